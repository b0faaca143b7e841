"""A second real node beside the test bed's first (testbed/realnode.py), as a second machine.

`SecondNode(tb).start()` on a bed that runs a real node adds `sandman-real-1`: its own
containerd (root, state, socket), kubelet (root dir, cert dir, pod logs, cgroup root
`/sandman-real-1`), kube-proxy and kube-router, all in their own network namespace
`sandman-real-1`, as on a second machine. The two nodes are routed to each other over one veth
(`sm-n1h` on the host, `sm-n1n` in the namespace), the way two machines are routed over their
uplinks; pods on each node reach pods on the other without masquerade, and the cluster's
Services, DNS and API server through the first node, where they run.

Why a network namespace: two kubelets, kube-proxies and kube-routers in one namespace would
each rewrite the same iptables chains and ipsets (kube-router keeps the chains of its own
node's pods only), so NetworkPolicy would hold on one node at a time. In its own namespace each
node's rules are its own, and traffic between the nodes crosses a routed link, as it does
between machines.

Containment, the workplace's rule: the second node's namespace routes everything to the first
(its default route), where the pods' policy-routing table decides: pods of either node, the
fake outside, `unreachable` for the rest. The host's rules that send the second node's traffic
there (from its pod CIDR, in from its link, to its pod CIDR and node IP) are added before any of
its processes starts, and the guard chain lets its link reach only the pods' bridge and the
fake outside.

`kill()` is a node lost: its kubelet, containerd, proxies and containers SIGKILLed, nothing
else touched (the Node object and the pods stay, as on a machine that died). `stop()` removes
the node: pods, processes, cgroups, mounts, namespace, rules and its Node object. A crash is
cleaned up by `realnode.cleanup()`, which finds this node by its fixed names.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING

from sandman import contract
from testbed import build, pki, realnode
from testbed.procs import Proc
from testbed.realnode import (
    GUARD_CHAIN,
    LABEL_REAL_NODE,
    OUT_LINK,
    OUTSIDE_NETNS,
    ROUTE_TABLE,
    TRANSIT_HOST,
    RealNode,
    RealNodeError,
    _ip_json,
    _kill_and_wait,
    _link_exists,
    _netns_names,
    _quiet,
    _sh,
)

if TYPE_CHECKING:
    from testbed.cluster import Testbed

# Fixed names (realnode.cleanup() finds them after a crash without any record).
NAME = "sandman-real-1"
NETNS = "sandman-real-1"
LINK, PEER = "sm-n1h", "sm-n1n"  # host side, node side
BRIDGE = "sm-cni1"  # inside NETNS
BRIDGE_MAC = "02:53:4d:00:00:02"  # fixed, as the first node's (realnode.BRIDGE_MAC says why)
CGROUP = "sandman-real-1"  # kubelet's cgroupRoot: pods under /sandman-real-1/kubepods
CNI_NETWORK = f"{realnode.CNI_NETWORK}-1"
# The host's rules into the pods' table: from its pod CIDR, in from its link, to its pod CIDR,
# to its node IP (the API server reaches its kubelet there).
RULE_PRIORITIES = (7416, 7417, 7418, 7419)
ZONE = "zone-real-1"
# Nothing else listens in NETNS: the components' usual ports.
PORTS = {"kubelet": 10250, "kube-proxy-healthz": 10256, "kube-proxy-metrics": 10249}
COMPONENTS = ("containerd", "kubelet", "kube-proxy", "kube-router")


def _in_netns(argv: list[str]) -> list[str]:
    # nsenter --net switches only the network namespace: the mounts (cgroups under /sys) stay
    # the machine's, which `ip netns exec` would replace with a fresh sysfs.
    return ["nsenter", f"--net=/run/netns/{NETNS}", "--", *argv]


def _guard_rules() -> list[list[str]]:
    """The host guard's rules for the link: pods and the fake outside, nothing else."""
    g, b = GUARD_CHAIN, realnode.BRIDGE
    return [["-i", b, "-o", LINK, "-j", "RETURN"], ["-i", LINK, "-o", b, "-j", "RETURN"],
            ["-i", LINK, "-o", OUT_LINK, "-j", "RETURN"], ["-i", OUT_LINK, "-o", LINK, "-j", "RETURN"],
            ["-i", LINK, "-m", "comment", "--comment", f"{g}: the second node reaches only "
             "pods and the fake outside", "-j", "DROP"],
            ["-o", LINK, "-m", "comment", "--comment", f"{g}: nothing else is forwarded to "
             "the second node", "-j", "DROP"]]


