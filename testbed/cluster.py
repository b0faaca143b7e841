"""Start and stop the test bed: etcd, kube-apiserver, kube-controller-manager, kube-scheduler
and kwok with fake nodes, all on 127.0.0.1, all state and logs under one state dir.
With `real_node=True`, also one node that runs real containers (testbed/realnode.py); the API
server then listens on that node's IP so pods can reach it.

Every failure raises TestbedError with one line naming the component and its log file.

The Kubernetes client side of a test bed (or of any cluster given by a kubeconfig) lives here
too: API clients, namespaces ready for pod creates, and `Cluster`, the handle the `cluster`
fixture yields.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import secrets
import shutil
import socket
import ssl
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kubernetes import client, config

from sandman import contract
from testbed import build, pki
from testbed.procs import Proc, repo_root, reserve_port, wait_for

KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
# Pod IPs are handed out from loopback, so anything that dials a pod IP (the controller's execd
# check, a test) stays on this machine: the workplace allows no other destination.
POD_CIDR = "127.64.0.1/16"
NODE_IP = "127.0.0.1"
ZONES = ("zone-a", "zone-b", "zone-c")
SERVICE_CIDR = "10.0.0.0/24"  # a name space for Service IPs only; nothing is ever sent there


class TestbedError(RuntimeError):
    __test__ = False  # not a pytest class


def default_state_dir(name: str) -> Path:
    root = os.environ.get("SANDMAN_TESTBED_STATE") or str(repo_root() / ".testbed")
    return Path(root) / name


def remove_stale_state_dirs(prefix: str = "pytest-") -> None:
    """State dirs `<prefix><pid>` of processes that are gone (their logs were kept until now)."""
    for d in default_state_dir("x").parent.glob(prefix + "*"):
        try:
            pid = int(d.name[len(prefix):])
        except ValueError:
            continue
        if pid != os.getpid() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(d, ignore_errors=True)


def _port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _tail(path: Path, n: int = 3) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(line.strip()[:300] for line in lines[-n:])


# Only pod creates, at Metadata level: a watch delivers events in bunches under load, and
# creationTimestamp has 1 s resolution, so pacing is checked on the API server's own
# requestReceivedTimestamp. Everything else is left out to keep the cost near zero.
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1", "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        {"level": "Metadata", "verbs": ["create"], "resources": [{"group": "", "resources": ["pods"]}]},
        {"level": "None"},
    ],
}


def audit_pod_creates(audit_log: Path, namespace: str) -> list[float]:
    """Unix times, sorted, at which the API server received each successful pod create in
    `namespace` (a 201 is answered once per stored pod)."""
    out: list[float] = []
    for f in sorted(audit_log.parent.glob(audit_log.stem + "*" + audit_log.suffix)):
        with open(f) as fh:
            for line in fh:
                ev = json.loads(line)
                ref = ev.get("objectRef") or {}
                if (ev.get("verb") != "create" or ref.get("resource") != "pods"
                        or ref.get("namespace") != namespace or ref.get("subresource")
                        or (ev.get("responseStatus") or {}).get("code") != 201):
                    continue
                t = dt.datetime.fromisoformat(ev["requestReceivedTimestamp"].replace("Z", "+00:00"))
                out.append(t.timestamp())
    return sorted(out)


@dataclass
class Testbed:
    """One running (or stopped) test bed. `start()` returns when nodes are Ready."""

    __test__ = False

    state_dir: Path
    nodes: int = 20
    # Pod creates in an audit log (see AUDIT_POLICY). On for pytest sessions (the pacing test
    # reads it); off for benchmarks, whose arms should not pay for a log they do not read.
    audit: bool = False
    components: list[Proc] = field(default_factory=list)
    ports: dict[str, int] = field(default_factory=dict)
    # One node running real containers beside the kwok nodes (testbed/realnode.py).
    real_node: bool = False
    # Where the API server listens: 127.0.0.1, or the real node's IP (pods must reach it).
    bind_ip: str = "127.0.0.1"
    realnode: object = field(default=None, repr=False)  # a realnode.RealNode once prepared
    # Seconds to wait for the machine's one real-node slot while another test bed holds it.
    real_node_wait: float = 0.0

    # Paths -----------------------------------------------------------------------------
    @property
    def kubeconfig(self) -> Path:
        return self.state_dir / "kubeconfig"

    @property
    def logs(self) -> Path:
        return self.state_dir / "logs"

    @property
    def audit_log(self) -> Path:
        """JSON lines, one per pod create (see AUDIT_POLICY): the API server's own receive time
        of each create, to the microsecond, for tests that check pacing."""
        return self.logs / "audit.log"

    @property
    def server(self) -> str:
        return f"https://{self.bind_ip}:{self.ports['apiserver']}"

    @property
    def pki(self) -> pki.Pki:
        d = self.state_dir / "pki"
        return pki.Pki(*(d / n for n in ("ca.crt", "ca.key", "apiserver.crt", "apiserver.key",
                                         "admin.crt", "admin.key", "sa.key", "sa.pub")))

    # Lifecycle -------------------------------------------------------------------------
    def start(self, timeout: float = 120.0) -> Testbed:
        """Build (if needed), start every component, create the kwok nodes, wait for Ready.

        On any failure everything already started is stopped before the error propagates.
        """
        from testbed import realnode

        bins = build.build()
        etcd = str(bins["etcd"])
        # A crashed real node's mounts may be under the state dir: unmount before removing it.
        realnode.cleanup_leftovers(self.state_dir)
        remove_state_dir(self.state_dir)
        self.logs.mkdir(parents=True)
        (self.state_dir / "flex").mkdir()
        if self.real_node:
            self.realnode = realnode.RealNode(self, wait=self.real_node_wait)
            try:
                self.realnode.prepare()  # the node IP must exist before the API server binds it
            except BaseException:
                self.stop()
                raise
            self.bind_ip = self.realnode.node_ip
        p = pki.generate(self.state_dir / "pki",
                         extra_ips=(self.bind_ip,) if self.bind_ip != "127.0.0.1" else ())
        self.ports = {
            "etcd": _env_port("ETCD_PORT"), "etcd-peer": _env_port("ETCD_PEER_PORT"),
            "apiserver": _env_port("APISERVER_PORT"), "kwok": _env_port("KWOK_PORT"),
        }
        self.kubeconfig.write_text(pki.kubeconfig(p, self.server))
        audit_flags = []
        if self.audit:
            policy = self.state_dir / "audit-policy.json"
            policy.write_text(json.dumps(AUDIT_POLICY))
            audit_flags = [f"--audit-policy-file={policy}", f"--audit-log-path={self.audit_log}",
                           "--audit-log-format=json", "--audit-log-maxsize=1024",
                           "--audit-log-maxbackup=1"]
        kc = str(self.kubeconfig)
        etcd_url = f"http://127.0.0.1:{self.ports['etcd']}"
        peer_url = f"http://127.0.0.1:{self.ports['etcd-peer']}"
        specs = [
            ("etcd", [etcd, "--name", "default", "--data-dir", str(self.state_dir / "etcd"),
                      "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
                      "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                      "--initial-cluster", f"default={peer_url}",
                      # A throwaway store: fsync only costs create latency here.
                      "--unsafe-no-fsync", "--quota-backend-bytes", str(4 << 30)],
             ("etcd", "etcd-peer")),
            ("kube-apiserver", [
                str(bins["kube-apiserver"]), f"--etcd-servers={etcd_url}",
                f"--bind-address={self.bind_ip}", f"--advertise-address={self.bind_ip}",
                f"--secure-port={self.ports['apiserver']}",
                f"--tls-cert-file={p.apiserver_cert}", f"--tls-private-key-file={p.apiserver_key}",
                f"--client-ca-file={p.ca_cert}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={p.sa_pub}",
                f"--service-account-signing-key-file={p.sa_key}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--authorization-mode=Node,RBAC",
                # Without it the apiserver loops on an invalid loopback Endpoints object.
                "--endpoint-reconciler-type=none",
                # Burst tests create thousands of pods; the default 400 in-flight is the
                # production figure, kept, but the event TTL is short to keep etcd small.
                "--event-ttl=10m", "--profiling=false", *audit_flags,
                # logs/exec/port-forward dial a node by its InternalIP: by default the API
                # server first resolves the node's name, a DNS query to the machine's resolver.
                "--kubelet-preferred-address-types=InternalIP",
                # kubectl logs/exec on the real node: the kubelet trusts the test bed's CA.
                *([f"--kubelet-client-certificate={p.admin_cert}",
                   f"--kubelet-client-key={p.admin_key}",
                   # Webhooks behind a Service (the chart's) are called at a ready endpoint's
                   # pod IP, routed to the node's bridge. By default the API server dials the
                   # ClusterIP, which only kube-proxy's DNAT keeps on this machine: before it
                   # has synced, or with no endpoint, the packet would follow the default route.
                   "--enable-aggregator-routing=true"] if self.real_node else [])],
             ("apiserver",)),
        ]
        try:
            for name, cmd, port_names in specs:
                for pn in port_names:
                    host = self.bind_ip if pn == "apiserver" else "127.0.0.1"
                    if _port_in_use(self.ports[pn], host):
                        raise TestbedError(f"{name}: port {host}:{self.ports[pn]} is already in "
                                           f"use; log {self.logs / (name + '.log')}")
                comp = self._spawn(name, cmd)
                if name == "etcd":
                    self._wait(comp, lambda: _tcp_open(self.ports["etcd"]), 30, "accepting clients")
                else:
                    self._wait(comp, self._apiserver_ready, 60, "/readyz ok")
            cm = self._spawn("kube-controller-manager", [
                str(bins["kube-controller-manager"]), f"--kubeconfig={kc}",
                f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
                "--leader-elect=false", "--bind-address=127.0.0.1", "--secure-port=0",
                f"--flex-volume-plugin-dir={self.state_dir / 'flex'}",
                f"--service-account-private-key-file={p.sa_key}", f"--root-ca-file={p.ca_cert}",
                "--use-service-account-credentials=false",
                # Bursts of thousands of pods: the GC and namespace deletion must keep up.
                "--kube-api-qps=200", "--kube-api-burst=400"])
            sched = self._spawn("kube-scheduler", [
                str(bins["kube-scheduler"]), f"--kubeconfig={kc}",
                f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
                "--leader-elect=false", "--bind-address=127.0.0.1", "--secure-port=0",
                "--kube-api-qps=500", "--kube-api-burst=1000"])
            kwok_config = self.state_dir / "kwok.json"
            kwok_config.write_text(json.dumps(kwok_configuration(self.nodes)))
            kwok = self._spawn("kwok", [
                # Our own file: without --config kwok reads ~/.kwok/kwok.yaml, whatever is there.
                str(bins["kwok"]), f"--config={kwok_config}",
                f"--kubeconfig={kc}", "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake",
                f"--cidr={POD_CIDR}", f"--node-ip={NODE_IP}",
                # Node heartbeats by Lease: without them kwok refreshed node status about once
                # a minute, past the controller-manager's 50 s grace, so every ~55 s all nodes
                # went NotReady for a few seconds and their pods were marked NotReady for good.
                "--node-lease-duration-seconds=40",
                f"--server-address=127.0.0.1:{self.ports['kwok']}"])
            self._wait(cm, self._default_sa_exists, 60, "default ServiceAccount created")
            self._create_nodes()
            self._wait(kwok, self._nodes_ready, 60, f"{self.nodes} nodes Ready")
            if self.realnode is not None:
                self.realnode.start()
            self.check()
            _ = sched
        except BaseException:
            try:
                self.stop()
            except TestbedError as e:  # the start failure is the news; leftovers are said too
                print(f"testbed: {e}", file=sys.stderr)
            raise
        self._write_pids()
        return self

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> Proc:
        # Own session: a Ctrl-C on the terminal must not kill the bed behind pytest's back,
        # and stop() signals each component's whole group.
        comp = Proc(name, cmd, self.logs / f"{name}.log", cwd=self.state_dir, env=env).start()
        self.components.append(comp)
        # Recorded at once, not only when the start completes: `python -m testbed down` then
        # finds the processes of an `up` that crashed half-way.
        self._write_pids()
        return comp

    def _wait(self, comp: Proc, ready, timeout: float, what: str,
              watch: list[Proc] | None = None) -> None:
        """Until ready() is true; raise if it is not by `timeout` or if any of `watch` (the
        bed's components) exits meanwhile."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for c in self.components if watch is None else watch:
                if not c.alive():
                    raise TestbedError(f"{c.name}: exited with code {c.exit_code()} during start; "
                                       f"log {c.log}: {_tail(c.log)}")
            try:
                if ready():
                    return
            except Exception:  # noqa: BLE001 - not ready yet; the deadline decides
                pass
            time.sleep(0.1)
        raise TestbedError(f"{comp.name}: not {what} after {timeout:.0f}s; log {comp.log}: "
                           f"{_tail(comp.log)}")

    def check(self) -> None:
        """Raise if any component died: a crashed component must fail the run loudly."""
        for c in self.components:
            if not c.alive():
                raise TestbedError(f"{c.name}: died (exit {c.exit_code()}); log {c.log}: "
                                   f"{_tail(c.log)}")

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM in reverse start order, wait for each to exit, SIGKILL stragglers.

        The real node goes first and removes everything it put on the machine; what it could
        not remove raises TestbedError (after the rest is stopped), one line naming it."""
        left: list[str] = []
        if self.realnode is not None:
            self.realnode.stop(timeout)
        for c in reversed(self.components):
            c.stop(timeout)
        self.components = []
        # After the API server: it listens on the node IP that the cleanup removes (it would
        # spend 2 x 10 s failing to reach itself on the way out).
        if self.realnode is not None:
            left = self.realnode.cleanup()
        elif (self.state_dir / "realnode").exists():  # a real node this object did not start
            from testbed import realnode

            rec = realnode.read_record()
            if rec and rec.get("state_dir") == str(self.state_dir):
                left = realnode.cleanup(rec)
        pids = self.state_dir / "pids.json"
        if pids.exists():
            pids.unlink()
        if left:
            raise TestbedError(f"real node: left on the machine after stop: {'; '.join(left[:6])}"
                               f"; logs {self.logs}")

    # Readiness probes ------------------------------------------------------------------
    def _ssl(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.pki.ca_cert))
        ctx.load_cert_chain(str(self.pki.admin_cert), str(self.pki.admin_key))
        return ctx

    def request(self, method: str, path: str, body: dict | None = None) -> dict:
        """A tiny API call without the kubernetes client (used before it is needed)."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.server + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, context=self._ssl(), timeout=10) as r:
            raw = r.read()
        return json.loads(raw) if raw.startswith(b"{") else {"raw": raw.decode()}

    def _apiserver_ready(self) -> bool:
        return self.request("GET", "/readyz").get("raw") == "ok"

    def _default_sa_exists(self) -> bool:
        self.request("GET", "/api/v1/namespaces/default/serviceaccounts/default")
        return True

    def _nodes_ready(self) -> bool:
        items = self.request("GET", "/api/v1/nodes?labelSelector=type%3Dkwok")["items"]
        ready = [n for n in items for c in n.get("status", {}).get("conditions", [])
                 if c["type"] == "Ready" and c["status"] == "True"]
        return len(ready) >= self.nodes

    def _create_nodes(self) -> None:
        for i in range(self.nodes):
            self.request("POST", "/api/v1/nodes", node_manifest(i))

    # Bookkeeping for `testbed up` / `down` across processes ----------------------------
    def _write_pids(self) -> None:
        data = {"ports": self.ports, "nodes": self.nodes, "bind_ip": self.bind_ip,
                "realnode": self.realnode.to_dict() if self.realnode is not None else None,
                "components": [{"name": c.name, "pid": c.pid, "cmd": c.cmd, "log": str(c.log)}
                               for c in self.components]}
        (self.state_dir / "pids.json").write_text(json.dumps(data, indent=2))

    @classmethod
    def attach(cls, state_dir: Path) -> Testbed | None:
        """The test bed recorded in state_dir by an earlier `up`, or None."""
        f = state_dir / "pids.json"
        if not f.exists():
            return None
        data = json.loads(f.read_text())
        tb = cls(state_dir, nodes=data["nodes"], ports=data["ports"],
                 bind_ip=data.get("bind_ip", "127.0.0.1"))
        tb.components = [Proc(c["name"], c["cmd"], Path(c["log"]), pid=c["pid"])
                         for c in data["components"]]
        if data.get("realnode"):
            from testbed import realnode

            tb.real_node = True
            tb.realnode = realnode.RealNode.attach(tb, data["realnode"])
        return tb


def remove_state_dir(path: Path) -> None:
    """rmtree a state dir, but only after unmounting whatever a real node left mounted below it
    (container root filesystems, volumes, kubelet's own bind mount): rmtree would otherwise
    walk into them and delete what they expose."""
    if not path.exists():
        return
    from testbed import realnode

    still = realnode.unmount_all_under(path)
    if still:
        raise TestbedError(f"test bed: cannot remove {path}: still mounted {still[:3]}")
    shutil.rmtree(path)


def kwok_configuration(nodes: int) -> dict:
    """kwok's options (docs/testbed.md, "Tuning"). kwok plays every node's kubelet, and by
    default moves pods through their stages (scheduled -> Running/Ready, deleting -> gone) with
    4 workers for all its nodes together: on a real cluster each node's kubelet writes its own
    pods' status, so the writers in parallel are at least one per node. At 4, a status PATCH that
    takes 0.5 s on a loaded API server caps the whole bed at ~8 pods Ready per second."""
    return {"apiVersion": "config.kwok.x-k8s.io/v1alpha1", "kind": "KwokConfiguration",
            "options": {"podPlayStageParallelism": max(4, nodes)}}


def node_manifest(i: int) -> dict:
    name = f"kwok-node-{i:03d}"
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {KWOK_NODE_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "type": "kwok", "kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "topology.kubernetes.io/zone": ZONES[i % len(ZONES)],
                contract.LABEL_NODE_POOL_DEFAULT: "sandbox",
            },
        },
        # Big enough for the 12,000-sandbox ramp (2 CPU / 8Gi each) over 20 nodes. Without an
        # ephemeral-storage figure the scheduler fits no pod that requests any.
        "status": {
            "allocatable": {"cpu": "2000", "memory": "8Ti", "ephemeral-storage": "100Ti",
                            "pods": "1000"},
            "capacity": {"cpu": "2000", "memory": "8Ti", "ephemeral-storage": "100Ti",
                         "pods": "1000"},
            "nodeInfo": {"kubeletVersion": f"fake-{build.kubernetes_version()}",
                         "architecture": "amd64", "operatingSystem": "linux"},
        },
    }


