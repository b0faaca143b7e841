"""execd's part in a trace (docs/metrics.md, "Traces"): it exports nothing, takes a valid
W3C traceparent into its log line for the request, and answers its own time on every
non-streamed request as `Server-Timing: execd;dur=<ms>`. The traceparent is the caller's data:
anything but a valid one is ignored, never echoed."""

import re

import pytest

from sandman import tracing

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
VALID = f"00-{TRACE}-00f067aa0ba902b7-01"
TIMING = re.compile(r"execd;dur=\d+\.\d")


def test_every_answer_says_execds_time_and_the_sdk_reads_it(execd):
    for r in (execd.post("/exec", {"command": "echo hi"}), execd.get("/health"),
              execd.get("/nonexistent"), execd.post("/exec", {"command": 5})):
        assert TIMING.fullmatch(r.headers["server-timing"]), r.headers
        assert tracing.execd_duration_ms(r.headers["server-timing"]) >= 0
    slow = execd.post("/exec", {"command": "sleep 0.3"})
    assert tracing.execd_duration_ms(slow.headers["server-timing"]) >= 300


def test_a_valid_traceparent_reaches_execds_log_line(execd_factory, tmp_path):
    (tmp_path / "ws").mkdir()
    d = execd_factory("--workspace", str(tmp_path / "ws"), "--verbose")
    assert d.post("/exec", {"command": "true"}, headers={"traceparent": VALID}).status_code == 200
    assert d.post("/exec", {"command": "true"}).status_code == 200
    lines = [ln for ln in d.log.read_text().splitlines() if "'POST /exec' 200" in ln]
    assert lines[0].endswith(f" trace={TRACE}") and "trace=" not in lines[1], lines


@pytest.mark.parametrize("value", [
    f"00-{TRACE.upper()}-00f067aa0ba902b7-01",  # upper case
    f"00-{'0' * 32}-00f067aa0ba902b7-01",  # invalid ids
    f"00-{TRACE}-{'0' * 16}-01",
    f"ff-{TRACE}-00f067aa0ba902b7-01",  # a version we do not read
    f"00-{TRACE}-00f067aa0ba902b7-01-extra",
    f"00-{TRACE}-00f067aa0ba902b7-01" + " trace=forged" * 4,
    f"00-{TRACE}-00f067aa0ba902b7-01\x1b[31m",
    "x" * 8000,
])
def test_a_bad_traceparent_is_ignored_and_never_logged(execd_factory, tmp_path, value):
    (tmp_path / "ws").mkdir()
    d = execd_factory("--workspace", str(tmp_path / "ws"), "--verbose")
    r = d.post("/exec", {"command": "echo ok"}, headers={"traceparent": value})
    assert r.status_code == 200 and r.json()["output"] == "ok\n"
    log = d.log.read_text()
    assert "trace=" not in log and "forged" not in log and "\x1b" not in log


@pytest.mark.parametrize("header, want", [
    ("execd;dur=12.5", 12.5), ("cache;dur=1, execd;dur=3", 3.0), ("execd;desc=x;dur=2", None),
    ("execd;dur=-1", None), ("execd;dur=1e9", None), ("execdx;dur=1", None), ("", None),
    ("execd;dur=1" + "0" * 600, None), (None, None),
])
def test_the_sdk_trusts_nothing_but_a_number_from_the_pod(header, want):
    assert tracing.execd_duration_ms(header) == want
