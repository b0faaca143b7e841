"""Proof that the test bed's real node (testbed/realnode.py) is real: a pod runs in containerd
and runc, resolves names through CoreDNS, reaches another pod through a kube-proxy Service, is
cut off by a NetworkPolicy (kube-router), reaches the fake outside and nothing else, and the
node leaves nothing on the machine when it stops, cleanly or after a crash.

Network checks run host programs inside a pod's network namespace (`RealNode.in_pod_netns`):
the pod's IP, routes and policy treatment apply, and they need nothing in the pod's image.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

from kubernetes import client

from testbed import realnode
from testbed.cluster import Testbed

PY = sys.executable
NS_UNREACHABLE = ("No route to host", "Network is unreachable")


def pause_pod(name: str, labels: dict | None = None, real: bool = True) -> dict:
    """A pod whose one container is the pause binary of the local pause image."""
    from testbed import images

    spec = {
        "containers": [{
            "name": "c", "image": images.PAUSE_REF, "command": ["/pause"],
            "imagePullPolicy": "Never",
            "resources": {"requests": {"cpu": "10m", "memory": "16Mi"},
                          "limits": {"cpu": "10m", "memory": "16Mi"}},
            "securityContext": {"allowPrivilegeEscalation": False,
                                "capabilities": {"drop": ["ALL"]},
                                "seccompProfile": {"type": "RuntimeDefault"}},
        }],
        "terminationGracePeriodSeconds": 0,
        "automountServiceAccountToken": False,
    }
    if real:
        spec.update(realnode.placement())
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": labels or {}}, "spec": spec}


def wait_running(core: client.CoreV1Api, ns: str, name: str, timeout: float = 60) -> client.V1Pod:
    deadline = time.monotonic() + timeout
    while True:
        pod = core.read_namespaced_pod(name, ns)
        ready = any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])
        if pod.status.phase == "Running" and ready:
            return pod
        if time.monotonic() > deadline:
            ev = core.list_namespaced_event(ns, field_selector=f"involvedObject.name={name}")
            raise AssertionError(f"pod {name} not Running+Ready after {timeout}s: phase "
                                 f"{pod.status.phase}, events "
                                 f"{[(e.reason, e.message) for e in ev.items][-5:]}")
        time.sleep(0.2)


def run_pods(cluster, ns: str, *pods: dict) -> dict[str, client.V1Pod]:
    for p in pods:
        cluster.core.create_namespaced_pod(ns, p)
    return {p["metadata"]["name"]: wait_running(cluster.core, ns, p["metadata"]["name"])
            for p in pods}


def connect_code(host: str, port: int, timeout: float = 3.0, send: bytes = b"") -> str:
    """Python source that connects, prints OK <first line> or ERR <errno name> <message>."""
    return (
        "import socket,errno,sys\n"
        "try:\n"
        f"    s=socket.create_connection(({host!r},{port}),{timeout})\n"
        f"    s.sendall({send!r})\n"
        "    print('OK', s.recv(200).split(b'\\n')[0].decode(errors='replace'))\n"
        "except OSError as e:\n"
        "    print('ERR', errno.errorcode.get(e.errno, e.errno), e)\n")


def in_pod(cluster, ns: str, pod: str, code: str, timeout: float = 30) -> str:
    res = cluster.testbed.realnode.in_pod_netns(ns, pod, [PY, "-I", "-c", code], timeout=timeout)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def dns_query(name: str, qtype: int = 1) -> bytes:
    q = b"".join(bytes([len(p)]) + p.encode() for p in name.rstrip(".").split(".")) + b"\0"
    return struct.pack("!HHHHHH", 0x5A5A, 0x0100, 1, 0, 0, 0) + q + struct.pack("!HH", qtype, 1)


RESOLVE_CODE = """
import socket, struct, sys
name, server = sys.argv[1], sys.argv[2]
q = bytes.fromhex(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(3)
s.sendto(q, (server, 53))
r = s.recv(4096)
rcode, an = r[3] & 15, struct.unpack('!H', r[6:8])[0]
def skip_name(i):
    while r[i]:
        if r[i] & 0xC0 == 0xC0:
            return i + 2
        i += r[i] + 1
    return i + 1
i = skip_name(12) + 4
ips = []
for _ in range(an):
    i = skip_name(i)
    t, _c, _ttl, ln = struct.unpack('!HHIH', r[i:i + 10]); i += 10
    if t == 1: ips.append(socket.inet_ntoa(r[i:i + 4]))
    i += ln
print(rcode, ' '.join(ips))
"""


def resolve_in_pod(cluster, ns: str, pod: str, name: str, server: str = realnode.CLUSTER_DNS) -> str:
    res = cluster.testbed.realnode.in_pod_netns(
        ns, pod, [PY, "-I", "-c", RESOLVE_CODE, name, server, dns_query(name).hex()])
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


HTTP_SERVER = ("import http.server as h, socketserver as s\n"
               "class H(h.BaseHTTPRequestHandler):\n"
               "    def do_GET(self):\n"
               "        self.send_response(200); self.end_headers(); self.wfile.write(b'pod-server\\n')\n"
               "    def log_message(self, *a): pass\n"
               "s.TCPServer.allow_reuse_address = True\n"
               "srv = s.TCPServer(('0.0.0.0', 8080), H); srv.timeout = 1\n"
               "import time; end = time.time() + 120\n"
               "while time.time() < end: srv.handle_request()\n")


class PodServer:
    """An HTTP server on :8080 in a pod's network namespace (a host python, bounded to 120 s)."""

    def __init__(self, cluster, ns: str, pod: str) -> None:
        pid = cluster.testbed.realnode.pod_pid(ns, pod)
        self.proc = subprocess.Popen(["nsenter", "-t", str(pid), "-n", PY, "-I", "-c",
                                      HTTP_SERVER], start_new_session=True)
        time.sleep(0.5)

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(5)


GET = b"GET / HTTP/1.0\r\n\r\n"


# --- the node ----------------------------------------------------------------------------------

def test_node_ready_labelled_and_tainted(real_cluster):
    node = real_cluster.core.read_node(realnode.NODE_NAME)
    ready = {c.type: c.status for c in node.status.conditions}["Ready"]
    assert ready == "True"
    rn = real_cluster.testbed.realnode
    assert node.metadata.labels[realnode.LABEL_REAL_NODE] == "true"
    from sandman import contract

    assert node.metadata.labels[contract.LABEL_NODE_POOL_DEFAULT] == "sandbox"
    assert [(t.key, t.value, t.effect) for t in node.spec.taints or []] == [
        (realnode.LABEL_REAL_NODE, "true", "NoSchedule")]
    addrs = {a.type: a.address for a in node.status.addresses}
    assert addrs["InternalIP"] == rn.node_ip and not rn.node_ip.startswith("127.")
    assert node.status.node_info.kubelet_version.startswith("v1.36")
    assert "containerd://1.6" in node.status.node_info.container_runtime_version
    # The kubernetes Service points where pods can reach the API server.
    ep = real_cluster.core.read_namespaced_endpoints("kubernetes", "default")
    assert ep.subsets[0].addresses[0].ip == rn.node_ip


def test_pods_stay_on_their_kind_of_node(real_cluster, real_namespace):
    """A pod without the real node's placement never lands there (taint); one with it runs
    there for real (containerd, runc, the pause binary as its command)."""
    ns, core = real_namespace, real_cluster.core
    kwok = pause_pod("kwok-pod", real=False)
    kwok["spec"]["nodeSelector"] = {"type": "kwok"}
    pods = run_pods(real_cluster, ns, pause_pod("real-pod"), kwok)
    assert pods["real-pod"].spec.node_name == realnode.NODE_NAME
    assert pods["kwok-pod"].spec.node_name.startswith("kwok-node-")
    # Nothing but the taint keeps an unplaced pod off the real node: with only the real node
    # able to take it (kwok nodes full of a selector it lacks), it stays Pending.
    stray = pause_pod("stray", real=False)
    stray["spec"]["nodeSelector"] = {realnode.LABEL_REAL_NODE: "true"}
    core.create_namespaced_pod(ns, stray)
    time.sleep(3)
    pod = core.read_namespaced_pod("stray", ns)
    assert pod.spec.node_name is None and pod.status.phase == "Pending"
    # Really running: the container's process is the pause binary, under runc.
    rn = real_cluster.testbed.realnode
    out = rn.crictl("ps", "--namespace", f"^{ns}$", "--pod",
                    rn.crictl("pods", "--namespace", f"^{ns}$", "--name", "^real-pod$", "-q")
                    .stdout.split()[0], "-o", "json").stdout
    cid = json.loads(out)["containers"][0]["id"]
    pid = json.loads(rn.crictl("inspect", "-o", "json", cid).stdout)["info"]["pid"]
    assert Path(f"/proc/{pid}/exe").resolve().name == "pause"
    assert "Seccomp:\t2" in Path(f"/proc/{pid}/status").read_text()  # RuntimeDefault: filter


def test_task_image_resolves_with_its_own_resolver_and_logs(real_cluster, real_namespace):
    """An unmodified image (the task image, python3) runs its own command: the pod's
    resolv.conf (search path, ndots) finds the API server's Service, and its output comes back
    through the API server from the kubelet (kubectl logs)."""
    ref = real_cluster.testbed.realnode.load_images("task")[0]
    pod = pause_pod("task")
    c = pod["spec"]["containers"][0]
    c.update(image=ref, command=["python3", "-c", (
        "import socket; print('resolved', socket.gethostbyname('kubernetes.default'))")])
    c["resources"]["limits"]["memory"] = c["resources"]["requests"]["memory"] = "64Mi"
    c["resources"]["limits"]["cpu"] = c["resources"]["requests"]["cpu"] = "100m"
    pod["spec"]["restartPolicy"] = "Never"
    real_cluster.core.create_namespaced_pod(real_namespace, pod)
    deadline = time.monotonic() + 60
    while real_cluster.core.read_namespaced_pod("task", real_namespace).status.phase not in (
            "Succeeded", "Failed"):
        assert time.monotonic() < deadline, "task pod did not finish in 60 s"
        time.sleep(0.3)
    log = real_cluster.core.read_namespaced_pod_log("task", real_namespace)
    assert real_cluster.core.read_namespaced_pod("task", real_namespace).status.phase == \
        "Succeeded", log
    assert log.strip() == "resolved 10.0.0.1"


def test_missing_image_fails_on_the_machine(real_cluster, real_namespace):
    """No registry can be reached: a pull goes to containerd's dead local proxy and fails
    there, without even resolving the registry's name."""
    pod = pause_pod("nopull")
    pod["spec"]["containers"][0].update(image="registry.invalid/sandman/none:1",
                                        imagePullPolicy="IfNotPresent")
    real_cluster.core.create_namespaced_pod(real_namespace, pod)
    deadline = time.monotonic() + 60
    msgs: list[str] = []
    while time.monotonic() < deadline:
        ev = real_cluster.core.list_namespaced_event(real_namespace,
                                                     field_selector="involvedObject.name=nopull")
        msgs = [e.message or "" for e in ev.items if e.reason in ("Failed", "ErrImagePull")]
        if msgs:
            break
        time.sleep(0.5)
    assert msgs and any("127.0.0.1:9" in m for m in msgs), msgs


# --- networking --------------------------------------------------------------------------------

def test_pod_resolves_cluster_names_through_coredns(real_cluster, real_namespace):
    run_pods(real_cluster, real_namespace, pause_pod("dns"))
    rn = real_cluster.testbed.realnode
    pid = rn.pod_pid(real_namespace, "dns")
    resolv = Path(f"/proc/{pid}/root/etc/resolv.conf").read_text()
    assert f"nameserver {realnode.CLUSTER_DNS}" in resolv
    assert f"search {real_namespace}.svc.cluster.local" in resolv
    assert resolve_in_pod(real_cluster, real_namespace, "dns",
                          "kubernetes.default.svc.cluster.local") == "0 10.0.0.1"
    # Names outside the cluster go only to the fake outside's resolver; none runs now.
    rcode = resolve_in_pod(real_cluster, real_namespace, "dns", "example.com").split()[0]
    assert rcode == "2"  # SERVFAIL, at once: never the machine's resolvers
    with realnode.serve_outside("dns", ip=realnode.OUTSIDE_IP2, port=53, lifetime=30,
                                records={"api.outside.test": realnode.OUTSIDE_IP}) as dns:
        assert resolve_in_pod(real_cluster, real_namespace, "dns",
                              "api.outside.test") == f"0 {realnode.OUTSIDE_IP}"
        assert dns.hits()


def test_service_reaches_a_pod(real_cluster, real_namespace):
    ns = real_namespace
    run_pods(real_cluster, ns, pause_pod("server", {"app": "server"}), pause_pod("client"))
    real_cluster.core.create_namespaced_service(ns, {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
        "spec": {"selector": {"app": "server"},
                 "ports": [{"port": 80, "targetPort": 8080, "protocol": "TCP"}]}})
    svc_ip = real_cluster.core.read_namespaced_service("web", ns).spec.cluster_ip
    srv = PodServer(real_cluster, ns, "server")
    try:
        deadline = time.monotonic() + 30
        out = ""
        while time.monotonic() < deadline:  # kube-proxy programs the Service within a second
            out = in_pod(real_cluster, ns, "client", connect_code(svc_ip, 80, send=GET))
            if out.startswith("OK"):
                break
            time.sleep(0.5)
        assert out == "OK HTTP/1.0 200 OK", out
        name = f"web.{ns}.svc.cluster.local"
        assert resolve_in_pod(real_cluster, ns, "client", name) == f"0 {svc_ip}"
        # The API server through the `kubernetes` Service (what in-cluster clients dial).
        tls = in_pod(real_cluster, ns, "client", (
            "import socket,ssl\n"
            "c=ssl.create_default_context(); c.check_hostname=False; c.verify_mode=ssl.CERT_NONE\n"
            "s=c.wrap_socket(socket.create_connection(('10.0.0.1',443),3))\n"
            "s.sendall(b'GET /version HTTP/1.0\\r\\n\\r\\n'); print(s.recv(100).split(b'\\r\\n')[0].decode())\n"))
        assert tls.startswith("HTTP/1.0") or tls.startswith("HTTP/1.1"), tls
    finally:
        srv.stop()


def test_network_policy_denying_ingress_blocks(real_cluster, real_namespace):
    ns = real_namespace
    pods = run_pods(real_cluster, ns, pause_pod("server", {"app": "server"}), pause_pod("client"))
    ip = pods["server"].status.pod_ip
    srv = PodServer(real_cluster, ns, "server")
    try:
        # Positive control first: without a policy the client gets through.
        assert in_pod(real_cluster, ns, "client", connect_code(ip, 8080, send=GET)) == \
            "OK HTTP/1.0 200 OK"
        client.NetworkingV1Api(real_cluster.api_client).create_namespaced_network_policy(ns, {
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "deny-ingress"},
            "spec": {"podSelector": {"matchLabels": {"app": "server"}},
                     "policyTypes": ["Ingress"], "ingress": []}})
        deadline = time.monotonic() + 60
        out = ""
        while time.monotonic() < deadline:
            out = in_pod(real_cluster, ns, "client", connect_code(ip, 8080, timeout=1.5, send=GET))
            if out.startswith("ERR"):
                break
            time.sleep(0.5)
        assert out.startswith("ERR"), f"still reachable 60 s after the policy: {out}"
        # Blocked for real: the server never saw the connection.
        assert "timed out" in out or "ECONNREFUSED" in out or "EHOSTUNREACH" in out, out
    finally:
        srv.stop()


