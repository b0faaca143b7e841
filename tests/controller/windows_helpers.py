"""Harness for the ownership-window tests (test_windows.py): the controller as a real
subprocess behind the fault proxy, callers as real HTTP clients that can hang up mid-request, a
gated stand-in execd on a pod's address, and the independent auditor."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
from kubernetes import client

from sandman import contract
from testbed import controller as testbed_controller
from testbed.procs import wait_for
from tests.controller.faultproxy import FaultProxy

REPO = Path(__file__).resolve().parents[2]
# Run the windows against another controller tree (an older version, a mutant), as the paper ran
# them against four versions: a directory holding controller/ and sandman/.
CONTROLLER_ROOT = Path(os.environ.get("SANDMAN_WINDOWS_CONTROLLER_ROOT") or REPO)
IMAGE = "registry.invalid/sandbox:1"  # kwok runs no container: never pulled
SPEC = {"cpu": "100m", "memory": "64Mi"}
JOB = "win"
ROLLOUT = {"role": "rollout"}  # per-caller labels: not warm-eligible (deleted when abandoned)
# After a hang-up the test waits this long before it releases a hold, so the controller has
# learned that the caller is gone (the API sees the disconnect at once; slack for a loaded host).
CANCEL_SETTLE_S = 0.5
FOREIGN = {"tenant": "other"}
POOL_JOB = "sandman-pool"  # the job of warm pods (controller.books.POOL_JOB)  # another tenant's pods: no sandman labels


# ---- the controller ---------------------------------------------------------------------------
class ControllerProc(testbed_controller.ControllerProc):
    """The shared controller starter (testbed/controller.py) run from CONTROLLER_ROOT against
    the proxy's kubeconfig, one per window test, with the windows' flags, a new log file per
    (re)start on the same port (the one it bound at its first start), and an HTTP client for
    its API."""

    def __init__(self, namespace: str, kubeconfig: Path, workdir: Path, args: list[str]):
        self.lease = f"win-{secrets.token_hex(3)}"
        super().__init__(namespace, kubeconfig, workdir / "controller-0.log", [
            "--lease-name", self.lease, "--lease-duration", "2", "--lease-renew", "0.5",
            # The sweep is the backstop, not the owner: off here so every window tests the
            # owner tasks alone (test_sweep_backstop turns it on).
            "--sweep-interval", "3600", "--sweep-grace", "3600",
            "--log-level", "INFO", *args], cwd=CONTROLLER_ROOT)
        self.ns = namespace
        self.workdir = workdir
        self.logs: list[Path] = []
        self._http: httpx.Client | None = None

    @property
    def http(self) -> httpx.Client:
        """The API client, made once the first start has the port."""
        if self._http is None:
            assert self.port, "the controller has not started yet"
            self._http = httpx.Client(base_url=self.url, timeout=10)
        return self._http

    def start(self, timeout: float = 60.0) -> ControllerProc:
        self.log = self.workdir / f"controller-{len(self.logs)}.log"
        self.logs.append(self.log)
        return super().start(timeout=timeout)

    def close(self) -> None:
        self.stop(timeout=5)
        if self._http is not None:
            self._http.close()

    def tail(self, n: int = 40) -> str:
        if not self.logs:
            return ""
        return "\n".join(self.logs[-1].read_text(errors="replace").splitlines()[-n:])

    def log_text(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in self.logs if p.exists())

    # API
    def sandboxes(self) -> list[dict]:
        r = self.http.get("/v1/sandboxes")
        r.raise_for_status()
        return r.json()["items"]

    def acquire(self, **kw) -> httpx.Response:
        return self.http.post("/v1/sandboxes", json=acquire_body(**kw), timeout=60)

    def release(self, sid: str) -> dict:
        r = self.http.delete(f"/v1/sandboxes/{sid}")
        r.raise_for_status()
        return r.json()

    def prewarm(self, count: int, idle_timeout_s: float | None = None) -> dict:
        body = {"image": IMAGE, "spec": dict(SPEC), "count": count}
        if idle_timeout_s is not None:
            body["idle_timeout_s"] = idle_timeout_s
        r = self.http.post("/v1/prewarm", json=body)
        r.raise_for_status()
        return r.json()

    def drain(self, job: str) -> dict:
        r = self.http.post(f"/v1/jobs/{job}/drain")
        r.raise_for_status()
        return r.json()


def acquire_body(labels: dict | None = None, timeout_s: float | None = None, job: str = JOB,
                 **extra) -> dict:
    body = {"image": IMAGE, "job": job, **SPEC, **extra}
    if labels:
        body["labels"] = labels
    if timeout_s is not None:
        body["timeout_s"] = timeout_s
    return body


# ---- callers ----------------------------------------------------------------------------------
class Caller:
    """One acquire over its own connection, in a thread. `hang_up()` closes the connection
    mid-request: the caller is gone, exactly as a client that crashed or was cancelled."""

    def __init__(self, port: int, body: dict):
        self.body = body
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        self.sent = threading.Event()
        self.done = threading.Event()
        self.status: int | None = None
        self.result: dict | None = None
        self.error: BaseException | None = None
        self.hung_up = False
        self._t = threading.Thread(target=self._run, daemon=True, name="caller")
        self._t.start()
        if not self.sent.wait(10):
            raise AssertionError("the acquire request could not be sent")

    def _run(self) -> None:
        try:
            data = json.dumps(self.body).encode()
            self.conn.request("POST", "/v1/sandboxes", body=data,
                              headers={"Content-Type": "application/json"})
            self.sent.set()
            resp = self.conn.getresponse()
            self.status = resp.status
            self.result = json.loads(resp.read() or b"null")
        except BaseException as e:  # noqa: BLE001 - recorded for the test
            self.error = e
        finally:
            self.sent.set()
            self.done.set()

    def hang_up(self) -> None:
        self.hung_up = True
        sock = self.conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self.conn.close()
        self._t.join(5)

    def wait(self, timeout: float = 30.0) -> tuple[int | None, dict | None]:
        if not self.done.wait(timeout):
            raise AssertionError(f"the acquire did not answer within {timeout:g}s")
        return self.status, self.result


# ---- a stand-in execd on a pod's loopback address, with a gate on its readiness route ------
class GatedExecd:
    def __init__(self, ip: str, port: int = contract.EXECD_PORT):
        self.reached = threading.Event()
        self.release = threading.Event()
        self.hits = 0
        gate = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                gate.hits += 1
                gate.reached.set()
                gate.release.wait(10)  # bounded: an unreleased gate answers after 10 s
                body = json.dumps({"ok": True}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        class S(ThreadingHTTPServer):
            daemon_threads = True
            allow_reuse_address = True

        self.server = S((ip, port), H)
        self._t = threading.Thread(target=self.server.serve_forever, kwargs={
            "poll_interval": 0.1}, daemon=True)
        self._t.start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


# ---- kwok node heartbeats ----------------------------------------------------------------------
class NodeLeaseKeeper:
    """Renews a Lease in kube-node-lease for every kwok node that has none of its own.

    Workaround for a test-bed flap: kwok (without --node-lease-duration-seconds) refreshes a
    node's status about once a minute, the controller-manager's node-monitor grace period is
    50 s, so every minute all nodes go NotReady for ~5 s and the pods on them are marked
    NotReady for good. A window that waits for Ready then never sees it. The node lifecycle
    controller takes a renewed node Lease as a heartbeat. Leases held by anyone else (a real
    kubelet, kwok with leases on) are left alone.
    """

    HOLDER = "sandman-window-tests"

    def __init__(self, api: client.ApiClient, period: float = 5.0):
        self.core = client.CoreV1Api(api)
        self.coord = client.CoordinationV1Api(api)
        self.period = period
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True, name="node-lease-keeper")

    def start(self) -> NodeLeaseKeeper:
        self.renew()
        self._t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._t.join(10)
        with contextlib.suppress(Exception):
            for lease in self.coord.list_namespaced_lease("kube-node-lease").items:
                if lease.spec.holder_identity == self.HOLDER:
                    self.coord.delete_namespaced_lease(lease.metadata.name, "kube-node-lease")

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            with contextlib.suppress(Exception):
                self.renew()

    def renew(self) -> None:
        import datetime as dt

        now = dt.datetime.now(dt.UTC)
        for node in self.core.list_node(label_selector="type=kwok").items:
            name = node.metadata.name
            try:
                lease = self.coord.read_namespaced_lease(name, "kube-node-lease")
            except client.ApiException as e:
                if e.status != 404:
                    raise
                body = client.V1Lease(
                    metadata=client.V1ObjectMeta(name=name, namespace="kube-node-lease"),
                    spec=client.V1LeaseSpec(holder_identity=self.HOLDER,
                                            lease_duration_seconds=40, renew_time=now))
                with contextlib.suppress(client.ApiException):
                    self.coord.create_namespaced_lease("kube-node-lease", body)
                continue
            if lease.spec.holder_identity != self.HOLDER:
                continue
            lease.spec.renew_time = now
            with contextlib.suppress(client.ApiException):
                self.coord.replace_namespaced_lease(name, "kube-node-lease", lease)


# ---- the test bed around one window ----------------------------------------------------------
@dataclass
class Window:
    """Proxy + controller + namespace for one window test, and the auditor."""

    core: client.CoreV1Api
    ns: str
    proxy: FaultProxy
    ctl: ControllerProc
    held: dict = field(default_factory=dict)  # pod name -> sandbox id, still held by a caller
    foreign: dict = field(default_factory=dict)  # pod name -> uid, another tenant's pods
    hits: int = 0

    # -- pods of another tenant
    def foreign_pod(self, name: str) -> str:
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": name, "labels": dict(FOREIGN)},
               "spec": {"containers": [{"name": "c", "image": "other-tenant/app:1"}],
                        "terminationGracePeriodSeconds": 0}}
        uid = self.core.create_namespaced_pod(self.ns, pod).metadata.uid
        self.foreign[name] = uid
        return uid

    def pod(self, name: str):
        try:
            return self.core.read_namespaced_pod(name, self.ns)
        except client.ApiException as e:
            if e.status == 404:
                return None
            raise

    def pod_ip(self, name: str, timeout: float = 15.0) -> str:
        def ip():
            p = self.pod(name)
            return p.status.pod_ip if p is not None and p.status else None
        return wait_for(ip, timeout, f"an address for pod {name}")

    def wait_ready(self, name: str, timeout: float = 20.0) -> str:
        """The pod is Ready in the API server (whatever the controller knows); its address."""
        def ready():
            p = self.pod(name)
            if p is None or p.status is None:
                return None
            ok = any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
            return p.status.pod_ip if ok and p.status.pod_ip else None
        return wait_for(ready, timeout, f"pod {name} Ready in the API server")

    def wait_gone(self, name: str, timeout: float, what: str = "") -> None:
        wait_for(lambda: self.pod(name) is None, timeout,
                   f"pod {name} to be deleted {what}".strip())

    def hand(self, result: dict) -> dict:
        """A sandbox the test (as its caller) now holds."""
        self.held[result["pod"]] = result["id"]
        return result

    def describe_pods(self) -> str:
        """One line per pod: phase, Ready, node, labels (for failure messages)."""
        lines = []
        for p in self.core.list_namespaced_pod(self.ns).items:
            conds = {c.type: c.status for c in (p.status.conditions or [])} if p.status else {}
            labels = p.metadata.labels or {}
            lines.append(f"{p.metadata.name}: phase={p.status.phase if p.status else None} "
                         f"ready={conds.get('Ready')} node={p.spec.node_name} "
                         f"state={labels.get(contract.LABEL_STATE)} "
                         f"deleting={bool(p.metadata.deletion_timestamp)}")
        return "\n".join(lines) or "(no pods)"

    # -- the auditor
    def unowned(self) -> list[str]:
        """Pods in the namespace that nobody owns: not held by a caller, not warm in the
        controller's books, not being deleted; and any harm done to another tenant's pods."""
        pods = self.core.list_namespaced_pod(self.ns).items
        items = self.ctl.sandboxes()
        warm = {i["pod"] for i in items if i["state"] == "warm"}
        bad = []
        present = {}
        for p in pods:
            name, labels = p.metadata.name, p.metadata.labels or {}
            present[name] = p.metadata.uid
            if name in self.foreign:
                continue
            if labels.get("tenant") == FOREIGN["tenant"]:
                bad.append(f"{name}: a foreign pod the test did not create")
                continue
            if name in self.held or name in warm:
                continue
            if p.metadata.deletion_timestamp or labels.get(
                    contract.LABEL_STATE) == contract.STATE_DELETING:
                continue
            state = next((i["state"] for i in items if i["pod"] == name), "not in the books")
            bad.append(f"{name}: state label {labels.get(contract.LABEL_STATE)!r}, "
                       f"controller: {state}")
        for name, uid in self.foreign.items():
            if present.get(name) != uid:
                bad.append(f"{name}: another tenant's pod was deleted or replaced")
        return bad

    def audit(self, timeout: float = 10.0) -> None:
        """Every pod owned (transient states get `timeout` to settle)."""
        deadline = time.monotonic() + timeout
        while True:
            bad = self.unowned()
            if not bad:
                return
            if time.monotonic() > deadline:
                raise AssertionError("pods without an owner:\n  " + "\n  ".join(bad)
                                     + f"\ncontroller log tail:\n{self.ctl.tail()}")
            time.sleep(0.1)

    def settle(self, timeout: float = 10.0) -> None:
        """After the test's callers released everything: no sandman pod is left at all (a
        pod 'being deleted' must really go), and another tenant's pods are untouched."""
        def leftovers():
            left = [p.metadata.name for p in self.core.list_namespaced_pod(self.ns).items
                    if p.metadata.name not in self.foreign]
            return left
        deadline = time.monotonic() + timeout
        while True:
            left = leftovers()
            if not left:
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"pods left after the trial: {left}\n"
                                     f"books: {self.ctl.sandboxes()}\n"
                                     f"controller log tail:\n{self.ctl.tail()}")
            time.sleep(0.1)
        for name in self.foreign:
            recs = [r for r in self.proxy.since(0, name=name) if r.method in ("DELETE", "PATCH",
                                                                               "PUT")]
            assert not recs, f"the controller wrote to another tenant's pod {name}: {recs}"
        bad = [n for n, uid in self.foreign.items()
               if (p := self.pod(n)) is None or p.metadata.uid != uid]
        assert not bad, f"another tenant's pods deleted or replaced: {bad}"

    @contextlib.contextmanager
    def trial(self, i: int):
        """One repeat: a sentinel pod of another tenant, then the window, then the audit,
        the callers' releases and the check that nothing is left."""
        sentinel = f"sentinel-{i}-{secrets.token_hex(2)}"
        self.foreign_pod(sentinel)
        mark = self.proxy.mark()
        try:
            yield mark
            self.proxy.clear()
            self.audit()
            for name, sid in list(self.held.items()):
                self.ctl.release(sid)
                del self.held[name]
            if any(s["state"] == "warm" for s in self.ctl.sandboxes()):
                # Parked or prewarmed pods belong to the pool's job: its drain empties them
                # (tests that prewarm set the target back to 0 themselves).
                self.ctl.drain(POOL_JOB)
            self.settle()
            self.hits += 1
        finally:
            self.proxy.clear()
        # The sentinel survived (checked in settle); remove it so trials stay independent.
        with contextlib.suppress(client.ApiException):
            self.core.delete_namespaced_pod(sentinel, self.ns, grace_period_seconds=0)
        self.foreign.pop(sentinel, None)


def created_pod(proxy: FaultProxy, mark: int, timeout: float = 10.0,
                pred=lambda r: True) -> str:
    """The name of the first pod create the proxy saw since `mark`."""
    recs = wait_for(lambda: [r for r in proxy.since(mark, "POST", r"/pods$") if pred(r)],
                      timeout, "a pod create at the proxy")
    return recs[0].name


def patched_state(proxy: FaultProxy, mark: int, name: str) -> list[str]:
    """The sandman state labels the controller patched onto pod `name`, in order."""
    out = []
    for r in proxy.since(mark, "PATCH", name=name):
        labels = ((r.body or {}).get("metadata") or {}).get("labels") or {}
        if contract.LABEL_STATE in labels:
            out.append(labels[contract.LABEL_STATE])
    return out


def deletes(proxy: FaultProxy, mark: int, name: str) -> list:
    return proxy.since(mark, "DELETE", name=name)
