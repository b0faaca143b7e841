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
    classify,
    is_infra,
    parse_summary,
    patch_paths,
    sections,
    sections_changed,
)

P, F, N = Verdict.PASSED, Verdict.FAILED, Verdict.NO_VERDICT
SUMMARY_OK = "...\n3 passed in 0.05s\n"
SUMMARY_FAIL = "F.\n=========== 1 failed, 2 passed, 1 warning in 0.12s ===========\n"
SUMMARY_COLLECT = "E\n!!! Interrupted: 1 error during collection !!!\n1 error in 0.07s\n"


@pytest.mark.parametrize("code,error,output,verdict,infra", [
    (0, None, SUMMARY_OK, P, False),
    (0, None, "5 skipped in 0.01s", F, False),  # nothing passed: all skipped is no pass
    (0, None, "no summary at all", N, True),
    (1, None, SUMMARY_FAIL, F, False),
    (1, None, "/usr/bin/python3: No module named pytest", N, True),  # pytest never ran
    (2, None, SUMMARY_COLLECT, F, False),  # collection errors: the patch broke an import
    (2, "refused: unexpected EOF while looking for matching quote", "", N, True),  # execd's
    (3, None, "INTERNALERROR> boom\n", N, True),
    (4, None, "ERROR: file or directory not found: tests/x.py\n", N, False),
    (5, None, "no tests ran in 0.01s\n", F, False),
    (137, None, "", N, True),  # SIGKILL: OOM or a dying pod
    (143, None, "", N, True),
    (-1, "incomplete frame: shell exited (status 137)", "", N, True),
    (0, "shell exited (status 0); a new shell was started, state lost", SUMMARY_OK, N, True),
    (126, None, "", N, True),
])
def test_exit_status_to_verdict(code, error, output, verdict, infra) -> None:
    o = classify(code, error, output)
    assert (o.verdict, o.infra) == (verdict, infra), o


def test_exit_one_with_a_summary_never_passes() -> None:
    assert classify(1, None, SUMMARY_OK).verdict is F


@pytest.mark.parametrize("output,expected", [
    ("3 passed in 0.05s", {"passed": 3}),
    ("== 1 failed, 2 passed, 3 warnings in 1.20s ==", {"failed": 1, "passed": 2,
                                                        "warnings": 3}),
    ("1 passed, 1 error in 0.3s (0:00:00)", {"passed": 1, "errors": 1}),
    ("======= no tests ran in 0.01s =======", {}),
    ("5 passed in 0.1s\nsomething after\n", {"passed": 5}),
    ("not pytest", None),
    ("collected 3 items", None),
])
def test_parse_summary(output, expected) -> None:
    assert parse_summary(output) == expected


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
])
def test_task_checks(kw, words) -> None:
    base = dict(name="t", image="img", repo="/testbed", base_commit="a" * 40,
                test_files=("tests/test_x.py",))
    with pytest.raises(BadRequest, match=words):
        Task(**{**base, **kw})


def test_task_defaults() -> None:
    t = Task(name="t", image="img", repo="/r", base_commit="abc1234",
             test_files=["tests/test a.py"], reference_patch="diff")
    assert t.test_files == ("tests/test a.py",) and t.reference_patch == b"diff"
    assert t.command == "python3 -m pytest -q -p no:cacheprovider 'tests/test a.py'"


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
