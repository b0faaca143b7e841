"""The image pre-pull on the test bed's real API server (kwok nodes: the "pull" is kwok starting
the container, so what is checked is the pods, the pacing, the status and the cleanup; the
kubelet's real pull is tests/e2e/test_prepull_on_node.py, the pure logic
test_prepull_logic.py).

- one puller per (node, image), pinned to each node of the pool and to nothing else, created at
  the pacer's rate, deleted once its outcome is read; `/v1/images` and the metrics say pulled;
- a tag is refused in one line and creates nothing; a new node gets the tracked images;
- a puller left by an earlier leader is deleted at start; a lookalike without the label is not;
- only a cluster-wide admin may pre-pull (a tenant's binding is refused, nothing created)."""

from __future__ import annotations

import collections
import secrets
import threading
import time

import httpx
import pytest
from kubernetes import client, watch

from controller import prepull as PP
from controller.settings import Settings
from sandman import api, contract
from sandman.client import Client
from testbed.controller import start_controller
from tests.controller.test_capacity_signals import scrape, value

pytestmark = pytest.mark.testbed

RATE = 4  # creates/s: slow enough that an unpaced burst of pullers would show
IMAGES = [f"registry.invalid/swe/task-{i}@sha256:{secrets.token_hex(32)}" for i in range(2)]


def pullers(core, ns: str) -> list:
    return core.list_namespaced_pod(ns, label_selector=contract.LABEL_PREPULL).items


def wait_for(fn, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


class Seen:
    """Every puller the API server stores, from a watch (they live a second or two)."""

    def __init__(self, core, ns: str):
        self.pods: dict[str, client.V1Pod] = {}
        self._w = watch.Watch()
        self._t = threading.Thread(target=self._run, args=(core, ns), daemon=True)
        self._t.start()

    def _run(self, core, ns: str) -> None:
        try:
            for ev in self._w.stream(core.list_namespaced_pod, ns,
                                     label_selector=contract.LABEL_PREPULL, timeout_seconds=300):
                if ev["type"] == "ADDED":
                    self.pods.setdefault(ev["object"].metadata.name, ev["object"])
        except Exception:  # noqa: BLE001 - the test bed went away under the watch
            pass

    def stop(self) -> None:
        self._w.stop()


def pool_nodes(core) -> list[str]:
    return sorted(n.metadata.name for n in core.list_node(
        label_selector=f"{contract.LABEL_NODE_POOL_DEFAULT}=sandbox").items)


def test_prepull_paces_pins_reports_and_cleans_up(cluster, namespace, tmp_path):
    core = cluster.core
    nodes = pool_nodes(core)
    assert len(nodes) >= 4, nodes
    # A leftover of an earlier leader, and a lookalike that is not a puller (no label).
    leftover = PP.Prepuller(None, None, Settings(namespace=namespace)).body(IMAGES[0], nodes[0])
    leftover["metadata"]["name"] = "sandman-prepull-leftover"
    core.create_namespaced_pod(namespace, leftover)
    core.create_namespaced_pod(namespace, {"metadata": {"name": "sandman-prepull-lookalike"},
                                           "spec": {"nodeName": nodes[0], "containers": [
                                               {"name": "c", "image": IMAGES[0]}]}})
    watcher = Seen(core, namespace)
    ctl = start_controller(namespace, cluster.kubeconfig, tmp_path / "ctl.log",
                           ["--lease-name", f"pp-{namespace}", "--rate", str(RATE),
                            "--burst", "1"])
    try:
        wait_for(lambda: [p for p in pullers(core, namespace)
                          if p.metadata.name == "sandman-prepull-leftover"] == [], 30,
                 "the leftover puller deleted")
        core.read_namespaced_pod("sandman-prepull-lookalike", namespace)  # untouched

        # A tag: refused in one line, nothing tracked.
        r = httpx.post(ctl.url + api.PREPULL.path,
                       json={"images": ["registry.invalid/swe/task:latest"]}, timeout=10)
        assert r.status_code == 422 and r.json()["error"]["type"] == "BadRequest", r.text
        assert "not pinned by digest" in r.json()["error"]["message"]
        assert "\n" not in r.json()["error"]["message"]
        with Client(ctl.url) as c:
            assert c.images().images == []

            t0 = time.monotonic()
            first = c.prepull(IMAGES)
            assert [i.image for i in first.images] == IMAGES
            # Counted pending at once: a caller polling for "nothing pending" waits for them.
            assert first.nodes == len(nodes), first
            assert all(i.pending == len(nodes) for i in first.images), first
            st = wait_for(lambda: (lambda x: x if all(i.pulled == len(nodes)
                                                      for i in x.images) else None)(
                c.images()), 120, "every node pulled every image")
            took = time.monotonic() - t0
        time.sleep(1.0)  # the watch's last events
        seen = {k: v for k, v in watcher.pods.items() if k != "sandman-prepull-leftover"}
        assert st.nodes == len(nodes)
        for i in st.images:
            assert (i.pending, i.failed, i.failures) == (0, 0, {})
        # One puller per (node, image), each pinned to its node, never a sandbox.
        pairs = collections.Counter((p.spec.node_name, p.spec.containers[0].image)
                                    for p in seen.values())
        assert set(pairs) == {(n, i) for n in nodes for i in IMAGES}
        assert all(v == 1 for v in pairs.values())
        for p in seen.values():
            assert contract.LABEL_SANDBOX not in p.metadata.labels
            assert p.spec.automount_service_account_token is False
            [cmd] = p.spec.containers[0].command
            assert cmd.startswith(PP.NO_ENTRYPOINT_DIR + "/")
        # Paced: the pacer's rate, not one burst of CONCURRENCY creates.
        per_second = collections.Counter(p.metadata.creation_timestamp for p in seen.values())
        assert max(per_second.values()) <= RATE + 2, per_second
        assert took >= (len(seen) - 1) / RATE * 0.8, took
        m = scrape(ctl.url)
        assert value(m, "sandman_controller_images_prepulled_total",
                     result="pulled") == len(seen)
        assert value(m, "sandman_controller_images_prepulled_total", result="failed") == 0
        assert value(m, "sandman_controller_images_prepull_pending") == 0
        # Every puller deleted once read.
        wait_for(lambda: [p.metadata.name for p in pullers(core, namespace)] == [], 60,
                 "the pullers deleted")

        # A node that joins the pool gets the tracked images.
        new = f"kwok-prepull-{secrets.token_hex(3)}"
        body = cluster_node(core, nodes[0], new)
        core.create_node(body)
        try:
            with Client(ctl.url) as c:
                wait_for(lambda: c.images().nodes == len(nodes) + 1
                         and all(i.pulled == len(nodes) + 1 for i in c.images().images),
                         PP.RECONCILE_S + 60, "the new node pulled")
        finally:
            core.delete_node(new)
        wait_for(lambda: [p.metadata.name for p in pullers(core, namespace)] == [], 60,
                 "the new node's pullers deleted")
    finally:
        watcher.stop()
        ctl.stop()
        for name in ("sandman-prepull-lookalike",):
            try:
                core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
            except client.ApiException:
                pass


def cluster_node(core, like: str, name: str) -> dict:
    """A kwok node like `like` (labels, status), named `name`."""
    n = core.read_node(like)
    labels = dict(n.metadata.labels)
    labels["kubernetes.io/hostname"] = name
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": labels,
                         "annotations": dict(n.metadata.annotations or {})},
            "status": {"allocatable": n.status.allocatable, "capacity": n.status.capacity}}


