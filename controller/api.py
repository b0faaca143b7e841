"""The controller's HTTP API (FastAPI): the routes, bodies and error types of `sandman/api.py`,
served. Errors are JSON `{"error": {"type", "message", "events"}}` with a type the SDK maps to
a typed exception."""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from controller.core import AcquireError, Controller, NotLeader, SandboxSpec
from controller.forward import not_leader_headers
from controller.pods import iso_utc
from sandman import api

log = logging.getLogger("controller.api")


def _err(e: api.ErrorType, message: str, events: list[str] | None = None, *,
         status: int | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(api.Error(e.type, message, events or []).to_json(),
                        status_code=status or e.status, headers=headers)


def build_app(state: dict) -> FastAPI:
    """`state["controller"]` is set once this replica leads; until then the API routes answer
    NotLeader (503). `state["elector"]` (the LeaderElector) tells a standby's /readyz whether
    it is in touch with the API server; on a standby, controller/forward.py sends API calls to
    the leader before they reach these routes."""
    app = FastAPI(title="sandman controller", version="0.1.0")

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
        return _err(api.ErrorType(exc.status, exc.kind), str(exc), exc.events, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _bad(_req, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        return _err(api.INVALID_BODY, f"{where}: {msg}" if where else msg)

    @app.post(api.ACQUIRE.path, status_code=201)
    async def acquire(body: api.AcquireRequest, request: Request):
        c = ctl()
        spec = SandboxSpec(body.image, body.cpu, body.memory, body.workspace, body.egress)
        task = asyncio.ensure_future(c.acquire(
            spec, body.job, owner=body.owner.to_json() if body.owner else None,
            labels=body.labels, timeout_s=body.timeout_s, warm_ok=body.warm_ok, wait=body.wait,
            request_id=body.request_id, lifetime_s=body.lifetime_s))
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
    async def list_sandboxes(job: str | None = None):
        c = ctl()
        return api.SandboxList([_view(c, e) for e in c.entries.values()
                                if e.state not in ("gone",)
                                and (job is None or e.job == job)]).to_json()

    @app.get(api.GET.path)
    async def get_sandbox(id: str):
        c = ctl()
        e = c.get(id)
        if e is None:
            return _err(api.SANDBOX_GONE, f"no sandbox {id}")
        return _view(c, e).to_json()

    @app.delete(api.RELEASE.path)
    async def release(id: str):
        return api.Released(id, await ctl().release(id)).to_json()

    @app.post(api.RENEW.path)
    async def renew(id: str, body: api.RenewRequest | None = None):
        c = ctl()
        e = await c.renew(id, body.lifetime_s if body else None)
        if e is None:
            return _err(api.SANDBOX_GONE, f"no handed-out sandbox {id} (released, drained or "
                                          "expired)")
        return _view(c, e).to_json()

    @app.post(api.PREWARM.path)
    async def prewarm(body: api.PrewarmRequest):
        c = ctl()
        s = body.spec
        spec = SandboxSpec(body.image, s.cpu, s.memory, s.workspace, s.egress)
        pool = c.prewarm(spec, body.count, body.idle_timeout_s)
        return api.PoolStatus(target=pool.target, warm=len(pool.warm), building=pool.building,
                              idle_timeout_s=pool.idle_timeout).to_json()

    @app.post(api.DRAIN.path)
    async def drain(job: str):
        return api.Drained(job, await ctl().drain(job)).to_json()

    @app.get(api.STATS.path)
    async def stats():
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


async def _disconnect(request: Request) -> None:
    """Returns once the client has gone (the body was already read by FastAPI)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


def _lease(result: dict) -> api.Lease:
    """The controller's acquire result as the contract's answer (a key it does not know fails
    here, loudly, not in a client)."""
    return api.Lease(**{**result, "timings": api.Timings(**result["timings"])})


def _view(c: Controller, e) -> api.SandboxView:
    return api.SandboxView(id=e.id, pod=e.name, job=e.job, state=e.state, address=e.ip,
                           port=c.s.execd_port, image=e.spec.image, cpu=e.spec.cpu,
                           memory=e.spec.memory, egress=e.spec.egress,
                           expires_at=iso_utc(e.expires_at) if e.expires_at else None,
                           lifetime_s=e.lifetime if e.expires_at else None)
