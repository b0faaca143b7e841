"""Per-connection bounds of the real `python -m webhook serve`, played with raw TLS sockets on
127.0.0.1: a review above --max-body-bytes is answered 413 without being read, and a request
that trickles in (headers or body) loses its connection after --request-read-seconds, while
well-behaved reviews keep being answered meanwhile (issue 13: two clients sending 2 MB reviews
raised every review's latency from 2 ms to 0.5-1.3 s; slow senders held connection slots)."""

from __future__ import annotations

import json
import socket
import ssl
import time
from pathlib import Path

import pytest

from testbed.webhook import start_webhook

TESTDATA = Path(__file__).parent / "testdata"
MAX_BODY = 256 * 1024
READ_SECONDS = 1.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    wh = start_webhook(tmp_path_factory.mktemp("bounded"), "--max-body-bytes", str(MAX_BODY),
                       "--request-read-seconds", str(READ_SECONDS))
    yield wh
    wh.stop()


def _connect(server) -> ssl.SSLSocket:
    ctx = ssl.create_default_context(cafile=str(server.ca))
    raw = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return ctx.wrap_socket(raw, server_hostname="127.0.0.1")


def _response(s: ssl.SSLSocket) -> tuple[int, dict, bytes]:
    f = s.makefile("rb")
    status = int(f.readline().split()[1])
    headers = {}
    while True:
        line = f.readline()
        if line in (b"\r\n", b""):
            break
        k, v = line.decode().split(":", 1)
        headers[k.strip().lower()] = v.strip()
    return status, headers, f.read(int(headers.get("content-length", 0)))


def _closed_by_server(s: ssl.SSLSocket, within: float) -> bool:
    """True once the server closed the connection (EOF or reset), waiting at most `within`."""
    deadline = time.monotonic() + within
    s.settimeout(0.2)
    while time.monotonic() < deadline:
        try:
            if s.recv(4096) == b"":
                return True
        except TimeoutError:
            continue
        except (ConnectionError, ssl.SSLError, OSError):
            return True
    return False


def _review_bytes() -> bytes:
    body = (TESTDATA / "validate-mutated-pod-allowed.json").read_bytes()
    return (b"POST /validate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def test_declared_oversize_answered_413_unread(server):
    with _connect(server) as s:
        # Only the headers: the server must answer without waiting for 2 MiB that never come.
        s.sendall(b"POST /validate HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 2097152\r\n\r\n")
        status, headers, body = _response(s)
        assert status == 413, body
        assert f"larger than {MAX_BODY} bytes" in json.loads(body)["error"]
        assert headers.get("connection") == "close"
        assert _closed_by_server(s, 5)


def test_chunked_oversize_cut_at_the_bound(server):
    with _connect(server) as s:
        s.sendall(b"POST /mutate HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"x" * 65536
        sent = 0
        try:
            while sent <= MAX_BODY + len(chunk):
                s.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
                sent += len(chunk)
        except (ConnectionError, ssl.SSLError):
            pass  # the server answered and closed while we were still sending
        status, _, body = _response(s)
        assert status == 413, body


def test_slow_senders_lose_their_connection_and_hold_no_one_up(server):
    slow = []
    try:
        for i in range(20):
            s = _connect(server)
            if i % 2:  # headers that never end
                s.sendall(b"POST /validate HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            else:  # a body that never ends
                s.sendall(b"POST /validate HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                          b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{")
            slow.append(s)
        # Meanwhile a review sent whole is answered.
        with _connect(server) as s:
            s.sendall(_review_bytes())
            status, _, body = _response(s)
            assert status == 200 and json.loads(body)["response"]["allowed"] is True, body
        # Each slow connection is closed by the server once its request is overdue.
        open_after = [i for i, s in enumerate(slow) if not _closed_by_server(s, READ_SECONDS + 10)]
        assert not open_after, f"still open after {READ_SECONDS + 10:g} s: {open_after}"
    finally:
        for s in slow:
            s.close()


@pytest.mark.slow
def test_a_kept_alive_connection_keeps_working(server):
    """The deadline is per request: a client that sends whole requests on one connection, with
    pauses longer than the deadline between them, is not cut."""
    with _connect(server) as s:
        for _ in range(2):
            s.sendall(_review_bytes())
            status, _, _ = _response(s)
            assert status == 200
            time.sleep(READ_SECONDS * 1.5)
        s.sendall(_review_bytes())
        assert _response(s)[0] == 200
