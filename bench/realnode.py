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
- **create-to-Ready** of N pods in three arms, in waves (the node has 2 CPUs and every
  sandbox's effective CPU request is at least its injected init containers' 100m): `bare`, a
  pod of the task image with no sandbox label (same size, `sleep`); `webhook`, a labelled pod
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
from bench.stats import summarize

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
ARMS = ("bare", "webhook", "controller")
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


_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6,
          "G": 10**9, "m": 1e-3}


def quantity(q: str | int | float) -> float:
    """A Kubernetes quantity as a number (cpu in cores, memory in bytes)."""
    s = str(q).strip()
    m = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", s)
    if not m or (m.group(2) and m.group(2) not in _UNITS):
        raise ValueError(f"not a quantity: {q!r}")
    return float(m.group(1)) * _UNITS.get(m.group(2), 1)


def pod_request(spec: dict, resource: str) -> float:
    """What the scheduler counts for a pod: max(sum of containers, largest init container)."""
    def req(c: dict) -> float:
        r = c.get("resources") or {}
        v = (r.get("requests") or {}).get(resource) or (r.get("limits") or {}).get(resource)
        return quantity(v) if v is not None else 0.0

    main = sum(req(c) for c in spec.get("containers") or [])
    init = max((req(c) for c in spec.get("initContainers") or []), default=0.0)
    return max(main, init)


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


