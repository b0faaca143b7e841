"""Image pinning on the test bed: the bed's real OCI registry (crane's, testbed/registry.py) and
a real controller on the real API server (kwok nodes pull nothing: the pods' image fields
and the acquire answers are what is checked).

- a tag moved between two acquires of one job: the job keeps its first digest, another job
  gets the new one; pods are made of `repo@sha256:...` with IfNotPresent;
- a warm pod prewarmed before the move is never handed out for the moved tag;
- `--image-pinning require`: a tag is refused in one line naming the setting, nothing made;
- a tag the registry cannot resolve is refused (ImageUnresolved), nothing made."""

from __future__ import annotations

import time

import httpx
import pytest

from sandman import api, contract
from sandman.client import BadRequest, Client, ImageUnresolved
from testbed.controller import start_controller
from testbed.registry import LocalRegistry

pytestmark = pytest.mark.testbed


@pytest.fixture
def registry(cluster):
    if cluster.testbed is None:
        pytest.skip("needs the local test bed (its registry)")
    reg = LocalRegistry(cluster.testbed).start()
    yield reg
    reg.stop()


def _ctl(cluster, namespace, tmp_path, *flags: str):
    return start_controller(namespace, cluster.kubeconfig, tmp_path / "ctl.log",
                            ["--lease-name", f"pin-{namespace}", "--image-pinning", "resolve",
                             *flags])


def _pod(cluster, namespace, sb) -> tuple[str, str]:
    c = cluster.core.read_namespaced_pod(sb.pod, namespace).spec.containers[0]
    return c.image, c.image_pull_policy


def _sandboxes(cluster, namespace) -> list:
    return cluster.core.list_namespaced_pod(
        namespace, label_selector=f"{contract.LABEL_MANAGED_BY}="
                                  f"{contract.MANAGED_BY_CONTROLLER}").items


def test_a_tag_moved_mid_job_keeps_the_job_on_its_first_digest(cluster, namespace, tmp_path,
                                                               registry):
    first = registry.scratch("swe/task:v1", "task=first")
    tag = f"{registry.host}/swe/task:v1"
    ctl = _ctl(cluster, namespace, tmp_path, "--registry-insecure", registry.host)
    try:
        with Client(ctl.url) as c:
            a1 = c.acquire(tag, job="run-a", warm_ok=False)
            assert (a1.image, a1.image_digest) == (first, first.split("@")[1])
            assert _pod(cluster, namespace, a1) == (first, "IfNotPresent")

            moved = registry.scratch("swe/task:v1", "task=second")  # the same tag, pushed anew
            assert moved != first

            a2 = c.acquire(tag, job="run-a", warm_ok=False)
            assert a2.image == first, "the job's second acquire followed the moved tag"
            assert _pod(cluster, namespace, a2) == (first, "IfNotPresent")

            b1 = c.acquire(tag, job="run-b", warm_ok=False)  # a job that starts now
            assert b1.image == moved
            assert _pod(cluster, namespace, b1) == (moved, "IfNotPresent")
            for sb in (a1, a2, b1):
                sb.release()
    finally:
        ctl.stop()


def test_a_warm_pod_from_before_the_move_is_not_handed_out_for_the_moved_tag(
        cluster, namespace, tmp_path, registry):
    first = registry.scratch("swe/warm:v1", "task=first")
    tag = f"{registry.host}/swe/warm:v1"
    ctl = _ctl(cluster, namespace, tmp_path, "--registry-insecure", registry.host)
    try:
        with Client(ctl.url) as c:
            r = httpx.post(ctl.url + api.PREWARM.path, json={"image": tag, "count": 1},
                           timeout=30)
            assert r.status_code == 200, r.text
            deadline = time.monotonic() + 60
            while not any((p.metadata.labels or {}).get(contract.LABEL_STATE) ==
                          contract.STATE_WARM and p.status.phase == "Running"
                          for p in _sandboxes(cluster, namespace)):
                assert time.monotonic() < deadline, "no warm pod within 60 s"
                time.sleep(0.5)
            warm = [p for p in _sandboxes(cluster, namespace)]
            assert [p.spec.containers[0].image for p in warm] == [first]

            moved = registry.scratch("swe/warm:v1", "task=second")
            got = c.acquire(tag, job="after-move")
            assert not got.warm, "the warm pod of the old image was handed out for the moved tag"
            assert got.image == moved
            assert _pod(cluster, namespace, got) == (moved, "IfNotPresent")
            # The pool's pod still serves whoever asks for the image it runs.
            old = c.acquire(first, job="by-digest")
            assert old.warm and old.image == first
            got.release()
            old.release()
    finally:
        ctl.stop()