def network_down(pod_cidr: str | None = None) -> None:
    """Remove the second node's network from the machine (idempotent; after a crash too)."""
    for prio in RULE_PRIORITIES:
        while _quiet(["ip", "rule", "del", "priority", str(prio)]) == 0:
            pass
    for r in _ip_json("route", "show", "table", str(ROUTE_TABLE)):
        if r.get("dev") == LINK:
            _quiet(["ip", "route", "del", r["dst"], "table", str(ROUTE_TABLE)])
    if pod_cidr and OUTSIDE_NETNS in _netns_names():
        _quiet(["ip", "-n", OUTSIDE_NETNS, "route", "del", pod_cidr])
    for rule in _guard_rules():
        while _quiet(["iptables", "-t", "mangle", "-D", GUARD_CHAIN, *rule]) == 0:
            pass
    if NETNS in _netns_names():
        res = subprocess.run(["ip", "netns", "pids", NETNS], capture_output=True, text=True)
        _kill_and_wait([int(p) for p in res.stdout.split()])
        _quiet(["ip", "netns", "del", NETNS])
    if _link_exists(LINK):
        _quiet(["ip", "link", "del", LINK])


def leftovers() -> list[str]:
    found = [f"link {LINK}"] if _link_exists(LINK) else []
    if NETNS in _netns_names():
        found.append(f"netns {NETNS}")
    found += [f"ip rule {r}" for r in _ip_json("rule") if r.get("priority") in RULE_PRIORITIES]
    found += [f"cgroup {m / CGROUP}" for m in realnode._cgroup_mounts() if (m / CGROUP).is_dir()]
    return found


