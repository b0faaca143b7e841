"""The test bed's real node: one kubelet that runs real containers beside the kwok nodes.

`Testbed(state_dir, real_node=True).start()` (or `make testbed-up REAL_NODE=1`) adds, on this
machine, as plain processes with all state under `<state_dir>/realnode/`:

- containerd (Debian's 1.6.20) + runc, own root/state/socket, pods in a bridge CNI network;
- kubelet and kube-proxy (iptables mode) built from the same k8s.io/kubernetes as the control
  plane; CoreDNS (cluster DNS, a host process on the node IP); kube-router as the NetworkPolicy
  engine only (`--run-firewall`);
- a fake "outside": the network namespace `sandman-outside` holding 198.18.0.1, 198.18.0.2 and
  169.254.169.254, the only place pod traffic may go besides other pods and the node.

Containment (the workplace's rule: no pod packet leaves the machine): pod traffic is routed by
its own policy-routing table (from the pod CIDR, or in from the bridge) that holds only the pod
CIDR, the fake outside and `unreachable default`; the CNI does not masquerade; a mangle/FORWARD
guard drops anything from the bridge that is not going to a pod or to the fake outside; the
main table and the default route are never touched.

Everything the node creates on the machine has a fixed name (links, netns, table, rule
priorities, chain) so `cleanup()` finds it after a crash without any record; what has to be
restored (sysctls the components change, ipsets that existed before) is recorded in
/run/sandman-testbed/realnode.json *before* anything is changed.

Every failure raises RealNodeError (a TestbedError): one line naming the component and its log.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from sandman import contract
from testbed import build, pki
from testbed.cluster import TestbedError  # cluster imports this module lazily: no cycle

if TYPE_CHECKING:
    from testbed.cluster import Testbed
    from testbed.procs import Proc

NODE_NAME = "sandman-real-0"
# The one label (value "true") and taint that mark the real node. Beside kwok nodes it is tainted
# NoSchedule: pods made for kwok nodes never land on it; a pod meant to run for real carries
# `placement()`. In a bed without kwok nodes (Testbed(nodes=0)) it is not tainted.
LABEL_REAL_NODE = f"{contract.DOMAIN}/testbed-real-node"
TAINT = {"key": LABEL_REAL_NODE, "value": "true", "effect": "NoSchedule"}
TOLERATION = {"key": LABEL_REAL_NODE, "operator": "Equal", "value": "true", "effect": "NoSchedule"}

# Fixed names of what the node creates on the machine (cleanup finds them without a record).
BRIDGE = "sm-cni0"
# The pods' gateway MAC, set once (locally administered). A bridge given none takes the lowest
# MAC of its ports and changes it as pods come and go; a pod whose ARP entry still names the old
# one sends frames the bridge switches instead of routing, and reaches nothing for ~30 s.
BRIDGE_MAC = "02:53:4d:00:00:01"
NODE_LINK, NODE_PEER = "sm-node0", "sm-node1"  # a veth holds the node IP: no dummy driver here
OUT_LINK, OUT_PEER = "sm-out0", "sm-out1"  # host <-> fake outside
OUTSIDE_NETNS = "sandman-outside"
GUARD_CHAIN = "SANDMAN-RN-GUARD"
ROUTE_TABLE = 7413
# 7413: from the pod CIDR; 7414: in from the bridge (whatever the source); 7415: the host's own
# traffic to the fake outside, so even a host process never sends 198.18/15 to the uplink.
RULE_PRIORITIES = (7413, 7414, 7415)
CNI_NETWORK = "sandman-realnode"

OUTSIDE_IP = "198.18.0.1"
OUTSIDE_IP2 = "198.18.0.2"  # also the fake outside's resolver: CoreDNS's only `forward`
METADATA_IP = "169.254.169.254"
OUTSIDE_NET = "198.18.0.0/15"
TRANSIT_HOST, TRANSIT_OUTSIDE = "198.19.255.1", "198.19.255.2"  # /30 on the veth pair
UNROUTED_TEST_NET = "203.0.113.0/24"  # TEST-NET-3: pods get "unreachable" locally
CLUSTER_DNS = "10.0.0.10"
CLUSTER_DOMAIN = "cluster.local"
# (pod CIDR, node IP): the first pair that overlaps nothing on the machine is used.
ADDRESS_PLANS = (("10.244.0.0/24", "10.245.0.1"), ("10.246.0.0/24", "10.247.0.1"),
                 ("172.30.244.0/24", "172.30.245.1"))
# Never pulled: no registry is reachable, and containerd's registry traffic is sent to a proxy
# on a dead local port, so a missing image fails at once instead of resolving a registry name.
# The one exception is 127.0.0.1 (NO_PROXY): the optional local registry of testbed/registry.py,
# which a test starts and which containerd reaches through its certs.d entry.
DEAD_PROXY = "http://127.0.0.1:9"
NO_PROXY = "127.0.0.1"

MACHINE_RECORD = Path(os.environ.get("SANDMAN_REALNODE_RECORD", "/run/sandman-testbed/realnode.json"))
# Sysctls the node's components change (kubelet's kernel tunables, forwarding for the fake
# outside); restored from the machine record on the way down.
SYSCTLS = (
    "net/ipv4/ip_forward", "net/ipv4/conf/all/route_localnet",
    "net/bridge/bridge-nf-call-iptables", "net/bridge/bridge-nf-call-ip6tables",
    "vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes",
    "net/netfilter/nf_conntrack_max", "net/netfilter/nf_conntrack_tcp_timeout_established",
    "net/netfilter/nf_conntrack_tcp_timeout_close_wait",
)
REAL_COMPONENTS = ("containerd", "kubelet", "kube-proxy", "coredns", "kube-router")
# Paths the components create outside the state dir whatever they are told (kubelet's device
# plugin socket is hard-coded under /var/lib/kubelet, its log links under /var/log/containers,
# containerd's CNI result cache under /var/lib/cni, the shims' sockets under /run/containerd).
# Removed on the way down when they did not exist before, deepest first.
MACHINE_PATHS = ("/var/lib/kubelet", "/var/log/containers", "/var/lib/cni/results", "/var/lib/cni",
                 "/run/containerd/runc/k8s.io", "/run/containerd/runc", "/run/containerd/fifo",
                 "/run/containerd/s", "/run/containerd")
IPTABLES_PREFIXES = ("KUBE-", "SANDMAN-RN-")


class RealNodeError(TestbedError):
    __test__ = False


def placement() -> dict:
    """Pod spec fields that put a pod on the real node (and only there)."""
    return {"nodeSelector": {LABEL_REAL_NODE: "true"}, "tolerations": [dict(TOLERATION)]}


# --- small helpers ---------------------------------------------------------------------------

def _sh(cmd: list[str], what: str, check: bool = True, log: Path | None = None,
        input: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, capture_output=True, text=True, input=input, timeout=timeout)
    if check and res.returncode != 0:
        where = f"; log {log}" if log else ""
        err = (res.stderr or res.stdout).strip().replace("\n", " | ")[-400:]
        raise RealNodeError(f"{what}: `{shlex.join(cmd)[:160]}` exited {res.returncode}: {err}{where}")
    return res


def _quiet(cmd: list[str]) -> int:
    """Run a cleanup step whose failure only means "already gone"."""
    try:
        return subprocess.run(cmd, capture_output=True, timeout=60).returncode
    except (OSError, subprocess.TimeoutExpired):
        return -1


def _ip_json(*args: str) -> list:
    res = subprocess.run(["ip", "-j", *args], capture_output=True, text=True)
    return json.loads(res.stdout or "[]") if res.returncode == 0 else []


def _link_exists(name: str) -> bool:
    return Path(f"/sys/class/net/{name}").exists()


def _read_sysctl(key: str) -> str | None:
    try:
        return Path("/proc/sys", key).read_text().strip()
    except OSError:
        return None


def _write_sysctl(key: str, value: str) -> None:
    with contextlib.suppress(OSError):
        Path("/proc/sys", key).write_text(value + "\n")


def _ipset_names() -> list[str]:
    if not shutil.which("ipset"):
        return []
    res = subprocess.run(["ipset", "list", "-n"], capture_output=True, text=True)
    return sorted(res.stdout.split()) if res.returncode == 0 else []


def _cgroup_mounts() -> list[Path]:
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        if right.split()[0] in ("cgroup", "cgroup2"):
            out.append(Path(_unescape(left.split()[4])))
    return out


def _unescape(path: str) -> str:
    return path.encode().decode("unicode_escape") if "\\" in path else path


def _mounts_under(root: Path) -> list[str]:
    root_s = str(root.resolve()) if root.exists() else str(root)
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mp = _unescape(line.split()[4])
        if mp == root_s or mp.startswith(root_s + "/"):
            out.append(mp)
    return out


def unmount_all_under(root: Path) -> list[str]:
    """Unmount every mount at or below `root`, deepest first; return what is still mounted."""
    for _ in range(20):
        mps = _mounts_under(root)
        if not mps:
            return []
        for mp in sorted(set(mps), key=lambda m: m.count("/"), reverse=True):
            if _quiet(["umount", mp]) != 0:
                _quiet(["umount", "-l", mp])  # busy (a process still holds it): detach
    return _mounts_under(root)


def _pid_cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _kill_and_wait(pids: list[int], timeout: float = 10.0) -> list[int]:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        if alive:
            time.sleep(0.05)
    return alive


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _port_free(ip: str, port: int, kind: int = socket.SOCK_STREAM) -> bool:
    with socket.socket(socket.AF_INET, kind) as s:
        try:
            s.bind((ip, port))
        except OSError:
            return False
    return True


def overlaps_on_machine(cidrs: list[str]) -> list[str]:
    """Addresses and routes (any table) on this machine that overlap any of `cidrs`."""
    nets = [ipaddress.ip_network(c, strict=False) for c in cidrs]
    found = []
    for link in _ip_json("-4", "addr"):
        for a in link.get("addr_info", []):
            net = ipaddress.ip_network(f"{a['local']}/{a['prefixlen']}", strict=False)
            if any(net.overlaps(n) for n in nets):
                found.append(f"address {a['local']}/{a['prefixlen']} on {link['ifname']}")
    for r in _ip_json("-4", "route", "show", "table", "all"):
        dst = r.get("dst", "")
        if dst in ("", "default") or r.get("type") in ("local", "broadcast"):
            continue
        try:
            net = ipaddress.ip_network(dst if "/" in dst else f"{dst}/32", strict=False)
        except ValueError:
            continue
        if any(net.overlaps(n) for n in nets):
            found.append(f"route {dst} table {r.get('table', 'main')}")
    return found


def _sysdeps():
    """tools/sysdeps.py (not a package: it runs before the venv exists) holds the one list of
    Debian packages the real node needs."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "tools" / "sysdeps.py"
    spec = importlib.util.spec_from_file_location("sandman_sysdeps", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def install_sysdeps() -> str | None:
    """Install the real node's Debian packages when missing (root only); None or why not."""
    missing = _sysdeps().missing_packages(real_node=True)
    if not missing:
        return None
    if os.geteuid() != 0:
        return f"real node needs Debian packages {missing} and this is not root"
    rc = subprocess.call([sys.executable, str(Path(_sysdeps().__file__)), "--real-node"])
    return None if rc == 0 else f"installing Debian packages {missing} failed (tools/sysdeps.py)"


# Present once the bridge netfilter code is in the kernel (built in, or the loaded module):
# kube-proxy and kube-router need bridged pod traffic to pass through iptables.
BRIDGE_NF_DIR = Path("/proc/sys/net/bridge")


def load_br_netfilter() -> None:
    """Load br_netfilter when the kernel lacks it (nothing else on the machine does); a root
    machine that cannot is a failure, never a reason to skip the real node."""
    if BRIDGE_NF_DIR.exists():
        return
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    modprobe = shutil.which("modprobe", path=path)
    if modprobe is None:
        raise RealNodeError("real node: the kernel has no br_netfilter and there is no "
                            "modprobe to load it (Debian package kmod)")
    res = subprocess.run([modprobe, "br_netfilter"], capture_output=True, text=True)
    if not BRIDGE_NF_DIR.exists():
        raise RealNodeError(f"real node: `modprobe br_netfilter` exited {res.returncode} and "
                            f"{BRIDGE_NF_DIR} is still missing: "
                            f"{(res.stderr or res.stdout).strip()[-300:]}")


def unavailable_reason() -> str | None:
    """One line saying why this machine cannot host a real node, or None when it can. A
    missing br_netfilter is not one: `prepare` loads it, or fails."""
    if os.geteuid() != 0:
        return "real node needs root (network namespaces, iptables, mounts, cgroups)"
    if not _cgroup_mounts():
        return "real node needs cgroups mounted under /sys/fs/cgroup"
    missing = _sysdeps().missing_packages(real_node=True)
    if missing:
        return f"real node needs Debian packages {missing} (make sysdeps REAL_NODE=1)"
    return None


# --- the machine record: what to restore, written before anything is changed ---------------

def read_record() -> dict | None:
    try:
        return json.loads(MACHINE_RECORD.read_text())
    except (OSError, ValueError):
        return None


def _write_record(rec: dict) -> None:
    MACHINE_RECORD.parent.mkdir(parents=True, exist_ok=True)
    tmp = MACHINE_RECORD.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(rec, indent=1))
    tmp.rename(MACHINE_RECORD)


