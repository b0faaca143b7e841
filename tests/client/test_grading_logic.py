"""The I/O-free half of grading (sandman/client/_grading.py): exit statuses as verdicts,
pytest's summary line, test sections of setup.cfg/pyproject.toml, the exclusion patterns
(checked with the real `git apply --exclude`), the task model's checks."""

from __future__ import annotations

import subprocess

import pytest

from sandman.client import (
    AcquireTimeout,
    BadRequest,
    ControllerError,
    Forbidden,
    PodFailed,
    SandboxGone,
    SandboxUnreachable,
    Unauthenticated,
)
from sandman.client._grading import (
    DEFAULT_EXCLUDE,
    Task,
    Verdict,
    config_candidates,
    config_matches,
    is_infra,
    judge,
    junit_key,
    patch_paths,
    runner_refusal,
    scan_patch,
    sections,
    sections_changed,
)

P, F = Verdict.PASSED, Verdict.FAILED
IDS = ("tests/test_calc.py::test_add", "tests/test_calc.py::test_mul")


def _junit(*cases: tuple[str, str]) -> bytes:
    body = "".join(f'<testcase classname="tests.test_calc" name="{n}">{inner}</testcase>'
                   for n, inner in cases)
    return f'<?xml version="1.0"?><testsuites><testsuite>{body}</testsuite></testsuites>'.encode()


@pytest.mark.parametrize("report,code,verdict,words", [
    (_junit(("test_add", ""), ("test_mul", "")), 0, P, "tests passed"),
    (_junit(("test_add", "<failure/>"), ("test_mul", "")), 1, F, "not passed"),
    (_junit(("test_add", "<skipped/>"), ("test_mul", "")), 0, F, "not passed"),
    (_junit(("test_add", "<error/>"), ("test_mul", "")), 1, F, "not passed"),
    (_junit(("test_mul", "")), 0, F, "not in the report"),  # a deselected official test
    (_junit(("test_add", ""), ("test_mul", ""), ("test_x", "")), 0, F, "has 3 test(s)"),
    (_junit(("test_add", ""), ("test_mul", "")), 1, F, "exited 1"),  # report vs status
    (_junit(("test_add", ""), ("test_mul", "")), 137, F, "exited 137"),
    (None, 0, F, "no JUnit report"),  # "3 passed" printed, os._exit(0): no report
    (None, 137, F, "no JUnit report"),
    (None, 3, F, "no JUnit report"),
    (b"<testsuites><testsuite>", 0, F, "not XML"),
    (b'<?xml version="1.0"?><!DOCTYPE x [<!ENTITY a "b">]><testsuites/>', 0, F, "DOCTYPE"),
    (b"<html/>", 0, F, "not a JUnit"),
])
def test_verdict_from_the_report(report, code, verdict, words) -> None:
    v, reason, _ = judge(report, IDS, code)
    assert v is verdict and words in reason, (v, reason)


def test_junit_keys_follow_pytest_mangling() -> None:
    assert junit_key("tests/test_calc.py::test_add") == ("tests.test_calc", "test_add")
    assert junit_key("a/t.py::TestX::test_y[1::2-a/b]") == ("a.t.TestX", "test_y[1::2-a/b]")


@pytest.mark.parametrize("path,refused", [
    ("pytest.py", True), ("pytest/__main__.py", True), ("_pytest/__init__.py", True),
    ("src/pluggy/__init__.py", True), ("py.py", True), ("packaging/__init__.py", True),
    ("iniconfig.py", True), ("sitecustomize.py", True), ("lib/usercustomize.py", True),
    ("x.pth", True), ("a/b/conftest.py", True), (".pytest.ini", True), ("pytest.toml", True),
    ("sub/.pytest.toml", True), ("tox.ini", True),
    ("calc/__init__.py", False), ("src/py/util.py", False), ("setup.cfg", False),
    ("pyproject.toml", False), ("docs/pytest_notes.md", False), ("my_pytest.py", False),
])
def test_runner_files_never_come_from_a_patch(path, refused) -> None:
    assert (runner_refusal(path) is not None) is refused, runner_refusal(path)


