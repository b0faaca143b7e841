"""loadtest/report.py's CPU and memory tables: a ramp's `<run>_sandman.json` with the stack
sampler's `<run>_procs.json` beside it, made up so every figure is known in advance."""

from __future__ import annotations

import json

from loadtest import report

T0 = 1000.0  # the run's start, unix time
MB = 2**20


def _run(tmp_path, procs: dict | None) -> str:
    doc = {
        "job": "lt-x", "started": T0, "duration_s": 20.0, "shape": "ramp",
        "pacing": {"rate": 50, "burst": 100}, "stop_reason": "all stages done",
        "stages": [
            {"label": "2", "users": 2, "started": 0.0, "reached": 3.0, "ended": 10.0,
             "timed_out": False, "peak_live": 2},
            {"label": "4", "users": 4, "started": 10.0, "reached": 13.0, "ended": 20.0,
             "timed_out": False, "peak_live": 4}],
        "pods": {"a": [1.0, 1.5], "b": [2.0, 2.5], "c": [11.0, 11.5], "d": [12.0, 12.5]},
        "acquires": [[0.5, 1.6, True, False], [0.5, 2.6, True, False],
                     [10.5, 11.6, True, False], [10.5, 12.6, True, False]],
        "samples": [], "leaked": [], "audit": "0 pod(s) of job lt-x left",
        "stats": {"ACQUIRE /v1/sandboxes": {"type": "ACQUIRE", "requests": 4, "failures": 0}},
        "thresholds": [], "exit_code": 0}
    (tmp_path / "ramp_sandman.json").write_text(json.dumps(doc))
    if procs is not None:
        (tmp_path / "ramp_procs.json").write_text(json.dumps(procs))
    text, page = report.build(tmp_path)
    assert page.exists()
    return text


def _sample(t, total, idle, api, ctl, ctl_rss, wh, locust=None):
    procs = {"kube-apiserver": [api, 300 * MB], "controller": [ctl, ctl_rss],
             "webhook": [wh, 50 * MB]}
    if locust is not None:
        procs["locust"] = [locust, 80 * MB]
    return [T0 + t, total, idle, procs]


PROCS = {"cores": 2, "every_s": 2.0,
         "names": ["kube-apiserver", "controller", "webhook", "locust"],
         "samples": [
             _sample(0, 100.0, 50.0, 5.0, 1.0, 100 * MB, 0.5),
             # locust's first sample comes after the run's start: it used nothing before.
             _sample(5, 110.0, 52.5, 10.0, 2.0, 101 * MB, 0.75, locust=0.0),
             _sample(10, 120.0, 55.0, 15.0, 3.0, 102 * MB, 1.0, locust=1.0),
             _sample(20, 140.0, 65.0, 20.0, 7.0, 104 * MB, 1.5, locust=2.0)]}


def _rows(text: str, title: str) -> list[str]:
    block = text.split(title, 1)[1].split("\n\n", 1)[0]
    return [ln for ln in block.splitlines() if ln.startswith("|")]


def test_cpu_per_process_per_step(tmp_path):
    text = _run(tmp_path, PROCS)
    rows = _rows(text, "ramp, where the CPU went")
    assert rows[0] == ("| step | s | machine CPU-s (2 cores) | kube-apiserver | webhook | "
                       "controller | locust | other processes | idle |")
    # Step 2: 20 machine CPU-s, 15 busy; the named processes 10 + 0.5 + 2 + 1, other 1.5.
    assert rows[2] == ("| 2 | 10 | 20 | 10.0 (50%) | 0.5 (2%) | 2.0 (10%) | 1.0 (5%) | "
                       "1.5 (8%) | 5.0 (25%) |")
    # Busy 10, the named ones 10.5 (samples a tick apart): "other" is never negative.
    assert rows[3] == ("| 4 | 10 | 20 | 5.0 (25%) | 0.5 (2%) | 4.0 (20%) | 1.0 (5%) | "
                       "0.0 (0%) | 10.0 (50%) |")
    assert rows[4].startswith("| whole run | 20 | 40 | 15.0 (38%) | 1.0 (2%) | 6.0 (15%) |")


def test_controller_and_webhook_per_1000_sandboxes(tmp_path):
    text = _run(tmp_path, PROCS)
    rows = _rows(text, "ramp, the controller and the webhook per 1,000 sandboxes")
    assert rows[0] == ("| step | created in step | live at end | controller CPU-s per 1,000 "
                       "created | controller RSS (growth per 1,000 live) | webhook CPU-s per "
                       "1,000 created | webhook RSS (growth per 1,000 live) |")
    # 2 created, 2.0 CPU-s: 1,000 per 1,000; RSS 102 MB, +2 MB over 2 live: +1,000 MB.
    assert rows[2] == "| 2 | 2 | 2 | 1000.0 | 102 MB (+1000.0 MB) | 250.0 | 50 MB (+0.0 MB) |"
    assert rows[3] == "| 4 | 2 | 4 | 2000.0 | 104 MB (+1000.0 MB) | 250.0 | 50 MB (+0.0 MB) |"
    assert rows[4] == ("| whole run | 4 | 4 | 1500.0 | 104 MB (+1000.0 MB) | 250.0 | "
                       "50 MB (+0.0 MB) |")


def test_the_whole_run_reports_the_peak_rss_not_the_one_after_release(tmp_path):
    # Released sandboxes at the end: the controller's RSS fell back to 101 MB after its
    # peak of 104 MB with 4 live; the whole run's row says 104 MB.
    after = _sample(20, 140.0, 65.0, 20.0, 7.0, 101 * MB, 1.5, locust=2.0)
    peak = _sample(15, 130.0, 60.0, 17.5, 5.0, 104 * MB, 1.25, locust=1.5)
    procs = dict(PROCS, samples=[*PROCS["samples"][:3], peak, after])
    rows = _rows(_run(tmp_path, procs), "ramp, the controller and the webhook per 1,000")
    assert rows[3].startswith("| 4 | 2 | 4 | 2000.0 | 101 MB (+250.0 MB) |"), rows
    assert rows[4].startswith("| whole run | 4 | 4 | 1500.0 | 104 MB (+1000.0 MB) |"), rows


def test_step_boundaries_between_samples_are_interpolated(tmp_path):
    # Only the samples at 0 and 20 s: a step ending at 10 s reads the counters half-way.
    procs = dict(PROCS, samples=[PROCS["samples"][0], PROCS["samples"][-1]])
    rows = _rows(_run(tmp_path, procs), "ramp, where the CPU went")
    assert rows[2].startswith("| 2 | 10 | 20 | 7.5 (38%) |"), rows


def test_a_run_without_the_sampler_reports_as_before(tmp_path):
    text = _run(tmp_path, None)
    assert "where the CPU went" not in text and "per 1,000 sandboxes" not in text
    assert "| 2 | yes |" in text  # the step table is still there
