"""The chart on the real test bed (kube-apiserver v1.36.2 + kwok nodes).

Safety: webhook configurations and the ClusterRole are cluster-scoped and could break other
tests' pod creates if left behind. Every release here (1) scopes its webhooks with
`webhook.namespaceSelector` to one test namespace, and (2) is uninstalled in a `finally`, after
which any cluster-scoped object still labelled with the release is deleted by label.
"""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from sandman.contract import (
    ANNOTATION_TOKEN_SHA256,
    LABEL_EGRESS,
    LABEL_SANDBOX,
    NETGUARD_CONTAINER,
)
from sandman.podspec import SandboxPolicy, make_sandbox
from testbed.controller import ControllerProc
from testbed.procs import refused_port, wait_for
from testbed.standin import Standin
from testbed.webhook import start_webhook, wait_webhook_active
from tests.charts.helm import CHART, ROOT, Helm, kubectl, objects

TOKEN = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
CLUSTER_KINDS = ("mutatingwebhookconfigurations", "validatingwebhookconfigurations",
                 "validatingadmissionpolicies", "validatingadmissionpolicybindings",
                 "clusterroles", "clusterrolebindings", "priorityclasses", "flowschemas",
                 "prioritylevelconfigurations")


@pytest.fixture
def helm(cluster, tmp_path) -> Helm:
    return Helm(tmp_path / "helm-home", cluster.kubeconfig)


def _scoped(only_namespace: str) -> dict:
    return {"webhook": {"namespaceSelector": {"matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": [only_namespace]}]}}}


def _values_file(tmp_path: Path, name: str, *dicts: dict) -> str:
    merged: dict = {}
    for d in dicts:
        _merge(merged, d)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(merged))
    return str(path)


def _merge(into: dict, d: dict) -> None:
    for k, v in d.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = v


class Release:
    """helm install/upgrade/uninstall of one uniquely named release, always cleaned up."""

    def __init__(self, helm: Helm, cluster, namespace: str):
        self.helm, self.cluster, self.namespace = helm, cluster, namespace
        self.name = f"s{secrets.token_hex(3)}"

    def install(self, values: str, *extra: str) -> None:
        self.helm.run("install", self.name, str(CHART), "--namespace", self.namespace,
                      "-f", values, *extra)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        # --no-hooks: the post-delete cleanup Job never completes on kwok (no containers run);
        # test_uninstall_cleanup_under_its_rbac runs its command here instead, and the e2e
        # suite runs the real hook on the real node.
        self.helm.run("uninstall", self.name, "--namespace", self.namespace, "--wait",
                      "--timeout", "60s", "--no-hooks", check=False)
        for kind in CLUSTER_KINDS:  # a failed uninstall must not leave admission behind
            kubectl(self.cluster.kubeconfig, "delete", kind, "-l",
                    f"app.kubernetes.io/instance={self.name}", "--ignore-not-found",
                    "--wait=false", check=False)

    def manifest(self) -> list[dict]:
        return objects(self.helm.run("get", "manifest", self.name, "-n", self.namespace).stdout)


def _ref(obj: dict, default_ns: str) -> list[str]:
    kind = obj["kind"]
    name = obj["metadata"]["name"]
    ns = obj["metadata"].get("namespace")
    cluster_scoped = kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration",
                              "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
                              "ClusterRole", "ClusterRoleBinding", "PriorityClass",
                              "FlowSchema", "PriorityLevelConfiguration")
    args = [f"{kind}/{name}"]
    if not cluster_scoped:
        args += ["-n", ns or default_ns]
    return args


def _can(cluster, sa_ns: str, sa: str, verb: str, resource: str, namespace: str = "",
         group: str = "", name: str = "") -> bool:
    api = client.AuthorizationV1Api(cluster.api_client)
    review = client.V1SubjectAccessReview(spec=client.V1SubjectAccessReviewSpec(
        user=f"system:serviceaccount:{sa_ns}:{sa}",
        groups=["system:serviceaccounts", f"system:serviceaccounts:{sa_ns}", "system:authenticated"],
        resource_attributes=client.V1ResourceAttributes(
            verb=verb, resource=resource, group=group, namespace=namespace or None,
            name=name or None)))
    return api.create_subject_access_review(review).status.allowed


def _service_account_kubeconfig(cluster, namespace: str, sa: str, tmp_path: Path) -> Path:
    """A kubeconfig that authenticates as the service account (a short-lived bound token)."""
    req = client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=600))
    token = cluster.core.create_namespaced_service_account_token(sa, namespace, req).status.token
    admin = yaml.safe_load(Path(cluster.kubeconfig).read_text())
    ctx = next(c for c in admin["contexts"] if c["name"] == admin["current-context"])["context"]
    entry = next(c for c in admin["clusters"] if c["name"] == ctx["cluster"])
    path = tmp_path / f"{sa}.kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "sa",
        "clusters": [entry], "users": [{"name": "sa", "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": entry["name"], "user": "sa"}}]}))
    return path


