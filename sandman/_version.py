"""The one version of both distributions, `sandman-client` (client/pyproject.toml) and
`sandman` (pyproject.toml): each reads it at build time (setuptools `attr:`), and the server's
`sandman-client==` pin is checked against it (tests/test_distributions.py). Shipped by the
client distribution; `sandman` is a namespace package (PEP 420) shared by both."""

__version__ = "0.2.0"
