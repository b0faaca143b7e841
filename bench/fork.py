"""`make bench-fork`: fork and checkpoint/restore against what they replace, each goal a ratio of
two figures of one run.

    python -m bench.fork [--rounds 3] [--children 8] [--checkpoint-count 64]
                         [--checkpoint-rounds 3] [--files 100]
                         [--write-docs] [--smoke]

On the test bed (kwok, 2 nodes; its own bed, stopped after): the real controller
(`--ready-check execd`, checkpoints in the bed's real local registry, testbed/registry.py) and
the stand-in's real execd behind every pod in its `snapshots` mode, as the fork and checkpoint
bed tests run it: each agent pod's execd is rooted at its own directory, its "task image" (a
generated repository of `--repo-files` files, the same bytes, modes and mtimes in every pod),
and records its snapshot base there before it serves. Per round:

- **warm acquire**: one acquire served by a warm pool of 1 (prewarmed, waited for);
- **delta upload**: the `--files` changed files of the repository as one tree upload
  (`upload_tree`) into that sandbox, which makes it the parent;
- **fork**: `fork(children)` of that parent from a warm pool of `children` (prewarmed and
  waited for; every child checked served from it). Goal: fork <= 2x (warm acquire + delta
  upload), the ratio of each round, then their median.

Once, after the rounds (`--checkpoint-count` sandboxes of one job):

- **fresh acquires**: the N acquires at once with `warm_ok=False` (an empty pool), wall time
  from the first call to the last answer;
- **checkpoint** of the job, after each sandbox got the delta, a file and an exported variable
  of its own and a cwd;
- **restore** of the set after every original was released and deleted (a trainer that
  crashed), wall time of the one call that hands out all N. Goal: restore <= 1.5x the fresh
  acquires of the same N of the same image: both make N pods through the same acquire path on
  the same empty bed; the ratio is of the set, which is also the ratio of per-sandbox means.
  Its phases (read, fetch, sandboxes) come from the controller's
  `sandman_controller_restore_phase_seconds`, and the state written into the N fresh
  sandboxes at once (8 at a time, as a restore applies it) is this machine's bound on what a
  restore adds to the fresh acquires.

Every child's and every restored sandbox's tree is compared with its source's (a manifest of
every entry: kind, mode, sha256 or link target, read from the host), and each restored shell's
cwd and exported variable. kwok starts no container, so a fresh acquire here has no image pull
or container start: a real node's is slower, which favours the restore ratio's denominator
there.

With REAL_NODE=1 it also runs on the real node (its own bed with the real node, `helm install`
of the chart, a trainer pod as the real-node bench's): fork of a sandbox of the real task image
into `--real-children` and checkpoint/restore of `--real-checkpoint-count`, and the snapshot
base's cost at execd start (create-to-Ready of labelled sandbox pods of the task image with
SANDMAN_SNAPSHOT=on vs without, interleaved), since every agent pod the controller makes pays
it. See `real_node()`.

/proc/loadavg is printed before and after; `--write-docs` is refused when the 1-minute load
before the run was above 1.5 (bench/docs.py), and when it has not settled after.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as dt
import hashlib
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench import docs
from bench.stats import percentile

SECTION = "## Fork and checkpoints: `python -m bench.fork`"
IMAGE = "registry.invalid/swe/task:1"  # kwok never pulls
SIZE: dict = {"cpu": "1", "memory": "1Gi"}
PREFIX = "sandman/checkpoints"
IMAGE_MTIME = 1_700_000_000
WAIT_S = 300.0


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip()


def repo_files(n: int) -> dict[str, bytes]:
    """The generated repository of the "task image": n small source files in 10 packages."""
    return {f"repo/pkg{i % 10}/mod{i}.py": f"# module {i}\nVALUE = {i}\n".encode() * 8
            for i in range(n)}


class Image:
    """Plants the pod's "image" (the repository) before its execd starts."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files

    def __call__(self, pod: str, home: Path) -> None:
        for rel, data in self.files.items():
            p = home / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
            os.utime(p, (IMAGE_MTIME, IMAGE_MTIME))