def test_scan_flags_reaching_into_the_runner() -> None:
    patch = (b"diff --git a/calc/__init__.py b/calc/__init__.py\n--- a/calc/__init__.py\n"
             b"+++ b/calc/__init__.py\n@@ -1,2 +1,5 @@\n import os\n+import _pytest.reports\n"
             b"+sys.modules['pytest'] = None\n+def add(a, b):\n+    return a + b\n")
    found = scan_patch(patch)
    assert any(f.startswith("calc/__init__.py: line 2: imports") for f in found), found
    assert any("line 3: rewrites sys.modules" in f for f in found), found
    assert len(found) == 2, found
    assert scan_patch(b"") == ()


def test_config_candidates_follow_pytest_order() -> None:
    c = config_candidates(("tests/unit/test_a.py", "tests/test_b.py"))
    assert c[:2] == ["tests/pytest.toml", "tests/.pytest.toml"] and c[-1] == "setup.cfg"
    assert config_matches("setup.cfg", b"[tool:pytest]\n") and not config_matches(
        "setup.cfg", b"[metadata]\n")
    assert config_matches("pytest.ini", b"")


def test_sections_of_setup_cfg_and_pyproject() -> None:
    cfg = "[metadata]\nname = x\n\n[tool:pytest]\naddopts = -q\n[flake8]\nmax = 1\n"
    assert sections(cfg, ("tool:pytest", "pytest")) == {"tool:pytest": ["[tool:pytest]",
                                                                        "addopts = -q"]}
    toml = ('[project]\nname = "x"\n[tool.pytest.ini_options]\naddopts = "-q"\n'
            '[tool.ruff]\nline-length = 99\n')
    wanted = DEFAULT_EXCLUDE.section_names("sub/pyproject.toml")
    assert list(sections(toml, wanted)) == ["tool.pytest.ini_options"]
    # Other sections change freely; a test section's change, addition or removal counts.
    assert not sections_changed(cfg.encode(), cfg.replace("max = 1", "max = 2").encode(),
                                ("tool:pytest",))
    assert sections_changed(cfg.encode(), cfg.replace("-q", "-k x").encode(), ("tool:pytest",))
    assert sections_changed(b"[metadata]\n", cfg.encode(), ("tool:pytest",))
    assert sections_changed(cfg.encode(), None, ("tool:pytest",))
    assert not sections_changed(b"[metadata]\n", None, ("tool:pytest",))


@pytest.mark.parametrize("path,excluded", [
    ("conftest.py", True), ("a/b/conftest.py", True), ("tests/pytest.ini", True),
    ("tox.ini", True), (".coveragerc", True), ("noxfile.py", True),
    ("myconftest.py", False), ("conftest.py.bak", False), ("src/setup.cfg", False),
])
def test_exclusion_patterns(path, excluded) -> None:
    assert DEFAULT_EXCLUDE.file_excluded(path) is excluded


def test_git_apply_exclude_args_match_the_patterns(tmp_path) -> None:
    """The same patterns through the real `git apply --exclude`: at any depth, no more."""
    paths = ["conftest.py", "a/b/conftest.py", "myconftest.py", "x/tox.ini", "ok.py"]
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    patch = "".join(
        f"diff --git a/{p} b/{p}\nnew file mode 100644\n--- /dev/null\n+++ b/{p}\n@@ -0,0 +1 @@\n+x\n"
        for p in paths).encode()
    assert patch_paths(patch) == paths
    subprocess.run(["git", "-C", str(tmp_path), "apply", *DEFAULT_EXCLUDE.apply_args(), "-"],
                   input=patch, check=True)
    present = sorted(p for p in paths if (tmp_path / p).exists())
    assert present == ["myconftest.py", "ok.py"]


def test_infra_errors_are_retried_caller_errors_raise() -> None:
    for e in (AcquireTimeout("t"), PodFailed("p"), ControllerError("500", status=500),
              SandboxGone("g"), SandboxUnreachable("u")):
        assert is_infra(e), e
    for e in (BadRequest("b"), Unauthenticated("u"), Forbidden("f")):
        assert not is_infra(e), e
    assert not is_infra(ValueError("a bug is not the infrastructure"))


