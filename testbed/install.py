"""The whole product on the test bed's real node: `helm install --wait` of charts/sandman.

`make testbed-up REAL_NODE=1 INSTALL=1` (or `python -m testbed.install up` on a bed that is
already up with a real node) and the e2e suite's fixture (tests/e2e/conftest.py) both use
`Install`: the webhook (3 replicas), its certificate Job, the controller (2 replicas) and the
sandboxes are real pods on the real node, from the image `testbed/images.py` builds here.

What it does besides `helm install`, and why:
- builds (once, cached) and imports the sandman and task images into the node's containerd:
  nothing can be pulled here;
- creates the sandbox namespace (`sandboxes`; the chart requires it to exist);
- makes the real node the only place new pods go while sandman is installed: it lifts the real
  node's NoSchedule taint (the controller puts a nodeSelector but no toleration on the pods it
  builds, and the `helm test` pod has no placement values at all) and cordons the kwok nodes
  (a pod there is "Running" without any container). `restore_nodes()` undoes both; uninstall
  calls it.

Values: testbed/values-realnode.yaml (resources scaled to the 2-CPU node, placement on the
real node, the local task image for `helm test`) plus the image reference set here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from testbed import build

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "sandman"
VALUES = Path(__file__).with_name("values-realnode.yaml")
RELEASE = "sandman"
NAMESPACE = "sandman-system"
SANDBOX_NAMESPACE = "sandboxes"
# Cluster-scoped objects the chart renders: after an uninstall none may carry the release.
CLUSTER_KINDS = ("mutatingwebhookconfigurations", "validatingwebhookconfigurations",
                 "validatingadmissionpolicies", "validatingadmissionpolicybindings",
                 "clusterroles", "clusterrolebindings", "priorityclasses")
# Kinds checked for leftovers after an uninstall (besides CLUSTER_KINDS), in every namespace.
NAMESPACED_KINDS = ("deployments", "replicasets", "pods", "services", "serviceaccounts",
                    "roles", "rolebindings", "networkpolicies", "poddisruptionbudgets", "jobs",
                    "cronjobs", "secrets", "configmaps", "leases.coordination.k8s.io",
                    "servicemonitors.monitoring.coreos.com")
NODES_RECORD = "install-nodes.json"


class InstallError(RuntimeError):
    """One line saying which step failed, with the tail of its output."""


def _tail(text: str, n: int = 1500) -> str:
    return text.strip()[-n:].replace("\n", " | ")


class Install:
    """charts/sandman on one test bed with a real node (`tb.realnode`)."""

    def __init__(self, tb, release: str = RELEASE, namespace: str = NAMESPACE,
                 sandbox_namespace: str = SANDBOX_NAMESPACE) -> None:
        if getattr(tb, "realnode", None) is None:
            raise InstallError("install: the test bed has no real node (make testbed-up "
                               "REAL_NODE=1): kwok nodes run no container")
        self.tb = tb
        self.release, self.namespace, self.sandbox_namespace = release, namespace, sandbox_namespace
        self.dir = Path(tb.state_dir) / "install"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.kubeconfig = Path(tb.kubeconfig)
        self.image_ref: str | None = None
        self.task_ref: str | None = None
        self.timings: dict[str, float] = {}

    # --- helm and kubectl, isolated from the user's own config ------------------------------
    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("HELM_")}
        home = self.dir / "helm"
        env.update(HELM_CACHE_HOME=str(home / "cache"), HELM_CONFIG_HOME=str(home / "config"),
                   HELM_DATA_HOME=str(home / "data"), KUBECONFIG=str(self.kubeconfig))
        return env

    def helm(self, *args: str, check: bool = True, timeout: float = 600
             ) -> subprocess.CompletedProcess:
        res = subprocess.run([str(build.helm_path()), *args], env=self._env(),
                             capture_output=True, text=True, timeout=timeout)
        if check and res.returncode != 0:
            raise InstallError(f"helm {' '.join(args[:2])} exited {res.returncode}: "
                               f"{_tail(res.stderr + res.stdout)}")
        return res

    def kubectl(self, *args: str, check: bool = True, timeout: float = 120,
                stdin: str | None = None) -> subprocess.CompletedProcess:
        res = subprocess.run([str(build.binaries()["kubectl"]), "--kubeconfig",
                              str(self.kubeconfig), *args], capture_output=True, text=True,
                             timeout=timeout, input=stdin)
        if check and res.returncode != 0:
            raise InstallError(f"kubectl {' '.join(args[:3])} exited {res.returncode}: "
                               f"{_tail(res.stderr + res.stdout)}")
        return res

    def kget(self, *args: str) -> dict:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    # --- preparation --------------------------------------------------------------------------
    def load_images(self) -> None:
        """Build (cached) and import the sandman and task images into the node's containerd."""
        t0 = time.monotonic()
        self.task_ref, self.image_ref = self.tb.realnode.load_images("task", "sandman")
        self.timings["images"] = time.monotonic() - t0

    def image_args(self) -> list[str]:
        if self.image_ref is None:
            self.load_images()
        repo, tag = self.image_ref.rsplit(":", 1)
        return ["--set", f"image.repository={repo}", "--set-string", f"image.tag={tag}"]

    def ensure_namespace(self, name: str) -> None:
        if self.kubectl("get", "namespace", name, check=False).returncode != 0:
            self.kubectl("create", "namespace", name)

    def _nodes(self) -> tuple[str, list[str]]:
        from testbed import realnode

        names = [n["metadata"]["name"] for n in self.kget("nodes")["items"]]
        return realnode.NODE_NAME, [n for n in names if n != realnode.NODE_NAME]

    def isolate_nodes(self) -> None:
        """New pods go to the real node only (see the module docstring); recorded first."""
        from testbed import realnode

        real, others = self._nodes()
        node = self.kget("node", real)
        taints = node["spec"].get("taints") or []
        rec = self.dir / NODES_RECORD
        if not rec.exists():
            uncordoned = [n for n in others
                          if not self.kget("node", n)["spec"].get("unschedulable")]
            rec.write_text(json.dumps({"taints": taints, "cordoned": uncordoned}))
        if any(t["key"] == realnode.TAINT["key"] for t in taints):
            self.kubectl("taint", "node", real, f"{realnode.TAINT['key']}:NoSchedule-")
        if others:
            self.kubectl("cordon", *others)

    def restore_nodes(self) -> None:
        rec = self.dir / NODES_RECORD
        if not rec.exists():
            return
        data = json.loads(rec.read_text())
        real, _ = self._nodes()
        for t in data["taints"]:
            self.kubectl("taint", "node", real, f"{t['key']}={t.get('value', '')}:{t['effect']}",
                         "--overwrite")
        if data["cordoned"]:
            self.kubectl("uncordon", *data["cordoned"])
        rec.unlink()

    # --- helm verbs ---------------------------------------------------------------------------
    def values_args(self, *values: str | Path | dict) -> list[str]:
        """`-f` for the test-bed values, then each extra (a file, or a dict written to one)."""
        out = ["-f", str(VALUES)]
        for i, v in enumerate(values):
            if isinstance(v, dict):
                path = self.dir / f"values-{time.monotonic_ns()}-{i}.yaml"
                path.write_text(yaml.safe_dump(v))
                v = path
            out += ["-f", str(v)]
        return out + self.image_args()

    def installed(self) -> bool:
        res = self.helm("status", self.release, "-n", self.namespace, check=False)
        return res.returncode == 0

    def install(self, *values: str | Path | dict, timeout: str = "600s") -> float:
        """helm install --wait; returns its seconds. Prepares images, namespaces and nodes."""
        self.load_images()
        self.ensure_namespace(self.namespace)
        self.ensure_namespace(self.sandbox_namespace)
        self.isolate_nodes()
        t0 = time.monotonic()
        try:
            self.helm("install", self.release, str(CHART), "-n", self.namespace,
                      *self.values_args(*values), "--wait", "--timeout", timeout)
        except InstallError as e:
            raise InstallError(f"{e}; {self.summary()}") from None
        self.timings["install"] = time.monotonic() - t0
        return self.timings["install"]

    def upgrade(self, *values: str | Path | dict, timeout: str = "600s") -> float:
        """`helm upgrade --wait`, then until the old replicas are gone: helm returns once the
        new ones are Ready, while old webhook replicas still serve their drain
        (webhook.drainSeconds) and mutate with the old settings, which the already-updated
        policy may refuse (docs/operations.md "Upgrades and rollbacks")."""
        t0 = time.monotonic()
        try:
            self.helm("upgrade", self.release, str(CHART), "-n", self.namespace,
                      *self.values_args(*values), "--wait", "--timeout", timeout)
            self.wait_no_terminating(120)
        except InstallError as e:
            raise InstallError(f"{e}; {self.summary()}") from None
        return time.monotonic() - t0

    def wait_no_terminating(self, timeout: float) -> None:
        """Until no pod of the release's webhook and controller is being deleted (bounded)."""
        deadline = time.monotonic() + timeout
        while True:
            pods = self.kget("pods", "-n", self.namespace, "-l",
                             f"app.kubernetes.io/instance={self.release},"
                             "app.kubernetes.io/component in (webhook,controller)")["items"]
            going = [p["metadata"]["name"] for p in pods
                     if p["metadata"].get("deletionTimestamp")]
            if not going:
                return
            if time.monotonic() > deadline:
                raise InstallError(f"old replicas still terminating {timeout:.0f} s after the "
                                   f"upgrade: {', '.join(going)}")
            time.sleep(0.5)

    def summary(self) -> str:
        """Deployments' ready counts and pods not Ready, in one line (for failures)."""
        try:
            deps = self.kget("deployments", "-n", self.namespace)["items"]
            pods = self.kget("pods", "-n", self.namespace)["items"]
        except InstallError as e:
            return f"(no summary: {e})"
        out = [f"{d['metadata']['name']} ready {d['status'].get('readyReplicas', 0)}/"
               f"{d['spec']['replicas']}" for d in deps]
        for p in pods:
            conds = {c["type"]: c["status"] for c in p["status"].get("conditions", [])}
            if conds.get("Ready") != "True" and p["status"].get("phase") != "Succeeded":
                out.append(f"pod {p['metadata']['name']} {p['status'].get('phase')} not Ready")
        return "; ".join(out)

    def test(self, timeout: str = "600s", check: bool = True) -> subprocess.CompletedProcess:
        return self.helm("test", self.release, "-n", self.namespace, "--logs",
                         "--timeout", timeout, check=check)

    def uninstall(self, timeout: str = "300s") -> None:
        """helm uninstall --wait, then any cluster-scoped object still carrying the release is
        deleted (a failed uninstall must not leave admission behind) and the nodes restored."""
        try:
            if self.installed():
                self.helm("uninstall", self.release, "-n", self.namespace, "--wait",
                          "--timeout", timeout)
        finally:
            for kind in CLUSTER_KINDS:
                self.kubectl("delete", kind, "-l", f"app.kubernetes.io/instance={self.release}",
                             "--ignore-not-found", "--wait=false", check=False)
            self.restore_nodes()

    def leftovers(self) -> list[str]:
        """Objects that still carry the release's label, in any namespace or cluster-wide."""
        sel = f"app.kubernetes.io/instance={self.release}"
        kinds = ",".join(k for k in (*NAMESPACED_KINDS, *CLUSTER_KINDS)
                         if "monitoring.coreos.com" not in k)
        return self._names("get", kinds, "--all-namespaces", "-l", sel, "-o", "name")

    def runtime_leftovers(self) -> list[str]:
        """What the release's pods made at run time and an uninstall does not remove: anything
        left in the release and sandbox namespaces (pods, Secrets, ConfigMaps, Leases)."""
        left = []
        for ns in (self.namespace, self.sandbox_namespace):
            names = self._names("get", "pods,secrets,configmaps,leases.coordination.k8s.io",
                                "-n", ns, "-o", "name")
            left += [f"{ns}/{n}" for n in names if n != "configmap/kube-root-ca.crt"]
        return left

    def _names(self, *args: str) -> list[str]:
        """`kubectl get -o name`'s names. "Nothing left" must come from an API server that
        answered: any failure (unreachable, refused, unknown kind) raises, except kubectl's
        NotFound for an object that is gone, which really means nothing."""
        res = self.kubectl(*args, check=False)
        if res.returncode != 0:
            errs = [line for line in res.stderr.splitlines() if line.strip()]
            if not errs or not all(line.startswith("Error from server (NotFound):")
                                   for line in errs):
                raise InstallError(f"kubectl {' '.join(args[:3])} exited {res.returncode}: "
                                   f"{_tail(res.stderr + res.stdout)}")
        return res.stdout.split()

    # --- where things are ----------------------------------------------------------------------
    def controller_pods(self) -> list[dict]:
        return self.kget("pods", "-n", self.namespace, "-l",
                         "app.kubernetes.io/component=controller")["items"]

    def controller_service(self) -> str:
        """The controller Service's name (the chart derives it from the release name)."""
        items = self.kget("services", "-n", self.namespace, "-l",
                          f"app.kubernetes.io/instance={self.release},"
                          "app.kubernetes.io/component=controller")["items"]
        if len(items) != 1:
            raise InstallError(f"install: expected one controller Service of release "
                               f"{self.release} in {self.namespace}, found {len(items)}")
        return items[0]["metadata"]["name"]

    def controller_host(self) -> str:
        """The Service's DNS name: what the controller's certificate names."""
        return f"{self.controller_service()}.{self.namespace}.svc"

    def controller_url_in_cluster(self) -> str:
        """$SANDMAN_URL of a trainer pod (https; the CA is ca_bundle())."""
        svc = self.kget("service", self.controller_service(), "-n", self.namespace)
        port = svc["spec"]["ports"][0]["port"]
        return f"https://{self.controller_host()}:{port}"

    def ca_configmap(self) -> str:
        """The ConfigMap in the release namespace holding the controller's CA bundle (ca.crt),
        written by the controller (--ca-configmap)."""
        return self.controller_service().removesuffix("-controller") + "-ca"

    def ca_bundle(self) -> str:
        """The controller's CA bundle (PEM), as published; InstallError when still empty."""
        cm = self.kget("configmap", self.ca_configmap(), "-n", self.namespace)
        pem = (cm.get("data") or {}).get("ca.crt", "")
        if "BEGIN CERTIFICATE" not in pem:
            raise InstallError(f"configmap {self.namespace}/{self.ca_configmap()} holds no "
                               "ca.crt yet (the controller publishes it at start)")
        return pem

    def how_to_reach(self) -> list[str]:
        """Lines for a person: the kubeconfig, and how to talk to the controller from here."""
        port = self.kget("service", self.controller_service(), "-n",
                         self.namespace)["spec"]["ports"][0]["port"]
        lines = [f"export KUBECONFIG={self.kubeconfig}",
                 f"# controller in the cluster: {self.controller_url_in_cluster()} (trainer "
                 f"pods: label sandman.dev/trainer=true)"]
        for p in self.controller_pods():
            ip = p.get("status", {}).get("podIP")
            if ip:
                lines.append(f"# controller pod {p['metadata']['name']}: https://{ip}:{port} "
                             f"(pod IPs are routed from this machine; the certificate names "
                             f"{self.controller_host()}: curl --resolve)")
        lines.append(f"# CA: kubectl -n {self.namespace} get configmap {self.ca_configmap()} "
                     "-o jsonpath='{.data.ca\\.crt}' > ca.crt   # SANDMAN_CA_FILE=ca.crt")
        lines.append(f"# or: kubectl -n {self.namespace} port-forward "
                     f"svc/{self.controller_service()} 8443:{port}   # then curl --cacert "
                     f"ca.crt --resolve {self.controller_host()}:8443:127.0.0.1 "
                     f"https://{self.controller_host()}:8443")
        return lines