# Programs the node runs; with its directory on their command line they are the node's.
NODE_PROGRAMS = ("containerd", "containerd-shim-runc-v2", "kubelet", "kube-proxy", "coredns",
                 "kube-router", "crictl", "ctr", "runc")


def _processes_of(rec: dict) -> list[int]:
    """Processes started for the recorded node: the node's programs whose command line names
    its directory (every component's config, socket or root dir is there, and so is every
    shim's -address)."""
    d = rec["dir"]
    out = []
    for pid in _all_pids():
        args = _pid_cmdline(pid)
        if args and Path(args[0]).name in NODE_PROGRAMS and any(d in a for a in args[1:]):
            out.append(pid)
    return out


def _owner_alive(rec: dict) -> bool:
    pid = rec.get("owner_pid")
    return pid is not None and _alive(pid)


# --- cleanup: works from the fixed names and the record, on a live or crashed node ----------

def _kubepods_cgroups() -> list[Path]:
    """The pods' cgroups of both nodes: kubelet's default root, and the second node's."""
    from testbed import secondnode

    return [m / d for m in _cgroup_mounts() for d in ("kubepods", secondnode.CGROUP)
            if (m / d).is_dir()]


def _cgroup_pids(root: Path) -> list[int]:
    pids: set[int] = set()
    for dirpath, _, files in os.walk(root):
        if "cgroup.procs" in files:
            with contextlib.suppress(OSError):
                pids.update(int(x) for x in Path(dirpath, "cgroup.procs").read_text().split())
    return sorted(pids)


