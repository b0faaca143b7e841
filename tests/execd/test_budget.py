"""Pre-auth budget (issue 15): what a client without the token can pin is bounded in connections
(and so threads), header bytes, header time and idle time, and never starves the agent.

Real sockets on 127.0.0.1; every loop is bounded in count and time. The size limits are the
defaults; the time limits are execd's flags with small values (the defaults are 10 s each). Each
test also fails on an execd without the budget.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from execd.execd_daemon import base

from .conftest import AUTH, TOKEN

FLOOD = 300  # unauthenticated connections, each holding 30 kB of unfinished headers


def threads_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


def closed_by_peer(s: socket.socket, within: float) -> tuple[bool, bytes]:
    """Reads until EOF (True) or `within` seconds pass (False); the bytes received."""
    got = b""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        s.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            break
        except OSError:
            return True, got
        if not chunk:
            return True, got
        got += chunk
    return False, got


def one_response(s: socket.socket, req: bytes) -> int | None:
    """Sends one request, reads one response on the same connection; its status or None."""
    try:
        s.sendall(req)
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = s.recv(65536)
            if not chunk:
                return None
            buf += chunk
        head, _, body = buf.partition(b"\r\n\r\n")
        n = 0
        for ln in head.split(b"\r\n")[1:]:
            k, _, v = ln.partition(b":")
            if k.strip().lower() == b"content-length":
                n = int(v)
        while len(body) < n:
            chunk = s.recv(65536)
            if not chunk:
                return None
            body += chunk
        return int(head.split()[1])
    except OSError:
        return None


def test_preauth_flood_bounds_threads_and_rss_and_agent_still_served(execd):
    base_threads = threads_of(execd.pid)
    base_rss = execd.rss_kib()
    socks = []
    try:
        for _ in range(FLOOD):
            s = socket.create_connection(("127.0.0.1", execd.port), timeout=5)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 30000)
            socks.append(s)
        time.sleep(1.0)  # let execd accept and read them all
        threads = threads_of(execd.pid)
        rss = execd.rss_kib()
        # The agent, on a new connection, in the middle of the flood.
        with httpx.Client(base_url=execd.url, headers=AUTH, timeout=30) as c:
            r = c.post("/exec", json={"command": "echo ok"})
        assert r.status_code == 200 and r.json()["output"] == "ok\n", r.text
    finally:
        for s in socks:
            s.close()
    print(f"threads {base_threads} -> {threads}, rss {base_rss} -> {rss} KiB")
    assert threads - base_threads <= base.MAX_PREAUTH + 2, (base_threads, threads)
    assert rss - base_rss < 8 * 1024, (base_rss, rss)


def test_header_block_bounded_in_total_bytes(execd):
    # 40 lines of 1 kB: each far under the stdlib's 64 kB per line, together over the budget.
    pad = b"".join(b"X-Pad-%d: %s\r\n" % (i, b"a" * 1000) for i in range(40))
    with socket.create_connection(("127.0.0.1", execd.port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + pad + b"\r\n")
        closed, got = closed_by_peer(s, 10)
    assert got.startswith(b"HTTP/1.1 431 "), got[:200]
    assert closed
    # Headers within the budget still work, body and keep-alive included.
    small = {f"X-Pad-{i}": "a" * 1000 for i in range(8)}
    with httpx.Client(base_url=execd.url, headers={**AUTH, **small}, timeout=30) as c:
        for _ in range(3):
            r = c.post("/exec", json={"command": "echo ok"})
            assert r.status_code == 200 and r.json()["output"] == "ok\n"


# Each well above the drip's 0.5 s between header lines, so only the header timeout ends it.
HEADER_TIMEOUT = 2.0
PREAUTH_IDLE = 2.0


@pytest.mark.slow
def test_header_time_and_preauth_idle_bounded_authed_idle_kept(execd_factory):
    execd = execd_factory("--header-timeout", str(HEADER_TIMEOUT),
                          "--preauth-idle", str(PREAUTH_IDLE))
    results: dict[str, tuple[bool, float, bytes]] = {}
    limit = HEADER_TIMEOUT + PREAUTH_IDLE

    def drip():
        # One header line every 0.5 s: each read is quick, the block never ends.
        t0 = time.monotonic()
        with socket.create_connection(("127.0.0.1", execd.port), timeout=5) as s:
            s.sendall(b"GET /health HTTP/1.1\r\n")
            got = b""
            for i in range(int(limit * 2) + 8):  # bounded: about limit + 4 s
                try:
                    s.sendall(b"X-%d: a\r\n" % i)
                except OSError:
                    break
                closed, more = closed_by_peer(s, 0.5)
                got += more
                if closed:
                    results["drip"] = (True, time.monotonic() - t0, got)
                    return
        results["drip"] = (False, time.monotonic() - t0, got)

    def idle_unauth():
        t0 = time.monotonic()
        with socket.create_connection(("127.0.0.1", execd.port), timeout=5) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            closed, got = closed_by_peer(s, limit + 4)
        results["idle"] = (closed, time.monotonic() - t0, got)

    def idle_authed():
        # On one raw socket, so a silent reconnect cannot hide a close.
        req = (b"GET /state HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n\r\n"
               % TOKEN.encode())
        with socket.create_connection(("127.0.0.1", execd.port), timeout=10) as s:
            first = one_response(s, req)
            time.sleep(limit + 2)
            second = one_response(s, req)
        results["authed"] = (first == second == 200, 0.0, b"%r %r" % (first, second))

    ts = [threading.Thread(target=f) for f in (drip, idle_unauth, idle_authed)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(limit * 2 + 30)
    closed, took, got = results["drip"]
    assert closed and took <= HEADER_TIMEOUT + 2, (took, got[:200])
    assert got.startswith(b"HTTP/1.1 408 "), got[:200]
    closed, took, got = results["idle"]
    assert got.startswith(b"HTTP/1.1 200 ")
    assert closed and took <= PREAUTH_IDLE + 2, took
    assert results["authed"][0], results["authed"]


def test_connection_cap_sheds_unauthenticated_first_then_refuses_503(execd_factory):
    d = execd_factory("--max-connections", "4", "--max-preauth", "2")
    clients = [httpx.Client(base_url=d.url, headers=AUTH, timeout=10,
                            limits=httpx.Limits(max_connections=1)) for _ in range(3)]
    socks = []
    try:
        for c in clients:  # three authenticated keep-alive connections
            assert c.get("/state").status_code == 200
        # Unauthenticated ones: one slot left; each new one sheds the one before.
        for _ in range(5):
            socks.append(socket.create_connection(("127.0.0.1", d.port), timeout=5))
            time.sleep(0.1)
        assert all(closed_by_peer(s, 2)[0] for s in socks[:-1])
        assert not closed_by_peer(socks[-1], 0.5)[0]
        # The authenticated ones were never shed.
        for c in clients:
            assert c.post("/exec", json={"command": "true"}).status_code == 200
        counts = clients[0].get("/state").json()["connections"]
        assert counts["shed"] >= 4 and counts["preauth"] == 1 and counts["connections"] == 4, \
            counts
        # A fourth authenticated connection takes the last slot, then a fifth is refused.
        fourth = httpx.Client(base_url=d.url, headers=AUTH, timeout=10)
        clients.append(fourth)
        assert fourth.get("/state").status_code == 200
        with socket.create_connection(("127.0.0.1", d.port), timeout=5) as s:
            closed, got = closed_by_peer(s, 5)
        assert closed and got.startswith(b"HTTP/1.1 503 "), got
    finally:
        for c in clients:
            c.close()
        for s in socks:
            s.close()
