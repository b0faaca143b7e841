"""Image pinning on the test bed: the bed's real OCI registry (crane's, testbed/registry.py) and
a real controller on the real API server (kwok nodes pull nothing: the pods' image fields
and the acquire answers are what is checked).

- a tag moved between two acquires of one job: the job keeps its first digest, another job
  gets the new one; pods are made of `repo@sha256:...` with IfNotPresent;
- a warm pod prewarmed before the move is never handed out for the moved tag;
- `--image-pinning require`: a tag is refused in one line naming the setting, nothing made;
- a tag the registry cannot resolve is refused (ImageUnresolved), nothing made;
- a job's pins outlive its leader: a standby that takes over, and a restarted controller, keep
  the job on its first digest after the tag moved; a pin tampered with in the job's ConfigMap
  (malformed, or a well-formed digest without the books key's proof) is refused, never
  resolved anew; a drain leaves no record behind; a job's record is bounded."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from controller.create import job_object_name
from controller.images import MAX_RECORDED_BYTES, pin_key
from sandman import api, contract
from sandman.client import BadRequest, Client, ImageUnresolved
from testbed.controller import ControllerProc
from testbed.registry import LocalRegistry

pytestmark = pytest.mark.testbed


@pytest.fixture
def registry(cluster):
    if cluster.testbed is None:
        pytest.skip("needs the local test bed (its registry)")
    reg = LocalRegistry(cluster.testbed).start()
    yield reg
    reg.stop()


def _ctl(cluster, namespace, tmp_path, *flags: str, log: str = "ctl.log",
         start: bool = True) -> ControllerProc:
    # A short lease: a killed leader's successor takes over within seconds.
    c = ControllerProc(namespace, cluster.kubeconfig, tmp_path / log,
                       ["--lease-name", f"pin-{namespace}", "--lease-duration", "3",
                        "--lease-renew", "1", "--image-pinning", "resolve", *flags])
    return c.start() if start else c


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


def _record(cluster, namespace, job: str) -> dict | None:
    """The job's ConfigMap's data (its recorded pins); None when there is no ConfigMap."""
    from kubernetes.client.exceptions import ApiException

    try:
        cm = cluster.core.read_namespaced_config_map(job_object_name(job), namespace)
    except ApiException as ex:
        if ex.status == 404:
            return None
        raise
    return dict(cm.data or {})


def _pinned(cluster, namespace, job: str, tag: str) -> str:
    return json.loads(_record(cluster, namespace, job)[pin_key(tag)])["pinned"]


def _set_pin(cluster, namespace, job: str, tag: str, value: str) -> None:
    cluster.core.patch_namespaced_config_map(job_object_name(job), namespace,
                                             {"data": {pin_key(tag): value}})


def test_a_new_leader_keeps_the_job_on_its_first_digest_after_the_tag_moved(
        cluster, namespace, tmp_path, registry):
    """The pins outlive the leader: a standby takes over from a killed leader, the tag moves
    meanwhile, and the job's next acquire still gets its first digest; so does the next one
    after that controller is restarted. (A leader that kept its pins in memory resolved the
    moved tag again and ran the job's later pods on another image.)"""
    first = registry.scratch("swe/failover:v1", "task=first")
    tag = f"{registry.host}/swe/failover:v1"
    flags = ("--registry-insecure", registry.host)
    a = _ctl(cluster, namespace, tmp_path, *flags, log="a.log")
    b = _ctl(cluster, namespace, tmp_path, *flags, log="b.log", start=False)
    try:
        b.start(role="standby")
        with Client(a.url) as c:
            s1 = c.acquire(tag, job="run-a", warm_ok=False)
        assert s1.image == first
        # Recorded before the pod was made of it: the job's ConfigMap names the digest.
        assert _pinned(cluster, namespace, "run-a", tag) == first

        a.kill()  # a crash: nothing of the leader's memory survives
        moved = registry.scratch("swe/failover:v1", "task=second")
        assert moved != first
        b.wait_ready(30, role="leader")
        with Client(b.url) as c:
            s2 = c.acquire(tag, job="run-a", warm_ok=False)
            assert s2.image == first, "the new leader followed the moved tag"
            assert _pod(cluster, namespace, s2) == (first, "IfNotPresent")
            other = c.acquire(tag, job="run-b", warm_ok=False)  # a job that starts now
            assert other.image == moved

        b.stop()  # and a restart of the controller: the record, not memory, decides
        a.start()
        with Client(a.url) as c:
            s3 = c.acquire(tag, job="run-a", warm_ok=False)
            assert s3.image == first, "the restarted controller followed the moved tag"
            assert _pod(cluster, namespace, s3) == (first, "IfNotPresent")
            for sb in (s1, s2, s3, other):
                c.release(sb.id)
            c.drain("run-a")
            c.drain("run-b")
        deadline = time.monotonic() + 30
        while any(_record(cluster, namespace, j) is not None for j in ("run-a", "run-b")):
            assert time.monotonic() < deadline, "a job's record outlived its drain"
            time.sleep(0.5)
    finally:
        a.stop()
        b.stop()


def test_a_tampered_pin_is_refused_and_a_drain_leaves_no_record(cluster, namespace, tmp_path,
                                                                registry):
    """Whoever may write ConfigMaps in the sandbox namespace can edit a job's record. A
    malformed pin, and a well-formed digest that lacks the books key's proof, are refused in
    one line (fail closed: resolving anew would move the job); nothing is made. The drain
    deletes the record with the job's ConfigMap."""
    key = tmp_path / "books.key"
    key.write_bytes(b"k" * 32)
    first = registry.scratch("swe/tamper:v1", "task=first")
    tag = f"{registry.host}/swe/tamper:v1"
    flags = ("--registry-insecure", registry.host, "--books-key-file", str(key))
    ctl = _ctl(cluster, namespace, tmp_path, *flags)
    try:
        with Client(ctl.url) as c:
            s1 = c.acquire(tag, job="victim", warm_ok=False)
        assert s1.image == first
        good = _record(cluster, namespace, "victim")[pin_key(tag)]
        moved = registry.scratch("swe/tamper:v1", "task=second")
        name = first.split("@")[0]
        forged = [
            ("not json", "not JSON"),
            (json.dumps({"image": tag, "pinned": f"{name}@sha256:xyz"}), "sha256:<64"),
            # The moved digest, well-formed, without the key: the proof is what refuses it.
            (json.dumps({"image": tag, "pinned": moved}), "proof"),
            (json.dumps({**json.loads(good), "pinned": moved}), "proof"),
        ]
        for value, why in forged:
            ctl.kill()  # the new leader reads the record: memory no longer hides the edit
            _set_pin(cluster, namespace, "victim", tag, value)
            ctl.start()
            before = len(_sandboxes(cluster, namespace))
            with Client(ctl.url) as c, pytest.raises(ImageUnresolved) as ei:
                c.acquire(tag, job="victim", warm_ok=False, timeout_s=30)
            msg = str(ei.value)
            assert why in msg and "not resolved anew" in msg and "\n" not in msg, msg
            assert len(_sandboxes(cluster, namespace)) == before, "a pod was made anyway"

        ctl.kill()
        _set_pin(cluster, namespace, "victim", tag, good)  # the controller's own, restored
        ctl.start()
        with Client(ctl.url) as c:
            assert c.acquire(tag, job="victim", warm_ok=False).image == first
            c.drain("victim")
        deadline = time.monotonic() + 30
        while _record(cluster, namespace, "victim") is not None:
            assert time.monotonic() < deadline, "the job's record outlived its drain"
            time.sleep(0.5)
        with Client(ctl.url) as c:  # drained: the job's name pins anew
            again = c.acquire(tag, job="victim", warm_ok=False)
            assert again.image == moved
            c.drain("victim")
    finally:
        ctl.stop()


def test_a_jobs_record_is_bounded(cluster, namespace, tmp_path, registry):
    """A job's pins stay far below the API server's 1 MiB per object: past the bound a new
    reference is refused in one line (never pinned in memory only, never resolved per pod);
    the job's recorded references keep working."""
    first = registry.scratch("swe/bound:v1", "task=first")
    registry.scratch("swe/bound:v2", "task=other")
    tag = f"{registry.host}/swe/bound:v1"
    ctl = _ctl(cluster, namespace, tmp_path, "--registry-insecure", registry.host)
    try:
        with Client(ctl.url) as c:
            s1 = c.acquire(tag, job="wide", warm_ok=False)
            assert s1.image == first
            # As if the job had pinned some thousand references already.
            cluster.core.patch_namespaced_config_map(
                job_object_name("wide"), namespace,
                {"data": {"pin.filler": "x" * (MAX_RECORDED_BYTES - 100)}})
            before = len(_sandboxes(cluster, namespace))
            with pytest.raises(BadRequest) as ei:
                c.acquire(f"{registry.host}/swe/bound:v2", job="wide", warm_ok=False)
            msg = str(ei.value)
            assert "bytes of image pins" in msg and "\n" not in msg, msg
            assert len(_sandboxes(cluster, namespace)) == before
            assert pin_key(f"{registry.host}/swe/bound:v2") not in _record(cluster, namespace,
                                                                          "wide")
            assert c.acquire(tag, job="wide", warm_ok=False).image == first
            c.drain("wide")
    finally:
        ctl.stop()
