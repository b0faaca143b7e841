"""What the real-node tests share: pods on the real node, waits, and ways to look inside.

Looking inside a pod needs nothing in its image: `netns()` runs a host program in the pod's
network namespace (it has the pod's IP, netguard's rules and NetworkPolicy's treatment), and
`execd()` talks to a sandbox's execd on the pod's own loopback (which netguard admits) with the
SDK's `Sandbox.connect`, so a test reads the container's view (/proc, cgroups) through execd.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

from kubernetes import client

from sandman.contract import ANNOTATION_TOKEN_SHA256, EXECD_PORT, LABEL_SANDBOX, NETGUARD_CONTAINER
from testbed import realnode
from testbed.trainer import (  # noqa: F401 - the e2e tests' trainer setup lives in testbed
    SDK_CA,
    SDK_CA_DIR,
    SDK_CA_MOUNT,
    SDK_CA_VOLUME,
    SDK_TOKEN_DIR,
    SDK_TOKEN_MOUNT,
    SDK_TOKEN_VOLUME,
    TRAINER_LABEL,
    bind_trainer,
    copy_ca,
    sdk_env,
)

PROBE = Path(__file__).with_name("probe.py")
TASK_IMAGE = "sandman.local/task:bookworm"
def sigkill_container(sandman, namespace: str, pod: str) -> int:
    """SIGKILL the pod's main container process on the node; returns its host PID."""
    rn = sandman.rn
    sid = rn.crictl("pods", "--namespace", f"^{namespace}$", "--name", f"^{pod}$", "-q",
                    "--state", "ready").stdout.split()
    assert sid, f"no sandbox for {namespace}/{pod}"
    cid = rn.crictl("ps", "-p", sid[0], "--state", "running", "-q").stdout.split()
    assert cid, f"no running container in {namespace}/{pod}"
    pid = json.loads(rn.crictl("inspect", "-o", "json", cid[0]).stdout)["info"]["pid"]
    os.kill(pid, signal.SIGKILL)
    return pid


def placement() -> dict:
    return realnode.placement()


def new_token() -> tuple[str, str]:
    token = secrets.token_hex(32)
    return token, hashlib.sha256(token.encode()).hexdigest()


def sandbox_pod(name: str, token_sha: str, *, cpu: str = "200m", memory: str = "192Mi",
                image: str = TASK_IMAGE, labels: dict | None = None,
                annotations: dict | None = None, security: dict | None = None) -> dict:
    """A pod as a plain client writes it: the label, the token hash, an unmodified image."""
    c = {"name": "task", "image": image, "imagePullPolicy": "IfNotPresent",
         "resources": {"limits": {"cpu": cpu, "memory": memory}}}
    if security:
        c["securityContext"] = security
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {LABEL_SANDBOX: "true", **(labels or {})},
                         "annotations": {ANNOTATION_TOKEN_SHA256: token_sha,
                                         **(annotations or {})}},
            "spec": {"containers": [c], "terminationGracePeriodSeconds": 1, **placement()}}


def plain_pod(name: str, *, labels: dict | None = None, image: str = TASK_IMAGE,
              command: list[str] | None = None, env: dict | None = None,
              restart: str = "Always", automount: bool = False) -> dict:
    """A pod that is no sandbox (no guard): a neighbour, a control, a trainer."""
    c = {"name": "main", "image": image, "imagePullPolicy": "IfNotPresent",
         "command": command or ["sleep", "3600"],
         "resources": {"limits": {"cpu": "50m", "memory": "64Mi"}}}
    if env:
        c["env"] = [{"name": k, "value": v} for k, v in env.items()]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": dict(labels or {})},
            "spec": {"containers": [c], "restartPolicy": restart,
                     "terminationGracePeriodSeconds": 1, "automountServiceAccountToken": automount,
                     **placement()}}


def assert_only_allowed(control: dict, got: dict, blocked: tuple[str, ...]) -> None:
    """Probes by name from an unguarded pod (`control`) and a guarded one (`got`): every
    target answers the control, so each block is the guard's; `allowed` gets through."""
    table = {k: (control[k], got[k]) for k in control}
    assert all(p.ok for p in control.values()), table
    assert got["allowed"].ok, table["allowed"]
    for k in blocked:
        assert not got[k].ok, (k, table[k])