def test_only_a_cluster_admin_may_prepull(cluster, namespace, tenants, authctl):
    a = tenants.namespace("pta")
    tenants.account(a, "trainer")
    tenants.bind(a, a, "trainer")  # sandman-user rights in its own tenant: not enough
    tok = tenants.token(a, "trainer")
    ctl = authctl()
    verify = ctl.verify()
    hdr = {"Authorization": f"Bearer {tok}"}
    r = httpx.post(ctl.url + api.PREPULL.path, json={"images": IMAGES}, headers=hdr,
                   timeout=10, verify=verify)
    assert r.status_code == 403 and r.json()["error"]["type"] == "Forbidden", r.text
    assert "sandboxes/images" in r.json()["error"]["message"]
    r = httpx.get(ctl.url + api.IMAGES.path, headers=hdr, timeout=10, verify=verify)
    assert r.status_code == 403, r.text
    r = httpx.post(ctl.url + api.PREPULL.path, json={"images": IMAGES}, timeout=10,
                   verify=verify)
    assert r.status_code == 401, r.text
    time.sleep(1.0)
    assert pullers(cluster.core, namespace) == []

    # Bound cluster-wide to a role with sandboxes/images: allowed.
    rbac = client.RbacAuthorizationV1Api(cluster.api_client)
    name = f"sandman-prepull-test-{secrets.token_hex(4)}"
    rbac.create_cluster_role({"metadata": {"name": name}, "rules": [
        {"apiGroups": [contract.DOMAIN], "resources": ["sandboxes/images"],
         "verbs": ["create", "get"]}]})
    try:
        rbac.create_cluster_role_binding({
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": "trainer", "namespace": a}]})
        # The authorizer's cache (10 s) may still hold the refusal.
        r = wait_for(lambda: (lambda x: x if x.status_code == 200 else None)(
            httpx.get(ctl.url + api.IMAGES.path, headers=hdr, timeout=10, verify=verify)),
            30, "the admin binding to take effect")
        assert r.json() == {"images": [], "nodes": 0}
    finally:
        for fn in (rbac.delete_cluster_role_binding, rbac.delete_cluster_role):
            try:
                fn(name)
            except client.ApiException:
                pass


def test_a_pod_squatting_a_puller_s_name_is_neither_adopted_nor_deleted(cluster, namespace,
                                                                          tmp_path):
    """Someone creates, ahead of the controller, a pod with the name a puller will take (the
    names are predictable): that node is reported failed with the reason, the squatter stays
    as it was, and every other node still pulls."""
    core = cluster.core
    nodes = pool_nodes(core)
    image = f"registry.invalid/swe/squat@sha256:{secrets.token_hex(32)}"
    squat = PP.puller_name(image, nodes[0])
    core.create_namespaced_pod(namespace, {"metadata": {"name": squat},
                                           "spec": {"nodeName": nodes[0], "containers": [
                                               {"name": "c", "image": "registry.invalid/x:1"}]}})
    ctl = start_controller(namespace, cluster.kubeconfig, tmp_path / "ctl.log",
                           ["--lease-name", f"pps-{namespace}"])
    try:
        with Client(ctl.url) as c:
            c.prepull([image])
            st = wait_for(lambda: (lambda x: x if x.images[0].pulled + x.images[0].failed
                                   == len(nodes) else None)(c.images()), 120, "every node done")
        [i] = st.images
        assert (i.pulled, i.failed) == (len(nodes) - 1, 1), i
        assert list(i.failures) == [nodes[0]] and "taken" in i.failures[nodes[0]], i
        pod = core.read_namespaced_pod(squat, namespace)
        assert pod.metadata.deletion_timestamp is None
        assert pod.spec.containers[0].image == "registry.invalid/x:1"
        assert value(scrape(ctl.url), "sandman_controller_images_prepulled_total",
                     result="failed") == 1
    finally:
        ctl.stop()
        core.delete_namespaced_pod(squat, namespace, grace_period_seconds=0)
