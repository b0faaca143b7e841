"""Run the real controller as a subprocess against the test bed, and audit pod ownership."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from sandman import contract
from testbed.cluster import free_port, repo_root


@dataclass
class ControllerProc:
    namespace: str
    kubeconfig: Path
    log: Path
    flags: list[str] = field(default_factory=list)
    port: int = 0
    proc: subprocess.Popen | None = None
    ready_check: str = "pod"  # kwok pods run nothing; `execd` needs a real execd at the pod IP

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, wait_ready: bool = True, timeout: float = 30) -> ControllerProc:
        self.port = self.port or free_port()
        cmd = [sys.executable, "-m", "controller", "serve", "--namespace", self.namespace,
               "--listen", f"127.0.0.1:{self.port}", "--kubeconfig", str(self.kubeconfig),
               "--ready-check", self.ready_check, *self.flags]
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                         cwd=repo_root(), start_new_session=True)
        if wait_ready:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 30, role: str | None = "leader") -> None:
        """Until /readyz answers 200 with `role` ("leader", "standby"; None: either). A standby
        is Ready too (it forwards to the leader), so tests that mean "this one leads" wait for
        the role."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"controller exited {self.proc.returncode}: "
                                   f"{self.log.read_text()[-2000:]}")
            try:
                r = httpx.get(self.url + "/readyz", timeout=1)
                if r.status_code == 200 and role in (None, r.json().get("role")):
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"controller not ready ({role or 'any role'}) after {timeout}s: "
                           f"{self.log.read_text()[-2000:]}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)


def pods(core, ns: str) -> list:
    return core.list_namespaced_pod(ns).items


def unowned(core, ns: str, ctl_url: str, handed: set[str], settle: float = 15.0) -> list[str]:
    """Pods nothing owns, after up to `settle` s for transient states to finish.

    Owned: leased and handed to a caller (`handed`), warm in the controller's books, or being
    deleted (deletionTimestamp or the deleting label)."""
    deadline = time.monotonic() + settle
    bad: list[str] = []
    while True:
        warm = set()
        try:
            items = httpx.get(ctl_url + "/v1/sandboxes", timeout=5).json()["items"]
            warm = {i["id"] for i in items if i["state"] in ("warm", "checking")}
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        bad = []
        for p in pods(core, ns):
            labels = p.metadata.labels or {}
            if labels.get(contract.LABEL_MANAGED_BY) != contract.MANAGED_BY_CONTROLLER:
                continue  # another tenant's pod: not ours to own
            if p.metadata.deletion_timestamp or labels.get(contract.LABEL_STATE) == \
                    contract.STATE_DELETING:
                continue
            if p.metadata.name in handed and labels.get(contract.LABEL_STATE) == \
                    contract.STATE_LEASED:
                continue
            if p.metadata.name in warm:
                continue
            bad.append(p.metadata.name)
        if not bad or time.monotonic() > deadline:
            return bad
        time.sleep(0.25)


def wait_for(pred, timeout: float, what: str, interval: float = 0.05):
    """`pred()`'s first truthy value, polled; AssertionError naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)
