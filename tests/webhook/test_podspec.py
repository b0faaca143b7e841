"""Properties of make_sandbox/check_sandbox over generated pods (hypothesis): idempotent, limits
never lowered, requests == limits, and the result fails only rules a mutation cannot fix."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandman.contract import ANNOTATION_TOKEN_SHA256, LABEL_EGRESS, LABEL_SANDBOX
from sandman.podspec import (
    GUARD_MODES,
    SandboxError,
    SandboxPolicy,
    check_sandbox,
    make_sandbox,
)
from sandman.quantity import parse_quantity

CPU = st.sampled_from(["100m", "250m", "0.5", "1", "1000m", "2", "4"])
MEM = st.sampled_from(["64Mi", "128Mi", "1Gi", "1024Mi", "2G", "8Gi"])
NAMES = st.sampled_from(["task", "proxy", "agent", "sidecar"])
UNFIXABLE = {"host-namespace", "privileged", "net-admin-added", "token-hash",
             "egress-label-invalid", "service-account-token", "sandbox-container-missing",
             "ingress-from-invalid"}


@st.composite
def resources(draw):
    out = {}
    for side in ("requests", "limits"):
        if draw(st.booleans()):
            values = {}
            if draw(st.booleans()):
                values["cpu"] = draw(CPU)
            if draw(st.booleans()):
                values["memory"] = draw(MEM)
            out[side] = values
    return out


@st.composite
def containers(draw):
    c = {"name": draw(NAMES), "image": "img"}
    if draw(st.booleans()):
        c["resources"] = draw(resources())
    if draw(st.booleans()):
        c["command"] = draw(st.sampled_from([["sleep", "1"], ["python3", "/sandman/execd.py"]]))
    if draw(st.booleans()):
        c["securityContext"] = {"capabilities": {"drop": draw(st.lists(st.sampled_from(
            ["ALL", "NET_RAW", "SYS_ADMIN"]), max_size=2, unique=True))}}
    if draw(st.booleans()):
        c["env"] = [{"name": "SANDMAN_TOKEN_SHA256", "value": "x"}]
    return c


@st.composite
def pods(draw):
    cs = draw(st.lists(containers(), min_size=1, max_size=3, unique_by=lambda c: c["name"]))
    inits = draw(st.lists(containers(), max_size=2, unique_by=lambda c: c["name"]))
    inits = [{**c, "name": "init-" + c["name"]} for c in inits]
    labels = {LABEL_SANDBOX: "true"}
    egress = draw(st.sampled_from([None, "deny", "allow"]))
    if egress:
        labels[LABEL_EGRESS] = egress
    spec = {"containers": cs}
    if draw(st.booleans()):  # what the service-account plugin adds, with its random suffix
        name = "kube-api-access-" + draw(st.text("abcdefghijklmnopqrstuvwxyz0123456789",
                                                 min_size=5, max_size=5))
        spec["volumes"] = [{"name": name, "projected": {"sources": [
            {"serviceAccountToken": {"path": "token"}}]}}]
        for c in cs:
            c["volumeMounts"] = [{"name": name, "mountPath": "/var/run/secrets/x"}]
            if draw(st.booleans()):
                c["env"] = [{"name": "VOLUME", "value": name}]
    if inits:
        spec["initContainers"] = inits
    if draw(st.booleans()):
        spec["enableServiceLinks"] = True
    return {"metadata": {"labels": labels, "annotations": {ANNOTATION_TOKEN_SHA256: "a" * 64}},
            "spec": spec}


def _limits(pod):
    spec = pod["spec"]
    return {(c["name"], r): parse_quantity(v)
            for c in spec.get("initContainers", []) + spec["containers"]
            for r, v in ((c.get("resources") or {}).get("limits") or {}).items()}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pods(), st.sampled_from(GUARD_MODES))
@pytest.mark.slow
def test_make_sandbox_properties(pod, guard):
    policy = SandboxPolicy(guard=guard)
    try:
        once = make_sandbox(pod, policy)
    except SandboxError:
        return
    assert make_sandbox(once, policy) == once
    after = _limits(once)
    for key, before in _limits(pod).items():
        assert after[key] >= before, key
    for c in once["spec"]["initContainers"] + once["spec"]["containers"]:
        r = c["resources"]
        for name in ("cpu", "memory"):
            assert parse_quantity(r["requests"][name]) == parse_quantity(r["limits"][name])
    assert {r.rule for r in check_sandbox(once, policy)} <= UNFIXABLE


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pods(), st.dictionaries(st.sampled_from(["sandman.dev/nonce", "sandman.dev/job", "app"]),
                               st.text(min_size=1, max_size=5), max_size=2),
       st.sampled_from(["a" * 64, "b" * 64, "short", None]), st.text(max_size=8))
@pytest.mark.slow
def test_cached_answers_equal_direct_ones(pod, extra_labels, token, name):
    """The webhook caches by spec + INPUT_LABELS + INPUT_ANNOTATIONS: names, other labels and a
    valid token's value must not change a result, and cached answers equal computed ones."""
    import jsonpatch

    from webhook import admission

    pod["metadata"]["labels"].update(extra_labels)
    pod["metadata"]["name"] = name
    if token is None:
        pod["metadata"]["annotations"].pop(ANNOTATION_TOKEN_SHA256)
    else:
        pod["metadata"]["annotations"][ANNOTATION_TOKEN_SHA256] = token
    policy = SandboxPolicy()
    for round_ in range(3):  # later rounds are served from the cache
        if round_ == 2:  # another pod of the burst: the plugin's volume has another suffix
            pod = json.loads(json.dumps(pod).replace("kube-api-access-", "kube-api-access-z"))
        try:
            direct = jsonpatch.make_patch(pod, make_sandbox(pod, policy)).patch
        except SandboxError as e:
            assert admission.patch_for(pod, policy) == (b"", e.refusal)
        else:
            patch, refusal = admission.patch_for(pod, policy)
            assert refusal is None
            assert jsonpatch.apply_patch(pod, json.loads(patch) if patch else []) == \
                jsonpatch.apply_patch(pod, direct)
        assert admission.refusals_for(pod, policy) == check_sandbox(pod, policy)


def test_big_pods_bypass_the_cache():
    from webhook import admission

    pod = {"metadata": {"labels": {LABEL_SANDBOX: "true"},
                        "annotations": {ANNOTATION_TOKEN_SHA256: "a" * 64}},
           "spec": {"containers": [{"name": "task", "image": "img", "env": [
               {"name": f"V{i}", "value": "x" * 100} for i in range(400)]}]}}
    admission.clear_caches()
    patch, refusal = admission.patch_for(pod, SandboxPolicy())
    assert patch and refusal is None
    assert admission.refusals_for(pod, SandboxPolicy())
    assert admission._patch_cached.cache_info().currsize == 0
    assert admission._refusals_cached.cache_info().currsize == 0
