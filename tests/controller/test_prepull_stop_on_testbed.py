"""Whose puller is it, on the kwok bed's real API server (pure logic:
test_prepull_ownership.py).

- a stopped controller leaves no puller behind: a pre-pull whose pod never finishes (its node
  has no kubelet, so the pod stays Pending) is cancelled and its pod deleted at SIGTERM, and
  by a leader that loses its Lease before it exits (it used to exit at once, leaving the pod
  to the next leader's sweep);
- a tenant's pod planted under a puller's name, a puller as written (label, node, image, one
  container, the puller's command), is neither adopted (the node is reported failed, naming
  it) nor deleted, under a books key;
- a tenant's labelled pod that runs something is never swept."""

from __future__ import annotations

import secrets
import time

import pytest
from kubernetes import client

from controller import prepull as PP
from controller.settings import Settings
from sandman import contract
from sandman.client import Client
from testbed.controller import start_controller
from tests.controller.test_prepull_on_testbed import pool_nodes, pullers, wait_for

pytestmark = pytest.mark.testbed


def no_kubelet_node(core, like: str) -> str:
    """A Ready node of the pool that kwok does not manage: a pod pinned to it stays Pending."""
    n = core.read_node(like)
    name = f"nokubelet-{secrets.token_hex(3)}"
    labels = {k: v for k, v in n.metadata.labels.items() if k != "kubernetes.io/hostname"}
    core.create_node({"apiVersion": "v1", "kind": "Node",
                      "metadata": {"name": name, "labels": labels}})
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    core.patch_node_status(name, {"status": {
        "allocatable": n.status.allocatable, "capacity": n.status.capacity,
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                        "message": "test", "lastHeartbeatTime": now,
                        "lastTransitionTime": now}]}})
    return name


def _one_stuck_puller(ctl, core, namespace: str, image: str, nodes: list, stuck: str):
    """Pre-pulls `image` until every kwok node has it and only the node without a kubelet
    still holds its puller pod; returns that pod."""
    with Client(ctl.url) as c:
        c.prepull([image])
        wait_for(lambda: (lambda i: i.pulled == len(nodes) and i.pending == 1)(
            c.images().images[0]), 60, "every kwok node pulled, the stuck one pending")
    [pod] = pullers(core, namespace)
    assert pod.spec.node_name == stuck
    return pod


def test_a_stopped_controller_leaves_no_puller(cluster, namespace, tmp_path):
    core = cluster.core
    nodes = pool_nodes(core)
    stuck = no_kubelet_node(core, nodes[0])
    image = f"registry.invalid/swe/stop@sha256:{secrets.token_hex(32)}"
    ctl = start_controller(namespace, cluster.kubeconfig, tmp_path / "ctl.log",
                           ["--lease-name", f"ppstop-{namespace}"])
    try:
        pod = _one_stuck_puller(ctl, core, namespace, image, nodes, stuck)
        assert pod.status.phase == "Pending"
        ctl.stop()
        assert pullers(core, namespace) == []
    finally:
        ctl.stop()
        core.delete_node(stuck)


def test_a_deposed_leader_leaves_no_puller(cluster, namespace, tmp_path):
    core = cluster.core
    coord = client.CoordinationV1Api(cluster.api_client)
    nodes = pool_nodes(core)
    stuck = no_kubelet_node(core, nodes[0])
    image = f"registry.invalid/swe/lost@sha256:{secrets.token_hex(32)}"
    lease = f"pplost-{namespace}"
    ctl = start_controller(namespace, cluster.kubeconfig, tmp_path / "ctl.log",
                           ["--lease-name", lease, "--lease-duration", "6", "--lease-renew", "2"])
    try:
        _one_stuck_puller(ctl, core, namespace, image, nodes, stuck)
        # Another holder takes the Lease: the leader stops renewing and exits.
        coord.patch_namespaced_lease(lease, namespace, {"spec": {
            "holderIdentity": "intruder", "leaseDurationSeconds": 3600}})
        wait_for(lambda: not ctl.alive(), 30, "the deposed leader to exit")
        assert pullers(core, namespace) == []
    finally:
        ctl.stop()
        core.delete_node(stuck)
        for p in pullers(core, namespace):
            core.delete_namespaced_pod(p.metadata.name, namespace, grace_period_seconds=0)


def test_a_planted_puller_is_neither_believed_nor_swept(cluster, namespace, tmp_path):
    core = cluster.core
    nodes = pool_nodes(core)
    image = f"registry.invalid/swe/planted@sha256:{secrets.token_hex(32)}"
    key = tmp_path / "books.key"
    key.write_bytes(secrets.token_bytes(32))
    # A puller exactly as a controller writes it (another draw of its command, no proof),
    # planted under the name the controller's puller for nodes[0] takes. kwok runs it, so its
    # status says "pulled" whatever the node holds.
    planted = PP.Prepuller(None, None, Settings(namespace=namespace)).body(image, nodes[0])
    core.create_namespaced_pod(namespace, planted)
    # A tenant's own labelled pod that runs a program.
    runs = {"metadata": {"name": f"tenant-{secrets.token_hex(3)}",
                         "labels": {contract.LABEL_PREPULL: PP.digest_label(image)}},
            "spec": {"nodeName": nodes[1], "containers": [
                {"name": "c", "image": "registry.invalid/tenant:1", "command": ["sleep", "1d"]}]}}
    core.create_namespaced_pod(namespace, runs)
    ctl = start_controller(namespace, cluster.kubeconfig, tmp_path / "ctl.log",
                           ["--lease-name", f"ppplant-{namespace}", "--books-key-file",
                            str(key)])
    try:
        with Client(ctl.url) as c:
            c.prepull([image])
            st = wait_for(lambda: (lambda x: x if x.images[0].pending == 0 else None)(
                c.images()), 60, "every node done")
        [i] = st.images
        assert (i.pulled, i.failed) == (len(nodes) - 1, 1), i
        assert list(i.failures) == [nodes[0]] and "did not create" in i.failures[nodes[0]], i
        time.sleep(PP.POLL_S)
        for name in (planted["metadata"]["name"], runs["metadata"]["name"]):
            assert core.read_namespaced_pod(name, namespace).metadata.deletion_timestamp is None
    finally:
        ctl.stop()
        for name in (planted["metadata"]["name"], runs["metadata"]["name"]):
            try:
                core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
            except client.ApiException:
                pass