def _rmdir_tree(root: Path) -> None:
    for dirpath, _, _ in sorted(os.walk(root), key=lambda t: t[0].count("/"), reverse=True):
        with contextlib.suppress(OSError):
            os.rmdir(dirpath)


def _shim_sockets(pids: list[int]) -> list[Path]:
    """The /run/containerd/s/<hash> sockets of containerd-shim-runc-v2 processes: containerd
    1.6 names them sha256(<containerd address>/<namespace>/<id>), outside any state dir."""
    import hashlib

    out = []
    for pid in pids:
        args = _pid_cmdline(pid)
        if not args or "containerd-shim" not in Path(args[0]).name:
            continue
        opt = {args[i]: args[i + 1] for i in range(1, len(args) - 1) if args[i].startswith("-")}
        if {"-namespace", "-id", "-address"} <= opt.keys():
            h = hashlib.sha256(os.path.join(opt["-address"], opt["-namespace"], opt["-id"])
                               .encode()).hexdigest()
            out.append(Path("/run/containerd/s") / h)
    return out


def _iptables_families() -> list[tuple[str, str]]:
    fams = []
    for save in ("iptables-save", "ip6tables-save", "iptables-legacy-save", "ip6tables-legacy-save"):
        if shutil.which(save):
            fams.append((save, save.replace("-save", "-restore")))
    return fams


def _ours(chain: str) -> bool:
    return chain.startswith(IPTABLES_PREFIXES)


def _iptables_cleanup_script(dump: str) -> str:
    """An iptables-restore --noflush script that removes our chains and the jumps to them."""
    out: list[str] = []
    table, chains, dels = None, [], []
    for line in dump.splitlines():
        if line.startswith("*"):
            table, chains, dels = line[1:], [], []
        elif line.startswith(":") and table:
            name = line[1:].split()[0]
            if _ours(name):
                chains.append(name)
        elif line.startswith("-A ") and table:
            parts = shlex.split(line)
            chain = parts[1]
            target = next((parts[i + 1] for i, a in enumerate(parts[:-1]) if a in ("-j", "-g")), "")
            if not _ours(chain) and (_ours(target) or "kube-router" in line):
                dels.append("-D" + line[2:])
        elif line == "COMMIT" and table and (chains or dels):
            out += [f"*{table}", *dels, *(f"-F {c}" for c in chains),
                    *(f"-X {c}" for c in chains), "COMMIT"]
            table = None
    return "\n".join(out) + "\n" if out else ""


def _iptables_leftovers() -> list[str]:
    found = []
    for save, _ in _iptables_families():
        res = subprocess.run([save], capture_output=True, text=True)
        for line in res.stdout.splitlines():
            if line.startswith((":", "-A")) and any(p in line for p in IPTABLES_PREFIXES):
                found.append(f"{save}: {line[:120]}")
    return found


def _network_down() -> None:
    from testbed import secondnode

    secondnode.network_down()  # its rules and guard entries first: they name our table and chain
    for prio in RULE_PRIORITIES:
        while _quiet(["ip", "rule", "del", "priority", str(prio)]) == 0:
            pass
    while _quiet(["ip", "rule", "del", "lookup", str(ROUTE_TABLE)]) == 0:
        pass
    _quiet(["ip", "route", "flush", "table", str(ROUTE_TABLE)])
    if OUTSIDE_NETNS in _netns_names():
        res = subprocess.run(["ip", "netns", "pids", OUTSIDE_NETNS], capture_output=True, text=True)
        _kill_and_wait([int(p) for p in res.stdout.split()])
        _quiet(["ip", "netns", "del", OUTSIDE_NETNS])
    for link in (BRIDGE, NODE_LINK, OUT_LINK):
        if _link_exists(link):
            _quiet(["ip", "link", "del", link])  # a veth's peer goes with it


def _netns_names() -> list[str]:
    return [n.get("name") for n in _ip_json("netns", "list")]


def cleanup(rec: dict, machine: bool = True) -> list[str]:
    """Remove everything a real node (live or crashed) put on the machine; return leftovers.

    Idempotent: each step only acts on what is still there. `rec` is the node's record (the
    machine record, or {"state_dir", "dir"}). machine=False: only the node's own processes and
    what is mounted under its state dir, for a node that does not hold the machine's slot (its
    start failed before): the fixed names then belong to another test bed."""
    if rec.get("dir"):
        procs = _processes_of(rec)
        sockets = _shim_sockets(procs)
        _kill_and_wait(procs)
        for s in sockets:
            with contextlib.suppress(OSError):
                s.unlink()
    if not machine:
        if rec.get("state_dir"):
            unmount_all_under(Path(rec["state_dir"]))
        return leftovers(rec, machine=False)
    # Holding the machine's slot, every kubepods cgroup is this node's. Containers' processes
    # outlive their shims (reparented to init): their cgroups find them.
    for cg in _kubepods_cgroups():
        for _ in range(5):
            pids = _cgroup_pids(cg)
            if not pids:
                break
            _kill_and_wait(pids, timeout=5)
    if rec.get("state_dir"):
        unmount_all_under(Path(rec["state_dir"]))
    # A killed container stays in its cgroup until its new parent (init) reaps it: rmdir
    # fails with EBUSY until then, so retry for a while.
    deadline = time.monotonic() + 15
    while _kubepods_cgroups():
        for cg in _kubepods_cgroups():
            _kill_and_wait(_cgroup_pids(cg), timeout=2)
            _rmdir_tree(cg)
        if time.monotonic() > deadline:
            break
        if _kubepods_cgroups():
            time.sleep(0.2)
    _network_down()
    for save, restore in _iptables_families():
        for _ in range(3):  # a rule added between save and restore (kube-router) needs a pass more
            script = _iptables_cleanup_script(_sh([save], "cleanup", check=False).stdout)
            if not script:
                break
            _sh([restore, "--noflush"], "cleanup", check=False, input=script)
    baseline = rec.get("ipsets")
    if baseline is not None:
        for name in _ipset_names():
            if name not in baseline:
                _quiet(["ipset", "destroy", name])
    for key, value in (rec.get("sysctls") or {}).items():
        if value is not None and _read_sysctl(key) != value:
            _write_sysctl(key, value)
    if rec.get("dir"):
        d = rec["dir"]
        logs = Path("/var/log/containers")
        if logs.is_dir():
            for f in logs.iterdir():
                with contextlib.suppress(OSError):
                    if f.is_symlink() and os.readlink(f).startswith(d):
                        f.unlink()
        # go-cni's result cache, <network>-<sandbox id>-<ifname>: the pods' network and the
        # loopback one (a crash skips the CNI DEL that would remove them).
        results = Path("/var/lib/cni/results")
        sandboxes = Path(d, "containerd", "root", "io.containerd.grpc.v1.cri", "sandboxes")
        ids = {x.name for x in sandboxes.iterdir()} if sandboxes.is_dir() else set()
        for f in results.iterdir() if results.is_dir() else ():
            if f.name.startswith(f"{CNI_NETWORK}-") or any(f"-{i}-" in f.name for i in ids):
                with contextlib.suppress(OSError):
                    f.unlink()
    for path, existed in (rec.get("paths") or {}).items():
        if existed or not os.path.isdir(path):
            continue
        if path == "/var/lib/kubelet" and not _mounts_under(Path(path)):
            shutil.rmtree(path, ignore_errors=True)  # device-plugins/kubelet.sock only
        else:
            with contextlib.suppress(OSError):
                os.rmdir(path)  # only when empty: someone else may have put things there
    left = leftovers(rec)
    if not left and rec and rec == read_record():  # only the record this cleanup was for
        MACHINE_RECORD.unlink()
        with contextlib.suppress(OSError):
            MACHINE_RECORD.parent.rmdir()
    return left


