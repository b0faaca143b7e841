"""execd's command line: the flags, its own checks, the start baseline, and the server on the
socket the launcher already listens on."""

import argparse
import os
import signal
import socket
import sys
import threading

from .base import (
    _SHA256_HEX,
    BODY_DEADLINE,
    EXECD_PORT,
    EXECD_TOKEN_ENV,
    HEADER_TIMEOUT,
    MAX_CONNECTIONS,
    MAX_HEADER_BYTES,
    MAX_PREAUTH,
    NETGUARD_STATUS_ENV,
    NETGUARD_STATUS_PATH,
    PREAUTH_IDLE,
    TREE_MAX_BYTES,
    VERSION,
    WORKSPACE_ENV,
)
from .daemon import Daemon
from .reuse import (
    BASELINE_COPY_CAP,
    BASELINE_EXCLUDE,
    BASELINE_PACKAGES,
    BASELINE_PATHS,
    BASELINE_SCOPES,
    BASELINE_STORE,
    BASELINE_STORE_CAP,
    EXECD_BASELINE_ENV,
    EXECD_BASELINE_SCOPE_ENV,
    Baseline,
)
from .server import ConnBudget, Handler, Server, adopt_listener, parse_listen
from .snapshot import record_at_start, snapshot_args
from .wire import HTTPError


def baseline_args(p):
    p.add_argument("--baseline-at-start", choices=("on", "off"),
                   default="on" if os.environ.get(EXECD_BASELINE_ENV) == "on" else "off",
                   help="record the reuse baseline before serving (default: %s=on, which "
                        "the controller sets in grading pods)" % EXECD_BASELINE_ENV)
    p.add_argument("--baseline-store", default=BASELINE_STORE,
                   help="private dir (0700) for the baseline's file copies")
    p.add_argument("--baseline-paths", default=BASELINE_PATHS,
                   help="':'-separated system and home roots (~ is $HOME)")
    p.add_argument("--baseline-packages", default=BASELINE_PACKAGES,
                   help="':'-separated package roots (globs; dirs or files)")
    p.add_argument("--baseline-exclude", default=BASELINE_EXCLUDE,
                   help="':'-separated paths never watched (with --baseline-scope root: "
                        "the pod's scratch mounts)")
    scope = os.environ.get(EXECD_BASELINE_SCOPE_ENV) or "listed"
    p.add_argument("--baseline-scope", choices=BASELINE_SCOPES,
                   default=scope if scope in BASELINE_SCOPES else "invalid",
                   help="listed: the roots above; root: also the whole of --root except "
                        "/proc, /sys, /dev (not /dev/shm), the store, execd's own dir and "
                        "--baseline-exclude, watched without copies (default: $%s, "
                        "which the controller sets in grading pods, else listed)"
                        % EXECD_BASELINE_SCOPE_ENV)
    p.add_argument("--baseline-localtime", default="/etc/localtime")
    p.add_argument("--baseline-rerecord", action="store_true",
                   help="let POST /baseline replace an existing baseline (tests, local use)")
    p.add_argument("--baseline-copy-cap", type=int, default=BASELINE_COPY_CAP)
    p.add_argument("--baseline-store-cap", type=int, default=BASELINE_STORE_CAP)