def test_a_controller_that_requires_digests_refuses_a_tag(cluster, namespace, tmp_path,
                                                         registry):
    pinned = registry.scratch("swe/req:v1", "task=req")
    ctl = _ctl(cluster, namespace, tmp_path, "--image-pinning", "require")
    try:
        with Client(ctl.url) as c:
            with pytest.raises(BadRequest) as ei:
                c.acquire(f"{registry.host}/swe/req:v1", job="strict", warm_ok=False)
            msg = str(ei.value)
            assert "--image-pinning" in msg and "\n" not in msg, msg
            assert ei.value.status == 400
            r = httpx.post(ctl.url + api.PREWARM.path,
                           json={"image": f"{registry.host}/swe/req:v1", "count": 1}, timeout=10)
            assert r.status_code == 400 and "--image-pinning" in r.text, r.text
            assert _sandboxes(cluster, namespace) == []
            sb = c.acquire(pinned, job="strict", warm_ok=False)  # a digest is taken
            assert sb.image == pinned and _pod(cluster, namespace, sb) == (pinned,
                                                                           "IfNotPresent")
            sb.release()
    finally:
        ctl.stop()


def test_a_tag_the_registry_cannot_resolve_is_refused(cluster, namespace, tmp_path,
                                                      registry):
    ctl = _ctl(cluster, namespace, tmp_path, "--registry-insecure", registry.host)
    try:
        with Client(ctl.url) as c:
            with pytest.raises(ImageUnresolved) as ei:
                c.acquire(f"{registry.host}/swe/absent:v1", job="nope", warm_ok=False,
                          timeout_s=30)
            assert "404" in str(ei.value) and "\n" not in str(ei.value), ei.value
            assert _sandboxes(cluster, namespace) == []
    finally:
        ctl.stop()


def test_grading_refuses_a_task_whose_image_digest_changed(cluster, namespace, tmp_path,
                                                           registry):
    """A real controller (pinning), a real execd behind each kwok pod (the stand-in), the
    bed's registry: the task's tag moves between its first grading and a later one."""
    import sys

    from sandman.client import ImageChanged
    from sandman.client import grading as G
    from testbed import taskimage
    from tests.controller.harness import standin_stack

    registry.scratch("swe/grade:v1", "task=first")
    repo = tmp_path / "repo"
    base = taskimage.make_repo(repo)
    task = G.Task(name="calc-add", image=f"{registry.host}/swe/grade:v1", repo=str(repo),
                  base_commit=base, test_files=tuple(taskimage.TEST_FILES),
                  test_command=f"{sys.executable} -m pytest -q -p no:cacheprovider "
                               "tests/test_calc.py",
                  python=sys.executable, reference_patch=taskimage.REFERENCE_PATCH,
                  time_limit_s=60, exclude=G.NO_EXCLUDE)
    with standin_stack(cluster, namespace, tmp_path, "pin-grade", "--image-pinning",
                       "resolve", "--registry-insecure", registry.host) as (ctl, _standin), \
            Client(ctl.url) as c:
        # The empty patch (it must fail): the stand-in's pods share the host's repository,
        # which a patch would change for the next grading.
        first = G.grade(c, task, b"", job="preflight")
        assert first.verdict is G.Verdict.FAILED, first.reason

        registry.scratch("swe/grade:v1", "task=second")  # the tag moves
        # The same job keeps its digest: graded as before.
        again = G.grade(c, task, b"", job="preflight")
        assert again.verdict is G.Verdict.FAILED, again.reason
        # A job that starts now gets the moved tag's image: refused, not graded.
        with pytest.raises(ImageChanged) as ei:
            G.grade(c, task, b"", job="train")
        assert "tag moved" in str(ei.value) and "\n" not in str(ei.value), ei.value