@pytest.mark.parametrize("kw,words", [
    ({"repo": "testbed"}, "absolute"),
    ({"base_commit": "main"}, "commit hash"),
    ({"test_files": ()}, "at least one"),
    ({"test_files": ("../x.py",)}, "inside"),
    ({"test_files": ("/abs.py",)}, "inside"),
    ({"time_limit_s": 0}, "time_limit_s"),
    ({"test_ids": ()}, "at least one"),
    ({"test_ids": "tests/test_x.py::t"}, "not one string"),
    ({"plugins": ("x; rm -rf /",)}, "plugin"),
])
def test_task_checks(kw, words) -> None:
    base = dict(name="t", image="img", repo="/testbed", base_commit="a" * 40,
                test_files=("tests/test_x.py",), time_limit_s=60)
    with pytest.raises(BadRequest, match=words):
        Task(**{**base, **kw})


def test_task_defaults() -> None:
    t = Task(name="t", image="img", repo="/r", base_commit="abc1234",
             test_files=["tests/test a.py"], reference_patch="diff", time_limit_s=60)
    assert t.test_files == ("tests/test a.py",) and t.reference_patch == b"diff"
    assert t.command == "python3 -m pytest -q -p no:cacheprovider 'tests/test a.py'"
    assert t.test_ids is None and t.plugins == () and t.python == "python3"


# ---- feature detection of other parts of issue 15 (role=, conditions=, reuse=, retire())


class _OldClient:
    def __init__(self):
        self.calls = []

    def acquire(self, image, *, job, cpu="2", memory="8Gi", egress="deny", timeout_s=300,
                namespace=None):
        self.calls.append(dict(image=image, job=job))
        return "sb"


class _NewClient(_OldClient):
    def acquire(self, image, *, job, cpu="2", memory="8Gi", egress="deny", timeout_s=300,
                namespace=None, role=None, conditions=None):
        self.calls.append(dict(image=image, job=job, role=role, conditions=conditions))
        return "sb"


class _Sb:
    id = "s"

    def __init__(self, new: bool):
        self.log = []
        if new:
            self.retire = lambda: self.log.append("retire")

    def release(self, reuse=False):
        self.log.append(f"release(reuse={reuse})")


def _task(**kw):
    kw.setdefault("time_limit_s", 60)
    return Task(name="t", image="img", repo="/r", base_commit="abc1234",
                test_files=("t.py",), **kw)


def test_acquire_uses_role_and_conditions_only_where_the_sdk_has_them() -> None:
    from sandman.client._sync import grading as sync_grading

    new = _NewClient()
    sync_grading._acquire(new, _task(conditions={"time_limit_s": 60}), "j", 10, None)
    assert new.calls[-1]["role"] == "grading"
    assert new.calls[-1]["conditions"] == {"time_limit_s": 60}
    old = _OldClient()
    sync_grading._acquire(old, _task(), "j", 10, None)
    assert old.calls[-1] == {"image": "img", "job": "j"}
    with pytest.raises(Exception, match="declares run conditions"):
        sync_grading._acquire(old, _task(conditions={"cpu_quota": 2}), "j", 10, None)


def test_pod_give_back_by_verdict_and_reuse() -> None:
    from sandman.client._sync import grading as sync_grading

    cases = [(True, Verdict.PASSED, True, ["release(reuse=True)"]),
             (True, Verdict.FAILED, True, ["release(reuse=True)"]),
             (True, Verdict.NO_VERDICT, True, ["retire"]),
             (True, Verdict.PASSED, False, ["release(reuse=False)"]),
             (False, Verdict.NO_VERDICT, True, ["release(reuse=False)"])]
    for new, verdict, reuse, expected in cases:
        sb = _Sb(new)
        sync_grading._finish(None, sb, verdict, reuse)
        assert sb.log == expected, (new, verdict, reuse)
