"""Acquisition of a reused grading pod vs a fresh one, on the test bed (`make bench-reuse`).

A script, not a test. The real controller (`--ready-check execd`) on kwok nodes, with the
kubelet stand-in's real execd behind every pod (testbed/standin.py). Each round, interleaved so
both arms share the machine's noise:

  fresh    acquire(role="grading", warm_ok=False): create, Ready, execd /health, hand-out;
           then a plain release (deleted)
  reused   acquire(role="grading", reused_ok=True) served by the pod parked by the previous round's
           release(reuse=True); a command changes the workspace, then release(reuse=True)
           (token rotation, execd /restore, /diff clean, patch) is timed too

kwok marks a pod Ready without starting a container, so "fresh" here has no image pull or
container start: a real node's fresh acquisition is slower, and the ratio here is a lower bound.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from execd.bench import write_docs
from sandman.client import Client
from testbed.cluster import Testbed, default_state_dir
from testbed.controller import ControllerProc
from testbed.kube import Cluster
from testbed.standin import Standin

IMAGE = "registry.invalid/swe/grader:1"
SECTION = "## Checked reuse (controller)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m controller.bench_reuse")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args(argv)
    state = default_state_dir("bench-reuse")
    tb = Testbed(state, nodes=2)
    print(f"# starting the test bed in {state}", file=sys.stderr)
    tb.start()
    ctl = standin = None
    fresh, reused, give_back = [], [], []
    try:
        cluster = Cluster.connect(tb.kubeconfig, tb)
        ns = cluster.new_namespace("bench-reuse")
        standin = Standin(cluster.core, ns, state / "standin").start()
        ctl = ControllerProc(ns, tb.kubeconfig, state / "controller.log",
                             ["--max-reuse", str(args.rounds + 10), "--log-level", "WARNING"],
                             ready_check="execd").start()
        kw = dict(job="bench", cpu="1", memory="1Gi", timeout_s=120, role="grading")
        with Client(ctl.url) as cl:
            sb = cl.acquire(IMAGE, **kw)
            assert sb.release(reuse=True) and sb.reused, "the first pod did not go back"
            for i in range(args.rounds):
                t = time.perf_counter()
                f = cl.acquire(IMAGE, warm_ok=False, **kw)
                fresh.append(time.perf_counter() - t)
                assert not f.warm
                f.release()
                t = time.perf_counter()
                r = cl.acquire(IMAGE, reused_ok=True, **kw)
                reused.append(time.perf_counter() - t)
                assert r.warm, "the parked grading pod was not handed out"
                r.exec(f"echo {i} > answer.py; export X={i}")
                t = time.perf_counter()
                assert r.release(reuse=True) and r.reused
                give_back.append(time.perf_counter() - t)
                print(f"# round {i + 1}: fresh {fresh[-1] * 1000:.0f} ms, reused "
                      f"{reused[-1] * 1000:.0f} ms, release(reuse) {give_back[-1] * 1000:.0f} "
                      "ms", file=sys.stderr)
    finally:
        if ctl:
            ctl.stop()
        if standin:
            standin.stop()
        tb.stop()
    f, r, g = (statistics.median(x) * 1000 for x in (fresh, reused, give_back))
    table = "\n".join([
        SECTION, "",
        f"`make bench-reuse` (`python -m controller.bench_reuse --rounds {args.rounds}`): the "
        "test bed (kwok, 2 nodes, the stand-in's real execd), medians of "
        f"{args.rounds} interleaved rounds; the machine was shared by 8 helpers.", "",
        "| measure | median ms | vs fresh |", "|---|---|---|",
        f"| acquire a fresh grading pod (`warm_ok=False`) | {f:.0f} | 1.00x |",
        f"| acquire the reused grading pod | {r:.0f} | {r / f:.2f}x |",
        f"| `release(reuse=True)`: token rotation, restore, clean `/diff`, patch | {g:.0f} | "
        f"{g / f:.2f}x |", "",
        "kwok starts no container: a real node's fresh acquisition adds the image pull and "
        "container start, so the ratio here is a lower bound on what reuse saves. The "
        "stand-in's baseline covers the pod's own directory only; in a real grading pod "
        "`/restore` also walks /etc, /usr/local, /opt, $HOME, /tmp and the package dirs "
        "(the execd section above times a 10k-file repository plus a venv).", ""])
    print(table)
    if args.write_docs:
        write_docs(table, SECTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
