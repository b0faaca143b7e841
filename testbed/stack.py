"""A one-machine sandman for `make demo` and tests/loadtest: the test bed, the webhook
(registered by `url:`) and the controller as local processes, optionally the kubelet stand-in
(a real execd per pod), and headless locust runs.

Every process is started in its own session and stopped by its pid (SIGTERM, then SIGKILL);
`Stack.stop()` returns what is still running, which should be nothing.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from testbed.cluster import Testbed, new_namespace
from testbed.controller import ControllerProc, start_controller
from testbed.procs import ROOT, Proc
from testbed.standin import start_standin
from testbed.webhook import registration, start_webhook, wait_webhook_active
from webhook.manifests import Registration


def locust(locustfile: str, args: list[str], log: Path, timeout: float,
           on_start: Callable[[Proc], None] | None = None) -> int:
    """One headless locust run of loadtest/<locustfile> (a path with a `/`: relative to the
    repository) as a process; its exit code is the thresholds' verdict (124 when it ran past
    `timeout` s and was stopped). `on_start(proc)` once it is started (a CPU sampler)."""
    path = ROOT / locustfile if "/" in locustfile else ROOT / "loadtest" / locustfile
    cmd = [sys.executable, "-m", "locust", "-f", str(path),
           "--headless", "--only-summary", "--loglevel", "INFO", *args]
    p = Proc("locust", cmd, log).start()
    try:
        if on_start is not None:
            on_start(p)
        return p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.stop()
        return 124


@dataclass
class Stack:
    """Test bed + webhook (registered by url:) + controller [+ stand-in], all local."""

    workdir: Path
    nodes: int = 20
    namespace: str = "sandboxes"
    controller_flags: list[str] = field(default_factory=list)
    ready_check: str = "pod"
    standin: bool = False  # a real execd per pod (testbed/standin.py); for --ready-check execd
    state_dir: Path | None = None  # the test bed's (default: workdir/testbed)
    testbed: Testbed | None = None
    registration: Registration | None = None
    controller: ControllerProc | None = None
    webhook_url: str = ""
    webhook_ca: Path | None = None
    procs: list[Proc] = field(default_factory=list)

    @property
    def kubeconfig(self) -> Path:
        return self.testbed.kubeconfig

    @property
    def controller_url(self) -> str:
        return self.controller.url if self.controller else ""

    def start(self, say=print) -> Stack:
        """Starts everything; on any failure stops what was started and re-raises."""
        try:
            return self._start(say)
        except BaseException:
            self.stop()
            raise

    def _start(self, say) -> Stack:
        from kubernetes import client, config

        self.workdir.mkdir(parents=True, exist_ok=True)
        t = time.monotonic()
        self.testbed = Testbed(self.state_dir or self.workdir / "testbed", nodes=self.nodes)
        self.testbed.start()
        say(f"test bed up ({self.nodes} kwok nodes) in {time.monotonic() - t:.1f} s; "
            f"KUBECONFIG={self.kubeconfig}")
        cfg = client.Configuration()
        config.load_kube_config(config_file=str(self.kubeconfig), client_configuration=cfg)
        api = client.ApiClient(cfg)
        core = client.CoreV1Api(api)
        new_namespace(core, self.namespace)
        wh = start_webhook(self.workdir / "webhook", "--log-level", "warning")
        self.procs.append(wh.proc)
        self.webhook_url, self.webhook_ca = wh.url, wh.ca
        self.registration = registration(client.AdmissionregistrationV1Api(api), self.namespace,
                                         wh.url, wh.ca.read_bytes(), "sandman-lt").create()
        wait_webhook_active(core, self.namespace)
        say(f"webhook serving {self.webhook_url}, registered by url: for namespace "
            f"{self.namespace}")
        if self.standin:
            self.procs.append(start_standin(self.namespace, self.kubeconfig,
                                            self.workdir / "standin.log"))
        self.controller = start_controller(self.namespace, self.kubeconfig,
                                           self.workdir / "controller.log",
                                           self.controller_flags, self.ready_check)
        self.procs.append(self.controller.proc)
        say(f"controller ready at {self.controller_url} ({' '.join(self.controller_flags)})")
        return self

    def pids(self) -> dict[str, int]:
        """name -> pid of every process this stack started (the test bed's components, the
        webhook, the controller, the stand-in), for a CPU and memory sampler."""
        comps = self.testbed.components if self.testbed is not None else []
        return {p.name: p.pid for p in [*comps, *self.procs] if p.pid is not None}

    def stop(self) -> list[str]:
        """Stops everything, newest first; returns what is still running (should be nothing)."""
        for p in reversed(self.procs):
            p.stop()
        if self.registration is not None:
            try:
                self.registration.delete()
            except Exception:  # noqa: BLE001 - the test bed goes next anyway
                pass
            self.registration = None
        comps = list(self.testbed.components) if self.testbed is not None else []
        if self.testbed is not None:
            self.testbed.stop()
        return [p.name for p in self.procs if p.alive()] + [c.name for c in comps if c.alive()]
