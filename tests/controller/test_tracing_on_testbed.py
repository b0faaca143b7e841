"""Traces on the bed, read back from a real OTLP receiver (Jaeger, tests/otlp_receiver.py): a
trainer process with its own OpenTelemetry SDK acquires, execs, grades and releases through
the SDK; the real controller (--otlp-endpoint) exports its spans; kwok pods with a real execd
each (the stand-in). One trace holds the trainer's spans, the controller's under them (the
W3C traceparent propagated), and execd's own time on each call."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import httpx
import pytest

from sandman import api
from tests.controller.test_checkpoint_on_testbed import registry  # noqa: F401

TRAINER = textwrap.dedent('''
    import json, sys
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from sandman.client import Client
    from sandman.client import grading as G

    a = json.loads(sys.argv[1])
    provider = TracerProvider(resource=Resource.create({"service.name": "trainer"}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=a["otlp"])))
    trace.set_tracer_provider(provider)
    out = {}
    with Client(a["url"]) as c, trace.get_tracer("trainer").start_as_current_span("rollout") as root:
        out["trace"] = format(root.get_span_context().trace_id, "032x")
        sb = c.acquire(a["image"], job="traced", timeout_s=60, cpu="1", memory="1Gi")
        out["sandbox"] = sb.id
        out["exec"] = sb.exec("echo traced").output
        sb.release()
        a["task"]["reference_patch"] = a["task"]["reference_patch"].encode("latin-1")
        task = G.Task(**{**a["task"], "test_files": tuple(a["task"]["test_files"]),
                         "exclude": G.NO_EXCLUDE})
        out["verdict"] = G.grade(c, task, b"", job="traced-grading").verdict.value
    provider.shutdown()
    print(json.dumps(out))
''')


@pytest.fixture
def stack(cluster, namespace, tmp_path, otlp_receiver, registry):  # noqa: F811
    from tests.controller.harness import standin_stack

    with standin_stack(cluster, namespace, tmp_path, "traced", "--otlp-endpoint",
                       otlp_receiver.otlp_endpoint, "--image-pinning", "resolve",
                       "--registry-insecure", registry.host) as (ctl, _standin):
        yield ctl


def _task(registry, tmp_path) -> dict:  # noqa: F811
    from testbed import taskimage

    registry.scratch("swe/traced:v1", "task=traced")
    repo = tmp_path / "repo"
    base = taskimage.make_repo(repo)
    return dict(name="calc-add", image=f"{registry.host}/swe/traced:v1", repo=str(repo),
                base_commit=base, test_files=list(taskimage.TEST_FILES),
                test_command=f"{sys.executable} -m pytest -q -p no:cacheprovider "
                             "tests/test_calc.py",
                python=sys.executable,
                reference_patch=taskimage.REFERENCE_PATCH.decode("latin-1"),
                time_limit_s=60, exclude=[])


def _by(spans: list[dict], service: str, name: str) -> list[dict]:
    return [s for s in spans if s["service"] == service and s["name"] == name]


def test_one_trace_from_the_trainer_through_the_controller_into_execd(stack, otlp_receiver,
                                                                      registry, tmp_path):  # noqa: F811
    image = f"{registry.host}/swe/agent:v1"
    registry.scratch("swe/agent:v1", "task=agent")
    args = {"url": stack.url, "otlp": otlp_receiver.traces_url, "image": image,
            "task": _task(registry, tmp_path)}
    run = subprocess.run([sys.executable, "-c", TRAINER, json.dumps(args)], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.splitlines()[-1])
    assert out["exec"] == "traced\n" and out["verdict"] == "failed", out

    def complete(spans: list[dict]) -> bool:
        ctl = [s for s in spans if s["service"] == "sandman-controller"]
        return (len(_by(spans, "trainer", "sandman grade")) == 1
                and len([s for s in ctl if s["kind"] == "server"]) >= 4
                and any(s["name"] == "execd READY" for s in ctl))

    spans = otlp_receiver.wait_for(out["trace"], complete, 60)
    ids = {s["span_id"]: s for s in spans}
    root, = _by(spans, "trainer", "rollout")
    assert root["parent_span_id"] is None

    # The trainer's acquire -> the controller's API span -> its phases -> execd's readiness.
    acquire = [s for s in _by(spans, "trainer", "sandman ACQUIRE")
               if s["parent_span_id"] == root["span_id"]]
    assert len(acquire) == 1, [s["name"] for s in spans]
    served = [s for s in spans if s["service"] == "sandman-controller"
              and s["kind"] == "server" and s["parent_span_id"] == acquire[0]["span_id"]]
    assert len(served) == 1 and served[0]["attributes"]["sandman.sandbox_id"] == out["sandbox"]
    phases = {s["name"]: s for s in spans if s["parent_span_id"] == served[0]["span_id"]}
    assert {"sandman create pod", "sandman wait ready"} <= set(phases), sorted(phases)
    ready = [s for s in _by(spans, "sandman-controller", "execd READY")
             if s["parent_span_id"] == phases["sandman wait ready"]["span_id"]]
    # Polled until it answers: the last poll is the 200 that handed the sandbox out.
    last = max(ready, key=lambda s: s["start_ns"])
    assert last["attributes"]["http.response.status_code"] == 200
    assert "sandman.execd.duration_ms" in last["attributes"]

    # The exec goes straight to execd: the trainer's span keeps execd's own time.
    ex, = [s for s in _by(spans, "trainer", "execd EXEC")
           if s["parent_span_id"] == root["span_id"]]
    assert ex["attributes"]["sandman.sandbox_id"] == out["sandbox"]
    assert 0 <= ex["attributes"]["sandman.execd.duration_ms"] <= \
        (ex["end_ns"] - ex["start_ns"]) / 1e6

    # The release, and the grading: its acquire, its fresh steps in the grading pod, its verdict.
    rel, = [s for s in _by(spans, "trainer", "sandman RELEASE")
            if s["parent_span_id"] == root["span_id"]]
    assert any(s["parent_span_id"] == rel["span_id"] and s["kind"] == "server" for s in spans)
    grade, = _by(spans, "trainer", "sandman grade")
    assert grade["attributes"]["sandman.verdict"] == "failed"
    under = [s for s in spans if _ancestor(ids, s, grade["span_id"])]
    names = {s["name"] for s in under}
    assert {"sandman ACQUIRE", "execd EXEC", "sandman RELEASE"} <= names, sorted(names)
    steps = [s for s in under if s["name"] == "execd EXEC"]
    assert len(steps) >= 4 and all("sandman.execd.duration_ms" in s["attributes"]
                                   for s in steps)


def _ancestor(ids: dict, span: dict, want: str) -> bool:
    for _ in range(64):
        parent = span["parent_span_id"]
        if parent is None or parent not in ids:
            return False
        if parent == want:
            return True
        span = ids[parent]
    return False


BAD_TRACEPARENTS = [
    "00-" + "F" * 32 + "-00f067aa0ba902b7-01", "00-" + "0" * 32 + "-00f067aa0ba902b7-01",
    "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "garbage", "",
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01" + "x" * 4000,
]


def test_a_callers_bad_traceparent_is_no_error(stack):
    """A traceparent is the caller's data: a malformed one is no parent, never an error."""
    with httpx.Client(base_url=stack.url, timeout=30) as h:
        for value in BAD_TRACEPARENTS:
            r = h.get(api.LIST.path, headers={"traceparent": value,
                                              "tracestate": value, "baggage": value})
            assert r.status_code == 200, (value[:80], r.text)
