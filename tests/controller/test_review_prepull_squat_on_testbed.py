"""A planted lookalike puller on the test bed's real API server: a pod created ahead of the
controller under a puller's (predictable) name, with the pre-pull label, the node and the image
in its first container, but with a sibling container too. Before, the controller's create met
409, read the pod, adopted it (label, node and first image matched) and reported the node by
its status, which the sibling can make 'pulled' on a node that lacks the image; then it deleted
the planted pod. Now it is a squatter: the node is reported failed, naming it. (The sweep
leaves it too: a sibling container makes it no puller as written, see
test_prepull_ownership.py; it is planted after the controller's start all the same.) Pure
logic: test_review_prepull_hostile.py."""

from __future__ import annotations

import secrets
import time

import pytest
from kubernetes import client

from controller import prepull as PP
from sandman import contract
from sandman.client import Client
from testbed.controller import start_controller
from tests.controller.test_prepull_on_testbed import pool_nodes, wait_for

pytestmark = pytest.mark.testbed


def test_a_lookalike_puller_with_a_sibling_is_not_adopted(cluster, namespace, tmp_path):
    core = cluster.core
    nodes = pool_nodes(core)
    image = f"registry.invalid/swe/lookalike@sha256:{secrets.token_hex(32)}"
    name = PP.puller_name(image, nodes[0])
    ctl = start_controller(namespace, cluster.kubeconfig, tmp_path / "ctl.log",
                           ["--lease-name", f"ppl-{namespace}"])
    try:
        with Client(ctl.url) as c:
            wait_for(lambda: c.images() is not None, 30, "the controller")
            time.sleep(2.0)  # its first pass swept the (empty) set of pullers
            core.create_namespaced_pod(namespace, {
                "metadata": {"name": name,
                             "labels": {contract.LABEL_PREPULL: PP.digest_label(image)}},
                "spec": {"nodeName": nodes[0], "containers": [
                    {"name": "z", "image": image, "command": [f"{PP.NO_ENTRYPOINT_DIR}/{'0' * 32}"]},
                    {"name": "a", "image": "registry.invalid/present:1"}]}})
            c.prepull([image])
            st = wait_for(lambda: (lambda x: x if x.images[0].pulled + x.images[0].failed
                                   == len(nodes) else None)(c.images()), 120, "every node done")
        [i] = st.images
        assert list(i.failures) == [nodes[0]] and "taken" in i.failures[nodes[0]], i
        assert i.pulled == len(nodes) - 1, i
    finally:
        ctl.stop()
        try:
            core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
        except client.ApiException as e:
            assert e.status == 404, e
