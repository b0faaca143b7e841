"""Acquisition of a reused grading pod vs a fresh one, on the test bed: the second half of
`python -m bench.reuse` (`make bench-reuse`).

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

import os
import statistics
import sys
import time
from pathlib import Path

from sandman.client import Client
from testbed.cluster import Cluster
from testbed.controller import ControllerProc
from testbed.standin import Standin

IMAGE = "registry.invalid/swe/grader:1"
SECTION = "## Checked reuse (controller): `python -m bench.reuse`"


def measure(cluster: Cluster, workdir: Path, rounds: int) -> dict:
    """`rounds` interleaved fresh/reused rounds on `cluster` (its own namespace, stand-in and
    controller, all stopped after); latencies in seconds."""
    load0 = os.getloadavg()[0]
    ns = cluster.new_namespace("bench-reuse")
    standin = Standin(cluster.core, ns, workdir / "standin").start()
    ctl = None
    fresh, reused, give_back = [], [], []
    try:
        ctl = ControllerProc(ns, cluster.kubeconfig, workdir / "controller.log",
                             ["--max-reuse", str(rounds + 10), "--log-level", "WARNING",
                              "--lease-name", f"bench-{ns}"],
                             ready_check="execd").start()
        kw = dict(job="bench", cpu="1", memory="1Gi", timeout_s=120, role="grading")
        with Client(ctl.url) as cl:
            sb = cl.acquire(IMAGE, **kw)
            assert sb.release(reuse=True) and sb.reused, "the first pod did not go back"
            for i in range(rounds):
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
        standin.stop()
        cluster.delete_namespace(ns)
    return {"rounds": rounds, "fresh": fresh, "reused": reused, "give_back": give_back,
            "load": (load0, os.getloadavg()[0])}


def render(res: dict) -> str:
    rounds = res["rounds"]
    f, r, g = (statistics.median(res[k]) * 1000 for k in ("fresh", "reused", "give_back"))
    return "\n".join([
        SECTION, "",
        f"`make bench-reuse` (`python -m bench.reuse --rounds {rounds}`): the "
        "test bed (kwok, 2 nodes, the stand-in's real execd), medians of "
        f"{rounds} interleaved rounds; load average {res['load'][0]:.2f} at the start, "
        f"{res['load'][1]:.2f} at the end.", "",
        "| measure | median ms | vs fresh |", "|---|---|---|",
        f"| acquire a fresh grading pod (`warm_ok=False`) | {f:.0f} | 1.00x |",
        f"| acquire the reused grading pod | {r:.0f} | {r / f:.2f}x |",
        f"| `release(reuse=True)`: token rotation, restore, clean `/diff`, patch | {g:.0f} | "
        f"{g / f:.2f}x |", "",
        "kwok starts no container: a real node's fresh acquisition adds the image pull and "
        "container start, so the ratio here is a lower bound on what reuse saves. The "
        "stand-in's baseline covers the pod's own directory only; in a real grading pod "
        "`/restore` walks the whole root filesystem (`--baseline-scope root`: the execd "
        "section above times it on the grading task image with a 10k-file repository).", ""])