def leftovers(rec: dict | None = None, machine: bool = True) -> list[str]:
    """Everything of a real node still on the machine, one line each (empty: clean).
    Without a record: what has a fixed name. machine=False: the node's processes and mounts."""
    rec = rec or read_record() or {}
    found = []
    if rec.get("dir"):
        for pid in _processes_of(rec):
            found.append(f"process {pid}: {' '.join(_pid_cmdline(pid))[:120]}")
    if not machine:
        return found + [f"mount {m}" for m in _mounts_under(Path(rec["state_dir"]))]
    for cg in _kubepods_cgroups():
        pids = _cgroup_pids(cg)
        found.append(f"cgroup {cg}" + (f" with processes {pids[:5]}" if pids else ""))
    if rec.get("state_dir"):
        found += [f"mount {m}" for m in _mounts_under(Path(rec["state_dir"]))]
    found += [f"link {n}" for n in (BRIDGE, NODE_LINK, NODE_PEER, OUT_LINK) if _link_exists(n)]
    from testbed import secondnode

    found += [x for x in secondnode.leftovers() if not x.startswith("cgroup ")]  # cgroups above
    if OUTSIDE_NETNS in _netns_names():
        found.append(f"netns {OUTSIDE_NETNS}")
    for r in _ip_json("rule"):
        if r.get("priority") in RULE_PRIORITIES or str(r.get("table")) == str(ROUTE_TABLE):
            found.append(f"ip rule {r}")
    found += [f"route {r.get('dst')} table {ROUTE_TABLE}"
              for r in _ip_json("route", "show", "table", str(ROUTE_TABLE))]
    found += _iptables_leftovers()
    if rec.get("ipsets") is not None:
        found += [f"ipset {n}" for n in _ipset_names() if n not in rec["ipsets"]]
    for key, value in (rec.get("sysctls") or {}).items():
        now = _read_sysctl(key)
        if value is not None and now != value:
            found.append(f"sysctl {key} = {now} (was {value})")
    found += [f"path {p} (made by the node)" for p, existed in (rec.get("paths") or {}).items()
              if not existed and p == "/var/lib/kubelet" and os.path.lexists(p)]
    return found


def cleanup_leftovers(state_dir: Path) -> None:
    """Before a test bed (re)uses `state_dir`: remove what a crashed real node of this state dir
    left (its mounts are under the dir, which is about to be removed)."""
    rec = read_record()
    if rec is not None and Path(rec["state_dir"]) == state_dir:
        left = cleanup(rec)
    else:
        left = cleanup({"state_dir": str(state_dir), "dir": str(state_dir / "realnode")},
                       machine=False)
    if left:
        raise RealNodeError(f"real node: leftovers of an earlier run could not be removed: "
                            f"{'; '.join(left[:5])}")


def _live(rec: dict) -> bool:
    return _owner_alive(rec) or (rec.get("owner_pid") is None and bool(_processes_of(rec)))


