"""controller/tracing.py's checks, without a receiver (the bed test reads real spans back)."""

import subprocess
import sys

import pytest
from opentelemetry import baggage, context, propagate, trace

from controller import tracing


@pytest.mark.parametrize("url", [
    "ftp://collector:4318", "collector:4318", "http://", "http://user:pw@collector:4318",
    "http://collector:4318?x=1", "http://collector:4318#frag",
])
def test_an_endpoint_that_is_not_a_receivers_base_url_is_refused_in_one_line(url):
    with pytest.raises(ValueError) as ei:
        tracing.check_endpoint(url)
    assert "\n" not in str(ei.value)


def test_off_by_default_and_only_the_trace_context_goes_on():
    assert tracing.configure("") is None
    assert not trace.get_current_span().is_recording()
    # A caller's baggage (anything a co-tenant writes) is never sent on to execd.
    ctx = baggage.set_baggage("tenant", "evil", context.get_current())
    carrier: dict = {}
    propagate.inject(carrier, context=ctx)
    assert "baggage" not in carrier
    assert propagate.get_global_textmap().fields == {"traceparent", "tracestate"}
    with tracing.child("nothing records") as s:  # no caller's span: no span
        assert s is None


@pytest.mark.parametrize("flags, says", [
    (["--otlp-endpoint", "ftp://x:1"], "--otlp-endpoint 'ftp://x:1': want http(s)://host[:port]"),
    (["--otlp-endpoint", "http://x:1", "--trace-sample-ratio", "2"],
     "--trace-sample-ratio 2.0: want 0 to 1"),
])
def test_the_controller_refuses_bad_trace_flags_before_anything_starts(flags, says, tmp_path):
    r = subprocess.run([sys.executable, "-m", "controller", "serve", "--namespace", "ns", "--listen", "127.0.0.1:0",
                        "--kubeconfig", str(tmp_path / "none"), *flags],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and says in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
