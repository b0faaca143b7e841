"""`make bench-replay` (`python -m bench.replay --write-docs`): warm-pool policies replayed in
virtual time through the controller's real code.

A trace of acquires (generated, or recorded: `--trace FILE`) is replayed against the real
`Controller` (its books, pacer, owner pipeline and warm pool) on an event loop whose clock is
virtual: waiting costs no wall time, so an hour of a training run replays in seconds, and a
seed fixes every figure. Kubernetes is bench/replaykube.py (create-to-Ready drawn from the
paper's Verified figures). The trace's timeline is fixed, as in the paper's replays: each
acquire is sent at its time and released `hold_s` after it was answered.

Three policies, side by side, on the same trace:
- none: no warm pool (every acquire creates);
- fixed 2: the paper's pool A/B: 2 warm pods per grading key from its first request, 2,100 s
  idle timeout;
- demand: controller/demand.py within a global budget (WARM_BUDGET_PODS pods, 2 vCPU each),
  300 s idle timeout.

Reported per policy: warm-hit rate and acquisition p50/p99 by role (bench/stats.py), idle warm
vCPU-hours and pod-hours over the trace's span. The burst probe then sends PROBE_GRADINGS
gradings of cold keys, one every PROBE_STEP_S, once alone and once while BURST_ROLLOUTS
rollouts start together (4 runs of 64, the paper's largest start burst reached 132 creates/s):
grading acquisition p99 with and without the burst.

Goals (demand policy): grading hits >= 95%; idle warm vCPU-hours <= 50% of the fixed pool's;
grading p99 under the burst <= 2x its p99 alone.

Trace generator (`generate`), shaped like the paper's workload (Tables A1, A9, section B):
RUNS runs start together; each keeps IN_FLIGHT trajectories in flight as GRPO groups of 8 of
one image, whose 8 rollouts start within a second; a run cycles through 24-88 images in a
shuffled order, so an image is re-requested within seconds inside a group and again a cycle
later (the paper's 13-44 minutes); a rollout lives a lognormal time (median ROLLOUT_MEDIAN_S)
and is followed by 0, 1 or 2 gradings (13.9% / 30.6% / 55.5%, campaign A), one after the other,
each a lognormal time (median GRADING_MEDIAN_S, the pre-registered comparison's 6.5 s test
run); a group's slot takes the next image once all 8 have ended.

Recorded-trace format: JSON lines, one acquire per line, in any order:
`{"t": 12.5, "role": "grading", "image": "task-007", "hold_s": 6.2}` with optional "cpu"
and "memory" (default the contract's sandbox size, `sandman.api.DEFAULT_CPU`/`DEFAULT_MEMORY`). `t` is seconds from the trace's start, `role` is
agent or grading, `hold_s` how long the caller keeps the sandbox. `--write-trace FILE` writes
the generated trace in this format.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import selectors
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import docs
from bench.replaykube import API_S, READY_MEDIAN_S, READY_SIGMA, ReplayKube
from bench.stats import percentile_or_nan
from controller.core import Controller
from controller.demand import Budget
from controller.pacer import Limits
from controller.pods import AcquireOrder, SandboxSpec
from controller.settings import Settings
from sandman import api, contract

SECTION = "## warm-pool replay: `python -m bench.replay`"
RUNS = 2
IN_FLIGHT = 64
GROUP = 8
IMAGES = (24, 88)
MINUTES = 90.0
ROLLOUT_MEDIAN_S, ROLLOUT_SIGMA = 240.0, 0.6
GRADING_MEDIAN_S, GRADING_SIGMA = 6.5, 0.5
GRADINGS = ((0, 0.139), (1, 0.306), (2, 0.555))
CPU, MEMORY = api.DEFAULT_CPU, api.DEFAULT_MEMORY
FIXED_TARGET, FIXED_IDLE_S = 2, 2100.0
DEMAND_IDLE_S = 300.0
WARM_BUDGET_PODS = 96  # the paper's checked-reuse A/B budget
PROBE_GRADINGS, PROBE_STEP_S = 40, 0.25
BURST_ROLLOUTS = 256
GOAL_HITS, GOAL_IDLE_RATIO, GOAL_BURST_RATIO = 0.95, 0.5, 2.0
POLICIES = ("none", "fixed 2", "demand")
ROLES = (contract.ROLE_GRADING, contract.ROLE_AGENT)


@dataclass(frozen=True)
class Request:
    t: float
    role: str
    image: str
    hold_s: float
    cpu: str = CPU
    memory: str = MEMORY


# ---- traces --------------------------------------------------------------------------------
def _lognormal(rng: random.Random, median: float, sigma: float, lo: float, hi: float) -> float:
    return min(hi, max(lo, median * math.exp(rng.gauss(0.0, sigma))))


def generate(seed: int, runs: int = RUNS, minutes: float = MINUTES,
             in_flight: int = IN_FLIGHT) -> list[Request]:
    """The workload the module docstring describes; the same seed, the same trace."""
    rng = random.Random(seed)
    universe = [f"task-{i:03d}" for i in range(IMAGES[1])]
    out: list[Request] = []
    end = minutes * 60.0
    for _run in range(runs):
        images = rng.sample(universe, rng.randint(*IMAGES))
        cycle: list[str] = []
        # (time the slot is free, slot index): the run's groups, all started at t=0
        slots = [0.0] * max(1, in_flight // GROUP)
        while True:
            i = min(range(len(slots)), key=lambda j: slots[j])
            start = slots[i]
            if start >= end:
                break
            if not cycle:
                cycle = rng.sample(images, len(images))
            image = cycle.pop()
            done = start
            for _ in range(GROUP):
                t = start + rng.uniform(0.0, 1.0)
                hold = _lognormal(rng, ROLLOUT_MEDIAN_S, ROLLOUT_SIGMA, 20.0, 1800.0)
                out.append(Request(round(t, 3), contract.ROLE_AGENT, image, round(hold, 3)))
                t += hold
                n = rng.choices([g for g, _ in GRADINGS], [p for _, p in GRADINGS])[0]
                for _ in range(n):
                    g = _lognormal(rng, GRADING_MEDIAN_S, GRADING_SIGMA, 1.0, 1800.0)
                    out.append(Request(round(t, 3), contract.ROLE_GRADING, image, round(g, 3)))
                    t += g + 0.5
                done = max(done, t)
            slots[i] = done + rng.uniform(0.0, 5.0)  # the trainer takes the group, starts one
    return sorted(out, key=lambda r: (r.t, r.role, r.image))


def write_trace(reqs: list[Request], path: Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in reqs:
            f.write(json.dumps(asdict(r), sort_keys=True) + "\n")


def load_trace(path: Path) -> list[Request]:
    """A recorded trace; ValueError naming the file and line on anything else."""
    out = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ValueError(f"trace {path}: {e.strerror or e}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"trace {path} line {n}"
        try:
            d = json.loads(line)
        except ValueError:
            raise ValueError(f"{where}: not JSON") from None
        if not isinstance(d, dict):
            raise ValueError(f"{where}: not a JSON object")
        unknown = set(d) - {"t", "role", "image", "hold_s", "cpu", "memory"}
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
        t, hold = d.get("t"), d.get("hold_s")
        for what, v in (("t", t), ("hold_s", hold)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{where}: {what} must be a number")
        if t < 0 or hold <= 0:
            raise ValueError(f"{where}: t must be >= 0 and hold_s > 0")
        if d.get("role") not in contract.ROLES:
            raise ValueError(f"{where}: role must be one of {', '.join(contract.ROLES)}")
        image, cpu, mem = d.get("image"), d.get("cpu", CPU), d.get("memory", MEMORY)
        if not all(isinstance(x, str) and x and not any(c.isspace() for c in x)
                   for x in (image, cpu, mem)):
            raise ValueError(f"{where}: image, cpu and memory must be non-empty strings")
        out.append(Request(float(t), d["role"], image, float(hold), cpu, mem))
    if not out:
        raise ValueError(f"trace {path}: no requests")
    return sorted(out, key=lambda r: (r.t, r.role, r.image))


# ---- virtual time --------------------------------------------------------------------------
class _Clock:
    now = 0.0


class _VirtualSelector(selectors.DefaultSelector):
    """Never sleeps: a wait for `timeout` seconds moves the virtual clock on by it."""

    def __init__(self, clock: _Clock):
        super().__init__()
        self.clock = clock

    def select(self, timeout=None):
        ready = super().select(0)
        if ready:
            return ready
        if timeout is None:
            raise RuntimeError("virtual time: nothing scheduled and nothing to wait for")
        self.clock.now += max(0.0, timeout)
        return []


class VirtualLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self.clock = _Clock()
        super().__init__(_VirtualSelector(self.clock))
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self.clock.now

    def call_later(self, delay, callback, *args, context=None):
        # A positive wait lasts at least a microsecond: one shorter than the clock's float
        # resolution would fire with no time passing, and a wait computed from elapsed time
        # (the pacer's token refill, 1e-16 short of a token) would be rescheduled forever.
        if 0 < delay < 1e-6:
            delay = 1e-6
        return super().call_later(delay, callback, *args, context=context)


def run_virtual(coro):
    loop = VirtualLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        for t in asyncio.all_tasks(loop):
            t.cancel()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()


# ---- one replay ----------------------------------------------------------------------------
def _settings(policy: str) -> Settings:
    demand = policy == "demand"
    return Settings(
        namespace="replay", ready_check="pod", sweep_interval=1e9, image_pinning="off",
        default_idle_timeout=DEMAND_IDLE_S if demand else FIXED_IDLE_S,
        limits=Limits(),  # the controller's defaults: 20 creates/s, burst 40, 200 creating
        warm_budget=Budget(pods=WARM_BUDGET_PODS, cpu=WARM_BUDGET_PODS * float(CPU))
        if demand else Budget())


def _spec(r: Request) -> SandboxSpec:
    return SandboxSpec(r.image, cpu=r.cpu, memory=r.memory, role=r.role)


async def _replay(reqs: list[Request], policy: str, seed: int) -> dict:
    loop = asyncio.get_running_loop()
    kube = ReplayKube(seed)
    ctl = Controller(kube, _settings(policy), clock=loop.time)
    await ctl.start()
    t0 = loop.time()
    samples: dict[str, list[tuple[float, bool]]] = {role: [] for role in ROLES}
    failed = 0

    async def one(r: Request) -> None:
        nonlocal failed
        await asyncio.sleep(max(0.0, t0 + r.t - loop.time()))
        spec = _spec(r)
        if policy == "fixed 2" and r.role == contract.ROLE_GRADING:
            pool = ctl.pools.get(spec)
            if pool is None or not pool.floor:  # first request, or idle since: the pool starts
                ctl.prewarm(spec, FIXED_TARGET, FIXED_IDLE_S)
        start = loop.time()
        try:
            got = await ctl.acquire(AcquireOrder(spec, "replay", warm_ok=policy != "none",
                                                 timeout_s=3600))
        except Exception:  # noqa: BLE001 - counted, the replay goes on
            failed += 1
            return
        samples[r.role].append((loop.time() - start, bool(got["warm"])))
        await asyncio.sleep(r.hold_s)
        await ctl.release(got["id"])

    try:
        await asyncio.gather(*(one(r) for r in reqs))
        span = loop.time() - t0
        ctl.warm.tick()  # idle time counted up to the end of the trace
    finally:
        await ctl.stop()
    out: dict = {"policy": policy, "failed": failed, "span_s": span, "creates": kube.creates,
                 "idle_pod_h": ctl.warm.idle_pod_s / 3600,
                 "idle_vcpu_h": ctl.warm.idle_cpu_s / 3600}
    for role in ROLES:
        xs = samples[role]
        out[role] = {"n": len(xs),
                     "hits": (sum(1 for _, w in xs if w) / len(xs)) if xs else float("nan"),
                     "p50_s": percentile_or_nan([s for s, _ in xs], 50),
                     "p99_s": percentile_or_nan([s for s, _ in xs], 99)}
    return out


def probe_trace(burst: bool) -> list[Request]:
    reqs = [Request(1.0 + i * PROBE_STEP_S, contract.ROLE_GRADING, f"probe-{i:03d}", 5.0)
            for i in range(PROBE_GRADINGS)]
    if burst:
        reqs += [Request(1.0 + (i % 64) / 64, contract.ROLE_AGENT, f"burst-{i // 8:03d}", 300.0)
                 for i in range(BURST_ROLLOUTS)]
    return sorted(reqs, key=lambda r: (r.t, r.role, r.image))


def replay(reqs: list[Request], seed: int, policies: tuple[str, ...] = POLICIES) -> dict:
    """Every policy on the trace, then the burst probe of each: the report `render` prints."""
    out: dict = {"seed": seed, "requests": len(reqs), "policies": {}}
    for policy in policies:
        res = run_virtual(_replay(reqs, policy, seed))
        alone = run_virtual(_replay(probe_trace(False), policy, seed))
        loaded = run_virtual(_replay(probe_trace(True), policy, seed))
        res["probe_p99_alone_s"] = alone[contract.ROLE_GRADING]["p99_s"]
        res["probe_p99_burst_s"] = loaded[contract.ROLE_GRADING]["p99_s"]
        out["policies"][policy] = res
    return out


def goals(report: dict) -> list[tuple[str, bool]]:
    """(goal, met) for the demand policy against the fixed pool."""
    p = report["policies"]
    d, f = p.get("demand"), p.get("fixed 2")
    if d is None or f is None:
        return []
    hits = d[contract.ROLE_GRADING]["hits"]
    ratio = d["idle_vcpu_h"] / f["idle_vcpu_h"] if f["idle_vcpu_h"] > 0 else math.inf
    burst = d["probe_p99_burst_s"] / d["probe_p99_alone_s"] if d["probe_p99_alone_s"] > 0 \
        else math.inf
    return [
        (f"grading warm hits >= {GOAL_HITS:.0%} (demand: {hits:.1%})", hits >= GOAL_HITS),
        (f"idle warm vCPU-hours <= {GOAL_IDLE_RATIO:.0%} of the fixed pool's "
         f"(demand: {ratio:.0%})", ratio <= GOAL_IDLE_RATIO),
        (f"grading p99 under a rollout burst <= {GOAL_BURST_RATIO:g}x alone "
         f"(demand: {burst:.2f}x)", burst <= GOAL_BURST_RATIO),
    ]


def _f(x: float, fmt: str) -> str:
    return "n/a" if isinstance(x, float) and math.isnan(x) else format(x, fmt)


def render(report: dict, argv: list[str]) -> str:
    lines = [SECTION, "",
             f"`{docs.command('bench.replay', argv)}`: {report['requests']} acquires, seed "
             f"{report['seed']}, virtual time through the real Controller (books, pacer, "
             f"pipeline, warm pool). Create-to-Ready lognormal, median {READY_MEDIAN_S:g} s, "
             f"sigma {READY_SIGMA:g}; every API call {API_S * 1000:g} ms. Percentiles: linear "
             "interpolation between closest ranks (bench/stats.py).", "",
             f"{report.get('workload', 'Generated trace')}. Generated traces: runs start "
             f"together, each with its trajectories in flight as GRPO groups of {GROUP} of one image (started within 1 s), "
             f"{IMAGES[0]}-{IMAGES[1]} images per run in a shuffled cycle, rollouts lognormal "
             f"(median {ROLLOUT_MEDIAN_S:g} s), then 0/1/2 gradings (13.9/30.6/55.5%, median "
             f"{GRADING_MEDIAN_S:g} s), all {CPU} vCPU. Policies: none; fixed "
             f"{FIXED_TARGET} per grading key from its first request, {FIXED_IDLE_S:g} s idle "
             f"timeout (the paper's pool A/B); demand (controller/demand.py), budget "
             f"{WARM_BUDGET_PODS} pods / {WARM_BUDGET_PODS * float(CPU):g} vCPU, "
             f"{Budget.per_key} per key, {DEMAND_IDLE_S:g} s idle timeout. Idle warm hours: "
             "pods warm or parked, unused, over the trace's span. Burst probe: "
             f"{PROBE_GRADINGS} gradings of cold keys, one every {PROBE_STEP_S:g} s, alone and "
             f"while {BURST_ROLLOUTS} rollouts start within 1 s (pacer at the controller's "
             "defaults: 20 creates/s, burst 40, 200 creating).", "",
             "| policy | grading hits | grading p50 / p99 (s) | rollout hits | "
             "rollout p50 / p99 (s) | idle warm vCPU-h | idle warm pod-h | creates | "
             "grading p99 alone / under burst (s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, p in report["policies"].items():
        g, a = p[contract.ROLE_GRADING], p[contract.ROLE_AGENT]
        lines.append(
            f"| {name} | {_f(g['hits'], '.1%')} | {_f(g['p50_s'], '.2f')} / "
            f"{_f(g['p99_s'], '.2f')} | {_f(a['hits'], '.1%')} | {_f(a['p50_s'], '.2f')} / "
            f"{_f(a['p99_s'], '.2f')} | {p['idle_vcpu_h']:.1f} | {p['idle_pod_h']:.1f} | "
            f"{p['creates']} | {_f(p['probe_p99_alone_s'], '.2f')} / "
            f"{_f(p['probe_p99_burst_s'], '.2f')} |")
    lines += ["", "Goals:"]
    lines += [f"- {what}: {'met' if ok else 'not met'}" for what, ok in goals(report)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m bench.replay", description=__doc__.split(
        "\n", 1)[0])
    ap.add_argument("--seed", type=int, default=1, help="trace and create-time seed")
    ap.add_argument("--trace", type=Path, default=None,
                    help="a recorded trace (JSON lines) instead of a generated one")
    ap.add_argument("--write-trace", type=Path, default=None, metavar="FILE",
                    help="write the generated trace to FILE (JSON lines)")
    ap.add_argument("--minutes", type=float, default=MINUTES, help="generated trace length")
    docs.add_flags(ap)
    args = ap.parse_args(argv)
    docs.check_flags(ap, args)
    if args.trace and args.write_trace:
        ap.error("--write-trace writes a generated trace: drop --trace")
    if not args.minutes > 0:
        ap.error("--minutes must be > 0")
    runs, in_flight = (1, 16) if args.smoke else (RUNS, IN_FLIGHT)
    minutes = 10.0 if args.smoke else args.minutes
    try:
        reqs = load_trace(args.trace) if args.trace else generate(
            args.seed, minutes=minutes, runs=runs, in_flight=in_flight)
    except ValueError as e:
        print(f"bench.replay: {e}", file=sys.stderr)
        return 2
    if args.write_trace:
        write_trace(reqs, args.write_trace)
    report = replay(reqs, args.seed)
    report["workload"] = (f"Recorded trace {args.trace.name}" if args.trace else
                          f"Generated trace: {runs} run(s), {in_flight} trajectories in "
                          f"flight each, {minutes:g} minutes of group starts")
    section = render(report, argv)
    print(section)
    if args.write_docs:
        print(f"wrote {docs.write_section(section)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
