"""Load shapes as plain stage lists, and the one `LoadTestShape` that plays them.

A stage asks for a user count and then waits for a condition on what really exists (users
spawned, sandboxes live, users done with their cycles), never for wall time alone: on a slow
cluster a step that has not filled is still being measured, not skipped. Every stage is
bounded by `max_s`; a stage that times out is recorded, and a ramp stops there (the step the
cluster could not reach is the answer of the ramp).

`Plan.tick(now, users, live, done)` is pure (tests feed it numbers); `SandmanShape` feeds it
the runner's user count and the counters kept by the locustfile's users.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The paper's scale ramp (concurrent sandboxes).
RAMP_STEPS = (99, 250, 500, 1000, 2000, 4000, 8000, 12000)
SHAPES = ("burst64", "two-runs", "ramp", "steady")
RUN_USERS = 64  # one training run's start (the paper's burst)


@dataclass(frozen=True)
class Stage:
    users: int
    spawn_rate: float
    need: str = "users"  # "users" | "live" | "done": what must reach `users` before the hold
    hold_s: float = 0.0  # after the condition is met
    max_s: float = 300.0  # the stage ends (timed out) after this, condition met or not
    stop_on_timeout: bool = False  # ramp: a step that cannot fill ends the run
    label: str = ""


@dataclass
class StageResult:
    label: str
    users: int
    started: float
    reached: float | None = None
    ended: float | None = None
    timed_out: bool = False
    peak_live: int = 0


@dataclass
class Plan:
    stages: list[Stage]
    i: int = 0
    results: list[StageResult] = field(default_factory=list)
    stop_reason: str = ""

    def tick(self, now: float, users: int, live: int, done: int) -> tuple[int, float] | None:
        while self.i < len(self.stages):
            st = self.stages[self.i]
            if len(self.results) <= self.i:
                self.results.append(StageResult(st.label or str(st.users), st.users, now))
            r = self.results[self.i]
            r.peak_live = max(r.peak_live, live)
            have = {"users": users, "live": live, "done": done}[st.need]
            # Users must exist: exactly the stage's count (a step down waits for the stop too).
            exist = users == st.users if st.need == "users" else users >= st.users
            if r.reached is None and have >= st.users and exist:
                r.reached = now
            if r.reached is not None and now - r.reached >= st.hold_s:
                r.ended = now
                self.i += 1
                continue
            if now - r.started >= st.max_s:
                r.ended, r.timed_out = now, True
                self.i += 1
                if st.stop_on_timeout:
                    self.stop_reason = (f"step {r.label} not reached within {st.max_s:g} s "
                                        f"({st.need} {have} of {st.users})")
                    self.i = len(self.stages)
                    return None
                continue
            return st.users, st.spawn_rate
        if not self.stop_reason:
            self.stop_reason = "all stages done"
        return None


def burst(n: int, budget_s: float) -> list[Stage]:
    """`n` users spawned within one second, each one acquire-hold-release cycle; the stage ends
    when every user finished its cycle."""
    return [Stage(n, float(n), need="done", max_s=budget_s, label=f"burst{n}")]


def ramp(steps: list[int], step_hold_s: float, step_max_s: float) -> list[Stage]:
    """Each step holds `n` live sandboxes for `step_hold_s` (users keep theirs across steps)."""
    out = []
    prev = 0
    for n in steps:
        # All of a step's new users arrive within about a second: the controller paces, not us.
        out.append(Stage(n, float(max(n - prev, 1)), need="live", hold_s=step_hold_s,
                         max_s=step_max_s, stop_on_timeout=True, label=str(n)))
        prev = n
    return out


def steady(base: int, duration_s: float, burst_every_s: float, burst_n: int,
           burst_s: float) -> list[Stage]:
    """`base` pacing users (the campaign mean) with `burst_n` extra users every `burst_every_s`
    for `burst_s` (a run start on top of the background)."""
    out: list[Stage] = []
    t = 0.0
    k = 0
    while t < duration_s and k < 1000:
        quiet = min(burst_every_s, duration_s - t)
        out.append(Stage(base, float(base), hold_s=quiet, max_s=quiet + 30, label=f"base{k}"))
        t += quiet
        if t < duration_s:
            out.append(Stage(base + burst_n, float(burst_n), hold_s=burst_s,
                             max_s=burst_s + 30, label=f"burst{k}"))
            t += burst_s
        k += 1
    return out


def build(name: str, *, ramp_max: int = 12000, step_hold_s: float = 10.0,
          step_max_s: float = 300.0, budget_s: float = 300.0, steady_s: float = 120.0,
          steady_base: int = 9, burst_every_s: float = 60.0, burst_s: float = 10.0,
          run_users: int = RUN_USERS) -> Plan:
    """`run_users`: the users of one run's start in burst64 and two-runs (64, the paper's; a
    smaller node takes a smaller run, the shape's form unchanged)."""
    if run_users < 1:
        raise ValueError(f"run_users must be >= 1, not {run_users}")
    if name == "burst64":
        return Plan(burst(run_users, budget_s))
    if name == "two-runs":
        # Two runs starting together: 2 x 64 within one second (the paper's 128-132/s).
        n = 2 * run_users
        return Plan([Stage(n, n * 132.0 / 128, need="done", max_s=budget_s,
                           label="two-runs")])
    if name == "ramp":
        steps = [n for n in RAMP_STEPS if n <= ramp_max]
        return Plan(ramp(steps or [ramp_max], step_hold_s, step_max_s))
    if name == "steady":
        return Plan(steady(steady_base, steady_s, burst_every_s, 64, burst_s))
    raise ValueError(f"unknown shape {name!r}; one of {', '.join(SHAPES)}")
