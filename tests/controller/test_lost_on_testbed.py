"""Lost sandboxes on the test bed's real control plane (the logic: test_lost.py;
docs/controller.md "Lost sandboxes"): a handed-out sandbox whose pod another party deletes, or
whose node is lost, is reported gone with its reason on the holder's next call; another tenant
learns no reason; what the holder can do to its own pod never ends a lease; nothing is left.

The lost node is a Node of this test's own that kwok plays until the test makes it anew without
kwok's annotation: nothing renews its Lease any more, and kube-controller-manager (the bed's,
default flags) marks it and its pods not Ready after its node-monitor grace period (40-50 s),
as it does for a node whose kubelet died. That wait is this file's only slow step."""

from __future__ import annotations

import json
import re
import secrets
import ssl
import time

import httpx
import pytest
from kubernetes.client.rest import ApiException

from sandman import api, contract
from sandman.client import Client, RetryPolicy, SandboxGone, SandboxUnreachable
from testbed.cluster import KWOK_NODE_ANNOTATION
from testbed.controller import local_tls_dir, start_controller
from tests.controller.harness import pods, standin_stack
from tests.controller.test_auth import IMAGE, bearer
from tests.controller.test_prepull_on_testbed import wait_for

pytestmark = pytest.mark.testbed

SIZE = {"cpu": "100m", "memory": "128Mi", "timeout_s": 60}
FAST = RetryPolicy(attempts=2, backoff_s=0.05, budget_s=3)  # execd of a kwok pod: refused


def _until(what: str, timeout: float, probe):
    """probe()'s first truthy answer within `timeout` s (each probe bounded by its own)."""
    return wait_for(probe, timeout, what)


def _gone(cl: Client, sid: str) -> str | None:
    try:
        cl.get(sid)
    except SandboxGone as e:
        return e.message
    return None


def _lost_count(url: str, reason: str, **kw) -> float:
    text = httpx.get(url + api.METRICS.path, timeout=10, **kw).text
    m = re.search(rf'^sandman_controller_leases_lost_total{{reason="{reason}"}} (\S+)$', text,
                  re.M)
    return float(m.group(1)) if m else 0.0


def test_a_leased_pod_deleted_by_another_party_is_gone_with_its_reason(cluster, namespace,
                                                                      tmp_path):
    with standin_stack(cluster, namespace, tmp_path, "lost") as (ctl, _standin):
        with Client(ctl.url, retry=FAST) as cl:
            sb = cl.acquire(IMAGE, job="lost", **SIZE)
            kept = cl.acquire(IMAGE, job="lost", **SIZE)
            evicted = cl.acquire(IMAGE, job="lost", **SIZE)
            assert sb.exec("echo hi").output == "hi\n"
            # Another party (an admin's `kubectl delete`, an eviction): not the holder's release.
            cluster.core.delete_namespaced_pod(sb.pod, namespace)
            said = _until("GET says gone", 30, lambda: _gone(cl, sb.id))
            assert said == (f"sandbox {sb.id} is gone: its pod was deleted while leased, by "
                            "another party than its holder's release (no reason recorded on "
                            "the pod)"), said
            # The holder's next execd call says so, in one line with the reason.
            with pytest.raises(SandboxGone) as err:
                sb.exec("true")
            assert "its pod was deleted while leased" in str(err.value)
            assert "\n" not in str(err.value)
            r = httpx.post(ctl.url + api.RENEW.url(id=sb.id), json={}, timeout=10)
            assert r.status_code == 404 and "deleted while leased" in r.text, r.text
            r = httpx.delete(ctl.url + api.RELEASE.url(id=sb.id), timeout=10)
            assert r.json()["released"] is False and "deleted while leased" in r.json()["lost"]
            # A release keeps today's answer: no reason, none recorded.
            kept.release()
            assert _until("released", 20, lambda: _gone(cl, kept.id)) == \
                f"no sandbox {kept.id}"
            r = httpx.delete(ctl.url + api.RELEASE.url(id=kept.id), timeout=10)
            assert "lost" not in r.json(), r.text
            # Its kubelet evicts a pod (kwok plays no kubelet: the test writes what it would):
            # a Failed pod never runs again, so the lease ends at once, with the reason.
            cluster.core.patch_namespaced_pod_status(evicted.pod, namespace, {"status": {
                "phase": "Failed", "reason": "Evicted",
                "message": "The node was low on resource: memory."}})
            said = _until("the evicted one gone", 30, lambda: _gone(cl, evicted.id))
            assert said == (f"sandbox {evicted.id} is gone: its pod ended while leased (phase "
                            "Failed: Evicted: The node was low on resource: memory.)"), said
        assert _lost_count(ctl.url, "deleted") == 1
        assert _lost_count(ctl.url, "evicted") == 1
        _until("nothing live", 20, lambda: httpx.get(
            ctl.url + api.STATS.path, timeout=10).json()["live"] == 0)
        _until("no pods left", 20, lambda: not pods(cluster.core, namespace))


