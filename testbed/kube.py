"""The Kubernetes client side of a test bed (or of any cluster given by a kubeconfig): API
clients and namespaces that are ready for pod creates."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path

from kubernetes import client, config

from testbed.cluster import Testbed
from testbed.procs import wait_for


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
