"""`python -m bench.replay` (virtual time, no cluster): a small replay's report has its
structure and is the same for the same seed; the goal logic says "met" and "not met" where it
should (not that the goals are met); traces load, round-trip and refuse bad lines."""

from __future__ import annotations

import itertools
import json
import math
import re
from pathlib import Path

import pytest

from bench import replay
from sandman import contract

G, A = contract.ROLE_GRADING, contract.ROLE_AGENT


@pytest.fixture(scope="module")
def small():
    reqs = replay.generate(3, runs=1, minutes=6, in_flight=16)
    return reqs, replay.replay(reqs, 3)


@pytest.mark.slow
def test_small_replay_report_structure(small):
    reqs, rep = small
    assert rep["requests"] == len(reqs) > 0
    assert tuple(rep["policies"]) == replay.POLICIES
    for name, p in rep["policies"].items():
        assert p["failed"] == 0, name
        for role in (G, A):
            r = p[role]
            assert r["n"] == sum(1 for q in reqs if q.role == role)
            assert 0 <= r["hits"] <= 1 and 0 <= r["p50_s"] <= r["p99_s"]
        assert p["idle_vcpu_h"] == pytest.approx(2 * p["idle_pod_h"])  # 2-vCPU pods
        assert p["probe_p99_alone_s"] > 0 and p["probe_p99_burst_s"] > 0
    none = rep["policies"]["none"]
    assert none[G]["hits"] == 0 and none["idle_pod_h"] == 0  # no pool: nothing warm
    assert rep["policies"]["fixed 2"][G]["hits"] > 0
    text = replay.render(rep, ["--seed", "3"])
    assert text.startswith(replay.SECTION)
    assert text.count("\n| ") == 1 + len(replay.POLICIES)  # the header, one row each
    assert "linear interpolation between closest ranks" in text
    assert text.count(": met") + text.count(": not met") == 3


@pytest.mark.slow
def test_same_seed_same_report(small):
    reqs, rep = small
    assert replay.replay(reqs, 3) == rep


def report(hits=0.96, idle_d=1.0, idle_f=4.0, alone=1.0, burst=1.5) -> dict:
    def pol(h, idle, a, b):
        return {G: {"hits": h}, "idle_vcpu_h": idle, "probe_p99_alone_s": a,
                "probe_p99_burst_s": b}
    return {"policies": {"fixed 2": pol(0.9, idle_f, 1.0, 1.0),
                         "demand": pol(hits, idle_d, alone, burst)}}


@pytest.mark.parametrize("kw, met", [
    ({}, [True, True, True]),
    ({"hits": 0.949}, [False, True, True]),
    ({"hits": 0.95}, [True, True, True]),
    ({"idle_d": 2.0}, [True, True, True]),
    ({"idle_d": 2.01}, [True, False, True]),
    ({"idle_f": 0.0}, [True, False, True]),
    ({"burst": 2.0}, [True, True, True]),
    ({"burst": 2.01}, [True, True, False]),
    ({"alone": 0.0}, [True, True, False]),
])
def test_goal_logic(kw, met):
    got = replay.goals(report(**kw))
    assert [ok for _, ok in got] == met


def test_trace_round_trip_and_bad_lines(tmp_path):
    reqs = replay.generate(5, runs=1, minutes=3, in_flight=8)
    path = tmp_path / "t.jsonl"
    replay.write_trace(reqs, path)
    assert replay.load_trace(path) == reqs
    for line, msg in [
        ("{", "not JSON"), ("[1]", "not a JSON object"),
        ('{"t": 1, "role": "agent", "image": "x", "hold_s": 1, "gpu": 1}', "unknown field"),
        ('{"t": -1, "role": "agent", "image": "x", "hold_s": 1}', "t must be >= 0"),
        ('{"t": 1, "role": "agent", "image": "x", "hold_s": "1"}', "hold_s must be a number"),
        ('{"t": 1, "role": "judge", "image": "x", "hold_s": 1}', "role must be one of"),
        ('{"t": 1, "role": "agent", "image": "a b", "hold_s": 1}', "non-empty strings"),
        ('{"t": NaN, "role": "agent", "image": "x", "hold_s": 1}', "t must be a number"),
    ]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps({"t": 0, "role": "agent", "image": "x", "hold_s": 1}) + "\n"
                       + line + "\n")
        with pytest.raises(ValueError, match=msg) as e:
            replay.load_trace(bad)
        assert "line 2" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="no requests"):
        (tmp_path / "empty.jsonl").write_text("\n")
        replay.load_trace(tmp_path / "empty.jsonl")


def test_cli_refusals(tmp_path, capsys):
    with pytest.raises(SystemExit):
        replay.main(["--smoke", "--write-docs"])
    capsys.readouterr()
    assert replay.main(["--trace", str(tmp_path / "missing.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bench.replay: trace ") and err.count("\n") == 1


def test_generated_trace_has_the_workload_shape():
    reqs = replay.generate(7, runs=2, minutes=60)
    rollouts = [r for r in reqs if r.role == A]
    gradings = [r for r in reqs if r.role == G]
    assert 1.0 < len(gradings) / len(rollouts) < 1.8  # 0/1/2 gradings: 1.42 expected
    by_image: dict[str, list[float]] = {}
    for r in rollouts:
        by_image.setdefault(r.image, []).append(r.t)
    gaps = [b - a for ts in by_image.values() for a, b in itertools.pairwise(sorted(ts))]
    short = sum(1 for g in gaps if g < 10) / len(gaps)
    assert short > 0.7  # a group's 8 start within a second (the paper: ~80% under 10 s)
    assert not math.isnan(max(gaps))


def test_make_bench_replay_writes_its_docs_section():
    make = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    recipe = re.search(r"^bench-replay:.*\n((?:\t.*\n)+)", make, re.M)
    assert recipe and "-m bench.replay --write-docs" in recipe.group(1)


@pytest.mark.slow
def test_a_recorded_trace_replays(tmp_path, capsys):
    path = tmp_path / "rec.jsonl"
    path.write_text('{"t": 0, "role": "agent", "image": "task-a", "hold_s": 30}\n'
                    '{"t": 30.5, "role": "grading", "image": "task-a", "hold_s": 5}\n'
                    '{"t": 36, "role": "grading", "image": "task-a", "hold_s": 5, "cpu": "1",'
                    ' "memory": "2Gi"}\n')
    assert replay.main(["--trace", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(replay.SECTION) and "Recorded trace rec.jsonl" in out
