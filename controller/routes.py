"""The controller's HTTP API (FastAPI): the routes, bodies and error types of `sandman/api.py`,
served. Errors are JSON `{"error": {"type", "message", "events"}}` with a type the SDK maps to
a typed exception."""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from controller import auth as A
from controller import metrics, tracing
from controller.checkpoint import parse_id
from controller.core import Controller
from controller.errors import (
    AcquireError,
    CheckpointFailed,
    NotLeader,
    SandboxGone,
    SandboxPaused,
)
from controller.forward import not_leader_headers
from controller.group import acquire_group
from controller.paused import PausedSandbox, Unrecorded, until_of
from controller.pods import AcquireOrder, SandboxSpec, iso_utc
from sandman import api, logs
from sandman._version import __version__

log = logging.getLogger("controller.routes")


def _err(e: api.ErrorType, message: str, events: list[str] | None = None, *,
         status: int | None = None, headers: dict[str, str] | None = None,
         checkpoint: str | None = None) -> JSONResponse:
    return JSONResponse(api.Error(e.type, message, events or [], checkpoint).to_json(),
                        status_code=status or e.status, headers=headers)


def build_app(state: dict, auth: A.KubeAuth | A.NoAuth | None = None,
              labels: A.LabelPolicy | None = None,
              tracer_provider: TracerProvider | None = None) -> FastAPI:
    """`state["controller"]` is set once this replica leads; until then the API routes answer
    NotLeader (503). `state["elector"]` (the LeaderElector) tells a standby's /readyz whether
    it is in touch with the API server; on a standby, controller/forward.py sends API calls to
    the leader before they reach these routes.

    `auth` checks every /v1 call (controller/auth.py; default: none, for local use). Each
    sandbox belongs to a tenant namespace, encoded in its job key (`auth.scoped_job`); a
    caller sees and touches only the tenants its RBAC allows."""
    # Server spans only (controller/tracing.py): the metrics are prometheus', the logs ours.
    app = FastAPI(title="sandman controller", version=__version__, telemetry={
        "tracer_provider": tracer_provider, "tracing": tracer_provider is not None,
        "metrics": False, "logs": False, "operation_spans": False})
    app.add_middleware(RequestContext)
    auth = auth or A.NoAuth()
    labels = labels or A.LabelPolicy()

    async def caller(request: Request) -> A.Caller:
        return await auth.authenticate(request.headers.get("authorization"))

    def tenant_for(who: A.Caller, namespace: str | None) -> str | None:
        """The tenant a call names, or the caller's own (its ServiceAccount's namespace).
        None under --auth none (one local user: unscoped, `namespace` only checked)."""
        if namespace is not None:
            A.check_tenant(namespace)
        if not auth.enabled:
            return None  # --auth none: one local user, no tenants
        if namespace is not None:
            return namespace
        if who.namespace is None:
            raise A.BadRequest(f"namespace: required, {who.username} is not a ServiceAccount "
                               "(no default tenant)")
        return who.namespace

    def split(key: str) -> tuple[str | None, str]:
        return A.split_job(key) if auth.enabled else (None, key)

    async def paused(who: A.Caller, verb: str, sid: str) -> None:
        """SandboxPaused naming its checkpoint when `sid` was paused (by its holder or the
        idle rule; controller/paused.py) and the caller may `verb` in its tenant; nothing
        otherwise (the caller then gets what an unknown id gets: another tenant learns neither
        the pause nor the checkpoint's id). A record naming another tenant than the live
        sandbox of that id is ignored: a record never speaks for another tenant's sandbox."""
        c = state.get("controller")
        p = c.idle.paused.get(sid) if c is not None and c.ready else None
        if c is None or p is None:
            return
        tenant, _job = split(p.job)
        live = c.entries.get(sid)
        if live is not None and split(live.job)[0] != tenant:
            return
        if auth.enabled and not await auth.allowed(who, verb, tenant or A.CLUSTER):
            return
        raise SandboxPaused(f"sandbox {sid} was paused; checkpoint: {p.checkpoint} (resume "
                            "it from there)", p.checkpoint)

    async def why_gone(who: A.Caller, verb: str, sid: str) -> str | None:
        """Why the handed-out sandbox `sid` ended under its holder (controller/lost.py), for
        a caller that may `verb` in its tenant; None otherwise (another tenant learns what an
        unknown id gets)."""
        c = state.get("controller")
        lost = c.ended(sid) if c is not None and c.ready else None
        if lost is None:
            return None
        tenant, _job = split(lost.job)
        if auth.enabled and not await auth.allowed(who, verb, tenant or A.CLUSTER):
            return None
        return lost.ending.why

    async def gone(who: A.Caller, verb: str, sid: str, plain: str) -> JSONResponse:
        """SANDBOX_GONE: with its reason when it was lost and the caller may know it."""
        why = await why_gone(who, verb, sid)
        return _err(api.SANDBOX_GONE, f"sandbox {sid} is gone: {why}" if why else plain)

    async def may_see(who: A.Caller, verb: str, e) -> bool:
        tenant, _job = split(e.job)
        # Unscoped entries (the warm pool) belong to no tenant: cluster-wide rights only.
        return await auth.allowed(who, verb, tenant or A.CLUSTER)

    def ctl() -> Controller:
        c = state.get("controller")
        if c is None or not c.ready:
            raise NotLeader("this controller replica is not the leader (or not synced yet); retry")
        return c

    @app.exception_handler(AcquireError)
    async def _acq(_req, exc: AcquireError):
        # NotLeader closes the connection: the Service balances connections, so the SDK's
        # retry on a fresh one may reach the other replica.
        headers = ({k.decode(): v.decode() for k, v in not_leader_headers()}
                   if isinstance(exc, NotLeader) else None)
        return _err(api.ErrorType(exc.status, exc.kind), str(exc), exc.events, headers=headers,
                    checkpoint=getattr(exc, "checkpoint", None))

    @app.exception_handler(A.Unauthenticated)
    async def _unauth(_req, exc: A.Unauthenticated):
        return _err(api.UNAUTHENTICATED, str(exc), headers={"WWW-Authenticate": "Bearer"})

    @app.exception_handler(RequestValidationError)
    async def _bad(_req, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        return _err(api.INVALID_BODY, f"{where}: {msg}" if where else msg)

    @app.post(api.ACQUIRE.path, status_code=201)
    async def acquire(body: api.AcquireRequest, request: Request):
        logs.add(job=body.job)
        who = await caller(request)
        tenant = tenant_for(who, body.namespace)
        logs.add(tenant=tenant)
        if tenant is not None:
            await auth.require(who, A.CREATE, tenant)
        labels.check(body.labels)
        c = ctl()
        # The controller dedups by (job, request_id): the job key carries the tenant and the
        # request id the caller's identity, so nobody else's replay finds this sandbox.
        rid = None if body.request_id is None else f"{who.key}:{body.request_id}"
        task = asyncio.ensure_future(c.acquire(
            AcquireOrder.of(body, A.scoped_job(tenant, body.job), rid)))
        # Starlette does not cancel a handler whose client left: wait for the disconnect
        # message too (no polling), so the controller learns the caller is gone and withdraws
        # or cleans up the create.
        gone = asyncio.ensure_future(_disconnect(request))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                await asyncio.sleep(0)  # a disconnect already queued is seen now, not after
        finally:
            gone.cancel()
        client_left = gone.done() and not gone.cancelled() and gone.exception() is None
        if task.done() and not client_left:
            return JSONResponse(_lease(task.result()).to_json(), status_code=201)
        task.cancel()
        try:
            result = await task
            # Finished in the same tick: nobody will ever read this token.
            await c.release(result["id"])
        except (asyncio.CancelledError, AcquireError):
            pass
        return _err(api.CLIENT_CLOSED, "client disconnected")

    @app.get(api.LIST.path)
    async def list_sandboxes(request: Request, job: str | None = None,
                             namespace: str | None = None):
        """Only the tenants the caller may list (`namespace`: that one alone, or 403)."""
        who = await caller(request)
        only = None
        if namespace is not None:
            A.check_tenant(namespace)
            if auth.enabled:  # --auth none has no tenants
                only = namespace
                await auth.require(who, A.LIST, only)
        c = ctl()
        seen: dict[str | None, bool] = {}
        items = []
        for e in list(c.entries.values()):
            if e.state == "gone":
                continue
            tenant, plain = split(e.job)
            if (only is not None and tenant != only) or job not in (None, plain, e.job):
                continue
            if tenant not in seen:
                seen[tenant] = await auth.allowed(who, A.LIST, tenant or A.CLUSTER)
            if seen[tenant]:
                items.append(_view(c, e, split))
        if not items and only is None and auth.enabled:
            # Nothing to show: say so only to a caller that may list its own tenant.
            await auth.require(who, A.LIST, who.namespace or A.CLUSTER)
        return api.SandboxList(items).to_json()

    @app.get(api.GET.path)
    async def get_sandbox(id: str, request: Request):
        logs.add(sandbox=id)
        who = await caller(request)
        c = ctl()
        await paused(who, A.GET, id)
        e = c.get(id)
        if e is None:
            return await gone(who, A.GET, id, f"no sandbox {id}")
        if not await may_see(who, A.GET, e):
            raise A.Forbidden(f"{who.username} may not get sandbox {id} (another tenant's)")
        return _view(c, e, split).to_json()

    async def let_go(id: str, request: Request, verb: str, act) -> dict:
        """Release or retire: the same rights (delete in the sandbox's tenant)."""
        logs.add(sandbox=id)
        who = await caller(request)
        c = ctl()
        await paused(who, A.DELETE, id)
        if auth.enabled:
            e = c.get(id)
            if e is None:
                # Nothing to release; a caller without delete rights learns nothing either way.
                await auth.require(who, A.DELETE, who.namespace or A.CLUSTER)
                return api.Released(id, False, lost=await why_gone(who, A.DELETE, id)).to_json()
            if not await may_see(who, A.DELETE, e):
                raise A.Forbidden(f"{who.username} may not {verb} sandbox {id} "
                                  "(another tenant's)")
        released, reused = await act(c)
        lost = None if released else await why_gone(who, A.DELETE, id)
        return api.Released(id, released, reused, lost=lost).to_json()

    @app.delete(api.RELEASE.path)
    async def release(id: str, request: Request, reuse: bool = False):
        async def act(c):
            return await c.release_reuse(id) if reuse else (await c.release(id), False)
        return await let_go(id, request, "release", act)

    @app.post(api.RETIRE.path)
    async def retire(id: str, request: Request):
        async def act(c):
            return await c.retire(id), False
        return await let_go(id, request, "retire", act)

    @app.post(api.SHADOW.path)
    async def shadow(id: str, request: Request, body: api.ShadowReport):
        async def act(c):
            return await c.shadow(id, body.outcome)
        return await let_go(id, request, "report a shadow grading of", act)

    @app.post(api.RENEW.path)
    async def renew(id: str, request: Request, body: api.RenewRequest | None = None):
        logs.add(sandbox=id)
        who = await caller(request)
        c = ctl()
        await paused(who, A.UPDATE, id)
        if auth.enabled:
            cur = c.get(id)
            if cur is None:
                await auth.require(who, A.UPDATE, who.namespace or A.CLUSTER)
            elif not await may_see(who, A.UPDATE, cur):
                # Another tenant's sandbox: renewing it would keep its pod alive past its
                # owner's lifetime.
                raise A.Forbidden(f"{who.username} may not renew sandbox {id} "
                                  "(another tenant's)")
        if body is not None and body.tokens:
            cur = c.get(id)
            if cur is not None:  # its tenant checked above
                c.prove(cur, body.tokens)
        e = await c.renew(id, body.lifetime_s if body else None)
        if e is None:
            return await gone(who, A.UPDATE, id, f"no handed-out sandbox {id} (released, "
                                                 "drained or expired)")
        return _view(c, e, split).to_json()

    @app.post(api.FORK.path, status_code=201)
    async def fork(id: str, request: Request, body: api.ForkRequest):
        """Only a caller that may create sandboxes in the parent's tenant (its holder's
        rights): the children are made there and carry the parent's state."""
        logs.add(sandbox=id)
        who = await caller(request)
        c = ctl()
        e = c.get(id)
        if e is None:
            if auth.enabled:  # a caller without create rights learns nothing either way
                await auth.require(who, A.CREATE, who.namespace or A.CLUSTER)
            return await gone(who, A.CREATE, id, f"no sandbox {id}")
        if auth.enabled and not await may_see(who, A.CREATE, e):
            raise A.Forbidden(f"{who.username} may not fork sandbox {id} (another tenant's)")
        c.prove(e, body.tokens)
        # Scoped to the caller as an acquire's: nobody else's replay finds these children.
        rid = None if body.request_id is None else f"{who.key}:{body.request_id}"

        # As acquire: the handler learns of the caller's leaving and cancels the fork, whose
        # undo releases every child already made.
        done, children = await run_or_leave(
            request, c.forker.fork(id, body.n, body.timeout_s, rid), releaser(c))
        if not done:
            return _err(api.CLIENT_CLOSED, "client disconnected")
        return JSONResponse(api.Forked([_lease(ch) for ch in children]).to_json(),
                            status_code=201)

    @app.post(api.GROUP.path, status_code=201)
    async def group(body: api.GroupRequest, request: Request):
        """The rights of an acquire; an acquire's own answer per member, in order."""
        logs.add(job=body.job)
        who = await caller(request)
        tenant = tenant_for(who, body.namespace)
        logs.add(tenant=tenant)
        if tenant is not None:
            await auth.require(who, A.CREATE, tenant)
        labels.check(body.labels)
        c = ctl()
        rid = None if body.request_id is None else f"{who.key}:{body.request_id}"
        assert body.count is not None  # checked by the model
        done, leases = await run_or_leave(request, acquire_group(
            c, AcquireOrder.of(body, A.scoped_job(tenant, body.job), rid), body.count),
            releaser(c))
        if not done:
            return _err(api.CLIENT_CLOSED, "client disconnected")
        return JSONResponse(api.Group([_lease(g) for g in leases]).to_json(), status_code=201)

    def releaser(c: Controller):
        """`on_late` of a call that hands out several sandboxes: nobody will read their
        tokens."""
        async def release_all(leases: list[dict]) -> None:
            for lease in leases:
                await c.release(lease["id"])
        return release_all

    async def run_or_leave(request: Request, coro, on_late) -> tuple[bool, Any]:
        """(True, result) of `coro`, or (False, None) when the caller left first: then it is
        cancelled (its undo runs by itself) and `on_late(result)` undoes one that finished in
        the same tick. Starlette does not cancel a handler whose client left: the disconnect
        message is awaited beside the call (no polling)."""
        task = asyncio.ensure_future(coro)
        gone = asyncio.ensure_future(_disconnect(request))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                await asyncio.sleep(0)
        finally:
            gone.cancel()
        if task.done() and not (gone.done() and not gone.cancelled()
                                and gone.exception() is None):
            return True, task.result()
        task.cancel()
        try:
            await on_late(await task)
        except (asyncio.CancelledError, AcquireError):
            pass
        return False, None

    async def checkpointable(who: A.Caller, c: Controller, sid: str, verb: str):
        """A handed-out sandbox the caller may read the state of (create in its tenant, as a
        fork); 404 and 403 as fork's."""
        e = c.get(sid)
        if e is None:
            if auth.enabled:
                await auth.require(who, A.CREATE, who.namespace or A.CLUSTER)
            raise SandboxGone(f"no sandbox {sid}")
        if auth.enabled and not await may_see(who, A.CREATE, e):
            raise A.Forbidden(f"{who.username} may not {verb} sandbox {sid} "
                              "(another tenant's)")
        return c.checkpoints.leased(sid)

    @app.post(api.CHECKPOINT.path, status_code=201)
    async def checkpoint(request: Request, body: api.CheckpointRequest):
        who = await caller(request)
        c = ctl()
        if body.job is not None:
            tenant = tenant_for(who, body.namespace)
            logs.add(tenant=tenant, job=body.job)
            if tenant is not None:
                await auth.require(who, A.CREATE, tenant)
            entries = c.checkpoints.of_job(A.scoped_job(tenant, body.job))
        else:
            entries = [await checkpointable(who, c, sid, "checkpoint") for sid in body.ids or ()]
        for e in entries:  # each of the caller's tenant (checked above)
            c.prove(e, body.tokens)

        async def nothing(_r) -> None:
            return None  # a set nobody got the id of expires with its TTL
        done, result = await run_or_leave(request, c.checkpoints.checkpoint(
            entries, body.timeout_s), nothing)
        if not done:
            return _err(api.CLIENT_CLOSED, "client disconnected")
        return JSONResponse(result.to_json(), status_code=201)

    @app.post(api.PAUSE.path)
    async def pause(id: str, request: Request, body: api.RestoreRequest | None = None):
        """A checkpoint of one sandbox, then its release (the rights of a checkpoint)."""
        logs.add(sandbox=id)
        who = await caller(request)
        c = ctl()
        e = await checkpointable(who, c, id, "pause")
        c.prove(e, body.tokens if body else None)

        async def keep(_r) -> None:
            return None  # the caller never got the id: the sandbox stays leased, not lost
        done, result = await run_or_leave(request, c.checkpoints.checkpoint(
            [e], body.timeout_s if body else api.DEFAULT_ACQUIRE_TIMEOUT_S), keep)
        if not done:
            return _err(api.CLIENT_CLOSED, "client disconnected")
        # Recorded before the release: a holder that lost this answer still finds the
        # checkpoint (410) by the old id, from this leader or the next. Unrecorded: the
        # sandbox stays leased and the answer says so (the checkpoint itself is valid).
        try:
            await c.paused.record(id, PausedSandbox(e.job, result.id,
                                                    until_of(result.expires_at)))
        except Unrecorded as ex:
            log.error("pause of %s: %s; left leased (checkpoint %s is valid)", id, ex,
                      result.id)
            raise CheckpointFailed(f"{ex}: the sandbox stays leased, not paused; its "
                                   f"checkpoint {result.id} is valid (restore it, or pause "
                                   "again)") from None
        if not await c.release(id):
            await c.paused.unrecord([id])  # released meanwhile by its holder: not paused
        return result.to_json()

    @app.post(api.RESTORE.path, status_code=201)
    async def restore(id: str, request: Request, body: api.RestoreRequest | None = None):
        """The rights of an acquire in the checkpoint's tenant (named in its id): another
        tenant's id is refused before the registry is asked."""
        who = await caller(request)
        body = body or api.RestoreRequest()
        tenant = None
        if auth.enabled:
            tenant = parse_id(id)[0]
            logs.add(tenant=tenant)
            if not await auth.allowed(who, A.CREATE, tenant):
                raise A.Forbidden(f"{who.username} may not restore checkpoint {id[:100]} "
                                  "(another tenant's)")
        c = ctl()
        rid = None if body.request_id is None else f"{who.key}:{body.request_id}"

        async def release_all(got) -> None:
            for lease in got.values():
                await c.release(lease["id"])
        done, got = await run_or_leave(request, c.checkpoints.restore(
            id, tenant, body.timeout_s, rid), release_all)
        if not done:
            return _err(api.CLIENT_CLOSED, "client disconnected")
        return JSONResponse({"sandboxes": {k: _lease(v).to_json() for k, v in got.items()}},
                            status_code=201)

    @app.post(api.PREWARM.path)
    async def prewarm(body: api.PrewarmRequest, request: Request):
        who = await caller(request)
        await auth.require(who, A.CREATE, A.CLUSTER, A.PREWARM_SUB)
        c = ctl()
        spec = await c.pinned_spec(SandboxSpec.of(body.image, body.spec))
        pool = c.prewarm(spec, body.count, body.idle_timeout_s)
        return api.PoolStatus(target=pool.target, warm=len(pool.warm), building=pool.building,
                              idle_timeout_s=pool.idle_timeout).to_json()

    @app.post(api.PREPULL.path)
    async def prepull(body: api.PrepullRequest, request: Request):
        """Admin: pods on every node of the pool, made by no tenant (cluster-wide create)."""
        who = await caller(request)
        await auth.require(who, A.CREATE, A.CLUSTER, A.IMAGES_SUB)
        return (await ctl().prepull.post(body.images)).to_json()

    @app.get(api.IMAGES.path)
    async def images(request: Request):
        who = await caller(request)
        await auth.require(who, A.GET, A.CLUSTER, A.IMAGES_SUB)
        return ctl().prepull.status().to_json()

    @app.post(api.DRAIN.path)
    async def drain(job: str, request: Request, namespace: str | None = None):
        """The job of the caller's tenant (or of `namespace`): never another tenant's."""
        logs.add(job=job)
        who = await caller(request)
        tenant = tenant_for(who, namespace)
        logs.add(tenant=tenant)
        if tenant is not None:
            await auth.require(who, A.DELETECOLLECTION, tenant)
        key = A.scoped_job(tenant, job)
        return api.Drained(job, await ctl().drain(key)).to_json()

    @app.get(api.STATS.path)
    async def stats(request: Request):
        who = await caller(request)
        await auth.require(who, A.GET, A.CLUSTER, A.STATS_SUB)
        return api.Stats(**ctl().stats()).to_json()

    @app.get(api.HEALTHZ.path)
    @app.get(api.LIVEZ.path)
    async def livez():
        # Liveness: the process and its event loop answer. Never the API server or the lease:
        # an API outage must not restart every replica (a leader that loses the lease exits
        # by itself, crash-only).
        return {"ok": True}

    @app.get(api.READYZ.path)
    async def readyz():
        """Ready = this replica can serve API calls, never "this replica leads": the leader
        once its informer has synced its books; a standby while it reads the Lease from the
        API server (within the lease duration), since it forwards calls to the leader. A
        standby answering 503 here kept a 2-replica Deployment at 1/2 Ready: `helm install
        --wait` timed out and a rolling update (maxUnavailable 0) never removed the old
        leader. kwok marks pods Ready without probes, so only a real kubelet showed it."""
        c = state.get("controller")
        if c is not None:
            if c.ready:
                return {"ok": True, "role": "leader"}
            return _err(api.NOT_READY, "leader: books not synced yet")
        el = state.get("elector")
        if el is None:
            return _err(api.NOT_READY, "starting")
        if el.is_leader:
            return _err(api.NOT_READY, "elected: syncing the books")
        if not el.connected():
            return _err(api.NOT_READY, f"no answer from the API server within {el.duration:g}s")
        return {"ok": True, "role": "standby", "leader": el.holder}

    @app.get(api.METRICS.path)
    async def metrics_route():
        return PlainTextResponse(generate_latest().decode(), media_type=CONTENT_TYPE_LATEST)

    return app


# X-Request-Id: a caller's own id for its call (kept when it is a short plain token, so
# nothing a caller sends can forge another field or flood a line), else one made here; the
# answer carries it back, and every line logged while serving the call has it as `request_id`.
REQUEST_ID_HEADER = "x-request-id"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
_REQUEST_ID_KEY = REQUEST_ID_HEADER.encode()


class RequestContext:
    """ASGI middleware around the API: the call's request id bound for its log lines, and the
    per-route request metrics, labelled by the route's TEMPLATE (`/v1/sandboxes/{id}`, never
    the path with an id in it; a path no route matches is `unmatched`), so no caller can add
    a series (controller/metrics.py `http_request`)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or ()).get(_REQUEST_ID_KEY, b"").decode("latin-1")
        rid = given if _REQUEST_ID.fullmatch(given) else secrets.token_hex(8)
        status = 500  # an exception before the answer started is a 500 to the caller
        t0 = time.perf_counter()

        async def sending(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [
                    *(h for h in message.get("headers", ()) if h[0].lower() != _REQUEST_ID_KEY),
                    (_REQUEST_ID_KEY, rid.encode())]}
            await send(message)

        tracing.attributes(request_id=rid)  # the server span's, when tracing is on
        try:
            with logs.bind(request_id=rid):
                await self.app(scope, receive, sending)
        finally:
            route = scope.get("route")
            metrics.http_request(getattr(route, "path", None), scope.get("method", ""),
                                 status, time.perf_counter() - t0)


async def _disconnect(request: Request) -> None:
    """Returns once the client has gone (the body was already read by FastAPI)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


def _lease(result: dict) -> api.Lease:
    """The controller's acquire result as the contract's answer (a key it does not know fails
    here, loudly, not in a client)."""
    check = result.get("conditions")
    return api.Lease(**{**result, "timings": api.Timings(**result["timings"]),
                        "conditions": api.ConditionsCheck(**check) if check else None})


def _view(c: Controller, e, split) -> api.SandboxView:
    """`problem`: its node is down (controller/lost.py), read from the Node object only."""
    tenant, job = split(e.job)
    return api.SandboxView(id=e.id, pod=e.name, job=job, state=e.state, address=e.ip,
                           port=c.s.execd_port, image=e.spec.image, cpu=e.spec.cpu,
                           memory=e.spec.memory, egress=e.spec.egress, tenant=tenant,
                           egress_allow=list(e.spec.egress_allow) or None,
                           expires_at=iso_utc(e.expires_at) if e.expires_at else None,
                           lifetime_s=e.lifetime if e.expires_at else None,
                           problem=c.nodes.problem(e))
