"""A real OTLP receiver for the trace tests: Jaeger v2 (tools/jaeger.py, `make jaeger`).

    with Jaeger().start() as jaeger:
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = jaeger.otlp_endpoint   # or jaeger.traces_url
        ...
        spans = jaeger.wait_for(trace_id, lambda spans: len(spans) == 3, timeout_s=10)

Spans go in over OTLP/HTTP and come back out of Jaeger's HTTP query API (/api/v3, OTLP JSON)
as plain dicts (`Span`), so a test asserts on what an exporter really sent, not on an in-memory
exporter's objects. Jaeger keeps them in memory; nothing is written outside a temporary folder
removed by stop().

Several test workers run side by side, so Jaeger opens only three listeners, all on 127.0.0.1
port 0 (the ports it got are read from its log): OTLP/HTTP, and the query extension's HTTP and
gRPC (the extension has no way to turn gRPC off). Everything else of Jaeger's default
configuration is left out: the OTLP gRPC, Jaeger and Zipkin receivers, the remote-sampling,
health-check and pprof extensions, and its own metrics endpoint (8888).
"""

from __future__ import annotations

import base64
import json
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from testbed.procs import Proc, reported_port
from tools import jaeger as jaeger_tool

Span = dict[str, Any]

START_TIMEOUT_S = 20.0
POLL_INTERVAL_S = 0.1
HTTP_TIMEOUT_S = 5.0
# OTLP's SpanKind and StatusCode enums, as the OTLP JSON encoding writes them (numbers).
KINDS = ("unspecified", "internal", "server", "client", "producer", "consumer")
STATUS_CODES = ("unset", "ok", "error")

CONFIG = """\
service:
  extensions: [jaeger_storage, jaeger_query]
  pipelines:
    traces:
      receivers: [otlp]
      exporters: [jaeger_storage_exporter]
  telemetry:
    metrics:
      level: none  # no Prometheus endpoint of its own (0.0.0.0:8888 by default)
    logs:
      level: info  # the "Starting ... server" lines carry the ports
      encoding: console
extensions:
  jaeger_storage:
    backends:
      memstore:
        memory:
          max_traces: 10000
  jaeger_query:
    storage:
      traces: memstore
    max_clock_skew_adjust: 0s  # report the timestamps the exporter sent
    http:
      endpoint: 127.0.0.1:0
    grpc:
      endpoint: 127.0.0.1:0
receivers:
  otlp:
    protocols:
      http:
        endpoint: 127.0.0.1:0
exporters:
  jaeger_storage_exporter:
    trace_storage: memstore
"""
# The log lines naming the ports each listener got (console encoding: message, tab, JSON fields).
OTLP_PORT_RE = r'Starting HTTP server\t\{[^\n]*"otelcol\.component\.id": "otlp"[^\n]*' \
    r'"endpoint": "127\.0\.0\.1:(\d+)"'
QUERY_PORT_RE = r'Starting HTTP server\t\{[^\n]*"otelcol\.component\.id": "jaeger_query"' \
    r'[^\n]*"port": (\d+)'


class JaegerError(RuntimeError):
    """Jaeger is not built, or did not start; the message says which (with its log's tail)."""


def _opener() -> urllib.request.OpenerDirector:
    # No proxy from the environment: the receiver is on 127.0.0.1.
    return urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _value(v: dict[str, Any]) -> Any:
    """An OTLP JSON AnyValue as a Python value."""
    if "stringValue" in v:
        return v["stringValue"]
    if "boolValue" in v:
        return v["boolValue"]
    if "intValue" in v:
        return int(v["intValue"])  # a string in OTLP JSON (64-bit)
    if "doubleValue" in v:
        return float(v["doubleValue"])
    if "bytesValue" in v:
        return base64.b64decode(v["bytesValue"])
    if "arrayValue" in v:
        return [_value(x) for x in v["arrayValue"].get("values", [])]
    if "kvlistValue" in v:
        return _attributes(v["kvlistValue"].get("values", []))
    return None


def _attributes(kvs: list[dict[str, Any]]) -> dict[str, Any]:
    return {kv["key"]: _value(kv.get("value", {})) for kv in kvs}


def _enum(value: Any, names: tuple[str, ...], prefix: str) -> str:
    """A number (OTLP JSON) or a name (`SPAN_KIND_SERVER`) as the short lower-case name."""
    if isinstance(value, str) and not value.isdigit():
        return value.removeprefix(prefix).lower()
    i = int(value or 0)
    return names[i] if 0 <= i < len(names) else str(i)


def spans_of(traces_data: dict[str, Any]) -> list[Span]:
    """The spans of an OTLP JSON TracesData, flattened, each with its resource and scope."""
    out = []
    for rs in traces_data.get("resourceSpans", []):
        resource = _attributes(rs.get("resource", {}).get("attributes", []))
        for ss in rs.get("scopeSpans", []):
            scope = ss.get("scope", {}).get("name", "")
            for s in ss.get("spans", []):
                status = s.get("status", {})
                out.append({
                    "name": s["name"],
                    "trace_id": s["traceId"].lower(),
                    "span_id": s["spanId"].lower(),
                    "parent_span_id": s.get("parentSpanId", "").lower() or None,
                    "service": resource.get("service.name"),
                    "kind": _enum(s.get("kind"), KINDS, "SPAN_KIND_"),
                    "attributes": _attributes(s.get("attributes", [])),
                    "resource": resource,
                    "scope": scope,
                    "start_ns": int(s["startTimeUnixNano"]),
                    "end_ns": int(s["endTimeUnixNano"]),
                    "status": _enum(status.get("code"), STATUS_CODES, "STATUS_CODE_"),
                    "status_message": status.get("message", ""),
                    "events": [{"name": e.get("name", ""),
                                "attributes": _attributes(e.get("attributes", []))}
                               for e in s.get("events", [])],
                })
    return out


