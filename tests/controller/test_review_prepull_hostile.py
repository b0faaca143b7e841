"""The image pre-pull against a tenant who may create pods in the sandbox namespace: puller
names are predictable (a hash of image and node), so a pod can be planted under one before the
controller creates it. A planted pod is adopted only when it is a puller as the controller
writes it, so the kubelet's status of the image's own container is what the node is reported
by; a lookalike with a sibling container whose image the node already has, another command, or
another runtime class is a squatter. Pure logic here; the planted pod on the kwok bed's real
API server is test_review_prepull_squat_on_testbed.py."""

from __future__ import annotations

import copy

from controller import prepull as PP
from controller.settings import Settings
from sandman import contract

IMAGE = f"registry.example/swe/task@sha256:{'cd' * 32}"
NODE = "node-1"


# One create's body: its command is drawn per body, and only that create's stored pod is
# adopted (test_prepull_ownership.py).
BODY = PP.Prepuller(None, None, Settings(namespace="sbx")).body(IMAGE, NODE)


def puller(**spec) -> dict:
    """The puller the controller's create stored on NODE (with a uid), its spec updated with
    `spec`."""
    body = copy.deepcopy(BODY)
    body["metadata"]["uid"] = "u-1"
    body["spec"].update(spec)
    return body


def expected() -> dict:
    return copy.deepcopy(BODY)


def test_a_pulled_sibling_does_not_make_a_failed_image_pulled():
    """The kubelet lists container statuses by name: a sibling named before the image's
    container, with an image the node has, came first and made the pod 'pulled'."""
    pod = {"status": {"phase": "Pending", "containerStatuses": [
        {"name": "a", "imageID": "docker.io/library/pause@sha256:1", "state": {"running": {}}},
        {"name": "pull", "state": {"waiting": {"reason": "ErrImagePull", "message": "denied"}}},
    ]}}
    assert PP.outcome(pod) == (PP.FAILED, "ErrImagePull: denied")
    pod["status"]["containerStatuses"][1]["state"] = {"waiting": {"reason": "ContainerCreating"}}
    assert PP.outcome(pod)[0] == PP.PENDING


def test_only_a_puller_as_written_is_adopted():
    assert PP.adoptable(puller(), expected())
    sidecar = {"name": "a", "image": "registry.k8s.io/pause:3.9"}
    squatters = {
        "a sibling container": puller(containers=puller()["spec"]["containers"] + [sidecar]),
        "an init container": puller(initContainers=[sidecar]),
        "the image's entrypoint": puller(containers=[{**puller()["spec"]["containers"][0],
                                                      "command": ["/bin/sh", "-c", "sleep 1"]}]),
        "another runtime class": puller(runtimeClassName="tenant-runtime"),
        "another node": puller(nodeName="node-2"),
        "another image": puller(containers=[{**puller()["spec"]["containers"][0],
                                             "image": "registry.example/other@sha256:" + "0" * 64}]),
    }
    for why, pod in squatters.items():
        assert not PP.adoptable(pod, expected()), why
    unlabelled = puller()
    unlabelled["metadata"]["labels"] = {}
    assert not PP.adoptable(unlabelled, expected())
    assert contract.LABEL_PREPULL in puller()["metadata"]["labels"]


def test_no_image_can_ship_the_puller_s_command():
    """The puller's command is a path no image has, so the image's entrypoint never runs. A
    fixed path could be shipped by an image's author: the image's own program would run there,
    unguarded (no netguard, no egress label) on every node of the pool. Drawn per puller, it
    cannot be."""
    prepuller = PP.Prepuller(None, None, Settings(namespace="sbx"))
    commands = {tuple(prepuller.body(IMAGE, NODE)["spec"]["containers"][0]["command"])
                for _ in range(3)}
    assert len(commands) == 3, commands
    for [path] in commands:
        assert path.startswith(PP.NO_ENTRYPOINT_DIR + "/") and len(path) > 32
    # A puller as written by another create (an earlier leader's, another draw) is not
    # this create's: never adopted.
    assert PP.adoptable(puller(), expected())
    assert not PP.adoptable(puller(), prepuller.body(IMAGE, NODE))
