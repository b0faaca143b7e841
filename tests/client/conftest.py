"""Fixtures for the client SDK tests, all real processes and real HTTP on 127.0.0.1:

- `execd`: a real `execd/execd.py` process (testbed/execd.py) with a random token; it and
  everything it started are killed when the module is done (`fresh_execd`: one per test, for
  kill tests).
- `CutProxy`: a TCP proxy that forwards HTTP requests to execd and, on plan, drops the
  connection after forwarding a request (before or after execd answered) or flips a byte of
  the answer. It records every request it forwarded.
- `FakeController`: a minimal real HTTP server with the controller's acquire/release routes,
  handing out a real execd's address, until controller/ lands (end-to-end tests are the
  controller's).
- `flavor`: "sync" or "async". Test bodies are written once, as coroutines, against the
  async API; the sync flavor wraps the sync SDK objects so that every call runs the *sync*
  code path and returns an already-finished awaitable.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import secrets
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from sandman.client import (
    AsyncClient,
    AsyncSandbox,
    Client,
    Process,
    RetryPolicy,
    Sandbox,
    Session,
)
from testbed.execd import Execd, start_execd

LOOPBACK = "127.0.0.1"

# Short retries so that tests of give-up paths stay fast; still several attempts.
FAST_RETRY = RetryPolicy(attempts=4, backoff_s=0.05, backoff_max_s=0.2, budget_s=3.0,
                         connect_timeout_s=2.0)


# ---------------------------------------------------------------- execd (testbed/execd.py)


def _start(workdir: Path) -> Execd:
    # An empty HOME of its own: the machine's ~/.bashrc is not the image's (one that runs
    # `pyenv init` keeps an interactive bash, as `sandman shell` starts, from its prompt).
    home = workdir.parent / f"{workdir.name}-home"  # beside the workspace, not in it
    home.mkdir(parents=True)
    return start_execd(workdir, "--kill-grace", "0.2", env={"HOME": str(home)})


@pytest.fixture(scope="module")
def execd(tmp_path_factory) -> Execd:
    ex = _start(tmp_path_factory.mktemp("execd"))
    try:
        yield ex
    finally:
        ex.stop()


@pytest.fixture
def fresh_execd(tmp_path) -> Execd:
    ex = _start(tmp_path / "execd")
    try:
        yield ex
    finally:
        ex.stop()


# ---------------------------------------------------------------- a cutting TCP proxy


def _read_http(sock: socket.socket, buf: bytearray) -> bytes | None:
    """One HTTP/1.1 message with a Content-Length body (all execd and httpx send); None at EOF."""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        buf += chunk
    head_end = buf.index(b"\r\n\r\n") + 4
    m = re.search(rb"(?im)^content-length:\s*(\d+)\s*$", bytes(buf[:head_end]))
    total = head_end + (int(m.group(1)) if m else 0)
    while len(buf) < total:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        buf += chunk
    msg = bytes(buf[:total])
    del buf[:total]
    return msg


@dataclass
class Forwarded:
    method: str
    path: str
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class CutProxy:
    """Forwards 127.0.0.1:port to execd. `plan` entries are consumed by matching requests:
    ("after_answer", path): execd answers, the proxy drops the answer and both connections;
    ("before_answer", path): the proxy drops the client as soon as the request is forwarded;
    ("corrupt", path): one byte of the answer's body is flipped;
    ("hold", path): execd answers, the proxy sets `holding` and keeps the answer until
    `release` is set (for what a caller does while it waits)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream = (LOOPBACK, upstream_port)
        self.plan: list[tuple[str, str]] = []
        self.forwarded: list[Forwarded] = []
        self.connections = 0
        self.cuts = 0
        self._lock = threading.Lock()
        self._srv = socket.socket()
        self._srv.bind((LOOPBACK, 0))
        self._srv.listen(64)
        self.port = self._srv.getsockname()[1]
        self._stop = threading.Event()
        self.holding = threading.Event()
        self.release = threading.Event()
        self._threads: list[threading.Thread] = []
        t = threading.Thread(target=self._accept, daemon=True)
        t.start()
        self._threads.append(t)

    def _accept(self) -> None:
        self._srv.settimeout(0.2)
        while not self._stop.is_set():
            try:
                c, _ = self._srv.accept()
            except (TimeoutError, OSError):
                continue
            with self._lock:
                self.connections += 1
            t = threading.Thread(target=self._serve, args=(c,), daemon=True)
            t.start()
            self._threads.append(t)

    def _take(self, path: str) -> str | None:
        with self._lock:
            for i, (action, p) in enumerate(self.plan):
                if path.startswith(p):
                    del self.plan[i]
                    self.cuts += 1
                    return action
        return None

    def _serve(self, c: socket.socket) -> None:
        c.settimeout(60)
        try:
            u = socket.create_connection(self.upstream, timeout=60)
        except OSError:
            c.close()
            return
        cbuf, ubuf = bytearray(), bytearray()
        try:
            while not self._stop.is_set():
                req = _read_http(c, cbuf)
                if req is None:
                    return
                line = req.split(b"\r\n", 1)[0].decode("latin-1").split()
                body = req[req.index(b"\r\n\r\n") + 4:]
                with self._lock:
                    self.forwarded.append(Forwarded(line[0], line[1], body))
                action = self._take(line[1])
                u.sendall(req)
                if action == "before_answer":
                    c.shutdown(socket.SHUT_RDWR)
                    c.close()
                    _read_http(u, ubuf)  # let execd finish and answer into the void
                    return
                resp = _read_http(u, ubuf)
                if resp is None:
                    return
                if action == "after_answer":
                    return
                if action == "hold":
                    self.holding.set()
                    self.release.wait(60)
                if action == "corrupt":
                    head_end = resp.index(b"\r\n\r\n") + 4
                    if len(resp) > head_end:
                        b = bytearray(resp)
                        b[-1] ^= 0x01
                        resp = bytes(b)
                c.sendall(resp)
        except OSError:
            return
        finally:
            for s in (c, u):
                try:
                    s.close()
                except OSError:
                    pass

    def requests_to(self, path: str) -> list[Forwarded]:
        with self._lock:
            return [f for f in self.forwarded if f.path.startswith(path)]

    def close(self) -> None:
        self._stop.set()
        self.release.set()
        self._srv.close()
        for t in self._threads:
            t.join(5)