def render_section(res: dict) -> str:
    """docs/benchmarks.md's real-node section from a run's results (see run())."""
    c2r, first, echo = res["create_to_ready"], res["first_command"], res["echo"]
    bare = c2r["bare"]
    n = res["sandboxes"]
    names = {"bare": "bare pod (no sandman): create call -> Ready",
             "webhook": "labelled pod through the webhook (no controller): create call -> Ready",
             "controller": "SDK acquire (controller + webhook): acquire call -> pod Ready"}

    def row(what: str, agg: dict) -> str:
        return (f"| {what} | {agg['n']} | {_cell(agg)} | {ratio(agg['p50'], bare['p50']):.2f}x | "
                f"{ratio(agg['p99'], bare['p99']):.2f}x |")

    rows = [row(names[arm], c2r[arm]) for arm in ARMS]
    rows.append(row("SDK acquire call -> acquire answered (Ready + the controller's execd "
                    "/health check)", res["acquire"]))
    rows.append(row("**acquire-to-first-command**: SDK acquire call -> first `echo` answered",
                    first))
    per_round = "; ".join(
        f"round {i + 1}: " + ", ".join(f"{arm} {r[arm]['p50']:.2f}/{r[arm]['p99']:.2f}"
                                       for arm in ARMS)
        + f", first command {res['rounds_first'][i]['p50']:.2f}/"
          f"{res['rounds_first'][i]['p99']:.2f}"
        for i, r in enumerate(res["rounds_c2r"]))
    keys: list[str] = []
    for arm in ARMS:
        keys += [k for k in res["phases"][arm] if k not in keys]
    phase_rows = "\n".join(
        f"| {k} | " + " | ".join(f"{res['phases'][arm][k]:.1f}" if k in res["phases"][arm]
                                 else "-" for arm in ARMS) + " |" for k in keys)
    ctl = res["controller_timings"]
    gap = res["first_after_acquire"]
    t, h = echo["trainer"], echo["host"]
    m = res["machine"]
    left = res["leftovers"] or "nothing of the bench (its namespace and pods gone)"
    release_left = res.get("release_leftovers")
    left += (f"; `helm uninstall` left {release_left} (the known uninstall residual of issue "
             f"12, fixed separately; the bed's stop removed them)" if release_left else
             "; `helm uninstall` left nothing")
    return f"""{SECTION}

Sandman on the test bed's real node (real containers: kubelet, containerd + runc, bridge CNI,
kube-proxy, kube-router; testbed/realnode.py), installed with `helm install` as `make e2e` does
(testbed/install.py: 3 webhook replicas of 150m, 2 controllers of 250m, pacing 20/s with a
burst of 40), against a bare pod of the same image in the same run. Command: `make
bench-realnode` (`{res['command']}`). Machine: {m['cpus']} cores ({m['arch']}), kernel
{m['kernel']}, Python {m['python']}, {m['date']}; **shared with other work**: five other
engineers' sessions (builds, test beds, benches) ran on the same 2 cores, load average (1, 5,
15 min) {m['load_before']} before the run and {m['load_after']} after it: treat the absolute
figures as this machine's on that day, the ratios as the result. The node: the real node
`sandman-real-0` (the kwok nodes beside it cordoned by the install; every measured pod checked to
have run there), images already imported (`{TASK_IMAGE}`; nothing is pulled).

Pods: `{TASK_IMAGE}`, {CPU} CPU / {MEMORY} (requests == limits). A sandbox's scheduler request is
at least its injected init containers' 100m / 128Mi, so this size costs the node no more than a
smaller one (a 25m sandbox would only give execd a smaller CPU quota). With sandman installed and
the trainer pod running, {res['used_cpu']:.2f} of the node's {res['alloc_cpu']:.2f} CPUs were
requested, so **{res['wave']} pods fit at once: each arm's {n} pods per round run in waves of
{res['wave']}**: a wave's pods are created together (threads on this machine, or concurrent SDK
acquires in the trainer), all become Ready, then are deleted (released) and gone before the next
wave; the three arms take turns wave by wave, after one untimed wave per arm. The bare pod: no
sandbox label, same image and size, `sleep infinity`, no service-account token (the webhook
removes it from sandboxes too). The webhook arm's pods and the echo sandbox live in a bench
namespace holding copies of the chart's sandbox NetworkPolicies; the controller's sandboxes in
`sandboxes`. The trainer: a pod of the sandman image with the trainer label, {TRAINER_CPU} CPU
requested and no CPU limit, running the SDK (`sandman.client`, sync client, one thread per
acquire).

Definitions: **create** = the client sends the pod create (bare, webhook; from this machine) or
the SDK acquire (controller; from the trainer pod: same kernel clock); **Ready** = this machine's
pod watch receives the pod with condition Ready=True (a sandbox's readiness probe is execd's
`/health` every 1 s; a bare pod is Ready when its container runs). Seconds: the median over
{res['rounds']} rounds of each round's p50 / p99 over its {n} pods per arm (p99 interpolated
between the two slowest), the rounds' range in brackets; ratios are those medians over the bare
pod's.

| what | pods | p50 s (range) | p99 s (range) | p50 vs bare | p99 vs bare |
|---|---|---|---|---|---|
{chr(10).join(rows)}

Per round (p50/p99 s): {per_round}. The first `echo` after an acquire was answered
{gap['p50'] * 1000:.0f} ms (p50) / {gap['p99'] * 1000:.0f} ms (p99) after the acquire returned
(a new connection to execd). The controller's own account (medians over all acquires): queued
{ctl['queued_ms']:.0f} ms, create call {ctl['create_ms']:.0f} ms, create -> Ready + execd /health
{ctl['ready_ms']:.0f} ms. Errors: {res['errors'] or 'none'}.

Where the start goes (medians in s over all rounds, from the kubelet's container start/finish
times, which have 1 s resolution):

| phase | bare | webhook | controller |
|---|---|---|---|
{phase_rows}

**execd echo round trip**: `sb.exec("echo hi")` through the SDK on one warm keep-alive
connection, to one sandbox (made through the webhook, {res['echo_cpu']} CPU / {ECHO_MEMORY}: the
CPU left after the waves, behind the copied NetworkPolicy), {echo['n_per_block']} calls per block
after {echo['warmup']} untimed, blocks alternating trainer and host ({echo['blocks']} per side per
round). Milliseconds, median of the rounds' p50 / p99 (range):

| from | calls | p50 ms (range) | p99 ms (range) |
|---|---|---|---|
| a trainer pod in the cluster (pod network, NetworkPolicy) | {t['n']} | {_cell(t, 'ms')} |
| this machine, to the pod IP through the node's bridge | {h['n']} | {_cell(h, 'ms')} |

Trainer / host p50: {ratio(t['p50'], h['p50']):.2f}x, p99: {ratio(t['p99'], h['p99']):.2f}x.

Left after the run: {left}. Whole run {res['wall_s']:.0f} s, of which bed + install
{res['setup_s']:.0f} s. Raw per-pod results: `.testbed/bench-realnode.json`.
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

def _ts(t) -> float | None:
    return t.timestamp() if t is not None else None


def container_times(pod) -> dict:
    """Start/finish times (the kubelet's, 1 s resolution) of a pod's containers, for the
    breakdown of where a sandbox's start goes."""
    out: dict = {"created": _ts(pod.metadata.creation_timestamp), "init": {}}
    for c in pod.status.init_container_statuses or []:
        t = c.state.terminated if c.state else None
        if t is not None:
            out["init"][c.name] = [_ts(t.started_at), _ts(t.finished_at)]
    for c in pod.status.container_statuses or []:
        if c.state and c.state.running:
            out["main_started"] = _ts(c.state.running.started_at)
            break
    return out


def phase_breakdown(pods: list[dict]) -> dict:
    """Medians (s) of where each pod's start went, from container_times() and the Ready time:
    create -> first container start, each init container's run, main start -> Ready."""
    cols: dict[str, list[float]] = {}

    def add(key: str, v: float | None) -> None:
        if v is not None:
            cols.setdefault(key, []).append(v)

    for r in pods:
        ph = r.get("phases") or {}
        inits = ph.get("init") or {}
        starts = [v[0] for v in inits.values() if v[0] is not None]
        main = ph.get("main_started")
        first = min(starts) if starts else main
        if ph.get("created") is not None and first is not None:
            add("create -> first container started", first - ph["created"])
        for name, (t0, t1) in inits.items():
            if t0 is not None and t1 is not None:
                add(f"init {name}", t1 - t0)
        if main is not None and r.get("ready_at") is not None:
            add("main container started -> Ready", r["ready_at"] - main)
    return {k: statistics.median(v) for k, v in cols.items()}


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
            if pod.spec.node_name:
                rec["node"] = pod.spec.node_name
            if ready and "ready" not in rec:
                rec["ready"] = now
                rec["phases"] = container_times(pod)
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


def bare_pod(name: str) -> dict:
    from testbed import realnode

    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"containers": [{
                "name": "task", "image": TASK_IMAGE, "imagePullPolicy": "IfNotPresent",
                "command": ["sleep", "infinity"],
                "resources": {"requests": {"cpu": CPU, "memory": MEMORY},
                              "limits": {"cpu": CPU, "memory": MEMORY}}}],
                "automountServiceAccountToken": False, "terminationGracePeriodSeconds": 1,
                **realnode.placement()}}


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

    def node_room(self) -> tuple[float, float, int]:
        """(allocatable CPUs, CPUs requested now, pods of this size that fit) on the real node."""
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
        per_cpu, per_mem = quantity(CPU), quantity(MEMORY)
        fit = int(min((alloc - used) / per_cpu + 1e-9, (alloc_mem - used_mem) / per_mem))
        return alloc, used, fit

    # --- one wave of one arm --------------------------------------------------------------------
    def _name(self, arm: str) -> str:
        self.seq += 1
        return f"{arm}-{self.seq}"

    def host_wave(self, arm: str, n: int) -> list[dict]:
        """n pods created together from this machine; create-to-Ready from the watch."""
        names = [self._name(arm) for _ in range(n)]
        t0s: dict[str, float] = {}

        def create(name: str) -> None:
            body = bare_pod(name) if arm == "bare" else sandbox_pod(name, _token()[1])
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
        for nm in created:
            rec = self.watch.get(self.ns, nm)
            if "ready" in rec:
                out.append({"arm": arm, "pod": nm, "c2r": rec["ready"] - t0s[nm],
                            "node": rec.get("node"), "ready_at": rec["ready"],
                            "phases": rec.get("phases")})
        for nm in created:
            try:
                self.core.delete_namespaced_pod(nm, self.ns, grace_period_seconds=0)
            except Exception as e:  # noqa: BLE001
                self.errors.append(f"delete {nm}: {str(e)[:200]}")
        for k in self.watch.wait(keys, "gone", GONE_TIMEOUT_S):
            raise BenchError(f"pod {k[1]} not gone {GONE_TIMEOUT_S:.0f}s after its delete")
        return out

    def controller_wave(self, n: int) -> list[dict]:
        ans = self.agent.ask({"op": "wave", "n": n, "image": TASK_IMAGE, "job": "bench-realnode",
                              "cpu": CPU, "memory": MEMORY, "timeout_s": WAVE_TIMEOUT_S},
                             timeout=WAVE_TIMEOUT_S + 60)
        if "error" in ans:
            raise BenchError(f"trainer agent: {ans['error']}")
        out, keys = [], []
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
                        "timings": r["timings"], "node": rec.get("node"),
                        "ready_at": rec["ready"], "phases": rec.get("phases")})
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
        alloc, used, _ = self.node_room()
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

    def warmup(self, wave: int) -> None:
        """One untimed wave per arm: the first connections and container starts of the run."""
        for arm in ARMS:
            if arm == "controller":
                self.controller_wave(wave)
            else:
                self.host_wave(arm, wave)

    # --- a round ----------------------------------------------------------------------------------
    def round(self, i: int, wave: int) -> dict:
        from testbed import realnode

        res: dict[str, list[dict]] = {arm: [] for arm in ARMS}
        for w, n in enumerate(waves(self.args.sandboxes, wave)):
            for arm in arm_order(w):
                got = self.controller_wave(n) if arm == "controller" else self.host_wave(arm, n)
                res[arm] += got
            print(f"# round {i + 1} wave {w + 1}: " + ", ".join(
                f"{a} {statistics.median(r['c2r'] for r in res[a][-n:]):.2f}s"
                for a in ARMS if res[a][-n:]), file=sys.stderr)
        for arm in ARMS:
            for r in res[arm]:
                if r.get("node") != realnode.NODE_NAME:
                    self.errors.append(f"{arm} {r['pod']} ran on {r.get('node')}, not the real "
                                       f"node")
        echo = self.echo()
        return {"pods": res, "echo": echo}

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