def _rewrite(args: list[str], **flags: str) -> list[str]:
    """The rendered args with some `--flag=value` replaced (local addresses and files)."""
    out = []
    for a in args:
        name = a.split("=", 1)[0].lstrip("-").replace("-", "_")
        out.append(f"--{name.replace('_', '-')}={flags.pop(name)}" if name in flags else a)
    assert not flags, f"not in the rendered args: {flags}"
    return out


def _check_webhook_serves(dep: dict, tls_secret, tmp_path: Path, server_name: str) -> None:
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["python3", "-m", "webhook", "serve"]
    mount = container["volumeMounts"][0]["mountPath"]
    certdir = tmp_path / "tls"
    certdir.mkdir()
    for key in ("tls.crt", "tls.key", "ca.crt"):
        (certdir / key).write_bytes(base64.b64decode(tls_secret.data[key]))
    # Port 0: the webhook binds it and prints the port it got (start_webhook reads it).
    args = _rewrite(container["args"], port="0", tls_cert=str(certdir / "tls.crt"),
                    tls_key=str(certdir / "tls.key"))
    assert f"--tls-cert={mount}/tls.crt" in container["args"]
    # The certificate names the Service, not 127.0.0.1: readiness is checked here, with SNI.
    server = start_webhook(tmp_path / "webhook", args=args, certdir=certdir, wait_ready=False)
    try:
        ctx = ssl.create_default_context(cadata=base64.b64decode(
            tls_secret.data["ca.crt"]).decode())
        deadline = time.monotonic() + 30
        status = None
        with httpx.Client(verify=ctx) as http:
            while status != 200 and time.monotonic() < deadline and server.alive():
                try:
                    status = http.get(f"https://127.0.0.1:{server.port}/readyz", timeout=2,
                                      extensions={"sni_hostname": server_name}).status_code
                except httpx.HTTPError:
                    time.sleep(0.2)
        assert status == 200, server.proc.tail()
    finally:
        server.stop()