def delta_dir(base: Path, files: dict[str, bytes], n: int) -> Path:
    """n changed files of the repository, laid out as one tree to upload into `repo/`."""
    out = base / "delta"
    for rel in list(files)[:n]:
        p = out / rel.removeprefix("repo/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(files[rel] + b"# changed by the agent\n")
    return out


def tree(home: Path) -> dict[str, tuple]:
    """Every entry under a pod's root: (kind, mode, sha256 or link target); the manifest
    children and restored sandboxes are compared by."""
    import stat

    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(home):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = os.lstat(p)
            mode = stat.S_IMODE(st.st_mode)
            if stat.S_ISLNK(st.st_mode):
                v: tuple = ("link", mode, os.readlink(p))
            elif stat.S_ISDIR(st.st_mode):
                v = ("dir", mode, None)
            else:
                v = ("file", mode, hashlib.sha256(p.read_bytes()).hexdigest())
            out[str(p.relative_to(home))] = v
    return out


def wait_for(pred, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError(f"bench.fork: not {what} after {timeout:.0f}s")
        time.sleep(0.2)


def timed(fn, *a, **kw):
    t = time.perf_counter()
    out = fn(*a, **kw)
    return time.perf_counter() - t, out


def _say(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr)


def measure(cluster, workdir: Path, a: argparse.Namespace) -> dict:
    """The rounds and the checkpoint part on `cluster` (its own namespace, stand-in, registry
    and controller, all stopped after); seconds."""
    from sandman.client import Client
    from testbed.controller import ControllerProc
    from testbed.registry import LocalRegistry
    from testbed.standin import Standin

    files = repo_files(a.repo_files)
    delta = delta_dir(workdir, files, a.files)
    ns = cluster.new_namespace("bench-fork")
    reg = LocalRegistry(cluster.testbed).start()
    standin = Standin(cluster.core, ns, workdir / "standin", snapshots=True, say=_say,
                      max_procs=max(200, 2 * a.checkpoint_count + a.children + 8),
                      before_start=Image(files)).start()
    root = standin.workdir
    ctl = None
    res: dict = {"rounds": [], "checks": 0}
    try:
        ctl = ControllerProc(ns, cluster.kubeconfig, workdir / "controller.log",
                             ["--lease-name", f"bench-{ns}", "--log-level", "WARNING",
                              "--checkpoint-registry", f"{reg.host}/{PREFIX}",
                              "--checkpoint-insecure"], ready_check="execd").start()
        with Client(ctl.url, timeout_s=WAIT_S) as cl:
            def warm(n: int) -> None:
                # The answer counts the pool's warm pods; the same target again changes nothing.
                wait_for(lambda: cl.prewarm(IMAGE, n, **SIZE).warm >= n, f"{n} warm pods")

            def gone() -> None:
                # Every pod deleted, so the next step starts on an empty bed.
                wait_for(lambda: not any(p.metadata.deletion_timestamp is None for p in
                                         cluster.core.list_namespaced_pod(ns).items),
                         "every pod deleted")

            for r in range(a.rounds):
                warm(1)
                acq, parent = timed(cl.acquire, IMAGE, job="fork", timeout_s=WAIT_S, **SIZE)
                assert parent.warm, "the warm acquire was not served by the pool"
                home = parent.exec("pwd").output.strip()
                up, _ = timed(parent.upload_tree, delta, home + "/repo")
                warm(a.children)
                fork, kids = timed(parent.fork, a.children, timeout_s=WAIT_S)
                assert all(k.warm for k in kids), "a child was not served by the warm pool"
                want = tree(root / parent.pod)
                changed = delta / "pkg0" / "mod0.py"
                assert want["repo/pkg0/mod0.py"][2] == hashlib.sha256(
                    changed.read_bytes()).hexdigest(), "the delta is not in the parent"
                for k in kids:
                    got = tree(root / k.pod)
                    assert got == want, f"child {k.pod}: its tree is not the parent's"
                    res["checks"] += 1
                # The machine's bound on a fork's fan-out: the same delta written into all the
                # children at once (their execds share this machine's CPUs, as no real pods do).
                homes = [k.exec("pwd").output.strip() for k in kids]
                with concurrent.futures.ThreadPoolExecutor(len(kids)) as pool:
                    t0 = time.monotonic()
                    list(pool.map(lambda kh: kh[0].upload_tree(delta, kh[1] + "/repo"),
                                  zip(kids, homes, strict=True)))
                    fan = time.monotonic() - t0
                cl.prewarm(IMAGE, 0, **SIZE)
                for sb in (*kids, parent):
                    sb.release()
                res["rounds"].append({"acquire": acq, "upload": up, "fork": fork, "fan": fan})
                print(f"# round {r + 1}: warm acquire {acq * 1000:.0f} ms, delta upload "
                      f"{up * 1000:.0f} ms, fork to {a.children} {fork * 1000:.0f} ms "
                      f"({fork / (acq + up):.2f}x); the delta into {a.children} at once "
                      f"{fan * 1000:.0f} ms ({fork / (acq + fan):.2f}x)", file=sys.stderr)
                gone()
            # Rounds of fresh acquires, checkpoint and restore: on this machine a step of 64
            # pods varies by several times from run to run, so the ratio is reported from
            # the round with the median ratio, with the others' range.
            cks = [checkpoint_part(cl, ctl.url, root, delta, a, gone)
                   for _ in range(a.checkpoint_rounds)]
            cks.sort(key=lambda c: c["restore"] / c["fresh"])
            res["checkpoint"] = cks[len(cks) // 2]
            res["checkpoint_ratios"] = [c["restore"] / c["fresh"] for c in cks]
            res["checkpoint_checks"] = sum(c["checks"] for c in cks)
    finally:
        if ctl is not None:
            ctl.stop()
        standin.stop()
        reg.stop()
        cluster.delete_namespace(ns)
    return res


def machine_cpu() -> float:
    """CPU-seconds this machine has been busy (every CPU, every process: /proc/stat's first
    line, all but idle and iowait)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    busy = sum(ticks[:8]) - ticks[3] - ticks[4]  # user..steal, less idle and iowait
    return busy / os.sysconf("SC_CLK_TCK")


def restore_phases(url: str) -> dict[str, float]:
    """The controller's sandman_controller_restore_phase_seconds sums, by phase (seconds)."""
    import httpx

    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("sandman_controller_restore_phase_seconds_sum{"):
            out[line.split('phase="', 1)[1].split('"', 1)[0]] = float(line.split()[-1])
    return out


def checkpoint_part(cl, url: str, root: Path, delta: Path, a: argparse.Namespace,
                    gone) -> dict:
    n = a.checkpoint_count
    lat: list[float] = []
    lock = threading.Lock()

    def fresh(_: int):
        t = time.perf_counter()
        sb = cl.acquire(IMAGE, job="ck", warm_ok=False, timeout_s=WAIT_S, **SIZE)
        with lock:
            lat.append(time.perf_counter() - t)
        return sb

    with ThreadPoolExecutor(n) as ex:
        t, cpu = time.perf_counter(), machine_cpu()
        sbs = list(ex.map(fresh, range(n)))
        fresh_s, fresh_cpu = time.perf_counter() - t, machine_cpu() - cpu
    assert not any(sb.warm for sb in sbs)

    def shape(i_sb) -> None:
        i, sb = i_sb
        home = sb.exec("pwd").output.strip()
        sb.upload_tree(delta, home + "/repo")
        r = sb.exec(f"printf {i} > repo/own-{i}; cd repo/pkg{i % 10}; export WHO=sb{i}")
        assert r.exit_code == 0, r

    # The restore's bound on this machine: the same N sandboxes given state at once, 8 at a
    # time as a restore applies them (controller/fork.py APPLY_CONCURRENCY), all N execds on
    # this machine's CPUs.
    with ThreadPoolExecutor(8) as ex:
        cpu = machine_cpu()
        shape_s, _ = timed(lambda: list(ex.map(shape, enumerate(sbs))))
        shape_cpu = machine_cpu() - cpu
    want = {sb.id: (tree(root / sb.pod), f"pkg{i % 10}", f"sb{i}") for i, sb in enumerate(sbs)}
    ck_s, ck = timed(cl.checkpoint, job="ck", timeout_s=WAIT_S)
    assert len(ck.sandboxes) == n, ck
    state = sum(s.bytes for s in ck.sandboxes)
    for sb in sbs:  # gone, as a crashed trainer's
        sb.release()
    gone()
    before = restore_phases(url)
    cpu = machine_cpu()
    restore_s, got = timed(cl.restore, ck.id, timeout_s=WAIT_S)
    restore_cpu = machine_cpu() - cpu
    after = restore_phases(url)
    phases = {k: after[k] - before.get(k, 0.0) for k in ("read", "fetch", "sandboxes")}
    assert set(got) == set(want), "the restore did not make every sandbox"
    checks = 0
    for old, sb in got.items():
        tr, cwd, who = want[old]
        assert tree(root / sb.pod) == tr, f"restored {sb.pod}: its tree is not {old}'s"
        out = sb.exec('pwd; echo "${WHO-unset}"').output.split()
        assert Path(out[0]).name == cwd and out[1] == who, (old, out)
        checks += 1
    for sb in got.values():
        sb.release()
    gone()
    print(f"# {n} fresh acquires {fresh_s * 1000:.0f} ms, checkpoint {ck_s * 1000:.0f} ms "
          f"({state} state bytes), restore {restore_s * 1000:.0f} ms "
          f"({restore_s / fresh_s:.2f}x; read {phases['read'] * 1000:.0f}, fetch "
          f"{phases['fetch'] * 1000:.0f}, sandboxes {phases['sandboxes'] * 1000:.0f}; "
          f"the state into {n} at once {shape_s * 1000:.0f}; machine CPU-s: fresh "
          f"{fresh_cpu:.1f}, state {shape_cpu:.1f}, restore {restore_cpu:.1f})",
          file=sys.stderr)
    return {"n": n, "fresh": fresh_s, "fresh_each": lat, "checkpoint": ck_s,
            "restore": restore_s, "bytes": state, "checks": checks, "phases": phases,
            "shape": shape_s, "cpu": {"fresh": fresh_cpu, "shape": shape_cpu,
                                      "restore": restore_cpu}}


def run_bed(a: argparse.Namespace) -> dict:
    """measure() on a test bed of its own (2 kwok nodes), stopped after."""
    from testbed.cluster import Cluster, Testbed, default_state_dir

    state = default_state_dir("bench-fork")
    tb = Testbed(state, nodes=2)
    print(f"# starting the test bed in {state}", file=sys.stderr)
    tb.start()
    try:
        with tempfile.TemporaryDirectory(prefix="sandman-bench-fork-") as tmp:
            try:
                return measure(Cluster.connect(tb.kubeconfig, tb), Path(tmp), a)
            except BaseException:
                keep_logs(Path(tmp), state / "failed")
                raise
    finally:
        tb.stop()


def keep_logs(workdir: Path, dest: Path) -> None:
    """A failed run's controller and execd logs, kept past its temporary directory (which
    goes with the run) for the one who reads the failure."""
    dest.mkdir(parents=True, exist_ok=True)
    for log in workdir.rglob("*.log"):
        shutil.copyfile(log, dest / log.name)
    print(f"# the failed run's logs: {dest}", file=sys.stderr)


def _busy(cpu_s: float, wall_s: float) -> str:
    return f"{cpu_s / wall_s:.2f}"


def _ms(x: float) -> str:
    return f"{x * 1000:.0f}"


def render(res: dict, a: argparse.Namespace, command: str, load: tuple[str, str],
           real: dict | None = None) -> str:
    rounds = res["rounds"]
    acq = statistics.median(r["acquire"] for r in rounds)
    up = statistics.median(r["upload"] for r in rounds)
    fk = statistics.median(r["fork"] for r in rounds)
    fork_ratio = statistics.median(r["fork"] / (r["acquire"] + r["upload"]) for r in rounds)
    fan = statistics.median(r["fan"] for r in rounds)
    fan_ratio = statistics.median(r["fork"] / (r["acquire"] + r["fan"]) for r in rounds)
    ck = res["checkpoint"]
    restore_ratio = ck["restore"] / ck["fresh"]
    ph, cpu = ck["phases"], ck["cpu"]
    ratios = res["checkpoint_ratios"]
    n = ck["n"]
    lines = [
        SECTION, "",
        f"`make bench-fork` (`{command}`), {dt.date.today().isoformat()}, "
        f"{os.cpu_count()} CPUs, {platform.machine()}, Python {platform.python_version()}. "
        f"/proc/loadavg before: `{load[0]}`; after: `{load[1]}`.", "",
        f"The test bed (kwok, 2 nodes): the real controller, checkpoints in the bed's local "
        f"registry, the stand-in's real execd behind each pod rooted at its own directory, whose "
        f"\"task image\" is a generated repository of {a.repo_files} files; the parent's change "
        f"is {a.files} of them rewritten. Medians of {len(rounds)} rounds.", "",
        "| measure | ms | goal |", "|---|---|---|",
        f"| warm acquire (a pool of 1) | {_ms(acq)} | |",
        f"| delta upload: {a.files} changed files as one `upload_tree` | {_ms(up)} | |",
        f"| fork into {a.children} from a warm pool of {a.children} | {_ms(fk)} | "
        f"{fork_ratio:.2f}x (warm acquire + delta upload), goal <= 2x: "
        f"{'met' if fork_ratio <= 2 else 'NOT met'} |",
        f"| the machine's bound: the delta uploaded into the {a.children} children at once | "
        f"{_ms(fan)} | fork is {fan_ratio:.2f}x (warm acquire + this) |",
        f"| {n} fresh acquires at once (`warm_ok=False`), wall | {_ms(ck['fresh'])} | "
        f"per sandbox p50 {_ms(percentile(ck['fresh_each'], 50))}, max "
        f"{_ms(max(ck['fresh_each']))} |",
        f"| checkpoint of the job's {n} ({ck['bytes'] / 1024:.0f} KiB of state) | "
        f"{_ms(ck['checkpoint'])} | |",
        f"| restore of the {n} (one call), wall | {_ms(ck['restore'])} | "
        f"{restore_ratio:.2f}x the {n} fresh acquires, goal <= 1.5x: "
        f"{'met' if restore_ratio <= 1.5 else 'NOT met'} |",
        f"| the restore ratio over {len(ratios)} rounds (each: fresh acquires, checkpoint, "
        f"restore) | | median {statistics.median(ratios):.2f}x, range {min(ratios):.2f}x - "
        f"{max(ratios):.2f}x (the rows above and below: the median round) |",
        f"| - its read: the set's index and {n} manifests | {_ms(ph['read'])} | |",
        f"| - its fetch: {n} states from the registry, each checked | {_ms(ph['fetch'])} | |",
        f"| - its sandboxes: {n} acquired, each given its state | {_ms(ph['sandboxes'])} | "
        f"{ph['sandboxes'] / ck['fresh']:.2f}x the fresh acquires |",
        f"| the machine's bound: the state written into the {n} fresh sandboxes, 8 at a time | "
        f"{_ms(ck['shape'])} | the fresh acquires + this: "
        f"{(ck['fresh'] + ck['shape']) / ck['fresh']:.2f}x |",
        f"| this machine's CPUs busy (CPU-s, every process) during: the fresh acquires / the "
        f"state writes / the restore | {cpu['fresh']:.1f} / {cpu['shape']:.1f} / "
        f"{cpu['restore']:.1f} | restore {cpu['restore'] / cpu['fresh']:.2f}x the fresh "
        f"acquires' CPU; busy {_busy(cpu['fresh'], ck['fresh'])} / "
        f"{_busy(cpu['shape'], ck['shape'])} / {_busy(cpu['restore'], ck['restore'])} of "
        f"{os.cpu_count()} CPUs |", "",
        f"Checked: {res['checks']} children's and {res['checkpoint_checks']} restored "
        "sandboxes' manifests "
        "(every entry's kind, mode, sha256 or link target) equal to their source's, and each "
        "restored shell's cwd and exported variable. The restore ratio is of the set: one "
        f"restore of {n} against {n} fresh acquires sent at once on the same empty bed (both "
        "make their pods through the same acquire path and pacer), which equals the ratio of "
        "the per-sandbox means. kwok starts no container: a fresh acquire here has no image "
        "pull or container start. The fork's children are written at once, and here their "
        f"execds share this machine's {os.cpu_count()} CPUs: the goal's single upload is one "
        f"execd's work, a fork's is {a.children}. The bound row is that work done without "
        "fork (the same delta into the same children, in parallel), so the gap between the "
        "two ratios is this machine's, and the second is fork's own cost. The restore's "
        "phases run one after the other (the controller's "
        "`sandman_controller_restore_phase_seconds`): no pod is made before every state is read "
        "and checked. Its sandboxes phase is the fresh acquires' work plus giving each its "
        f"state, whose bound on this machine is the state-writes row ({n} execds sharing "
        f"{os.cpu_count()} CPUs, as no real node's pods do). The CPU row is the whole "
        "machine's busy time (controller, API server, kwok, stand-in, every execd): when a step "
        f"keeps all {os.cpu_count()} CPUs busy, its wall time is its CPU work divided by "
        "them, so the restore's CPU-seconds against the fresh acquires' say what a restore "
        "costs on this machine beyond a fresh acquire.", ""]
    if real:
        lines += real_lines(real)
    return "\n".join(lines)


def real_lines(real: dict) -> list[str]:
    f = real["fork"]
    fork_ratio = f["fork"] / (f["acquire"] + f["upload"])
    restore_ratio = f["restore"] / f["fresh"]
    base, none = real["base"], real["none"]
    b50, n50 = statistics.median(base), statistics.median(none)
    return [
        f"Real node (`REAL_NODE=1`): its own bed with the real node, the chart installed, "
        f"checkpoints in the bed's local registry; a trainer pod runs the SDK "
        f"(bench/fork_agent.py). Sandboxes of the real task image at {real['cpu']} / "
        f"{real['memory']} (the node's 2 CPUs also hold the install and the trainer, so "
        f"fewer than on kwok); the delta is {real['files']} new files of a repository in "
        "/work/repo. One run.", "",
        "| measure | ms | goal |", "|---|---|---|",
        f"| warm acquire | {_ms(f['acquire'])} | |",
        f"| delta upload ({real['files']} files, one `upload_tree`) | {_ms(f['upload'])} | |",
        f"| fork into {real['children']} from a warm pool of {real['children']} | "
        f"{_ms(f['fork'])} | {fork_ratio:.2f}x (warm acquire + delta upload), goal <= 2x |",
        f"| {real['count']} fresh acquires at once, wall | {_ms(f['fresh'])} | |",
        f"| checkpoint of the {real['count']} ({f['bytes'] / 1024:.0f} KiB of state) | "
        f"{_ms(f['checkpoint'])} | |",
        f"| restore of the {real['count']}, wall | {_ms(f['restore'])} | {restore_ratio:.2f}x "
        f"the fresh acquires, goal <= 1.5x |",
        f"| create-to-Ready of a sandbox pod with the snapshot base (`SANDMAN_SNAPSHOT=on`), "
        f"median of {len(base)} | {_ms(b50)} | {b50 / n50:.2f}x without |",
        f"| the same pod without it, median of {len(none)} | {_ms(n50)} | 1.00x |", "",
        f"Checked: {f['kids_same']} of {real['children']} children and {f['restored_same']} of "
        f"{real['count']} restored sandboxes with their source's manifest (kinds, modes, link "
        f"targets and sha256 of the changed tree /work, {f['manifest_lines']} lines) and, for "
        "the restored, cwd and exported variable. The base's cost: labelled pods of the task "
        "image made by the webhook (no controller), one at a time, the two arms alternating, "
        "each checked by its execd's answer to `GET /snapshot` (a base, or 409 without); "
        "every agent pod the controller makes records the base before its execd serves.", ""]


def _ready(pod) -> bool:
    return any(c.type == "Ready" and c.status == "True"
               for c in (pod.status.conditions or []))


def _pods_gone(core, ns: str, timeout: float = WAIT_S) -> None:
    wait_for(lambda: not core.list_namespaced_pod(ns).items, f"every pod of {ns} gone", timeout)


def base_cost(core, ns: str, pairs: int, cpu: str, memory: str) -> dict[str, list[float]]:
    """create-to-Ready of a webhook-made sandbox pod of the task image with SANDMAN_SNAPSHOT=on
    and without, one pod at a time, the arms alternating."""
    import httpx

    from bench.realnode import _token, sandbox_pod
    from sandman.contract import EXECD_PORT, EXECD_SNAPSHOT_ENV
    from sandman.execd_api import SNAPSHOT

    out: dict[str, list[float]] = {"base": [], "none": []}
    for i in range(pairs):
        for arm in (("base", "none") if i % 2 == 0 else ("none", "base")):
            name = f"base-{arm}-{i}"
            token, sha = _token()
            pod = sandbox_pod(name, sha, cpu, memory)
            if arm == "base":
                pod["spec"]["containers"][0]["env"] = [{"name": EXECD_SNAPSHOT_ENV,
                                                        "value": "on"}]
            t = time.monotonic()
            core.create_namespaced_pod(ns, pod)
            wait_for(lambda n=name: _ready(core.read_namespaced_pod(n, ns)), f"{name} Ready")
            out[arm].append(time.monotonic() - t)
            # Its execd answers GET /snapshot (an empty one) only with a base: 409 without.
            ip = core.read_namespaced_pod(name, ns).status.pod_ip
            r = httpx.get(f"http://{ip}:{EXECD_PORT}{SNAPSHOT.path}", timeout=30,
                          headers={"Authorization": f"Bearer {token}"}, trust_env=False)
            if r.status_code != (200 if arm == "base" else 409):
                raise RuntimeError(f"bench.fork: {name}: GET /snapshot answered "
                                   f"{r.status_code}, so its base is not what the arm says")
            core.delete_namespaced_pod(name, ns, grace_period_seconds=0)
            _pods_gone(core, ns)
    return out


def run_agent(tb, core, ns: str, sbx_ns: str, cfg: dict) -> dict:
    """bench/fork_agent.py in the trainer pod; its `wait` lines are answered once every
    sandbox pod is gone."""
    import json
    import subprocess

    from testbed import build

    src = (Path(__file__).with_name("fork_agent.py")).read_text()
    proc = subprocess.Popen(
        [str(build.binaries()["kubectl"]), "--kubeconfig", str(tb.kubeconfig), "exec", "-i",
         "-n", ns, "trainer", "-c", "trainer", "--", "python3", "-u", "-c", src,
         json.dumps(cfg)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        for line in proc.stdout:
            if not line.startswith("BENCH "):
                continue
            got = json.loads(line[len("BENCH "):])
            if "wait" not in got:
                return got
            _pods_gone(core, sbx_ns)
            proc.stdin.write("\n")
            proc.stdin.flush()
        raise RuntimeError(f"bench.fork: the trainer's agent exited {proc.wait()} without "
                           "its results")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def real_node(a: argparse.Namespace) -> dict:
    """The real node's part on a bed of its own (stopped after, also on a failure)."""
    from kubernetes.client import RbacAuthorizationV1Api

    from bench.realnode import TASK_IMAGE, trainer_pod
    from testbed import trainer
    from testbed.cluster import Cluster, Testbed, default_state_dir
    from testbed.install import Install
    from testbed.registry import LocalRegistry
    from testbed.relay import Relay

    tb = Testbed(default_state_dir("bench-fork-real"), nodes=2, real_node=True,
                 real_node_wait=900)
    print("# starting the real-node bed", file=sys.stderr)
    tb.start()
    inst = reg = relay = None
    try:
        cluster = Cluster.connect(tb.kubeconfig, tb)
        core = cluster.core
        node_ip = getattr(tb.realnode, "node_ip", None)
        reg = LocalRegistry(tb).start()
        # The controller's pod reaches the node IP, never the host's loopback.
        relay = Relay(str(node_ip), "127.0.0.1", reg.port).start()
        inst = Install(tb)
        inst.install({"controller": {"checkpoints": {
            "registry": f"{node_ip}:{relay.port}/{PREFIX}", "insecure": True}}})
        ns = cluster.new_namespace("bench-fork")
        base = base_cost(core, ns, a.real_base_pairs, a.real_cpu, a.real_memory)
        trainer.prepare_namespace(cluster.api_client, inst, ns)
        # Prewarming is the admin's (the chart's admin ClusterRole, cluster-wide).
        binding: Any = {
            "metadata": {"name": f"bench-fork-admin-{ns}"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": "sandman-admin"},
            "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": ns}]}
        RbacAuthorizationV1Api(cluster.api_client).create_cluster_role_binding(binding)
        body: Any = trainer_pod("trainer", str(inst.image_ref), inst.controller_url_in_cluster())
        core.create_namespaced_pod(ns, body)
        wait_for(lambda: _ready(core.read_namespaced_pod("trainer", ns)), "trainer Ready")
        cfg = {"image": TASK_IMAGE, "children": a.real_children,
               "count": a.real_checkpoint_count, "files": a.files, "cpu": a.real_cpu,
               "memory": a.real_memory}
        fork = run_agent(tb, core, ns, inst.sandbox_namespace, cfg)
        print(f"# real node: {fork}", file=sys.stderr)
        if fork["kids_same"] != a.real_children or fork["restored_same"] != \
                a.real_checkpoint_count or fork["restored"] != a.real_checkpoint_count:
            raise RuntimeError(f"bench.fork: a real-node tree differs from its source: {fork}")
        cluster.delete_namespace(ns)
        return {"fork": fork, "base": base["base"], "none": base["none"],
                "children": a.real_children, "count": a.real_checkpoint_count,
                "files": a.files, "cpu": a.real_cpu, "memory": a.real_memory}
    finally:
        try:
            if inst is not None:
                inst.uninstall()
        finally:
            if relay is not None:
                relay.stop()
            if reg is not None:
                reg.stop()
            tb.stop()


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.fork", description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--children", type=int, default=8, help="fork to this many")
    ap.add_argument("--checkpoint-count", type=int, default=64,
                    help="sandboxes of the job checkpointed and restored")
    ap.add_argument("--checkpoint-rounds", type=int, default=3,
                    help="rounds of fresh acquires, checkpoint and restore")
    ap.add_argument("--files", type=int, default=100, help="changed files of the repository")
    ap.add_argument("--repo-files", type=int, default=1000,
                    help="files of the kwok pods' generated repository")
    # The real node has 2 CPUs, about 1 left beside the install and the trainer: a parent and
    # its warm pool (or the checkpointed set) at 150m each fit with room for pods going away.
    ap.add_argument("--real-children", type=int, default=3)
    ap.add_argument("--real-checkpoint-count", type=int, default=4)
    ap.add_argument("--real-cpu", default="150m")
    ap.add_argument("--real-memory", default="160Mi")
    ap.add_argument("--real-base-pairs", type=int, default=5,
                    help="snapshot base cost: create-to-Ready pairs (with, without)")
    docs.add_flags(ap)
    a = ap.parse_args(argv)
    docs.check_flags(ap, a)
    if a.smoke:
        a.rounds, a.children, a.checkpoint_count, a.repo_files = 1, 2, 4, 200
        a.checkpoint_rounds = 1
        a.real_children, a.real_checkpoint_count, a.real_base_pairs = 1, 2, 1
    if a.files > a.repo_files:
        ap.error("--files must be at most --repo-files")
    return a


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse(argv)
    before = loadavg()
    print(f"# /proc/loadavg before: {before}", file=sys.stderr)
    load0 = float(before.split()[0])
    if a.write_docs and load0 > docs.LOAD_MAX:
        print(f"bench.fork: the 1-minute load is {load0:.2f} (> {docs.LOAD_MAX}): --write-docs "
              "takes figures from a quiet machine only", file=sys.stderr)
        return 1
    res = run_bed(a)
    real = real_node(a) if os.environ.get("REAL_NODE") not in (None, "", "0") else None
    load1 = docs.settle() if a.write_docs else docs.load1()
    after = loadavg()
    print(f"# /proc/loadavg after: {after}", file=sys.stderr)
    section = render(res, a, docs.command("bench.fork", argv), (before, after), real)
    print(section)
    if a.write_docs:
        why = docs.docs_refusal(load0, load1)
        if why:
            print(why, file=sys.stderr)
            return 1
        print(f"wrote {docs.write_section(section)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