def main(argv=None, listen_socket=None):
    """`listen_socket`: a socket the caller bound to --listen and listens on before importing
    this module (the pod's launcher): connections made while the imports run wait in its
    backlog, answered once execd serves, instead of being refused."""
    p = argparse.ArgumentParser(description="sandman execd")
    p.add_argument("--listen", default="0.0.0.0:%d" % EXECD_PORT)
    p.add_argument("--token-sha256", default=os.environ.get(EXECD_TOKEN_ENV))
    p.add_argument("--insecure-no-token", action="store_true",
                   help="serve without a token (tests only)")
    p.add_argument("--workspace", default=os.environ.get(WORKSPACE_ENV),
                   help="the shell's first cwd; /reset {\"workspace\": true} empties it")
    p.add_argument("--root", default="/", help="file routes refuse paths outside this dir")
    p.add_argument("--netguard-status",
                   default=os.environ.get(NETGUARD_STATUS_ENV, NETGUARD_STATUS_PATH))
    # Tests only: the directory /conditions reads as "/" (cgroup, mountinfo, passwd, zone).
    p.add_argument("--conditions-root", default="/", help=argparse.SUPPRESS)
    p.add_argument("--kill-grace", type=float, default=2.0,
                   help="unused, kept for old command lines: a killed command's processes "
                        "get no SIGTERM (docs/execd.md)")
    p.add_argument("--max-body", type=int, default=96 << 20, help="request size cap (bytes)")
    p.add_argument("--body-timeout", type=float, default=BODY_DEADLINE,
                   help="a request body must arrive within this many seconds")
    p.add_argument("--max-tree-bytes", type=int, default=TREE_MAX_BYTES,
                   help="size cap of a tree's tar, up or down (bytes)")
    # Tests only: small status reads split frames at chosen points.
    p.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS,
                   help="open connections (one thread each); over it a new one gets 503")
    p.add_argument("--max-preauth", type=int, default=MAX_PREAUTH,
                   help="connections not yet authenticated; over it the oldest is closed")
    p.add_argument("--max-header-bytes", type=int, default=MAX_HEADER_BYTES,
                   help="request line plus headers (431 above)")
    p.add_argument("--header-timeout", type=float, default=HEADER_TIMEOUT,
                   help="seconds from a request's first byte to the end of its headers")
    p.add_argument("--preauth-idle", type=float, default=PREAUTH_IDLE,
                   help="idle seconds allowed to a connection that has not authenticated")
    p.add_argument("--status-read-size", type=int, default=4096, help=argparse.SUPPRESS)
    p.add_argument("--verbose", action="store_true")
    baseline_args(p)
    snapshot_args(p)
    args = p.parse_args(argv)
    if args.token_sha256:
        args.token_sha256 = args.token_sha256.strip().lower()
        if not _SHA256_HEX.match(args.token_sha256):
            sys.stderr.write("execd: the token hash must be 64 hex characters\n")
            return 2
    elif args.insecure_no_token:
        args.token_sha256 = None
    else:
        sys.stderr.write("execd: no token hash (%s or --token-sha256); refusing to start "
                         "(--insecure-no-token overrides)\n" % EXECD_TOKEN_ENV)
        return 2
    if args.baseline_scope not in BASELINE_SCOPES:
        sys.stderr.write("execd: %s=%r: must be listed or root; refusing to start\n"
                         % (EXECD_BASELINE_SCOPE_ENV, os.environ.get(EXECD_BASELINE_SCOPE_ENV)))
        return 2
    host, port = parse_listen(args.listen)
    if args.workspace:
        args.workspace = os.path.realpath(args.workspace)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    try:
        daemon = Daemon(args)
    except OSError as e:
        sys.stderr.write("execd: %s; refusing to start\n" % (e,))
        return 2
    Handler.daemon = daemon
    daemon.baseline = Baseline(daemon, args)
    if args.baseline_at_start == "on":
        try:  # before serving: the first holder must not act before the baseline exists
            daemon.baseline.record()
        except (OSError, HTTPError) as e:
            sys.stderr.write("execd: no reuse baseline: %s\n" % (getattr(e, "message", e),))
    record_at_start(daemon, args)  # before serving too: no holder's change can be in it
    Server.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
    Server.budget = ConnBudget(args.max_connections, min(args.max_preauth,
                                                         args.max_connections))
    Server.listen_socket = adopt_listener(listen_socket, host, port)
    srv = Server((host, port), Handler)
    stopping = threading.Event()

    def stop(signum, frame):
        # Leave nothing behind: the shell and everything it started go with us. Calls still
        # answered say so, and nothing new is served: a suite killed by the pod's stop must
        # not read as its own death.
        daemon.stopping = True
        stopping.set()
        try:
            daemon.kill_sandbox()
        finally:
            os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    def reap_loop():
        while not stopping.wait(0.5):
            daemon.reaper.reap()

    threading.Thread(target=reap_loop, daemon=True).start()
    addr = srv.server_address
    sys.stderr.write("execd %s listening on %s:%d (pid %d, %s)\n" % (
        VERSION, addr[0], addr[1], os.getpid(), daemon.subreaper or "no subreaper"))
    sys.stderr.flush()
    threading.Thread(target=daemon.make_undumpable, daemon=True).start()
    try:
        srv.serve_forever(poll_interval=0.5)
    finally:
        daemon.kill_sandbox()
    return 0


if __name__ == "__main__":
    sys.exit(main())
