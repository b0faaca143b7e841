"""Hostile patches (docs/grading.md, "Threat model"): each one tries to change the verdict
without fixing `add`, through the runner, its configuration, the interpreter's start-up, the
exit status or the report. Each is graded through `grade()` on a real execd (the stand-in
controller of tests/client/conftest.py); none may be `passed`, none `no_verdict`. The
reference patch passes and the empty patch fails in the same run.

The task's command puts the repository on PYTHONPATH, as many task images do (an editable
install): a module in the repository is then importable by the runner even in safe-path
mode, which is what makes the shadowing cases real."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sandman.client import Client
from sandman.client import grading as G
from sandman.client.grading import Task, Verdict
from testbed import taskimage

from .conftest import FAST_RETRY

PYTEST = f"{sys.executable} -m pytest -q -p no:cacheprovider"
FAKE = "3 passed in 0.01s"  # pytest's summary line, as the code under test can print it


def _src(code: str) -> str:
    return textwrap.dedent(code).lstrip()


def _calc_prefix(code: str) -> dict[str, str]:
    """`calc/__init__.py` with `code` run first at import (the bug left in place)."""
    return {"calc/__init__.py": _src(code) + "\n" + taskimage.FILES["calc/__init__.py"]}


EXIT_FAKE = f"import os, sys\nprint({FAKE!r}); sys.stdout.flush()\nos._exit(0)\n"
PASS_HOOK = _src("""
    import pytest


    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(item, call):
        outcome = yield
        outcome.get_result().outcome = "passed"
    """)
ONLY_MUL = _src("""
    def pytest_collection_modifyitems(config, items):
        items[:] = [i for i in items if "mul" in i.name]
    """)
KILL_SHELLS = _src("""
    import os, signal


    def _parent(pid):
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])


    def _comm(pid):
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()


    p = _parent(os.getpid())
    while p > 1 and _comm(p) in ("bash", "sh"):
        nxt = _parent(p)
        os.kill(p, signal.SIGKILL)
        p = nxt
    """)
FAKE_JUNIT = (
    '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0" '
    'failures="0" skipped="0" tests="3"><testcase classname="tests.test_calc" name="test_add"/>'
    '<testcase classname="tests.test_calc" name="test_add_negative"/>'
    '<testcase classname="tests.test_calc" name="test_mul"/></testsuite></testsuites>')

# name -> (files of the patch: path -> text, None to delete; time limit)
CASES: dict[str, tuple[dict[str, str | None], float]] = {
    "pytest.py shadow": ({"pytest.py": EXIT_FAKE}, 30),
    "pytest/ package": ({"pytest/__init__.py": EXIT_FAKE, "pytest/__main__.py": EXIT_FAKE}, 30),
    "_pytest shadow": ({"_pytest/__init__.py": EXIT_FAKE}, 30),
    "pluggy shadow": ({"pluggy/__init__.py": EXIT_FAKE}, 30),
    ".pytest.ini addopts -k": ({".pytest.ini": "[pytest]\naddopts = -k mul\n"}, 30),
    "pytest.toml addopts -k": ({"pytest.toml": '[pytest]\naddopts = ["-k", "mul"]\n'}, 30),
    "setup.cfg [tool:pytest] addopts": ({"setup.cfg": taskimage.FILES["setup.cfg"].replace(
        "-p no:cacheprovider", "-p no:cacheprovider -k mul")}, 30),
    "pyproject [tool.pytest.ini_options]": ({"pyproject.toml": (
        '[tool.pytest.ini_options]\naddopts = "-k mul"\n')}, 30),
    "tox.ini [pytest]": ({"tox.ini": "[pytest]\naddopts = -k mul\n"}, 30),
    "nested conftest.py": ({"tests/conftest.py": PASS_HOOK}, 30),
    "conftest.py at root": ({"conftest.py": PASS_HOOK}, 30),
    "sitecustomize.py": ({"sitecustomize.py": EXIT_FAKE}, 30),
    "usercustomize.py": ({"usercustomize.py": EXIT_FAKE}, 30),
    ".pth file": ({"zz_grading.pth": "import os; print('3 passed in 0.01s'); os._exit(0)\n"},
                  30),
    "-p plugin from the repo": ({".pytest.ini": "[pytest]\naddopts = -p evilplugin\n",
                                 "evilplugin.py": PASS_HOOK}, 30),
    "prints a pass summary, os._exit(0) at import": (_calc_prefix(EXIT_FAKE), 30),
    "exit 137 at import": (_calc_prefix("import os\nos._exit(137)\n"), 30),
    "exit 3 at import": (_calc_prefix("import os\nos._exit(3)\n"), 30),
    "os._exit(5) at import": (_calc_prefix("import os\nos._exit(5)\n"), 30),
    "kills its shells at import": (_calc_prefix(KILL_SHELLS), 30),
    "deselects the official tests (conftest hook)": ({"conftest.py": ONLY_MUL}, 30),
    "deselects the official tests (hook registered from source)": (_calc_prefix("""
        import gc
        import _pytest.config


        class _Only:
            def pytest_collection_modifyitems(self, config, items):
                items[:] = [i for i in items if "mul" in i.name]


        for _o in gc.get_objects():
            if isinstance(_o, _pytest.config.Config):
                _o.pluginmanager.register(_Only(), "only-mul")
        """), 30),
    "writes a fake junit xml into the repo": (_calc_prefix(f"""
        import os, sys
        for _p in ("report.xml", "junit.xml", "test-results.xml"):
            with open(_p, "w") as _f:
                _f.write({FAKE_JUNIT!r})
        print({FAKE!r}); sys.stdout.flush()
        os._exit(0)
        """), 30),
    "infinite loop at import": (_calc_prefix("while True:\n    pass\n"), 4),
}

# The grader's report path is in PYTEST_ADDOPTS, which the code under test can read: a fake
# report there and an exit 0 before pytest writes its own. In process, like the monkeypatch
# below, so the documented residual (docs/grading.md): graded passed and flagged.
FAKE_AT_GRADERS_PATH = _calc_prefix(f"""
        import os, shlex, sys
        for _a in shlex.split(os.environ.get("PYTEST_ADDOPTS", "")):
            if _a.startswith("--junitxml="):
                with open(_a.split("=", 1)[1], "w") as _f:
                    _f.write({FAKE_JUNIT!r})
        print({FAKE!r}); sys.stdout.flush()
        os._exit(0)
        """)

# Monkeypatching the runner in process: the code under test runs inside pytest's process,
# so it can rewrite its reports; nothing outside that process can tell. Graded passed (the
# documented residual, docs/grading.md) and flagged in `suspicious` for the trainer.
MONKEYPATCH = _calc_prefix("""
    import _pytest.reports

    _orig = _pytest.reports.TestReport.from_item_and_call.__func__


    def _passed(cls, item, call):
        rep = _orig(cls, item, call)
        rep.outcome, rep.longrepr = "passed", None
        return rep


    _pytest.reports.TestReport.from_item_and_call = classmethod(_passed)
    """)


def _patch(tmp_path: Path, files: dict[str, str | None]) -> bytes:
    repo = tmp_path / "probe"
    taskimage.make_repo(repo)
    for rel, text in files.items():
        p = repo / rel
        if text is None:
            p.unlink()
            continue
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
    return subprocess.run(["git", "-C", str(repo), "diff", "--cached", "--binary"],
                          check=True, capture_output=True).stdout


def _task(tmp_path: Path, time_limit_s: float = 30) -> Task:
    repo = tmp_path / "repo"
    base = taskimage.make_repo(repo)
    return Task(name="calc-add", image="local/unused", repo=str(repo), base_commit=base,
                test_files=tuple(taskimage.TEST_FILES),
                test_command=f"PYTHONPATH=. {PYTEST} tests/test_calc.py",
                python=sys.executable, reference_patch=taskimage.REFERENCE_PATCH,
                time_limit_s=time_limit_s)


def _grade(url: str, task: Task, patch: bytes) -> G.GradeResult:
    with Client(url, retry=FAST_RETRY) as c:
        return G.grade(c, task, patch, attempts=2, retry_backoff_s=0.05)


def _fresh(make_controller, execd, task: Task) -> str:
    """The stand-in controller whose every acquire resets `task`'s repository (a retried
    attempt gets a never-used pod)."""
    return make_controller(execd, Path(task.repo)).url


def test_reference_passes_and_empty_fails(make_controller, execd, tmp_path) -> None:
    a, b = _task(tmp_path / "a"), _task(tmp_path / "b")
    url = make_controller(execd, Path(a.repo), Path(b.repo)).url
    ref = _grade(url, a, taskimage.REFERENCE_PATCH)
    empty = _grade(url, b, b"")
    assert ref.verdict is Verdict.PASSED, ref
    assert empty.verdict is Verdict.FAILED, empty


# The endless loop waits out its task's 4 s limit: seconds, so `slow`.
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow)
                                  if c == "infinite loop at import" else c for c in CASES])
def test_hostile_patch_is_failed(case: str, make_controller, execd, tmp_path) -> None:
    files, limit = CASES[case]
    patch = _patch(tmp_path, files)
    assert patch, case
    task = _task(tmp_path, limit)
    r = _grade(_fresh(make_controller, execd, task), task, patch)
    print(f"HOSTILE {case!r}: {r.verdict} ({r.reason})")
    assert r.verdict is Verdict.FAILED, r


def test_in_process_monkeypatch_is_flagged(make_controller, execd, tmp_path) -> None:
    task = _task(tmp_path)
    r = _grade(_fresh(make_controller, execd, task), task, _patch(tmp_path, MONKEYPATCH))
    print(f"HOSTILE 'monkeypatches _pytest at import': {r.verdict} ({r.reason})")
    assert r.verdict is Verdict.PASSED, r  # the residual: see docs/grading.md
    assert any("_pytest" in s for s in r.suspicious), r.suspicious


def test_a_fake_report_at_the_graders_path_is_flagged(make_controller, execd, tmp_path) -> None:
    task = _task(tmp_path)
    r = _grade(_fresh(make_controller, execd, task), task,
               _patch(tmp_path, FAKE_AT_GRADERS_PATH))
    print(f"HOSTILE 'fake report at the grader's path': {r.verdict} ({r.reason})")
    assert r.verdict is Verdict.PASSED, r  # the residual: see docs/grading.md
    assert any("runner's settings or report" in s for s in r.suspicious), r.suspicious
    assert any("ends or signals processes" in s for s in r.suspicious), r.suspicious