def test_the_pods_gateway_keeps_its_mac_as_pods_come_and_go(real_cluster, real_namespace):
    """The bridge's MAC is set, not taken from its ports: a bridge given none follows its
    lowest port MAC, and a pod still holding the old one in its ARP cache lost all traffic
    for ~30 s whenever another pod came or went (the egress test's probes timed out)."""
    ns = real_namespace
    sysfs = Path("/sys/class/net") / realnode.BRIDGE

    def mac() -> tuple[str, str]:
        return ((sysfs / "address").read_text().strip(),
                (sysfs / "addr_assign_type").read_text().strip())

    want = (realnode.BRIDGE_MAC, "3")  # NET_ADDR_SET: never recalculated from the ports
    assert mac() == want
    ports = {p.name for p in (sysfs / "brif").iterdir()}
    run_pods(real_cluster, ns, *(pause_pod(f"p{i}") for i in range(3)))
    assert len({p.name for p in (sysfs / "brif").iterdir()} - ports) == 3
    assert mac() == want
    core = client.CoreV1Api(real_cluster.api_client)
    for i in range(3):
        core.delete_namespaced_pod(f"p{i}", ns, grace_period_seconds=0)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and {p.name for p in (sysfs / "brif").iterdir()} - ports:
        time.sleep(0.2)
    assert not {p.name for p in (sysfs / "brif").iterdir()} - ports, "the pods' veths stayed"
    assert mac() == want


