"""`make bench-realnode`: sandman's latencies on the test bed's real node (real containers),
against a bare pod of the same image measured in the same run.

    python -m bench.realnode [--rounds 3] [--sandboxes 64] [--write-docs] [--smoke]

It starts its own bed (control plane, 2 kwok nodes, the real node; waits up to 15 min for the
machine's one real-node slot), `helm install`s sandman on it (testbed/install.py, the values
`make e2e` uses), measures, uninstalls and stops the bed, also after a failure. It runs against
the install's security as a trainer does (testbed/trainer.py): the trainer pod carries the
trainer label, in a namespace labelled and bound to the chart's user role, and calls the
controller over https with a projected token, verified with the published CA. `--smoke`: one
round of one pod per arm and a few echoes, no warm-up (tests/e2e/test_bench_smoke.py runs `measure()` on the
suite's install instead of an install of its own).

What is measured, per round (wall-clock times; the trainer's container and this process read
the same kernel clock, so their timestamps compare):
- **create-to-Ready** of N pods in four arms, in waves (the node has 2 CPUs and every
  sandbox's effective CPU request is at least its injected init containers' 100m): `bare`, a
  pod of the task image with no sandbox label (same size, `sleep`); `floor`, the bare pod with a
  guarded sandbox's shape and none of its work (an init container running `true`, an emptyDir,
  a 1 s readiness probe), the ceiling this kubelet sets for any such pod; `webhook`, a labelled pod
  created by this process, which the webhook turns into a guarded sandbox; `controller`, an
  SDK acquire from a trainer pod in the cluster (controller + webhook). Start: the create call
  (bare, webhook) or the acquire call (controller) is sent; end: this process's watch sees the
  pod's Ready condition True. The arms take turns wave by wave.
- **acquire-to-first-command** (controller arm): SDK acquire call start to the answer of the
  first `echo` sent to that sandbox's execd, in the trainer pod.
- **execd echo round trip** on a warm connection to one sandbox, from the trainer pod and from
  this machine (pod IPs are routed to the node's bridge), in alternating blocks.

The trainer pod runs bench/realnode_agent.py (stdin/stdout JSON lines over `kubectl exec -i`),
so one trainer process serves the whole round and its connection pools stay warm. Everything it creates is
deleted at the end (namespaces, pods; `helm uninstall`), and checked.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import platform
import re
import secrets
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench import docs, realnode_agent
from bench.docs import LOAD_MAX, docs_refusal, load1, settle
from bench.stats import percentile, summarize
from sandman.quantity import parse_quantity

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## real node: `python -m bench.realnode`"
TASK_IMAGE = "sandman.local/task:bookworm"
# The paper's tiny size. The injected init containers take the sandbox's own size
# (sandman/podspec.py injected_resources); below this (25m) python3 starting execd would be
# throttled to 2.5 ms of CPU per 100 ms.
CPU = "100m"
MEMORY = "128Mi"
TRAINER_CPU = "250m"
TRAINER_MEMORY = "256Mi"
# The echo sandbox gets the CPU left after the waves (at most this): at 100m execd's share of each
# call alone throttles it to ~10 ms per echo, which would measure the quota, not the path.
ECHO_CPU_MAX = 1.0
ECHO_MEMORY = "256Mi"
ARMS = ("bare", "floor", "webhook", "controller")
# The floor arm: a pod of the same image and size shaped like a guarded sandbox but doing no work
# (one init container running `true`, an emptyDir volume, a 1 s readiness probe on a `sleep`):
# the least this kubelet takes for any pod with that shape, whatever runs in it.
FLOOR_INIT = "floor-init"
# The larger size: the most CPU one pod can get beside the install (100m steps), 1 GiB per CPU.
LARGE_MEMORY_PER_CPU = 2**30
WAVE_TIMEOUT_S = 180.0
GONE_TIMEOUT_S = 120.0
AGENT_PREFIX = realnode_agent.PREFIX
RAW = ROOT / ".testbed" / "bench-realnode.json"


class BenchError(RuntimeError):
    """One line: what failed."""


# ---- pure parts: statistics, parsing, planning, the docs section ----------------------------

def across_rounds(per_round: list[dict]) -> dict:
    """Median and range of each round's p50 and p99 (rounds: summarize() outputs)."""
    out = {}
    for key in ("p50", "p99"):
        xs = [r[key] for r in per_round]
        out[key] = statistics.median(xs)
        out[key + "_range"] = (min(xs), max(xs))
    out["n"] = sum(r["n"] for r in per_round)
    return out


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("inf")


def waves(total: int, size: int) -> list[int]:
    """How many pods each wave creates: `total` in waves of at most `size`."""
    if total < 1 or size < 1:
        raise ValueError(f"waves: total {total} and size {size} must be >= 1")
    full, rest = divmod(total, size)
    return [size] * full + ([rest] if rest else [])


def arm_order(wave: int) -> tuple[str, ...]:
    """The arms take turns going first, so no arm always meets the machine right after another
    arm's deletions."""
    k = wave % len(ARMS)
    return ARMS[k:] + ARMS[:k]


def quantity(q: str | int | float) -> float:
    """A Kubernetes quantity as a number (cpu in cores, memory in bytes)."""
    return float(parse_quantity(q))


def pod_request(spec: dict, resource: str) -> float:
    """What the scheduler counts for a pod: max(sum of containers, largest init container)."""
    def req(c: dict) -> float:
        r = c.get("resources") or {}
        v = (r.get("requests") or {}).get(resource) or (r.get("limits") or {}).get(resource)
        return quantity(v) if v is not None else 0.0

    main = sum(req(c) for c in spec.get("containers") or [])
    init = max((req(c) for c in spec.get("initContainers") or []), default=0.0)
    return max(main, init)


_RFC3339 = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?(Z|[+-]\d\d:\d\d)")


def cri_seconds(v) -> float | None:
    """A CRI timestamp as seconds since the epoch, or None for an unset one: nanoseconds (a
    number, or digits as `crictl ps/pods -o json` print them) or RFC 3339 with up to 9 decimals
    (`crictl inspect`, `crictl logs --timestamps`). The runtime reads the same kernel clock as
    this process."""
    if v is None or v == "":
        return None
    if isinstance(v, (int, float)) or str(v).isdigit():
        n = int(v)
        return n / 1e9 if n > 0 else None
    m = _RFC3339.fullmatch(str(v).strip())
    if not m:
        raise ValueError(f"not a CRI timestamp: {str(v)[:80]!r}")
    base = dt.datetime.fromisoformat(m.group(1) + ("+00:00" if m.group(3) == "Z" else m.group(3)))
    if base.year < 1971:  # Go's zero time: not started / not finished
        return None
    return base.timestamp() + int((m.group(2) or "0").ljust(9, "0")) / 1e9


def json_values(text: str) -> list:
    """Every JSON value in `text`, lists flattened (`crictl inspect` prints one object per ID)."""
    dec, out, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            return out
        v, i = dec.raw_decode(text, i)
        out += v if isinstance(v, list) else [v]


def listening_at(log: str) -> float | None:
    """When execd said it listens, from `crictl logs --timestamps` of its container."""
    for line in log.splitlines():
        ts, _, rest = line.partition(" ")
        if rest.startswith("execd ") and " listening on " in rest:
            return cri_seconds(ts)
    return None


