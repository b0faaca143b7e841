"""execd, the in-pod daemon that runs an agent's commands in one persistent bash: standard
library only, python3 >= 3.8, mounted read-only into unmodified task images (docs/execd.md).

One module per concern; `main` is the command line, `server` the HTTP side and its route
table, `daemon` the shell's owner. A module that only some requests need is imported by the
first of them where that saves CPU at every sandbox start.
"""

import sys

# execd never speaks TLS: keep http.client (imported by http.server) from loading OpenSSL, and
# use the builtin SHA-256 rather than hashlib's (base.py), for about 7 MiB less RSS in every
# sandbox. Here, because this runs before any module of the package.
sys.modules.setdefault("ssl", None)
