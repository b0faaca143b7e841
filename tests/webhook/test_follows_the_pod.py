"""Admission follows the pod, not its labels: an UPDATE cannot strip a sandbox of what makes the
webhook and the policy judge it (its labels, its token annotation), a pod carrying sandman's
injected init containers is judged as a sandbox whatever its labels say, and every Pod Security
Standards baseline control holds in sandboxes (docs/webhook.md, "Pod Security baseline").
Pure logic through the webhook's handler; the policy's CEL twins are played on the test bed
(tests/webhook/test_policy.py)."""

from __future__ import annotations

import copy

import pytest

from sandman.contract import (
    ANNOTATION_TOKEN_SHA256,
    EXECD_INSTALL_CONTAINER,
    LABEL_EGRESS,
    LABEL_SANDBOX,
)
from sandman.podspec import SandboxPolicy, make_sandbox
from tests.webhook.golden_cases import deny_pod, ephemeral, pod, review
from webhook import admission

POLICY = SandboxPolicy()
OTHER_TOKEN = "ab" * 32


def sandbox(deny: bool = False) -> dict:
    labels = {LABEL_SANDBOX: "true", **({LABEL_EGRESS: "deny"} if deny else {})}
    return make_sandbox(pod(labels=labels), POLICY)


def edited(p: dict, fn) -> dict:
    p = copy.deepcopy(p)
    fn(p)
    return p


def verdict(r: dict) -> tuple[bool, str]:
    out, _ = admission.validate(r, POLICY)
    resp = out["response"]
    return resp["allowed"], (resp.get("status") or {}).get("message", "")


def refused(r: dict, rule: str) -> None:
    allowed, message = verdict(r)
    assert not allowed, "admitted"
    assert f"sandman {rule}:" in message, message


def update(old: dict, fn) -> dict:
    return review("u", edited(old, fn), operation="UPDATE", old=old)


def _labels(p: dict) -> dict:
    return p["metadata"]["labels"]


def _annotations(p: dict) -> dict:
    return p["metadata"]["annotations"]


# --- 1. an UPDATE cannot take away what makes a pod judged -------------------------------------

@pytest.mark.parametrize("deny", [False, True])
def test_removing_the_sandbox_label_is_refused(deny):
    refused(update(sandbox(deny), lambda p: _labels(p).pop(LABEL_SANDBOX)), "metadata-immutable")


def test_changing_the_sandbox_label_is_refused():
    refused(update(sandbox(), lambda p: _labels(p).update({LABEL_SANDBOX: "false"})),
            "metadata-immutable")


@pytest.mark.parametrize("old", ["sandbox", "deny-only"])
@pytest.mark.parametrize("edit", ["allow", "removed"])
def test_egress_deny_cannot_be_undone(old, edit):
    p = sandbox(deny=True) if old == "sandbox" else deny_pod()

    def fn(q):
        if edit == "allow":
            _labels(q)[LABEL_EGRESS] = "allow"
        else:
            _labels(q).pop(LABEL_EGRESS)
    refused(update(p, fn), "metadata-immutable")


def test_all_labels_stripped_from_a_deny_sandbox_is_refused():
    refused(update(sandbox(deny=True), lambda p: p["metadata"].pop("labels")),
            "metadata-immutable")


@pytest.mark.parametrize("value", [OTHER_TOKEN, None])
def test_the_token_annotation_cannot_change(value):
    def fn(q):
        if value is None:
            _annotations(q).pop(ANNOTATION_TOKEN_SHA256)
        else:
            _annotations(q)[ANNOTATION_TOKEN_SHA256] = value
    refused(update(sandbox(), fn), "metadata-immutable")


def test_the_token_of_a_sandbox_whose_label_is_also_removed_cannot_change():
    refused(update(sandbox(), lambda p: (_labels(p).pop(LABEL_SANDBOX), _annotations(p).update(
        {ANNOTATION_TOKEN_SHA256: OTHER_TOKEN}))), "metadata-immutable")


def test_label_updates_that_keep_what_is_judged_are_admitted():
    for old in (sandbox(), sandbox(deny=True), deny_pod()):
        allowed, message = verdict(update(old, lambda p: _labels(p).update(team="a")))
        assert allowed, message
    # allow -> deny is judged by the guard the pod runs (the existing rule), not refused here.
    allowed, message = verdict(update(sandbox(), lambda p: _labels(p).update(
        {LABEL_EGRESS: "allow"})))
    assert allowed, message


# --- 2. sandman's init containers make a pod a sandbox, whatever its labels ----------------------

def _unlabelled(p: dict) -> dict:
    return edited(p, lambda q: q["metadata"].update(labels={"app": "x"}))


def test_a_pod_carrying_the_install_container_without_the_label_is_refused_at_create():
    refused(review("c", _unlabelled(sandbox())), "sandbox-label")


def test_netadmin_debugger_on_an_unlabelled_pod_carrying_sandmans_containers_is_refused():
    """A pod that lost its labels (admitted before this rule, or during an outage of both the
    webhook and the policy) still carries sandman's init containers: kubectl debug with a
    privileged NET_ADMIN container is judged like on any sandbox."""
    for old in (_unlabelled(sandbox()), _unlabelled(sandbox(deny=True)), _unlabelled(deny_pod())):
        r = ephemeral(old, securityContext={"privileged": True,
                                            "capabilities": {"add": ["NET_ADMIN"]}})
        allowed, message = verdict(r)
        assert not allowed, old["spec"]["initContainers"][0]["name"]
        assert "sandman privileged:" in message and "sandman net-admin-added:" in message, message