def test_egress_reaches_fake_outside_and_nothing_else(real_cluster, real_namespace):
    ns = real_namespace
    pods = run_pods(real_cluster, ns, pause_pod("egress"))
    pod_ip = pods["egress"].status.pod_ip
    with realnode.serve_outside("tcp", realnode.OUTSIDE_IP, 8080, lifetime=30) as out, \
            realnode.serve_outside("tcp", realnode.METADATA_IP, 80, lifetime=30) as meta:
        res = in_pod(real_cluster, ns, "egress", connect_code(realnode.OUTSIDE_IP, 8080))
        assert res == "OK sandman-outside", f"{res}; {out.describe()}"
        # No masquerade: the outside sees the pod's own address.
        assert [h.split(":")[0] for h in out.hits()] == [pod_ip]
        # The metadata address is the fake outside's, reached through the pods' table only.
        res = in_pod(real_cluster, ns, "egress", connect_code(realnode.METADATA_IP, 80))
        assert res == "OK sandman-outside", f"{res}; {meta.describe()}"
        assert meta.hits()
    # TEST-NET-3 (never routed): refused on this machine, at once.
    t0 = time.monotonic()
    res = in_pod(real_cluster, ns, "egress", connect_code("203.0.113.10", 443, timeout=5))
    assert res.startswith("ERR") and any(s in res for s in NS_UNREACHABLE), res
    assert time.monotonic() - t0 < 3
    # The machine's own gateway too: the pods' table has no route to the uplink at all.
    gw = in_pod(real_cluster, ns, "egress", connect_code("192.0.2.1", 53, timeout=5))
    assert gw.startswith("ERR") and any(s in gw for s in NS_UNREACHABLE), gw


