"""The HTTP layer: FastAPI routes around webhook.admission. Bodies are parsed with json, not
pydantic models: the handler is on every labelled pod create and must stay around a millisecond.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from sandman.sandbox import SandboxPolicy
from webhook import admission
from webhook.metrics import Metrics

log = logging.getLogger("webhook")

# etcd stores objects up to 1.5 MiB; a review carries the object and, on UPDATE, the old one.
MAX_BODY_BYTES = 4 * 1024 * 1024
_JSON = "application/json"


def create_app(policy: SandboxPolicy, metrics: Metrics | None = None,
               ready: Callable[[], str | None] = lambda: None,
               background: Callable[[], Awaitable[None]] | None = None) -> FastAPI:
    """`ready()` returns None when serving is possible, else why not (for /readyz);
    `background` runs while the app is up (the certificate watcher)."""
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

    async def handle(request: Request, operation: str) -> Response:
        start = time.perf_counter()
        body = await request.body()
        try:
            if len(body) > MAX_BODY_BYTES:
                metrics.count(operation, "error", "bad-request")
                return Response(b'{"error":"body too large"}', 413, media_type=_JSON)
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
                return Response(json.dumps({"error": str(e)}).encode(), 400, media_type=_JSON)
            except Exception:
                log.exception("%s failed", operation)
                metrics.count(operation, "error", "internal-error")
                return Response(b'{"error":"internal error"}', 500, media_type=_JSON)
            allowed = out["response"]["allowed"]
            metrics.count(operation, "allowed" if allowed else "denied", reason)
            if not allowed:
                req = review["request"]
                log.info("%s denied %s/%s: %s", operation, req.get("namespace"),
                         (req.get("object") or {}).get("metadata", {}).get("name")
                         or req.get("name"), out["response"]["status"]["message"])
            return Response(json.dumps(out, separators=(",", ":")).encode(), 200, media_type=_JSON)
        finally:
            metrics.duration.labels(operation).observe(time.perf_counter() - start)

    @app.post("/mutate")
    async def mutate(request: Request) -> Response:
        return await handle(request, "mutate")

    @app.post("/validate")
    async def validate(request: Request) -> Response:
        return await handle(request, "validate")

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