def test_install_upgrade_uninstall_and_rbac(cluster, namespace, helm, tmp_path, figures):
    other = cluster.new_namespace("chart-other")
    sandboxes = cluster.new_namespace("chart-sandboxes")
    t0 = time.monotonic()
    try:
        with Release(helm, cluster, namespace) as rel:
            values = _values_file(tmp_path, "v1", _scoped(namespace),
                                  {"controller": {"readyCheck": "pod"},
                                   "sandboxNamespace": sandboxes})
            # Every rendered object (the helm test pod included) passes the API server's
            # validation with unknown fields refused, before anything is created.
            rendered = helm.run("template", rel.name, str(CHART), "--namespace", namespace,
                                "-f", values).stdout
            # (Objects name their namespace: the sandbox namespace is not the release one.)
            # Pods name a ServiceAccount of the release, which a dry run does not create:
            # they are validated the same way once the release exists.
            docs = [d for d in re.split(r"^---[ \t]*$", rendered, flags=re.M) if d.strip()]
            pods = [d for d in docs if re.search(r"^kind: Pod$", d, re.M)]
            assert pods, "the chart renders its helm test pod"
            kubectl(cluster.kubeconfig, "apply", "--dry-run=server", "--validate=strict",
                    "-f", "-", stdin="\n---\n".join(d for d in docs if d not in pods))
            rel.install(values, "--wait", "--timeout", "120s")
            kubectl(cluster.kubeconfig, "apply", "--dry-run=server", "--validate=strict",
                    "-f", "-", stdin="\n---\n".join(pods))
            first = rel.manifest()
            kinds = {o["kind"] for o in first}
            assert {"Deployment", "Service", "PodDisruptionBudget", "PriorityClass",
                    "MutatingWebhookConfiguration", "ValidatingAdmissionPolicy",
                    "ValidatingAdmissionPolicyBinding", "Role",
                    "RoleBinding", "ClusterRole", "ClusterRoleBinding", "ServiceAccount",
                    "NetworkPolicy", "Job", "CronJob", "FlowSchema",
                    "PriorityLevelConfiguration"} <= kinds, kinds
            for obj in first:
                kubectl(cluster.kubeconfig, "get", *_ref(obj, namespace))

            controller = f"{rel.name}-sandman-controller"
            webhook = f"{rel.name}-sandman-webhook"
            cfg = f"{webhook}-{namespace}"
            # The controller: pods in the sandbox namespace, nowhere else; in particular
            # nothing in the release namespace, where the webhook's ServiceAccount (which may
            # patch the webhook configurations and read the CA key) and its Secrets live.
            assert _can(cluster, namespace, controller, "create", "pods", sandboxes)
            assert _can(cluster, namespace, controller, "patch", "pods", sandboxes)
            assert _can(cluster, namespace, controller, "create", "configmaps", sandboxes)
            # A job's image pins are patched into its ConfigMap: no update, no list.
            assert _can(cluster, namespace, controller, "patch", "configmaps", sandboxes)
            assert not _can(cluster, namespace, controller, "update", "configmaps", sandboxes)
            assert not _can(cluster, namespace, controller, "list", "configmaps", sandboxes)
            assert _can(cluster, namespace, controller, "update", "leases", sandboxes,
                        "coordination.k8s.io", "sandman-controller")
            assert not _can(cluster, namespace, controller, "create", "pods", other)
            assert not _can(cluster, namespace, controller, "list", "pods")  # cluster-wide
            for verb, resource in (("create", "pods"), ("patch", "pods"), ("get", "secrets"),
                                   ("list", "secrets"), ("create", "configmaps"),
                                   ("update", "leases"), ("patch", "serviceaccounts")):
                assert not _can(cluster, namespace, controller, verb, resource, namespace), (
                    f"the controller may {verb} {resource} in the webhook's namespace")
            assert not _can(cluster, namespace, controller, "get", "secrets", sandboxes)
            # ... besides the CA bundle ConfigMap it publishes to trainers, by name.
            ca_cm = f"{rel.name}-sandman-ca"
            assert _can(cluster, namespace, controller, "patch", "configmaps", namespace,
                        name=ca_cm)
            assert not _can(cluster, namespace, controller, "patch", "configmaps", namespace,
                            name="someone-elses")
            # The webhook: its own Secrets and configurations, never pods.
            assert not _can(cluster, namespace, webhook, "list", "pods", namespace)
            assert not _can(cluster, namespace, webhook, "list", "pods")
            assert not _can(cluster, namespace, webhook, "get", "pods", namespace)
            assert _can(cluster, namespace, webhook, "get", "secrets", namespace,
                        name=f"{webhook}-tls")
            assert not _can(cluster, namespace, webhook, "get", "secrets", namespace,
                            name="someone-elses")
            assert not _can(cluster, namespace, webhook, "list", "secrets", namespace)
            assert _can(cluster, namespace, webhook, "patch",
                        "mutatingwebhookconfigurations", group="admissionregistration.k8s.io",
                        name=cfg)
            assert not _can(cluster, namespace, webhook, "patch",
                            "validatingwebhookconfigurations",
                            group="admissionregistration.k8s.io", name="another-webhook")

            # The certificate Job's exact command, run here under the webhook's own account
            # (kwok runs no containers): its RBAC suffices to issue and patch caBundle.
            job = next(o for o in first if o["kind"] == "Job")
            kc = _service_account_kubeconfig(cluster, namespace, webhook, tmp_path)
            # Its init containers: the webhook's certificates, then the controller's.
            inits = job["spec"]["template"]["spec"]["initContainers"]
            assert [i["name"] for i in inits] == ["certs", "controller-certs"]
            for ensure in inits:
                assert ensure["command"] == ["python3", "-m", "webhook", "certs", "ensure"]
                res = subprocess.run([sys.executable, "-m", "webhook", "certs", "ensure",
                                      "--kubeconfig", str(kc), *ensure["args"],
                                      "--propagation-seconds=0"], cwd=ROOT,
                                     capture_output=True, text=True, timeout=60)
                assert res.returncode == 0, res.stderr[-3000:]
            # Its second step: the Secrets become the ServiceAccount's, so uninstall removes them.
            own = job["spec"]["template"]["spec"]["containers"][0]
            assert own["command"][:2] == ["python3", "-c"]
            env = {e["name"]: e["value"] for e in own["env"]}
            res = subprocess.run([sys.executable, "-c", own["command"][2]], cwd=ROOT,
                                 env={**os.environ, **env, "KUBECONFIG": str(kc)},
                                 capture_output=True, text=True, timeout=60)
            assert res.returncode == 0, res.stderr[-3000:]
            tls = cluster.core.read_namespaced_secret(f"{webhook}-tls", namespace)
            assert tls.type == "kubernetes.io/tls"
            ctl_tls = cluster.core.read_namespaced_secret(f"{controller}-tls", namespace)
            for secret in (tls, cluster.core.read_namespaced_secret(f"{webhook}-tls-ca",
                                                                    namespace),
                           ctl_tls, cluster.core.read_namespaced_secret(f"{controller}-tls-ca",
                                                                        namespace)):
                assert [(r.kind, r.name) for r in secret.metadata.owner_references] == [
                    ("ServiceAccount", webhook)]
            # The controller's pair names its Service and comes from a CA of its own.
            from cryptography import x509

            leaf = x509.load_pem_x509_certificate(base64.b64decode(ctl_tls.data["tls.crt"]))
            sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            assert f"{controller}.{namespace}.svc" in sans.get_values_for_type(x509.DNSName)
            assert ctl_tls.data["ca.crt"] != tls.data["ca.crt"]
            bundle = tls.data["ca.crt"]
            mwc = cluster.admissionregistration.read_mutating_webhook_configuration(cfg)
            assert {w.client_config.ca_bundle for w in mwc.webhooks} == {bundle}

            # The webhook Deployment's exact args, serving the issued Secret: the API server's
            # view (the Service's DNS name, verified against caBundle) gets a ready webhook.
            dep = next(o for o in first if o["kind"] == "Deployment" and
                       o["metadata"]["name"] == webhook)
            _check_webhook_serves(dep, tls, tmp_path, f"{webhook}.{namespace}.svc")

            # Upgrade with changed values: the new values reach the objects.
            values2 = _values_file(tmp_path, "v2", _scoped(namespace),
                                   {"controller": {"readyCheck": "pod", "rate": 5},
                                    "sandboxNamespace": sandboxes,
                                    "webhook": {"timeoutSeconds": 7, "replicas": 2}})
            helm.run("upgrade", rel.name, str(CHART), "--namespace", namespace, "-f", values2,
                     "--wait", "--timeout", "120s")
            dep = json.loads(kubectl(cluster.kubeconfig, "get", "deploy", controller, "-n",
                                     namespace, "-o", "json").stdout)
            assert "--rate=5" in dep["spec"]["template"]["spec"]["containers"][0]["args"]
            mwc = cluster.admissionregistration.read_mutating_webhook_configuration(cfg)
            assert [w.timeout_seconds for w in mwc.webhooks] == [7]
            wh = client.AppsV1Api(cluster.api_client).read_namespaced_deployment(webhook,
                                                                                 namespace)
            assert wh.spec.replicas == 2
            second = rel.manifest()
            # The certificate Job's pod did not change, so neither did the (immutable) Job.
            assert [o for o in second if o["kind"] == "Job"] == [job]

            # Uninstall: nothing of ours is left, in any namespace or cluster-wide.
            helm.run("uninstall", rel.name, "--namespace", namespace, "--wait",
                     "--timeout", "60s", "--no-hooks")  # see Release.__exit__
            for obj in first + second:
                res = kubectl(cluster.kubeconfig, "get", *_ref(obj, namespace), check=False)
                assert res.returncode != 0 and "NotFound" in res.stderr, (obj["kind"], res.stdout)
            rendered_kinds = sorted({o["kind"].lower() for o in first + second}
                                    | {"pod", "replicaset", "secret", "configmap",
                                       "lease.coordination.k8s.io"})
            deadline = time.monotonic() + 60
            while True:  # pods and ReplicaSets go through the garbage collector
                left = kubectl(cluster.kubeconfig, "get", ",".join(rendered_kinds),
                               "--all-namespaces", "-l",
                               f"app.kubernetes.io/instance={rel.name}", "-o", "name").stdout
                if not left.strip() or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert not left.strip(), f"left after uninstall: {left}"
            # The certificate Secrets (written by `certs ensure`, not by Helm) went with their
            # owner: nothing at all is left in the namespace.
            deadline = time.monotonic() + 30
            while True:
                left_secrets = [s.metadata.name for s in
                                cluster.core.list_namespaced_secret(namespace).items]
                if not left_secrets or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert not left_secrets, f"left after uninstall: {left_secrets}"
    finally:
        cluster.delete_namespace(other)
        cluster.delete_namespace(sandboxes)
    figures.add(f"chart: install + RBAC + upgrade + uninstall on the test bed in "
                f"{time.monotonic() - t0:.1f}s")


