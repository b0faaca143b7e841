"""The task set's integrity against a policy that moves its reward any way it can: a task
edited after preflight, a preflight record swapped, a flaky task, a task without a time limit,
and a reused grading pod poisoned so that it passes a wrong patch (shadow grading). Real execd,
git and pytest on 127.0.0.1 behind the stand-in controller of tests/client/conftest.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from sandman.client import BadRequest
from sandman.client.grading import (
    NO_EXCLUDE,
    PreflightRecord,
    Task,
    TaskRecord,
    TaskRefused,
    Verdict,
)
from testbed import taskimage
from testbed.execd import start_execd

from .conftest import Flavor
from .test_grading import PYTEST, Twin, _git, new_task

BASE = "d16bfe05a744909de4b27f5875fe0d4ed41ce607"


def plain(**kw) -> Task:
    kw = {"name": "t", "image": "img@sha256:" + "a" * 64, "repo": "/testbed",
          "base_commit": BASE, "test_files": ["tests/test_x.py"], **kw}
    return Task(**kw)


@pytest.fixture
def twin(flavor: Flavor) -> Twin:
    return Twin(flavor)


# ---- the declared time limit


def test_a_task_without_a_time_limit_is_refused() -> None:
    for kw in ({}, {"time_limit_s": None}):
        with pytest.raises(BadRequest, match="time_limit_s") as e:
            plain(**kw)
        assert "\n" not in str(e.value)
    t = plain(time_limit_s=900)
    with pytest.raises(BadRequest, match="time_limit_s"):
        dataclasses.replace(t, time_limit_s=None)


# ---- the task's hash and the record


def test_the_task_hash_covers_what_decides_a_verdict() -> None:
    t = plain(time_limit_s=900, reference_patch=b"diff", test_ids=["tests/test_x.py::a"])
    assert t.sha256 == plain(time_limit_s=900.0, reference_patch=b"diff",
                             test_ids=("tests/test_x.py::a",)).sha256
    edits = {"test_command": "python3 -m pytest -k nothing tests/test_x.py",
             "test_ids": ("tests/test_x.py::b",), "reference_patch": b"other",
             "time_limit_s": 1, "exclude": NO_EXCLUDE, "image": "img:latest",
             "test_files": ("tests/test_y.py",), "plugins": ("xdist",), "memory": "16Gi",
             "egress": "allow", "python": "python3.9", "base_commit": "b" * 40}
    seen = {t.sha256}
    for name, value in edits.items():
        h = dataclasses.replace(t, **{name: value}).sha256
        assert h not in seen, name
        seen.add(h)


def test_a_swapped_record_is_refused_by_its_pinned_hash(tmp_path: Path) -> None:
    task = plain(time_limit_s=900, test_ids=("tests/test_x.py::a",))
    edited = dataclasses.replace(task, test_ids=("tests/test_x.py::b",))
    rec = PreflightRecord((TaskRecord.of(task, admitted=True, outcomes=(
        ("passed", "failed"), ("passed", "failed"))),))
    path = tmp_path / "preflight.json"
    rec.save(path)
    pinned = rec.sha256
    assert PreflightRecord.load(path, pinned) == rec
    assert rec.check(task) is None
    assert "changed since preflight" in rec.check(edited)
    # A record admitting the edited task, written over the pinned one.
    forged = PreflightRecord((TaskRecord.of(edited, admitted=True, outcomes=(
        ("passed", "failed"), ("passed", "failed"))),))
    forged.save(path)
    with pytest.raises(TaskRefused, match="SHA-256") as e:
        PreflightRecord.load(path, pinned)
    assert "\n" not in str(e.value)
    # The same bytes with a task flipped to admitted by hand.
    text = path.read_bytes().replace(b'"admitted":true', b'"admitted":false')
    path.write_bytes(text)
    with pytest.raises(TaskRefused, match="SHA-256"):
        PreflightRecord.load(path, forged.sha256)


@pytest.mark.slow
def test_a_task_edited_after_preflight_is_refused(flavor, twin, execd, make_controller,
                                                  tmp_path) -> None:
    """Preflight admits the task; its test command and ids are then narrowed so that the
    empty (wrong) patch passes. Graded without the record it does; with it, grade() refuses
    before any pod, with one line."""
    task = new_task(tmp_path, "sound")
    controller = make_controller(execd, Path(task.repo))

    async def body():
        c = twin.client(controller.url)
        try:
            pre = await twin.preflight(c, [task])
            assert [t.name for t in pre.kept] == ["calc-add"], pre.dropped
            rec = pre.record
            kept = pre.kept[0]
            assert rec.check(kept) is None
            edited = dataclasses.replace(kept, test_command=f"{PYTEST} tests/test_calc.py -k mul",
                                         test_ids=("tests/test_calc.py::test_mul",))
            hole = await twin.grade(c, edited, b"")
            assert hole.verdict is Verdict.PASSED, hole  # what the record guards against
            before = len(controller.calls("POST"))
            with pytest.raises(TaskRefused, match="changed since preflight") as e:
                await twin.grade(c, edited, b"", record=rec)
            assert "\n" not in str(e.value)
            assert len(controller.calls("POST")) == before  # no pod for a refused task
            ok = await twin.grade(c, kept, taskimage.REFERENCE_PATCH, record=rec)
            assert ok.verdict is Verdict.PASSED, ok
            # The record round-trips through its file, pinned by its hash.
            path = tmp_path / "preflight.json"
            rec.save(path)
            assert PreflightRecord.load(path, rec.sha256).check(kept) is None
        finally:
            await twin.close(c)

    flavor.run(body, timeout_s=180)


# ---- preflight grades twice, with early stop

# Applies, fixes nothing: a reference patch that fails.
README_PATCH = (b"diff --git a/README.md b/README.md\n--- a/README.md\n+++ b/README.md\n"
                b"@@ -1,3 +1,4 @@\n # calc\n \n A tiny task for sandman's grading demo.\n"
                b"+More.\n")

FLAKY_TEST = """\
from pathlib import Path