def main(argv: list[str] | None = None) -> int:
    from testbed.cluster import Testbed, TestbedError, default_state_dir

    ap = argparse.ArgumentParser(prog="python -m testbed.install", description=__doc__.split(
        "\n")[0])
    ap.add_argument("--state-dir", default=None,
                    help="the bed's state dir (default: the one `make testbed-up` uses)")
    sub = ap.add_subparsers(dest="verb", required=True)
    up = sub.add_parser("up", help="helm install --wait on the running bed's real node")
    up.add_argument("-f", "--values", action="append", default=[],
                    help="extra values file(s) after testbed/values-realnode.yaml")
    sub.add_parser("down", help="helm uninstall --wait; restore the nodes")
    sub.add_parser("status", help="helm status and how to reach the controller")
    args = ap.parse_args(argv)
    state = Path(args.state_dir) if args.state_dir else default_state_dir("manual")
    try:
        tb = Testbed.attach(state)
        if tb is None or getattr(tb, "realnode", None) is None:
            print(f"testbed.install: no test bed with a real node is up ({state}); run "
                  f"`make testbed-up REAL_NODE=1` first", file=sys.stderr)
            return 1
        inst = Install(tb)
        if args.verb == "up":
            if inst.installed():
                print(f"# {RELEASE} already installed in {NAMESPACE}", file=sys.stderr)
            else:
                took = inst.install(*args.values)
                print(f"# helm install --wait of {CHART.relative_to(ROOT)} ({inst.image_ref}) "
                      f"took {took:.1f}s", file=sys.stderr)
            print("\n".join(inst.how_to_reach()))
            return 0
        if args.verb == "down":
            inst.uninstall()
            left = inst.leftovers() + inst.runtime_leftovers()
            if left:
                print(f"testbed.install: left after uninstall: {left}", file=sys.stderr)
                return 1
            return 0
        print(inst.helm("status", RELEASE, "-n", NAMESPACE, check=False).stdout.strip())
        print("\n".join(inst.how_to_reach()))
        return 0
    except (InstallError, TestbedError, build.BuildError) as e:
        print(f"testbed.install: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