def phase_steps(r: dict) -> list[tuple[str, float]]:
    """One pod's start as (step, time) in order: the create call (the acquire call, for the
    controller), the watch seeing it scheduled, the runtime's pod sandbox, each init container
    created / started / exited, the main container created / started, execd listening, then the
    watch seeing Ready (and the acquire answered, the first command answered)."""
    cri = r.get("cri") or {}
    ctrs = cri.get("containers") or {}
    inits = [n for n in r.get("inits") or [] if n in ctrs]
    mains = [n for n in ctrs if n not in inits]
    steps: list[tuple[str, float | None]] = [
        ("create call", r.get("t0")), ("scheduled", r.get("scheduled")),
        ("pod sandbox created", cri.get("sandbox"))]
    for n in inits:
        c = ctrs[n]
        steps += [(f"{n} created", c.get("created")), (f"{n} started", c.get("started")),
                  (f"{n} exited", c.get("finished"))]
    if len(mains) == 1:
        c = ctrs[mains[0]]
        steps += [("main created", c.get("created")), ("main started", c.get("started"))]
    steps.append(("execd listening", cri.get("listening")))
    if r.get("arm") == "controller":
        steps += [("acquire answered", r.get("t1")), ("first command answered", r.get("t2"))]
    else:
        steps.append(("Ready seen", r.get("ready_at")))
    return [(k, t) for k, t in steps if t is not None]


def phase_intervals(r: dict) -> dict[str, float]:
    """One pod's start as consecutive intervals (s) between its phase_steps(), plus the whole
    (create call -> Ready seen, or acquire call -> first command answered) and, for the
    controller, execd listening -> the kubelet's Ready seen (what the early check saves)."""
    steps = phase_steps(r)
    out = {f"{a} -> {b}": tb - ta for (a, ta), (b, tb) in zip(steps, steps[1:], strict=False)}
    t0, cri = r.get("t0"), r.get("cri") or {}
    if r.get("arm") == "controller":
        if t0 is not None and r.get("t2") is not None:
            out["whole: acquire call -> first command answered"] = r["t2"] - t0
        if cri.get("listening") is not None and r.get("ready_at") is not None:
            out["(execd listening -> pod Ready seen)"] = r["ready_at"] - cri["listening"]
    elif t0 is not None and r.get("ready_at") is not None:
        out["whole: create call -> Ready seen"] = r["ready_at"] - t0
    return out


def phase_table(pods: list[dict]) -> dict[str, dict]:
    """Per interval label (in the order pods first show it): p50 and p99 (s) over `pods`."""
    cols: dict[str, list[float]] = {}
    for r in pods:
        for k, v in phase_intervals(r).items():
            cols.setdefault(k, []).append(v)
    return {k: {"p50": percentile(v, 50), "p99": percentile(v, 99), "n": len(v)}
            for k, v in cols.items()}


def parse_agent_line(line: str) -> dict | None:
    """The agent's answer in one line of its output, or None for any other line."""
    if not line.startswith(AGENT_PREFIX):
        return None
    data = json.loads(line[len(AGENT_PREFIX):])
    if not isinstance(data, dict):
        raise ValueError(f"agent answer is not an object: {line[:200]!r}")
    return data


def _cell(agg: dict, unit: str = "s") -> str:
    def f(x: float) -> str:
        return f"{x:.2f}" if unit == "s" else f"{x * 1000:.2f}"

    lo50, hi50 = agg["p50_range"]
    lo99, hi99 = agg["p99_range"]
    return (f"**{f(agg['p50'])}** ({f(lo50)}-{f(hi50)}) | **{f(agg['p99'])}** "
            f"({f(lo99)}-{f(hi99)})")


_NAMES = {"bare": "bare pod (no sandman): create call -> Ready",
          "floor": "floor: a sandbox's shape, no work (init `true`, volume, probe): create "
                   "call -> Ready",
          "webhook": "labelled pod through the webhook (plain client): create call -> Ready",
          "controller": "SDK acquire (controller + webhook): acquire call -> pod Ready"}


def _ratio_rows(sz: dict) -> list[str]:
    bare = sz["create_to_ready"]["bare"]

    def row(what: str, agg: dict) -> str:
        return (f"| {what} | {agg['n']} | {_cell(agg)} | {ratio(agg['p50'], bare['p50']):.2f}x | "
                f"{ratio(agg['p99'], bare['p99']):.2f}x |")

    rows = [row(_NAMES[arm], sz["create_to_ready"][arm]) for arm in ARMS]
    rows.append(row("SDK acquire call -> acquire answered", sz["acquire"]))
    rows.append(row("**acquire-to-first-command**: SDK acquire call -> first `echo` answered",
                    sz["first_command"]))
    return rows


def _phase_rows(sz: dict) -> list[str]:
    keys: list[str] = []
    for arm in ARMS:
        keys += [k for k in sz["phases"][arm] if k not in keys]
    whole = [k for k in keys if k.startswith("whole:") or k.startswith("(")]
    keys = [k for k in keys if k not in whole] + whole

    def cell(arm: str, k: str) -> str:
        v = sz["phases"][arm].get(k)
        return f"{v['p50'] * 1000:.0f} / {v['p99'] * 1000:.0f}" if v else "-"

    return [f"| {k} | " + " | ".join(cell(arm, k) for arm in ARMS) + " |" for k in keys]


# The goals the figures are held to (p50s against the bare pod's create -> Ready p50; p99s
# against its p99).
GOALS = (("plain client: create -> Ready p50", "webhook", "p50", 2.0),
         ("SDK: acquire -> first command p50", "first", "p50", 1.5),
         ("plain client p99", "webhook", "p99", 2.0),
         ("SDK: acquire -> first command p99", "first", "p99", 2.0))


def goal_lines(sz: dict) -> list[str]:
    """Each goal with the run's ratio and whether it was met."""
    bare = sz["create_to_ready"]["bare"]
    out = []
    for what, key, q, limit in GOALS:
        agg = sz["first_command"] if key == "first" else sz["create_to_ready"][key]
        r = ratio(agg[q], bare[q])
        out.append(f"{what} {r:.2f}x the bare pod's (goal <= {limit:.1f}x): "
                   f"{'met' if r <= limit else '**not met**'}")
    return out


def ceiling_lines(sz: dict) -> list[str]:
    """What the floor arm says of the goals: the ratio no pod of a sandbox's shape beats on
    this kubelet, whether each create -> Ready goal is above it, and what sandman adds over
    the floor (its own work: the guard, execd's install and start, under the pod's quota)."""
    bare, floor = sz["create_to_ready"]["bare"], sz["create_to_ready"]["floor"]
    out = []
    for q in ("p50", "p99"):
        f = ratio(floor[q], bare[q])
        limit = 2.0
        out.append(f"floor {q} {f:.2f}x the bare pod's: the {limit:.1f}x plain-client goal is "
                   + ("**above what this kubelet allows** for any pod of a sandbox's shape"
                      if f > limit else "within what this kubelet allows"))
    web, first = sz["create_to_ready"]["webhook"], sz["first_command"]
    out.append(f"plain client p50 {ratio(web['p50'], floor['p50']):.2f}x the floor's "
               f"({(web['p50'] - floor['p50']) * 1000:.0f} ms of sandman's own work over it); "
               f"SDK acquire -> first command p50 {ratio(first['p50'], floor['p50']):.2f}x the "
               f"floor's")
    return out


