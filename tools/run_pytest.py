"""Run pytest for the Makefile; a run that collects no test is a failure, said in one line.

    tools/run_pytest.py [pytest args]          one pytest session with these arguments
    tools/run_pytest.py --split [pytest args]  the whole suite as two concurrent sessions

`--split` (what `make test` runs): the real-node tier (`-m realnode`: its own test bed with the
real node, the chart installed on it, tests/e2e) spends its ~20 minutes waiting on real pods,
so it runs beside everything else (`-m "not realnode"`: the kwok test bed and the tests that
need no cluster) instead of after it. The two sessions share nothing: each has its own state
dir (`.testbed/pytest-<pid>[-real]`), ports and beds, and the two sets of tests are disjoint by
marker. The other tier streams to the terminal; the real-node tier writes
`.testbed/pytest-realnode.log`, printed in full when it ends. Either failing fails the run. An
interrupt (Ctrl-C, SIGTERM) is passed to both as SIGINT so their fixtures stop the beds, and
the runner waits for that before it exits.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REAL_LOG = ROOT / ".testbed" / "pytest-realnode.log"
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


def _split(args: list[str]) -> int:
    if any(a == "-m" or a.startswith("-m") and not a.startswith("--") for a in args):
        return _single(args)  # the caller chose its own selection
    cmd = [sys.executable, "-m", "pytest"]
    REAL_LOG.parent.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    got_signal: list[int] = []

    def on_signal(signum, _frame):
        got_signal.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    t0 = time.monotonic()
    with REAL_LOG.open("w") as log:
        try:
            # Both in their own process group: a terminal's Ctrl-C reaches them through
            # _stop only, once, so teardown is not interrupted a second time.
            real = subprocess.Popen([*cmd, "-m", "realnode", *args], cwd=ROOT, stdout=log,
                                    stderr=subprocess.STDOUT, process_group=0)
            procs.append(real)
            rest = subprocess.Popen([*cmd, "-m", "not realnode", *args], cwd=ROOT,
                                    process_group=0)
            procs.append(rest)
            rc_rest = rest.wait()
            if real.poll() is None:
                print(f"\nrun_pytest: the other tests ended after {time.monotonic() - t0:.0f}s; "
                      f"waiting for the real-node tier ({REAL_LOG})", flush=True)
            rc_real = real.wait()
        except KeyboardInterrupt:
            print("\nrun_pytest: interrupted; stopping both sessions (their beds stop in "
                  "teardown)", file=sys.stderr, flush=True)
            _stop(procs)
            return 130 if not got_signal else 128 + got_signal[0]
        finally:
            _stop(procs)  # nothing left running, whatever ended the wait
    print(f"\n===== real-node tier (-m realnode), from {REAL_LOG} =====", flush=True)
    sys.stdout.write(REAL_LOG.read_text(errors="replace"))
    print(f"run_pytest: both tiers ended after {time.monotonic() - t0:.0f}s "
          f"(not realnode: exit {rc_rest}, realnode: exit {rc_real})", flush=True)
    failed = False
    both_empty = rc_rest == NO_TESTS and rc_real == NO_TESTS
    for name, rc in (("not realnode", rc_rest), ("realnode", rc_real)):
        # With extra arguments (`make test PYTEST_ARGS=-k...`) one tier may select nothing.
        if rc == NO_TESTS and (not args or both_empty):
            print(f"make test: the {name} tier collected no tests (exit 5); refusing to call "
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