# --- teardown ----------------------------------------------------------------------------------

def _machine_state(state_dir: Path) -> dict:
    def sh(cmd: str) -> str:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout

    def ours(line: str) -> bool:
        # By the program's name, never a word of its arguments (the kwok bed's kube-apiserver,
        # in another tier at the same time, passes --kubelet-...). Only the bed runs the node's
        # own programs; a containerd, ctr or shim is the bed's when it names the bed's state
        # dir (tests/images runs a containerd of its own meanwhile, under its pytest tmp dir).
        words = line.split()
        prog = os.path.basename(words[1]) if len(words) > 1 else ""
        if prog in ("kubelet", "kube-proxy", "coredns", "kube-router"):
            return True
        return prog.startswith(("containerd", "ctr")) and str(state_dir) in line

    procs = sh("ps -ww -eo stat=,args= | awk '$1 !~ /^Z/' | "
               "grep -E 'containerd|kubelet|kube-proxy|coredns|kube-router' | grep -v grep "
               "|| true")
    return {
        "ip link": sh("ip -br link | awk '{print $1}'"),
        "ip netns": sh("ip netns list"),
        "ip rule": sh("ip rule"),
        "iptables": sh("iptables-save | grep -E '^(:|-A)' | grep -E 'KUBE-|SANDMAN-RN' || true"),
        "ip6tables": sh("ip6tables-save | grep -E '^(:|-A)' | grep -E 'KUBE-|SANDMAN-RN' || true"),
        "ipset": sh("ipset list -n"),
        # Zombies are not left running; anything else of the node's programs is.
        "procs": "".join(line + "\n" for line in procs.splitlines() if ours(line)),
    }


