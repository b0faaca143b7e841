"""The chart's egress ceiling on the test bed's API server: installed with sandbox.egressCeiling
and sandbox.egressNever, the ValidatingAdmissionPolicy Helm rendered from them (the webhook's
configurations deleted, as in an outage) admits what the webhook would render for an allowlist
within the ceiling and refuses the bypasses; the API server accepts the ceiling NetworkPolicy
as rendered, never ranges excepted."""

from __future__ import annotations

import copy

import pytest
from kubernetes import client

from sandman.contract import (
    ANNOTATION_EGRESS_ALLOW,
    ANNOTATION_TOKEN_SHA256,
    LABEL_EGRESS,
    LABEL_SANDBOX,
)
from sandman.podspec import SandboxPolicy, make_sandbox
from tests.charts.helm import Helm, kubectl
from tests.charts.test_chart_on_testbed import (
    TOKEN,
    Release,
    _refused,
    _scoped,
    _values_file,
)

CEILING = ["10.0.0.0/8:*", "[fd00::/8]:443", "svc/*.infra:*",
           {"entry": "svc/pypi-mirror.mirrors:3141", "podSelector": {
               "matchLabels": {"app": "pypi-mirror"}}, "targetPort": 8080}]
NEVER = ["10.96.0.1", "10.100.0.0/16"]
# The webhook's policy for these values (its flags: a Service's object form gives its entry).
POLICY = SandboxPolicy(egress_ceiling=("10.0.0.0/8:*/tcp", "[fd00::/8]:443/tcp",
                                       "svc/*.infra:*/tcp", "svc/pypi-mirror.mirrors:3141/tcp"),
                       egress_never=tuple(NEVER))
WIDE = SandboxPolicy(egress_ceiling=("0.0.0.0/0:*", "svc/*.other:*", "[::/0]:*"),
                     egress_never=tuple(NEVER))


@pytest.fixture
def helm(cluster, tmp_path) -> Helm:
    return Helm(tmp_path / "helm-home", cluster.kubeconfig)


def allowlisted(allow: str, egress: str = "deny") -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"generateName": "allow-", "labels": {LABEL_SANDBOX: "true",
                                                              LABEL_EGRESS: egress},
                         "annotations": {ANNOTATION_TOKEN_SHA256: TOKEN,
                                         ANNOTATION_EGRESS_ALLOW: allow}},
            "spec": {"containers": [{"name": "task", "image": "python:3.12-slim"}]}}


def forged(entry: str) -> dict:
    """A pod as the webhook would render it for `entry`, which the webhook itself refuses
    (outside the ceiling, a never range): annotation and guard args written by hand, as a
    bypass would."""
    pod = make_sandbox(allowlisted("10.0.0.0/8:443/tcp"), POLICY)
    pod["metadata"]["annotations"][ANNOTATION_EGRESS_ALLOW] = entry
    args = pod["spec"]["initContainers"][0]["args"]
    args[args.index("10.0.0.0/8:443/tcp")] = entry
    return pod


def test_the_charts_policy_holds_the_ceiling_and_its_network_policy_is_accepted(
        cluster, namespace, helm, tmp_path):
    sandboxes = cluster.new_namespace("chart-egress")
    try:
        with Release(helm, cluster, namespace) as rel:
            rel.install(_values_file(tmp_path, "v", _scoped(sandboxes), {
                "sandboxNamespace": sandboxes, "controller": {"readyCheck": "pod"},
                "sandbox": {"egressCeiling": CEILING, "egressNever": NEVER}}))
            # Only the policy judges: the webhook's configurations are gone (an outage).
            for kind in ("mutatingwebhookconfiguration", "validatingwebhookconfiguration"):
                for o in rel.manifest():
                    if o["kind"].lower() == kind:
                        kubectl(cluster.kubeconfig, "delete", kind, o["metadata"]["name"],
                                "--ignore-not-found")
            outside = make_sandbox(allowlisted("0.0.0.0/0:443/tcp"), WIDE)
            e = _refused(cluster, sandboxes, outside)  # waits for the policy to load
            assert e.status == 403 and "sandman egress-allow-refused" in e.body, e.body
            for bad, rule in (
                    (make_sandbox(allowlisted("svc/pypi.other:3141/tcp"), WIDE),
                     "egress-allow-refused"),
                    (forged("[fe80::/64]:443/tcp"), "egress-allow-refused"),
                    (forged("10.100.1.0/24:443/tcp"), "egress-allow-refused"),  # egressNever
                    (forged("169.254.169.254/32:80/tcp"), "egress-allow-refused"),
                    (forged("svc/pypi-mirror.mirrors:3142/tcp"), "egress-allow-refused")):
                e = _refused(cluster, sandboxes, bad, timeout=5)
                assert e.status == 403 and f"sandman {rule}" in e.body, (bad, e.body)
            # Within the ceiling, as the webhook renders it: admitted.
            for allow in ("10.0.0.0/8:443/tcp,[fd00:1::/64]:443/tcp,svc/pypi.infra:3141/tcp",
                          "10.96.0.0/12:443/tcp", "svc/pypi-mirror.mirrors:3141/tcp"):
                good = make_sandbox(allowlisted(allow), POLICY)
                got = cluster.core.create_namespaced_pod(sandboxes, good, dry_run="All")
                assert "--allow-egress" in got.spec.init_containers[0].args
            # The same pod with an extra entry in its guard: not what the annotation says.
            extra = copy.deepcopy(good)
            extra["spec"]["initContainers"][0]["args"] += ["--allow-egress", "0.0.0.0/0:443/tcp"]
            e = _refused(cluster, sandboxes, extra, timeout=5)
            assert "sandman guard-misconfigured" in e.body, e.body
            # The ceiling NetworkPolicy, as the API server stored it.
            net = client.NetworkingV1Api(cluster.api_client)
            pol = next(p for p in net.list_namespaced_network_policy(sandboxes).items
                       if p.metadata.name.endswith("-sandbox-egress-ceiling"))
            first = pol.spec.egress[0].to[0].ip_block
            assert (first.cidr, first._except) == ("10.0.0.0/8", ["10.96.0.1/32",
                                                                  "10.100.0.0/16"])
            v6 = pol.spec.egress[1].to[0].ip_block
            assert (v6.cidr, v6._except) == ("fd00::/8", ["fd00:ec2::254/128"])
            assert pol.spec.egress[3].ports[0].port == 8080
    finally:
        cluster.delete_namespace(sandboxes)