def _refused(cluster, namespace: str, pod: dict, timeout: float = 30) -> ApiException:
    """The refusal of a dry-run create of `pod`, retried while the API server still admits it
    (admission configuration changes take about a second to load)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            cluster.core.create_namespaced_pod(namespace, pod, dry_run="All")
        except ApiException as e:
            return e
        assert time.monotonic() < deadline, f"still admitted after {timeout:g}s: {pod['metadata']}"
        time.sleep(0.2)


def test_chart_webhook_configurations_admit_through_a_local_webhook(cluster, namespace, helm,
                                                                   tmp_path):
    """The rendered configurations, pointed at a webhook process on 127.0.0.1 (the values
    switch `webhook.development.url`), mutate labelled pods in the sandbox namespace; the
    chart's default admission (mutating webhook + policy) refuses a pod that is no correct
    sandbox. Then the outage of docs/operations.md step 2: with the webhook configurations
    deleted, the policy still refuses an unguarded egress-deny pod and a client's raw sandbox,
    while the controller's pods (built by make_sandbox) are admitted."""
    sandboxes = cluster.new_namespace("chart-sbx")
    server = start_webhook(tmp_path / "webhook")
    try:
        with Release(helm, cluster, namespace) as rel:
            values = _values_file(tmp_path, "dev", _scoped(sandboxes), {
                "sandboxNamespace": sandboxes,
                "controller": {"readyCheck": "pod"},
                "webhook": {"development": {
                    "url": server.url,
                    "caBundle": base64.b64encode(server.ca.read_bytes()).decode()}}})
            rel.install(values)
            pod = {"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"generateName": "sbx-", "labels": {LABEL_SANDBOX: "true"},
                                "annotations": {ANNOTATION_TOKEN_SHA256: TOKEN}},
                   "spec": {"containers": [{"name": "task", "image": "python:3.12-slim"}]}}
            # The API server picks up new configurations within a second or so.
            wait_webhook_active(cluster.core, sandboxes)
            got = cluster.core.create_namespaced_pod(sandboxes, pod, dry_run="All")
            names = [c.name for c in got.spec.init_containers or []]
            assert names == [NETGUARD_CONTAINER], names  # the guard installs execd too
            assert got.spec.enable_service_links is False
            # A pod that is no correct sandbox is refused (by the policy: the validating
            # webhook is off by default).
            bad = dict(pod, metadata={"generateName": "bad-", "labels": {LABEL_SANDBOX: "true"}})
            refusal = _refused(cluster, sandboxes, bad)  # the policy loads asynchronously too
            assert refusal.status == 403 and "token-hash" in refusal.body, refusal.body

            # Outage, docs/operations.md step 2: the webhook configurations are deleted.
            cfg = next(o["metadata"]["name"] for o in rel.manifest()
                       if o["kind"] == "MutatingWebhookConfiguration")
            kubectl(cluster.kubeconfig, "delete", "mutatingwebhookconfiguration", cfg)
            kubectl(cluster.kubeconfig, "delete", "validatingwebhookconfiguration", cfg,
                    "--ignore-not-found")
            # Once the API server stops calling the mutating webhook, a client's raw sandbox
            # reaches the policy as sent.
            raw_refusal = _refused(cluster, sandboxes, pod)
            assert raw_refusal.status == 403, raw_refusal.body
            assert "ValidatingAdmissionPolicy" in raw_refusal.body
            unguarded = {"apiVersion": "v1", "kind": "Pod",
                         "metadata": {"generateName": "deny-", "labels": {LABEL_EGRESS: "deny"}},
                         "spec": {"containers": [{"name": "task", "image": "python:3.12-slim"}]}}
            with pytest.raises(ApiException) as e:
                cluster.core.create_namespaced_pod(sandboxes, unguarded, dry_run="All")
            assert e.value.status == 403 and "sandman guard-missing" in e.value.body, e.value.body
            # The controller builds its pods itself: they keep being admitted.
            built = make_sandbox(pod, SandboxPolicy())
            got = cluster.core.create_namespaced_pod(sandboxes, built, dry_run="All")
            assert got.spec.init_containers[0].name == NETGUARD_CONTAINER
    finally:
        server.stop()
        cluster.delete_namespace(sandboxes)


