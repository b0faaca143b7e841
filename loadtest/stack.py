"""A one-machine sandman for `make demo` and tests/loadtest: the test bed (testbed), the
webhook and the controller as local processes, optionally an execd kubelet, and locust runs.

Every process is started in its own session and stopped by its pid (SIGTERM, then SIGKILL);
`Stack.stop()` verifies that none is left.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from webhook.manifests import Registration

ROOT = Path(__file__).resolve().parents[1]
WEBHOOK_NAMESPACE = "sandman-system"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    name: str
    cmd: list[str]
    log: Path
    proc: subprocess.Popen | None = None

    def start(self) -> Proc:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen(self.cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                         start_new_session=True,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, n: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, timeout: float = 20.0) -> None:
        if not self.alive():
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def start_webhook(workdir: Path, timeout: float = 30.0) -> tuple[Proc, str, Path]:
    """`python3 -m webhook serve` over TLS on 127.0.0.1 (self-signed CA in workdir/certs)."""
    certdir = workdir / "certs"
    log = workdir / "webhook.log"
    seen = log.stat().st_size if log.exists() else 0  # a reused workdir keeps older lines
    p = Proc("webhook", [sys.executable, "-m", "webhook", "serve", "--host", "127.0.0.1",
                         "--port", "0", "--self-signed-dir", str(certdir), "--ip", "127.0.0.1",
                         "--log-level", "warning"], log).start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not p.alive():
            raise RuntimeError(f"webhook exited: {p.tail()}")
        m = re.search(r"serving https://127\.0\.0\.1:(\d+)",
                      log.read_bytes()[seen:].decode(errors="replace"))
        if m:
            return p, f"https://127.0.0.1:{m.group(1)}", certdir / "ca.crt"
        time.sleep(0.05)
    p.stop()
    raise RuntimeError(f"webhook did not start in {timeout:g} s: {p.tail()}")


def registration(admission_api, namespace: str, url: str, ca: bytes) -> Registration:
    """Both webhook configurations by `url:` with the CA, scoped to `namespace`."""
    return Registration(admission_api, f"sandman-lt-{namespace}-{secrets.token_hex(2)}", url, ca,
                        [namespace], WEBHOOK_NAMESPACE)


def probe_pod(namespace: str) -> dict:
    """A labelled sandbox pod as a trainer's own code would send it (the webhook completes it)."""
    from sandman import contract

    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"generateName": "lt-probe-",
                         "labels": {contract.LABEL_SANDBOX: contract.SANDBOX_TRUE,
                                    contract.LABEL_EGRESS: contract.EGRESS_DENY},
                         "annotations": {contract.ANNOTATION_TOKEN_SHA256: "0" * 64}},
            "spec": {"containers": [{"name": "task", "image": "registry.invalid/lt/task:1"}]}}


def wait_webhook_active(core, namespace: str, timeout: float = 20.0) -> None:
    """Until a dry-run create comes back mutated: the API server calls the webhook."""
    from kubernetes.client.rest import ApiException

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            got = core.create_namespaced_pod(namespace, probe_pod(namespace), dry_run="All")
            if got.spec.init_containers:
                return
        except ApiException:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"webhook configurations not active after {timeout:g} s")


def new_namespace(core, name: str, timeout: float = 30.0) -> str:
    core.create_namespace({"metadata": {"name": name}})
    deadline = time.monotonic() + timeout
    while True:  # pod creates are Forbidden until the default ServiceAccount exists
        try:
            core.read_namespaced_service_account("default", name)
            return name
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def start_controller(namespace: str, kubeconfig: Path, log: Path, flags: list[str],
                     ready_check: str = "pod", timeout: float = 30.0) -> tuple[Proc, str]:
    port = free_port()
    p = Proc("controller", [sys.executable, "-m", "controller", "serve", "--namespace", namespace,
                            "--listen", f"127.0.0.1:{port}", "--kubeconfig", str(kubeconfig),
                            "--ready-check", ready_check, *flags], log).start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not p.alive():
            raise RuntimeError(f"controller exited: {p.tail()}")
        try:
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                return p, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    p.stop()
    raise RuntimeError(f"controller not ready after {timeout:g} s: {p.tail()}")


