"""One mini-swe-agent step through sandman's environment vs mini-swe-agent's own local backend, on
the same machine, in one invocation (`make bench-minisweagent`: `python -m bench.minisweagent
--write-docs`).

A script, not a test. Each target runs `DefaultAgent.step()` (its deterministic test model's
`echo hi` action: query, execute, the observation rendered with the environment's template
variables), interleaved inside each repeat so they share the machine's noise:
  local     minisweagent.environments.local.LocalEnvironment: subprocess.run(shell=True) on
            this machine (no container, no HTTP); the machine has no Docker engine, so its
            DockerEnvironment cannot run here
  sandman   sandman.client.minisweagent.SandmanEnvironment over a real execd (token on) on
            127.0.0.1, with `bash -c` (as local's shell) and with its default `bash -lc`
  sdk       sandman.client.Sandbox.exec("echo hi") on the same execd: the floor under it
--write-docs replaces its section of docs/benchmarks.md, only when the 1-minute load was at
most bench/docs.py's LOAD_MAX at the start and the end (both recorded); --smoke: a few
steps, one repeat.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from minisweagent import __version__ as MINI_VERSION
from minisweagent.agents.default import DefaultAgent
from minisweagent.environments.local import LocalEnvironment
from minisweagent.models.test_models import DeterministicModel, make_output

from bench import docs
from bench.stats import percentile
from sandman.client import Sandbox
from sandman.client.minisweagent import SandmanEnvironment
from testbed.execd import start_execd

SECTION = "## mini-swe-agent environment: `python -m bench.minisweagent`"
# The smallest templates: the step's cost is the environment's, not Jinja's.
AGENT = {"system_template": "s", "instance_template": "{{task}}",
         "cost_limit": 0, "step_limit": 0}


def timed_steps(env: Any, calls: int) -> tuple[list[float], int]:
    """Latencies (s) of `calls` agent steps and how many observations lacked "hi"."""
    model = DeterministicModel(outputs=[make_output("", [{"command": "echo hi"}])
                                        for _ in range(calls)])
    agent = DefaultAgent(model, env, **AGENT)
    lat, wrong = [], 0
    for _ in range(calls):
        t0 = time.perf_counter()
        obs = agent.step()
        lat.append(time.perf_counter() - t0)
        wrong += "<returncode>0</returncode>" not in obs[0]["content"] or \
            "hi" not in obs[0]["content"]
        agent.messages.clear()  # a long trajectory would make later steps costlier
    return lat, wrong


def timed_sdk(sb: Sandbox, calls: int) -> tuple[list[float], int]:
    lat, wrong = [], 0
    for _ in range(calls):
        t0 = time.perf_counter()
        r = sb.exec("echo hi")
        lat.append(time.perf_counter() - t0)
        wrong += r.output != "hi\n" or r.exit_code != 0
    return lat, wrong


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=200, help="steps per target per repeat")
    p.add_argument("--repeats", type=int, default=5, help="medians over this many repeats")
    docs.add_flags(p)
    args = p.parse_args(argv)
    docs.check_flags(p, args)
    if args.smoke:
        args.calls, args.repeats = 3, 1
    if not (1 <= args.calls <= 100_000 and 1 <= args.repeats <= 100):
        p.error("--calls in [1, 100000], --repeats in [1, 100]")
    cmdline = docs.command("bench.minisweagent", sys.argv[1:] if argv is None else argv)

    load_start = docs.settle() if args.write_docs else docs.load1()
    work = Path(tempfile.mkdtemp(prefix="bench-minisweagent-"))
    home = work / "home"
    home.mkdir()
    # The login bash reads ~/.profile: this machine's own (running `pyenv init`) is not what a
    # sandbox's image has. Both execd and the local backend get an empty HOME.
    ex = start_execd(work / "execd", env={"HOME": str(home)})
    sdk = Sandbox.connect(ex.address, ex.port, ex.token)
    local = LocalEnvironment(cwd=str(work), env={"HOME": str(home)})
    plain = SandmanEnvironment(sandbox=sdk, cwd=str(work), interpreter=["bash", "-c"])
    login = SandmanEnvironment(sandbox=sdk, cwd=str(work))
    rows: dict[str, list[dict[str, float]]] = {}
    wrong: dict[str, int] = {}
    try:
        targets: list[tuple[str, Callable[[], tuple[list[float], int]]]] = [
            ("mini-swe-agent LocalEnvironment (sh -c)", lambda: timed_steps(local, args.calls)),
            ("sandman environment, bash -c", lambda: timed_steps(plain, args.calls)),
            ("sandman environment, bash -lc (default)",
             lambda: timed_steps(login, args.calls)),
            ("sandman SDK Sandbox.exec (floor, no agent)", lambda: timed_sdk(sdk, args.calls)),
        ]
        for _, fn in targets:  # warm-up, untimed
            fn()
        for rep in range(args.repeats):
            for name, fn in targets:
                lat, bad = fn()
                rows.setdefault(name, []).append(
                    {"p50": percentile(lat, 50) * 1e3, "p99": percentile(lat, 99) * 1e3,
                     "sps": len(lat) / sum(lat)})
                wrong[name] = wrong.get(name, 0) + bad
                print(f"repeat {rep + 1}/{args.repeats} {name}: p50 "
                      f"{rows[name][-1]['p50']:.3f} ms", file=sys.stderr, flush=True)
    finally:
        sdk.close()
        ex.stop()
        shutil.rmtree(work, ignore_errors=True)
    load_end = docs.settle() if args.write_docs else docs.load1()

    med = {n: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
           for n, runs in rows.items()}
    names = list(med)
    lo, pl, lg, floor = (med[n] for n in names)
    lines = [
        SECTION, "",
        f"Produced by `{cmdline}` (from the repo root, venv python; `make bench-minisweagent`) "
        f"on {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs (1-minute load average "
        f"{load_start:.2f} at the start, {load_end:.2f} at the end), Python "
        f"{sys.version.split()[0]}, mini-swe-agent {MINI_VERSION}, execd on 127.0.0.1 with a "
        f"token. Each figure is the median over {args.repeats} repeats of {args.calls} "
        f"sequential `DefaultAgent.step()` per target (its deterministic test model's "
        f"`echo hi` action: query, execute, the observation rendered), targets interleaved "
        f"within each repeat. This machine has no Docker engine: the comparison is "
        f"mini-swe-agent's local backend, a process of this machine per action.", "",
        "| target | step p50 ms | p99 ms | steps/s | observations without `hi` |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, s in med.items():
        lines.append(f"| {name} | {s['p50']:.3f} | {s['p99']:.3f} | {s['sps']:.0f} | "
                     f"{wrong[name]} of {args.calls * args.repeats} |")
    lines += [
        "",
        f"- sandman (`bash -c`) p50 - local p50: **{pl['p50'] - lo['p50']:+.3f} ms** per "
        f"step ({pl['p50'] / lo['p50']:.2f}x); p99 {pl['p99'] - lo['p99']:+.3f} ms",
        f"- the login shell (`bash -lc`, Docker's default, reads /etc/profile): "
        f"{lg['p50'] - pl['p50']:+.3f} ms p50 over `bash -c`",
        f"- sandman (`bash -c`) p50 / SDK `exec` p50 (the environment's own cost: the "
        f"interpreter process and the agent's step): **{pl['p50'] / floor['p50']:.2f}x** "
        f"({pl['p50'] - floor['p50']:+.3f} ms)",
    ]
    section = "\n".join(lines) + "\n"
    print(section)
    if args.write_docs:
        refusal = docs.docs_refusal(load_start, load_end)
        if refusal:
            print(refusal, file=sys.stderr)
            return 1
        print(f"wrote {docs.write_section(section)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
