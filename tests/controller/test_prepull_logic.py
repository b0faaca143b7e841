"""The image pre-pull's pure logic: a puller's outcome from its status, which nodes are the
pool's, the puller pod's hardening, the request's digest check, the tracked set, and the
pacer's pre-pull role (never ahead of an acquire). On the test bed: test_prepull_on_testbed.py;
on the real node: tests/e2e/test_prepull_on_node.py."""

from __future__ import annotations

import asyncio

import pytest

from controller import prepull as PP
from controller.errors import BadRequest
from controller.pacer import ROLE_PREPULL, Limits, Pacer, QueueFull
from controller.settings import Settings
from sandman import api, contract

DIGEST = "sha256:" + "ab" * 32
IMAGE = f"registry.example/swe/task@{DIGEST}"


def status(phase="Pending", **container):
    return {"status": {"phase": phase, "containerStatuses": [container] if container else []}}


@pytest.mark.parametrize("pod,want", [
    (status(), (PP.PENDING, "")),
    (status(state={"waiting": {"reason": "ContainerCreating"}}), (PP.PENDING, "")),
    (status(state={"waiting": {"reason": "ErrImagePull", "message": "not\nfound"}}),
     (PP.FAILED, "ErrImagePull: not found")),
    (status(state={"waiting": {"reason": "ImagePullBackOff"}}), (PP.FAILED, "ImagePullBackOff")),
    # The real node: the exec of the puller's command fails after the pull; the image is there.
    (status("Failed", imageID="docker.io/x@sha256:1", state={"terminated": {
        "reason": "StartError", "exitCode": 128}}), (PP.PULLED, "")),
    (status("Running", state={"running": {}}), (PP.PULLED, "")),  # kwok
    # Past the deadline without a container: failed, never pulled.
    ({"status": {"phase": "Failed", "reason": "DeadlineExceeded", "message": "too long"}},
     (PP.FAILED, "DeadlineExceeded: too long")),
    (status("Failed", state={"terminated": {"reason": "ContainerStatusUnknown"}}),
     (PP.FAILED, "pod failed")),
])
def test_outcome(pod, want):
    assert PP.outcome(pod) == want


def test_reason_is_capped_and_one_line():
    state, reason = PP.outcome(status(state={"waiting": {"reason": "ErrImagePull",
                                                         "message": "x\n" * 1000}}))
    assert state == PP.FAILED and len(reason) <= PP.REASON_CAP and "\n" not in reason


def node(name, ready="True", taints=(), unschedulable=False):
    return {"metadata": {"name": name},
            "spec": {"taints": list(taints), "unschedulable": unschedulable},
            "status": {"conditions": [{"type": "Ready", "status": ready}]}}


def test_eligible_nodes_are_the_sandboxes_nodes():
    pool = {"key": "pool", "value": "sbx", "effect": "NoSchedule"}
    tol = [{"key": "pool", "operator": "Equal", "value": "sbx", "effect": "NoSchedule"}]
    assert PP.eligible(node("a"), [])
    assert not PP.eligible(node("a", ready="False"), [])
    assert not PP.eligible(node("a", unschedulable=True), [])
    assert not PP.eligible(node("a", taints=[pool]), [])
    assert PP.eligible(node("a", taints=[pool]), tol)
    assert not PP.eligible(node("a", taints=[{**pool, "value": "gpu"}]), tol)
    assert PP.eligible(node("a", taints=[{"key": "x", "effect": "PreferNoSchedule"}]), [])
    assert PP.eligible(node("a", taints=[pool]), [{"operator": "Exists"}])