def container_costs(phases: dict) -> dict[str, float]:
    """Per injected init container, the p50 ms it adds to a start: its create -> start, its run
    (started -> exited) and the wait from its exit to the next container's create (what the
    start would not pay without it: the next container would follow the previous one)."""
    out: dict[str, float] = {}
    for k, v in phases.items():
        a = k.partition(" -> ")[0]
        name, _, step = a.rpartition(" ")
        if name.startswith("sandman-") and step in ("created", "started", "exited"):
            out[name] = out.get(name, 0.0) + v["p50"] * 1000
    return out


def kubelet_waits(phases: dict) -> dict[str, float]:
    """The p50 ms of a plain client's start that are the kubelet's pace, not work: each wait
    from an init container's exit to the next container's create (the kubelet sees the exit
    at its next pod-lifecycle relist, every 1 s), execd listening -> Ready seen (the readiness
    probe's 1 s tick and the status write), and the extra of scheduled -> pod sandbox created
    over the bare pod's (the kubelet polls the pod's volumes every 300 ms; a bare pod has
    none)."""
    web, bare = phases["webhook"], phases["bare"]
    out = {k: v["p50"] * 1000 for k, v in web.items()
           if k.partition(" -> ")[0].endswith(" exited") or k == "execd listening -> Ready seen"}
    vol = "scheduled -> pod sandbox created"
    if vol in web and vol in bare:
        out["volume mount wait (over the bare pod's)"] = (web[vol]["p50"]
                                                          - bare[vol]["p50"]) * 1000
    return out


def _size_block(sz: dict, cpu: str, memory: str, n: int, wave: int, rounds: int) -> str:
    per_round = "; ".join(
        f"round {i + 1}: " + ", ".join(f"{arm} {r[arm]['p50']:.2f}/{r[arm]['p99']:.2f}"
                                       for arm in ARMS)
        + f", first command {sz['rounds_first'][i]['p50']:.2f}/"
          f"{sz['rounds_first'][i]['p99']:.2f}"
        for i, r in enumerate(sz["rounds_c2r"]))
    ctl = ", ".join(f"{k[:-3]} {v:.0f} ms" for k, v in sz["controller_timings"].items())
    gap = sz["first_after_acquire"]
    costs = ", ".join(f"`{k}` {v:.0f} ms" for k, v in
                      container_costs(sz["phases"]["webhook"]).items())
    kw = kubelet_waits(sz["phases"])
    waited = sum(kw.values())
    waits = ", ".join(f"{k} {v:.0f}" for k, v in kw.items())
    return f"""**{cpu} CPU / {memory}** (requests == limits), {n} pods per arm per round in waves of
{wave}. Seconds: the median over {rounds} rounds of each round's p50 / p99 (range in brackets);
ratios are those medians over the bare pod's.

| what | pods | p50 s (range) | p99 s (range) | p50 vs bare | p99 vs bare |
|---|---|---|---|---|---|
{chr(10).join(_ratio_rows(sz))}

Against the goals: {'; '.join(goal_lines(sz))}.

The ceiling, measured in the same run by the floor arm: {'; '.join(ceiling_lines(sz))}.

Per round (p50/p99 s): {per_round}. The first `echo` was answered {gap['p50'] * 1000:.0f} ms
(p50) / {gap['p99'] * 1000:.0f} ms (p99) after the acquire returned. The acquire answer's own
`timings` (medians): {ctl or 'none'}.

Where the start goes, step by step (p50 / p99 in ms over all rounds' pods; each row is the
interval between two consecutive steps of the same pod, so a column's rows add up to its
`whole:` row at the median only roughly). Steps: the create call sent (the SDK acquire, for
the controller arm); the watch seeing the pod scheduled; the runtime's pod sandbox created
(CNI included in the next step); each container created / started / exited (containerd's
nanosecond times, `crictl inspect`); execd's "listening" log line (its CRI log timestamp);
the watch seeing Ready; the acquire and the first command answered in the trainer pod.

| step | bare | floor | webhook | controller |
|---|---|---|---|---|
{chr(10).join(_phase_rows(sz))}

What each injected init container adds to a plain client's start (p50 ms of its create ->
start, its run, and the wait from its exit to the next container's create): {costs or
'none seen'}. Of the plain client's p50, {waited:.0f} ms are the kubelet's pace rather than
work ({waits or 'none seen'}): the kubelet learns that a container exited or started at its
next pod-lifecycle relist (every 1 s), the readiness probe runs on a 1 s tick (the API's
minimum), and a pod with volumes waits for the kubelet's 300 ms mount poll.
"""


def render_section(res: dict) -> str:
    """docs/benchmarks.md's real-node section from a run's results (see run())."""
    echo = res["echo"]
    m = res["machine"]
    sizes = res.get("sizes") or [{"key": "pods", "cpu": CPU, "memory": MEMORY,
                                  "wave": res["wave"], "n": res["sandboxes"]}]
    blocks = [_size_block(res if z["key"] == "pods" else res["large"], z["cpu"], z["memory"],
                          z["n"], z["wave"], res["rounds"])
              for z in sizes if z["key"] == "pods" or res.get("large")]
    t, h = echo["trainer"], echo["host"]
    left = res["leftovers"] or "nothing of the bench (its namespace and pods gone)"
    release_left = res.get("release_leftovers")
    left += (f"; `helm uninstall` left {release_left} (the bed's stop removed it)"
             if release_left else "; `helm uninstall` left nothing")
    loads = (f"1-minute load {m.get('load1_start', float('nan')):.2f} at the start, "
             f"{res.get('load_last_wave', float('nan')):.2f} after the last wave (the bench's "
             f"own bed: control plane, install, real node) and "
             f"{m.get('load1_end', float('nan')):.2f} at the end, once the bed had stopped "
             f"(load average 1/5/15 min before the run: {m['load_before']})")
    return f"""{SECTION}

Sandman on the test bed's real node (real containers: kubelet, containerd + runc, bridge CNI,
kube-proxy, kube-router; testbed/realnode.py), installed with `helm install` as `make e2e` does
(testbed/install.py: 3 webhook replicas of 150m, 2 controllers of 250m, TLS and tokens on),
against a bare pod of the same image in the same run. Command: `make bench-realnode`
(`{res['command']}`). Machine: {m['cpus']} cores ({m['arch']}), kernel {m['kernel']}, Python
{m['python']}, {m['date']}, nothing else running; {loads}. The bench refuses to write this
section when the load was above {LOAD_MAX} at the start or the end. The node: the real node
`sandman-real-0` (the kwok nodes beside it cordoned by the install; every measured pod checked to
have run there), images already imported (`{TASK_IMAGE}`; nothing is pulled).

Arms: a **bare** pod (no sandbox label, same image and size, `sleep infinity`, no
service-account token); a **floor** pod, the bare pod shaped like a guarded sandbox but doing no
work (an init container running `true`, an emptyDir mounted in both, a 1 s exec readiness
probe of `true`): what this kubelet takes for that shape whatever runs in it; a labelled pod created by a **plain client** (this machine), which the
webhook turns into a guarded sandbox (one injected init container, netguard, which installs
execd once its rules are in, sized like the sandbox; execd's readiness probe); an **SDK acquire** from a trainer pod
(trainer label, projected token, https with the published CA; sync client, one thread per
acquire) through the controller, which asks execd `/ready` itself as soon as the sandbox
container runs. With sandman and the trainer running, {res['used_cpu']:.2f} of the node's
{res['alloc_cpu']:.2f} CPUs were requested. A wave's pods are created together, all become Ready,
then are deleted (released) and gone before the next; the arms take turns wave by wave (the
first arm moves on each round), after one untimed wave per arm. **Ready** = this machine's pod
watch receives the pod with Ready=True.

{chr(10).join(blocks)}
**execd echo round trip**: `sb.exec("echo hi")` through the SDK on one warm keep-alive
connection, to one sandbox (made through the webhook, {res['echo_cpu']} CPU / {ECHO_MEMORY}: the
CPU left after the waves), {echo['n_per_block']} calls per block after {echo['warmup']} untimed,
blocks alternating trainer and host ({echo['blocks']} per side per round). Milliseconds, median
of the rounds' p50 / p99 (range):

| from | calls | p50 ms (range) | p99 ms (range) |
|---|---|---|---|
| a trainer pod in the cluster (pod network, NetworkPolicy) | {t['n']} | {_cell(t, 'ms')} |
| this machine, to the pod IP through the node's bridge | {h['n']} | {_cell(h, 'ms')} |

Trainer / host p50: {ratio(t['p50'], h['p50']):.2f}x, p99: {ratio(t['p99'], h['p99']):.2f}x.
Errors: {res['errors'] or 'none'}. Left after the run: {left}. Whole run {res['wall_s']:.0f} s,
of which bed + install {res['setup_s']:.0f} s. Raw per-pod results:
`.testbed/bench-realnode.json`.
"""


