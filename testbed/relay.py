"""A TCP relay from an address pods can reach to one only this machine can: the real node's
pods reach the node IP but never the host's loopback, where the local registry listens
(testbed/registry.py). The installed controller stores checkpoints through it.

    relay = Relay(rn.node_ip, "127.0.0.1", reg.port).start()   # relay.port on the node IP
    ...
    relay.stop()

Threads of the calling process: nothing outlives it."""

from __future__ import annotations

import contextlib
import socket
import threading


class Relay:
    def __init__(self, listen_host: str, to_host: str, to_port: int) -> None:
        self.listen_host, self.to = listen_host, (to_host, to_port)
        self.port = 0
        self._sock: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()

    def start(self) -> Relay:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((self.listen_host, 0))
        s.listen(64)
        self._sock, self.port = s, s.getsockname()[1]
        threading.Thread(target=self._accept, name="relay-accept", daemon=True).start()
        return self

    def _accept(self) -> None:
        while self._sock is not None:
            try:
                a, _ = self._sock.accept()
            except OSError:
                return
            try:
                b = socket.create_connection(self.to, timeout=10)
            except OSError:
                a.close()
                continue
            b.settimeout(None)
            with self._lock:
                self._conns |= {a, b}
            left = [2]  # pipes of this pair still running; the last one closes both
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self._pipe, args=(src, dst, left), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, left: list[int]) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        # Half-close: the other direction may still be sending its answer.
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
        with self._lock:
            left[0] -= 1
            if left[0] == 0:
                for s in (src, dst):
                    self._conns.discard(s)
                    s.close()

    def stop(self) -> None:
        s, self._sock = self._sock, None
        if s is not None:
            s.close()
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for c in conns:
            with contextlib.suppress(OSError):
                c.close()
