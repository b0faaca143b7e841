"""Acquire bursts through the controller API: acquire, hold, run commands, release.

Each user is one rollout: it acquires a sandbox (ACQUIRE, latency includes the pacing queue),
holds it (the paper's rollout sandboxes lived 136-207 s at the median; runs here scale that
down with --hold-s), runs --commands small commands through execd (EXEC; needs a real execd
behind each pod, see testbed/standin.py), and releases it (RELEASE); all through the SDK
(`sandman.client`), whose `on_request` hook reports each call to locust (loadtest/users.py).
With --group-size N each user is one task's N rollouts: one GROUP call for N sandboxes, held and
released together (the same pacing, caps and fairness as N acquires). With --kubeconfig, the pod
watch adds POD_READY (create-to-Ready per pod) and the leak audit runs after the run.

Shapes (--shape), played by `SandmanShape` (loadtest/shapes.py), advancing on what exists:
  burst64    64 acquires within 1 s, one cycle each (a training run's start)
  two-runs   2 x 64 within 1 s (two runs starting together: 128-132 creates/s)
             (--run-users: the users of one run's start in these two, 64 by default)
  ramp       99, 250, 500, 1k, 2k, 4k, 8k, 12k concurrent sandboxes (--ramp-max caps it); users
             keep their sandbox across steps; a step that does not fill in --step-max-s ends
             the run, and that step is the ramp's answer
  steady     a campaign mean (--steady-rate, 1.8/s) with a burst of 64 every --burst-every-s

    locust -f loadtest/acquire_burst.py --headless --shape burst64 \
        --controller-url http://127.0.0.1:8080 --kubeconfig KC --namespace sandboxes \
        --csv out/burst64 --html out/burst64.html --max-p99-ms 10000 --max-leaked 0
"""

from __future__ import annotations

import argparse
import time

import gevent
from locust import LoadTestShape, User, events, task

from loadtest import common, shapes, users
from loadtest.run import ACQUIRE, GROUP, RUN
from sandman.client import Sandbox

common.install([ACQUIRE, GROUP])

HOLD_DEFAULT = {"burst64": 5.0, "two-runs": 5.0, "ramp": -1.0, "steady": 3.0}
MAX_HOLD_S = 3600.0  # "until the run ends" is still bounded


def _at_least_one(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, not {n}")
    return n


@events.init_command_line_parser.add_listener
def _args(parser) -> None:
    g = parser.add_argument_group("acquire_burst")
    g.add_argument("--shape", choices=shapes.SHAPES, default="burst64")
    g.add_argument("--hold-s", type=float, default=None,
                   help="hold each sandbox this long (default: 5 for bursts, 3 for steady, "
                        "-1 = until the run ends for ramp)")
    g.add_argument("--commands", type=int, default=0, help="execd commands per sandbox")
    g.add_argument("--run-users", type=_at_least_one, default=shapes.RUN_USERS,
                   help="burst64, two-runs: the users of one run's start (default 64)")
    g.add_argument("--ramp-max", type=int, default=12000, help="highest ramp step to try")
    g.add_argument("--step-hold-s", type=float, default=10.0, help="ramp: hold each full step")
    g.add_argument("--step-max-s", type=float, default=300.0,
                   help="ramp: a step not full after this ends the run")
    g.add_argument("--budget-s", type=float, default=300.0, help="bursts: bound of the stage")
    g.add_argument("--steady-s", type=float, default=120.0)
    g.add_argument("--steady-rate", type=float, default=1.8, help="acquires/s in steady")
    g.add_argument("--burst-every-s", type=float, default=60.0)
    g.add_argument("--pacing-rate", type=float, default=0.0,
                   help="the controller's --rate, drawn in the report (0: from /v1/stats)")
    g.add_argument("--pacing-burst", type=int, default=0, help="the controller's --burst")
    g.add_argument("--group-size", type=_at_least_one, default=1,
                   help="each user acquires this many sandboxes in one group call (GROUP), "
                        "holds and releases them together (1: single acquires)")


def _hold(o) -> float:
    return HOLD_DEFAULT[o.shape] if o.hold_s is None else o.hold_s


def _steady_base(o) -> int:
    # Users with constant pacing: base users / cycle period = the campaign's mean rate.
    return max(1, round(o.steady_rate * (_hold(o) + 2.0)))


class SandboxUser(User):
    """One rollout: acquire -> hold (+ commands) -> release, `cycles` times (0: until stopped)."""

    def on_start(self) -> None:
        o = self.environment.parsed_options
        self.o = o
        self.sandboxes = users.Sandboxes(self.environment, o.controller_url)
        self.job = common.job_of(self.environment)
        self.sbs: list[Sandbox] = []
        self.cycles = 0
        self.max_cycles = 0 if o.shape == "steady" else 1
        self.finished = False
        self.period = (_hold(o) + 2.0) if o.shape == "steady" else 0.0
        self.last = 0.0

    def wait_time(self) -> float:
        if self.finished:
            return 1.0
        return max(0.0, self.period - (time.monotonic() - self.last))

    @task
    def cycle(self) -> None:
        if self.finished:
            return
        self.last = time.monotonic()
        if self.o.group_size > 1:
            self.sbs = self.sandboxes.acquire_group(self.job, self.o.group_size) or []
        else:
            sb = self.sandboxes.acquire(self.job)
            self.sbs = [sb] if sb is not None else []
        if self.sbs:
            # The group's rollouts run side by side; the first member carries the commands.
            self._hold_and_exec(self.sbs[0])
            for sb in self.sbs:
                users.release(sb)
            self.sbs = []
        else:
            gevent.sleep(1.0)  # a failed acquire does not turn into a tight retry loop
        self.cycles += 1
        if self.max_cycles and self.cycles >= self.max_cycles:
            self.finished = True
            RUN.done += 1

    def _hold_and_exec(self, sb: Sandbox) -> None:
        hold = _hold(self.o)
        n = self.o.commands
        if hold < 0:
            for i in range(n):
                self.sandboxes.exec(sb, f"echo turn-{i} && ls / >/dev/null", label="turn")
            deadline = time.monotonic() + MAX_HOLD_S
            while time.monotonic() < deadline:
                gevent.sleep(1.0)
            return
        step = hold / (n + 1)
        for i in range(n):
            gevent.sleep(step)
            self.sandboxes.exec(sb, f"echo turn-{i} && ls / >/dev/null", label="turn")
        gevent.sleep(step if n else hold)

    def on_stop(self) -> None:
        for sb in self.sbs:
            users.later(users.release, sb)
        self.sbs = []


class SandmanShape(LoadTestShape):
    plan: shapes.Plan | None = None

    def tick(self):
        if self.plan is None:
            o = self.runner.environment.parsed_options
            self.plan = shapes.build(
                o.shape, ramp_max=o.ramp_max, step_hold_s=o.step_hold_s,
                step_max_s=o.step_max_s, budget_s=o.budget_s, steady_s=o.steady_s,
                steady_base=_steady_base(o), burst_every_s=o.burst_every_s,
                burst_s=max(_hold(o), 0) + 5.0, run_users=o.run_users)
            RUN.plan = self.plan
            RUN.extra.update({"shape": o.shape, "locustfile": "acquire_burst",
                              "group_size": o.group_size,
                              "pacing": {"rate": o.pacing_rate or None,
                                         "burst": o.pacing_burst or None}})
        return self.plan.tick(self.get_run_time(), self.get_current_user_count(), RUN.live,
                              RUN.done)