def aggregate(rounds: list[dict]) -> dict:
    """The docs' figures from each round's raw results (see Bench.round())."""
    rounds_c2r = [{arm: summarize([r["c2r"] for r in rd["pods"][arm]]) for arm in ARMS}
                  for rd in rounds]
    ctl = [r for rd in rounds for r in rd["pods"]["controller"]]
    rounds_acq = [summarize([r["acquire"] for r in rd["pods"]["controller"]]) for rd in rounds]
    rounds_first = [summarize([r["first"] for r in rd["pods"]["controller"]]) for rd in rounds]
    gap = [r["first"] - r["acquire"] for r in ctl]
    echo_blocks = {side: [summarize(rd["echo"][side]) for rd in rounds]
                   for side in ("trainer", "host")}
    return {
        "create_to_ready": {arm: across_rounds([r[arm] for r in rounds_c2r]) for arm in ARMS},
        "acquire": across_rounds(rounds_acq),
        "first_command": across_rounds(rounds_first),
        "rounds_c2r": rounds_c2r, "rounds_first": rounds_first,
        "controller_timings": {k: statistics.median(r["timings"][k] for r in ctl)
                               for k in ("queued_ms", "create_ms", "ready_ms")},
        "echo": {side: across_rounds(v) for side, v in echo_blocks.items()},
        "first_after_acquire": summarize(gap),
        "phases": {arm: phase_breakdown([r for rd in rounds for r in rd["pods"][arm]])
                   for arm in ARMS},
    }


