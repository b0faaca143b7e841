"""Proof that the test bed's second real node (testbed/secondnode.py) is a second machine: its
own kubelet, containerd and proxies in their own network namespace and cgroup root; pods on the
two nodes reach each other routed, without masquerade, and reach Services, DNS and the fake
outside and nothing else; its NetworkPolicy engine guards its own pods; and once removed, killed
first or not, nothing of it is left on the machine or in the cluster.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from kubernetes import client

from testbed import realnode, secondnode
from tests.testbed.test_realnode import (
    GET,
    NS_UNREACHABLE,
    PY,
    RESOLVE_CODE,
    connect_code,
    dns_query,
    pause_pod,
    wait_running,
)

FIRST, SECOND = realnode.NODE_NAME, secondnode.NAME
HOSTNAME = "kubernetes.io/hostname"

# Answers each connection with the peer's address: what the server saw (no masquerade).
PEER_SERVER = ("import socket, time\n"
               "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
               "s.bind(('0.0.0.0', 8080)); s.listen(8); s.settimeout(1)\n"
               "end = time.time() + 120\n"
               "while time.time() < end:\n"
               "    try:\n"
               "        c, a = s.accept()\n"
               "    except OSError:\n"
               "        continue\n"
               "    c.sendall(('peer ' + a[0] + '\\n').encode()); c.close()\n")


@pytest.fixture(scope="module")
def second(_real_bed, figures):
    """The second node on the session's real-node bed, removed after the module (asserting
    nothing of it is left)."""
    cluster = _real_bed.get(figures)
    node = secondnode.SecondNode(cluster.testbed)
    t0 = time.monotonic()
    node.start()
    figures.add(f"second node: up in {time.monotonic() - t0:.1f}s "
                f"({', '.join(f'{k} {v:.1f}s' for k, v in node.timings.items())})")
    try:
        yield node
    finally:
        left = node.stop()
        assert left == [], f"the second node left: {left}"
        assert secondnode.leftovers() == []


def pod_on(node: str, name: str, labels: dict | None = None) -> dict:
    """test_realnode's pause pod, on the named node."""
    pod = pause_pod(name, labels)
    pod["spec"]["nodeSelector"][HOSTNAME] = node
    return pod


def run(cluster, ns: str, *pods: dict) -> dict[str, client.V1Pod]:
    for p in pods:
        cluster.core.create_namespaced_pod(ns, p)
    return {p["metadata"]["name"]: wait_running(cluster.core, ns, p["metadata"]["name"], 90)
            for p in pods}


def in_pod(node, ns: str, pod: str, code: str) -> str:
    res = node.in_pod_netns(ns, pod, [PY, "-I", "-c", code], timeout=30)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


class PeerServer:
    def __init__(self, node, ns: str, pod: str) -> None:
        pid = node.pod_pid(ns, pod)
        self.proc = subprocess.Popen(["nsenter", "-t", str(pid), "-n", PY, "-I", "-c",
                                      PEER_SERVER], start_new_session=True)
        time.sleep(0.5)

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(5)