def _env_port(name: str) -> int:
    v = os.environ.get(f"SANDMAN_TESTBED_{name}")
    return int(v) if v else reserve_port()


def _tcp_open(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=1):
        return True



def api_client(kubeconfig: Path, pool: int = 32) -> client.ApiClient:
    """A client of its own Configuration (never the process-wide default); `pool`
    connections, one per thread for threaded callers."""
    cfg = client.Configuration()
    config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
    cfg.connection_pool_maxsize = pool
    return client.ApiClient(cfg)


def new_namespace(core: client.CoreV1Api, name: str, timeout: float = 30.0) -> str:
    """Create namespace `name` and wait for its default ServiceAccount: pod creates are
    Forbidden until the controller-manager made it."""
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))

    def has_sa() -> bool:
        try:
            return bool(core.read_namespaced_service_account("default", name))
        except client.ApiException as e:
            if e.status != 404:
                raise
            return False

    wait_for(has_sa, timeout, f"the default ServiceAccount of namespace {name}", 0.1)
    return name


def delete_namespace(core: client.CoreV1Api, name: str) -> None:
    """Delete `name` (not waiting for it to go); a namespace already gone is fine."""
    try:
        core.delete_namespace(name, grace_period_seconds=0)
    except client.ApiException as e:
        if e.status != 404:
            raise


