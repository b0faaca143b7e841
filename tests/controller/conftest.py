"""Fixtures of the controller's test-bed tests that more than one module uses."""

from __future__ import annotations

import secrets

import pytest
from kubernetes import client

from controller import auth as A
from testbed.controller import ControllerProc, local_tls_dir

VERBS = ["create", "get", "list", "update", "delete", "deletecollection"]


class Tenants:
    """Tenant namespaces, ServiceAccounts, RBAC and tokens, all removed afterwards."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.rbac = client.RbacAuthorizationV1Api(cluster.api_client)
        self.namespaces: list[str] = []
        self.role = f"sandman-user-test-{secrets.token_hex(4)}"
        self.rbac.create_cluster_role({"metadata": {"name": self.role}, "rules": [
            {"apiGroups": [A.GROUP], "resources": [A.RESOURCE], "verbs": VERBS}]})

    def namespace(self, prefix: str) -> str:
        ns = self.cluster.new_namespace(prefix)
        self.namespaces.append(ns)
        return ns

    def account(self, ns: str, name: str) -> str:
        self.cluster.core.create_namespaced_service_account(ns, {"metadata": {"name": name}})
        return f"system:serviceaccount:{ns}:{name}"

    def bind(self, ns: str, sa_ns: str, sa: str, name: str = "sandman-user") -> None:
        self.rbac.create_namespaced_role_binding(ns, {
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": self.role},
            "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": sa_ns}]})

    def token(self, ns: str, sa: str, audience: str = A.DEFAULT_AUDIENCE) -> str:
        tr = self.cluster.core.create_namespaced_service_account_token(
            sa, ns, {"spec": {"audiences": [audience], "expirationSeconds": 3600}})
        return tr.status.token

    def close(self) -> None:
        try:
            self.rbac.delete_cluster_role(self.role)
        except client.ApiException:
            pass
        for ns in self.namespaces:
            self.cluster.delete_namespace(ns)


@pytest.fixture
def tenants(cluster):
    t = Tenants(cluster)
    yield t
    t.close()


@pytest.fixture
def authctl(cluster, namespace, tmp_path):
    procs: list[ControllerProc] = []

    def make(*flags: str, kubeconfig=None) -> ControllerProc:
        p = ControllerProc(namespace, kubeconfig or cluster.kubeconfig,
                           tmp_path / f"controller-{len(procs)}.log",
                           ["--lease-name", f"auth-{namespace}-{len(procs)}", *flags],
                           auth="kubernetes", tls=local_tls_dir())
        procs.append(p)
        return p.start()

    yield make
    for p in procs:
        p.kill()