def test_hostile_another_tenant_learns_no_reason(cluster, namespace, tenants, authctl):
    """The reason of a lost sandbox is told only to callers that may see it (GET, renew,
    release rights in its tenant): another tenant gets what an unknown id gets."""
    a, b = tenants.namespace("ta"), tenants.namespace("tb")
    for ns in (a, b):
        tenants.account(ns, "trainer")
        tenants.bind(ns, ns, "trainer")
    tok_a, tok_b = tenants.token(a, "trainer"), tenants.token(b, "trainer")
    ctl = authctl()
    ctx = ssl.create_default_context(cafile=str(local_tls_dir() / "ca.crt"))
    with httpx.Client(verify=ctx, timeout=30) as h:
        r = h.post(ctl.url + api.ACQUIRE.path, headers=bearer(tok_a),
                   json={"image": IMAGE, "job": "run", **SIZE})
        assert r.status_code == 201, r.text
        sid, pod = r.json()["id"], r.json()["pod"]
        cluster.core.delete_namespaced_pod(pod, namespace)

        def a_says():
            got = h.get(ctl.url + api.GET.url(id=sid), headers=bearer(tok_a))
            return got.status_code == 404 and got.json()["error"]["message"]
        assert "deleted while leased" in _until("A told why", 30, a_says)
        got = h.get(ctl.url + api.GET.url(id=sid), headers=bearer(tok_b))
        assert got.status_code == 404 and got.json()["error"]["message"] == f"no sandbox {sid}"
        got = h.post(ctl.url + api.RENEW.url(id=sid), headers=bearer(tok_b), json={})
        assert got.status_code == 404 and "deleted" not in got.text, got.text
        for route, body in ((api.FORK, {"n": 1}), (api.PAUSE, {})):  # the same id, other routes
            got = h.post(ctl.url + route.url(id=sid), headers=bearer(tok_b), json=body)
            assert got.status_code in (403, 404) and "deleted" not in got.text, (route, got.text)
        got = h.delete(ctl.url + api.RELEASE.url(id=sid), headers=bearer(tok_b))
        assert got.status_code == 200 and got.json()["released"] is False
        assert "lost" not in got.json(), got.text
        got = h.delete(ctl.url + api.RELEASE.url(id=sid), headers=bearer(tok_a))
        assert "deleted while leased" in got.json()["lost"], got.text


def test_hostile_what_a_holder_does_to_its_own_pod_ends_no_lease(cluster, namespace, tmp_path):
    """The holder runs its pod's processes: it can fail its readiness and write its
    container's termination message. Here its pod's status says not Ready "because the node
    is lost", with kube's words, and the controller ends leases 1 s after a node is lost: the
    controller reads the pod's Node, which is Ready, so neither its lease nor another's ends
    and no problem is shown."""
    ctl = start_controller(namespace, cluster.kubeconfig, tmp_path / "ctl.log",
                           ["--lease-name", f"forge-{namespace}", "--node-lost-after", "1"])
    try:
        with Client(ctl.url, retry=FAST) as cl:
            mine = cl.acquire(IMAGE, job="attacker", **SIZE)
            other = cl.acquire(IMAGE, job="victim", **SIZE)
            forged = {"status": {"conditions": [
                {"type": "Ready", "status": "False", "reason": "NodeNotReady",
                 "message": "node lost"},
                {"type": "DisruptionTarget", "status": "False", "reason": "DeletionByPodGC",
                 "message": "PodGC: node no longer exists"}],
                "containerStatuses": [{"name": "sandbox", "image": IMAGE, "imageID": "",
                                       "ready": False, "restartCount": 0,
                                       "state": {"running": {}},
                                       "lastState": {"terminated": {
                                           "exitCode": 1, "reason": "NodeLost",
                                           "message": "node lost"}}}]}}
            t0 = time.monotonic()
            while time.monotonic() - t0 < 8:  # the node check runs at least every 5 s
                cluster.core.patch_namespaced_pod_status(mine.pod, namespace, forged)
                for sb in (mine, other):
                    info = cl.get(sb.id)
                    assert info.state == "leased" and info.problem is None, info
                time.sleep(0.5)
            # The forged status held (kwok did not undo it): the test was not vacuous.
            st = cluster.core.read_namespaced_pod(mine.pod, namespace).status
            assert any(c.type == "Ready" and c.status == "False" for c in st.conditions)
            assert _lost_count(ctl.url, "node_lost") == 0
    finally:
        ctl.kill()


