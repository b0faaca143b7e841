"""The controller's traces (docs/metrics.md, "Traces"): off unless --otlp-endpoint names an
OTLP/HTTP receiver; then the API's spans (FastAPI's own telemetry, the caller's W3C
traceparent as their parent), an acquire's phases (queue, create, ready) and each execd call
made for a caller, exported in batches.

Only the W3C trace context is read from callers and sent on: the process's propagator is
set to tracecontext alone, so a caller's `baggage` never reaches execd or the logs. Spans the
controller makes on its own (warm builds, sweeps, readiness polls of warm pods) have no caller
to belong to and are not made: `child()` starts a span only under a recording one."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import propagate, trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from sandman import tracing
from sandman._version import __version__
from sandman.tracing import inject, record_execd, set_attributes

__all__ = ["attributes", "check_endpoint", "child", "configure", "inject", "record_execd",
           "set_attributes", "shutdown"]

log = logging.getLogger(__name__)

SERVICE = "sandman-controller"
# A slow or gone receiver costs the controller a bounded queue, never a request: spans past it
# are dropped (counted by the SDK's own log line), each export waits at most EXPORT_TIMEOUT_S.
QUEUE_MAX = 4096
EXPORT_TIMEOUT_S = 5.0


def check_endpoint(url: str) -> str:
    """The receiver's base URL (`http(s)://host:port`, OTEL_EXPORTER_OTLP_ENDPOINT's form),
    or ValueError with one line."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--otlp-endpoint {url!r}: want http(s)://host[:port]")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"--otlp-endpoint {url!r}: no credentials, query or fragment")
    return url.rstrip("/")


def configure(endpoint: str, sample_ratio: float = 1.0) -> TracerProvider | None:
    """The process's tracer provider, exporting to `endpoint` (None: tracing off, the API's
    no-op). `sample_ratio` of the traces the controller starts; a caller's sampled flag is
    followed (ParentBased), so a trainer that traces every call sees them all."""
    propagate.set_global_textmap(TraceContextTextMapPropagator())
    if not endpoint:
        return None
    base = check_endpoint(endpoint)
    if not 0.0 <= sample_ratio <= 1.0:
        raise ValueError(f"--trace-sample-ratio {sample_ratio}: want 0 to 1")
    provider = TracerProvider(
        resource=Resource.create({"service.name": SERVICE, "service.version": __version__}),
        sampler=ParentBased(TraceIdRatioBased(sample_ratio)))
    provider.add_span_processor(BatchSpanProcessor(
        OTLPSpanExporter(endpoint=f"{base}/v1/traces", timeout=EXPORT_TIMEOUT_S),
        max_queue_size=QUEUE_MAX))
    trace.set_tracer_provider(provider)
    log.info("traces: exported to %s/v1/traces (sample ratio %g)", base, sample_ratio)
    return provider


def shutdown(provider: TracerProvider | None) -> None:
    """Export what is queued (bounded by the exporter's timeout) and stop."""
    if provider is not None:
        try:
            provider.shutdown()
        except Exception as e:  # noqa: BLE001 - exiting anyway
            log.warning("traces: shutdown failed: %s", e)


@contextlib.contextmanager
def child(name: str, attributes: Mapping[str, Any] | None = None,
          kind: str = "internal") -> Iterator[Any]:
    """A span under the current one when that one records (a caller's request), else none."""
    if not trace.get_current_span().is_recording():
        yield None
        return
    with tracing.span(name, kind, attributes) as s:
        yield s


def attributes(**values: Any) -> None:
    """Set `sandman.<name>` attributes on the current span, when it records."""
    tracing.set_attributes(trace.get_current_span() if trace.get_current_span().is_recording()
                           else None, {f"sandman.{k}": v for k, v in values.items()})
