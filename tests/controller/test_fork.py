"""Fork's controller side against a hostile parent and children (no bed): the snapshot is data to
the controller, relayed byte for byte and never parsed, and its digest is checked before any
child gets a byte. A real HTTP server on loopback plays execd (the parent's /snapshot and the
children's /snapshot/apply, told apart by token); the books and the acquire path are a small
stand-in (the bed's tests in test_fork_on_testbed.py run the real ones)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

from controller import fork as F
from controller.books import State
from controller.errors import ForkFailed
from controller.requests import Requests
from sandman import contract, execd_api

ROOT = Path(__file__).resolve().parents[2]
PARENT = "parent-token"


class Execd(ThreadingHTTPServer):
    """`snapshot`: the bytes /snapshot answers (trailer included); every apply's (token,
    header digest, body) is kept; `refuse`: tokens whose apply answers 409."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.snapshot = b""
        self.applies: list[tuple[str, str, bytes]] = []
        self.refuse: set[str] = set()
        self.lock = threading.Lock()
        threading.Thread(target=self.serve_forever, daemon=True).start()


class _Handler(BaseHTTPRequestHandler):
    server: Execd

    def log_message(self, *a) -> None:
        pass

    def _token(self) -> str:
        return self.headers.get("Authorization", "").removeprefix("Bearer ")

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        assert self.path == execd_api.SNAPSHOT.path and self._token() == PARENT
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.server.snapshot)))
        self.end_headers()
        self.wfile.write(self.server.snapshot)

    def do_POST(self) -> None:  # noqa: N802
        assert self.path == execd_api.SNAPSHOT_APPLY.path
        body = self.rfile.read(int(self.headers["Content-Length"]))
        tok = self._token()
        with self.server.lock:
            self.server.applies.append((tok, self.headers[execd_api.TREE_SHA256_HEADER], body))
        if tok in self.server.refuse:
            out, code = b'{"error": "snapshot of another image"}', 409
        else:
            out, code = json.dumps({"files": 1, "deleted": 0, "bytes": len(body),
                                    "cwd": "/"}).encode(), 200
        self.send_response(code)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


class Ctl:
    """What the Forker asks of the controller: the parent's entry, acquires (each a child
    token on the same execd; `slow` makes them wait), releases."""

    def __init__(self, port: int, role: str = contract.ROLE_AGENT,
                 slow: tuple[float, ...] = ()):
        self.s = SimpleNamespace(execd_port=port, health_timeout=5.0, snapshot_base=True)
        spec = SimpleNamespace(role=role, image="img@sha256:" + "0" * 64)
        self.parent = SimpleNamespace(id="p", stage=State.LEASED, spec=spec, token=PARENT,
                                      ip="127.0.0.1", job="job", owner=None, labels={},
                                      lifetime=600.0, conditions=None)
        self.books = SimpleNamespace(entries={"p": self.parent})
        self.slow = slow  # seconds each acquire takes, in call order (default none)
        self.calls = 0
        self.acquired: list[str] = []
        self.released: list[str] = []
        self.tasks: set[asyncio.Task] = set()
        self.requests = Requests()

    def leased(self, cid: str) -> bool:
        return cid in self.acquired and cid not in self.released

    async def acquire(self, order) -> dict:
        assert order.spec is self.parent.spec and order.job == "job"
        i, self.calls = self.calls, self.calls + 1
        await asyncio.sleep(self.slow[i] if i < len(self.slow) else 0)
        cid = f"c{i}"
        self.acquired.append(cid)
        return {"id": cid, "address": "127.0.0.1", "token": f"tok-{cid}"}

    async def release(self, cid: str) -> bool:
        self.released.append(cid)
        return True

    def _spawn(self, coro, name: str) -> asyncio.Task:
        t = asyncio.get_running_loop().create_task(coro, name=name)
        self.tasks.add(t)
        return t


def framed(data: bytes, digest: str | None = None) -> bytes:
    return data + (digest or hashlib.sha256(data).hexdigest()).encode()


@pytest.fixture
def execd():
    srv = Execd()
    yield srv
    srv.shutdown()
    srv.server_close()


async def _fork(ctl: Ctl, n: int) -> list[dict]:
    f = F.Forker(ctl)  # type: ignore[arg-type]
    try:
        return await f.fork("p", n, 30.0)
    finally:
        await f.close()


def test_the_snapshot_is_relayed_byte_for_byte_never_parsed(execd):
    """Not a tar at all, names that would climb out of any root: the controller neither
    reads nor refuses them (the child's execd does); each child gets the same bytes."""
    data = b"../../etc/passwd\0" + os.urandom(3 << 20) + b"/proc/1/root"
    execd.snapshot = framed(data)
    ctl = Ctl(execd.server_address[1])
    kids = asyncio.run(_fork(ctl, 3))
    assert [k["id"] for k in kids] == ["c0", "c1", "c2"] and ctl.released == []
    assert sorted(t for t, _, _ in execd.applies) == ["tok-c0", "tok-c1", "tok-c2"]
    for _, sha, body in execd.applies:
        assert body == data and sha == hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("stream, why", [
    (framed(b"state" * 500, "f" * 64), "SHA-256"),
    (b"short", "SHA-256"),
    (framed(b"x" * 5000), "cap"),
])
def test_a_snapshot_that_is_not_what_its_trailer_says_reaches_no_child(execd, monkeypatch,
                                                                       stream, why):
    monkeypatch.setattr(F, "SNAPSHOT_ARCHIVE_MAX", 4096)
    execd.snapshot = stream
    ctl = Ctl(execd.server_address[1])
    with pytest.raises(ForkFailed, match=why) as err:
        asyncio.run(_fork(ctl, 3))
    assert "\n" not in str(err.value)
    assert execd.applies == []  # no child saw a byte
    assert sorted(ctl.released) == sorted(ctl.acquired)


def test_a_child_that_refuses_fails_the_fork_and_every_child_is_released(execd):
    execd.snapshot = framed(b"state")
    execd.refuse = {"tok-c1"}
    ctl = Ctl(execd.server_address[1])
    with pytest.raises(ForkFailed, match=r"child c1's execd answered 409") as err:
        asyncio.run(_fork(ctl, 3))
    assert "\n" not in str(err.value)
    assert sorted(ctl.released) == ["c0", "c1", "c2"]


def test_a_grading_sandbox_is_refused_before_anything_is_asked(execd):
    execd.snapshot = framed(b"state")
    ctl = Ctl(execd.server_address[1], role=contract.ROLE_GRADING)
    with pytest.raises(Exception, match="never forked"):
        asyncio.run(_fork(ctl, 1))
    assert ctl.acquired == [] and execd.applies == []


def test_a_cancelled_fork_releases_the_children_it_had(execd):
    """The caller leaves while children are still being acquired: those had are released by
    the undo, which the cancel does not interrupt."""
    execd.snapshot = framed(b"state")
    ctl = Ctl(execd.server_address[1], slow=(0.0, 30.0))

    async def run() -> None:
        f = F.Forker(ctl)  # type: ignore[arg-type]
        task = asyncio.ensure_future(f.fork("p", 2, 30.0))
        while not ctl.acquired:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.gather(*ctl.tasks)
        await f.close()

    asyncio.run(run())
    assert ctl.acquired == ["c0"] and ctl.released == ["c0"]


def test_the_controller_never_unpacks_an_archive():
    """No controller module reads tar members: the snapshot is only counted, hashed, relayed."""
    for p in sorted((ROOT / "controller").glob("*.py")):
        assert not re.search(r"^\s*(import|from)\s+tarfile\b", p.read_text(), re.M), p
