"""SWE-ReX's own runtime tests (tests/test_execution.py of its sdist at the locked version,
fetched hash-checked by tools/swerex_tests.py) against sandman's adapter on the test bed: one
sandbox acquired by `SandmanDeployment` from the real controller, a real execd behind its pod
(the stand-in), every test of that file run by pytest under
tests/client/swerex_upstream_conftest.py, which gives them a `SandmanRuntime` as their
`remote_runtime` and lists, as strict xfails with their reasons, the ones one execd shell
cannot pass. A new failure, or an expected one that starts passing, fails this test."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.client.swerex_upstream_conftest import EXPECTED_FAILURES
from tests.controller.harness import standin_stack
from tools import swerex_tests

ROOT = Path(__file__).resolve().parents[2]
CONFTEST = ROOT / "tests" / "client" / "swerex_upstream_conftest.py"


@pytest.fixture
def stack(cluster, namespace, tmp_path):
    # Each execd's $HOME its pod's directory, as a container's is its own: the upstream tests
    # run `bash -lc`, which would otherwise read the host user's profile (and whatever it runs).
    with standin_stack(cluster, namespace, tmp_path, "swerex-up", own_home=True) as got:
        yield got


def test_swerex_runtime_tests_on_the_test_bed(stack, tmp_path):
    ctl, _standin = stack
    suite = tmp_path / "swerex_upstream"
    suite.mkdir()
    shutil.copyfile(swerex_tests.ensure(), suite / "test_execution.py")
    shutil.copyfile(CONFTEST, suite / "conftest.py")
    (suite / "__init__.py").write_text("")
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "SANDMAN_URL": ctl.url, "PYTHONPATH": str(ROOT), "HOME": str(home)}
    for name in ("SWEREX_EXECD", "PYTEST_ADDOPTS", "PYTEST_PLUGINS"):  # none of the caller's
        env.pop(name, None)
    # -c /dev/null: none of this repository's conftests or settings; --basetemp: the upstream
    # tests' tmp_path (files the sandbox writes on the host) goes with this test's.
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rxXfs", "-p", "no:cacheprovider",
         "-c", os.devnull, "--rootdir", str(tmp_path), "--basetemp", str(tmp_path / "inner"),
         "--timeout", "60", "--tb=short", str(suite)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    summary = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|skipped|xfailed|failed|error)",
                                               summary)}
    # Every expected failure seen as one (strict: a pass would have failed the run), the one
    # skip, and nothing else short of passing; the floor catches a file that lost its tests.
    xfails = [n for n, why in EXPECTED_FAILURES.items() if why != "SKIP"]
    assert counts.get("xfailed") == len(xfails) and counts.get("skipped") == 1, summary
    assert counts.get("passed", 0) >= 46 and set(counts) <= {"passed", "skipped", "xfailed"}, \
        summary
