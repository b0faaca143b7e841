"""Grading (sandman.client.grading) against a real execd and real git and pytest on 127.0.0.1:
capture_patch from an agent's repository, grade() through the stand-in controller of
tests/client/conftest.py (a real HTTP server handing out the real execd), preflight, and the
infrastructure-failure paths (acquire timeout, execd killed mid-run, a killed shell). Every
test runs through the sync and the async twin. The verdict logic's pure parts are
test_grading_logic.py; the demo on real pods is tests/e2e/test_grading_demo.py."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from sandman.client import AsyncClient, AsyncSandbox, Client, Sandbox
from sandman.client import grading as G
from sandman.client.grading import NO_EXCLUDE, Task, Verdict
from testbed import taskimage
from testbed.execd import Execd

from .conftest import FAST_RETRY, FakeController, Flavor, _error

PYTEST = f"{sys.executable} -m pytest -q -p no:cacheprovider"

# A conftest.py that turns every failure into a pass: what an agent once planted (paper §3).
PLANTED_CONFTEST = (
    "import pytest\n\n\n"
    "@pytest.hookimpl(hookwrapper=True)\n"
    "def pytest_runtest_makereport(item, call):\n"
    "    outcome = yield\n"
    "    outcome.get_result().outcome = 'passed'\n")


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout


def new_task(tmp_path: Path, name: str = "repo", **kw) -> Task:
    repo = tmp_path / name
    base = taskimage.make_repo(repo)
    kw.setdefault("test_command", f"{PYTEST} tests/test_calc.py")
    kw.setdefault("python", sys.executable)
    return Task(name="calc-add", image="local/unused", repo=str(repo), base_commit=base,
                test_files=tuple(taskimage.TEST_FILES),
                reference_patch=taskimage.REFERENCE_PATCH, time_limit_s=60, **kw)


class Twin:
    """The grading functions of one flavor, called from an async test body."""

    def __init__(self, flavor: Flavor) -> None:
        self.is_async = flavor.is_async

    def client(self, url: str):
        return AsyncClient(url, retry=FAST_RETRY) if self.is_async else Client(
            url, retry=FAST_RETRY)

    def connect(self, ex: Execd):
        cls = AsyncSandbox if self.is_async else Sandbox
        return cls.connect(ex.address, ex.port, ex.token, retry=FAST_RETRY)

    async def close(self, obj) -> None:
        if self.is_async:
            await obj.aclose()
        else:
            obj.close()

    async def grade(self, client, task, patch, **kw):
        kw.setdefault("retry_backoff_s", 0.05)
        if self.is_async:
            return await G.agrade(client, task, patch, **kw)
        return G.grade(client, task, patch, **kw)

    async def capture(self, sb, base, **kw):
        if self.is_async:
            return await G.acapture_patch(sb, base, **kw)
        return G.capture_patch(sb, base, **kw)

    async def preflight(self, client, tasks, **kw):
        kw.setdefault("retry_backoff_s", 0.05)
        if self.is_async:
            return await G.apreflight(client, tasks, **kw)
        return G.preflight(client, tasks, **kw)


@pytest.fixture
def twin(flavor: Flavor) -> Twin:
    return Twin(flavor)


# ---- grade


@pytest.mark.slow
def test_reference_passes_and_empty_fails(flavor, twin, controller: FakeController,
                                          tmp_path) -> None:
    async def body():
        c = twin.client(controller.url)
        try:
            ref = await twin.grade(c, new_task(tmp_path, "a"), taskimage.REFERENCE_PATCH)
            empty = await twin.grade(c, new_task(tmp_path, "b"), b"")
        finally:
            await twin.close(c)
        assert ref.verdict is Verdict.PASSED, ref
        assert ref.summary == {"passed": 3} and ref.exit_code == 0 and ref.attempts == 1
        assert empty.verdict is Verdict.FAILED, empty
        assert empty.summary == {"failed": 2, "passed": 1} and empty.exit_code == 1
        # Each grading acquired one pod and released it (no reuse asked: deleted).
        assert len(controller.calls("POST")) == 2 and len(controller.calls("DELETE")) == 2
        assert controller.sandboxes == {}

    flavor.run(body, timeout_s=90)


@pytest.mark.slow
def test_planted_conftest_is_graded_without_it(flavor, twin, controller, tmp_path) -> None:
    """A raw patch that plants a conftest.py forcing every test to pass: the hook works (a
    plain pytest run in the patched repository passes), and the grader leaves it out,
    with the default exclusions and without them (conftest.py is the runner's file)."""
    task = new_task(tmp_path, "probe")
    (Path(task.repo) / "conftest.py").write_text(PLANTED_CONFTEST)
    _git(Path(task.repo), "add", "-N", "conftest.py")
    planted = _git(Path(task.repo), "diff", "--binary").encode()
    assert b"conftest.py" in planted
    hole = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/test_calc.py"], cwd=task.repo, capture_output=True)
    assert hole.returncode == 0, hole.stdout  # the planted hook works

    async def body():
        c = twin.client(controller.url)
        try:
            open_hole = await twin.grade(
                c, dataclasses.replace(new_task(tmp_path, "a"), exclude=NO_EXCLUDE), planted)
            guarded = await twin.grade(c, new_task(tmp_path, "b"), planted)
        finally:
            await twin.close(c)
        assert open_hole.verdict is Verdict.FAILED, open_hole
        assert guarded.verdict is Verdict.FAILED, guarded
        assert [e.path for e in guarded.excluded] == ["conftest.py"]
        assert [e.path for e in open_hole.excluded] == ["conftest.py"]
        assert not (tmp_path / "b" / "conftest.py").exists()

    flavor.run(body, timeout_s=90)


def _over_the_cap() -> bytes:
    """80 MiB of a new file: past execd's request cap once encoded, which raised the caller's
    BadRequest out of grade()."""
    blob = b"+" + b"x" * 79 + b"\n"
    return (b"diff --git a/blob.txt b/blob.txt\nnew file mode 100644\n--- /dev/null\n"
            b"+++ b/blob.txt\n@@ -0,0 +1,%d @@\n" % (1 << 20)) + blob * (1 << 20)


# The agent's output, wrong in a way git or the grader refuses: failed, never no_verdict (which
# would let a policy trade a certain failure for a sample that does not count) nor an error.
# The corrupt ones are input git cannot read at all (git apply exits 128 for them).
WRONG_PATCHES = {
    "does not apply": (lambda: taskimage.REFERENCE_PATCH.replace(
        b"-    return a - b", b"-    return a * b"), "patch does not apply"),
    "garbage": (lambda: b"garbage\n", "patch does not apply"),
    "hunk cut short": (lambda: taskimage.REFERENCE_PATCH.rsplit(b"\n", 3)[0] + b"\n",
                       "patch does not apply"),
    "hunk without a body": (
        lambda: b"--- a/calc/__init__.py\n+++ b/calc/__init__.py\n@@ -1 +1 @@\n",
        "patch does not apply"),
    "header without names": (lambda: b"diff --git a/calc/__init__.py\n",
                             "patch does not apply"),
    "over the cap": (_over_the_cap, "patch too large"),
}


@pytest.mark.parametrize("case", list(WRONG_PATCHES))
def test_a_wrong_patch_is_failed(flavor, twin, controller, tmp_path, case) -> None:
    make, reason = WRONG_PATCHES[case]

    async def body():
        c = twin.client(controller.url)
        try:
            r = await twin.grade(c, new_task(tmp_path), make())
        finally:
            await twin.close(c)
        assert r.verdict is Verdict.FAILED and r.attempts == 1, r
        assert r.reason.startswith(reason), r.reason

    flavor.run(body, timeout_s=120)


def test_patch_cannot_change_the_official_tests(flavor, twin, controller, tmp_path) -> None:
    """A patch that rewrites the official test file to pass is applied without that file."""
    task = new_task(tmp_path, "probe")
    test_file = Path(task.repo) / "tests/test_calc.py"
    test_file.write_text("def test_add():\n    assert True\n")
    cheat = _git(Path(task.repo), "diff", "--binary").encode()

    async def body():
        c = twin.client(controller.url)
        try:
            r = await twin.grade(c, new_task(tmp_path, "a"), cheat)
        finally:
            await twin.close(c)
        assert r.verdict is Verdict.FAILED, r
        assert [e.path for e in r.excluded] == ["tests/test_calc.py"]

    flavor.run(body, timeout_s=60)


def test_setup_cfg_test_section_change_is_left_out(flavor, twin, controller, tmp_path) -> None:
    """A setup.cfg change to [tool:pytest] that deselects the failing tests: the whole
    setup.cfg stays the base's. Without the section rule the change reaches the repository,
    and pytest still reads the base's copy (`-c`): failed either way."""
    probe = new_task(tmp_path, "probe")
    cfg = Path(probe.repo) / "setup.cfg"
    cfg.write_text(cfg.read_text().replace("addopts = -p no:cacheprovider",
                                           "addopts = -p no:cacheprovider -k mul"))
    cheat = _git(Path(probe.repo), "diff", "--binary").encode()

    async def body():
        c = twin.client(controller.url)
        try:
            r = await twin.grade(c, new_task(tmp_path, "a"), cheat)
            # The same change without the section rule: pytest reads the base's setup.cfg.
            hole = await twin.grade(c, dataclasses.replace(new_task(tmp_path, "b"),
                                                           exclude=NO_EXCLUDE), cheat)
        finally:
            await twin.close(c)
        assert r.verdict is Verdict.FAILED, r
        assert [e.path for e in r.excluded] == ["setup.cfg"]
        assert hole.verdict is Verdict.FAILED and hole.excluded == (), hole
        assert "-k mul" in (tmp_path / "b" / "setup.cfg").read_text()

    flavor.run(body, timeout_s=90)


def test_time_limit_is_a_verdict(flavor, twin, controller, tmp_path) -> None:
    async def body():
        c = twin.client(controller.url)
        try:
            task = dataclasses.replace(new_task(tmp_path), time_limit_s=1,
                                       test_command=f"sleep 30; {PYTEST} tests/test_calc.py")
            r = await twin.grade(c, task, taskimage.REFERENCE_PATCH)
        finally:
            await twin.close(c)
        assert r.verdict is Verdict.FAILED and "time limit" in r.reason, r

    flavor.run(body, timeout_s=60)


# ---- infrastructure failures: retried, never failed


def test_acquire_timeout_is_retried_then_graded(flavor, twin, controller, tmp_path) -> None:
    controller.answers.append(_error(504, "AcquireTimeout", "no sandbox within 300s"))

    async def body():
        c = twin.client(controller.url)
        try:
            r = await twin.grade(c, new_task(tmp_path), taskimage.REFERENCE_PATCH)
        finally:
            await twin.close(c)
        assert r.verdict is Verdict.PASSED and r.attempts == 2, r
        assert len(r.infra_errors) == 1 and "AcquireTimeout" in r.infra_errors[0]
        assert r.infra_errors[0].startswith("attempt 1 (acquire): "), r.infra_errors

    flavor.run(body, timeout_s=60)


def test_acquire_never_succeeding_is_no_verdict(flavor, twin, controller, tmp_path) -> None:
    controller.answers.extend([_error(500, "InternalError", "boom")] * 2)

    async def body():
        c = twin.client(controller.url)
        try:
            r = await twin.grade(c, new_task(tmp_path), b"", attempts=2)
        finally:
            await twin.close(c)
        assert r.verdict is Verdict.NO_VERDICT and r.attempts == 2, r
        assert all("ControllerError" in e for e in r.infra_errors), r.infra_errors

    flavor.run(body, timeout_s=60)


def test_killed_shell_with_a_healthy_pod_is_failed(flavor, twin, controller,
                                                  tmp_path) -> None:
    """The suite's shell is SIGKILLed from inside (as code under test can do): the suite
    runs in a fresh process, so that is its exit status (137) with the pod and execd
    healthy: failed, not no_verdict (which a policy could learn to provoke)."""
    async def body():
        c = twin.client(controller.url)
        try:
            task = dataclasses.replace(new_task(tmp_path), test_command="kill -9 $$")
            r = await twin.grade(c, task, b"", attempts=2)
        finally:
            await twin.close(c)
        assert r.verdict is Verdict.FAILED and r.attempts == 1, r
        assert "no JUnit report (exit 137)" in r.reason, r.reason

    flavor.run(body, timeout_s=60)


def test_execd_killed_mid_run_is_no_verdict(flavor, twin, fresh_execd: Execd, tmp_path,
                                            make_controller) -> None:
    """The grading pod's execd dies while the suite runs (a deleted pod): no_verdict after
    the retry, never failed."""
    ctl = make_controller(fresh_execd)
    # A duration no other test's sleep has: pgrep sees every process on the machine, and a
    # `sleep 20` of a test beside this one stopped execd before the suite started.
    pause = f"20.{uuid.uuid4().int % 10**9:09d}"
    task = dataclasses.replace(new_task(tmp_path),
                               test_command=f"sleep {pause}; {PYTEST} tests/test_calc.py")

    def killer():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if subprocess.run(["pgrep", "-f", f"^sleep {pause}$"], capture_output=True).stdout:
                break
            time.sleep(0.1)
        fresh_execd.stop()

    async def body():
        c = twin.client(ctl.url)
        try:
            threading.Thread(target=killer, daemon=True).start()
            r = await twin.grade(c, task, taskimage.REFERENCE_PATCH, attempts=2)
        finally:
            await twin.close(c)
        assert r.verdict is Verdict.NO_VERDICT and r.attempts == 2, r
        assert any("Unreachable" in e or "Gone" in e for e in r.infra_errors), r.infra_errors
        # execd's shutdown ends the suite and may still answer: then the report's read fails.
        assert r.infra_errors[0].startswith(("attempt 1 (run the suite): ",
                                             "attempt 1 (read the report): ")), r.infra_errors

    flavor.run(body, timeout_s=90)


# ---- capture


def test_capture_patch_round_trip_and_exclusions(flavor, twin, execd, tmp_path) -> None:
    """The agent fixes the bug, adds a binary file and a new module, commits part of it,
    plants a conftest.py, changes pytest.ini-like config and setup.cfg's [tool:pytest]:
    the captured patch, applied to a fresh copy of the base, gives exactly the agent's
    tree minus the excluded files; the agent's HEAD and index are untouched."""
    task = new_task(tmp_path, "agent")
    repo = Path(task.repo)
    blob = bytes(range(256)) * 8 + b"\r\n\x00\xff"

    async def body():
        sb = twin.connect(execd)
        try:
            w = sb.write if not twin.is_async else None
            cmds = (
                f"cd {repo} && sed -i 's/a - b/a + b/' calc/__init__.py && "
                "git -c user.name=a -c user.email=a@b commit -qam fix && "
                "mkdir -p sub && printf 'x = 1\\n' > calc/extra.py && "
                "echo 'addopts = -k mul' >> setup.cfg && "
                "printf '[pytest]\\n' > pytest.ini && git add pytest.ini")
            r = sb.exec(cmds) if not twin.is_async else await sb.exec(cmds)
            assert r.exit_code == 0, r.output
            for path, data in ((f"{repo}/data.bin", blob),
                               (f"{repo}/sub/conftest.py", PLANTED_CONFTEST.encode())):
                if w:
                    w(path, data)
                else:
                    await sb.write(path, data)
            head_before = _git(repo, "rev-parse", "HEAD")
            index_before = (repo / ".git/index").read_bytes()
            patch, excluded = await twin.capture(sb, task.base_commit, repo=str(repo))
        finally:
            await twin.close(sb)
        assert sorted(e.path for e in excluded) == ["pytest.ini", "setup.cfg",
                                                    "sub/conftest.py"], excluded
        assert _git(repo, "rev-parse", "HEAD") == head_before
        assert (repo / ".git/index").read_bytes() == index_before
        # Apply to a fresh base: the agent's files, byte for byte; no excluded file.
        fresh = tmp_path / "fresh"
        taskimage.make_repo(fresh)
        subprocess.run(["git", "-C", str(fresh), "apply", "--binary", "-"], input=patch,
                       check=True)
        assert (fresh / "data.bin").read_bytes() == blob
        assert (fresh / "calc/__init__.py").read_bytes() == (repo / "calc/__init__.py").read_bytes()
        assert (fresh / "calc/extra.py").read_text() == "x = 1\n"
        assert (fresh / "setup.cfg").read_text() == taskimage.FILES["setup.cfg"]
        assert not (fresh / "pytest.ini").exists() and not (fresh / "sub").exists()

    flavor.run(body, timeout_s=60)


def test_capture_of_an_untouched_repo_is_empty(flavor, twin, execd, tmp_path) -> None:
    task = new_task(tmp_path)

    async def body():
        sb = twin.connect(execd)
        try:
            patch, excluded = await twin.capture(sb, task.base_commit, repo=task.repo)
        finally:
            await twin.close(sb)
        assert patch == b"" and excluded == []

    flavor.run(body, timeout_s=30)


# ---- preflight


@pytest.mark.slow
def test_preflight_keeps_only_sound_tasks(flavor, twin, execd, make_controller,
                                          tmp_path) -> None:
    """Sound task kept; a task whose tests pass without the fix (vacuous) and one whose
    reference patch does not fix it are dropped, each with its reason."""
    sound = new_task(tmp_path, "sound")
    vacuous = dataclasses.replace(new_task(tmp_path, "vacuous"), name="vacuous",
                                  test_command=f"{PYTEST} tests/test_calc.py -k mul",
                                  test_ids=("tests/test_calc.py::test_mul",))
    broken = dataclasses.replace(new_task(tmp_path, "broken"), name="broken",
                                 reference_patch=b"")

    controller = make_controller(execd, *(Path(t.repo) for t in (sound, vacuous, broken)))

    async def body():
        c = twin.client(controller.url)
        try:
            res = await twin.preflight(c, [sound, vacuous, broken])
        finally:
            await twin.close(c)
        assert [t.name for t in res.kept] == ["calc-add"], res.dropped
        # The kept task carries the official test ids collected on the base.
        assert res.kept[0].test_ids == ("tests/test_calc.py::test_add",
                                        "tests/test_calc.py::test_add_negative",
                                        "tests/test_calc.py::test_mul")
        reasons = {t.name: why for t, why in res.dropped}
        assert reasons["vacuous"].startswith("empty patch: passed"), reasons
        assert reasons["broken"] == "no reference patch"

    flavor.run(body, timeout_s=120)
