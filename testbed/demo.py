"""`make demo`: a one-machine sandman under a locust burst, then torn down.

Brings up the test bed (etcd, kube-apiserver, controller-manager, scheduler, kwok with fake
nodes), starts the webhook (registered by `url:` with its CA) and the controller as local
processes, runs `acquire_burst.py` headless with --shape (default burst64), then a short ramp
(to --ramp-max, default 1,000 concurrent sandboxes), prints the summary table and the path of
the HTML report with its plots, and stops every process it started.

    python -m testbed.demo [--shape burst64|two-runs|steady|ramp] [--ramp-max 1000]
                            [--rate 20 --burst 40] [--nodes 20] [--no-ramp]
Exit code: 0 when every run met its thresholds (no errors, 0 leaked pods). It composes the
test bed and the load tests, so it lives on the test bed's side: it imports loadtest, never
the reverse. The ramp alone, as a bench: `python -m bench.loadtest`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from loadtest import report, shapes
from testbed import procstat
from testbed.cluster import default_state_dir
from testbed.procs import ROOT
from testbed.stack import Stack, locust


def say(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_shape(stack: Stack, out: Path, name: str, shape: str, a, extra: list[str],
              timeout: float) -> int:
    args = ["--shape", shape, "--controller-url", stack.controller_url,
            "--kubeconfig", str(stack.kubeconfig), "--namespace", stack.namespace,
            "--job", f"demo-{name}", "--csv", str(out / name), "--html", str(out / f"{name}.html"),
            "--pacing-rate", str(a.rate), "--pacing-burst", str(a.burst), "--max-error-rate", "0", "--max-leaked", "0", *extra]
    say(f"locust: {name} (acquire_burst.py --shape {shape} {' '.join(extra)})")
    t = time.monotonic()
    # Where the CPU went, per process (loadtest/report.py reads <name>_procs.json).
    sampler = procstat.Sampler(out / f"{name}_procs.json")
    for pname, pid in (stack.pids() if hasattr(stack, "pids") else {}).items():
        sampler.add(pname, pid)
    sampler.start()
    try:
        code = locust("acquire_burst.py", args, out / f"{name}.log", timeout,
                      on_start=lambda p: sampler.add("locust", p.pid))
    finally:
        sampler.stop()
    say(f"locust: {name} finished in {time.monotonic() - t:.0f} s, exit {code} "
        f"(log {out / f'{name}.log'})")
    return code


def ramp_steps(a) -> list[int]:
    return [n for n in shapes.RAMP_STEPS if n <= a.ramp_max] or [a.ramp_max]


def step_budget(a) -> float:
    """A step may take its new creates at the pacing rate, 1.5x over, plus a minute: a step
    that does not fill in that is the machine's limit, not the pacer's."""
    steps = ramp_steps(a)
    biggest = max(b - p for p, b in zip([0, *steps], steps, strict=False))
    return max(180.0, biggest / a.rate * 1.5 + 60)


def ramp_args(a) -> list[str]:
    return ["--ramp-max", str(a.ramp_max), "--step-hold-s", "5",
            "--step-max-s", f"{step_budget(a):.0f}", "--leak-settle-s", "180"]


def ramp_timeout(a) -> float:
    return len(ramp_steps(a)) * (step_budget(a) + 10) + 600


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m testbed.demo")
    ap.add_argument("--shape", choices=shapes.SHAPES, default="burst64")
    ap.add_argument("--ramp-max", type=int, default=1000)
    ap.add_argument("--no-ramp", action="store_true", help="only --shape")
    ap.add_argument("--rate", type=float, default=20.0, help="controller --rate (creates/s)")
    ap.add_argument("--burst", type=int, default=40, help="controller --burst")
    ap.add_argument("--nodes", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None,
                    help="report directory (default .testbed/demo-reports/<time>)")
    a = ap.parse_args(argv)
    out = a.out or ROOT / ".testbed" / "demo-reports" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    stack = Stack(out / "stack", nodes=a.nodes, state_dir=default_state_dir("demo"),
                  controller_flags=["--rate", f"{a.rate:g}", "--burst", str(a.burst),
                                    "--max-creating", "200", "--sweep-interval", "30",
                                    "--log-level", "INFO"])
    codes: list[int] = []
    t0 = time.monotonic()
    try:
        say("starting the test bed, the webhook and the controller")
        stack.start(say)
        if a.shape != "ramp":
            codes.append(run_shape(stack, out, a.shape, a.shape, a,
                                   ["--max-p99-ms", "60000"], timeout=900))
        if a.shape == "ramp" or not a.no_ramp:
            codes.append(run_shape(stack, out, "ramp", "ramp", a, ramp_args(a),
                                   timeout=ramp_timeout(a)))
    except KeyboardInterrupt:
        say("interrupted")
        codes.append(130)
    except Exception as e:  # noqa: BLE001 - reported, then torn down
        say(f"FAILED: {e}")
        codes.append(1)
    finally:
        say("tearing down (controller, webhook, test bed)")
        left = stack.stop()
        say("teardown: nothing left running" if not left else f"teardown: STILL RUNNING {left}")
        if left:
            codes.append(1)
    if list(out.glob("*_sandman.json")):
        text, page = report.build(out, "sandman demo")
        print()
        print(text)
        print(f"\nHTML report with plots: {page}")
    code = max(codes) if codes else 1
    say(f"done in {time.monotonic() - t0:.0f} s, exit {code}")
    return code


if __name__ == "__main__":
    sys.exit(main())