class Jaeger:
    """One Jaeger process with in-memory storage, listening on 127.0.0.1 only."""

    def __init__(self, binary: Path | None = None) -> None:
        self.binary = binary or jaeger_tool.binary()
        self.otlp_port: int | None = None
        self.query_port: int | None = None
        self._proc: Proc | None = None
        self._dir: Path | None = None

    @property
    def otlp_endpoint(self) -> str:
        """The base URL, as OTEL_EXPORTER_OTLP_ENDPOINT takes it (the SDK adds /v1/traces)."""
        if self.otlp_port is None:
            raise JaegerError("Jaeger is not started")
        return f"http://127.0.0.1:{self.otlp_port}"

    @property
    def traces_url(self) -> str:
        """The OTLP/HTTP traces URL (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTLPSpanExporter's)."""
        return f"{self.otlp_endpoint}/v1/traces"

    @property
    def query_url(self) -> str:
        if self.query_port is None:
            raise JaegerError("Jaeger is not started")
        return f"http://127.0.0.1:{self.query_port}"

    @property
    def pid(self) -> int:
        if self._proc is None or self._proc.pid is None:
            raise JaegerError("Jaeger is not started")
        return self._proc.pid

    @property
    def folder(self) -> Path:
        """Its config and log (removed by stop())."""
        if self._dir is None:
            raise JaegerError("Jaeger is not started")
        return self._dir

    def start(self, timeout_s: float = START_TIMEOUT_S) -> Jaeger:
        if self._proc is not None:
            raise JaegerError("Jaeger is already started")
        if not self.binary.exists():
            raise JaegerError(f"Jaeger {jaeger_tool.VERSION} is not built at {self.binary}: "
                              "run `make jaeger` (make deps does)")
        self._dir = Path(tempfile.mkdtemp(prefix="sandman-jaeger-"))
        config = self._dir / "config.yaml"
        config.write_text(CONFIG)
        self._proc = Proc("jaeger", [str(self.binary), "--config", str(config)],
                          self._dir / "jaeger.log", cwd=self._dir).start()
        try:
            deadline = time.monotonic() + timeout_s
            try:
                self.otlp_port = reported_port(self._proc, OTLP_PORT_RE, deadline)
                self.query_port = reported_port(self._proc, QUERY_PORT_RE, deadline)
            except RuntimeError as e:
                raise JaegerError(str(e)) from None
            self._wait_ready(deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, deadline: float) -> None:
        """Until the query API answers and the OTLP receiver takes an (empty) export."""
        last = ""
        while True:
            try:
                with _opener().open(f"{self.query_url}/api/services", timeout=HTTP_TIMEOUT_S):
                    pass
                req = urllib.request.Request(self.traces_url, data=b"{}", method="POST",
                                             headers={"Content-Type": "application/json"})
                with _opener().open(req, timeout=HTTP_TIMEOUT_S):
                    return
            except (urllib.error.URLError, OSError) as e:
                last = str(e)
            assert self._proc is not None
            if not self._proc.alive():
                raise JaegerError(f"jaeger exited {self._proc.exit_code()} before it answered: "
                                  f"{self._log_tail()}")
            if time.monotonic() > deadline:
                raise JaegerError(f"jaeger did not answer in time ({last}): {self._log_tail()}")
            time.sleep(POLL_INTERVAL_S)

    def _log_tail(self, lines: int = 20) -> str:
        text = self._proc.tail(20000) if self._proc is not None else ""
        return "\n".join(text.splitlines()[-lines:])

    def trace(self, trace_id_hex: str) -> list[Span]:
        """The trace's spans as Jaeger has them now; [] when it has none (yet)."""
        url = f"{self.query_url}/api/v3/traces/{trace_id_hex.lower()}"
        try:
            with _opener().open(url, timeout=HTTP_TIMEOUT_S) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:
            if e.code == 404:  # {"error": {"httpCode": 404, "message": "No traces found"}}
                return []
            raise
        result = body.get("result", {})
        chunks = result if isinstance(result, list) else [result]
        return [s for chunk in chunks for s in spans_of(chunk)]

    def wait_for(self, trace_id_hex: str, predicate: Callable[[list[Span]], object],
                 timeout_s: float = 10.0) -> list[Span]:
        """The trace's spans once `predicate(spans)` holds; AssertionError with the last seen
        spans after `timeout_s` (exporters batch, so spans arrive late and in any order)."""
        deadline = time.monotonic() + timeout_s
        spans: list[Span] = []
        for _ in range(int(timeout_s / POLL_INTERVAL_S) + 2):
            spans = self.trace(trace_id_hex)
            if predicate(spans):
                return spans
            if time.monotonic() > deadline:
                break
            time.sleep(POLL_INTERVAL_S)
        seen = [(s["service"], s["name"], s["span_id"], s["parent_span_id"]) for s in spans]
        raise AssertionError(f"trace {trace_id_hex}: predicate still false after {timeout_s:g}s; "
                             f"Jaeger has {len(spans)} spans (service, name, id, parent): {seen}")

    def stop(self) -> None:
        """Kill Jaeger (its storage is memory: nothing to flush), wait for it, remove its folder."""
        if self._proc is not None:
            self._proc.kill()
            self._proc = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        self.otlp_port = self.query_port = None

    def __enter__(self) -> Jaeger:
        return self if self._proc is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