def guard_rules(e2e, ns: str, pod, entry: str) -> str:
    """The filter table in a guarded pod's namespace, once its guard's args carry `entry`
    (what the webhook rendered from the pod's allowlist annotation)."""
    guard = next(c for c in pod.spec.init_containers if c.name == NETGUARD_CONTAINER)
    assert entry in " ".join(guard.args or []), guard.args
    return e2e.netns(ns, pod.metadata.name, ["iptables-save", "-t", "filter"]).stdout


def refusal(e2e, ns: str, body: dict) -> str:
    """The one-line message the admission chain refuses `body`'s create with."""
    try:
        e2e.create(ns, body)
    except client.ApiException as e:
        assert e.status in (400, 403, 422), e
        return json.loads(e.body)["message"]
    raise AssertionError(f"{body['metadata']['name']} was admitted")


def _ready(pod) -> bool:
    return any(c.type == "Ready" and c.status == "True"
               for c in (pod.status.conditions or []))


@dataclass
class Probe:
    ok: bool
    how: str
    detail: str


class E2E:
    """The real-node bed with sandman installed (tests/e2e/conftest.py)."""

    def __init__(self, cluster, inst) -> None:
        self.cluster = cluster
        self.inst = inst
        self.rn = cluster.testbed.realnode
        self.nodes: dict[str, object] = {}  # more real nodes by name (testbed/secondnode.py)
        self.install_error: str | None = None

    @property
    def core(self) -> client.CoreV1Api:
        return self.cluster.core

    # --- pods -----------------------------------------------------------------------------
    def create(self, ns: str, pod: dict):
        return self.core.create_namespaced_pod(ns, pod)

    def wait_pod(self, ns: str, name: str, pred, what: str, timeout: float = 120):
        deadline = time.monotonic() + timeout
        pod = None
        while time.monotonic() < deadline:
            pod = self.core.read_namespaced_pod(name, ns)
            if pred(pod):
                return pod
            time.sleep(0.5)
        raise AssertionError(f"pod {ns}/{name} not {what} after {timeout:.0f}s: "
                             f"{self.describe(ns, name, pod)}")

    def wait_ready(self, ns: str, name: str, timeout: float = 120):
        return self.wait_pod(ns, name, _ready, "Ready", timeout)

    def wait_done(self, ns: str, name: str, timeout: float = 300):
        return self.wait_pod(ns, name, lambda p: p.status.phase in ("Succeeded", "Failed"),
                             "finished", timeout)

    def run_ready(self, ns: str, *pods: dict, timeout: float = 120) -> dict:
        """Create pods and wait until all are Ready; returns name -> V1Pod."""
        for p in pods:
            self.create(ns, p)
        return {p["metadata"]["name"]: self.wait_ready(ns, p["metadata"]["name"], timeout)
                for p in pods}

    def describe(self, ns: str, name: str, pod=None) -> str:
        try:
            pod = pod or self.core.read_namespaced_pod(name, ns)
        except client.ApiException as e:
            return f"({e.status})"
        st = pod.status
        parts = [f"phase={st.phase}"]
        for c in (st.init_container_statuses or []) + (st.container_statuses or []):
            state = c.state
            s = ("running" if state.running else
                 f"waiting {state.waiting.reason}: {(state.waiting.message or '')[:200]}"
                 if state.waiting else
                 f"terminated {state.terminated.exit_code} {state.terminated.reason}: "
                 f"{(state.terminated.message or '')[:300]}" if state.terminated else "?")
            last = c.last_state.terminated if c.last_state else None
            if last is not None and last.message:  # FallbackToLogsOnError: the log's tail
                s += f" (last exit {last.exit_code}: {last.message.strip()[-300:]})"
            parts.append(f"{c.name}: {s} ready={c.ready} restarts={c.restart_count}")
        events = self.core.list_namespaced_event(
            ns, field_selector=f"involvedObject.name={name}").items
        parts += [f"event {e.reason}: {(e.message or '')[:200]}" for e in events[-6:]]
        return "; ".join(parts)

    def logs(self, ns: str, name: str, container: str | None = None) -> str:
        try:
            # The client returns None, not "", for a container that has printed nothing yet.
            return self.core.read_namespaced_pod_log(name, ns, container=container) or ""
        except client.ApiException as e:
            return f"(logs: {e.status} {e.reason})"

    def delete(self, ns: str, name: str, wait: bool = False, timeout: float = 60) -> None:
        try:
            self.core.delete_namespaced_pod(name, ns, grace_period_seconds=0)
        except client.ApiException as e:
            if e.status != 404:
                raise
        deadline = time.monotonic() + timeout
        while wait and time.monotonic() < deadline:
            try:
                self.core.read_namespaced_pod(name, ns)
            except client.ApiException as e:
                if e.status == 404:
                    return
                raise
            time.sleep(0.3)

    def ip(self, ns: str, name: str) -> str:
        return self.core.read_namespaced_pod(name, ns).status.pod_ip

    # --- inside a pod ---------------------------------------------------------------------
    def node_of(self, ns: str, name: str):
        """The real node (testbed RealNode) a pod runs on."""
        if not self.nodes:
            return self.rn
        return self.nodes.get(self.core.read_namespaced_pod(name, ns).spec.node_name, self.rn)

    def netns(self, ns: str, name: str, argv: list[str], timeout: float = 60
              ) -> subprocess.CompletedProcess:
        return self.node_of(ns, name).in_pod_netns(ns, name, argv, timeout=timeout)

    def probe(self, ns: str, name: str, *args: str) -> Probe:
        """One probe (tests/e2e/probe.py) from inside the pod's network namespace."""
        res = self.netns(ns, name, [sys.executable, "-I", str(PROBE), *args], timeout=30)
        assert res.returncode == 0, f"probe {args} from {ns}/{name}: {res.stderr[-800:]}"
        return Probe(**json.loads(res.stdout.strip().splitlines()[-1]))

    def execd(self, ns: str, name: str, token: str, body: str, timeout: float = 120) -> dict:
        """Run `body` (python, with `sb` a sandman.client.Sandbox on this pod's execd, reached
        over the pod's loopback) in the pod's network namespace; `out` (a dict) is returned."""
        script = (f"import json\nfrom sandman.client import Sandbox\nout = {{}}\n"
                  f"sb = Sandbox.connect('127.0.0.1', {EXECD_PORT}, {token!r})\ntry:\n"
                  + textwrap.indent(textwrap.dedent(body), "    ")
                  + "\nfinally:\n    sb.close()\nprint('E2E-OUT ' + json.dumps(out))\n")
        res = self.netns(ns, name, [sys.executable, "-c", script], timeout=timeout)
        lines = [ln for ln in res.stdout.splitlines() if ln.startswith("E2E-OUT ")]
        assert res.returncode == 0 and lines, (
            f"execd script in {ns}/{name} exited {res.returncode}: {res.stderr[-2000:]}")
        return json.loads(lines[-1][len("E2E-OUT "):])

    def sh(self, ns: str, name: str, token: str, command: str, timeout: float = 60) -> tuple:
        """(exit code, output) of one command in the sandbox's shell, through execd."""
        out = self.execd(ns, name, token, f"""
            r = sb.exec({command!r}, timeout={timeout})
            out['code'] = r.exit_code
            out['output'] = r.output
        """, timeout=timeout + 30)
        return out["code"], out["output"]


def crictl_exec(e2e: E2E, ns: str, name: str, argv: list[str], timeout: float = 30
                ) -> subprocess.CompletedProcess:
    """Run argv in a pod's first running container (crictl exec), for pods without execd."""
    pods = e2e.rn.crictl("pods", "--namespace", f"^{ns}$", "--name", f"^{name}$",
                         "--state", "ready", "-q").stdout.split()
    assert pods, f"no ready sandbox for {ns}/{name}"
    cids = e2e.rn.crictl("ps", "-p", pods[0], "--state", "running", "-q").stdout.split()
    assert cids, f"no running container in {ns}/{name}"
    return e2e.rn.crictl("exec", cids[0], *argv, timeout=timeout)