def _netns_inode(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def test_second_node_is_its_own_machine(real_cluster, second):
    node = real_cluster.core.read_node(SECOND)
    assert any(c.type == "Ready" and c.status == "True" for c in node.status.conditions)
    assert node.metadata.labels[realnode.LABEL_REAL_NODE] == "true"
    assert node.metadata.labels["topology.kubernetes.io/zone"] == secondnode.ZONE
    addrs = {a.type: a.address for a in node.status.addresses}
    assert addrs["InternalIP"] == second.node_ip != real_cluster.testbed.realnode.node_ip
    # Its processes live in its own network namespace; the first node's in the machine's.
    ns_ino = os.stat(f"/run/netns/{secondnode.NETNS}").st_ino
    for name in secondnode.COMPONENTS:
        assert _netns_inode(second.procs[name].pid) == ns_ino, name
    assert _netns_inode(os.getpid()) != ns_ino
    # Its state is its own: a socket, a root dir, a cgroup root.
    assert second.sock != real_cluster.testbed.realnode.sock and second.sock.exists()
    assert any((m / secondnode.CGROUP / "kubepods").is_dir() for m in realnode._cgroup_mounts())


def test_pods_on_the_two_nodes_reach_each_other_routed(real_cluster, real_namespace, second):
    ns, first = real_namespace, real_cluster.testbed.realnode
    pods = run(real_cluster, ns, pod_on(FIRST, "a", {"app": "a"}), pod_on(SECOND, "b", {"app": "b"}))
    assert pods["a"].spec.node_name == FIRST and pods["b"].spec.node_name == SECOND
    ip_a, ip_b = pods["a"].status.pod_ip, pods["b"].status.pod_ip
    assert ipaddress.ip_address(ip_b) in ipaddress.ip_network(second.pod_cidr)
    srv_b, srv_a = PeerServer(second, ns, "b"), PeerServer(first, ns, "a")
    try:
        # Each way, and each server sees the other pod's own address: routed, not masqueraded.
        assert in_pod(first, ns, "a", connect_code(ip_b, 8080)) == f"OK peer {ip_a}"
        assert in_pod(second, ns, "b", connect_code(ip_a, 8080)) == f"OK peer {ip_b}"
        # A Service from the second node to a pod on the first: its own kube-proxy translates.
        real_cluster.core.create_namespaced_service(ns, {
            "apiVersion": "v1", "kind": "Service", "metadata": {"name": "web-a"},
            "spec": {"selector": {"app": "a"},
                     "ports": [{"port": 80, "targetPort": 8080, "protocol": "TCP"}]}})
        svc_ip = real_cluster.core.read_namespaced_service("web-a", ns).spec.cluster_ip
        deadline, out = time.monotonic() + 30, ""
        while time.monotonic() < deadline:
            out = in_pod(second, ns, "b", connect_code(svc_ip, 80))
            if out.startswith("OK"):
                break
            time.sleep(0.5)
        assert out == f"OK peer {ip_b}", out
        # Cluster DNS (CoreDNS runs on the first node) from the second.
        name = f"web-a.{ns}.svc.{realnode.CLUSTER_DOMAIN}"
        res = second.in_pod_netns(ns, "b", [PY, "-I", "-c", RESOLVE_CODE, name,
                                            realnode.CLUSTER_DNS, dns_query(name).hex()])
        assert res.stdout.strip() == f"0 {svc_ip}", res.stdout + res.stderr
    finally:
        srv_a.stop()
        srv_b.stop()


def test_second_node_pods_reach_the_fake_outside_and_nothing_else(real_cluster, real_namespace,
                                                                  second):
    ns = real_namespace
    pod_ip = run(real_cluster, ns, pod_on(SECOND, "egress"))["egress"].status.pod_ip
    with realnode.serve_outside("tcp", realnode.OUTSIDE_IP, 8080, lifetime=30) as out:
        res = in_pod(second, ns, "egress", connect_code(realnode.OUTSIDE_IP, 8080))
        assert res == "OK sandman-outside", f"{res}; {out.describe()}"
        assert [h.split(":")[0] for h in out.hits()] == [pod_ip]
    for dst in ("203.0.113.10", "192.0.2.1"):
        t0 = time.monotonic()
        res = in_pod(second, ns, "egress", connect_code(dst, 443, timeout=5))
        assert res.startswith("ERR") and any(s in res for s in NS_UNREACHABLE), (dst, res)
        assert time.monotonic() - t0 < 3, f"{dst}: not refused locally"
    # The second node's own namespace is contained the same way (its kubelet, its proxies).
    res = subprocess.run(["nsenter", f"--net=/run/netns/{secondnode.NETNS}", PY, "-I", "-c",
                          connect_code("203.0.113.10", 443, timeout=5)],
                         capture_output=True, text=True, timeout=30)
    assert any(s in res.stdout for s in NS_UNREACHABLE), res.stdout + res.stderr


def test_network_policy_guards_the_second_nodes_pods(real_cluster, real_namespace, second):
    """kube-router on the second node keeps its own pods' chains: ingress to a pod there is
    cut for a client on the first node (across the nodes' link)."""
    ns, first = real_namespace, real_cluster.testbed.realnode
    pods = run(real_cluster, ns, pod_on(FIRST, "client"), pod_on(SECOND, "server", {"app": "s"}))
    ip = pods["server"].status.pod_ip
    srv = PeerServer(second, ns, "server")
    try:
        assert in_pod(first, ns, "client", connect_code(ip, 8080)).startswith("OK")
        client.NetworkingV1Api(real_cluster.api_client).create_namespaced_network_policy(ns, {
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "deny-ingress"},
            "spec": {"podSelector": {"matchLabels": {"app": "s"}}, "policyTypes": ["Ingress"],
                     "ingress": []}})
        deadline, out = time.monotonic() + 60, ""
        while time.monotonic() < deadline:
            out = in_pod(first, ns, "client", connect_code(ip, 8080, timeout=1.5, send=GET))
            if out.startswith("ERR"):
                break
            time.sleep(0.5)
        assert out.startswith("ERR") and ("timed out" in out or "ECONNREFUSED" in out), out
    finally:
        srv.stop()


def test_a_killed_second_node_is_removed_without_a_trace(real_cluster, real_namespace, second):
    """Last of the module fixture's tests: killed (every process SIGKILLed, its pod running), then removed:
    nothing of it stays on the machine, its Node object is gone, and the first node still
    runs pods."""
    ns = real_namespace
    run(real_cluster, ns, pod_on(SECOND, "victim"))
    killed = second.kill()
    assert killed and not second.pids()
    left = second.stop()
    assert left == [] and secondnode.leftovers() == [], left
    with pytest.raises(client.ApiException) as e:
        real_cluster.core.read_node(SECOND)
    assert e.value.status == 404
    assert not [m for m in Path("/proc/self/mountinfo").read_text().splitlines()
                if str(second.dir) in m]
    # Its pod's node is gone: nothing will ever confirm its end, so it goes by force.
    real_cluster.core.delete_namespaced_pod("victim", ns, grace_period_seconds=0)
    run(real_cluster, ns, pod_on(FIRST, "after"))


def test_a_second_node_left_behind_is_removed_by_the_next_start(real_cluster, real_namespace):
    """A node killed and never removed (its namespace, link, rules, cgroups and pods left, as
    after a crashed test): the next start removes all of it first, then runs."""
    ns = real_namespace
    old = secondnode.SecondNode(real_cluster.testbed).start()
    run(real_cluster, ns, pod_on(SECOND, "left"))
    old.kill()
    assert secondnode.leftovers()
    new = secondnode.SecondNode(real_cluster.testbed).start()
    try:
        assert real_cluster.core.read_node(SECOND).metadata.uid  # registered anew
        run(real_cluster, ns, pod_on(SECOND, "again"))
    finally:
        left = new.stop()
    assert left == [] and secondnode.leftovers() == [], left