def test_controller_under_its_rbac_and_the_helm_test_script(cluster, namespace, helm, tmp_path,
                                                            figures):
    """The controller with the Deployment's exact args, authenticated as the chart's service
    account, hands out a sandbox; the `helm test` pod's script, run here against it, passes.
    kwok runs no container, so the kubelet stand-in (testbed/standin.py) starts the real execd
    on each sandbox pod's loopback IP."""
    other = cluster.new_namespace("chart-nowhere")
    sandboxes = cluster.new_namespace("chart-sbx")
    standin = Standin(cluster.core, sandboxes, tmp_path / "standin").start()
    ctl = None
    try:
        with Release(helm, cluster, namespace) as rel:
            # Image pinning off: the helm test's image is on Docker Hub, which the bed does
            # not reach (pinning on the bed: tests/controller/test_image_pinning_on_testbed.py).
            rel.install(_values_file(tmp_path, "v", _scoped(other),
                                     {"sandboxNamespace": sandboxes,
                                      "sandbox": {"imagePinning": "off"}}))
            manifest = rel.manifest()
            controller = f"{rel.name}-sandman-controller"
            dep = next(o for o in manifest if o["kind"] == "Deployment" and
                       o["metadata"]["name"] == controller)
            container = dep["spec"]["template"]["spec"]["containers"][0]
            assert container["command"] == ["python3", "-m", "controller", "serve"]
            assert "--ready-check=execd" in container["args"]  # the production default
            kc = _service_account_kubeconfig(cluster, namespace, controller, tmp_path)
            # The mounted sandbox pod template, as the Deployment's volume would hold it.
            cm = next(o for o in manifest if o["kind"] == "ConfigMap" and
                      o["metadata"]["name"] == f"{controller}-pod-template")
            tpl = tmp_path / "pod-template.json"
            tpl.write_text(cm["data"]["pod-template.json"])
            # A serving pair as `certs ensure` issues it for the Service's names (plus
            # 127.0.0.1, where it listens here), in place of the mounted Secret.
            from webhook.certs import self_signed_dir, service_dns_names

            host = f"{controller}.{namespace}.svc"
            certdir = Path(self_signed_dir(str(tmp_path / "tls"),
                                           service_dns_names(controller, namespace),
                                           ["127.0.0.1"]))
            # The rendered args as they are (namespace, ready check, lease, TLS, CA ConfigMap
            # ...), but on loopback and with local files.
            ctl = ControllerProc(None, kc, tmp_path / "controller.log",
                                 _rewrite(container["args"], listen="127.0.0.1:0",
                                          advertise_address="127.0.0.1",
                                          pod_template_file=str(tpl),
                                          tls_cert_file=str(certdir / "tls.crt"),
                                          tls_key_file=str(certdir / "tls.key"),
                                          tls_ca_file=str(certdir / "ca.crt")),
                                 ready_check=None, tls=certdir)
            assert f"--tls-server-name={host}" in container["args"]
            try:
                ctl.start()
            except RuntimeError as e:
                raise AssertionError(f"controller not leader/ready: {e}") from None
            url = ctl.url
            assert url.startswith("https://")
            log = ctl.log
            # Under the chart's Role, the controller published its CA bundle for trainers.
            ca_cm = f"{rel.name}-sandman-ca"

            def published() -> bool:
                data = cluster.core.read_namespaced_config_map(ca_cm, namespace).data or {}
                return data.get("ca.crt") == (certdir / "ca.crt").read_text()
            wait_for(published, 30, f"the CA bundle in configmap {ca_cm}")

            hooks = objects(helm.run("get", "hooks", rel.name, "-n", namespace).stdout)
            pod = next(o for o in hooks if o["kind"] == "Pod")
            assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
            tc = pod["spec"]["containers"][0]
            assert tc["command"] == ["python3", "-m", "sandman.selftest"]
            env = {e["name"]: e["value"] for e in tc["env"] if "value" in e}
            assert env["SANDMAN_URL"].startswith(f"https://{host}:")
            ca_vol = next(v for v in pod["spec"]["volumes"] if "configMap" in v)
            assert ca_vol["configMap"]["name"] == ca_cm
            # The pod's $SANDMAN_CA_FILE, as its ConfigMap volume would hold it.
            ca_file = tmp_path / "ca-from-configmap.crt"
            ca_file.write_text(cluster.core.read_namespaced_config_map(
                ca_cm, namespace).data["ca.crt"])
            # The test pod's identity: its ServiceAccount's token for the projected volume's
            # audience, bound to sandman-user by the chart (the controller checks both).
            sa = pod["spec"]["serviceAccountName"]
            audience = pod["spec"]["volumes"][0]["projected"]["sources"][0][
                "serviceAccountToken"]["audience"]
            token = tmp_path / "token"
            token.write_text(cluster.core.create_namespaced_service_account_token(
                sa, namespace, {"spec": {"audiences": [audience]}}).status.token)
            test_cmd = [sys.executable, "-m", "sandman.selftest", *tc["args"]]
            t0 = time.monotonic()
            res = subprocess.run(test_cmd, cwd=tmp_path,
                                 env={**os.environ, "SANDMAN_URL": url,
                                      "SANDMAN_TOKEN_FILE": str(token),
                                      "SANDMAN_CA_FILE": str(ca_file),
                                      "SANDMAN_POD_IP": "127.0.0.1"},
                                 capture_output=True, text=True, timeout=120)
            took = time.monotonic() - t0
            assert res.returncode == 0, f"{res.stdout}{res.stderr}\n{log.read_text()[-2000:]}"
            assert "ok: acquired, ran `echo ok`, released" in res.stdout
            # Without the token the controller refuses it (401), and says so in one line.
            anon = {k: v for k, v in os.environ.items() if k != "SANDMAN_TOKEN_FILE"}
            res = subprocess.run(test_cmd, cwd=tmp_path, env={**anon, "SANDMAN_URL": url,
                                                              "SANDMAN_CA_FILE": str(ca_file)},
                                 capture_output=True, text=True, timeout=120)
            assert res.returncode != 0 and "Unauthenticated" in res.stderr, res.stderr
            # Without the CA the SDK refuses the controller's certificate: it never sends the
            # token to a server it cannot verify.
            noca = {k: v for k, v in os.environ.items() if k != "SANDMAN_CA_FILE"}
            res = subprocess.run(test_cmd, cwd=tmp_path,
                                 env={**noca, "SANDMAN_URL": url, "SANDMAN_TOKEN_FILE": str(token)},
                                 capture_output=True, text=True, timeout=120)
            assert res.returncode != 0 and "ConfigurationError" in res.stderr, res.stderr
            assert "certificate did not verify" in res.stderr, res.stderr  # at once, no retries
            # ... and it fails loudly when there is no controller to talk to.
            with refused_port() as dead:
                bad = subprocess.run(test_cmd, cwd=tmp_path,
                                     env={**os.environ, "SANDMAN_TOKEN_FILE": str(token),
                                          "SANDMAN_CA_FILE": str(ca_file),
                                          "SANDMAN_URL": f"https://127.0.0.1:{dead}"},
                                     capture_output=True, text=True, timeout=120)
            assert bad.returncode != 0 and "ControllerUnreachable" in bad.stderr, bad.stderr
            # ... and it never sends the token over plain http.
            with refused_port() as dead:
                plain = subprocess.run(test_cmd, cwd=tmp_path,
                                       env={**os.environ, "SANDMAN_TOKEN_FILE": str(token),
                                            "SANDMAN_URL": f"http://127.0.0.1:{dead}"},
                                       capture_output=True, text=True, timeout=120)
            assert plain.returncode != 0 and "plain http" in plain.stderr, plain.stderr
            # A clean shutdown (it releases the Lease) while the chart's RBAC still exists:
            # no call the controller made was refused.
            ctl.stop()
            assert "forbidden" not in log.read_text().lower(), log.read_text()[-3000:]
    finally:
        if ctl is not None:
            ctl.stop()
        standin.stop()
        cluster.delete_namespace(other)
        cluster.delete_namespace(sandboxes)
    figures.add(f"chart: helm test script against the controller under its RBAC: {took:.1f}s")


