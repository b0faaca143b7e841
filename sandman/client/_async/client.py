"""`AsyncClient`: the controller's acquire/release API (routes and bodies: sandman/api.py).

`sandman/client/_async/client.py` is the source of both twins: `tools/gen_sync.py` writes
`sandman/client/_sync/client.py` from it (docs/sdk.md, "Two twins, one source")."""

from __future__ import annotations

import asyncio
import logging
import threading
import time  # noqa: F401 - the sync twin sleeps with time.sleep (tools/gen_sync.py)
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from sandman import api, tracing
from sandman.client import _core
from sandman.client._core import OnRequest, RetryPolicy
from sandman.client.errors import (
    AuthUnavailable,
    BadRequest,
    ControllerUnreachable,
    NotLeader,
    ProtocolError,
    SandboxGone,
    SandmanError,
)
from sandman.client.models import Images, Lease, Owner, PoolStatus, SandboxInfo, Stats

from .sandbox import AsyncSandbox

log = logging.getLogger("sandman.client")


class AsyncClient:
    """The controller at `url` (e.g. "https://sandman-controller.sandman-system.svc:8080").

    In a pod, `AsyncClient()` with no arguments is configured from the environment:
    `$SANDMAN_URL`, `$SANDMAN_TOKEN_FILE` (a projected ServiceAccount token with audience
    `sandman`, read again whenever the kubelet rotates it, sent as `Authorization: Bearer`)
    and `$SANDMAN_CA_FILE` (the controller's CA, for https). `token=` / `token_file=` /
    `ca_file=` override them (docs/sdk.md, "Before you start").

    Leaving `async with AsyncClient(...)` (or aclose()) releases every sandbox acquired
    through it that was not released yet, so a crashed rollout loop does not leave pods
    behind. With asyncio, an acquire whose caller is cancelled runs on, and the sandbox it
    gets is released (the paper's cancelled-create leak: a cancelled caller must not orphan
    its pod).

    `on_request(kind, name, elapsed_ms, response_length, exception)` is called once per call
    to the controller, and passed on to the sandboxes acquired here for their execd calls:
    `kind` is the operation ("ACQUIRE", "EXEC", ...), `name` its route template, `exception`
    the error the call raises (None on success). The load tests report it to locust."""

    def __init__(self, url: str | None = None, *, token: str | None = None,
                 token_file: str | None = None, ca_file: str | None = None,
                 timeout_s: float = 30.0, retry: RetryPolicy | None = None,
                 file_timeout_s: float = 120.0,
                 transport: httpx.AsyncBaseTransport | None = None,
                 execd_transport: httpx.AsyncBaseTransport | None = None,
                 on_request: OnRequest | None = None,
                 allow_insecure_http: bool = False) -> None:
        self.url = _core.controller_url(url)
        self._token = _core.TokenSource(token, token_file)
        _core.check_plain_http(self.url, self._token, allow_insecure_http)
        self._timeout_s = timeout_s
        self._retry = retry or RetryPolicy()
        self._file_timeout_s = file_timeout_s
        self._execd_transport = execd_transport
        self._on_request = on_request
        if transport is None:
            transport = httpx.AsyncHTTPTransport(socket_options=_core.SOCKET_OPTIONS,
                                                 verify=_core.controller_tls(ca_file))
        self._http = httpx.AsyncClient(base_url=self.url, transport=transport, trust_env=False,
                                       headers={"User-Agent": _core.USER_AGENT})
        self._lock = threading.Lock()  # _live and _closed; held for no I/O
        self._live: dict[str, AsyncSandbox] = {}  # acquired here, not (confirmed) released
        if True:  # ASYNC
            self._pending: set[asyncio.Task[Any]] = set()  # acquires of cancelled callers
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
        if True:  # ASYNC
            if self._pending:  # acquires of cancelled callers: their sandboxes join _live
                await asyncio.wait(set(self._pending), timeout=_core.CLOSE_WAIT_S)
        with self._lock:
            live = list(self._live.values())
        for sb in live:
            try:
                await sb.release()
            except SandmanError as e:
                log.warning("sandbox %s: release at client close failed: %s", sb.id, e)
        await self._http.aclose()

    # ---- the API

    @_core.acquiring
    async def acquire(self, image: str, *, job: str, cpu: str | int | float = api.DEFAULT_CPU,
                      memory: str = api.DEFAULT_MEMORY,
                      egress: str | Mapping[str, Sequence[str]] = api.DEFAULT_EGRESS,
                      workspace: str | None = None,
                      owner: Owner | Mapping[str, str] | None = None,
                      labels: Mapping[str, str] | None = None,
                      timeout_s: float = api.DEFAULT_ACQUIRE_TIMEOUT_S, warm_ok: bool = True,
                      wait: bool = True, lifetime_s: float | None = None,
                      renew: bool = True, namespace: str | None = None,
                      role: str = api.DEFAULT_ROLE,
                      conditions: api.Conditions | Mapping[str, Any] | None = None,
                      reused_ok: bool = False, ephemeral_storage: str | None = None,
                      gpu: int = 0) -> AsyncSandbox:
        """A ready sandbox from `image`, sized `cpu`/`memory` (requests equal limits).
        `timeout_s` bounds the wait for it, image pull included (AcquireTimeout).
        `lifetime_s` (None: the controller's default) is how long the sandbox outlives this
        process if it dies: with `renew`, the handle renews it at each third of it until
        released or closed.

        Every attempt carries one request_id, so an attempt whose answer was lost is retried
        and the controller answers it with the first attempt's sandbox, not a second one. Only
        if the controller itself was replaced in between can a retry get a second sandbox;
        the first then stays leased under the job until `drain` (docs/sdk.md).

        `namespace`: the tenant the sandbox belongs to; default the caller's ServiceAccount
        namespace (another needs the caller's RBAC there).

        `role`: "agent" (default) or "grading"; a grading sandbox may be released with
        `reuse=True` (restored, checked, back to its warm pool); a later grading acquire gets
        such a pod only with `reused_ok=True` (else a never-used one).

        `egress`: "deny" (default), "allow", or `{"allow": ["10.0.0.0/8:443",
        "svc/pypi-mirror.infra:3141"]}`: outbound denied but for those entries (CIDR:PORT or
        svc/NAME.NAMESPACE:PORT, optionally /tcp or /udp), which must lie within the
        cluster's ceiling (BadRequest naming the entry otherwise); each allowlist is its own
        warm pool.

        `conditions` declares run conditions (`api.Conditions` or a mapping with its fields:
        egress, cpu_quota, visible_cpus, memory_limit, user, tz, hash_seed, time_limit_s,
        egress_allow).
        The controller reads them in the pod before hand-out and never hands out one that
        contradicts a readable field (ConditionsRefused once its tries are used up); the
        sandbox's `conditions_check` says what was verified and what could not be read.

        `ephemeral_storage` (e.g. "10Gi"): the container's disk, requests equal limits.
        `gpu`: GPUs of the cluster's GPU resource; BadRequest unless the chart grants that
        many per sandbox. Both are part of the warm-pool key, like the size."""
        if self._closed:
            raise SandmanError("client is closed")
        body = _core.request(
            api.AcquireRequest, image=image, job=job, timeout_s=timeout_s,
            # One id for every attempt: a retry whose first answer was lost gets the same
            # sandbox back from the controller instead of a second one.
            request_id=_core.new_request_id(),
            **_spec_fields(cpu=cpu, memory=memory, egress=egress, workspace=workspace,
                           owner=owner, labels=labels, warm_ok=warm_ok, wait=wait,
                           lifetime_s=lifetime_s, namespace=namespace, role=role,
                           conditions=conditions, reused_ok=reused_ok,
                           ephemeral_storage=ephemeral_storage, gpu=gpu))
        if True:  # ASYNC
            task = _core.keep(asyncio.ensure_future(self._acquire(body, renew)))
            try:
                return await asyncio.shield(task)
            except asyncio.CancelledError:
                # The controller may still hand out the sandbox: own it, release it when it
                # comes.
                self._pending.add(task)
                task.add_done_callback(self._release_orphan)
                raise
        else:
            return self._acquire(body, renew)

    async def _acquire(self, body: api.AcquireRequest, renew: bool = True) -> AsyncSandbox:
        resp = await self._send(api.ACQUIRE, json=body.to_json(),
                                read_s=float(body.timeout_s) + _core.ACQUIRE_ANSWER_GRACE_S)
        return self._adopt(Lease.from_json(_core.decode_json(resp, "acquire")), body.job, renew)

    def _adopt(self, lease: Lease, job: str | None, renew: bool) -> AsyncSandbox:
        """A handle on a sandbox the controller just handed out, held (released at close)."""
        sb = AsyncSandbox(lease.address, lease.port, lease.token, id=lease.id, pod=lease.pod,
                          warm=lease.warm, timings=lease.timings, retry=self._retry,
                          job=job, file_timeout_s=self._file_timeout_s,
                          transport=self._execd_transport, on_request=self._on_request,
                          conditions_check=lease.conditions, _client=self)
        sb.image, sb.image_digest = lease.image, lease.image_digest
        with self._lock:
            self._live[lease.id] = sb
        if renew:
            sb._start_renewing(lease.lifetime_s, lease.expires_at)
        else:
            sb.expires_at, sb.lifetime_s = lease.expires_at, lease.lifetime_s
        log.info("sandbox %s acquired: pod %s at %s:%d (warm %s)", lease.id, lease.pod,
                 lease.address, lease.port, lease.warm)
        sb.reuses = lease.reuses
        return sb

    if True:  # ASYNC
        def _release_orphan(self, task: asyncio.Task[AsyncSandbox]) -> None:
            self._pending.discard(task)
            if task.cancelled() or task.exception() is not None:
                return  # no sandbox came of it (the exception is retrieved, not lost)
            sb = task.result()
            log.info("sandbox %s: its acquire's caller was cancelled; releasing it", sb.id)
            rel = _core.keep(asyncio.ensure_future(sb.release()))
            self._pending.add(rel)
            rel.add_done_callback(self._pending.discard)
            rel.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def fork(self, sandbox_id: str, n: int, *,
                   timeout_s: float = api.DEFAULT_ACQUIRE_TIMEOUT_S, renew: bool = True,
                   job: str | None = None) -> list[AsyncSandbox]:
        """`n` new sandboxes of the sandbox's spec, tenant and job, each holding its state at
        the call: its filesystem changes against the image, its shell's cwd and exported
        environment (never its running processes or sessions). Held like acquired ones.
        All or nothing: on any failure every child is released and one error says why
        (ForkFailed when the state did not reach a child; an acquire's error when a child
        could not be had; BadRequest for a grading sandbox). `job`: the children's `job`
        attribute (the parent's, when forked through its handle)."""
        if self._closed:
            raise SandmanError("client is closed")
        body = _core.request(api.ForkRequest, n=n, timeout_s=timeout_s,
                             request_id=_core.new_request_id(),
                             tokens=self._tokens([sandbox_id]))
        if True:  # ASYNC
            task = _core.keep(asyncio.ensure_future(self._fork(sandbox_id, body, renew, job)))
            try:
                return await asyncio.shield(task)
            except asyncio.CancelledError:
                # The controller may still hand the children out: own them, release them.
                self._pending.add(task)
                task.add_done_callback(self._release_orphans)
                raise
        else:
            return self._fork(sandbox_id, body, renew, job)

    async def _fork(self, sandbox_id: str, body: api.ForkRequest, renew: bool,
                    job: str | None) -> list[AsyncSandbox]:
        resp = await self._send(api.FORK, id=_check_id(sandbox_id), json=body.to_json(),
                                read_s=float(body.timeout_s) + _core.ACQUIRE_ANSWER_GRACE_S)
        try:
            leases = api.Forked.read_children(_core.decode_json(resp, "fork"), Lease)
        except api.AnswerError as e:
            raise ProtocolError(str(e)) from None
        if len(leases) != body.n:
            raise ProtocolError(f"fork: asked for {body.n} children, the controller answered "
                                f"{len(leases)}")
        kids = [self._adopt(lease, job, renew) for lease in leases]
        log.info("sandbox %s forked into %s", sandbox_id, ", ".join(k.id or "" for k in kids))
        return kids

    if True:  # ASYNC
        def _release_orphans(
                self, task: asyncio.Task[list[AsyncSandbox]] | asyncio.Task[
                    dict[str, AsyncSandbox]]) -> None:
            self._pending.discard(task)
            if task.cancelled() or task.exception() is not None:
                return
            got = task.result()
            for sb in (list(got.values()) if isinstance(got, dict) else got):
                rel = _core.keep(asyncio.ensure_future(sb.release()))
                self._pending.add(rel)
                rel.add_done_callback(self._pending.discard)
                rel.add_done_callback(lambda t: t.cancelled() or t.exception())

    @_core.acquiring
    async def acquire_group(self, image: str, count: int, *, job: str,
                            timeout_s: float = api.DEFAULT_ACQUIRE_TIMEOUT_S,
                            renew: bool = True, **spec: Any) -> AsyncSandboxGroup:
        """`count` ready sandboxes of one spec in one call (1 to api.MAX_GROUP), for N
        rollouts of one task: a list of handles, held like acquired ones; `async with` it to
        release them all on exit. `spec`: acquire's other keywords (cpu, memory, egress,
        role, conditions, ...), the same for every member.

        The controller paces the members as `count` creates under the job's budget and
        fairness, and serves what the warm pool holds first. All or nothing: on any failure
        (a member's AcquireTimeout, QueueFull, PodFailed; BadRequest for a group that can
        never fit under the job's cap) no member is left and one error says why. `timeout_s`
        bounds the whole group. A retry of a lost answer gets the same group back."""
        if self._closed:
            raise SandmanError("client is closed")
        body = _core.request(api.GroupRequest, image=image, job=job, count=count,
                             timeout_s=timeout_s, request_id=_core.new_request_id(),
                             **_spec_fields(**spec))
        if True:  # ASYNC
            task = _core.keep(asyncio.ensure_future(self._group(body, renew)))
            try:
                return await asyncio.shield(task)
            except asyncio.CancelledError:
                # The controller may still hand the group out: own it, release it.
                self._pending.add(task)
                task.add_done_callback(self._release_orphans)
                raise
        else:
            return self._group(body, renew)

    async def _group(self, body: api.GroupRequest, renew: bool) -> AsyncSandboxGroup:
        resp = await self._send(api.GROUP, json=body.to_json(),
                                read_s=float(body.timeout_s) + _core.ACQUIRE_ANSWER_GRACE_S)
        try:
            leases = api.Group.read(_core.decode_json(resp, "group"), Lease)
        except api.AnswerError as e:
            raise ProtocolError(str(e)) from None
        if len(leases) != body.count:
            raise ProtocolError(f"group: asked for {body.count} sandboxes, the controller "
                                f"answered {len(leases)}")
        got = AsyncSandboxGroup(self._adopt(lease, body.job, renew) for lease in leases)
        log.info("group of %d acquired: %s", len(got), ", ".join(sb.id or "" for sb in got))
        return got

    async def checkpoint(self, *, job: str | None = None, ids: Sequence[str] | None = None,
                         namespace: str | None = None,
                         timeout_s: float = api.DEFAULT_ACQUIRE_TIMEOUT_S) -> api.Checkpointed:
        """The state of the sandboxes `ids`, or of every handed-out agent sandbox of `job`
        (one of the two), stored in the admin's registry; the answer's `id` names the set and
        is all `restore()` needs, from any process of the same tenant, until its `expires_at`.
        The sandboxes keep running. All or nothing (CheckpointFailed); a grading sandbox named
        in `ids` is refused (BadRequest), a job's are left out."""
        body = _core.request(api.CheckpointRequest, job=job,
                             ids=None if ids is None else list(ids), namespace=namespace,
                             timeout_s=timeout_s,
                             tokens=self._tokens(ids) if ids is not None
                             else self._tokens(None, job=job))
        resp = await self._send(api.CHECKPOINT, json=body.to_json(),
                                read_s=float(timeout_s) + _core.ACQUIRE_ANSWER_GRACE_S)
        try:
            return api.Checkpointed.from_json(_core.decode_json(resp, "checkpoint"))
        except api.AnswerError as e:
            raise ProtocolError(str(e)) from None

    async def restore(self, checkpoint: str | api.Checkpointed, *,
                      timeout_s: float = api.DEFAULT_ACQUIRE_TIMEOUT_S,
                      renew: bool = True) -> dict[str, AsyncSandbox]:
        """Every sandbox of a checkpoint made anew, each holding its state at the checkpoint
        (filesystem changes, cwd, exported environment): {old sandbox id: new handle}, held
        like acquired ones. All or nothing: CheckpointFailed (an artifact changed in the
        registry, a pod that refused the state) or an acquire's error, and no sandbox is left;
        CheckpointGone for an id past its TTL or of no checkpoint; Forbidden for another
        tenant's."""
        if self._closed:
            raise SandmanError("client is closed")
        cid = checkpoint.id if isinstance(checkpoint, api.Checkpointed) else checkpoint
        if not cid:
            raise BadRequest("empty checkpoint id")
        body = _core.request(api.RestoreRequest, timeout_s=timeout_s,
                             request_id=_core.new_request_id())
        if True:  # ASYNC
            task = _core.keep(asyncio.ensure_future(self._restore(cid, body, renew)))
            try:
                return await asyncio.shield(task)
            except asyncio.CancelledError:
                self._pending.add(task)
                task.add_done_callback(self._release_orphans)
                raise
        else:
            return self._restore(cid, body, renew)

    async def _restore(self, cid: str, body: api.RestoreRequest,
                       renew: bool) -> dict[str, AsyncSandbox]:
        resp = await self._send(api.RESTORE, id=cid, json=body.to_json(),
                                read_s=float(body.timeout_s) + _core.ACQUIRE_ANSWER_GRACE_S)
        try:
            leases = api.RestoredCheckpoint.read(_core.decode_json(resp, "restore"), Lease)
        except api.AnswerError as e:
            raise ProtocolError(str(e)) from None
        got = {old: self._adopt(lease, None, renew) for old, lease in leases.items()}
        log.info("checkpoint %s restored: %s", cid,
                 ", ".join(f"{old} -> {sb.id}" for old, sb in got.items()))
        return got

    async def resume(self, handle: str | api.Checkpointed, *,
                     timeout_s: float = api.DEFAULT_ACQUIRE_TIMEOUT_S,
                     renew: bool = True) -> AsyncSandbox:
        """The sandbox a `pause()` gave `handle` for, made anew with its state."""
        got = await self.restore(handle, timeout_s=timeout_s, renew=renew)
        if len(got) != 1:
            for sb in got.values():
                await sb.release()
            raise ProtocolError(f"resume: the checkpoint holds {len(got)} sandboxes, not one "
                                "(restore it instead)")
        return next(iter(got.values()))

    async def pause(self, sandbox_id: str, *,
                    timeout_s: float = api.DEFAULT_ACQUIRE_TIMEOUT_S) -> api.Checkpointed:
        """The sandbox `sandbox_id` checkpointed, then released (as `sandbox.pause()`, by id:
        the CLI holds a lease, not a handle): the handle `resume()` makes it anew from. On
        failure (CheckpointFailed) it is not released."""
        if self._closed:
            raise SandmanError("client is closed")
        return await self._pause(sandbox_id, timeout_s)

    async def _pause(self, sandbox_id: str, timeout_s: float) -> api.Checkpointed:
        body = _core.request(api.RestoreRequest, timeout_s=timeout_s,
                             tokens=self._tokens([sandbox_id]))
        resp = await self._send(api.PAUSE, id=_check_id(sandbox_id), json=body.to_json(),
                                read_s=float(timeout_s) + _core.ACQUIRE_ANSWER_GRACE_S)
        self._forget(sandbox_id)
        try:
            return api.Checkpointed.from_json(_core.decode_json(resp, "pause"))
        except api.AnswerError as e:
            raise ProtocolError(str(e)) from None

    async def release(self, sandbox_id: str, reuse: bool = False) -> bool:
        """Release by id (idempotent; True when this call released it). `reuse` (grading
        sandboxes only, else BadRequest): the controller restores the pod, checks it clean
        and returns it to its warm pool, or deletes it when it cannot."""
        return (await self._let_go(sandbox_id, reuse))[0]

    async def retire(self, sandbox_id: str) -> bool:
        """Delete a sandbox whose grading contradicted an earlier one (never reused; counted
        by the controller). True when this call released it."""
        resp = await self._send(api.RETIRE, id=_check_id(sandbox_id), read_s=self._timeout_s)
        data = _core.decode_json(resp, "retire")
        self._forget(sandbox_id)
        released = isinstance(data, dict) and data.get("released") is True
        log.info("sandbox %s %s", sandbox_id, "retired" if released else "was already gone")
        return released

    async def report_shadow(self, sandbox_id: str, outcome: str) -> tuple[bool, bool]:
        """A reused grading pod's verdict against a never-used pod's: `outcome` "agree" or
        "contradict" (contract.SHADOW_OUTCOMES). The controller counts it, retires a
        contradicted pod and releases an agreeing one for reuse: (released, reused)."""
        body = _core.request(api.ShadowReport, outcome=outcome)
        resp = await self._send(api.SHADOW, id=_check_id(sandbox_id), json=body.to_json(),
                                read_s=self._timeout_s)
        data = _core.decode_json(resp, "shadow")
        self._forget(sandbox_id)
        released = isinstance(data, dict) and data.get("released") is True
        reused = isinstance(data, dict) and data.get("reused") is True
        log.info("sandbox %s: shadow grading %s; %s", sandbox_id, outcome,
                 ("released for reuse" if reused else "released") if released
                 else "was already released")
        return released, reused

    async def _let_go(self, sandbox_id: str, reuse: bool) -> tuple[bool, bool]:
        """(released, reused)."""
        params = {api.RELEASE_REUSE_PARAM: "true"} if reuse else None
        resp = await self._send(api.RELEASE, id=_check_id(sandbox_id), params=params,
                                read_s=self._timeout_s)
        data = _core.decode_json(resp, "release")
        self._forget(sandbox_id)
        released = isinstance(data, dict) and data.get("released") is True
        reused = isinstance(data, dict) and data.get("reused") is True
        lost = data.get("lost") if isinstance(data, dict) else None
        log.info("sandbox %s %s", sandbox_id,
                 ("released for reuse" if reused else "released") if released
                 else f"was already gone: {lost}" if isinstance(lost, str)
                 else "was already released")
        return released, reused

    async def renew(self, sandbox_id: str, lifetime_s: float | None = None) -> SandboxInfo:
        """Push a sandbox's expiry to now + `lifetime_s` (None: its current lifetime).
        SandboxGone when it was released, drained or expired."""
        body = _core.request(api.RenewRequest, lifetime_s=lifetime_s,
                             tokens=self._tokens([sandbox_id]))
        resp = await self._send(api.RENEW, id=_check_id(sandbox_id), json=body.to_json(),
                                read_s=self._timeout_s)
        return SandboxInfo.from_json(_core.decode_json(resp, "renew"))

    async def get(self, sandbox_id: str) -> SandboxInfo:
        """What the controller knows of a sandbox; SandboxGone when it does not exist."""
        resp = await self._send(api.GET, id=_check_id(sandbox_id), read_s=self._timeout_s)
        return SandboxInfo.from_json(_core.decode_json(resp, "get"))

    async def list(self, job: str | None = None,
                   namespace: str | None = None) -> list[SandboxInfo]:
        """The sandboxes of every tenant the caller may list (`namespace`: that one only)."""
        params = {k: v for k, v in (("job", job), ("namespace", namespace)) if v} or None
        resp = await self._send(api.LIST, params=params, read_s=self._timeout_s)
        data = _core.decode_json(resp, "list")
        items = data.get("items") if isinstance(data, dict) else None
        if not isinstance(items, list):
            raise ProtocolError("list: the answer has no 'items' list")
        return [SandboxInfo.from_json(d) for d in items]

    async def prewarm(self, image: str, count: int, *,
                      cpu: str | int | float = api.DEFAULT_CPU,
                      memory: str = api.DEFAULT_MEMORY,
                      egress: str | Mapping[str, Sequence[str]] = api.DEFAULT_EGRESS,
                      workspace: str | None = None,
                      idle_timeout_s: float | None = None,
                      role: str = api.DEFAULT_ROLE, ephemeral_storage: str | None = None,
                      gpu: int = 0) -> PoolStatus:
        """Keep `count` never-used sandboxes of this image and size ready, so acquires with
        `warm_ok=True` get one at once. `count=0` empties the pool. Warm pods cost capacity
        while idle; they go after `idle_timeout_s` without an acquire. `role`: the pool of
        agent or of grading sandboxes (a separate key); `ephemeral_storage` and `gpu` as
        acquire's (each size its own pool)."""
        spec = _core.request(api.Spec, cpu=str(cpu), memory=str(memory),
                             egress=_core.egress_of(egress),
                             workspace=workspace, role=role,
                             ephemeral_storage=ephemeral_storage, gpu=gpu)
        body = _core.request(api.PrewarmRequest, image=image, count=count, spec=spec,
                             idle_timeout_s=idle_timeout_s)
        resp = await self._send(api.PREWARM, json=body.to_json(), read_s=self._timeout_s)
        return PoolStatus.from_json(_core.decode_json(resp, "prewarm"))

    async def drain(self, job: str, namespace: str | None = None) -> int:
        """End of a job: the controller deletes every sandbox of `job` and withdraws its
        queued acquires. Handles of this client for that job are gone afterwards. Returns how
        many sandboxes the controller is deleting."""
        if not job:
            raise BadRequest("job is required")
        resp = await self._send(api.DRAIN, job=job, read_s=self._timeout_s,
                                params={"namespace": namespace} if namespace else None)
        data = _core.decode_json(resp, "drain")
        with self._lock:
            ending = [sb for sb in self._live.values() if sb.job == job]
        for sb in ending:
            sb._gone = True
            self._forget(sb.id)
        n = data.get("deleting") if isinstance(data, dict) else None
        return n if isinstance(n, int) else 0

    async def prepull(self, images: Sequence[str]) -> Images:
        """Pull `images` (each pinned by digest, `registry/repo@sha256:<64 hex>`) onto every
        node of the sandbox node pool, paced behind every acquire (admin). Returns at once with
        the progress; `images()` reads it later. Posting an image again retries its failed
        nodes."""
        body = _core.request(api.PrepullRequest, images=list(images))
        resp = await self._send(api.PREPULL, json=body.to_json(), read_s=self._timeout_s)
        return Images.from_json(_core.decode_json(resp, "prepull"))

    async def images(self) -> Images:
        """Each pre-pulled image's nodes: pulled, pending, failed (with the kubelet's reason)."""
        resp = await self._send(api.IMAGES, read_s=self._timeout_s)
        return Images.from_json(_core.decode_json(resp, "images"))

    # ---- transport

    async def stats(self) -> Stats:
        """The controller's pacer and pools (`GET /v1/stats`): queue depth per job and per
        tenant, creates in flight, live pods, the pacing rate, warm pools."""
        resp = await self._send(api.STATS, read_s=self._timeout_s)
        return Stats.from_json(_core.decode_json(resp, "stats"))

    def _tokens(self, ids: Sequence[str] | None, *,
                job: str | None = None) -> dict[str, str] | None:
        """The execd tokens of the sandboxes named (or of `job`'s) that this client holds: a
        controller that restarted since their hand-out learns them back from these (its
        fork, checkpoint, pause and idle rule need them). None when it holds none."""
        with self._lock:
            live = dict(self._live)
        if ids is not None:
            got = {i: live[i]._token for i in ids if i in live}
        else:
            got = {i: sb._token for i, sb in live.items() if sb.job == job}
        return dict(list(got.items())[:api.MAX_CHECKPOINT]) or None

    def _forget(self, sandbox_id: str | None) -> None:
        with self._lock:
            self._live.pop(sandbox_id or "", None)

    async def _send(self, route: api.Route, *, read_s: float, json: Any = None,
                    params: dict[str, str] | None = None,
                    **path_params: str) -> httpx.Response:
        """One call to the controller, with its retries; reported once to `on_request`."""
        path = route.url(**path_params)
        with _core.call(self._on_request, route, "sandman", path_params.get("id")) as call:
            resp = await self._attempts(route.method, path, read_s=read_s, json=json,
                                        params=params)
            call.done(resp)
            return resp

    async def _attempts(self, method: str, path: str, *, read_s: float, json: Any,
                        params: dict[str, str] | None) -> httpx.Response:
        if self._http.is_closed:
            raise SandmanError(f"{method} {path}: the client is closed")
        attempts = _core.Attempts(self._retry, read_s)
        tmo = _core.timeout(self._retry, read_s)
        while True:
            attempts.start()
            err: SandmanError | httpx.TransportError
            try:
                resp = await self._http.request(method, path, json=json, params=params,
                                                headers=tracing.inject(self._token.header()),
                                                timeout=tmo)
            except _core.RETRYABLE as e:
                bad = _core.configuration_error(e)
                if bad is not None:
                    raise bad from e
                err = e
            else:
                try:
                    _core.raise_for_controller(resp)
                    return resp
                except (NotLeader, AuthUnavailable) as e:
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