def update_docs(section: str, path: Path | None = None) -> Path:
    """Replace (or append) the real-node section; the other sections stay as they are."""
    return docs.write_section(section, path)


# ---- the trainer pod's side ----------------------------------------------------------------

AGENT = Path(realnode_agent.__file__).read_text()


class Agent:
    """bench/realnode_agent.py in the trainer pod, over `kubectl exec -i`: one JSON request,
    one JSON answer."""

    def __init__(self, kubectl: Path, kubeconfig: Path, ns: str, pod: str) -> None:
        self.proc = subprocess.Popen(
            [str(kubectl), "--kubeconfig", str(kubeconfig), "exec", "-i", "-n", ns, pod, "-c",
             "trainer", "--", "python3", "-u", "-c", AGENT],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            bufsize=1)
        self._lines: list[str] = []
        self._cond = threading.Condition()
        self._err: list[str] = []
        threading.Thread(target=self._read, args=(self.proc.stdout, True), daemon=True).start()
        threading.Thread(target=self._read, args=(self.proc.stderr, False), daemon=True).start()

    def _read(self, stream, out: bool) -> None:
        for line in stream:
            with self._cond:
                (self._lines if out else self._err).append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def ask(self, req: dict, timeout: float) -> dict:
        with self._cond:
            self._lines.clear()
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        except OSError as e:
            raise BenchError(f"trainer agent gone ({e}): {self.stderr()}") from None
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self._lines:
                    got = parse_agent_line(line)
                    if got is not None:
                        self._lines.clear()
                        return got
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BenchError(f"trainer agent: no answer to {req['op']} in {timeout:.0f}s;"
                                     f" {self.stderr()}")
                if self.proc.poll() is not None:
                    raise BenchError(f"trainer agent exited {self.proc.returncode}: "
                                     f"{self.stderr()}")
                self._cond.wait(min(left, 1.0))

    def stderr(self) -> str:
        with self._cond:
            return " | ".join(self._err[-8:])[-1500:]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask({"op": "quit"}, timeout=60)
            except BenchError:
                pass
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


# ---- this machine's side -------------------------------------------------------------------