def claim_machine(rec: dict, wait: float = 0.0) -> None:
    """Take the machine's one real-node slot by creating the record exclusively: holding it is
    the right to the fixed names. A record whose owner is gone (a crash) is cleaned up first;
    a live one is waited for up to `wait` seconds, then refused with its state dir named."""
    deadline = time.monotonic() + wait
    while True:
        MACHINE_RECORD.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(MACHINE_RECORD, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            other = read_record()
            if other is None:  # being written, or a writer died half-way
                with contextlib.suppress(OSError):
                    if time.time() - MACHINE_RECORD.stat().st_mtime > 30:
                        MACHINE_RECORD.unlink()
                time.sleep(0.2)
                continue
            if other.get("state_dir") == rec["state_dir"] or not _live(other):
                left = cleanup(other)
                if left:
                    raise RealNodeError(f"real node: leftovers of an earlier run "
                                        f"({other['state_dir']}) could not be removed: "
                                        f"{'; '.join(left[:5])}") from None
                with contextlib.suppress(OSError):
                    if read_record() == other:
                        MACHINE_RECORD.unlink()
                continue
            if time.monotonic() >= deadline:
                raise RealNodeError(
                    f"real node: another test bed's real node is running ({other['state_dir']}, "
                    f"pid {other.get('owner_pid')}); one per machine: stop it first (make "
                    f"testbed-down, or end that pytest session)") from None
            time.sleep(2)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(rec, f, indent=1)
        break
    # Holding the slot, anything with a fixed name is a leftover of a run that lost its record.
    from testbed import secondnode

    if (any(_link_exists(n) for n in (BRIDGE, NODE_LINK, OUT_LINK)) or OUTSIDE_NETNS in _netns_names()
            or secondnode.leftovers()):
        cleanup({}, machine=True)


# --- the node --------------------------------------------------------------------------------

class RealNode:
    """The real node of one Testbed. `prepare()` runs before the API server starts (it needs
    the node IP to listen on), `start()` after the control plane is up, `stop()` first on the
    way down. Use through `Testbed(..., real_node=True)`."""

    # What a second node (testbed/secondnode.py) names differently.
    name = NODE_NAME
    bridge = BRIDGE
    cni_network = CNI_NETWORK
    cgroup_root: str | None = None  # kubelet's default, "/": pods under /kubepods

    def __init__(self, tb: Testbed, owner_pid: int | None = None, wait: float = 0.0) -> None:
        self.tb = tb
        self.wait = wait  # for the machine's one real-node slot, when another bed holds it
        self.dir = tb.state_dir / "realnode"
        self.owner_pid = owner_pid if owner_pid is not None else os.getpid()
        self.pod_cidr: str | None = None
        self.node_ip: str | None = None
        self.ports: dict[str, int] = {}
        self.bins: dict[str, Path] = {}
        self.images: list[str] = []
        self.image_names: list[str] = []  # testbed.images' short names of `images`
        self.timings: dict[str, float] = {}

    # Paths and addresses ------------------------------------------------------------------
    @property
    def sock(self) -> Path:
        return self.dir / "containerd" / "containerd.sock"

    @property
    def endpoint(self) -> str:
        """The CRI endpoint: `crictl --runtime-endpoint <this>`, `ctr -a <sock> -n k8s.io`."""
        return f"unix://{self.sock}"

    @property
    def gateway(self) -> str:
        return str(next(ipaddress.ip_network(self.pod_cidr).hosts()))

    def crictl(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.bins.get("crictl") or build.realnode_binaries()["crictl"]),
                               "--runtime-endpoint", self.endpoint, "--image-endpoint",
                               self.endpoint, "--timeout", "20s", *args],
                              capture_output=True, text=True, timeout=timeout)

    def to_dict(self) -> dict:
        return {"pod_cidr": self.pod_cidr, "node_ip": self.node_ip, "ports": self.ports,
                "owner_pid": self.owner_pid}

    @classmethod
    def attach(cls, tb: Testbed, data: dict) -> RealNode:
        rn = cls(tb, owner_pid=data.get("owner_pid"))
        rn.pod_cidr, rn.node_ip, rn.ports = data["pod_cidr"], data["node_ip"], data["ports"]
        rn.bins = build.realnode_binaries()
        return rn

    def set_owner(self, pid: int | None) -> None:
        """None: the node outlives this process (`make testbed-up`); only `down` stops it."""
        self.owner_pid = pid
        rec = read_record()
        if rec and rec.get("dir") == str(self.dir):
            rec["owner_pid"] = pid
            _write_record(rec)
        if (self.tb.state_dir / "pids.json").exists():
            self.tb._write_pids()

    # Phase 1: before the API server -------------------------------------------------------
    def prepare(self) -> None:
        t0 = time.monotonic()
        reason = install_sysdeps() or unavailable_reason()
        if reason:
            raise RealNodeError(f"real node: {reason}")
        load_br_netfilter()
        self.bins = build.build_realnode()
        self.dir.mkdir(parents=True, exist_ok=True)
        claim_machine({
            "state_dir": str(self.tb.state_dir), "dir": str(self.dir), "sock": str(self.sock),
            "owner_pid": self.owner_pid,
            "sysctls": {k: _read_sysctl(k) for k in SYSCTLS}, "ipsets": _ipset_names(),
            "paths": {p: os.path.lexists(p) for p in MACHINE_PATHS},
            "started": time.time(),
        }, self.wait)
        self.timings["slot-wait"] = time.monotonic() - t0
        self._pick_addresses()
        rec = read_record()
        rec.update(pod_cidr=self.pod_cidr, node_ip=self.node_ip)
        _write_record(rec)
        self._network_up()
        self.timings["prepare"] = time.monotonic() - t0 - self.timings["slot-wait"]

    def _pick_addresses(self) -> None:
        for cidr, ip in ADDRESS_PLANS:
            if not overlaps_on_machine([cidr, f"{ip}/32"]):
                self.pod_cidr, self.node_ip = cidr, ip
                return
        raise RealNodeError(f"real node: every address plan {ADDRESS_PLANS} overlaps an address "
                            f"or route on this machine: {overlaps_on_machine([c for c, _ in ADDRESS_PLANS])[:3]}")

    def _network_up(self) -> None:
        ns, t = OUTSIDE_NETNS, str(ROUTE_TABLE)
        plen = ipaddress.ip_network(self.pod_cidr).prefixlen
        steps = [
            # The node IP: pods reach the API server, kubelet, CoreDNS there (never loopback).
            ["ip", "link", "add", NODE_LINK, "type", "veth", "peer", "name", NODE_PEER],
            ["ip", "addr", "add", f"{self.node_ip}/32", "dev", NODE_LINK],
            ["ip", "link", "set", NODE_PEER, "up"], ["ip", "link", "set", NODE_LINK, "up"],
            # The pods' bridge, made here (the CNI plugin reuses it) so the guard exists first.
            ["ip", "link", "add", BRIDGE, "address", BRIDGE_MAC, "type", "bridge"],
            ["ip", "addr", "add", f"{self.gateway}/{plen}", "dev", BRIDGE],
            ["ip", "link", "set", BRIDGE, "up"],
            # The fake outside.
            ["ip", "netns", "add", ns],
            ["ip", "link", "add", OUT_LINK, "type", "veth", "peer", "name", OUT_PEER, "netns", ns],
            ["ip", "addr", "add", f"{TRANSIT_HOST}/30", "dev", OUT_LINK, "noprefixroute"],
            ["ip", "link", "set", OUT_LINK, "up"],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
            ["ip", "-n", ns, "addr", "add", f"{TRANSIT_OUTSIDE}/30", "dev", OUT_PEER],
            ["ip", "-n", ns, "link", "set", OUT_PEER, "up"],
            *(["ip", "-n", ns, "addr", "add", f"{a}/32", "dev", "lo"]
              for a in (OUTSIDE_IP, OUTSIDE_IP2, METADATA_IP)),
            ["ip", "-n", ns, "route", "add", self.pod_cidr, "via", TRANSIT_HOST, "dev", OUT_PEER],
            # The pods' own table: pods, the fake outside, nothing else.
            ["ip", "route", "add", self.pod_cidr, "dev", BRIDGE, "src", self.gateway, "table", t],
            ["ip", "route", "add", OUTSIDE_NET, "via", TRANSIT_OUTSIDE, "dev", OUT_LINK, "onlink",
             "table", t],
            ["ip", "route", "add", f"{METADATA_IP}/32", "via", TRANSIT_OUTSIDE, "dev", OUT_LINK,
             "onlink", "table", t],
            ["ip", "route", "add", "unreachable", "default", "table", t],
            ["ip", "rule", "add", "from", self.pod_cidr, "lookup", t,
             "priority", str(RULE_PRIORITIES[0])],
            ["ip", "rule", "add", "iif", BRIDGE, "lookup", t, "priority", str(RULE_PRIORITIES[1])],
            ["ip", "rule", "add", "to", OUTSIDE_NET, "lookup", t,
             "priority", str(RULE_PRIORITIES[2])],
        ]
        for cmd in steps:
            _sh(cmd, "real node network")
        _write_sysctl(f"net/ipv6/conf/{BRIDGE}/disable_ipv6", "1")
        _write_sysctl("net/ipv4/ip_forward", "1")  # pods <-> fake outside; restored on the way down
        guard = "\n".join([
            "*mangle", f":{GUARD_CHAIN} - [0:0]",
            f"-A {GUARD_CHAIN} -i {BRIDGE} -o {BRIDGE} -j RETURN",
            f"-A {GUARD_CHAIN} -i {BRIDGE} -o {OUT_LINK} -j RETURN",
            f'-A {GUARD_CHAIN} -i {BRIDGE} -m comment --comment "sandman real node: pods reach '
            f'only pods and the fake outside" -j DROP',
            f"-A {GUARD_CHAIN} -i {OUT_LINK} -o {BRIDGE} -j RETURN",
            f'-A {GUARD_CHAIN} -i {OUT_LINK} -m comment --comment "sandman real node: the fake '
            f'outside reaches only pods" -j DROP',
            f'-A {GUARD_CHAIN} -o {BRIDGE} -m comment --comment "sandman real node: nothing '
            f'else is forwarded to pods" -j DROP',
            f"-I FORWARD 1 -j {GUARD_CHAIN}", "COMMIT", ""])
        _sh(["iptables-restore", "--noflush"], "real node guard", input=guard)
        self._check_containment()

    def _check_containment(self) -> None:
        """Ask the kernel where pod traffic would go before any pod exists."""
        src = str(ipaddress.ip_network(self.pod_cidr)[5])
        for dst, want in ((OUTSIDE_IP, f"dev {OUT_LINK}"), (METADATA_IP, f"dev {OUT_LINK}"),
                          ("203.0.113.7", "unreachable"), ("192.0.2.1", "unreachable")):
            res = _sh(["ip", "route", "get", dst, "from", src, "iif", BRIDGE], "real node routing",
                      check=False)
            got = (res.stdout + res.stderr).strip()
            if want == "unreachable" and res.returncode == 0 and "unreachable" not in got:
                raise RealNodeError(f"real node routing: pod traffic to {dst} would not be "
                                    f"refused locally: {got}")
            if want != "unreachable" and want not in got:
                raise RealNodeError(f"real node routing: pod traffic to {dst} does not go to the "
                                    f"fake outside: {got}")
        res = _sh(["ip", "route", "get", OUTSIDE_IP2], "real node routing")
        if f"dev {OUT_LINK}" not in res.stdout:
            raise RealNodeError(f"real node routing: the host's traffic to the fake outside "
                                f"would leave the machine: {res.stdout.strip()}")

    # Phase 2: after the control plane -----------------------------------------------------
    def start(self, timeout: float = 120.0) -> None:
        t0 = time.monotonic()
        tb = self.tb
        for name in ("kubelet", "coredns-ready", "kube-proxy-healthz", "kube-proxy-metrics"):
            self.ports.setdefault(name, _reserve_port(self.node_ip))
        if not _port_free(self.node_ip, 53, socket.SOCK_DGRAM) or not _port_free(self.node_ip, 53):
            raise RealNodeError(f"coredns: port {self.node_ip}:53 is already in use; log "
                                f"{tb.logs / 'coredns.log'}")
        p = tb.pki
        kc_kubelet = self._kubeconfig("kubelet", pki.client_cert(
            p, "kubelet", f"system:node:{NODE_NAME}", "system:nodes"))
        kc_proxy = self._kubeconfig("kube-proxy", pki.client_cert(p, "kube-proxy",
                                                                  "system:kube-proxy"))
        # CoreDNS and kube-router are test-bed infrastructure: the admin identity.
        kc_admin = self._kubeconfig("admin", None)
        self._service_endpoints()

        ctd = self._spawn("containerd", ["containerd", "--config", str(self._containerd_config())],
                          env={"HTTP_PROXY": DEAD_PROXY, "HTTPS_PROXY": DEAD_PROXY,
                               "NO_PROXY": NO_PROXY, "http_proxy": DEAD_PROXY,
                               "https_proxy": DEAD_PROXY, "no_proxy": NO_PROXY})
        tb._wait(ctd, lambda: self.crictl("info", timeout=10).returncode == 0, 30, "serving CRI")
        self.timings["containerd"] = time.monotonic() - t0
        self._import_images()
        self.timings["images"] = time.monotonic() - t0

        kubelet = self._spawn("kubelet", [
            str(self.bins["kubelet"]), f"--config={self._kubelet_config()}",
            f"--kubeconfig={kc_kubelet}", f"--root-dir={self.dir / 'kubelet'}",
            f"--cert-dir={self.dir / 'kubelet-pki'}",
            f"--hostname-override={NODE_NAME}", f"--node-ip={self.node_ip}",
            f"--node-labels={LABEL_REAL_NODE}=true,{contract.LABEL_NODE_POOL_DEFAULT}=sandbox,"
            f"type=real,topology.kubernetes.io/zone=zone-real", "--v=1"])
        self._spawn("kube-proxy", [str(self.bins["kube-proxy"]),
                                   f"--config={self._kube_proxy_config(kc_proxy)}", "--v=1"])
        self._spawn("coredns", [str(self.bins["coredns"]), "-conf", str(self._corefile(kc_admin))])
        tb._wait(kubelet, self._node_ready, timeout, f"node {NODE_NAME} Ready")
        self.timings["node-ready"] = time.monotonic() - t0
        # kube-router looks its Node object up once, at start: only now does it exist.
        self._spawn("kube-router", self.kube_router_cmd(kc_admin))
        comps = {c.name: c for c in tb.components}
        tb._wait(comps["kube-proxy"], lambda: _http_ok(
            f"http://{self.node_ip}:{self.ports['kube-proxy-healthz']}/healthz"), 60,
            "/healthz ok (rules synced)")
        tb._wait(comps["coredns"], lambda: _http_ok(
            f"http://{self.node_ip}:{self.ports['coredns-ready']}/ready"), 60, "/ready ok")
        tb._wait(comps["kube-router"], lambda: _kube_router_synced(comps["kube-router"].log), 60,
                 "NetworkPolicy chains installed and synced")
        self.timings["start"] = time.monotonic() - t0

    def kube_router_cmd(self, kubeconfig: Path) -> list[str]:
        """kube-router as the NetworkPolicy engine only, for this node's pods."""
        return [str(self.bins["kube-router"]), f"--kubeconfig={kubeconfig}",
                "--run-firewall=true", "--run-router=false", "--run-service-proxy=false",
                "--run-loadbalancer=false", f"--hostname-override={self.name}",
                f"--service-cluster-ip-range={self.tb_service_cidr()}", "--enable-ipv6=false",
                "--health-port=0", "--metrics-port=0", "--v=1"]

    def tb_service_cidr(self) -> str:
        from testbed.cluster import SERVICE_CIDR

        return SERVICE_CIDR

    def _spawn(self, name: str, cmd: list[str], env: dict | None = None) -> Proc:
        return self.tb._spawn(name, cmd, env=env)

    def _kubeconfig(self, name: str, cert: tuple[Path, Path] | None) -> Path:
        path = self.dir / f"{name}.kubeconfig"
        path.write_text(pki.kubeconfig(self.tb.pki, self.tb.server, user=name, cert=cert))
        return path

    def _node_ready(self) -> bool:
        node = self.tb.request("GET", f"/api/v1/nodes/{self.name}")
        return any(c["type"] == "Ready" and c["status"] == "True"
                   for c in node.get("status", {}).get("conditions", []))

    def _service_endpoints(self) -> None:
        """The `kubernetes` and `kube-dns` Services' endpoints: the API server and CoreDNS are
        host processes on the node IP (the API server runs --endpoint-reconciler-type=none)."""
        api_port = self.tb.ports["apiserver"]
        self._put_endpoints("default", "kubernetes", [("https", api_port, "TCP")])
        self._apply("/api/v1/namespaces/kube-system/services", "kube-dns", {
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "kube-dns", "namespace": "kube-system",
                         "labels": {"k8s-app": "kube-dns"}},
            "spec": {"clusterIP": CLUSTER_DNS, "ports": [
                {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 53},
                {"name": "dns-tcp", "port": 53, "protocol": "TCP", "targetPort": 53}]}})
        self._put_endpoints("kube-system", "kube-dns", [("dns", 53, "UDP"), ("dns-tcp", 53, "TCP")])

    def _put_endpoints(self, ns: str, svc: str, ports: list[tuple[str, int, str]]) -> None:
        self._apply(f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices", svc, {
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": svc, "namespace": ns, "labels": {
                "kubernetes.io/service-name": svc,
                "endpointslice.kubernetes.io/managed-by": "testbed.sandman.dev"}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [self.node_ip], "conditions": {"ready": True},
                           "nodeName": NODE_NAME}],
            "ports": [{"name": n, "port": p, "protocol": proto} for n, p, proto in ports]})
        # Endpoints too (older clients read them); not mirrored into a second slice.
        self._apply(f"/api/v1/namespaces/{ns}/endpoints", svc, {
            "apiVersion": "v1", "kind": "Endpoints",
            "metadata": {"name": svc, "namespace": ns,
                         "labels": {"endpointslice.kubernetes.io/skip-mirror": "true"}},
            "subsets": [{"addresses": [{"ip": self.node_ip}],
                         "ports": [{"name": n, "port": p, "protocol": proto}
                                   for n, p, proto in ports]}]})

    def _apply(self, collection: str, name: str, body: dict) -> None:
        import urllib.error

        try:
            self.tb.request("POST", collection, body)
        except urllib.error.HTTPError as e:
            if e.code != 409:
                raise RealNodeError(f"real node: cannot create {collection}/{name}: HTTP {e.code} "
                                    f"{e.read()[:200]!r}; log {self.tb.logs / 'kube-apiserver.log'}") from None
            cur = self.tb.request("GET", f"{collection}/{name}")
            body["metadata"]["resourceVersion"] = cur["metadata"]["resourceVersion"]
            self.tb.request("PUT", f"{collection}/{name}", body)

    # Config files -------------------------------------------------------------------------
    def _containerd_config(self) -> Path:
        d = self.dir / "containerd"
        cni = self.dir / "cni"
        (cni / "net.d").mkdir(parents=True, exist_ok=True)
        (cni / "net.d" / "10-sandman.conflist").write_text(json.dumps({
            "cniVersion": "1.0.0", "name": self.cni_network,
            "plugins": [{
                "type": "bridge", "bridge": self.bridge, "isGateway": True, "hairpinMode": True,
                # No masquerade: pod traffic keeps its source and goes only where the pods'
                # routing table allows (pods, the fake outside).
                "ipMasq": False,
                "ipam": {"type": "host-local", "dataDir": str(cni / "ipam"),
                         "ranges": [[{"subnet": self.pod_cidr, "gateway": self.gateway}]],
                         "routes": [{"dst": "0.0.0.0/0"}]},
            }],
        }, indent=1))
        q = json.dumps  # TOML basic strings accept JSON string escapes
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        text = f"""version = 2
root = {q(str(d / "root"))}
state = {q(str(d / "state"))}
oom_score = 0
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = {q(str(self.sock))}
[ttrpc]
  address = ""
[debug]
  address = ""
  level = "info"
[metrics]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = {q(str(d / "opt"))}

[{cri}]
  sandbox_image = {q(self.pause_ref)}
  # No CAP_SYS_RESOURCE here: a negative oom_score_adj fails RunPodSandbox.
  restrict_oom_score_adj = true
  # Pod network namespaces under the state dir: nothing in /var/run/netns, one umount sweep.
  netns_mounts_under_state_dir = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false
  [{cri}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [{cri}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{cri}.containerd.runtimes.runc.options]
        # cgroup v1 and no systemd here.
        SystemdCgroup = false
        BinaryName = {q(shutil.which("runc") or "runc")}
        Root = {q(str(d / "runc"))}
  [{cri}.cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = {q(str(cni / "net.d"))}
    max_conf_num = 1
  [{cri}.registry]
    config_path = {q(str(d / "certs.d"))}
"""
        (d / "certs.d").mkdir(parents=True, exist_ok=True)
        path = d / "config.toml"
        path.write_text(text)
        return path

    def _kubelet_config(self) -> Path:
        cfg = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            # This host is cgroup v1 without systemd; kubelet >= 1.35 refuses v1 unless told.
            "failCgroupV1": False, "cgroupDriver": "cgroupfs",
            "oomScoreAdj": 0,  # no CAP_SYS_RESOURCE: a negative value fails
            "containerRuntimeEndpoint": self.endpoint,
            "address": self.node_ip, "port": self.ports["kubelet"], "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": 0,
            "clusterDNS": [CLUSTER_DNS], "clusterDomain": CLUSTER_DOMAIN,
            # Never hand pods the machine's resolvers (dnsPolicy Default gets none at all).
            "resolvConf": "",
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False},
                               "x509": {"clientCAFile": str(self.tb.pki.ca_cert)}},
            "authorization": {"mode": "AlwaysAllow"},
            "podLogsDir": str(self.dir / "pod-logs"),
            "volumePluginDir": str(self.dir / "volume-plugins"),
            # Tainted only beside kwok nodes, to keep their pods off; in a bed with no kwok
            # node every pod is meant to run for real (sandboxes carry no toleration).
            "registerWithTaints": self.taints(),
            "failSwapOn": False,
            # Images cannot be pulled again here: never garbage-collect them.
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%",
                             "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
            "serializeImagePulls": False, "maxPods": 110,
            "shutdownGracePeriod": "0s", "shutdownGracePeriodCriticalPods": "0s",
            "nodeStatusUpdateFrequency": "5s", "syncFrequency": "10s",
        }
        if self.cgroup_root:
            cfg["cgroupRoot"] = self.cgroup_root
        path = self.dir / "kubelet-config.json"
        path.write_text(json.dumps(cfg, indent=1))
        return path

    def taints(self) -> list[dict]:
        return [dict(TAINT)] if self.tb.nodes > 0 else []

    def _kube_proxy_config(self, kubeconfig: Path) -> Path:
        cfg = {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(kubeconfig)},
            "mode": "iptables",  # no IPVS in this kernel
            "hostnameOverride": self.name, "bindAddress": self.node_ip,
            "healthzBindAddress": f"{self.node_ip}:{self.ports['kube-proxy-healthz']}",
            "metricsBindAddress": f"127.0.0.1:{self.ports['kube-proxy-metrics']}",
            "clusterCIDR": self.pod_cidr, "detectLocalMode": "ClusterCIDR",
            "nodePortAddresses": [f"{self.node_ip}/32"],  # never on the uplink
            # Leave the machine's conntrack sysctls alone; no route_localnet.
            "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s",
                          "tcpCloseWaitTimeout": "0s"},
            "iptables": {"localhostNodePorts": False, "masqueradeAll": False},
            "oomScoreAdj": 0,
        }
        path = self.dir / "kube-proxy-config.json"
        path.write_text(json.dumps(cfg, indent=1))
        return path

    def _corefile(self, kubeconfig: Path) -> Path:
        path = self.dir / "Corefile"
        # `forward` only to the fake outside's resolver (nothing listens there unless a test
        # starts one): never to the machine's resolvers.
        path.write_text(f""".:53 {{
    bind {self.node_ip}
    errors
    ready {self.node_ip}:{self.ports['coredns-ready']}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig} sandman-testbed
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 5
    }}
    forward . {OUTSIDE_IP2}:53 {{
        max_fails 1
    }}
    cache 5
}}
""")
        return path

    # Images -------------------------------------------------------------------------------
    @property
    def pause_ref(self) -> str:
        from testbed import images

        return images.PAUSE_REF

    def _import_images(self) -> None:
        self.load_images("pause")

    def load_images(self, *names: str) -> list[str]:
        """Build (once, cached) and import testbed.images images into the node's containerd,
        by short name ("pause", "task", "sandman"); returns their refs. Pods use them with
        imagePullPolicy IfNotPresent or Never: nothing can be pulled here."""
        from testbed import images

        refs = []
        for name in names:
            getter = getattr(images, f"{name}_image", None)
            if getter is None:
                raise RealNodeError(f"real node: testbed.images has no {name!r} image")
            try:
                ref, archive = getter()
                if ref not in self.images:
                    images.import_archive(self.sock, archive)
            except images.ImageError as e:
                raise RealNodeError(f"containerd image import: {name}: {e}; log "
                                    f"{self.tb.logs / 'containerd.log'}") from None
            if ref not in self.images:
                self.images.append(ref)
                self.image_names.append(name)
            refs.append(ref)
        return refs

    # Looking into pods --------------------------------------------------------------------
    def pod_pid(self, namespace: str, name: str) -> int:
        """The host PID of a running pod's sandbox (its pause process)."""
        res = self.crictl("pods", "--namespace", f"^{namespace}$", "--name", f"^{name}$",
                          "--state", "ready", "-q")
        ids = res.stdout.split()
        if res.returncode != 0 or not ids:
            raise RealNodeError(f"crictl: no ready sandbox for pod {namespace}/{name}: "
                                f"{res.stderr.strip()[:200]}; log {self.tb.logs / 'containerd.log'}")
        info = json.loads(self.crictl("inspectp", "-o", "json", ids[0]).stdout)
        return int(info["info"]["pid"])

    def in_pod_netns(self, namespace: str, name: str, argv: list[str],
                     timeout: float = 30) -> subprocess.CompletedProcess:
        """Run a host command in a pod's network namespace (nsenter -n): it has the pod's IP,
        routes and NetworkPolicy treatment, and needs nothing in the pod's image."""
        return subprocess.run(["nsenter", "-t", str(self.pod_pid(namespace, name)), "-n", *argv],
                              capture_output=True, text=True, timeout=timeout)

    # Stop ---------------------------------------------------------------------------------
    def stop(self, timeout: float = 20.0) -> None:
        """Stop the node's processes and its pods (first on the way down: the control plane
        still runs). `cleanup()` then removes what is left on the machine, once the API
        server, which listens on the node IP, has stopped too."""
        t0 = time.monotonic()
        comps = {c.name: c for c in self.tb.components if c.name in REAL_COMPONENTS}
        for name in ("kube-router", "coredns", "kube-proxy", "kubelet"):
            if name in comps:
                comps[name].stop(timeout)
        ctd = comps.get("containerd")
        self.remove_pods(ctd)
        if ctd is not None:
            ctd.stop(timeout)
        self.tb.components = [c for c in self.tb.components if c.name not in REAL_COMPONENTS]
        self.timings["stop"] = time.monotonic() - t0

    def remove_pods(self, ctd: Proc | None) -> None:
        """Every pod through the CRI, while containerd runs: the CNI plugin then releases each
        pod's address and veth."""
        if ctd is not None and ctd.alive() and self.sock.exists():
            with contextlib.suppress(subprocess.TimeoutExpired, OSError):
                pods = self.crictl("pods", "-q", timeout=30).stdout.split()
                if pods:
                    self.crictl("stopp", *pods, timeout=60)
                    self.crictl("rmp", "-f", *pods, timeout=60)

    def cleanup(self) -> list[str]:
        """Remove everything the node put on the machine; return leftovers (empty: clean)."""
        t0 = time.monotonic()
        rec = read_record()
        if rec is not None and rec.get("dir") == str(self.dir):
            left = cleanup(rec)
        else:  # never held the machine's slot (its start failed early): only its own things
            left = cleanup({"state_dir": str(self.tb.state_dir), "dir": str(self.dir)},
                           machine=False)
        self.timings["cleanup"] = time.monotonic() - t0
        return left

    # Status -------------------------------------------------------------------------------
    def status(self) -> list[tuple[str, bool, str]]:
        """(part, ok, detail) for `python -m testbed status`."""
        out = []
        try:
            ok = self._node_ready()
        except Exception as e:  # noqa: BLE001 - status reports, never raises
            ok, detail = False, str(e)[:100]
        else:
            detail = f"{self.node_ip}, pods {self.pod_cidr}"
        out.append((f"node {NODE_NAME}", ok, detail))
        out.append(("containerd CRI", self.sock.exists() and
                    self.crictl("info", timeout=10).returncode == 0, str(self.sock)))
        out.append(("kube-proxy healthz", _http_ok(
            f"http://{self.node_ip}:{self.ports.get('kube-proxy-healthz')}/healthz"), ""))
        out.append(("coredns ready", _http_ok(
            f"http://{self.node_ip}:{self.ports.get('coredns-ready')}/ready"), f"{self.node_ip}:53"))
        out.append(("kube-router chains", _kube_router_synced(), ""))
        out.append((f"bridge {BRIDGE}", _link_exists(BRIDGE), self.gateway))
        out.append((f"netns {OUTSIDE_NETNS}", OUTSIDE_NETNS in _netns_names(),
                    f"{OUTSIDE_IP} {OUTSIDE_IP2} {METADATA_IP}"))
        rules = [r for r in _ip_json("rule") if r.get("priority") in RULE_PRIORITIES]
        out.append((f"pod routing table {ROUTE_TABLE}", len(rules) == len(RULE_PRIORITIES),
                    f"{len(rules)} rules"))
        return out


