"""Who netguard admits to execd's port when `sandbox.ingressFrom` is narrowed to the trainers.

docs/install.md's own example (`sandbox.ingressFrom: [10.32.0.0/12]`, the trainers' pod CIDR)
locked out the controller: with `--ready-check execd` it dials execd from its own pod IP, which
is not a trainer's, so no sandbox it built ever became "ready" (kwok runs no init container and
no execd, so nothing showed it). The controller replica that builds a pod admits its own pod
IP on that pod (policy.controller_ip -> the pod's ingress-from annotation): it only ever dials
execd on pods its own process built, and the webhook, which reads the same annotation, accepts
the pod unchanged. Every other source stays refused.
"""

from __future__ import annotations

import dataclasses
import ipaddress

import jsonpatch
import pytest

from sandman.contract import (
    ANNOTATION_INGRESS_FROM,
    ANNOTATION_TOKEN_SHA256,
    LABEL_EGRESS,
    LABEL_SANDBOX,
)
from sandman.podspec import NODE_IP_ENV, SandboxPolicy, check_sandbox, make_sandbox, netguard_args

TRAINERS = "10.32.0.0/12"
CONTROLLER_IP = "10.200.0.7"  # a system node pool, outside the trainers' CIDR
NARROWED = SandboxPolicy(ingress_from=(TRAINERS,))


def _pod(egress: str = "deny", annotations: dict | None = None) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "sbx-1", "labels": {LABEL_SANDBOX: "true", LABEL_EGRESS: egress},
                         "annotations": {ANNOTATION_TOKEN_SHA256: "a" * 64,
                                         **(annotations or {})}},
            "spec": {"containers": [{"name": "sandbox", "image": "img"}]}}


def _sources(pod: dict, policy: SandboxPolicy) -> list[str]:
    args = netguard_args(pod, policy)
    return [args[i + 1] for i, a in enumerate(args) if a == "--ingress-from"]


def _admits(pod: dict, policy: SandboxPolicy, ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    for s in _sources(pod, policy):
        if s == f"$({NODE_IP_ENV})":
            continue
        net = ipaddress.ip_network(s, strict=False)
        if net.version == addr.version and addr in net:
            return True
    return False


@pytest.mark.parametrize("egress", ["deny", "allow"])
def test_a_pod_the_controller_builds_admits_the_controller_under_a_narrowed_ingress(egress):
    built = make_sandbox(_pod(egress), dataclasses.replace(NARROWED, controller_ip=CONTROLLER_IP))
    assert _admits(built, NARROWED, CONTROLLER_IP), _sources(built, NARROWED)
    assert _admits(built, NARROWED, "10.33.1.2")  # a trainer
    assert not _admits(built, NARROWED, "10.200.0.8")  # any other pod: still refused
    assert not _admits(built, NARROWED, "10.31.255.255")
    assert _sources(built, NARROWED)[-1] == f"$({NODE_IP_ENV})"  # the kubelet's probes
    # The webhook (no controller_ip) accepts it exactly as built: empty patch, no refusal.
    again = make_sandbox(built, NARROWED)
    assert jsonpatch.make_patch(built, again).patch == []
    assert check_sandbox(built, NARROWED) == []
    # And the controller's own re-mutation is idempotent.
    ctl = dataclasses.replace(NARROWED, controller_ip=CONTROLLER_IP)
    assert make_sandbox(built, ctl) == built


def test_the_controller_adds_nothing_when_ingress_already_admits_it():
    """Default install (0.0.0.0/0): the pod is the same as without a controller_ip, so the
    webhook goldens and the controller's empty-patch test are untouched."""
    plain = make_sandbox(_pod(), SandboxPolicy())
    built = make_sandbox(_pod(), SandboxPolicy(controller_ip=CONTROLLER_IP))
    assert built == plain and ANNOTATION_INGRESS_FROM not in built["metadata"]["annotations"]


def test_an_ipv6_controller_is_admitted_as_a_host_not_matched_by_an_ipv4_wildcard():
    built = make_sandbox(_pod(), SandboxPolicy(controller_ip="fd00:200::7"))
    assert _sources(built, SandboxPolicy())[:2] == ["0.0.0.0/0", "fd00:200::7/128"]


def test_an_explicit_annotation_keeps_its_sources_and_gains_only_the_controller():
    pod = _pod(annotations={ANNOTATION_INGRESS_FROM: "10.1.0.0/16, fd00::/64"})
    built = make_sandbox(pod, dataclasses.replace(NARROWED, controller_ip=CONTROLLER_IP))
    assert _sources(built, NARROWED)[:3] == ["10.1.0.0/16", "fd00::/64", f"{CONTROLLER_IP}/32"]
    assert not _admits(built, NARROWED, "10.33.1.2")  # the annotation, not the policy, rules


def test_controller_ip_must_be_an_address():
    with pytest.raises(ValueError):
        SandboxPolicy(controller_ip="10.0.0.0/8")
    with pytest.raises(ValueError):
        SandboxPolicy(controller_ip="controller.local")
