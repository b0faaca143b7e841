"""The trace tests' OTLP receiver (tests/otlp_receiver.py) is real and stays on 127.0.0.1: spans
the OpenTelemetry SDK exports over OTLP/HTTP from two services come back from Jaeger's query
API as one trace, parent and services intact; Jaeger listens only where the module says
(several test workers run it at once), and leaves no process behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from tests.otlp_receiver import Jaeger, JaegerError

# Jaeger's default listeners: none of them may be opened (another worker's Jaeger, or anything
# else on the machine, may hold them). OTLP gRPC/HTTP, its metrics, health check, pprof, zipkin,
# remote sampling HTTP/gRPC, query HTTP/gRPC, the Jaeger receiver's gRPC/thrift ports.
DEFAULT_PORTS = {4317, 4318, 8888, 13133, 1777, 9411, 5778, 5779, 16686, 16685, 14250, 14268,
                 6831, 6832, 55679}


def _provider(service: str, jaeger: Jaeger) -> TracerProvider:
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=jaeger.traces_url,
                                                                     timeout=10)))
    return provider


def _sockets(pid: int) -> list[tuple[str, str, int, str]]:
    """(protocol, local address, port, state) of every inet socket the process holds, from
    /proc (state 0A is TCP LISTEN)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for proto in ("tcp", "tcp6", "udp", "udp6"):
        for line in Path(f"/proc/{pid}/net/{proto}").read_text().splitlines()[1:]:
            f = line.split()
            if f[9] in inodes:
                addr, port = f[1].rsplit(":", 1)
                out.append((proto, addr, int(port, 16), f[3]))
    return out


def test_spans_of_two_services_come_back_as_one_trace_with_their_parent(otlp_receiver):
    jaeger = otlp_receiver
    sdk, controller = _provider("sandman-sdk", jaeger), _provider("sandman-controller", jaeger)
    carrier: dict[str, str] = {}
    with sdk.get_tracer("test").start_as_current_span("create", kind=SpanKind.CLIENT,
                                                      attributes={"sandbox.count": 2}) as p:
        TraceContextTextMapPropagator().inject(carrier)  # what crosses the wire
    parent = p.get_span_context()
    ctx = TraceContextTextMapPropagator().extract(carrier)
    with controller.get_tracer("test").start_as_current_span(
            "POST /sandboxes", context=ctx, kind=SpanKind.SERVER,
            attributes={"http.route": "/sandboxes"}) as c:
        pass
    sdk.shutdown()
    controller.shutdown()
    trace_id = f"{parent.trace_id:032x}"

    spans = jaeger.wait_for(trace_id, lambda s: len(s) == 2, timeout_s=15)

    by_name = {s["name"]: s for s in spans}
    root, child = by_name["create"], by_name["POST /sandboxes"]
    assert root["span_id"] == f"{parent.span_id:016x}"
    assert root["parent_span_id"] is None
    assert child["span_id"] == f"{c.get_span_context().span_id:016x}"
    assert child["parent_span_id"] == root["span_id"]
    assert {s["trace_id"] for s in spans} == {trace_id}
    assert (root["service"], root["kind"]) == ("sandman-sdk", "client")
    assert (child["service"], child["kind"]) == ("sandman-controller", "server")
    assert root["attributes"]["sandbox.count"] == 2
    assert child["attributes"]["http.route"] == "/sandboxes"
    assert root["start_ns"] <= child["start_ns"] <= child["end_ns"]
    # Another trace id is not this one: [] (404 from the query API), not an error.
    assert jaeger.trace(f"{parent.trace_id ^ 1:032x}") == []


def test_listens_only_on_loopback_and_on_none_of_jaegers_default_ports(otlp_receiver):
    jaeger = otlp_receiver
    socks = _sockets(jaeger.pid)
    listening = [s for s in socks if s[0].startswith("udp") or s[3] == "0A"]
    # 0100007F is 127.0.0.1 as /proc writes it; nothing on 0.0.0.0, ::, or another address.
    assert {(p, a) for p, a, _port, _st in listening} == {("tcp", "0100007F")}, socks
    ports = {port for _p, _a, port, _st in listening}
    assert len(ports) == 3, socks  # OTLP/HTTP, query HTTP, query gRPC
    assert {jaeger.otlp_port, jaeger.query_port} < ports
    assert not ports & DEFAULT_PORTS, socks


def test_stop_leaves_no_process_and_no_folder():
    with Jaeger() as jaeger:  # the context manager starts it, and stops it if a check fails
        pid, folder = jaeger.pid, jaeger.folder
        assert Path(f"/proc/{pid}").exists() and folder.is_dir()
    assert not Path(f"/proc/{pid}").exists()  # killed and reaped: not even a zombie
    assert not folder.exists()
    jaeger.stop()  # twice is harmless (the context manager's exit did it once)


def test_wait_for_says_what_it_saw_when_the_predicate_stays_false(otlp_receiver):
    jaeger = otlp_receiver
    provider = _provider("lonely", jaeger)
    with provider.get_tracer("test").start_as_current_span("only") as span:
        pass
    provider.shutdown()
    trace_id = f"{span.get_span_context().trace_id:032x}"
    jaeger.wait_for(trace_id, lambda s: len(s) == 1, timeout_s=15)
    with pytest.raises(AssertionError, match=r"has 1 spans .*'lonely', 'only'"):
        jaeger.wait_for(trace_id, lambda s: len(s) == 2, timeout_s=0.3)


def test_a_missing_binary_is_a_one_line_error_naming_make_jaeger(tmp_path):
    with pytest.raises(JaegerError, match=r"not built at .*: run `make jaeger`"):
        Jaeger(binary=tmp_path / "jaeger").start()


def test_a_jaeger_that_dies_at_start_is_an_error_with_its_log(tmp_path):
    fake = tmp_path / "jaeger"
    fake.write_text("#!/bin/sh\necho 'cannot start: bad config' >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(JaegerError, match=r"(?s)exited 3 .*cannot start: bad config"):
        Jaeger(binary=fake).start(timeout_s=10)