class PodWatch:
    """Per namespace, one watch thread: when each pod was first seen, first seen Ready, gone,
    and on which node (wall-clock times at the moment this process received the event)."""

    def __init__(self, core, namespaces: list[str]) -> None:
        self.core = core
        self.pods: dict[tuple[str, str], dict] = {}
        self.cond = threading.Condition()
        self.stopping = threading.Event()
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(ns,), daemon=True)
                        for ns in namespaces]
        for t in self.threads:
            t.start()

    def _note(self, ev_type: str, pod, now: float) -> None:
        key = (pod.metadata.namespace, pod.metadata.name)
        ready = any(c.type == "Ready" and c.status == "True"
                    for c in (pod.status.conditions or []))
        with self.cond:
            rec = self.pods.setdefault(key, {"seen": now})
            if pod.spec.node_name and "node" not in rec:
                rec["node"] = pod.spec.node_name
                rec["scheduled"] = now
            if ready and "ready" not in rec:
                rec["ready"] = now
                rec["inits"] = [c.name for c in pod.spec.init_containers or []]
            if ev_type == "DELETED":
                rec["gone"] = now
            self.cond.notify_all()

    def _run(self, ns: str) -> None:
        from kubernetes import watch
        from kubernetes.client import ApiException

        rv = None
        while not self.stopping.is_set():
            try:
                if rv is None:
                    lst = self.core.list_namespaced_pod(ns, _request_timeout=30)
                    now = time.time()
                    for p in lst.items:
                        self._note("LIST", p, now)
                    rv = lst.metadata.resource_version
                w = watch.Watch()
                for ev in w.stream(self.core.list_namespaced_pod, ns, resource_version=rv,
                                   timeout_seconds=20, _request_timeout=40):
                    now = time.time()
                    if ev["type"] == "ERROR":
                        rv = None
                        break
                    self._note(ev["type"], ev["object"], now)
                    rv = ev["object"].metadata.resource_version
                    if self.stopping.is_set():
                        w.stop()
            except ApiException as e:
                if e.status == 410:
                    rv = None
                    continue
                self.errors.append(f"watch {ns}: {e.status} {e.reason}")
                time.sleep(0.5)
            except Exception as e:  # noqa: BLE001 - a broken stream is reopened, bounded by stop
                self.errors.append(f"watch {ns}: {type(e).__name__}: {str(e)[:200]}")
                time.sleep(0.5)

    def get(self, ns: str, name: str) -> dict:
        with self.cond:
            return dict(self.pods.get((ns, name), {}))

    def wait(self, keys: list[tuple[str, str]], field: str, timeout: float) -> list:
        """Wait until every pod in keys has `field` (ready, gone); returns those still without."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                missing = [k for k in keys if field not in self.pods.get(k, {})]
                left = deadline - time.monotonic()
                if not missing or left <= 0:
                    return missing
                self.cond.wait(min(left, 1.0))

    def stop(self) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(timeout=25)


def _token() -> tuple[str, str]:
    token = secrets.token_hex(32)
    return token, hashlib.sha256(token.encode()).hexdigest()


def bare_pod(name: str, cpu: str = CPU, memory: str = MEMORY) -> dict:
    from testbed import realnode

    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"containers": [{
                "name": "task", "image": TASK_IMAGE, "imagePullPolicy": "IfNotPresent",
                "command": ["sleep", "infinity"],
                "resources": {"requests": {"cpu": cpu, "memory": memory},
                              "limits": {"cpu": cpu, "memory": memory}}}],
                "automountServiceAccountToken": False, "terminationGracePeriodSeconds": 1,
                **realnode.placement()}}


def floor_pod(name: str, cpu: str = CPU, memory: str = MEMORY) -> dict:
    """The bare pod plus what a guarded sandbox's shape costs the kubelet, with no work in it:
    an init container that exits at once, an emptyDir mounted in both containers (the
    kubelet's volume poll), and a readiness probe on the API's minimum period (an exec of
    `true`: nothing in the image listens without starting an interpreter)."""
    pod = bare_pod(name, cpu, memory)
    spec = pod["spec"]
    mount = [{"name": "floor", "mountPath": "/floor"}]
    res = spec["containers"][0]["resources"]
    spec["volumes"] = [{"name": "floor", "emptyDir": {}}]
    spec["initContainers"] = [{"name": FLOOR_INIT, "image": TASK_IMAGE,
                               "imagePullPolicy": "IfNotPresent", "command": ["true"],
                               "resources": res, "volumeMounts": mount}]
    spec["containers"][0]["volumeMounts"] = mount
    spec["containers"][0]["readinessProbe"] = {"exec": {"command": ["true"]},
                                               "periodSeconds": 1, "timeoutSeconds": 3}
    return pod


def sandbox_pod(name: str, token_sha: str, cpu: str = CPU, memory: str = MEMORY) -> dict:
    """A labelled pod as a plain client writes it; the webhook makes it a guarded sandbox."""
    from sandman.contract import ANNOTATION_TOKEN_SHA256, LABEL_SANDBOX, SANDBOX_TRUE
    from testbed import realnode

    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {LABEL_SANDBOX: SANDBOX_TRUE},
                         "annotations": {ANNOTATION_TOKEN_SHA256: token_sha}},
            "spec": {"containers": [{
                "name": "task", "image": TASK_IMAGE, "imagePullPolicy": "IfNotPresent",
                "resources": {"limits": {"cpu": cpu, "memory": memory}}}],
                "terminationGracePeriodSeconds": 1, **realnode.placement()}}


def trainer_labels() -> dict:
    """The chart's trainer selector (values.yaml networkPolicy.trainerSelector)."""
    import yaml

    from testbed.install import CHART

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    return dict(values["networkPolicy"]["trainerSelector"]["podSelector"]["matchLabels"])


def trainer_pod(name: str, image: str, controller_url: str) -> dict:
    """A trainer as docs/sdk.md sets one up (testbed/trainer.py): the trainer label, the
    namespace's `default` ServiceAccount with a projected token for the controller, its CA and
    the SDK's environment; `sleep`, the agent runs through `kubectl exec`."""
    from testbed import realnode, trainer

    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": trainer_labels()},
            "spec": {"restartPolicy": "Never", "automountServiceAccountToken": False,
                     "terminationGracePeriodSeconds": 1,
                     "containers": [trainer.trainer_container(
                         "trainer", image, ["sleep", "infinity"], controller_url,
                         # No CPU limit: a quota would throttle the SDK's side of the
                         # timings (a trainer is a big pod in production).
                         resources={"requests": {"cpu": TRAINER_CPU, "memory": TRAINER_MEMORY},
                                    "limits": {"memory": TRAINER_MEMORY}})],
                     "volumes": trainer.trainer_volumes(),
                     **realnode.placement()}}