def _lost_node(name: str, tag: str, kwok: bool = True) -> dict:
    """A Node kwok plays (`kwok`), or one that says Ready once and never again."""
    return {"apiVersion": "v1", "kind": "Node", "metadata": {
        "name": name, "annotations": {KWOK_NODE_ANNOTATION: "fake"} if kwok else {},
        "labels": {"kubernetes.io/hostname": name, "sandman-test/lost": tag,
                   contract.LABEL_NODE_POOL_DEFAULT: "sandbox"}},
        # Only this test's pods: they tolerate the taint and require the label.
        "spec": {"taints": [{"key": "sandman-test/lost", "value": tag, "effect": "NoSchedule"}]},
        "status": {"allocatable": {"cpu": "16", "memory": "64Gi", "pods": "20"},
                   "capacity": {"cpu": "16", "memory": "64Gi", "pods": "20"},
                   **({} if kwok else {"conditions": [
                       {"type": "Ready", "status": "True", "reason": "KubeletReady",
                        "message": "the last status its kubelet posted"}]})}}


def _node_ready(core, name: str) -> bool:
    conds = core.read_node(name).status.conditions or []
    return any(c.type == "Ready" and c.status == "True" for c in conds)


def test_a_lost_node_is_reported_then_its_lease_ended_and_nothing_leaks(cluster, namespace,
                                                                        tmp_path):
    tag = secrets.token_hex(3)
    node = f"lost-{tag}"
    template = tmp_path / "template.json"
    template.write_text(json.dumps({
        "tolerations": [{"key": "sandman-test/lost", "operator": "Equal", "value": tag,
                         "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": "sandman-test/lost", "operator": "In", "values": [tag]}]}]}}}}))
    cluster.core.create_node(_lost_node(node, tag))
    ctl = None
    try:
        _until("the node Ready", 30, lambda: _node_ready(cluster.core, node))
        ctl = start_controller(namespace, cluster.kubeconfig, tmp_path / "ctl.log",
                               ["--lease-name", f"lost-{namespace}", "--node-lost-after", "10",
                                "--pod-template-file", str(template)])
        with Client(ctl.url, retry=FAST) as cl:
            sb = cl.acquire(IMAGE, job="node", **SIZE)
            assert cluster.core.read_namespaced_pod(sb.pod, namespace).spec.node_name == node
            assert cl.get(sb.id).problem is None
            # Its kubelet dies: the Node is made anew, Ready, without kwok's annotation (kwok
            # keeps renewing a node's Lease while it has that Node object, annotated or not),
            # so nothing renews it; its pod stays bound to it.
            cluster.core.delete_node(node)
            cluster.core.create_node(_lost_node(node, tag, kwok=False))
            t0 = time.monotonic()
            problem = _until("the view says the node is down", 100,
                             lambda: cl.get(sb.id).problem)
            took = time.monotonic() - t0
            assert problem.startswith(f"node {node} is not Ready (Unknown) since "), problem
            assert "its execd cannot be reached" in problem and "ends the lease in" in problem
            # The SDK's next execd call: unreachable, with the controller's reason.
            with pytest.raises(SandboxUnreachable) as err:
                sb.exec("true")
            assert f"the controller says: node {node} is not Ready" in str(err.value)
            # Past --node-lost-after: the controller ends the lease, with the reason.
            said = _until("the lease ended", 30, lambda: _gone(cl, sb.id))
            assert said.startswith(f"sandbox {sb.id} is gone: its node was lost (node {node} "
                                   "is not Ready (Unknown) since "), said
            assert said.endswith("; the controller ended the lease after 10s"), said
            # The pod went at once, though no kubelet confirms (a delete of grace 0).
            _until("the pod deleted", 20, lambda: not pods(cluster.core, namespace))
        assert _lost_count(ctl.url, "node_lost") == 1
        stats = httpx.get(ctl.url + api.STATS.path, timeout=10).json()
        assert stats["live"] == 0 and not stats["jobs"], stats
        print(f"node lost: the view said so {took:.0f}s after the heartbeats stopped")
    finally:
        try:
            cluster.core.delete_node(node)
        except ApiException as e:
            if e.status != 404:
                raise
        if ctl is not None:
            ctl.kill()
    assert not pods(cluster.core, namespace)
