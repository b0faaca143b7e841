"""Proof that the test bed is a real Kubernetes control plane: a 1,000-pod burst goes Ready on
kwok nodes, the garbage collector works, the scheduler honours topology spread, and the API
server really calls an admission webhook registered by URL."""

from __future__ import annotations

import http.server
import json
import socket
import ssl
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kubernetes import client, watch

from bench.stats import percentile
from testbed import pki

IMAGE = "registry.invalid/sandman/tiny:1"  # never pulled: kwok runs no container


def tiny_pod(name: str, labels: dict | None = None, **spec) -> dict:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {"containers": [{"name": "c", "image": IMAGE,
                                 "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}}}],
                 "terminationGracePeriodSeconds": 0, **spec},
    }


def _ready(pod) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in (pod.status.conditions or []))


def test_thousand_pods_become_ready(cluster, namespace, figures):
    n = 1000
    created: dict[str, float] = {}
    ready_at: dict[str, float] = {}
    done = threading.Event()

    def watcher():
        w = watch.Watch()
        deadline = time.monotonic() + 240
        rv = None
        while not done.is_set() and time.monotonic() < deadline:
            for ev in w.stream(cluster.core.list_namespaced_pod, namespace, timeout_seconds=10,
                               resource_version=rv, allow_watch_bookmarks=False):
                pod = ev["object"]
                rv = pod.metadata.resource_version
                if _ready(pod) and pod.metadata.name not in ready_at:
                    ready_at[pod.metadata.name] = time.monotonic()
                    if len(ready_at) >= n:
                        done.set()
                        w.stop()
                        break

    t = threading.Thread(target=watcher, daemon=True)
    t.start()
    time.sleep(0.3)  # let the watch open first, so no Ready transition is missed
    api = client.CoreV1Api(cluster.new_api_client(pool=8))

    def create(i: int) -> None:
        name = f"p{i:04d}"
        created[name] = time.monotonic()
        api.create_namespaced_pod(namespace, tiny_pod(name))

    t0 = time.monotonic()
    with ThreadPoolExecutor(8) as ex:
        list(ex.map(create, range(n)))
    create_s = time.monotonic() - t0
    assert done.wait(180), f"only {len(ready_at)} of {n} pods Ready after 180 s"
    lat = [ready_at[k] - created[k] for k in created]
    pods = cluster.core.list_namespaced_pod(namespace).items
    assert len(pods) == n
    assert all(_ready(p) and p.status.pod_ip and p.spec.node_name for p in pods)
    # kwok hands out pod IPs from loopback: nothing ever dials outside this machine.
    assert all(p.status.pod_ip.startswith("127.") for p in pods)
    figures.add(f"1,000 pods: {n / create_s:.0f} creates/s (8 threads); create-to-Ready "
                f"p50 {statistics.median(lat) * 1000:.0f} ms, p99 {percentile(lat, 99) * 1000:.0f} ms")


def test_garbage_collector_deletes_orphaned_dependent(cluster, namespace):
    owner = cluster.core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "owner"}, "data": {}})
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid}
    pod = tiny_pod("dependent")
    pod["metadata"]["ownerReferences"] = [ref]
    cluster.core.create_namespaced_pod(namespace, pod)
    cluster.core.create_namespaced_pod(namespace, tiny_pod("bystander"))
    cluster.core.delete_namespaced_config_map("owner", namespace)
    deadline = time.monotonic() + 60
    names = {"dependent"}
    while time.monotonic() < deadline:
        names = {p.metadata.name for p in cluster.core.list_namespaced_pod(namespace).items}
        if "dependent" not in names:
            break
        time.sleep(0.2)
    assert "dependent" not in names, "the garbage collector never deleted the dependent pod"
    assert "bystander" in names, "a pod without that owner must survive"


