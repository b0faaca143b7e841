"""`make bench-loadtest` (`python -m bench.loadtest --write-docs`): the locust ramp through the
whole local stack (test bed with kwok nodes, the webhook registered by `url:`, the controller),
the highest step this machine holds.

The stack and the ramp are `make demo`'s (testbed/demo.py, `--shape ramp`); this prints the
load-test report's table (loadtest/report.py) and with --write-docs puts it into its section of
docs/benchmarks.md, above the earlier runs' notes kept there. `--smoke`: a ramp to 3 sandboxes
(tests/bench/test_smoke.py runs `measure()` on the suite's bed instead of a stack of its own).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from bench import docs
from loadtest import report
from testbed import demo
from testbed.cluster import default_state_dir
from testbed.procs import ROOT
from testbed.stack import Stack

SECTION = "## loadtest: `python -m bench.loadtest`"


def measure(stack, out: Path, a) -> int:
    """The ramp on a running stack (anything with controller_url, kubeconfig, namespace);
    locust's exit code (the thresholds' verdict)."""
    return demo.run_shape(stack, out, "ramp", "ramp", a, demo.ramp_args(a),
                          timeout=demo.ramp_timeout(a))


def render(out: Path, a, cmdline: str, code: int, wall_s: float,
           loads: tuple[float, float] | None = None) -> str:
    """`loads`: the machine's 1-minute load average before the stack started and after it
    stopped (the report's "other processes" column says what else ran meanwhile)."""
    text, page = report.build(out, "sandman bench-loadtest")
    load = (f"1-minute load {loads[0]:.2f} at the start, {loads[1]:.2f} at the end; "
            if loads else "")
    return "\n".join([
        SECTION, "",
        f"The locust ramp through the whole stack (`make bench-loadtest`, i.e. `{cmdline}`): "
        f"test bed with {a.nodes} kwok nodes, the webhook registered by `url:`, the controller "
        f"(`--rate {a.rate:g} --burst {a.burst}`), one locust process; each step adds users "
        "that acquire and keep a sandbox, holds 5 s once that many are live, and a step that "
        "does not fill within its budget ends the ramp. "
        f"{os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}; {load}{wall_s:.0f} s from "
        f"start to teardown; locust exit {code}. Reading guide: `docs/loadtest.md`.", "",
        text.rstrip("\n"), ""])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m bench.loadtest")
    ap.add_argument("--ramp-max", type=int, default=12000)
    ap.add_argument("--rate", type=float, default=50.0, help="controller --rate (creates/s)")
    ap.add_argument("--burst", type=int, default=100, help="controller --burst")
    ap.add_argument("--nodes", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None,
                    help="report directory (default .testbed/bench-loadtest/<time>)")
    docs.add_flags(ap)
    a = ap.parse_args(argv)
    docs.check_flags(ap, a)
    if a.smoke:
        a.ramp_max, a.nodes = 3, 2
    out = a.out or ROOT / ".testbed" / "bench-loadtest" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    stack = Stack(out / "stack", nodes=a.nodes, state_dir=default_state_dir("bench-loadtest"),
                  controller_flags=["--rate", f"{a.rate:g}", "--burst", str(a.burst),
                                    "--max-creating", "200", "--sweep-interval", "30",
                                    "--log-level", "INFO"])
    load_start = docs.load1()
    t0 = time.monotonic()
    code = 1
    try:
        stack.start(demo.say)
        code = measure(stack, out, a)
    finally:
        left = stack.stop()
        if left:
            demo.say(f"teardown: STILL RUNNING {left}")
            code = code or 1
    wall_s = time.monotonic() - t0
    # For docs, the end's load once the stack's own has decayed (bounded: bench/docs.py).
    load_end = docs.settle() if a.write_docs else docs.load1()
    section = render(out, a, docs.command("bench.loadtest", argv), code, wall_s,
                     (load_start, load_end))
    print(section)
    if a.write_docs:
        print(f"wrote {docs.write_section(section)}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
