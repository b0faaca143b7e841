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
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from sandman import contract
from sandman.podspec import SandboxPolicy
from webhook import admission
from webhook.metrics import Metrics

log = logging.getLogger("webhook")

# A sandbox pod's review is ~5-10 KiB. Larger ones are refused (413) without being read: two
# clients sending 2 MB reviews raised every other review's latency from 2 ms to 0.5-1.3 s
# (issue 13), since reviews are parsed one at a time on the event loop. `--max-body-bytes`.
MAX_BODY_BYTES = 1024 * 1024
# All request bodies held at once: past this, 503 (a refused sandbox) instead of memory growth
# until the kernel kills the webhook (paper: one 384 MiB replica, 115 restarts, 6,126 failed
# creates of other jobs). Real reviews are ~5-10 KiB, so this only bites under abuse.
BODY_BUDGET_BYTES = 64 * 1024 * 1024


def too_large(limit: int) -> bytes:
    return json.dumps({"error": f"request body larger than {limit} bytes: refused unread (a "
                                "sandbox pod's AdmissionReview is ~10 KiB)"}).encode()


def answer(operation: str, body: bytes, policy: SandboxPolicy,
           metrics: Metrics, max_body: int = MAX_BODY_BYTES) -> tuple[int, bytes]:
    """(HTTP status, JSON body) for one AdmissionReview; counts and times it."""
    start = time.perf_counter()
    try:
        if len(body) > max_body:
            metrics.count(operation, "error", "bad-request")
            return 413, too_large(max_body)
        review: Any = None
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
            req = review.get("request") if isinstance(review, dict) else None
            log.exception("%s failed", operation,
                          extra=review_fields(req) if isinstance(req, dict) else None)
            metrics.count(operation, "error", "internal-error")
            return 500, b'{"error":"internal error"}'
        allowed = out["response"]["allowed"]
        metrics.count(operation, "allowed" if allowed else "denied", reason)
        if not allowed:
            req = review["request"]
            f = review_fields(req)
            log.info("%s denied %s/%s: %s", operation, f["namespace"], f["pod"],
                     out["response"]["status"]["message"], extra=f)
        return 200, json.dumps(out, separators=(",", ":")).encode()
    finally:
        metrics.duration.labels(operation).observe(time.perf_counter() - start)


def review_fields(req: dict) -> dict[str, str | None]:
    """The ids of a log line about a review (sandman/logs.py FIELDS): the pod and namespace,
    the review's uid as `request_id`, and for a pod the controller made, its sandbox id, job
    and tenant (from its labels). Only strings, each cut to 253 characters: the object has
    not been validated yet, so its labels may be anything."""
    def text(v: Any) -> str | None:
        return v[:253] if isinstance(v, str) and v else None

    def obj_at(d: dict, key: str) -> dict:
        v = d.get(key)
        return v if isinstance(v, dict) else {}

    meta = obj_at(obj_at(req, "object"), "metadata")
    labels = obj_at(meta, "labels")
    pod = text(meta.get("name")) or text(req.get("name"))
    tenant, job = text(labels.get(contract.LABEL_TENANT)), text(labels.get(contract.LABEL_JOB))
    if tenant and job and job.startswith(tenant + "."):
        job = job[len(tenant) + 1:]  # the controller's job key: `<tenant>.<job>`
    ours = labels.get(contract.LABEL_MANAGED_BY) == contract.MANAGED_BY_CONTROLLER
    return {"namespace": text(req.get("namespace")), "pod": pod,
            "request_id": text(req.get("uid")), "sandbox": pod if ours else None,
            "job": job, "tenant": tenant}


class AdmissionFastPath:
    """ASGI wrapper answering POST /mutate and /validate without FastAPI's routing and request
    objects (about 0.1 ms of the ~1 ms a call costs, measured); the only server of those two
    routes. Everything else goes to the FastAPI app."""

    ROUTES = {"/mutate": "mutate", "/validate": "validate"}

    def __init__(self, app: FastAPI, policy: SandboxPolicy, metrics: Metrics,
                 budget: int = BODY_BUDGET_BYTES, max_body: int = MAX_BODY_BYTES):
        self.app, self.policy, self.metrics, self.budget = app, policy, metrics, budget
        self.max_body = max_body
        self.buffered = 0  # request bytes held by all requests being received right now

    async def __call__(self, scope, receive, send):
        operation = self.ROUTES.get(scope.get("path")) if scope["type"] == "http" else None
        if operation is None or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        close = False
        try:
            declared = dict(scope.get("headers") or ()).get(b"content-length")
            if declared is not None and declared.isdigit() and int(declared) > self.max_body:
                # Refused before a byte of the body is read; the connection is closed, so the
                # rest of what the client sends is never read either.
                self.metrics.count(operation, "error", "bad-request")
                status, payload, close = 413, too_large(self.max_body), True
            else:
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > self.max_body:  # chunked, no length: stop reading at the bound
                        self.metrics.count(operation, "error", "bad-request")
                        status, payload, close = 413, too_large(self.max_body), True
                        break
                    chunks.append(chunk)
                    self.buffered += len(chunk)
                    if not message.get("more_body"):
                        break
                if close:
                    pass
                elif self.buffered > self.budget:
                    self.metrics.count(operation, "error", "overloaded")
                    status, payload = 503, b'{"error":"webhook overloaded"}'
                else:
                    status, payload = answer(operation, b"".join(chunks), self.policy,
                                             self.metrics, self.max_body)
        finally:
            self.buffered -= sum(len(c) for c in chunks)
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(payload)).encode())]
        if close:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


def create_app(policy: SandboxPolicy, metrics: Metrics | None = None,
               ready: Callable[[], str | None] = lambda: None,
               background: Callable[[], Coroutine[Any, Any, None]] | None = None) -> FastAPI:
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