def test_puller_pod_is_hardened_and_never_a_sandbox():
    s = Settings(namespace="sbx", pod_template={
        "tolerations": [{"key": "pool", "operator": "Exists"}],
        "imagePullSecrets": [{"name": "regcred"}], "priorityClassName": "high"})
    body = PP.Prepuller(None, None, s).body(IMAGE, "node-1")
    meta, spec = body["metadata"], body["spec"]
    assert meta["labels"] == {contract.LABEL_PREPULL: "ab" * 16}
    assert contract.LABEL_SANDBOX not in meta["labels"]
    assert contract.LABEL_MANAGED_BY not in meta["labels"]
    assert spec["nodeName"] == "node-1" and spec["restartPolicy"] == "Never"
    assert spec["automountServiceAccountToken"] is False and spec["enableServiceLinks"] is False
    assert 0 < spec["activeDeadlineSeconds"] <= 3600
    assert "priorityClassName" not in spec  # a puller never preempts anything
    assert spec["tolerations"] == [{"key": "pool", "operator": "Exists"}]
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    [c] = spec["containers"]
    assert c["image"] == IMAGE and c["imagePullPolicy"] == "IfNotPresent"
    assert c["command"][0].startswith(PP.NO_ENTRYPOINT_DIR + "/")
    assert c["resources"]["requests"] == c["resources"]["limits"]
    sc = c["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["allowPrivilegeEscalation"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True
    # One name per (image, node), stable across restarts: a second create answers 409.
    assert meta["name"] == PP.puller_name(IMAGE, "node-1") != PP.puller_name(IMAGE, "node-2")


@pytest.mark.parametrize("ref", [
    "registry.example/swe/task:v1",  # a tag: could move before the run
    "registry.example/swe/task",
    f"registry.example/swe/task@sha256:{'AB' * 32}",  # not the canonical lowercase
    f"registry.example/swe/task@sha256:{'ab' * 31}",
    f"registry.example/swe/task@{DIGEST}\n",
    f"registry.example/swe task@{DIGEST}",
    f"-x@{DIGEST}",
])
def test_refs_without_a_digest_are_refused_in_one_line(ref):
    with pytest.raises(ValueError) as e:
        api.PrepullRequest(images=[ref])
    assert "\n" not in str(e.value) and "images[0]" in str(e.value)


def test_request_bounds():
    with pytest.raises(ValueError, match="1 to"):
        api.PrepullRequest(images=[])
    with pytest.raises(ValueError, match="1 to"):
        api.PrepullRequest(images=[IMAGE] * (api.MAX_PREPULL_IMAGES + 1))
    with pytest.raises(ValueError):
        api.PrepullRequest(images=[f"r/{'x' * api.MAX_IMAGE_REF_LEN}@{DIGEST}"])
    assert api.PrepullRequest(images=[IMAGE, IMAGE]).images == [IMAGE, IMAGE]


def ref(i: int) -> str:
    return f"registry.example/t{i}@sha256:{i:064x}"


def test_tracked_set_is_bounded_and_keeps_the_charts():
    p = PP.Prepuller(None, None, Settings(namespace="sbx"))
    p.add([ref(0)], pinned=True)
    p.add([ref(i) for i in range(1, 200)])
    p.add([ref(i) for i in range(200, 300)])
    assert len(p.images) == api.MAX_PREPULL_IMAGES
    assert ref(0) in p.images and ref(299) in p.images and ref(1) not in p.images
    with pytest.raises(BadRequest):
        p.add([ref(i) for i in range(1000, 1256)])  # with the chart's one: 257


def test_failed_nodes_are_retried_on_a_new_post():
    p = PP.Prepuller(None, None, Settings(namespace="sbx"))
    p.add([IMAGE])
    p.images[IMAGE] = {"n1": PP._NodeState(PP.FAILED, "ErrImagePull"),
                       "n2": PP._NodeState(PP.PULLED)}
    st = p.status().images[0]
    assert (st.pulled, st.pending, st.failed, st.failures) == (1, 0, 1, {"n1": "ErrImagePull"})
    p.add([IMAGE])
    assert p.images[IMAGE]["n1"].state == PP.PENDING and p._queue.qsize() == 1
    assert p.images[IMAGE]["n2"].state == PP.PULLED


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


def test_prepull_role_goes_after_every_acquire():
    async def main():
        p = Pacer(Limits(rate=1000, burst=1000, max_creating=1, max_live=100))
        p.start()
        first = await p.acquire("job")
        pre = asyncio.ensure_future(p.acquire("sandman-prepull", role=ROLE_PREPULL))
        await asyncio.sleep(0.02)
        agent = asyncio.ensure_future(p.acquire("job", role=contract.ROLE_AGENT))
        grading = asyncio.ensure_future(p.acquire("job", role=contract.ROLE_GRADING))
        await asyncio.sleep(0.02)
        names = {pre: "prepull", agent: "agent", grading: "grading"}
        order: list[str] = []
        slot = first
        left = set(names)
        while left:
            slot.done_creating()  # one slot frees: exactly one waiter gets it
            done, _ = await asyncio.wait(left, return_when=asyncio.FIRST_COMPLETED)
            await asyncio.sleep(0.02)
            assert len(done) == 1 and not any(f.done() for f in left - done)
            [f] = done
            left.discard(f)
            order.append(names[f])
            slot = f.result()
        await p.stop()
        return order

    # The puller waited first, and still went last.
    assert run(main()) == ["grading", "agent", "prepull"]


def test_a_waiting_prepull_never_refuses_a_no_wait_acquire():
    async def main():
        p = Pacer(Limits(rate=1000, burst=1000, max_creating=2, max_live=100))
        p.start()
        busy = [await p.acquire("x"), await p.acquire("x")]
        pre = asyncio.ensure_future(p.acquire("sandman-prepull", role=ROLE_PREPULL))
        await asyncio.sleep(0.02)
        busy[0].done_creating()
        await asyncio.sleep(0.02)
        # The freed slot went to the puller (nothing else waited) ...
        assert pre.done()
        pre.result().done_creating()
        pre2 = asyncio.ensure_future(p.acquire("sandman-prepull", role=ROLE_PREPULL))
        busy.append(await asyncio.wait_for(pre2, 1))
        # ... and with a puller queued behind a full cap, wait=False says the cap, not "queued".
        pre3 = asyncio.ensure_future(p.acquire("sandman-prepull", role=ROLE_PREPULL))
        await asyncio.sleep(0.02)
        with pytest.raises(QueueFull, match="concurrent creates at the cap"):
            await p.acquire("job", wait=False)
        busy[1].done_creating()
        got = await p.acquire("job", wait=False)  # ahead of the waiting puller
        assert not pre3.done()
        pre3.cancel()
        got.gone()
        await p.stop()

    run(main())


def test_a_tag_in_the_chart_s_flag_stops_the_controller_in_one_line(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "controller", "serve", "--namespace", "x",
                        "--kubeconfig", str(tmp_path / "none"), "--prepull-image", IMAGE,
                        "--prepull-image", "registry.example/swe/task:v1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    [line] = (r.stdout + r.stderr).strip().splitlines()
    assert "--prepull-image[1]" in line and "not pinned by digest" in line