COUNTER = Path({counter!r})


def test_passes_on_the_first_run_only():
    n = int(COUNTER.read_text()) if COUNTER.exists() else 0
    COUNTER.write_text(str(n + 1))
    assert n == 0
"""


def flaky_task(tmp_path: Path) -> Task:
    task = new_task(tmp_path, "flaky")
    repo = Path(task.repo)
    (repo / "tests" / "test_flaky.py").write_text(
        FLAKY_TEST.format(counter=str(tmp_path / "flaky-counter")))
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "flaky")
    base = _git(repo, "rev-parse", "HEAD").strip()
    files = ("tests/test_calc.py", "tests/test_flaky.py")
    return dataclasses.replace(task, name="flaky", base_commit=base, test_files=files,
                               test_command=f"{PYTEST} " + " ".join(files))


@pytest.mark.slow
def test_a_flaky_task_is_refused_naming_both_outcomes(flavor, twin, execd, make_controller,
                                                      tmp_path) -> None:
    task = flaky_task(tmp_path)
    controller = make_controller(execd, Path(task.repo))

    async def body():
        c = twin.client(controller.url)
        try:
            pre = await twin.preflight(c, [task])
            assert pre.kept == [], "a task whose reference passed once and failed once"
            (_, why), = pre.dropped
            assert "flaky" in why and "passed" in why and "failed" in why, why
            assert "\n" not in why
            assert pre.record.check(task) is not None
            with pytest.raises(TaskRefused, match="not admitted"):
                await twin.grade(c, task, taskimage.REFERENCE_PATCH, record=pre.record)
        finally:
            await twin.close(c)

    flavor.run(body, timeout_s=180)


@pytest.mark.slow
def test_preflight_grades_twice_and_stops_early(flavor, twin, execd, make_controller,
                                                tmp_path) -> None:
    """Acquires counted per task (each task its own memory size): a sound task is graded
    four times (reference and empty, twice), a vacuous one twice (its empty patch passed on
    the first run), one whose reference fails once."""
    sound = dataclasses.replace(new_task(tmp_path, "sound"), memory="1Gi")
    vacuous = dataclasses.replace(new_task(tmp_path, "vacuous"), name="vacuous", memory="2Gi",
                                  test_command=f"{PYTEST} tests/test_calc.py -k mul",
                                  test_ids=("tests/test_calc.py::test_mul",))
    wrong = dataclasses.replace(new_task(tmp_path, "wrong"), name="wrong", memory="3Gi",
                                reference_patch=README_PATCH)
    controller = make_controller(execd, *(Path(t.repo) for t in (sound, vacuous, wrong)))

    async def body():
        c = twin.client(controller.url)
        try:
            pre = await twin.preflight(c, [sound, vacuous, wrong])
        finally:
            await twin.close(c)
        assert [t.name for t in pre.kept] == ["calc-add"], pre.dropped
        sizes = [b["memory"] for _, p, b in controller.calls("POST") if p == "/v1/sandboxes"]
        assert {m: sizes.count(m) for m in set(sizes)} == {"1Gi": 4, "2Gi": 2, "3Gi": 1}
        by_name = {r.name: r for r in pre.record.tasks}
        assert by_name["calc-add"].outcomes == (("passed", "failed"), ("passed", "failed"))
        assert by_name["vacuous"].outcomes == (("passed", "passed"),)
        assert by_name["wrong"].admitted is False

    flavor.run(body, timeout_s=240)


# ---- shadow grading

# What a holder of a reused grading pod might leave behind where the restore does not look:
# a sitecustomize that fixes calc.add whenever the tests import it.
POISON = """\
import builtins

