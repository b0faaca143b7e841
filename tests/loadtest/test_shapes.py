"""The shapes' tick() sequences: they advance on what exists, never on wall time alone, and
every stage is bounded."""

from __future__ import annotations

import pytest

from loadtest import shapes
from loadtest.shapes import Plan, Stage


def play(plan: Plan, script):
    """script: (now, users, live, done) per tick; returns what tick() answered each time."""
    return [plan.tick(*s) for s in script]


def test_burst64_waits_until_every_user_finished_its_cycle():
    plan = shapes.build("burst64", budget_s=300)
    got = play(plan, [(0, 0, 0, 0), (0.5, 30, 0, 0), (1.0, 64, 40, 0), (6.0, 64, 64, 10),
                      (9.0, 64, 0, 63), (9.5, 64, 0, 64)])
    assert got == [(64, 64.0)] * 5 + [None]
    r = plan.results[0]
    assert (r.reached, r.ended, r.timed_out, r.peak_live) == (9.5, 9.5, False, 64)
    assert plan.stop_reason == "all stages done"


def test_two_runs_is_128_users_spawned_at_132_per_second():
    plan = shapes.build("two-runs")
    assert plan.tick(0, 0, 0, 0) == (128, 132.0)
    # 128 done but the runner reports fewer users (still spawning): not done yet.
    assert plan.tick(1, 100, 0, 128) == (128, 132.0)
    assert plan.tick(2, 128, 0, 128) is None


def test_run_users_scales_both_bursts_and_zero_is_refused():
    assert shapes.build("two-runs", run_users=12).tick(0, 0, 0, 0) == (24, 24.75)
    plan = shapes.build("burst64", run_users=5)
    assert plan.tick(0, 0, 0, 0) == (5, 5.0) and plan.stages[0].label == "burst5"
    with pytest.raises(ValueError, match="run_users must be >= 1"):
        shapes.build("burst64", run_users=0)


def test_ramp_advances_only_when_the_step_is_live_and_held():
    plan = shapes.build("ramp", ramp_max=500, step_hold_s=10, step_max_s=100)
    assert [s.users for s in plan.stages] == [99, 250, 500]
    script = [
        (0, 0, 0, 0),        # step 99 asked for
        (5, 99, 60, 0),      # users exist, sandboxes not yet: no advance
        (8, 99, 99, 0),      # full: the 10 s hold starts
        (17, 99, 99, 0),     # still holding
        (18, 99, 99, 0),     # held 10 s: step 250, spawning its 151 new users in ~1 s
        (30, 250, 250, 0),
        (40, 250, 250, 0),   # -> 500
        (41, 500, 500, 0),
        (51, 500, 500, 0),   # done
    ]
    got = play(plan, script)
    assert got == [(99, 99.0), (99, 99.0), (99, 99.0), (99, 99.0), (250, 151.0), (250, 151.0),
                   (500, 250.0), (500, 250.0), None]
    assert [r.label for r in plan.results] == ["99", "250", "500"]
    assert all(not r.timed_out for r in plan.results)


def test_ramp_stops_at_the_first_step_it_cannot_fill_and_says_why():
    plan = shapes.build("ramp", ramp_max=1000, step_hold_s=0, step_max_s=60)
    assert plan.tick(0, 0, 0, 0) == (99, 99.0)
    assert plan.tick(1, 99, 99, 0) == (250, 151.0)
    assert plan.tick(30, 250, 180, 0) == (250, 151.0)
    assert plan.tick(61.5, 250, 200, 0) is None  # 60 s budget of step 250 is over
    assert plan.results[-1].timed_out and plan.results[-1].label == "250"
    assert plan.stop_reason == "step 250 not reached within 60 s (live 200 of 250)"
    assert plan.tick(70, 250, 250, 0) is None  # stays stopped


def test_burst_stage_that_times_out_moves_on_without_stopping():
    plan = Plan([Stage(4, 4.0, need="done", max_s=10, label="a"), Stage(2, 2.0, label="b")])
    assert plan.tick(0, 4, 4, 0) == (4, 4.0)
    assert plan.tick(10, 4, 4, 1) == (2, 2.0)  # timed out, not a ramp: next stage
    assert plan.results[0].timed_out
    assert plan.tick(10.5, 4, 0, 1) == (2, 2.0)  # the 2 users to stop still exist
    assert plan.tick(11, 2, 0, 1) is None


def test_steady_alternates_base_and_bursts_within_the_duration():
    plan = shapes.build("steady", steady_s=100, steady_base=9, burst_every_s=30, burst_s=10)
    assert [(s.users, s.label) for s in plan.stages] == [
        (9, "base0"), (73, "burst0"), (9, "base1"), (73, "burst1"), (9, "base2")]
    assert plan.stages[-1].hold_s == pytest.approx(100 - 2 * 40)
    # A stage holds for its time once its users exist.
    assert plan.tick(0, 0, 0, 0) == (9, 9.0)
    assert plan.tick(1, 9, 3, 0) == (9, 9.0)
    assert plan.tick(31, 9, 3, 0) == (73, 64.0)
    assert plan.tick(32, 50, 3, 0) == (73, 64.0)  # burst users still spawning: no hold yet
    assert plan.tick(33, 73, 3, 0) == (73, 64.0)
    assert plan.tick(43, 73, 3, 0) == (9, 9.0)
    assert plan.tick(44, 73, 3, 0) == (9, 9.0)  # back to base once the extra users stopped
    assert plan.results[-1].reached is None


def test_every_ramp_step_is_bounded_and_the_paper_ramp_is_the_default():
    plan = shapes.build("ramp")
    assert [s.users for s in plan.stages] == list(shapes.RAMP_STEPS)
    assert all(s.max_s < float("inf") and s.stop_on_timeout for s in plan.stages)


def test_unknown_shape_is_refused():
    with pytest.raises(ValueError, match="unknown shape"):
        shapes.build("spike")
