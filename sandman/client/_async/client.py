"""`AsyncClient`: the controller's acquire/release API. Mirrors
`sandman/client/_sync/client.py`; change both together."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import httpx

from sandman.client import _core
from sandman.client._async.sandbox import AsyncSandbox, _keep
from sandman.client._core import RetryPolicy
from sandman.client.errors import ControllerUnreachable, NotLeader, SandboxGone, SandmanError
from sandman.client.models import Lease, Owner, PoolStatus, SandboxInfo

log = logging.getLogger("sandman.client")

# aclose() waits this long for releases still running in the background.
_CLOSE_WAIT_S = 60.0


class AsyncClient:
    """The controller at `url` (e.g. "http://sandman-controller:8080").

    Leaving `async with AsyncClient(...)` (or aclose()) releases every sandbox acquired
    through it that was not released yet, so a crashed rollout loop does not leave pods
    behind. An acquire whose caller is cancelled runs on, and the sandbox it gets is released
    (the paper's cancelled-create leak: a cancelled caller must not orphan its pod)."""

    def __init__(self, url: str, *, timeout_s: float = 30.0, retry: RetryPolicy | None = None,
                 file_timeout_s: float = 120.0,
                 transport: httpx.AsyncBaseTransport | None = None,
                 execd_transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.url = url.rstrip("/")
        self._timeout_s = timeout_s
        self._retry = retry or RetryPolicy()
        self._file_timeout_s = file_timeout_s
        self._execd_transport = execd_transport
        if transport is None:
            transport = httpx.AsyncHTTPTransport(socket_options=_core.SOCKET_OPTIONS)
        self._http = httpx.AsyncClient(base_url=self.url, transport=transport, trust_env=False,
                                       headers={"User-Agent": _core.USER_AGENT})
        self._live: dict[str, AsyncSandbox] = {}  # acquired here, not (confirmed) released
        self._pending: set[asyncio.Task[Any]] = set()  # acquires/releases of cancelled callers
        self._closed = False

    def __repr__(self) -> str:
        return f"AsyncClient(url={self.url!r}, live={len(self._live)})"

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Release the sandboxes still held through this client, then close. A release that
        fails is logged (with the sandbox id) and the others still go."""
        self._closed = True
        if self._pending:  # acquires of cancelled callers: their sandboxes join _live
            await asyncio.wait(set(self._pending), timeout=_CLOSE_WAIT_S)
        for sb in list(self._live.values()):
            try:
                await sb.release()
            except SandmanError as e:
                log.warning("sandbox %s: release at client close failed: %s", sb.id, e)
        await self._http.aclose()

    # ---- the API

    async def acquire(self, image: str, *, job: str, cpu: str | int | float = "2",
                      memory: str = "8Gi", egress: str = "deny", workspace: str | None = None,
                      owner: Owner | Mapping[str, str] | None = None,
                      labels: Mapping[str, str] | None = None, timeout_s: float = 300,
                      warm_ok: bool = True, wait: bool = True) -> AsyncSandbox:
        """A ready sandbox from `image`, sized `cpu`/`memory` (requests equal limits).
        `timeout_s` bounds the wait for it, image pull included (AcquireTimeout).

        Every attempt carries one request_id, so an attempt whose answer was lost is retried
        and the controller answers it with the first attempt's sandbox, not a second one. Only
        if the controller itself was replaced in between can a retry get a second sandbox;
        the first then stays leased under the job until `drain` (docs/sdk.md)."""
        if self._closed:
            raise SandmanError("client is closed")
        body = _core.acquire_body(image=image, cpu=cpu, memory=memory, workspace=workspace,
                                  egress=egress, job=job, owner=owner, labels=labels,
                                  timeout_s=timeout_s, warm_ok=warm_ok, wait=wait)
        task = _keep(asyncio.ensure_future(self._acquire(body, float(timeout_s))))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            # The controller may still hand out the sandbox: own it, release it when it comes.
            self._pending.add(task)
            task.add_done_callback(self._release_orphan)
            raise

    async def _acquire(self, body: dict[str, Any], timeout_s: float) -> AsyncSandbox:
        resp = await self._send("POST", "/v1/sandboxes", json=body,
                                read_s=timeout_s + _core.ACQUIRE_ANSWER_GRACE_S)
        lease = Lease.from_json(_core.decode_json(resp, "acquire"))
        sb = AsyncSandbox(lease.address, lease.port, lease.token, id=lease.id, pod=lease.pod,
                          warm=lease.warm, timings=lease.timings, retry=self._retry,
                          job=body["job"],
                          file_timeout_s=self._file_timeout_s,
                          transport=self._execd_transport, _client=self)
        self._live[lease.id] = sb
        log.info("sandbox %s acquired: pod %s at %s:%d (warm %s)", lease.id, lease.pod,
                 lease.address, lease.port, lease.warm)
        return sb

    def _release_orphan(self, task: asyncio.Task[AsyncSandbox]) -> None:
        self._pending.discard(task)
        if task.cancelled() or task.exception() is not None:
            return  # no sandbox came of it (the exception is retrieved, not lost)
        sb = task.result()
        log.info("sandbox %s: its acquire's caller was cancelled; releasing it", sb.id)
        rel = _keep(asyncio.ensure_future(sb.release()))
        self._pending.add(rel)
        rel.add_done_callback(self._pending.discard)
        rel.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def release(self, sandbox_id: str) -> bool:
        """Release by id (idempotent; True when this call released it)."""
        resp = await self._send("DELETE", f"/v1/sandboxes/{_quote(sandbox_id)}",
                                read_s=self._timeout_s)
        data = _core.decode_json(resp, "release")
        self._forget(sandbox_id)
        released = isinstance(data, dict) and data.get("released") is True
        log.info("sandbox %s released (%s)", sandbox_id,
                 "now" if released else "was already released")
        return released

    async def get(self, sandbox_id: str) -> SandboxInfo:
        """What the controller knows of a sandbox; SandboxGone when it does not exist."""
        resp = await self._send("GET", f"/v1/sandboxes/{_quote(sandbox_id)}",
                                read_s=self._timeout_s)
        return SandboxInfo.from_json(_core.decode_json(resp, "get"))

    async def list(self, job: str | None = None) -> list[SandboxInfo]:
        params = {"job": job} if job else None
        resp = await self._send("GET", "/v1/sandboxes", params=params, read_s=self._timeout_s)
        data = _core.decode_json(resp, "list")
        if isinstance(data, dict):  # {"items": [...]}
            data = data.get("items", data.get("sandboxes", []))
        if not isinstance(data, list):
            data = []
        return [SandboxInfo.from_json(d) for d in data]

    async def prewarm(self, image: str, count: int, *, cpu: str | int | float = "2",
                       memory: str = "8Gi", egress: str = "deny", workspace: str | None = None,
                       idle_timeout_s: float | None = None) -> PoolStatus:
        """Keep `count` never-used sandboxes of this image and size ready, so acquires with
        `warm_ok=True` get one at once. `count=0` empties the pool. Warm pods cost capacity
        while idle; they go after `idle_timeout_s` without an acquire."""
        body = _core.prewarm_body(image=image, count=count, cpu=cpu, memory=memory,
                                  workspace=workspace, egress=egress,
                                  idle_timeout_s=idle_timeout_s)
        resp = await self._send("POST", "/v1/prewarm", json=body, read_s=self._timeout_s)
        return PoolStatus.from_json(_core.decode_json(resp, "prewarm"))

    async def drain(self, job: str) -> int:
        """End of a job: the controller deletes every sandbox of `job` and withdraws its
        queued acquires. Handles of this client for that job are gone afterwards. Returns how
        many sandboxes the controller is deleting."""
        resp = await self._send("POST", f"/v1/jobs/{_quote(job)}/drain", read_s=self._timeout_s)
        data = _core.decode_json(resp, "drain")
        for sb in list(self._live.values()):
            if sb.job == job:
                sb._gone = True
                self._forget(sb.id)
        n = data.get("deleting") if isinstance(data, dict) else None
        return n if isinstance(n, int) else 0

    # ---- transport

    def _forget(self, sandbox_id: str) -> None:
        self._live.pop(sandbox_id, None)

    async def _send(self, method: str, path: str, *, read_s: float, json: Any = None,
                    params: dict[str, str] | None = None) -> httpx.Response:
        if self._http.is_closed:
            raise SandmanError(f"{method} {path}: the client is closed")
        attempts = _core.Attempts(self._retry, read_s)
        tmo = _core.timeout(self._retry, read_s)
        while True:
            attempts.start()
            err: SandmanError | httpx.TransportError
            try:
                resp = await self._http.request(method, path, json=json, params=params,
                                                timeout=tmo)
            except _core.RETRYABLE as e:
                err = e
            else:
                try:
                    _core.raise_for_controller(resp)
                    return resp
                except NotLeader as e:
                    err = e
            delay = attempts.delay()
            if delay is None:
                if isinstance(err, SandmanError):
                    raise err
                raise ControllerUnreachable(f"{method} {path}: no answer from the controller "
                                            f"after {attempts.n} attempts: {err}") from err
            log.info("controller %s %s attempt %d failed (%s); retrying in %.2fs", method,
                     path, attempts.n, type(err).__name__, delay)
            await asyncio.sleep(delay)


def _quote(sandbox_id: str) -> str:
    if not sandbox_id:
        raise SandboxGone("empty sandbox id")
    return quote(sandbox_id, safe="")