def test_topology_spread_over_kwok_nodes(cluster, namespace):
    nodes = [n.metadata.name for n in cluster.core.list_node(label_selector="type=kwok").items]
    assert len(nodes) >= 3
    n = 3 * len(nodes)
    spread = [{"maxSkew": 2, "topologyKey": "kubernetes.io/hostname",
               "whenUnsatisfiable": "DoNotSchedule", "labelSelector": {"matchLabels": {"app": "s"}}}]
    for i in range(n):
        cluster.core.create_namespaced_pod(namespace, tiny_pod(
            f"s{i:03d}", {"app": "s"}, topologySpreadConstraints=spread,
            nodeSelector={"type": "kwok"}))
    deadline = time.monotonic() + 60
    pods = []
    while time.monotonic() < deadline:
        pods = cluster.core.list_namespaced_pod(namespace, label_selector="app=s").items
        if len(pods) == n and all(p.spec.node_name for p in pods):
            break
        time.sleep(0.2)
    per_node = {name: 0 for name in nodes}
    for p in pods:
        assert p.spec.node_name, f"{p.metadata.name} never scheduled"
        per_node[p.spec.node_name] += 1
    assert max(per_node.values()) - min(per_node.values()) <= 2, per_node


class _Webhook(http.server.BaseHTTPRequestHandler):
    # Measured here: without it every admission call stalls ~40 ms on delayed ACKs.
    disable_nagle_algorithm = True
    protocol_version = "HTTP/1.1"
    calls: list[str] = []

    def do_POST(self):  # noqa: N802 - http.server's naming
        review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        req = review["request"]
        name = req["object"]["metadata"].get("name", "")
        type(self).calls.append(name)
        allowed = not name.startswith("refuse-")
        resp = {"uid": req["uid"], "allowed": allowed}
        if not allowed:
            resp["status"] = {"code": 403, "message": "refused by the test webhook"}
        body = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                           "response": resp}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def _serving_cert(tmp: Path) -> tuple[Path, Path, bytes]:
    p = pki.generate(tmp)  # its apiserver cert carries SAN 127.0.0.1: reuse it for the server
    return p.apiserver_cert, p.apiserver_key, p.ca_cert.read_bytes()


def test_validating_webhook_by_url_is_called(cluster, namespace, tmp_path):
    import base64

    cert, key, ca = _serving_cert(tmp_path)
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Webhook)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(cert), str(key))
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    srv.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    port = srv.server_address[1]
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    _Webhook.calls = []
    cfg_name = f"testbed-proof-{namespace}"
    cluster.admissionregistration.create_validating_webhook_configuration({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": cfg_name},
        "webhooks": [{
            "name": "proof.testbed.sandman.dev",
            "clientConfig": {"url": f"https://127.0.0.1:{port}/validate",
                             "caBundle": base64.b64encode(ca).decode()},
            "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                       "resources": ["pods"]}],
            # Only this test's namespace: a leftover must never block other tests.
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
            "failurePolicy": "Fail", "sideEffects": "None", "timeoutSeconds": 5,
            "admissionReviewVersions": ["v1"]}]})
    try:
        # The API server picks the new configuration up asynchronously: retry until called.
        deadline = time.monotonic() + 30
        refused = None
        i = 0
        while time.monotonic() < deadline:
            try:
                cluster.core.create_namespaced_pod(namespace, tiny_pod(f"refuse-{i}"))
                i += 1
                time.sleep(0.2)
            except client.ApiException as e:
                refused = e
                break
        assert refused is not None, "the API server never called the webhook"
        assert refused.status == 403 and "refused by the test webhook" in refused.body
        cluster.core.create_namespaced_pod(namespace, tiny_pod("admitted"))
        assert "admitted" in _Webhook.calls and f"refuse-{i}" in _Webhook.calls
        names = {p.metadata.name for p in cluster.core.list_namespaced_pod(namespace).items}
        assert "admitted" in names and f"refuse-{i}" not in names
    finally:
        cluster.admissionregistration.delete_validating_webhook_configuration(cfg_name)
        srv.shutdown()


def test_kwok_nodes_ready_and_labelled(cluster):
    nodes = cluster.core.list_node(label_selector="type=kwok").items
    assert nodes
    zones = {n.metadata.labels["topology.kubernetes.io/zone"] for n in nodes}
    assert len(zones) == 3
    assert all(_ready(n) for n in nodes)
