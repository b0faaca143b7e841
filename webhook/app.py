"""The HTTP layer: `AdmissionFastPath` answers POST /mutate and /validate around
webhook.admission; FastAPI serves the rest (health, readiness, metrics). Bodies are parsed with
json, not pydantic models: the handler is on every labelled pod create and must stay around a
millisecond.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from sandman.sandbox import SandboxPolicy
from webhook import admission
from webhook.metrics import Metrics

log = logging.getLogger("webhook")

# etcd stores objects up to 1.5 MiB; a review carries the object and, on UPDATE, the old one.
MAX_BODY_BYTES = 4 * 1024 * 1024
# All request bodies held at once: past this, 503 (a refused sandbox) instead of memory growth
# until the kernel kills the webhook (paper: one 384 MiB replica, 115 restarts, 6,126 failed
# creates of other jobs). Real reviews are ~5-10 KiB, so this only bites under abuse.
BODY_BUDGET_BYTES = 64 * 1024 * 1024


def answer(operation: str, body: bytes, policy: SandboxPolicy,
           metrics: Metrics) -> tuple[int, bytes]:
    """(HTTP status, JSON body) for one AdmissionReview; counts and times it."""
    start = time.perf_counter()
    try:
        if len(body) > MAX_BODY_BYTES:
            metrics.count(operation, "error", "bad-request")
            return 413, b'{"error":"body too large"}'
        try:
            review = json.loads(body)
            if operation == "mutate":
                out, reason, size = admission.mutate(review, policy)
                if size:
                    metrics.patch_bytes.observe(size)
            else:
                out, reason = admission.validate(review, policy)
        except (ValueError, admission.BadReview) as e:
            metrics.count(operation, "error", "bad-request")
            return 400, json.dumps({"error": str(e)}).encode()
        except Exception:
            log.exception("%s failed", operation)
            metrics.count(operation, "error", "internal-error")
            return 500, b'{"error":"internal error"}'
        allowed = out["response"]["allowed"]
        metrics.count(operation, "allowed" if allowed else "denied", reason)
        if not allowed:
            req = review["request"]
            log.info("%s denied %s/%s: %s", operation, req.get("namespace"),
                     (req.get("object") or {}).get("metadata", {}).get("name")
                     or req.get("name"), out["response"]["status"]["message"])
        return 200, json.dumps(out, separators=(",", ":")).encode()
    finally:
        metrics.duration.labels(operation).observe(time.perf_counter() - start)


class AdmissionFastPath:
    """ASGI wrapper answering POST /mutate and /validate without FastAPI's routing and request
    objects (about 0.1 ms of the ~1 ms a call costs, measured); the only server of those two
    routes. Everything else goes to the FastAPI app."""

    ROUTES = {"/mutate": "mutate", "/validate": "validate"}

    def __init__(self, app: FastAPI, policy: SandboxPolicy, metrics: Metrics,
                 budget: int = BODY_BUDGET_BYTES):
        self.app, self.policy, self.metrics, self.budget = app, policy, metrics, budget
        self.buffered = 0  # request bytes held by all requests being received right now

    async def __call__(self, scope, receive, send):
        operation = self.ROUTES.get(scope.get("path")) if scope["type"] == "http" else None
        if operation is None or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        try:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                chunk = message.get("body", b"")
                if size <= MAX_BODY_BYTES:  # past it, answer() refuses with 413; stop keeping
                    chunks.append(chunk)
                    self.buffered += len(chunk)
                size += len(chunk)
                if not message.get("more_body"):
                    break
            if self.buffered > self.budget:
                self.metrics.count(operation, "error", "overloaded")
                status, payload = 503, b'{"error":"webhook overloaded"}'
            else:
                status, payload = answer(operation, b"".join(chunks), self.policy, self.metrics)
        finally:
            self.buffered -= sum(len(c) for c in chunks)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})


def create_app(policy: SandboxPolicy, metrics: Metrics | None = None,
               ready: Callable[[], str | None] = lambda: None,
               background: Callable[[], Awaitable[None]] | None = None) -> FastAPI:
    """`ready()` returns None when serving is possible, else why not (for /readyz);
    `background` runs while the app is up (the certificate watcher). The admission routes are
    not here: wrap the app in `AdmissionFastPath` (webhook/server.py does)."""
    metrics = metrics or Metrics()

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        task = asyncio.get_running_loop().create_task(background()) if background else None
        yield
        if task:
            task.cancel()

    app = FastAPI(title="sandman webhook", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    app.state.metrics = metrics
    app.state.policy = policy

    @app.get("/healthz")
    async def healthz() -> Response:
        return Response(b"ok\n", media_type="text/plain")

    @app.get("/readyz")
    async def readyz() -> Response:
        why = ready()
        if why:
            return Response(f"not ready: {why}\n".encode(), 503, media_type="text/plain")
        return Response(b"ok\n", media_type="text/plain")

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