class SecondNode(RealNode):
    """The second real node of a Testbed that runs one (`tb.realnode`). Not one of the bed's
    components: it may be killed on purpose (`kill()`) while the bed goes on."""

    name = NAME
    bridge = BRIDGE
    cni_network = CNI_NETWORK
    cgroup_root = f"/{CGROUP}"

    def __init__(self, tb: Testbed, tainted: bool | None = None) -> None:
        first = tb.realnode
        if first is None or not first.node_ip:
            raise RealNodeError("second node: the test bed runs no real node")
        super().__init__(tb, owner_pid=first.owner_pid)
        self.first = first
        self.dir = tb.state_dir / "realnode-1"
        # Like the first node's taint unless told: testbed/install.py lifts the first's while
        # sandman is installed, and a second node then joins untainted.
        self.tainted = tainted
        self.procs: dict[str, Proc] = {}
        self.ports = dict(PORTS)

    def taints(self) -> list[dict]:
        if self.tainted is None:
            return super().taints()
        return [dict(realnode.TAINT)] if self.tainted else []

    # Addresses: the first node's next /24 of pods and its node IP + 1 --------------------
    def _pick_addresses(self) -> None:
        net = ipaddress.ip_network(self.first.pod_cidr)
        cidr = str(ipaddress.ip_network((int(net.network_address) + net.num_addresses,
                                         net.prefixlen)))
        ip = str(ipaddress.ip_address(self.first.node_ip) + 1)
        clash = realnode.overlaps_on_machine([cidr, f"{ip}/32"])
        if clash:
            raise RealNodeError(f"second node: {cidr} or {ip} overlaps the machine: {clash[:3]}")
        self.pod_cidr, self.node_ip = cidr, ip

    def _network_up(self) -> None:
        t, host_ip = str(ROUTE_TABLE), self.first.node_ip
        plen = ipaddress.ip_network(self.pod_cidr).prefixlen
        ns = ["ip", "-n", NETNS]
        steps = [
            ["ip", "netns", "add", NETNS],
            ["ip", "link", "add", LINK, "type", "veth", "peer", "name", PEER, "netns", NETNS],
            ["ip", "link", "set", LINK, "up"],
            [*ns, "link", "set", "lo", "up"],
            [*ns, "addr", "add", f"{self.node_ip}/32", "dev", PEER],
            [*ns, "link", "set", PEER, "up"],
            [*ns, "route", "add", f"{host_ip}/32", "dev", PEER, "src", self.node_ip],
            # Everything else goes to the first node, whose pods' table decides.
            [*ns, "route", "add", "default", "via", host_ip, "dev", PEER, "src", self.node_ip],
            [*ns, "link", "add", BRIDGE, "address", BRIDGE_MAC, "type", "bridge"],
            [*ns, "addr", "add", f"{self.gateway}/{plen}", "dev", BRIDGE],
            [*ns, "link", "set", BRIDGE, "up"],
            # The host side: the pods' table knows the second node and its pods ...
            ["ip", "route", "add", f"{self.node_ip}/32", "dev", LINK, "src", host_ip, "table", t],
            ["ip", "route", "add", self.pod_cidr, "via", self.node_ip, "dev", LINK, "onlink",
             "src", host_ip, "table", t],
            ["ip", "-n", OUTSIDE_NETNS, "route", "replace", self.pod_cidr, "via", TRANSIT_HOST],
            # ... and all of its traffic, and the host's to it, is routed by that table.
            ["ip", "rule", "add", "from", self.pod_cidr, "lookup", t,
             "priority", str(RULE_PRIORITIES[0])],
            ["ip", "rule", "add", "iif", LINK, "lookup", t, "priority", str(RULE_PRIORITIES[1])],
            ["ip", "rule", "add", "to", self.pod_cidr, "lookup", t,
             "priority", str(RULE_PRIORITIES[2])],
            ["ip", "rule", "add", "to", f"{self.node_ip}/32", "lookup", t,
             "priority", str(RULE_PRIORITIES[3])],
        ]
        for cmd in steps:
            _sh(cmd, "second node network")
        guard = _guard_rules()
        for i, rule in enumerate(guard[:4], start=1):  # before the first node's DROPs
            _sh(["iptables", "-t", "mangle", "-I", GUARD_CHAIN, str(i), *rule], "second node guard")
        for rule in guard[4:]:
            _sh(["iptables", "-t", "mangle", "-A", GUARD_CHAIN, *rule], "second node guard")
        # Per-namespace: forwarding for its pods, bridged pod traffic through iptables (kube-
        # proxy and kube-router need it), no IPv6 on the bridge.
        for key, value in (("net.ipv4.ip_forward", "1"), ("net.bridge.bridge-nf-call-iptables", "1"),
                           (f"net.ipv6.conf.{BRIDGE}.disable_ipv6", "1")):
            _sh(_in_netns(["sysctl", "-qw", f"{key}={value}"]), "second node sysctl")
        self._check_containment()

    def _check_containment(self) -> None:
        """Ask the kernel where the second node's pod traffic would go before any pod exists."""
        src = str(ipaddress.ip_network(self.pod_cidr)[5])
        peer = str(ipaddress.ip_network(self.first.pod_cidr)[5])
        for dst, want in ((realnode.OUTSIDE_IP, f"dev {OUT_LINK}"),
                          (peer, f"dev {realnode.BRIDGE}"),
                          ("203.0.113.7", None), ("192.0.2.1", None)):
            res = _sh(["ip", "route", "get", dst, "from", src, "iif", LINK],
                      "second node routing", check=False)
            got = (res.stdout + res.stderr).strip()
            refused = res.returncode != 0 or "unreachable" in got
            if (want is None and not refused) or (want is not None and want not in got):
                raise RealNodeError(f"second node routing: its pods' traffic to {dst} would not "
                                    f"go {want or 'nowhere'}: {got}")

    # Start --------------------------------------------------------------------------------
    def start(self, timeout: float = 120.0) -> SecondNode:
        t0 = time.monotonic()
        self.bins = self.first.bins or build.realnode_binaries()
        self.dir.mkdir(parents=True, exist_ok=True)
        if leftovers():  # a second node of an earlier start that was never removed
            self.stop()
        try:
            for m in realnode._cgroup_mounts():  # kubelet refuses a cgroupRoot that is missing
                d = m / CGROUP
                d.mkdir(exist_ok=True)
                for f in ("cpuset.cpus", "cpuset.mems"):  # an empty cpuset holds no task
                    if (m / f).exists() and not (d / f).read_text().strip():
                        (d / f).write_text((m / f).read_text())
            self._pick_addresses()
            self._network_up()
            self.timings["network"] = time.monotonic() - t0
            self._start_components(timeout)
        except BaseException:
            with contextlib.suppress(Exception):
                self.stop()
            raise
        self.timings["start"] = time.monotonic() - t0
        return self

    def _start_components(self, timeout: float) -> None:
        t0 = time.monotonic()
        p = self.tb.pki
        kc_kubelet = self._kubeconfig("kubelet", pki.client_cert(
            p, f"kubelet-{NAME}", f"system:node:{NAME}", "system:nodes"))
        kc_proxy = self._kubeconfig("kube-proxy", pki.client_cert(p, "kube-proxy",
                                                                  "system:kube-proxy"))
        kc_admin = self._kubeconfig("admin", None)
        env = {k: realnode.DEAD_PROXY for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy",
                                                 "https_proxy")}
        env.update(NO_PROXY=realnode.NO_PROXY, no_proxy=realnode.NO_PROXY)
        self._spawn("containerd", ["containerd", "--config", str(self._containerd_config())],
                    env=env)
        self._until(lambda: self.crictl("info", timeout=10).returncode == 0, 30, "containerd",
                    "serving CRI")
        # What the first node holds, this one holds too: a pod may land on either.
        self.load_images(*self.first.image_names)
        self.timings["images"] = time.monotonic() - t0
        self._spawn("kubelet", [
            str(self.bins["kubelet"]), f"--config={self._kubelet_config()}",
            f"--kubeconfig={kc_kubelet}", f"--root-dir={self.dir / 'kubelet'}",
            f"--cert-dir={self.dir / 'kubelet-pki'}",
            f"--hostname-override={NAME}", f"--node-ip={self.node_ip}",
            f"--node-labels={LABEL_REAL_NODE}=true,{contract.LABEL_NODE_POOL_DEFAULT}"
            f"=sandbox,type=real,topology.kubernetes.io/zone={ZONE}", "--v=1"])
        self._spawn("kube-proxy", [str(self.bins["kube-proxy"]),
                                   f"--config={self._kube_proxy_config(kc_proxy)}", "--v=1"])
        self._until(self._node_ready, timeout, "kubelet", f"node {NAME} Ready")
        self.timings["node-ready"] = time.monotonic() - t0
        self._spawn("kube-router", self.kube_router_cmd(kc_admin))
        self._until(lambda: self.http_ok(
            f"http://{self.node_ip}:{self.ports['kube-proxy-healthz']}/healthz"), 60,
            "kube-proxy", "/healthz ok (rules synced)")
        self._until(self._router_synced, 60, "kube-router", "NetworkPolicy chains synced")

    def _router_synced(self) -> bool:
        res = subprocess.run(_in_netns(["iptables", "-S", "KUBE-ROUTER-FORWARD"]),
                             capture_output=True, text=True)
        log = self.procs["kube-router"].log
        return res.returncode == 0 and "sync iptables took" in log.read_text(errors="replace")

    def _spawn(self, name: str, cmd: list[str], env: dict | None = None) -> Proc:
        proc = Proc(f"{name}-1", _in_netns(cmd), self.tb.logs / f"{name}-1.log",
                    cwd=self.tb.state_dir, env=env).start()
        self.procs[name] = proc
        return proc

    def _until(self, ready, timeout: float, comp: str, what: str) -> None:
        self.tb._wait(self.procs[comp], ready, timeout, what, watch=list(self.procs.values()))

    def http_ok(self, url: str) -> bool:
        """GET `url` from inside the node's namespace (its proxies listen there only)."""
        code = ("import sys, urllib.request as u\n"
                "sys.exit(0 if u.urlopen(sys.argv[1], timeout=2).status == 200 else 1)\n")
        return subprocess.run(_in_netns([sys.executable, "-I", "-c", code, url]),
                              capture_output=True, timeout=10).returncode == 0

    # A node lost, and a node removed ------------------------------------------------------
    def pids(self) -> list[int]:
        """Its processes: components, shims and every container's."""
        own = realnode._processes_of({"dir": f"{self.dir}/"})
        return sorted(set(own) | set(self._container_pids()))

    def _container_pids(self) -> list[int]:
        out: list[int] = []
        for m in realnode._cgroup_mounts():
            if (m / CGROUP).is_dir():
                out += realnode._cgroup_pids(m / CGROUP)
        return out

    def kill(self) -> list[int]:
        """The node lost: SIGKILL to its kubelet, containerd, proxies, shims and containers at
        once (the machine died); the Node object, its pods and its network stay. Returns the
        PIDs killed."""
        pids = self.pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _kill_and_wait(pids, timeout=10)
        for proc in self.procs.values():
            with contextlib.suppress(Exception):
                proc.wait(5)
        return pids

    def stop(self, timeout: float = 20.0) -> list[str]:
        """Remove the node from the bed and the machine; return leftovers (empty: clean)."""
        t0 = time.monotonic()
        for name in ("kube-router", "kube-proxy", "kubelet"):
            if name in self.procs:
                self.procs[name].stop(timeout)
        ctd = self.procs.get("containerd")
        self.remove_pods(ctd)
        if ctd is not None:
            ctd.stop(timeout)
        sockets = realnode._shim_sockets(self.pids())
        for _ in range(5):
            pids = self.pids()
            if not pids:
                break
            _kill_and_wait(pids, timeout=5)
        for s in sockets:
            with contextlib.suppress(OSError):
                s.unlink()
        realnode.unmount_all_under(self.dir)
        deadline = time.monotonic() + 15
        while any((m / CGROUP).is_dir() for m in realnode._cgroup_mounts()):
            for m in realnode._cgroup_mounts():
                if (m / CGROUP).is_dir():
                    _kill_and_wait(realnode._cgroup_pids(m / CGROUP), timeout=2)
                    realnode._rmdir_tree(m / CGROUP)
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        network_down(self.pod_cidr)
        self.delete_node()
        self.timings["stop"] = time.monotonic() - t0
        left = leftovers() + [f"process {p}" for p in self.pids()]
        left += [f"mount {m}" for m in realnode._mounts_under(self.dir)]
        return left

    def delete_node(self) -> None:
        import urllib.error

        with contextlib.suppress(urllib.error.HTTPError):
            self.tb.request("DELETE", f"/api/v1/nodes/{NAME}")

    # Looking into pods --------------------------------------------------------------------
    def status(self) -> list[tuple[str, bool, str]]:
        ok = False
        with contextlib.suppress(Exception):
            ok = self._node_ready()
        return [(f"node {NAME}", ok, f"{self.node_ip}, pods {self.pod_cidr}, netns {NETNS}")]