def measure(tb, inst, args, leftovers: list[str]) -> tuple[dict, list[dict], Bench]:
    """The rounds on an installed product (`inst` on the bed `tb`); what the bench made is
    deleted after, also after a failure (what is still there goes to `leftovers`)."""
    bench = Bench(tb, inst, args)
    rounds: list[dict] = []
    try:
        bench.setup()
        alloc, used, fit = bench.node_room()
        wave = min(args.wave, fit)
        if wave < 1:
            raise BenchError(f"no room on the real node: {used:.2f} of {alloc:.2f} CPUs requested")
        info = {"alloc_cpu": alloc, "used_cpu": used, "wave": wave}
        print(f"# real node: {used:.2f}/{alloc:.2f} CPUs requested, {fit} pods fit, waves of "
              f"{wave}", file=sys.stderr)
        if not args.smoke:  # the smoke checks the bench runs; its one round is not a figure
            bench.warmup(wave)
        for i in range(args.rounds):
            rounds.append(bench.round(i, wave))
            tb.check()
            RAW.parent.mkdir(exist_ok=True)
            RAW.with_suffix(".partial.json").write_text(json.dumps(
                {"meta": info, "rounds": rounds}, default=str))
    finally:
        leftovers += bench.teardown()
    return info, rounds, bench


def run(args, argv_used: list[str]) -> int:
    from testbed import build
    from testbed.cluster import Testbed, TestbedError, default_state_dir
    from testbed.install import Install, InstallError

    t_start = time.monotonic()
    machine = {"cpus": os.cpu_count(), "arch": platform.machine(), "kernel": platform.release(),
               "python": platform.python_version(),
               "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
               "load_before": _load()}
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
    meta = results_meta(args, argv_used, bench, info, leftovers, release_left, machine,
                        time.monotonic() - t_start)
    # Raw first: a section that fails to render is re-rendered from it (--render).
    RAW.parent.mkdir(exist_ok=True)
    RAW.write_text(json.dumps({"meta": meta, "rounds": rounds}, indent=1, default=str))
    print(f"# raw results: {RAW}", file=sys.stderr)
    render(RAW, args.write_docs)
    return 1 if bench.errors or leftovers else 0


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
            "wall_s": wall_s, "machine": {**machine, "load_after": _load()},
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
    ap.add_argument("--sandboxes", type=int, default=64, help="pods per arm per round (64)")
    ap.add_argument("--wave", type=int, default=8,
                    help="pods at once at most (fewer if the node has no room; default 8)")
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
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.render is not None:
        try:
            render(args.render, args.write_docs)
        except (OSError, ValueError, KeyError) as e:
            print(f"bench-realnode: cannot render {args.render}: {e}", file=sys.stderr)
            return 1
        return 0
    if min(args.rounds, args.sandboxes, args.wave, args.echo, args.echo_blocks) < 1:
        print("bench-realnode: --rounds, --sandboxes, --wave, --echo, --echo-blocks must be >= 1",
              file=sys.stderr)
        return 2
    from testbed import realnode

    why = realnode.install_sysdeps() or realnode.unavailable_reason()
    if why:
        print(f"bench-realnode: this machine cannot host the real node: {why}", file=sys.stderr)
        return 1
    return run(args, argv)


if __name__ == "__main__":
    sys.exit(main())