@dataclass
class Cluster:
    """A cluster to test against: the test bed's, or any other by kubeconfig (testbed None)."""

    kubeconfig: Path
    api_client: client.ApiClient
    testbed: Testbed | None = None

    @classmethod
    def connect(cls, kubeconfig: Path, testbed: Testbed | None = None) -> Cluster:
        return cls(Path(kubeconfig), api_client(Path(kubeconfig)), testbed)

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api_client)

    @property
    def admissionregistration(self) -> client.AdmissionregistrationV1Api:
        return client.AdmissionregistrationV1Api(self.api_client)

    @property
    def coordination(self) -> client.CoordinationV1Api:
        return client.CoordinationV1Api(self.api_client)

    def new_api_client(self, pool: int = 32) -> client.ApiClient:
        return api_client(self.kubeconfig, pool)

    def new_namespace(self, prefix: str = "t") -> str:
        """A fresh namespace `<prefix>-<6 hex>`, ready for pod creates."""
        return new_namespace(self.core,
                             f"{prefix[:40].rstrip('-').lower()}-{secrets.token_hex(3)}")

    def delete_namespace(self, name: str) -> None:
        delete_namespace(self.core, name)

    def check(self) -> None:
        """Raise if a component of the test bed died (nothing to check on another cluster)."""
        if self.testbed is not None:
            self.testbed.check()
