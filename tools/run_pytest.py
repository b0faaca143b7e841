"""Run pytest for the Makefile; a run that collects no test is a failure, said in one line.

    tools/run_pytest.py [pytest args]           one pytest session with these arguments
    tools/run_pytest.py --phased [pytest args]  the whole suite in PHASES (`make test`)

`--phased`: the suite as sessions disjoint by marker, in three phases, each ending before the
next starts:
1. `check` (what `make check` runs: no cluster, no root, not `slow`) on CHECK_WORKERS
   pytest-xdist workers, alone on the machine: it takes both cores, and its waiting tests
   overlap.
2. The two test beds side by side: `bed` (the kwok bed's tests and the root-only ones, in
   order) and `realnode` (its own bed with the real node, the chart installed on it,
   tests/e2e). Both mostly wait, one on the API server, the other on real pods, so together
   they take about as long as the longer of them alone. Beside them `slow`: the tests that
   need no bed but take seconds each (left out of `make check`), in one session, done long
   before the beds are.
3. `timing` (rates and lifetimes measured against the clock on a kwok bed), alone: beside
   another bed a pacing test saw 71 creates in one second.
The first session of a phase streams to the terminal, the others write
`.testbed/pytest-<tier>.log`, printed when the phase has ended. The sessions share nothing:
each has its own state dir (`.testbed/pytest-<pid>[-real]`), ports and beds. Any session
failing fails the run; every phase runs anyway, so one run shows every failure. With
`--junitxml=FILE` each session writes FILE with its tier's name before the suffix. A layout
with all sessions at once (check beside both beds) drove the load average to 10-13 on 2 cores
and tests that measure time failed. An interrupt (Ctrl-C, SIGTERM) is passed to every session
as SIGINT so their fixtures stop the beds, and the runner waits for that before it exits.
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

# The check tier's selection and workers, as the Makefile's `make check` has them. More
# workers than cores: about half of the tier's time is tests waiting (timeouts, retries,
# subprocesses), which other workers' tests fill.
CHECK = "not testbed and not realnode and not netns and not e2e and not slow"
CHECK_WORKERS = "4"

# (name, marker expression, extra pytest args), phase by phase. Disjoint by marker, together
# the whole suite (tests/test_conftest_hooks.py checks both on the collected suite).
PHASES: tuple[tuple[tuple[str, str, tuple[str, ...]], ...], ...] = (
    (("check", CHECK, ("-n", CHECK_WORKERS)),),
    (("bed", "(testbed or netns) and not realnode and not timing", ()),
     ("realnode", "realnode", ()),
     ("slow", "slow and not testbed and not realnode and not netns and not e2e", ())),
    (("timing", "timing and not realnode", ()),),
)


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


def _log(name: str) -> Path:
    return ROOT / ".testbed" / f"pytest-{name}.log"


def tier_args(name: str, args: list[str]) -> list[str]:
    """`args` for one tier's session: a `--junitxml` file gets the tier's name."""
    out = []
    for a in args:
        if a.startswith("--junitxml="):
            p = Path(a.split("=", 1)[1])
            a = f"--junitxml={p.with_name(f'{p.stem}-{name}{p.suffix}')}"
        out.append(a)
    return out


def _run_phase(tiers, args: list[str], rcs: dict[str, int], ended: dict[str, float],
               t0: float, procs: list[subprocess.Popen]) -> None:
    cmd = [sys.executable, "-m", "pytest"]
    logs = []
    mine: list[tuple[str, subprocess.Popen]] = []
    try:
        for i, (name, marks, extra) in enumerate(tiers):
            out = None
            if i:
                out = _log(name).open("w")
                logs.append(out)
            print(f"\nrun_pytest: tier {name} (-m \"{marks}\" {' '.join(extra)})"
                  + (f", beside {tiers[0][0]}, to {_log(name)}" if i else ""), flush=True)
            # Each in its own process group: a terminal's Ctrl-C reaches them through _stop
            # only, once, so their teardown (stopping the beds) is not interrupted twice.
            p = subprocess.Popen([*cmd, "-m", marks, *extra, *tier_args(name, args)], cwd=ROOT,
                                 stdout=out, stderr=subprocess.STDOUT if out else None,
                                 process_group=0)
            procs.append(p)
            mine.append((name, p))
        while any(name not in rcs for name, _p in mine):
            for name, p in mine:
                if name not in rcs and p.poll() is not None:
                    rcs[name], ended[name] = p.returncode, time.monotonic() - t0
                    left = sum(n not in rcs for n, _p in mine)
                    print(f"\nrun_pytest: tier {name} ended after {ended[name]:.0f}s "
                          f"(exit {p.returncode})" + (f"; {left} still running" if left else ""),
                          flush=True)
            time.sleep(1)
    finally:
        for f in logs:
            f.close()
    for name, marks, extra in tiers[1:]:
        print(f"\n===== tier {name} (-m \"{marks}\" {' '.join(extra)}), from {_log(name)} =====",
              flush=True)
        sys.stdout.write(_log(name).read_text(errors="replace"))


def _phased(args: list[str]) -> int:
    if any(a == "-m" or a.startswith("-m") and not a.startswith("--") for a in args):
        return _single(args)  # the caller chose its own selection
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
    try:
        for tiers in PHASES:
            _run_phase(tiers, args, rcs, ended, t0, procs)
    except KeyboardInterrupt:
        print("\nrun_pytest: interrupted; stopping every session (their beds stop in "
              "teardown)", file=sys.stderr, flush=True)
        _stop(procs)
        return 130 if not got_signal else 128 + got_signal[0]
    finally:
        _stop(procs)  # nothing left running, whatever ended the wait
    names = [name for tiers in PHASES for name, _m, _e in tiers]
    print("run_pytest: " + "; ".join(f"{n}: exit {rcs[n]}, ended at {ended[n]:.0f}s"
                                     for n in names)
          + f"; all ended after {time.monotonic() - t0:.0f}s", flush=True)
    failed = False
    all_empty = all(rc == NO_TESTS for rc in rcs.values())
    for name in names:
        rc = rcs[name]
        # With extra arguments (`make test PYTEST_ARGS=-k...`) a tier may select nothing.
        if rc == NO_TESTS and (not args or all_empty):
            print(f"make test: tier {name} collected no tests (exit 5); refusing to call "
                  "that a pass", file=sys.stderr)
            failed = True
        elif rc not in (0, NO_TESTS):
            print(f"make test: tier {name} failed (exit {rc})", file=sys.stderr)
            failed = True
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["--phased"]:
        return _phased(argv[1:])
    return _single(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
