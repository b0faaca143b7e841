"""Spans for sandman's calls, through the OpenTelemetry API when the process has it
(docs/metrics.md, "Traces").

The SDK and the controller make their spans with the OpenTelemetry *API* only, so a trainer
decides where they go: without `opentelemetry-api` installed, or with no tracer provider set,
every function here is a no-op and costs a few attribute reads. The W3C `traceparent` of the
current span goes on every request to the controller and to execd, so one trace follows an
acquire from the trainer through the controller's phases, and an exec or a grade into the pod.

execd exports nothing: it is stdlib-only, and a sandbox pod's egress is the holder's to use, so
a collector reachable from execd would be reachable from the agent too. It reads the
`traceparent` into its log lines and answers `Server-Timing: execd;dur=<ms>`, which the
caller's span keeps as `sandman.execd.duration_ms` (the time execd spent on the request).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

from sandman import execd_api
from sandman._version import __version__

try:
    from opentelemetry import propagate as _propagate
    from opentelemetry import trace as _trace
except ImportError:  # the client distribution does not depend on it
    _trace = None  # type: ignore[assignment]
    _propagate = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from opentelemetry.trace import Span

SCOPE = "sandman"
EXECD_DURATION_ATTR = "sandman.execd.duration_ms"
# One metric of Server-Timing (RFC-less, W3C): `execd;dur=12.5`, possibly among others.
_EXECD_TIMING = re.compile(r"(?:^|,)\s*" + re.escape(execd_api.SERVER_TIMING_NAME)
                           + r"\s*;\s*dur=([0-9]{1,9}(?:\.[0-9]{1,6})?)\s*(?:[;,]|$)")


def enabled() -> bool:
    return _trace is not None


@contextlib.contextmanager
def span(name: str, kind: str = "internal",
         attributes: Mapping[str, Any] | None = None) -> Iterator[Span | None]:
    """The current span for the block (a child of the caller's), or None without the API.
    An exception leaving the block is recorded on the span and sets its status to error."""
    if _trace is None:
        yield None
        return
    tracer = _trace.get_tracer(SCOPE, __version__)
    attrs = {k: v for k, v in (attributes or {}).items() if v is not None}
    with tracer.start_as_current_span(name, kind=_KINDS[kind], attributes=attrs) as s:
        yield s


def inject(headers: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """Put the current span's context (`traceparent`, and what else the process's propagator
    carries) into `headers`; nothing without the API or outside a recording span."""
    if _propagate is not None:
        _propagate.inject(headers)
    return headers


def set_attributes(s: Span | None, attributes: Mapping[str, Any]) -> None:
    if s is not None:
        for k, v in attributes.items():
            if v is not None:
                s.set_attribute(k, v)


def execd_duration_ms(server_timing: str | None) -> float | None:
    """execd's own time on a request, from its answer's Server-Timing header (None when absent
    or not as execd writes it: the header is data from the pod, never trusted beyond a number)."""
    if not server_timing or len(server_timing) > 512:
        return None
    m = _EXECD_TIMING.search(server_timing)
    return float(m.group(1)) if m else None


def record_execd(s: Span | None, headers: Mapping[str, str]) -> None:
    if s is None:
        return
    dur = execd_duration_ms(headers.get(execd_api.SERVER_TIMING_HEADER))
    if dur is not None:
        s.set_attribute(EXECD_DURATION_ATTR, dur)


if _trace is not None:
    _KINDS = {"internal": _trace.SpanKind.INTERNAL, "client": _trace.SpanKind.CLIENT,
              "server": _trace.SpanKind.SERVER}
else:
    _KINDS = {}
