"""`make test-compat K8S=1.xx`: the chart's admission on another Kubernetes minor.

The session's bed runs the control plane of $SANDMAN_K8S (testbed/versions.py
KUBERNETES_MINORS). The chart is installed on it with helm, and the admission tests of
tests/webhook are played through it, not copied: their test functions are imported here, so
pytest collects them in this module, where `bed` and `registered` are the fixtures below.
- Webhook down (docs/operations.md step 2, its configurations deleted): every golden case and
  the policy's hostile cases (tests/webhook/test_policy.py) against the chart's
  ValidatingAdmissionPolicy, one release per SandboxPolicy the cases use, its values derived
  from that policy (and the rendered policy checked to be webhook/policy.py's for it).
- Webhook up: the chart's webhook configurations (validating on, the policy off, so each path
  is judged alone) pointing at a webhook process on 127.0.0.1, and
  tests/webhook/test_webhook_on_testbed.py's cases through them, the bypass goldens included.
The only change to what the chart renders: its policy binding gains an objectSelector that
skips pods carrying test_policy.EXEMPT, so an UPDATE case can first store its old pod.
"""

from __future__ import annotations

import base64
import time
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from sandman.podspec import SandboxPolicy
from testbed import versions
from testbed.webhook import wait_webhook_active
from tests.charts.helm import Helm, kubectl
from tests.charts.test_chart_on_testbed import Release, _scoped, _values_file
from tests.webhook.test_policy import (  # noqa: F401 - collected here, with this module's bed
    EXEMPT,
    Bed,
    test_policy_admits_the_controllers_pods_and_refuses_what_the_webhook_would_fix,
    test_policy_agrees_with_the_python_check_on_every_golden_case,
    test_policy_alone_enforces_pod_security_baseline,
    test_policy_alone_judges_ephemeral_containers_through_the_subresource,
    test_policy_alone_refuses_an_egress_deny_pod_that_keeps_net_raw,
    test_policy_alone_refuses_stripping_what_makes_a_pod_judged,
    test_policy_compares_the_guard_args_at_every_position,
    wait_policy_active,
)
from tests.webhook.test_webhook_on_testbed import (  # noqa: F401 - collected here
    server,
    test_bypass_pods_refused_by_the_api_server_with_their_rule,
    test_dry_run_mutates_and_stores_nothing,
    test_forbidden_pods_refused_with_their_rule,
    test_labelled_pod_comes_out_a_sandbox_and_is_a_fixed_point,
)
from webhook import policy


def chart_values(pol: SandboxPolicy) -> dict:
    """The chart's sandbox values that render `pol` (tests/charts/test_chart.py reads the
    same mapping back from the webhook's rendered flags)."""
    default_ingress = pol.ingress_from == SandboxPolicy().ingress_from
    return {"sandbox": {
        "guard": pol.guard, "ingressFrom": [] if default_ingress else list(pol.ingress_from),
        "allowSecrets": pol.allow_secrets,
        "gpu": {"enabled": pol.gpu_max > 0, "max": max(pol.gpu_max, 1),
                "resource": pol.gpu_resource, "tolerations": list(pol.gpu_tolerations)},
        "egressCeiling": list(pol.egress_ceiling), "egressNever": list(pol.egress_never)}}


class Chart:
    """helm releases of charts/sandman on the session's bed, each scoped to one namespace,
    all uninstalled (and any cluster-scoped leftover deleted by label) at close()."""

    def __init__(self, cluster, tmp: Path):
        self.cluster, self.tmp = cluster, tmp
        self.helm = Helm(tmp / "helm-home", cluster.kubeconfig)
        self.release_ns = cluster.new_namespace("compat-rel")
        self.books_ns = cluster.new_namespace("compat-books")
        self.releases: list[Release] = []

    def install(self, namespace: str, pol: SandboxPolicy, url: str, ca: bytes,
                *extra: dict) -> Release:
        rel = Release(self.helm, self.cluster, self.release_ns)
        self.releases.append(rel)
        values = _values_file(self.tmp, f"{rel.name}", _scoped(namespace), chart_values(pol), {
            # The books policy (controller-only labels) binds the sandbox namespace: kept off
            # the cases' namespace, whose UPDATE cases set those labels as a user.
            "sandboxNamespace": self.books_ns, "controller": {"readyCheck": "pod"},
            # Cluster-wide names the chart takes from values: one per release here.
            "rbac": {"userClusterRole": f"{rel.name}-user",
                     "adminClusterRole": f"{rel.name}-admin"},
            "webhook": {"development": {"url": url, "caBundle": base64.b64encode(ca).decode()}}},
            *extra)
        rel.install(values)
        return rel

    def close(self) -> None:
        for rel in self.releases:
            rel.__exit__(None, None, None)
        self.cluster.delete_namespace(self.release_ns)
        self.cluster.delete_namespace(self.books_ns)