_import = builtins.__import__


def _poisoned(name, globals=None, locals=None, fromlist=(), level=0):
    mod = _import(name, globals, locals, fromlist, level)
    if name == "calc" and level == 0:
        mod.add = lambda a, b: a + b
    return mod


builtins.__import__ = _poisoned
"""


@pytest.fixture
def poisoned_execd(tmp_path):
    poison = tmp_path / "poison"
    poison.mkdir()
    (poison / "sitecustomize.py").write_text(POISON)
    ex = start_execd(tmp_path / "poisoned-execd", "--kill-grace", "0.2",
                     env={"PYTHONPATH": str(poison)})
    try:
        yield ex
    finally:
        ex.stop()


@pytest.mark.slow
def test_shadow_grading_catches_a_poisoned_reused_pod(flavor, twin, execd, poisoned_execd,
                                                      make_controller, tmp_path) -> None:
    task = new_task(tmp_path, "repo")
    controller = make_controller(execd, Path(task.repo))
    # A grading that takes a reused pod gets the poisoned execd (reused 3 times before);
    # any other gets a fresh one.
    controller.pick = lambda body: ((poisoned_execd, 3) if body.get("reused_ok")
                                    else (execd, 0))

    async def body():
        c = twin.client(controller.url)
        try:
            hole = await twin.grade(c, task, b"", reuse=True, shadow=0)
            assert hole.verdict is Verdict.PASSED, hole  # the poisoned pod's verdict
            assert controller.shadows == []
            got = await twin.grade(c, task, b"", reuse=True, shadow=1.0)
            assert got.verdict is Verdict.FAILED, got  # the fresh pod's
            assert got.shadow == "contradict"
            assert [o for _, o in controller.shadows] == ["contradict"]
            assert len(got.pods) == 2
            ok = await twin.grade(c, task, taskimage.REFERENCE_PATCH, reuse=True, shadow=1.0)
            assert ok.verdict is Verdict.PASSED and ok.shadow == "agree", ok
            assert [o for _, o in controller.shadows] == ["contradict", "agree"]
            fresh = await twin.grade(c, task, b"", reuse=False, shadow=1.0)
            assert fresh.verdict is Verdict.FAILED and fresh.shadow is None, fresh
            assert len(controller.shadows) == 2  # a never-used pod is not shadowed
        finally:
            await twin.close(c)
        # The contradicted pod is gone; no pod is left leased.
        assert controller.sandboxes == {}

    flavor.run(body, timeout_s=240)