def test_uninstall_cleanup_under_its_rbac(cluster, namespace, helm, tmp_path):
    """The post-delete hook's exact command (`python3 -m controller.cleanup`, the rendered
    args), run here under the hook's own ServiceAccount and Roles (kwok runs no Job): it waits
    for the release's controller pods, then removes the controller's sandbox pods, its image
    pre-pull's puller pods, per-job ConfigMaps and Lease and the helm test pod, and nothing
    else."""
    from sandman.contract import LABEL_MANAGED_BY, LABEL_PREPULL, MANAGED_BY_CONTROLLER

    sbx = cluster.new_namespace("chart-cleanup-sbx")
    other = cluster.new_namespace("chart-cleanup-other")
    core = cluster.core
    coord = client.CoordinationV1Api(cluster.api_client)
    try:
        with Release(helm, cluster, namespace) as rel:
            rel.install(_values_file(tmp_path, "v", _scoped(other), {
                "sandboxNamespace": sbx, "controller": {"readyCheck": "pod"}}))
            hooks = [o for o in objects(helm.run("get", "hooks", rel.name, "-n",
                                                 namespace).stdout)
                     if o["metadata"]["annotations"].get("helm.sh/hook") == "post-delete"]
            job = next(o for o in hooks if o["kind"] == "Job")
            args = job["spec"]["template"]["spec"]["containers"][0]["args"]
            sa = job["spec"]["template"]["spec"]["serviceAccountName"]
            helm.run("uninstall", rel.name, "--namespace", namespace, "--wait",
                     "--timeout", "60s", "--no-hooks")
            lease = next(a.split("=", 1)[1] for a in args if a.startswith("--lease-name="))
            test_pod = next(a.split("=", 1)[1] for a in args if a.startswith("--test-pod="))

            def pod(name: str, ns: str, labels: dict) -> None:
                body = {"metadata": {"name": name, "labels": labels},
                        "spec": {"containers": [{"name": "c", "image": "img"}]}}
                # The uninstalled release's books policy (only its controller may write the
                # managed-by label) stays in the API server's admission cache for a moment
                # after its deletion: retry that refusal only, bounded.
                deadline = time.monotonic() + 20
                while True:
                    try:
                        core.create_namespaced_pod(ns, body)
                        return
                    except ApiException as e:
                        if (e.status != 403 or "books-labels" not in (e.body or "")
                                or time.monotonic() > deadline):
                            raise
                        time.sleep(0.5)

            managed = {LABEL_MANAGED_BY: MANAGED_BY_CONTROLLER, LABEL_SANDBOX: "true"}
            for i in range(3):
                pod(f"sbx-{i}", sbx, managed)
            pod("users-own-sandbox", sbx, {LABEL_SANDBOX: "true"})  # not the controller's
            for i in range(2):  # pullers of an image pre-pull (no managed-by label)
                pod(f"sandman-prepull-{i}", sbx, {LABEL_PREPULL: "ab" * 16})
            pod(test_pod, namespace, {"app.kubernetes.io/component": "helm-test"})
            pod("bystander", namespace, {})
            core.create_namespaced_config_map(sbx, {"metadata": {
                "name": "sandman-job-a", "labels": {LABEL_MANAGED_BY: MANAGED_BY_CONTROLLER}}})
            core.create_namespaced_config_map(sbx, {"metadata": {"name": "someone-elses"}})
            for name in (lease, "someone-elses"):
                coord.create_namespaced_lease(sbx, {"metadata": {"name": name},
                                                    "spec": {"holderIdentity": "x"}})
            # A controller pod of the release still there: the cleanup waits for it (bounded),
            # then fails saying so, having deleted nothing.
            pod("ctl-shutting-down", namespace, {"app.kubernetes.io/instance": rel.name,
                                                 "app.kubernetes.io/component": "controller"})

            for o in hooks:  # the hook's account and rights, as Helm creates them first
                if o["kind"] != "Job":
                    kubectl(cluster.kubeconfig, "apply", "-f", "-", stdin=yaml.safe_dump(o))
            kc = _service_account_kubeconfig(cluster, namespace, sa, tmp_path)
            assert _can(cluster, namespace, sa, "deletecollection", "pods", sbx)
            assert not _can(cluster, namespace, sa, "delete", "pods", sbx, name="sbx-0")
            assert _can(cluster, namespace, sa, "delete", "leases", sbx, "coordination.k8s.io",
                        lease)
            assert not _can(cluster, namespace, sa, "delete", "leases", sbx,
                            "coordination.k8s.io", "someone-elses")
            assert not _can(cluster, namespace, sa, "delete", "pods", namespace, name="bystander")
            assert not _can(cluster, namespace, sa, "delete", "pods", other)
            assert not _can(cluster, namespace, sa, "create", "pods", sbx)
            assert not _can(cluster, namespace, sa, "get", "secrets", sbx)
            assert not _can(cluster, namespace, sa, "list", "pods")  # cluster-wide

            def cleanup(*extra: str) -> subprocess.CompletedProcess:
                return subprocess.run([sys.executable, "-m", "controller.cleanup", *args,
                                       "--kubeconfig", str(kc), *extra], cwd=ROOT,
                                      capture_output=True, text=True, timeout=120)

            res = cleanup("--timeout=2")
            assert res.returncode == 1, res.stdout + res.stderr
            assert "controller pods still there" in res.stderr and "ctl-shutting-down" in \
                res.stderr, res.stderr
            assert len(core.list_namespaced_pod(sbx).items) == 6  # nothing deleted yet

            core.delete_namespaced_pod("ctl-shutting-down", namespace, grace_period_seconds=0)
            res = cleanup()
            assert res.returncode == 0, res.stdout + res.stderr
            assert ("deleted 3 pods, 2 pullers, 1 configmaps, 1 lease, 1 test pod"
                    in res.stdout), res.stdout
            assert [p.metadata.name for p in core.list_namespaced_pod(sbx).items] == [
                "users-own-sandbox"]
            assert [p.metadata.name for p in core.list_namespaced_pod(namespace).items] == [
                "bystander"]
            assert [c.metadata.name for c in core.list_namespaced_config_map(sbx).items
                    if c.metadata.name != "kube-root-ca.crt"] == ["someone-elses"]
            assert [x.metadata.name for x in coord.list_namespaced_lease(sbx).items] == [
                "someone-elses"]
            # Idempotent: a second run finds nothing and still succeeds.
            res = cleanup()
            assert res.returncode == 0 and "deleted 0 pods" in res.stdout, res.stdout + res.stderr
            for o in hooks:
                if o["kind"] != "Job":
                    kubectl(cluster.kubeconfig, "delete", "-f", "-", "--ignore-not-found",
                            stdin=yaml.safe_dump(o), check=False)
    finally:
        cluster.delete_namespace(sbx)
        cluster.delete_namespace(other)
