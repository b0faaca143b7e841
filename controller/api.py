"""The controller's HTTP API (FastAPI). Errors are JSON `{"error": {"type", "message",
"events"}}` with a type the SDK maps to a typed exception."""

from __future__ import annotations

import asyncio
import logging
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, field_validator

from controller.core import AcquireError, Controller, NotLeader, SandboxSpec
from controller.forward import not_leader_headers
from sandman import contract

log = logging.getLogger("controller.api")


class Owner(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    uid: str


def _quantity(v):
    if isinstance(v, bool) or not isinstance(v, (str, int, float)):
        raise ValueError("must be a Kubernetes quantity such as 2, 500m or 8Gi")
    return str(v)


class SpecBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cpu: str = "2"
    memory: str = "8Gi"
    workspace: str | None = None
    egress: Literal["deny", "allow"] = contract.EGRESS_DENY

    _q = field_validator("cpu", "memory", mode="before")(classmethod(lambda cls, v: _quantity(v)))


class AcquireBody(SpecBody):
    image: str
    job: str
    owner: Owner | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    timeout_s: float = Field(300.0, gt=0, le=3600)
    warm_ok: bool = True
    wait: bool = True
    # Idempotency key: a retry with the same key (and job) gets the same sandbox back.
    request_id: str | None = Field(None, min_length=1, max_length=128)


class PrewarmBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    image: str
    spec: SpecBody = Field(default_factory=SpecBody)
    count: int = Field(ge=0)
    idle_timeout_s: float | None = Field(None, gt=0)


def _err(status: int, kind: str, message: str, events: list[str] | None = None,
         headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"type": kind, "message": message, "events": events or []}},
                        status_code=status, headers=headers)


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
        return _err(exc.status, exc.kind, str(exc), exc.events, headers)

    @app.exception_handler(RequestValidationError)
    async def _bad(_req, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return _err(422, "BadRequest", f"{where or 'body'}: {first.get('msg', 'invalid request')}")

    @app.post("/v1/sandboxes", status_code=201)
    async def acquire(body: AcquireBody, request: Request):
        c = ctl()
        spec = SandboxSpec(body.image, body.cpu, body.memory, body.workspace, body.egress)
        task = asyncio.ensure_future(c.acquire(
            spec, body.job, owner=body.owner.model_dump() if body.owner else None,
            labels=body.labels, timeout_s=body.timeout_s, warm_ok=body.warm_ok, wait=body.wait,
            request_id=body.request_id))
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
            return JSONResponse(task.result(), status_code=201)
        task.cancel()
        try:
            result = await task
            # Finished in the same tick: nobody will ever read this token.
            await c.release(result["id"])
        except (asyncio.CancelledError, AcquireError):
            pass
        return _err(499, "ClientClosed", "client disconnected")

    @app.get("/v1/sandboxes")
    async def list_sandboxes(job: str | None = None):
        c = ctl()
        return {"items": [_view(c, e) for e in c.entries.values()
                          if e.state not in ("gone",) and (job is None or e.job == job)]}

    @app.get("/v1/sandboxes/{sid}")
    async def get_sandbox(sid: str):
        c = ctl()
        e = c.get(sid)
        if e is None:
            return _err(404, "SandboxGone", f"no sandbox {sid}")
        return _view(c, e)

    @app.delete("/v1/sandboxes/{sid}")
    async def release(sid: str):
        return {"id": sid, "released": await ctl().release(sid)}

    @app.post("/v1/prewarm")
    async def prewarm(body: PrewarmBody):
        c = ctl()
        s = body.spec
        spec = SandboxSpec(body.image, s.cpu, s.memory, s.workspace, s.egress)
        pool = c.prewarm(spec, body.count, body.idle_timeout_s)
        return {"target": pool.target, "warm": len(pool.warm), "building": pool.building,
                "idle_timeout_s": pool.idle_timeout}

    @app.post("/v1/jobs/{job}/drain")
    async def drain(job: str):
        return {"job": job, "deleting": await ctl().drain(job)}

    @app.get("/v1/stats")
    async def stats():
        return ctl().stats()

    @app.get("/healthz")
    @app.get("/livez")
    async def livez():
        # Liveness: the process and its event loop answer. Never the API server or the lease:
        # an API outage must not restart every replica (a leader that loses the lease exits
        # by itself, crash-only).
        return {"ok": True}

    @app.get("/readyz")
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
            return _err(503, "NotReady", "leader: books not synced yet")
        el = state.get("elector")
        if el is None:
            return _err(503, "NotReady", "starting")
        if el.is_leader:
            return _err(503, "NotReady", "elected: syncing the books")
        if not el.connected():
            return _err(503, "NotReady",
                        f"no answer from the API server within {el.duration:g}s")
        return {"ok": True, "role": "standby", "leader": el.holder}

    @app.get("/metrics")
    async def metrics_route():
        return PlainTextResponse(generate_latest().decode(), media_type=CONTENT_TYPE_LATEST)

    return app


async def _disconnect(request: Request) -> None:
    """Returns once the client has gone (the body was already read by FastAPI)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


def _view(c: Controller, e) -> dict:
    return {"id": e.id, "pod": e.name, "job": e.job, "state": e.state, "address": e.ip,
            "port": c.s.execd_port, "image": e.spec.image, "cpu": e.spec.cpu,
            "memory": e.spec.memory, "egress": e.spec.egress}
