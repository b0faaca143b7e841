"""tests/conftest.py's session hooks, run on small test files outside the tree: the skip check
(what `make test` and CI set: a skipped test is listed and fails the run, a deselected one
does not) and the bed's crash check and log capture for every test that reaches a bed through
any fixture (the e2e suite's reach the real-node bed without `real_cluster`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CASES = '''
import pytest

def test_runs():
    pass

@pytest.mark.skip(reason="a demo skip")
def test_skipped():
    pass
'''


def run(tmp_path: Path, *args: str, cases: str = CASES, **env: str
        ) -> subprocess.CompletedProcess:
    (tmp_path / "test_cases.py").write_text(cases)
    clean = {k: v for k, v in os.environ.items()
             if k not in ("SANDMAN_NO_SKIPS", "CI", "SANDMAN_KUBECONFIG")}
    # tests/conftest.py as a plugin on a test file outside the tree (no other conftest, no ini).
    return subprocess.run([sys.executable, "-m", "pytest", "-c", os.devnull, "--rootdir",
                           str(tmp_path), "-p", "tests.conftest", "-p", "no:cacheprovider",
                           "test_cases.py", *args],
                          cwd=tmp_path, env={**clean, "PYTHONPATH": str(ROOT), **env},
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_a_skip_fails_the_run_and_is_listed(tmp_path):
    res = run(tmp_path, SANDMAN_NO_SKIPS="1")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "test_cases.py::test_skipped: Skipped: a demo skip" in res.stdout
    assert run(tmp_path, CI="true").returncode == 1


@pytest.mark.slow
def test_deselected_is_not_skipped_and_skips_pass_without_the_setting(tmp_path):
    res = run(tmp_path, "-k", "test_runs", SANDMAN_NO_SKIPS="1")
    assert res.returncode == 0, res.stdout + res.stderr
    assert run(tmp_path).returncode == 0


# A stand-in for a bed (pure bookkeeping): its `check()` reports a crashed component, its log
# directory holds one log. `e2e` reaches the real-node bed as the e2e suite's fixtures do.
BED_CASES = '''
import pytest

from tests import conftest


class CrashedBed:
    def __init__(self, logs):
        self.logs = logs

    def check(self):
        raise AssertionError("kube-apiserver exited during the run")


@pytest.fixture(scope="session")
def _real_bed(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    (logs / "kubelet.log").write_text("the kubelet's last words\\n")
    conftest._BED["real"] = CrashedBed(logs)
    yield


@pytest.fixture
def e2e(_real_bed):
    return "installed"


def test_passes_but_the_bed_crashed(e2e):
    pass


def test_fails_on_the_bed(e2e):
    assert e2e == "something else"


def test_without_a_bed():
    pass
'''


@pytest.mark.slow
def test_tests_on_the_real_bed_get_its_crash_check_and_logs(tmp_path):
    res = run(tmp_path, "-rA", cases=BED_CASES)
    out = res.stdout
    assert res.returncode == 1, out + res.stderr
    assert "ERROR at teardown of test_passes_but_the_bed_crashed" in out, out
    assert "kube-apiserver exited during the run" in out
    assert "test-bed log" in out and "the kubelet's last words" in out
    assert "PASSED test_cases.py::test_without_a_bed" in out
    assert "ERROR test_cases.py::test_without_a_bed" not in out
    assert "ERROR test_cases.py::test_fails_on_the_bed" in out


DUMP = '''
import json, os

def pytest_collection_finish(session):
    with open(os.environ["TIER_DUMP"], "w") as f:
        json.dump({i.nodeid: sorted({m.name for m in i.iter_markers()}) for i in session.items},
                  f)
'''


@pytest.mark.slow
def test_make_tests_tiers_are_disjoint_and_cover_the_suite(tmp_path):
    """tools/run_pytest.py's phases, evaluated on the markers the whole collected suite really
    carries: every test is in exactly one tier, so `make test` runs each test once."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import run_pytest
    finally:
        sys.path.remove(str(ROOT / "tools"))
    (tmp_path / "tierdump.py").write_text(DUMP)
    dump = tmp_path / "items.json"
    res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p",
                          "tierdump", "-p", "no:cacheprovider"], cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}",
                              "TIER_DUMP": str(dump)}, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    import json

    items = json.loads(dump.read_text())
    assert len(items) > 1000, len(items)
    names = ("testbed", "realnode", "netns", "e2e", "timing", "slow")
    tiers = [t for phase in run_pytest.PHASES for t in phase]
    counts = {name: 0 for name, _m, _e in tiers}
    for nodeid, marks in items.items():
        env = {n: n in marks for n in names}
        # The expressions use only these names, `and`, `or`, `not` and parentheses.
        hits = [name for name, expr, _e in tiers if eval(expr, {"__builtins__": {}}, env)]  # noqa: S307
        assert len(hits) == 1, (nodeid, marks, hits)
        counts[hits[0]] += 1
    assert all(counts.values()), counts  # no tier is empty
    # `make check` is the first phase's tier.
    make = (ROOT / "Makefile").read_text()
    line = next(ln for ln in make.splitlines() if ln.startswith("CHECK_MARKERS := "))
    assert line.split(":= ", 1)[1] == run_pytest.CHECK, line
    line = next(ln for ln in make.splitlines() if ln.startswith("CHECK_WORKERS := "))
    assert line.split(":= ", 1)[1] == run_pytest.CHECK_WORKERS, line
