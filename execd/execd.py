"""execd's entry point: `python3 -I -S /sandman/execd.py --listen HOST:PORT` in a pod,
`python3 execd/execd.py --listen ...` from a checkout (docs/execd.md has the flags and the API).

The daemon is the package `execd_daemon` beside this file, imported rather than run as a
script: Python never uses compiled bytecode for a script, and compiling the daemon is ~40 ms of
CPU at every sandbox start, 0.4 s under a 100m quota.

This file listens on --listen before those imports (~50 ms of CPU, ~0.4 s under a 100m quota on
the real node): a probe or the controller's /ready that arrives once the interpreter is up waits
in the backlog and is answered when execd serves, instead of being refused and retried a period
later. Anything unexpected leaves the bind to execd, which reports its own errors.

Standard library only, python3 >= 3.8, like the daemon.
"""

import os
import socket
import sys


def listen(argv):
    """A TCP socket listening on --listen's HOST:PORT, or None."""
    try:
        host, _, port = argv[argv.index("--listen") + 1].rpartition(":")
        host = host[1:-1] if host.startswith("[") else host
        s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    except (ValueError, IndexError, OSError):
        return None
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, int(port)))
        s.listen(128)
        return s
    except (ValueError, OSError):
        s.close()
        return None


if __name__ == "__main__":
    sock = listen(sys.argv[1:])
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from execd_daemon.main import main

    sys.exit(main(listen_socket=sock))
