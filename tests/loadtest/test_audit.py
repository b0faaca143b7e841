"""The leak audit inside a pod: `--kubeconfig in-cluster` reads the pod's ServiceAccount token
and CA and $KUBERNETES_SERVICE_HOST/PORT. Here against the test bed's API server with a real
ServiceAccount's token (TokenRequest) laid out as the kubelet mounts it; its RBAC decides, not
the admin kubeconfig."""

from __future__ import annotations

import shutil
from urllib.parse import urlparse

import pytest
from kubernetes import client

from loadtest.audit import IN_CLUSTER, core_api, default_kubeconfig, leak_audit
from sandman import contract

pytestmark = pytest.mark.testbed


def _sa_dir(cluster, ns: str, tmp_path) -> tuple[str, dict]:
    core = cluster.core
    core.create_namespaced_service_account(ns, {"metadata": {"name": "loadtest"}})
    tok = core.create_namespaced_service_account_token(
        "loadtest", ns, {"spec": {"expirationSeconds": 600}}).status.token
    d = tmp_path / "serviceaccount"
    d.mkdir()
    (d / "token").write_text(tok)
    shutil.copy(cluster.testbed.pki.ca_cert, d / "ca.crt")
    server = urlparse(cluster.testbed.server)
    return str(d), {"KUBERNETES_SERVICE_HOST": server.hostname,
                    "KUBERNETES_SERVICE_PORT": str(server.port)}


def test_in_cluster_audit_uses_the_pods_service_account(cluster, namespace, tmp_path):
    if cluster.testbed is None:
        pytest.skip("needs the local test bed's CA (SANDMAN_KUBECONFIG is set)")
    sa_dir, env = _sa_dir(cluster, namespace, tmp_path)
    core = core_api(IN_CLUSTER, sa_dir=sa_dir, environ=env)
    # Before the Role: the ServiceAccount may not list pods (the admin kubeconfig could).
    with pytest.raises(client.ApiException) as e:
        leak_audit(core, namespace, "lt-x", 0)
    assert e.value.status == 403 and f"system:serviceaccount:{namespace}:loadtest" in e.value.body
    rbac = client.RbacAuthorizationV1Api(cluster.api_client)
    rbac.create_namespaced_role(namespace, {
        "metadata": {"name": "leak-audit"},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]})
    rbac.create_namespaced_role_binding(namespace, {
        "metadata": {"name": "leak-audit"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                    "name": "leak-audit"},
        "subjects": [{"kind": "ServiceAccount", "name": "loadtest", "namespace": namespace}]})
    cluster.core.create_namespaced_pod(namespace, {
        "metadata": {"name": "left-behind", "labels": {contract.LABEL_JOB: "lt-x"}},
        "spec": {"containers": [{"name": "c", "image": "registry.invalid/x:1"}]}})
    # RBAC takes effect within a moment; the audit polls for `settle_s` anyway.
    names = leak_audit(core_api(IN_CLUSTER, sa_dir=sa_dir, environ=env), namespace, "lt-x", 5)
    assert names == ["left-behind"]
    assert leak_audit(core, namespace, "lt-other", 0) == []


def test_in_cluster_without_a_token_is_one_clear_error(tmp_path):
    with pytest.raises(RuntimeError, match="in-cluster config"):
        core_api(IN_CLUSTER, sa_dir=str(tmp_path), environ={})


def test_default_kubeconfig(tmp_path):
    (tmp_path / "token").write_text("t")
    assert default_kubeconfig({"KUBECONFIG": "/kc"}, str(tmp_path)) == "/kc"
    assert default_kubeconfig({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, str(tmp_path)) == IN_CLUSTER
    assert default_kubeconfig({}, str(tmp_path)) == ""  # not in a pod: no audit
    assert default_kubeconfig({"KUBERNETES_SERVICE_HOST": "10.0.0.1"},
                              str(tmp_path / "none")) == ""  # no token mounted


def test_job_label_is_the_controllers_job_key(tmp_path):
    from controller.auth import scoped_job
    from loadtest.audit import default_tenant, job_label

    assert job_label("team-a", "lt-1") == scoped_job("team-a", "lt-1") == "team-a.lt-1"
    assert job_label("", "lt-1") == scoped_job(None, "lt-1") == "lt-1"
    (tmp_path / "namespace").write_text("trainers\n")
    assert default_tenant(IN_CLUSTER, {}, str(tmp_path)) == "trainers"  # the pod's own
    assert default_tenant(IN_CLUSTER, {"SANDMAN_TENANT": "x"}, str(tmp_path)) == "x"
    assert default_tenant("/kc", {}, str(tmp_path)) == ""