@pytest.fixture
def proxy(execd) -> CutProxy:
    p = CutProxy(execd.port)
    try:
        yield p
    finally:
        p.close()


# ---------------------------------------------------------------- a stand-in controller


@dataclass
class FakeController:
    """The controller's acquire/release routes, backed by a dict. `answers` queues canned
    (status, body) replies for POST /v1/sandboxes; `acquire_delay_s` and `release_delay_s`
    hold acquires and releases."""

    target: Execd
    target_port: int | None = None  # e.g. a proxy's port in front of the execd
    token: str | None = None  # hand out this token instead of the execd's
    answers: list[tuple[int, Any]] = field(default_factory=list)
    acquire_delay_s: float = 0.0
    release_delay_s: float = 0.0
    lifetime_s: float | None = None  # answered with each acquire: the SDK then renews
    # Per acquire body: (execd, times the pod was reused before) to hand out instead of
    # `target` (a reused, possibly poisoned pod for a reused_ok grading, a fresh one otherwise).
    pick: Callable[[dict[str, Any]], tuple[Execd, int]] | None = None
    shadows: list[tuple[str, str]] = field(default_factory=list)  # (id, outcome) reported
    renew_answers: list[tuple[int, Any]] = field(default_factory=list)  # canned renew replies
    sandboxes: dict[str, dict[str, Any]] = field(default_factory=dict)
    by_request: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)  # request_id
    requests: list[tuple[str, str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    port: int = 0
    url: str = ""

    def calls(self, method: str, prefix: str = "/v1/sandboxes") -> list[tuple[str, str, Any]]:
        with self.lock:
            return [r for r in self.requests if r[0] == method and r[1].startswith(prefix)]


def _error(status: int, typ: str, msg: str, events: list[str] | None = None):
    return status, {"error": {"type": typ, "message": msg, "events": events or []}}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    ctl: FakeController

    def log_message(self, *a) -> None:
        pass

    def _reply(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> Any:
        n = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(n)) if n else None

    def _client_left(self) -> bool:
        self.connection.setblocking(False)
        try:
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True
        finally:
            self.connection.setblocking(True)

    def _record(self, body: Any) -> None:
        with self.ctl.lock:
            self.ctl.requests.append((self.command, self.path, body))

    def do_POST(self) -> None:
        body = self._body()
        self._record(body)
        ctl = self.ctl
        if self.path == "/v1/prewarm":
            return self._reply(200, {"target": body["count"], "warm": 0,
                                     "building": body["count"], "idle_timeout_s": 300.0})
        m = re.fullmatch(r"/v1/jobs/([^/]+)/drain", self.path)
        if m:
            with ctl.lock:
                gone = [k for k, v in ctl.sandboxes.items() if v["job"] == m.group(1)]
                for k in gone:
                    del ctl.sandboxes[k]
            return self._reply(200, {"job": m.group(1), "deleting": len(gone)})
        m = re.fullmatch(r"/v1/sandboxes/([^/]+)/retire", self.path)
        if m:
            with ctl.lock:
                existed = ctl.sandboxes.pop(m.group(1), None) is not None
            return self._reply(200, {"id": m.group(1), "released": existed, "reused": False})
        m = re.fullmatch(r"/v1/sandboxes/([^/]+)/shadow", self.path)
        if m:
            # As the controller: counted; a contradicted pod is deleted, an agreeing one goes
            # back to its pool.
            with ctl.lock:
                ctl.shadows.append((m.group(1), body["outcome"]))
                existed = ctl.sandboxes.pop(m.group(1), None) is not None
            return self._reply(200, {"id": m.group(1), "released": existed,
                                     "reused": existed and body["outcome"] == "agree"})
        m = re.fullmatch(r"/v1/sandboxes/([^/]+)/renew", self.path)
        if m:
            with ctl.lock:
                canned = ctl.renew_answers.pop(0) if ctl.renew_answers else None
                sb = ctl.sandboxes.get(m.group(1))
            if canned is not None:
                return self._reply(*canned)
            if sb is None:
                return self._reply(*_error(404, "SandboxGone", "no such sandbox"))
            lifetime = (body or {}).get("lifetime_s") or ctl.lifetime_s
            return self._reply(200, dict(sb, lifetime_s=lifetime, expires_at=time.strftime(
                "%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + lifetime))))
        if self.path != "/v1/sandboxes":
            return self._reply(*_error(404, "BadRequest", "no such route"))
        if ctl.acquire_delay_s:
            time.sleep(ctl.acquire_delay_s)
        with ctl.lock:
            canned = ctl.answers.pop(0) if ctl.answers else None
        if canned is not None:
            return self._reply(*canned)
        # As the controller: a repeat of a request_id gets the first attempt's sandbox (waiting
        # for it if the first is still being served), as long as that sandbox is leased.
        key = (body["job"], body.get("request_id"))
        with ctl.lock:
            first = ctl.by_request.get(key) if key[1] is not None else None
            if first is None and key[1] is not None:
                ctl.by_request[key] = mine = {"done": threading.Event()}
            else:
                mine = None
        if first is not None:
            first["done"].wait(10)
            answer = first.get("answer")
            if answer is not None and answer["id"] in ctl.sandboxes:
                return self._reply(201, answer)
        sid = "sb-" + secrets.token_hex(4)
        target, reuses = ctl.pick(body) if ctl.pick else (ctl.target, 0)
        # What the controller writes for a sandbox (sandman.api.SandboxView), all of it.
        sb = {"id": sid, "pod": f"pod-{sid}", "job": body["job"], "state": "leased",
              "address": target.address, "port": ctl.target_port or target.port,
              "image": body["image"], "cpu": body["cpu"], "memory": body["memory"],
              "egress": body["egress"]}
        answer = dict(sb, token=ctl.token or target.token, warm=bool(reuses),
                      timings={"queued_ms": 1.5, "create_ms": 20, "ready_ms": 30.25})
        if reuses:
            answer["reuses"] = reuses
        if ctl.lifetime_s:
            answer.update(lifetime_s=ctl.lifetime_s, expires_at="2026-01-01T00:00:00Z")
        with ctl.lock:
            ctl.sandboxes[sid] = sb
        if mine is not None:
            mine["answer"] = answer
            mine["done"].set()
        self._reply(201, answer)

    def do_DELETE(self) -> None:
        self._record(None)
        if self.ctl.release_delay_s:
            time.sleep(self.ctl.release_delay_s)
            if self._client_left():  # as a proxy would: the release is lost, not applied
                self.close_connection = True
                return
        path, _, query = self.path.partition("?")
        sid = path.rsplit("/", 1)[-1]
        with self.ctl.lock:
            existed = self.ctl.sandboxes.pop(sid, None) is not None
        # As the controller: reuse=true puts a (grading) pod back in its pool.
        self._reply(200, {"id": sid, "released": existed,
                          "reused": existed and "reuse=true" in query.split("&")})

    def do_GET(self) -> None:
        self._record(None)
        path, _, query = self.path.partition("?")
        with self.ctl.lock:
            if path == "/v1/sandboxes":
                job = query.partition("job=")[2] or None
                items = [s for s in self.ctl.sandboxes.values() if job in (None, s["job"])]
                return self._reply(200, {"items": items})
            sb = self.ctl.sandboxes.get(path.rsplit("/", 1)[-1])
        if sb is None:
            return self._reply(*_error(404, "SandboxGone", "no such sandbox"))
        self._reply(200, sb)


@pytest.fixture
def controller(execd) -> FakeController:
    ctl = FakeController(target=execd)
    handler = type("Handler", (_Handler,), {"ctl": ctl})
    srv = ThreadingHTTPServer((LOOPBACK, 0), handler)
    srv.daemon_threads = True
    ctl.port = srv.server_address[1]
    ctl.url = f"http://{LOOPBACK}:{ctl.port}"
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    t.start()
    try:
        yield ctl
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(5)


def _git_quiet(repo: Any, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


class _FreshPodHandler(_Handler):
    """The stand-in controller, plus: every acquire hands out a "never-used pod", i.e. the
    registered repositories are reset to their base first (one real execd serves all)."""

    def do_POST(self) -> None:
        if self.path == "/v1/sandboxes":
            for repo in list(getattr(self.ctl, "repos", [])):
                _git_quiet(repo, "reset", "-q", "--hard")
                _git_quiet(repo, "clean", "-fdxq")
        super().do_POST()


@pytest.fixture
def make_controller():
    servers = []

    def make(target: Execd, *repos: Path) -> FakeController:
        ctl = FakeController(target=target)
        ctl.repos = list(repos)  # type: ignore[attr-defined]
        srv = ThreadingHTTPServer((LOOPBACK, 0),
                                  type("H", (_FreshPodHandler,), {"ctl": ctl}))
        srv.daemon_threads = True
        ctl.url = f"http://{LOOPBACK}:{srv.server_address[1]}"
        threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.1},
                         daemon=True).start()
        servers.append(srv)
        return ctl

    try:
        yield make
    finally:
        for srv in servers:
            srv.shutdown()
            srv.server_close()



# ---------------------------------------------------------------- sync and async, one body


async def _done(value: Any) -> Any:
    return value


class SyncedIter:
    """A sync generator behind `async for`: each step runs the sync code path; `aclose()`
    closes the generator, as leaving an async generator's loop early does."""

    def __init__(self, gen: Any) -> None:
        self._gen = gen

    def __aiter__(self) -> SyncedIter:
        return self

    async def __anext__(self) -> Any:
        try:
            return next(self._gen)
        except StopIteration:
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        self._gen.close()


class Synced:
    """A sync SDK object behind the async interface: a call runs the sync method at once and
    returns an awaitable of its result (errors raise at the call, inside the same block)."""

    _renames = {"aclose": "close"}

    def __init__(self, obj: Any) -> None:
        self._obj = obj

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._obj, self._renames.get(name, name))
        if not callable(attr):
            return attr

        def call(*args: Any, **kw: Any) -> Any:
            result = attr(*args, **kw)
            if isinstance(result, (Sandbox, Client, Process, Session)):
                result = Synced(result)
            if isinstance(result, list) and all(isinstance(r, (Process, Session))
                                                for r in result):
                result = [Synced(r) for r in result]  # sb.processes(), sb.sessions()
            if inspect.isgenerator(result):
                return SyncedIter(result)  # `async for` over the sync twin's generator
            return _done(result)

        return call

    async def __aenter__(self) -> Synced:
        self._obj.__enter__()
        return self

    async def __aexit__(self, *exc: Any) -> Any:
        return self._obj.__exit__(*exc)

    def __repr__(self) -> str:
        return repr(self._obj)


@dataclass
class Flavor:
    name: str

    @property
    def is_async(self) -> bool:
        return self.name == "async"

    def client(self, url: str, **kw: Any) -> Any:
        kw.setdefault("retry", FAST_RETRY)
        return AsyncClient(url, **kw) if self.is_async else Synced(Client(url, **kw))

    def connect(self, ex: Execd, *, port: int | None = None, token: str | None = None,
                **kw: Any) -> Any:
        kw.setdefault("retry", FAST_RETRY)
        args = (ex.address, port or ex.port, ex.token if token is None else token)
        if self.is_async:
            return AsyncSandbox.connect(*args, **kw)
        return Synced(Sandbox.connect(*args, **kw))

    def run(self, body: Callable[[], Coroutine[Any, Any, Any]], timeout_s: float = 30) -> Any:
        async def bounded() -> Any:
            return await asyncio.wait_for(body(), timeout_s)

        return asyncio.run(bounded())


@pytest.fixture(params=["sync", "async"])
def flavor(request) -> Flavor:
    return Flavor(request.param)