def _reserve_port(host: str) -> int:
    from testbed.procs import reserve_port

    return reserve_port(host)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except Exception:  # noqa: BLE001 - not ready
        return False


def _kube_router_synced(log: Path | None = None) -> bool:
    """kube-router's top-level chain is in place and (with its log) a full sync has finished."""
    res = subprocess.run(["iptables", "-S", "KUBE-ROUTER-FORWARD"], capture_output=True, text=True)
    if res.returncode != 0:
        return False
    return log is None or "sync iptables took" in log.read_text(errors="replace")


# --- the fake outside's servers, for e2e tests -------------------------------------------------

class OutsideServer:
    """A TCP, UDP or DNS server in the fake outside netns that exits by itself after
    `lifetime` seconds. `hits()` lists the peers that reached it (one line each in its log)."""

    def __init__(self, kind: str, ip: str, port: int, lifetime: float, log: Path,
                 records: dict[str, str] | None = None) -> None:
        self.kind, self.ip, self.port, self.log = kind, ip, port, log
        script = Path(__file__).with_name("outside_server.py")
        cmd = ["ip", "netns", "exec", OUTSIDE_NETNS, sys.executable, "-I", str(script),
               kind, ip, str(port), str(lifetime), json.dumps(records or {})]
        with open(log, "ab") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if "listening" in log.read_text(errors="replace"):
                return
            if self.proc.poll() is not None:
                raise RealNodeError(f"outside server: exited {self.proc.returncode}; log {log}")
            time.sleep(0.05)
        self.stop()
        raise RealNodeError(f"outside server: not listening after 10s; log {log}")

    def hits(self) -> list[str]:
        return [ln.split(" ", 1)[1] for ln in self.log.read_text(errors="replace").splitlines()
                if ln.startswith("hit ")]

    def describe(self) -> str:
        """One line for a failed probe: the server's process state (T: something stopped it)
        and its listening socket's queue (connections the kernel took that it never accepted),
        so a probe that timed out says whether the server or the path was at fault."""
        try:
            data = Path(f"/proc/{self.proc.pid}/stat").read_bytes()
            state = data[data.rfind(b")") + 2:].split()[0].decode()
        except OSError:
            state = f"gone (exit {self.proc.poll()})"
        res = subprocess.run(["ip", "netns", "exec", OUTSIDE_NETNS, "ss", "-Hltn", "src",
                              f"{self.ip}:{self.port}"], capture_output=True, text=True)
        queue = " ".join(res.stdout.split()[1:3]) or (res.stderr.strip() or "no listener")
        return (f"outside server {self.kind} {self.ip}:{self.port} pid {self.proc.pid} state "
                f"{state}, listen queue (now/max) {queue}, hits {len(self.hits())}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)

    def __enter__(self) -> OutsideServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_outside(kind: str = "tcp", ip: str = OUTSIDE_IP, port: int = 8080,
                  lifetime: float = 120.0, records: dict[str, str] | None = None,
                  log_dir: Path | None = None) -> OutsideServer:
    """Start a bounded-lifetime server in the fake outside: kind "tcp" (answers one line),
    "udp" (echoes) or "dns" (A records from `records`, NXDOMAIN otherwise; at OUTSIDE_IP2:53
    it is what CoreDNS forwards to)."""
    if kind not in ("tcp", "udp", "dns"):
        raise ValueError(f"kind must be tcp, udp or dns, not {kind!r}")
    log_dir = log_dir or Path(read_record()["state_dir"]) / "logs"
    log = log_dir / f"outside-{kind}-{ip}-{port}-{time.monotonic_ns()}.log"
    return OutsideServer(kind, ip, port, lifetime, log, records)