class AsyncSandboxGroup(list[AsyncSandbox]):
    """What `acquire_group` gives: the members, in order; `async with` releases them all."""

    async def __aenter__(self) -> AsyncSandboxGroup:
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        await self.release()

    async def release(self) -> int:
        """Every member given back (each release idempotent); how many this call released.
        Every member is tried even if one fails; the first failure is raised after."""
        n, first = 0, None
        for sb in self:
            try:
                n += bool(await sb.release())
            except SandmanError as e:  # the client retries it when closed
                first = first or e
        if first is not None:
            raise first
        return n


def _spec_fields(*, cpu: str | int | float = api.DEFAULT_CPU, memory: str = api.DEFAULT_MEMORY,
                 egress: str | Mapping[str, Sequence[str]] = api.DEFAULT_EGRESS,
                 workspace: str | None = None,
                 owner: Owner | Mapping[str, str] | None = None,
                 labels: Mapping[str, str] | None = None, warm_ok: bool = True,
                 wait: bool = True, lifetime_s: float | None = None,
                 namespace: str | None = None, role: str = api.DEFAULT_ROLE,
                 conditions: api.Conditions | Mapping[str, Any] | None = None,
                 reused_ok: bool = False, ephemeral_storage: str | None = None,
                 gpu: int = 0) -> dict[str, Any]:
    """An acquire's spec and options as the request's fields (acquire and acquire_group)."""
    return dict(cpu=str(cpu), memory=str(memory), egress=_core.egress_of(egress),
                workspace=workspace, owner=_core.owner_of(owner), labels=dict(labels or {}),
                warm_ok=bool(warm_ok), wait=bool(wait), lifetime_s=lifetime_s,
                namespace=namespace, role=role, conditions=_core.conditions_of(conditions),
                reused_ok=bool(reused_ok), ephemeral_storage=ephemeral_storage, gpu=gpu)


def _check_id(sandbox_id: str) -> str:
    if not sandbox_id:
        raise SandboxGone("empty sandbox id")
    return sandbox_id