def test_stop_and_crash_leave_nothing(real_cluster, _real_bed):
    """Stop cleanly, then start again and crash it (SIGKILL every process, pods left running),
    then `down` from a fresh process's view: nothing of the node is left either time."""
    tb: Testbed = real_cluster.testbed
    state_dir = tb.state_dir
    t0 = time.monotonic()
    _real_bed.stop()  # raises if anything was left
    stop_s = time.monotonic() - t0
    assert realnode.leftovers() == []
    st = _machine_state(state_dir)
    assert not st["iptables"] and not st["ip6tables"] and not st["procs"], st
    assert realnode.OUTSIDE_NETNS not in st["ip netns"] and realnode.BRIDGE not in st["ip link"]
    assert not [m for m in Path("/proc/self/mountinfo").read_text().splitlines()
                if str(state_dir) in m]

    cluster = _real_bed.get(_FigureSink())
    ns = cluster.new_namespace("crash")
    run_pods(cluster, ns, pause_pod("victim"))
    tb = cluster.testbed
    for c in tb.components:  # a crash of everything the test bed started; pods and shims stay
        os.kill(c.pid, signal.SIGKILL)
    for c in tb.components:
        c.proc.wait(10)  # reaped, as init would after a real crash of this process
    _real_bed.forget()
    attached = Testbed.attach(tb.state_dir)  # what `make testbed-down` does
    attached.stop()
    assert realnode.leftovers() == []
    st2 = _machine_state(tb.state_dir)
    assert not st2["iptables"] and not st2["procs"], st2
    assert not [m for m in Path("/proc/self/mountinfo").read_text().splitlines()
                if str(tb.state_dir) in m]
    print(f"real node stop {stop_s:.1f}s")


class _FigureSink:
    def add(self, line: str) -> None:
        pass