def start_kubelet(namespace: str, kubeconfig: Path, log: Path, max_procs: int = 100) -> Proc:
    return Proc("kubelet", [sys.executable, "-m", "loadtest.kubelet", "--kubeconfig",
                            str(kubeconfig), "--namespace", namespace, "--max-procs",
                            str(max_procs)], log).start()


def locust(locustfile: str, args: list[str], log: Path, timeout: float) -> int:
    """One headless locust run as a subprocess; its exit code is the thresholds' verdict."""
    cmd = [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtest" / locustfile),
           "--headless", "--only-summary", "--loglevel", "INFO", *args]
    p = Proc("locust", cmd, log).start()
    try:
        return p.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        p.stop()
        return 124


@dataclass
class Stack:
    """Test bed + webhook (registered by url:) + controller, all local; `stop()` tears down."""

    workdir: Path
    nodes: int = 20
    namespace: str = "sandboxes"
    controller_flags: list[str] = field(default_factory=list)
    ready_check: str = "pod"
    kubelet: bool = False
    procs: list[Proc] = field(default_factory=list)
    testbed: object = None
    state_dir: Path | None = None  # the test bed's (default: workdir/testbed)
    registration: Registration | None = None
    controller_url: str = ""
    webhook_url: str = ""
    webhook_ca: Path | None = None

    @property
    def kubeconfig(self) -> Path:
        return self.testbed.kubeconfig

    def start(self, say=print) -> Stack:
        from kubernetes import client, config

        from testbed.cluster import Testbed

        self.workdir.mkdir(parents=True, exist_ok=True)
        t = time.monotonic()
        self.testbed = Testbed(self.state_dir or self.workdir / "testbed", nodes=self.nodes)
        self.testbed.start()
        say(f"test bed up ({self.nodes} kwok nodes) in {time.monotonic() - t:.1f} s; "
            f"KUBECONFIG={self.kubeconfig}")
        cfg = client.Configuration()
        config.load_kube_config(config_file=str(self.kubeconfig), client_configuration=cfg)
        api = client.ApiClient(cfg)
        self.core = client.CoreV1Api(api)
        new_namespace(self.core, self.namespace)
        wh, self.webhook_url, self.webhook_ca = start_webhook(self.workdir / "webhook")
        self.procs.append(wh)
        self.registration = registration(client.AdmissionregistrationV1Api(api), self.namespace,
                                         self.webhook_url, self.webhook_ca.read_bytes()).create()
        wait_webhook_active(self.core, self.namespace)
        say(f"webhook serving {self.webhook_url}, registered by url: for namespace "
            f"{self.namespace}")
        if self.kubelet:
            self.procs.append(start_kubelet(self.namespace, self.kubeconfig,
                                            self.workdir / "kubelet.log"))
        ctl, self.controller_url = start_controller(
            self.namespace, self.kubeconfig, self.workdir / "controller.log",
            self.controller_flags, self.ready_check)
        self.procs.append(ctl)
        say(f"controller ready at {self.controller_url} ({' '.join(self.controller_flags)})")
        return self

    def stop(self) -> list[str]:
        """Stops everything, newest first; returns what is still running (should be nothing)."""
        for p in reversed(self.procs):
            p.stop()
        if self.registration is not None:
            try:
                self.registration.delete()
            except Exception:  # noqa: BLE001 - the test bed goes next anyway
                pass
        comps = list(self.testbed.components) if self.testbed is not None else []
        if self.testbed is not None:
            self.testbed.stop()
        return [p.name for p in self.procs if p.alive()] + [c.name for c in comps if c.alive()]