def test_a_restricted_debugger_on_such_a_pod_is_admitted():
    r = ephemeral(_unlabelled(sandbox()), securityContext={"capabilities": {"drop": ["ALL"]}})
    allowed, message = verdict(r)
    assert allowed, message


def test_a_pod_that_only_names_a_container_like_ours_is_judged():
    p = pod(labels={"app": "x"}, annotations={}, initContainers=[
        {"name": EXECD_INSTALL_CONTAINER, "image": "x"}], hostNetwork=True)
    allowed, message = verdict(review("c", p))
    assert not allowed and "sandman host-namespace:" in message, message


# --- 3. Pod Security Standards baseline, in sandboxes ------------------------------------------

def _task_sc(p: dict) -> dict:
    return p["spec"]["containers"][0]["securityContext"]


BASELINE_REFUSED = {
    "host-port": lambda p: p["spec"]["containers"][0]["ports"].append(
        {"containerPort": 8080, "hostPort": 8080}),
    "selinux-type": lambda p: _task_sc(p).update(seLinuxOptions={"type": "spc_t"}),
    "selinux-pod-type": lambda p: p["spec"].update(securityContext={
        "seLinuxOptions": {"type": "unconfined_t"}}),
    "selinux-user": lambda p: _task_sc(p).update(seLinuxOptions={"user": "system_u"}),
    "selinux-role": lambda p: p["spec"].update(securityContext={
        "seLinuxOptions": {"role": "system_r"}}),
    "sysctl-unsafe": lambda p: p["spec"].update(securityContext={"sysctls": [
        {"name": "kernel.msgmax", "value": "65536"}]}),
    "apparmor-annotation-other": lambda p: _annotations(p).update({
        "container.apparmor.security.beta.kubernetes.io/task": "foo"}),
    "procmount-unmasked": lambda p: _task_sc(p).update(procMount="Unmasked"),
    "host-process": lambda p: _task_sc(p).update(windowsOptions={"hostProcess": True}),
    "seccomp-unconfined": lambda p: _task_sc(p).update(seccompProfile={"type": "Unconfined"}),
}
BASELINE_RULE = {"host-port": "host-port", "selinux-type": "selinux",
                 "selinux-pod-type": "selinux", "selinux-user": "selinux",
                 "selinux-role": "selinux", "sysctl-unsafe": "sysctl",
                 "apparmor-annotation-other": "unconfined", "procmount-unmasked": "unconfined",
                 "host-process": "privileged", "seccomp-unconfined": "unconfined"}


@pytest.mark.parametrize("name", sorted(BASELINE_REFUSED))
def test_baseline_control_refused_in_a_sandbox(name):
    refused(review("b", edited(sandbox(), BASELINE_REFUSED[name])), BASELINE_RULE[name])


@pytest.mark.parametrize("name", sorted(BASELINE_REFUSED))
def test_baseline_control_refused_in_an_egress_deny_pod(name):
    if name == "apparmor-annotation-other":
        fn = lambda p: _annotations(p).update(  # noqa: E731
            {"container.apparmor.security.beta.kubernetes.io/worker": "foo"})
    elif name == "host-port":
        fn = lambda p: p["spec"]["containers"][0].update(ports=[  # noqa: E731
            {"containerPort": 8080, "hostPort": 8080}])
    else:
        fn = BASELINE_REFUSED[name]
    refused(review("b", edited(deny_pod(), fn)), BASELINE_RULE[name])


BASELINE_ALLOWED = {
    "selinux-container-t": lambda p: _task_sc(p).update(seLinuxOptions={
        "type": "container_t", "level": "s0:c123,c456"}),
    "selinux-engine-t": lambda p: p["spec"].update(securityContext={
        "seLinuxOptions": {"type": "container_engine_t"}}),
    "sysctl-safe": lambda p: p["spec"].update(securityContext={"sysctls": [
        {"name": "net.ipv4.ip_unprivileged_port_start", "value": "0"},
        {"name": "net.ipv4.tcp_keepalive_time", "value": "60"}]}),
    "apparmor-localhost": lambda p: (_task_sc(p).update(appArmorProfile={
        "type": "Localhost", "localhostProfile": "sandbox"}), _annotations(p).update({
            "container.apparmor.security.beta.kubernetes.io/task": "localhost/sandbox"})),
    "host-port-zero": lambda p: p["spec"]["containers"][0]["ports"].append(
        {"containerPort": 8080, "hostPort": 0}),
}


@pytest.mark.parametrize("name", sorted(BASELINE_ALLOWED))
def test_baseline_allowed_values_admitted(name):
    allowed, message = verdict(review("b", edited(sandbox(), BASELINE_ALLOWED[name])))
    assert allowed, message


@pytest.mark.parametrize("sc,rule", [
    ({"seLinuxOptions": {"type": "spc_t"}}, "selinux"),
    ({"procMount": "Unmasked"}, "unconfined"),
    ({"appArmorProfile": {"type": "Unconfined"}}, "unconfined"),
])
def test_baseline_controls_judge_ephemeral_containers(sc, rule):
    r = ephemeral(sandbox(), securityContext={"capabilities": {"drop": ["ALL"]}, **sc})
    refused(r, rule)


def test_a_profile_annotation_added_by_an_update_is_judged():
    """The legacy per-container AppArmor annotation, added on UPDATE before a debugger of that
    name joins, is judged like at create."""
    refused(update(sandbox(), lambda p: _annotations(p).update({
        "container.apparmor.security.beta.kubernetes.io/debugger": "unconfined"})), "unconfined")
