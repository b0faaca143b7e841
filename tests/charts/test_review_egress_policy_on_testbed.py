"""The chart's ValidatingAdmissionPolicy alone (the webhook's configurations deleted, as in an
outage) against hand-written allowlists the webhook refuses: the two must refuse the same
entries (docs/webhook.md "Egress allowlists"). The pod is written as the webhook would render
it for a harmless entry, then the annotation and the guard's argument are swapped for the
hostile one, as a tenant creating pods in the sandbox namespace would.

- the NAT64 image (64:ff9b::/96) of an admin's never range (sandman/egress.py's never_ranges
  holds it; the policy gets the chart's rendering of them, `sandman.egressNeverNat64`);
- an IPv4 entry with host bits: not canonical for the webhook, a CIDR for Kubernetes' cidr();
  netguard would read it masked, so the pod would run another list than its annotation (the
  policy compares `cidr(x).masked()` with `cidr(x)`).
netguard fails the first closed at apply time too (its own never check); the ceiling
NetworkPolicy excepts the NAT64 images (tests/charts/test_egress_ceiling_on_testbed.py)."""

from __future__ import annotations

import ipaddress

import pytest
from kubernetes.client import ApiException

from sandman import egress
from sandman.contract import ANNOTATION_EGRESS_ALLOW
from sandman.podspec import SandboxPolicy, make_sandbox
from tests.charts.helm import Helm, kubectl
from tests.charts.test_chart_on_testbed import Release, _refused, _scoped, _values_file
from tests.charts.test_egress_ceiling_on_testbed import allowlisted

pytestmark = pytest.mark.testbed

CEILING = ["10.0.0.0/8:*", "[64:ff9b::/96]:443"]
NEVER = ["10.96.0.1", "10.100.0.0/16"]
POLICY = SandboxPolicy(egress_ceiling=("10.0.0.0/8:*/tcp", "[64:ff9b::/96]:443/tcp"),
                       egress_never=tuple(NEVER))
API_NAT64 = "[64:ff9b::a60:1/128]:443/tcp"  # 10.96.0.1 through NAT64
PUBLIC_NAT64 = "[64:ff9b::808:808/128]:443/tcp"  # 8.8.8.8 through NAT64: allowed
HOST_BITS = "10.1.2.3/8:443/tcp"


def forged(entry: str) -> dict:
    pod = make_sandbox(allowlisted("10.0.0.0/8:443/tcp"), POLICY)
    pod["metadata"]["annotations"][ANNOTATION_EGRESS_ALLOW] = entry
    args = pod["spec"]["initContainers"][0]["args"]
    args[args.index("10.0.0.0/8:443/tcp")] = entry
    return pod


@pytest.fixture(scope="module")
def policy_only(cluster, tmp_path_factory):
    """A sandbox namespace judged by the chart's policy alone; yields a dry-run create that
    answers None (admitted) or the refusal."""
    tmp = tmp_path_factory.mktemp("review-egress")
    helm = Helm(tmp / "helm-home", cluster.kubeconfig)
    home = cluster.new_namespace("review-egress-rel")
    sandboxes = cluster.new_namespace("review-egress")
    try:
        with Release(helm, cluster, home) as rel:
            rel.install(_values_file(tmp, "v", _scoped(sandboxes), {
                "sandboxNamespace": sandboxes, "controller": {"readyCheck": "pod"},
                "sandbox": {"egressCeiling": CEILING, "egressNever": NEVER}}))
            for kind in ("mutatingwebhookconfiguration", "validatingwebhookconfiguration"):
                for o in rel.manifest():
                    if o["kind"].lower() == kind:
                        kubectl(cluster.kubeconfig, "delete", kind, o["metadata"]["name"],
                                "--ignore-not-found")
            # Waits for the policy to load: the metadata address is refused by both.
            e = _refused(cluster, sandboxes, forged("169.254.169.254/32:443/tcp"))
            assert "sandman egress-allow-refused" in e.body, e.body

            def judge(pod: dict) -> ApiException | None:
                try:
                    cluster.core.create_namespaced_pod(sandboxes, pod, dry_run="All")
                except ApiException as ex:
                    return ex
                return None

            yield judge
    finally:
        cluster.delete_namespace(sandboxes)
        cluster.delete_namespace(home)


def test_the_webhook_refuses_both_entries():
    """The Python side of the comparison: never_ranges carries the NAT64 image, and the
    canonical check refuses host bits."""
    never = egress.never_ranges(egress.parse_never(NEVER))
    assert ipaddress.ip_network("64:ff9b::a60:1/128") in never
    assert egress.refusals(egress.parse_list(API_NAT64), egress.Ceiling.parse(CEILING),
                           egress.parse_never(NEVER))
    assert not egress.is_canonical(HOST_BITS)


def test_a_nat64_entry_outside_the_never_ranges_is_admitted(policy_only):
    assert policy_only(make_sandbox(allowlisted(PUBLIC_NAT64), POLICY)) is None


def test_the_nat64_image_of_an_admin_never_range_is_refused(policy_only):
    e = policy_only(forged(API_NAT64))
    assert e is not None and "sandman egress-allow-refused" in e.body


def test_an_entry_with_host_bits_is_refused(policy_only):
    e = policy_only(forged(HOST_BITS))
    assert e is not None and "sandman egress-allow-invalid" in e.body