class Bench:
    def __init__(self, tb, inst, args) -> None:
        from kubernetes import client, config

        self.tb, self.inst, self.args = tb, inst, args
        cfg = client.Configuration()
        config.load_kube_config(config_file=str(tb.kubeconfig), client_configuration=cfg)
        # Room for a wave's create threads and the watches: a full pool would open (and pay a
        # TLS handshake for) a new connection inside a timed create.
        cfg.connection_pool_maxsize = 32
        self.api = client.ApiClient(cfg)
        self.core = client.CoreV1Api(self.api)
        self.ns = f"bench-realnode-{os.getpid()}"
        self.sbx_ns = inst.sandbox_namespace
        self.errors: list[str] = []
        self.watch: PodWatch | None = None
        self.agent: Agent | None = None
        self.seq = 0
        self.echo_cpu = ""

    # --- set-up ------------------------------------------------------------------------------
    def setup(self) -> None:
        from kubernetes import client

        from testbed import build, trainer

        self.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(
            name=self.ns)))
        # The chart's sandbox policies, copied: the webhook arm's sandboxes and the echo
        # sandbox get the same NetworkPolicy treatment as the controller's.
        pols = json.loads(self.inst.kubectl("get", "networkpolicies", "-n", self.sbx_ns, "-o",
                                            "json").stdout)["items"]
        for p in pols:
            body = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                    "metadata": {"name": p["metadata"]["name"]}, "spec": p["spec"]}
            self.inst.kubectl("apply", "-n", self.ns, "-f", "-", stdin=json.dumps(body))
        # The admin's steps for a trainer namespace: the label the controller's NetworkPolicy
        # admits, the chart's user role for its ServiceAccount, the CA bundle.
        trainer.prepare_namespace(self.api, self.inst, self.ns)
        self.watch = PodWatch(self.core, [self.ns, self.sbx_ns])
        url = self.inst.controller_url_in_cluster()
        self.core.create_namespaced_pod(self.ns, trainer_pod("trainer", self.inst.image_ref, url))
        if self.watch.wait([(self.ns, "trainer")], "ready", 120):
            raise BenchError("trainer pod not Ready after 120 s")
        self.agent = Agent(build.binaries()["kubectl"], self.tb.kubeconfig, self.ns, "trainer")

    def node_room(self, cpu: str = CPU, memory: str = MEMORY) -> tuple[float, float, int, float]:
        """(allocatable CPUs, CPUs requested now, pods of this size that fit, bytes of memory
        unrequested) on the real node."""
        from testbed import realnode

        node = self.core.read_node(realnode.NODE_NAME)
        alloc = quantity(node.status.allocatable["cpu"])
        alloc_mem = quantity(node.status.allocatable["memory"])
        pods = self.core.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={realnode.NODE_NAME}").items
        used = used_mem = 0.0
        for p in pods:
            if p.status.phase in ("Succeeded", "Failed"):
                continue
            spec = self.api.sanitize_for_serialization(p.spec)
            used += pod_request(spec, "cpu")
            used_mem += pod_request(spec, "memory")
        # The injected init containers take the sandbox's own size: it is the whole request.
        per_cpu, per_mem = quantity(cpu), quantity(memory)
        fit = int(min((alloc - used) / per_cpu + 1e-9, (alloc_mem - used_mem) / per_mem))
        return alloc, used, fit, alloc_mem - used_mem

    # --- one wave of one arm --------------------------------------------------------------------
    def _name(self, arm: str) -> str:
        self.seq += 1
        return f"{arm}-{self.seq}"

    def cri_snapshot(self, ns: str, names: list[str]) -> dict[str, dict]:
        """The runtime's own nanosecond times for each named pod while it runs: its pod
        sandbox's creation, each container's created / started / finished, and when execd
        logged that it listens (its main container's log timestamps). Empty when the runtime
        cannot say (then the phase table has fewer rows, never made-up ones)."""
        rn = self.tb.realnode
        try:
            sandboxes = json.loads(rn.crictl("pods", "--namespace", f"^{ns}$", "-o",
                                             "json").stdout)["items"]
            sbx = {p["id"]: p for p in sandboxes if p["metadata"]["name"] in names
                   and p.get("state") == "SANDBOX_READY"}
            ctrs = [c for c in json.loads(rn.crictl("ps", "-a", "--namespace", f"^{ns}$", "-o",
                                                    "json").stdout)["containers"]
                    if c["podSandboxId"] in sbx]
            ids = [c["id"] for c in ctrs]
            status = {v["status"]["id"]: v["status"] for v in json_values(
                rn.crictl("inspect", "-o", "json", *ids).stdout)} if ids else {}
        except (ValueError, KeyError, OSError, subprocess.SubprocessError) as e:
            self.errors.append(f"crictl: {type(e).__name__}: {str(e)[:200]}")
            return {}
        out = {p["metadata"]["name"]: {"sandbox": cri_seconds(p.get("createdAt")),
                                       "containers": {}} for p in sbx.values()}
        for c in ctrs:
            pod = out[sbx[c["podSandboxId"]]["metadata"]["name"]]
            st = status.get(c["id"], {})
            name = c["metadata"]["name"]
            pod["containers"][name] = {
                "created": cri_seconds(st.get("createdAt") or c.get("createdAt")),
                "started": cri_seconds(st.get("startedAt")),
                "finished": cri_seconds(st.get("finishedAt"))}
            if c.get("state") == "CONTAINER_RUNNING":
                got = rn.crictl("logs", "--timestamps", c["id"], timeout=30)
                at = listening_at(got.stdout + got.stderr)
                if at is not None:
                    pod["listening"] = at
        return out

    def host_wave(self, arm: str, n: int, cpu: str = CPU, memory: str = MEMORY) -> list[dict]:
        """n pods created together from this machine; create-to-Ready from the watch."""
        names = [self._name(arm) for _ in range(n)]
        t0s: dict[str, float] = {}

        def create(name: str) -> None:
            body = (bare_pod(name, cpu, memory) if arm == "bare"
                    else floor_pod(name, cpu, memory) if arm == "floor"
                    else sandbox_pod(name, _token()[1], cpu, memory))
            t0s[name] = time.time()
            self.core.create_namespaced_pod(self.ns, body, _request_timeout=60)

        out: list[dict] = []
        with ThreadPoolExecutor(n) as ex:
            futs = [ex.submit(create, nm) for nm in names]
            for nm, f in zip(names, futs, strict=True):
                try:
                    f.result()
                except Exception as e:  # noqa: BLE001 - counted as this pod's failure
                    self.errors.append(f"{arm} create {nm}: {str(e)[:200]}")
        created = [nm for nm in names if nm in t0s]
        keys = [(self.ns, nm) for nm in created]
        for k in self.watch.wait(keys, "ready", WAVE_TIMEOUT_S):
            self.errors.append(f"{arm} {k[1]} not Ready after {WAVE_TIMEOUT_S:.0f}s")
        cri = self.cri_snapshot(self.ns, created)  # after the wave: no timed pod waits on it
        for nm in created:
            rec = self.watch.get(self.ns, nm)
            if "ready" in rec:
                out.append({"arm": arm, "pod": nm, "c2r": rec["ready"] - t0s[nm],
                            "node": rec.get("node"), "ready_at": rec["ready"], "t0": t0s[nm],
                            "scheduled": rec.get("scheduled"), "inits": rec.get("inits"),
                            "cri": cri.get(nm)})
        for nm in created:
            try:
                self.core.delete_namespaced_pod(nm, self.ns, grace_period_seconds=0)
            except Exception as e:  # noqa: BLE001
                self.errors.append(f"delete {nm}: {str(e)[:200]}")
        for k in self.watch.wait(keys, "gone", GONE_TIMEOUT_S):
            raise BenchError(f"pod {k[1]} not gone {GONE_TIMEOUT_S:.0f}s after its delete")
        return out

    def controller_wave(self, n: int, cpu: str = CPU, memory: str = MEMORY) -> list[dict]:
        ans = self.agent.ask({"op": "wave", "n": n, "image": TASK_IMAGE, "job": "bench-realnode",
                              "cpu": cpu, "memory": memory, "timeout_s": WAVE_TIMEOUT_S},
                             timeout=WAVE_TIMEOUT_S + 60)
        if "error" in ans:
            raise BenchError(f"trainer agent: {ans['error']}")
        out, keys = [], []
        pods = [r["pod"] for r in ans["results"] if "pod" in r]
        cri = self.cri_snapshot(self.sbx_ns, pods)
        for r in ans["results"]:
            if "pod" in r:
                keys.append((self.sbx_ns, r["pod"]))
            if "error" in r:
                self.errors.append(f"controller {r.get('pod', '?')}: {r['error']}")
                continue
            if r.get("warm"):
                self.errors.append(f"controller {r['pod']}: warm hit (expected a cold create)")
            self.watch.wait([(self.sbx_ns, r["pod"])], "ready", 10)
            rec = self.watch.get(self.sbx_ns, r["pod"])
            if "ready" not in rec:
                self.errors.append(f"controller {r['pod']}: acquired but its Ready never seen")
                continue
            out.append({"arm": "controller", "pod": r["pod"], "c2r": rec["ready"] - r["t0"],
                        "acquire": r["t1"] - r["t0"], "first": r["t2"] - r["t0"],
                        "t0": r["t0"], "t1": r["t1"], "t2": r["t2"],
                        "timings": r["timings"], "node": rec.get("node"),
                        "ready_at": rec["ready"], "scheduled": rec.get("scheduled"),
                        "inits": rec.get("inits"), "cri": cri.get(r["pod"])})
        rel = self.agent.ask({"op": "release"}, timeout=120)
        if "error" in rel:
            raise BenchError(f"trainer agent release: {rel['error']}")
        for k in self.watch.wait(keys, "gone", GONE_TIMEOUT_S):
            raise BenchError(f"released sandbox {k[1]} not gone after {GONE_TIMEOUT_S:.0f}s")
        return out

    # --- echo round trips -----------------------------------------------------------------------
    def echo(self) -> dict[str, list[float]]:
        from sandman.client import Sandbox
        from sandman.contract import EXECD_PORT

        token, sha = _token()
        name = self._name("echo")
        alloc, used, _, _ = self.node_room()
        cpu_m = int(min(ECHO_CPU_MAX, alloc - used) * 10 + 1e-9) * 100
        if cpu_m < 100:
            raise BenchError(f"no room for the echo sandbox: {used:.2f} of {alloc:.2f} CPUs")
        self.echo_cpu = f"{cpu_m}m"
        self.core.create_namespaced_pod(self.ns, sandbox_pod(name, sha, self.echo_cpu,
                                                             ECHO_MEMORY))
        try:
            if self.watch.wait([(self.ns, name)], "ready", WAVE_TIMEOUT_S):
                raise BenchError(f"echo sandbox {name} not Ready after {WAVE_TIMEOUT_S:.0f}s")
            ip = self.core.read_namespaced_pod(name, self.ns).status.pod_ip
            req = {"op": "echo", "address": ip, "port": EXECD_PORT, "token": token,
                   "n": self.args.echo, "warmup": 20}
            out: dict[str, list[float]] = {"trainer": [], "host": []}
            with Sandbox.connect(ip, EXECD_PORT, token) as sb:
                for _ in range(20):
                    sb.exec("echo hi", timeout=30)
                for b in range(self.args.echo_blocks * 2):
                    side = ("trainer", "host")[(b + (b // 2)) % 2]  # T H H T T H ...
                    if side == "trainer":
                        ans = self.agent.ask(req, timeout=300)
                        if "error" in ans:
                            raise BenchError(f"trainer echo: {ans['error']}")
                        out["trainer"] += ans["rtt_s"]
                    else:
                        for _ in range(self.args.echo):
                            t = time.perf_counter()
                            r = sb.exec("echo hi", timeout=30)
                            out["host"].append(time.perf_counter() - t)
                            if r.output != "hi\n":
                                raise BenchError(f"host echo answered {r.output[:100]!r}")
            return out
        finally:
            self.core.delete_namespaced_pod(name, self.ns, grace_period_seconds=0)
            self.watch.wait([(self.ns, name)], "gone", GONE_TIMEOUT_S)

    def wave(self, arm: str, n: int, size: dict) -> list[dict]:
        if arm == "controller":
            return self.controller_wave(n, size["cpu"], size["memory"])
        return self.host_wave(arm, n, size["cpu"], size["memory"])

    def warmup(self, size: dict) -> None:
        """One untimed wave per arm: the first connections and container starts of the run."""
        for arm in ARMS:
            self.wave(arm, size["wave"], size)

    # --- a round ----------------------------------------------------------------------------------
    def round(self, i: int, sizes: list[dict]) -> dict:
        """Each size's pods (its `n` per arm in waves of its `wave`, the arms taking turns, the
        first arm moving on each round), then the echo blocks. Keys: the sizes' `key`s."""
        from testbed import realnode

        out: dict = {}
        for size in sizes:
            res: dict[str, list[dict]] = {arm: [] for arm in ARMS}
            for w, n in enumerate(waves(size["n"], size["wave"])):
                for arm in arm_order(w + i):
                    res[arm] += self.wave(arm, n, size)
                print(f"# round {i + 1} {size['cpu']} wave {w + 1}: " + ", ".join(
                    f"{a} {statistics.median(r['c2r'] for r in res[a][-n:]):.2f}s"
                    for a in ARMS if res[a][-n:]) + f" (load {load1():.2f})", file=sys.stderr)
            for arm in ARMS:
                for r in res[arm]:
                    if r.get("node") != realnode.NODE_NAME:
                        self.errors.append(f"{arm} {r['pod']} ran on {r.get('node')}, not the "
                                           f"real node")
            out[size["key"]] = res
        out["echo"] = self.echo()
        return out

    def teardown(self) -> list[str]:
        """Delete everything the bench made; returns what is still there."""
        left = []
        if self.agent is not None:
            self.agent.close()
        if self.watch is not None:
            self.watch.stop()
        self.inst.kubectl("delete", "namespace", self.ns, "--ignore-not-found", "--wait=true",
                          "--timeout=120s", check=False, timeout=150)
        if self.inst.kubectl("get", "namespace", self.ns, check=False).returncode == 0:
            left.append(f"namespace {self.ns}")
        pods = self.core.list_namespaced_pod(self.sbx_ns).items
        left += [f"pod {self.sbx_ns}/{p.metadata.name}" for p in pods]
        return left


def _load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def aggregate_size(rounds: list[dict], key: str) -> dict:
    """One size's figures (`key`: its results in each round, see Bench.round())."""
    rounds_c2r = [{arm: summarize([r["c2r"] for r in rd[key][arm]]) for arm in ARMS}
                  for rd in rounds]
    ctl = [r for rd in rounds for r in rd[key]["controller"]]
    rounds_acq = [summarize([r["acquire"] for r in rd[key]["controller"]]) for rd in rounds]
    rounds_first = [summarize([r["first"] for r in rd[key]["controller"]]) for rd in rounds]
    timing_keys = [k for k in (ctl[0]["timings"] if ctl else {})]
    return {
        "create_to_ready": {arm: across_rounds([r[arm] for r in rounds_c2r]) for arm in ARMS},
        "acquire": across_rounds(rounds_acq),
        "first_command": across_rounds(rounds_first),
        "rounds_c2r": rounds_c2r, "rounds_first": rounds_first,
        "controller_timings": {k: statistics.median(r["timings"].get(k, 0.0) for r in ctl)
                               for k in timing_keys},
        "first_after_acquire": summarize([r["first"] - r["acquire"] for r in ctl]),
        "phases": {arm: phase_table([r for rd in rounds for r in rd[key][arm]])
                   for arm in ARMS},
    }


def aggregate(rounds: list[dict]) -> dict:
    """The docs' figures from each round's raw results: the tiny size's at the top level, the
    larger size's under "large" (None when the run had none), the echo's."""
    echo_blocks = {side: [summarize(rd["echo"][side]) for rd in rounds]
                   for side in ("trainer", "host")}
    return {**aggregate_size(rounds, "pods"),
            "large": aggregate_size(rounds, "large") if all("large" in rd for rd in rounds)
            else None,
            "echo": {side: across_rounds(v) for side, v in echo_blocks.items()}}


def plan_sizes(args, alloc: float, used: float, fit: int, mem_free: float) -> list[dict]:
    """The sizes a round measures: the paper's tiny pods in waves of what fits (at most
    --wave), then (unless --large-sandboxes 0) the largest pod the node fits beside the install,
    one at a time. Raises BenchError when not even one tiny pod fits."""
    wave = min(args.wave, fit)
    if wave < 1:
        raise BenchError(f"no room on the real node: {used:.2f} of {alloc:.2f} CPUs requested")
    sizes = [{"key": "pods", "cpu": CPU, "memory": MEMORY, "wave": wave, "n": args.sandboxes}]
    cpu_m = int((alloc - used) * 10 + 1e-9) * 100
    mem = min(cpu_m / 1000 * LARGE_MEMORY_PER_CPU, mem_free) // 2**20
    if args.large_sandboxes > 0 and cpu_m > quantity(CPU) * 1000 and mem >= 128:
        sizes.append({"key": "large", "cpu": f"{cpu_m}m", "memory": f"{int(mem)}Mi", "wave": 1,
                      "n": args.large_sandboxes})
    return sizes


def measure(tb, inst, args, leftovers: list[str]) -> tuple[dict, list[dict], Bench]:
    """The rounds on an installed product (`inst` on the bed `tb`); what the bench made is
    deleted after, also after a failure (what is still there goes to `leftovers`)."""
    bench = Bench(tb, inst, args)
    rounds: list[dict] = []
    try:
        bench.setup()
        alloc, used, fit, mem_free = bench.node_room()
        sizes = plan_sizes(args, alloc, used, fit, mem_free)
        info = {"alloc_cpu": alloc, "used_cpu": used, "wave": sizes[0]["wave"], "sizes": sizes}
        print(f"# real node: {used:.2f}/{alloc:.2f} CPUs requested, {fit} tiny pods fit; sizes "
              + ", ".join(f"{z['cpu']}/{z['memory']} x{z['n']} in waves of {z['wave']}"
                          for z in sizes), file=sys.stderr)
        if not args.smoke:  # the smoke checks the bench runs; its one round is not a figure
            bench.warmup(sizes[0])
        for i in range(args.rounds):
            rounds.append(bench.round(i, sizes))
            tb.check()
            RAW.parent.mkdir(exist_ok=True)
            RAW.with_suffix(".partial.json").write_text(json.dumps(
                {"meta": info, "rounds": rounds}, default=str))
        info["load_last_wave"] = load1()
    finally:
        leftovers += bench.teardown()
    return info, rounds, bench


def run(args, argv_used: list[str]) -> int:
    from testbed import build
    from testbed.cluster import Testbed, TestbedError, default_state_dir
    from testbed.install import Install, InstallError

    start_load = settle()  # a machine still busy with an earlier step gets up to SETTLE_S
    print(f"# 1-minute load at the start: {start_load:.2f}", file=sys.stderr)
    if args.write_docs and start_load > LOAD_MAX:
        print(f"bench-realnode: {docs_refusal(start_load, 0.0)}; run it with nothing else "
              f"running", file=sys.stderr)
        return 1
    t_start = time.monotonic()
    machine = {"cpus": os.cpu_count(), "arch": platform.machine(), "kernel": platform.release(),
               "python": platform.python_version(),
               "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
               "load_before": _load(), "load1_start": start_load}
    tb = Testbed(default_state_dir("bench-realnode"), nodes=2, real_node=True,
                 real_node_wait=args.node_wait)
    inst = bench = None
    rounds: list[dict] = []
    leftovers: list[str] = []
    release_left: list[str] = []
    info: dict = {}
    try:
        tb.start()
        inst = Install(tb)
        inst.install()
        setup_s = time.monotonic() - t_start - tb.realnode.timings.get("slot-wait", 0.0)
        info, rounds, bench = measure(tb, inst, args, leftovers)
        info["setup_s"] = setup_s
    except (BenchError, TestbedError, InstallError, build.BuildError) as e:
        print(f"bench-realnode: {e}", file=sys.stderr)
        return 1
    finally:
        try:
            if inst is not None:
                inst.uninstall()
                # What the release itself leaves (helm uninstall's residue) is reported, not
                # blamed on the bench; tb.stop() below removes it with the bed.
                release_left = inst.leftovers() + inst.runtime_leftovers()
        finally:
            tb.stop()
    wall_s = time.monotonic() - t_start
    machine["load1_end"] = settle()  # the bed has stopped: what is left is someone else's
    meta = results_meta(args, argv_used, bench, info, leftovers, release_left, machine, wall_s)
    refusal = docs_refusal(start_load, machine["load1_end"])
    print(f"# 1-minute load: {start_load:.2f} at the start, "
          f"{info.get('load_last_wave', float('nan')):.2f} after the last wave, "
          f"{machine['load1_end']:.2f} at the end (bed stopped)", file=sys.stderr)
    # Raw first: a section that fails to render is re-rendered from it (--render).
    RAW.parent.mkdir(exist_ok=True)
    RAW.write_text(json.dumps({"meta": meta, "rounds": rounds}, indent=1, default=str))
    print(f"# raw results: {RAW}", file=sys.stderr)
    if refusal and args.write_docs:
        print(f"bench-realnode: {refusal}", file=sys.stderr)
    render(RAW, args.write_docs and not refusal)
    return 1 if bench.errors or leftovers or (refusal and args.write_docs) else 0


def results_meta(args, argv_used: list[str], bench: Bench, info: dict, leftovers: list[str],
                 release_left: list[str], machine: dict, wall_s: float) -> dict:
    """What the docs section says besides the figures (render_section())."""
    if bench.errors or bench.watch.errors:
        print(f"bench-realnode: errors: {(bench.errors + bench.watch.errors)[:10]}",
              file=sys.stderr)
    return {**info, "rounds": args.rounds, "sandboxes": args.sandboxes,
            "errors": "; ".join(bench.errors[:5]), "leftovers": "; ".join(leftovers),
            "release_leftovers": ", ".join(release_left), "echo_cpu": bench.echo_cpu,
            "command": docs.command("bench.realnode", argv_used),
            "wall_s": wall_s, "machine": machine,
            "echo": {"n_per_block": args.echo, "warmup": 20, "blocks": args.echo_blocks}}


def render(raw: Path, update: bool) -> str:
    """The docs section from a raw results file (printed; written with update)."""
    data = json.loads(raw.read_text())
    meta = data["meta"]
    res = {**aggregate(data["rounds"]), **{k: v for k, v in meta.items() if k != "echo"}}
    res["echo"].update(meta["echo"])
    section = render_section(res)
    print(section)
    if update:
        print(f"# wrote {update_docs(section)}", file=sys.stderr)
    return section


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.realnode",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="whole measurements (default 3)")
    ap.add_argument("--sandboxes", type=int, default=12,
                    help="tiny pods per arm per round (12)")
    ap.add_argument("--wave", type=int, default=4,
                    help="tiny pods at once at most (fewer if the node has no room; default 4)")
    ap.add_argument("--large-sandboxes", type=int, default=4,
                    help="pods of the largest size per arm per round, one at a time (4; 0: none)")
    ap.add_argument("--echo", type=int, default=200, help="echo calls per block (200)")
    ap.add_argument("--echo-blocks", type=int, default=2, help="blocks per side per round (2)")
    ap.add_argument("--node-wait", type=float, default=900,
                    help="seconds to wait for the machine's real-node slot (900)")
    ap.add_argument("--render", type=Path, metavar="RAW",
                    help="no run: the section from a raw results file of an earlier run")
    docs.add_flags(ap)
    return ap


def parse(argv: list[str]) -> argparse.Namespace:
    ap = parser()
    args = ap.parse_args(argv)
    docs.check_flags(ap, args)
    if args.smoke:
        args.rounds, args.sandboxes, args.wave, args.echo, args.echo_blocks = 1, 1, 1, 5, 1
        args.large_sandboxes = 0
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.render is not None:
        try:
            m = json.loads(args.render.read_text())["meta"]["machine"]
            refusal = docs_refusal(m.get("load1_start", float("inf")),
                                   m.get("load1_end", float("inf")))
            if args.write_docs and refusal:
                print(f"bench-realnode: {refusal}", file=sys.stderr)
                return 1
            render(args.render, args.write_docs)
        except (OSError, ValueError, KeyError) as e:
            print(f"bench-realnode: cannot render {args.render}: {e}", file=sys.stderr)
            return 1
        return 0
    if min(args.rounds, args.sandboxes, args.wave, args.echo, args.echo_blocks) < 1 or \
            args.large_sandboxes < 0:
        print("bench-realnode: --rounds, --sandboxes, --wave, --echo, --echo-blocks must be >= 1"
              " and --large-sandboxes >= 0", file=sys.stderr)
        return 2
    from testbed import realnode

    why = realnode.install_sysdeps() or realnode.unavailable_reason()
    if why:
        print(f"bench-realnode: this machine cannot host the real node: {why}", file=sys.stderr)
        return 1
    return run(args, argv)


if __name__ == "__main__":
    sys.exit(main())
