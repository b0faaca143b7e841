"""What every part of execd shares: its version, the copies of sandman's contract names (execd
cannot import sandman.contract; a test keeps them equal), the request defaults and limits, and
the stdlib SHA-256 without OpenSSL."""

import re
import threading
import time

try:
    from _sha256 import sha256  # noqa: F401  python <= 3.11
except ImportError:
    try:
        from _sha2 import sha256  # noqa: F401  python >= 3.12
    except ImportError:
        from hashlib import sha256  # noqa: F401
try:
    from _operator import _compare_digest as compare_digest  # noqa: F401  what hmac uses without OpenSSL
except ImportError:
    from hmac import compare_digest  # noqa: F401


VERSION = "0.2.0"

# Copies of sandman/contract.py (execd cannot import it); a test keeps them equal.
EXECD_PORT = 9470
EXECD_PATH = "/sandman/execd.py"
EXECD_TOKEN_ENV = "SANDMAN_TOKEN_SHA256"
NETGUARD_STATUS_PATH = "/sandman/run/netguard.json"
EXECD_READY_PATH = "/ready"

NETGUARD_STATUS_ENV = "SANDMAN_NETGUARD_STATUS"
WORKSPACE_ENV = "SANDMAN_WORKSPACE"
INSTANCE_ENV = "SANDMAN_EXECD_INSTANCE"
# The shell exports this variable (value: instance-call) to every process a call starts, so a timeout or a
# reset finds it again even after it double-forked or called setsid.
TAG_VAR = "__SANDMAN_CALL"
DEFAULT_TIMEOUT = 300.0
DEFAULT_MAX_OUTPUT = 102400
MAX_OUTPUT_LIMIT = 64 << 20
CACHE_BYTES = 8 << 20  # stored answers for request_id retries
IDLE_TIMEOUT = 180.0  # keep-alive idle limit; callers pool connections for minutes
# A stream's client that takes longer than this to accept one chunk is gone: the command's
# loop (timeouts, kills) must not wait on a stalled reader.
STREAM_SEND_TIMEOUT = 10.0
# Pre-auth budget: what a client without the token can pin (connections, threads, header bytes,
# time). The agent's connections are never refused for the sake of unauthenticated ones: those
# are capped below the total and the oldest is shed to admit a new one.
MAX_CONNECTIONS = 64  # connections (one thread each), authenticated or not
MAX_PREAUTH = 16  # of which not (yet) authenticated
MAX_HEADER_BYTES = 32 << 10  # request line and headers together
HEADER_TIMEOUT = 10.0  # from a request's first byte to the end of its headers
PREAUTH_IDLE = 10.0  # idle limit of a connection that has not authenticated
BODY_DEADLINE = 30.0  # a request body must arrive within this (slow clients get 408)
# Read as bash and the dynamic loader start, before any command of ours runs.
SHELL_STARTUP_VARS = ("BASH_ENV", "ENV", "LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT")
PIPE_SIZE = 1 << 20
READ_SIZE = 1 << 20
PR_SET_CHILD_SUBREAPER = 36
PR_SET_DUMPABLE = 4
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def now():
    return time.monotonic()


class Activity(object):
    """When the holder last used this execd: requests in flight, and the monotonic time the
    last one ended. The controller's idle rule reads it (`GET /activity`); its own reads
    (QUIET_ROUTES) are not activity, so reading never keeps a sandbox alive."""

    def __init__(self):
        self.lock = threading.Lock()
        self.busy = 0
        self.last = now()

    def begin(self):
        with self.lock:
            self.busy += 1

    def end(self):
        with self.lock:
            self.busy -= 1
            self.last = now()

    def read(self):
        """`idle_s` is 0 while a request runs: a long command is never idle."""
        with self.lock:
            idle = 0.0 if self.busy else max(0.0, now() - self.last)
            return {"idle_s": round(idle, 3), "busy": self.busy}


def sh_quote(data):
    return b"'" + data.replace(b"'", b"'\\''") + b"'"
TREE_MAX_BYTES = 1 << 30  # a tree's whole archive, up or down; --max-tree-bytes
