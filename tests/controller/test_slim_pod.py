"""The informer keeps only a slim copy of each pod: every reading the books make of a pod must
give the same answer on the slim copy as on the whole object."""

import copy

import pytest

from controller import pods
from controller.pods import slim_pod
from sandman import contract
from sandman.podspec import SandboxPolicy, make_sandbox


def _pod(**status) -> dict:
    base = {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "sbx-a-1", "namespace": "ns",
                         "labels": {contract.LABEL_JOB: "a", contract.LABEL_NONCE: "n1",
                                    contract.LABEL_EGRESS: contract.EGRESS_ALLOW}},
            "spec": {"containers": [{"name": "sandbox", "image": "img:1", "workingDir": "/w",
                                     "resources": {"requests": {"cpu": "1", "memory": "2Gi"}}}]}}
    pod = make_sandbox(base, SandboxPolicy())
    pod["metadata"].update(uid="u-1", resourceVersion="42", creationTimestamp="2026-01-01T00:00:00Z",
                           managedFields=[{"manager": "x", "fieldsV1": {"f:spec": {}}}],
                           annotations={contract.ANNOTATION_TOKEN_SHA256: "ab" * 32})
    pod["spec"]["nodeName"] = "kwok-node-1"
    pod["status"] = status
    return pod


READY = {"phase": "Running", "podIP": "10.0.0.5", "hostIP": "10.1.0.1",
         "conditions": [{"type": "PodScheduled", "status": "True", "lastTransitionTime": "t"},
                        {"type": "Ready", "status": "True", "lastProbeTime": None}],
         "containerStatuses": [{"name": "sandbox", "ready": True, "restartCount": 0,
                                "state": {"running": {"startedAt": "t"}}}]}
CASES = {
    "ready": READY,
    "pending-no-status": {"phase": "Pending"},
    "not-ready": {**READY, "conditions": [{"type": "Ready", "status": "False"}]},
    # The guard still runs: the sandbox container has not started (no early execd check).
    "init-running": {"phase": "Pending", "podIP": "10.0.0.5",
                     "initContainerStatuses": [{"name": "sandman-netguard",
                                                "state": {"running": {"startedAt": "t"}}}],
                     "containerStatuses": [{"name": "sandbox", "state": {"waiting": {
                         "reason": "PodInitializing"}}}]},
    # A container other than the sandbox one runs: not the sandbox started.
    "other-running": {"phase": "Pending", "podIP": "10.0.0.5", "containerStatuses": [
        {"name": "sidecar", "state": {"running": {"startedAt": "t"}}},
        {"name": "sandbox", "state": {"waiting": {"reason": "ContainerCreating"}}}]},
    "image-pull-backoff": {"phase": "Pending", "containerStatuses": [
        {"name": "sandbox", "state": {"waiting": {"reason": "ImagePullBackOff", "message": "m"}}}]},
    "fatal-waiting": {"phase": "Pending", "containerStatuses": [
        {"name": "sandbox", "state": {"waiting": {"reason": "CreateContainerError",
                                                  "message": "no such file"}}}]},
    "fatal-init": {"phase": "Pending", "initContainerStatuses": [
        {"name": "netguard", "state": {"waiting": {"reason": "InvalidImageName", "message": "x"}}}]},
    "failed": {"phase": "Failed", "reason": "Evicted", "message": "The node was low on memory."},
    # Pod GC's mark before it deletes a pod whose Node is gone (a lost lease's reason).
    "pod-gc": {"phase": "Failed", "conditions": [
        {"type": "DisruptionTarget", "status": "True", "reason": "DeletionByPodGC",
         "message": "PodGC: node no longer exists", "lastTransitionTime": "t"},
        {"type": "Ready", "status": "False", "reason": "PodFailed"}]},
    "succeeded": {"phase": "Succeeded"},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_reading_is_the_same_on_the_slim_copy(case):
    full = _pod(**copy.deepcopy(CASES[case]))
    slim = slim_pod(copy.deepcopy(full))
    for read in (pods.name, pods.uid, pods.labels, pods.deleting, pods.pod_ip,
                 pods.is_ready, pods.started, pods.failure, pods.spec_of,
                 lambda p: pods.age(p, 1.8e9),
                 pods.expires_at, pods.lifetime, pods.node_name, pods.disruption):
        assert read(slim) == read(full), read.__name__
    assert pods.meta(slim)["creationTimestamp"] == pods.meta(full)["creationTimestamp"]
    # The cases do reach the interesting answers, so equality above is not None == None.
    assert (pods.failure(slim) is not None) == (case.startswith("fatal") or case in (
        "failed", "succeeded", "pod-gc"))
    assert pods.node_name(slim) == "kwok-node-1"
    assert (pods.disruption(slim) is not None) == (case == "pod-gc")
    assert pods.is_ready(slim) == (case == "ready")
    assert pods.started(slim) == (case in ("ready", "not-ready"))


def test_deleting_and_empty_pods():
    full = _pod(**READY)
    full["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:01Z"
    slim = slim_pod(full)
    assert pods.deleting(slim) and pods.failure(slim) == pods.failure(full)
    assert slim_pod({}) == {"metadata": {}, "spec": {"containers": [{}]}, "status": {}}
    assert pods.spec_of(slim_pod({})) == pods.spec_of({})


def test_the_lease_annotations_survive_the_slim_copy():
    """A leader rebuilt from the informer's copies keeps every sandbox's expiry."""
    full = _pod(**READY)
    full["metadata"]["annotations"].update(pods.lease_annotations(90, 1.8e9 + 0.2))
    slim = slim_pod(full)
    assert pods.expires_at(slim) == pods.expires_at(full) == 1.8e9 + 1  # rounded up
    assert pods.lifetime(slim) == pods.lifetime(full) == 90
    # Kept too: a restarted leader checks a holder's token against it (Controller.prove).
    assert pods.annotation(slim, contract.ANNOTATION_TOKEN_SHA256) == \
        pods.annotation(full, contract.ANNOTATION_TOKEN_SHA256)
    assert pods.expires_at(_pod()) is None and pods.lifetime(_pod()) is None


def test_slim_copy_is_small():
    import json

    full = _pod(**READY)
    slim = slim_pod(full)
    assert "managedFields" not in slim["metadata"]
    assert set(slim["metadata"].get("annotations", {})) <= {contract.ANNOTATION_TOKEN_SHA256}
    assert len(json.dumps(slim)) < len(json.dumps(full)) / 2


def test_the_books_proof_survives_the_slim_copy():
    """A leader rebuilt from the informer's copies can check each pod's proof."""
    full = _pod(**READY)
    full["metadata"]["annotations"][contract.ANNOTATION_PROOF] = "cd" * 32
    slim = slim_pod(full)
    assert pods.annotation(slim, contract.ANNOTATION_PROOF) == "cd" * 32


def test_the_egress_allowlist_survives_the_slim_copy():
    """The allowlist is part of the warm-pool key: a rebuilt leader reads it from the copy."""
    full = _pod(**READY)
    full["metadata"]["labels"][contract.LABEL_EGRESS] = contract.EGRESS_DENY
    allow = "198.18.0.1/32:8181/tcp,svc/pypi-mirror.infra:3141/tcp"
    full["metadata"]["annotations"][contract.ANNOTATION_EGRESS_ALLOW] = allow
    spec = pods.spec_of(slim_pod(full))
    assert spec == pods.spec_of(full)
    assert spec.egress_allow == tuple(allow.split(","))
