"""Run pytest for the Makefile; a run that collects no test is a failure, said in one line.

    tools/run_pytest.py [pytest args]          one pytest session with these arguments
    tools/run_pytest.py --split [pytest args]  the whole suite as concurrent sessions

`--split` (`make test-split`; `make test` runs one session): the suite as three concurrent
sessions (TIERS), because two of them mostly wait: the real-node tier (`-m realnode`: its own
test bed with the real node, the chart installed on it, tests/e2e) waits on real pods, the kwok
bed's tier on the API server, while the tests that need neither are CPU-bound and take two
workers. The sessions share nothing: each has its own state dir (`.testbed/pytest-<pid>[-real]`),
ports and beds, and their tests are disjoint by marker. The first tier streams to the terminal;
the others write `.testbed/pytest-<tier>.log`, printed in full when all have ended. Then the
`timing` tier (rates and lifetimes measured against the clock on a kwok bed) runs alone,
streamed. Any tier failing fails the run. On 2 cores the load average reached 10-13 and tests
that measure time failed beside each other (pacing windows on the kwok bed, a webhook replica
killed mid-burst on the real node): it is for machines with more cores. An interrupt (Ctrl-C,
SIGTERM) is passed to every session as SIGINT so their fixtures stop the beds, and the runner
waits for that before it exits.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# An interrupted session stops its beds in its fixtures' teardown (a real node takes ~30 s,
# more on a loaded machine); after this it is killed.
STOP_GRACE_S = 300
NO_TESTS = 5  # pytest.ExitCode.NO_TESTS_COLLECTED


def _single(args: list[str]) -> int:
    import pytest

    rc = pytest.main(args)
    if rc == pytest.ExitCode.NO_TESTS_COLLECTED:
        print("make test: pytest collected no tests (exit 5); refusing to call that a pass",
              file=sys.stderr)
        return 1
    return int(rc)


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# (name, marker expression, extra pytest args). Disjoint by marker, together the whole suite.
# The first streams to the terminal, the others to their logs (printed when all have ended).
TIERS = (
    # The kwok bed's tests and the root-only ones (network namespaces with fixed names, the
    # chroot, a throwaway containerd): one process, in order.
    ("bed", "(testbed or netns) and not realnode and not timing", ()),
    # Its own bed with the real node, the chart installed on it: waits on real pods.
    ("realnode", "realnode", ()),
    # No cluster, no root (what `make check` runs): CPU-bound, two workers, at a lower CPU
    # priority so the beds' timing tests (pacing rate, lifetimes) keep their share.
    ("check", "not testbed and not realnode and not netns", ("-n", "2")),
)
NICE = {"check": 10}
# Run alone once the others have ended: they check rates and lifetimes against the clock,
# which a machine busy with the other tiers' real pods skews (a pacing test saw 71 creates
# in one second beside the real node's locust Job).
ALONE = ("timing", "timing and not realnode", ())


def _log(name: str) -> Path:
    return ROOT / ".testbed" / f"pytest-{name}.log"


def _split(args: list[str]) -> int:
    if any(a == "-m" or a.startswith("-m") and not a.startswith("--") for a in args):
        return _single(args)  # the caller chose its own selection
    cmd = [sys.executable, "-m", "pytest"]
    _log("x").parent.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    got_signal: list[int] = []

    def on_signal(signum, _frame):
        got_signal.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    t0 = time.monotonic()
    rcs: dict[str, int] = {}
    ended: dict[str, float] = {}
    logs = []
    try:
        for i, (name, marks, extra) in enumerate(TIERS):
            out = None
            if i:
                out = _log(name).open("w")
                logs.append(out)
            # Each in its own process group: a terminal's Ctrl-C reaches them through _stop
            # only, once, so their teardown (stopping the beds) is not interrupted twice.
            nice = ["nice", "-n", str(NICE[name])] if name in NICE else []
            procs.append(subprocess.Popen([*nice, *cmd, "-m", marks, *extra, *args], cwd=ROOT,
                                          stdout=out, stderr=subprocess.STDOUT if out else None,
                                          process_group=0))
        while len(rcs) < len(procs):
            for (name, _m, _e), p in zip(TIERS, procs, strict=True):
                if name not in rcs and p.poll() is not None:
                    rcs[name], ended[name] = p.returncode, time.monotonic() - t0
                    print(f"\nrun_pytest: tier {name} ended after {ended[name]:.0f}s "
                          f"(exit {p.returncode}); {len(procs) - len(rcs)} still running",
                          flush=True)
            time.sleep(1)
        # The timing tier, alone, streamed (its own kwok bed, ~5 s to start).
        name, marks, extra = ALONE
        print(f"\nrun_pytest: tier {name} (-m \"{marks}\"), alone", flush=True)
        alone = subprocess.Popen([*cmd, "-m", marks, *extra, *args], cwd=ROOT, process_group=0)
        procs.append(alone)
        rcs[name], ended[name] = alone.wait(), time.monotonic() - t0
    except KeyboardInterrupt:
        print("\nrun_pytest: interrupted; stopping every session (their beds stop in "
              "teardown)", file=sys.stderr, flush=True)
        _stop(procs)
        return 130 if not got_signal else 128 + got_signal[0]
    finally:
        _stop(procs)  # nothing left running, whatever ended the wait
        for f in logs:
            f.close()
    for name, marks, extra in TIERS[1:]:
        print(f"\n===== tier {name} (-m \"{marks}\" {' '.join(extra)}), from {_log(name)} =====",
              flush=True)
        sys.stdout.write(_log(name).read_text(errors="replace"))
    print("run_pytest: " + "; ".join(f"{n}: exit {rcs[n]} after {ended[n]:.0f}s"
                                     for n, _m, _e in (*TIERS, ALONE))
          + f"; all ended after {time.monotonic() - t0:.0f}s", flush=True)
    failed = False
    all_empty = all(rc == NO_TESTS for rc in rcs.values())
    for name, rc in rcs.items():
        # With extra arguments (`make test PYTEST_ARGS=-k...`) a tier may select nothing.
        if rc == NO_TESTS and (not args or all_empty):
            print(f"make test: tier {name} collected no tests (exit 5); refusing to call "
                  "that a pass", file=sys.stderr)
            failed = True
        elif rc not in (0, NO_TESTS):
            failed = True
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["--split"]:
        return _split(argv[1:])
    return _single(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
