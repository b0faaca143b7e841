"""One group acquire of N sandboxes vs N parallel acquires, on the test bed.

    python -m bench.group [--count 32] [--rounds 5] [--rate 20] [--burst 40]
                          [--kubeconfig KC] [--write-docs] [--smoke]

A script, not a test. The real controller (`--ready-check execd`, the pacing given) on kwok
nodes, with the kubelet stand-in's real execd behind every pod (testbed/standin.py). Each
round, interleaved so both arms share the machine's noise, with the warm pool off for both
(`warm_ok=False`: every sandbox is a create):

  group     one `acquire_group(IMAGE, N)` call
  parallel  N `acquire(IMAGE)` calls at once, one thread each (today's way)

Per arm: the controller calls the SDK made (its `on_request` hook), the time from the first
call to the last sandbox handed out, the creates the controller made (its creates_total) and
the queue waits it reports per sandbox (each answer's `timings.queued_ms`): the pacing both
arms went through. kwok starts no container, so times are the controller's own, without a
pull or a container start.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench import bed, docs
from bench.stats import median, percentile
from sandman.client import Client, Sandbox

IMAGE = "registry.invalid/swe/task:1"  # kwok never pulls
SIZE = {"cpu": "1", "memory": "1Gi"}
SECTION = "## Group acquires: `python -m bench.group`"
ARMS = ("group", "parallel")


class Calls:
    """The SDK's `on_request` hook: controller calls counted by kind."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.n: dict[str, int] = {}

    def __call__(self, kind: str, name: str, elapsed_ms: float, length: int,
                 exc: BaseException | None) -> None:
        with self.lock:
            self.n[kind] = self.n.get(kind, 0) + 1

    def total(self) -> int:
        with self.lock:
            return sum(self.n.values())


def creates(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith('sandman_controller_creates_total{result="ok"} '):
            return float(line.split()[1])
    return 0.0


def one_round(url: str, arm: str, n: int, job: str) -> dict:
    calls = Calls()
    c0 = creates(url)
    kw = dict(job=job, timeout_s=300, warm_ok=False, renew=False, **SIZE)
    with Client(url, on_request=calls) as cl:
        t0 = time.perf_counter()
        if arm == "group":
            got: list[Sandbox] = list(cl.acquire_group(IMAGE, n, **kw))
        else:
            with ThreadPoolExecutor(n) as pool:
                got = list(pool.map(lambda _: cl.acquire(IMAGE, **kw), range(n)))
        last = time.perf_counter() - t0
        made = calls.total()
        out = {"calls": made, "last_s": last, "creates": creates(url) - c0,
               "queued_ms": [sb.timings.queued_ms for sb in got]}
        for sb in got:
            sb.release()
    return out


def measure(cluster, workdir: Path, a: argparse.Namespace) -> dict:
    from testbed.controller import ControllerProc
    from testbed.procs import wait_for
    from testbed.standin import Standin

    load0 = docs.load1()
    ns = cluster.new_namespace("bench-group")
    standin = Standin(cluster.core, ns, workdir / "standin").start()
    ctl = None
    res: dict = {arm: [] for arm in ARMS}
    try:
        ctl = ControllerProc(ns, cluster.kubeconfig, workdir / "controller.log",
                             ["--rate", str(a.rate), "--burst", str(a.burst),
                              "--log-level", "WARNING", "--lease-name", f"bench-{ns}"],
                             ready_check="execd").start()
        for i in range(a.rounds):
            for arm in (ARMS if i % 2 == 0 else ARMS[::-1]):
                r = one_round(ctl.url, arm, a.count, f"{arm}-{i}")
                res[arm].append(r)
                print(f"# round {i + 1} {arm}: {r['calls']} calls, last sandbox "
                      f"{r['last_s'] * 1000:.0f} ms, {r['creates']:.0f} creates", file=sys.stderr)
                # Every pod of the round gone before the next: both arms start from nothing.
                wait_for(lambda: not cluster.core.list_namespaced_pod(ns).items, 120,
                         "the round's pods deleted")
    finally:
        if ctl:
            ctl.stop()
        standin.stop()
        cluster.delete_namespace(ns)
    res["load"] = (load0, docs.load1() if a.smoke else docs.settle())
    return res


def run_bed(a: argparse.Namespace) -> dict:
    return bed.run("bench-group", 2, measure, a)


def render(res: dict, a: argparse.Namespace, command: str) -> str:
    rows = []
    for arm in ARMS:
        rs = res[arm]
        waits = [q for r in rs for q in r["queued_ms"]]
        what = ("one `acquire_group(IMAGE, N)`" if arm == "group"
                else "N parallel `acquire(IMAGE)`")
        rows.append(f"| {what} | {median([r['calls'] for r in rs]):.0f} | "
                    f"{median([r['last_s'] for r in rs]) * 1000:.0f} | "
                    f"{median([r['creates'] for r in rs]):.0f} | "
                    f"{percentile(waits, 50):.0f} / {max(waits):.0f} |")
    return "\n".join([
        SECTION, "",
        f"`{command}`: the test bed (kwok, 2 nodes, the stand-in's real execd), N = {a.count} "
        f"sandboxes, creates paced at {a.rate:g}/s with a burst of {a.burst}, the warm pool "
        f"off; medians of {a.rounds} interleaved rounds per arm. Load average "
        f"{res['load'][0]:.2f} at the start, {res['load'][1]:.2f} at the end.", "",
        "| arm | controller calls | time to the last sandbox, ms | creates | queue wait "
        "p50 / max, ms |", "|---|---|---|---|---|", *rows, "",
        "Both arms go through the same pacer (each member of a group is one acquire): the "
        "creates and queue waits are the pacing each went through. Beyond the calls, a group "
        "fails whole: when a member cannot be had, the members already made are released at "
        "once and none is left leased.", ""])


def parse(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    ap = argparse.ArgumentParser(prog="python -m bench.group",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, default=32, help="sandboxes per group (N)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds per arm")
    ap.add_argument("--rate", type=float, default=20.0, help="the controller's --rate")
    ap.add_argument("--burst", type=int, default=40, help="the controller's --burst")
    ap.add_argument("--kubeconfig", default=None,
                    help="this cluster instead of a test bed of its own")
    docs.add_flags(ap)
    a = ap.parse_args(argv)
    docs.check_flags(ap, a)
    if a.smoke:
        a.count, a.rounds = 4, 1
    return ap, a


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _, a = parse(argv)
    res = run_bed(a)
    section = render(res, a, docs.command("bench.group", argv))
    print(section)
    if a.write_docs:
        refused = docs.docs_refusal(*res["load"])
        if refused:
            print(f"# {refused}", file=sys.stderr)
            return 1
        print(f"wrote {docs.write_section(section)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