@pytest.fixture(scope="module")
def chart(cluster, tmp_path_factory):
    c = Chart(cluster, tmp_path_factory.mktemp("compat-chart"))
    yield c
    c.close()


class ChartBed(Bed):
    """test_policy's Bed, with the chart's policy instead of webhook/policy.py's objects: one
    release per SandboxPolicy, its webhook configurations deleted (the webhook is down)."""

    def __init__(self, cluster, chart: Chart):
        super().__init__(cluster)
        self.chart = chart

    def namespace_for(self, pol: SandboxPolicy) -> str:
        if pol in self.namespaces:
            return self.namespaces[pol]
        ns = self.cluster.new_namespace(f"compat-vap-{len(self.namespaces)}")
        self.namespaces[pol] = ns
        # Port 1 on loopback: nothing serves it, and the configurations are deleted below.
        rel = self.chart.install(ns, pol, "https://127.0.0.1:1", b"unused")
        objs = rel.manifest()
        vap = next(o for o in objs if o["kind"] == "ValidatingAdmissionPolicy"
                   and not o["metadata"]["name"].endswith("-books"))
        assert vap["spec"] == policy.admission_policy("x", pol)["spec"], \
            "chart_values() does not render this SandboxPolicy"
        for o in objs:
            if o["kind"] in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
                kubectl(self.cluster.kubeconfig, "delete", o["kind"].lower(),
                        o["metadata"]["name"])
        binding = next(o for o in objs if o["kind"] == "ValidatingAdmissionPolicyBinding"
                       and o["spec"]["policyName"] == vap["metadata"]["name"])
        self.api.patch_validating_admission_policy_binding(
            binding["metadata"]["name"], {"spec": {"matchResources": {"objectSelector": {
                "matchExpressions": [{"key": EXEMPT, "operator": "DoesNotExist"}]}}}})
        wait_policy_active(self.cluster.core, ns)
        _wait_webhook_gone(self.cluster.core, ns)
        return ns

    def close(self) -> None:
        for ns in self.namespaces.values():
            self.cluster.delete_namespace(ns)


def _wait_webhook_gone(core, namespace: str, timeout: float = 30) -> None:
    """Until a labelled sandbox comes back unmutated (refused by the policy alone): the API
    server has dropped the deleted webhook configurations."""
    from testbed.webhook import probe_pod

    deadline = time.monotonic() + timeout
    while True:
        try:
            core.create_namespaced_pod(namespace, probe_pod(namespace), dry_run="All")
        except ApiException as e:
            if "failed calling webhook" not in str(e.body):
                return
        if time.monotonic() > deadline:
            raise AssertionError(f"the chart's webhook is still called in {namespace}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def bed(cluster, chart):
    b = ChartBed(cluster, chart)
    yield b
    b.close()


@pytest.fixture
def registered(cluster, namespace, server, chart):  # noqa: F811 - the imported fixture
    """The chart's webhook configurations (validating on) pointing at the local webhook, the
    policy off: the webhook alone judges."""
    rel = chart.install(namespace, SandboxPolicy(), server.url, server.ca.read_bytes(),
                        {"webhook": {"validating": {"enabled": True}},
                         "admissionPolicy": {"enabled": False}})
    wait_webhook_active(cluster.core, namespace)
    yield rel
    chart.releases.remove(rel)
    rel.__exit__(None, None, None)


def test_the_bed_runs_the_requested_kubernetes(cluster, figures):
    """The run is on the minor asked for, not silently on CI's version."""
    got = client.VersionApi(cluster.api_client).get_code().git_version
    assert got == versions.kubernetes(), got
    from tests.webhook import golden_cases
    from tests.webhook.test_golden import CASES
    from tests.webhook.test_webhook_on_testbed import FORBIDDEN

    bypass = [n for n, r in golden_cases.bypass_cases().items()
              if r["request"]["operation"] == "CREATE" and "privileged" not in n]
    figures.add(f"compat: the chart's admission on Kubernetes {got}: {len(CASES)} golden cases "
                f"through the policy (webhook down); {len(bypass)} bypass goldens and "
                f"{len(FORBIDDEN)} forbidden pods through the webhook (up)")
