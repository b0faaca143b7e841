"""The injected init containers never raise a pod's effective request, nor change its QoS class.

The effective request and the QoS class are computed here as the Kubernetes documentation
states them ("Init containers: resource sharing within containers", "Sidecar containers:
resource sharing", "Pod Quality of Service Classes"), not with the product's code."""

from __future__ import annotations

import copy
from decimal import Decimal

import pytest

from sandman.contract import EXECD_INSTALL_CONTAINER, LABEL_SANDBOX, NETGUARD_CONTAINER
from sandman.podspec import GUARD_EGRESS_DENY, SandboxPolicy, guarded_pod, make_sandbox

POLICY = SandboxPolicy()
INJECTED = (NETGUARD_CONTAINER, EXECD_INSTALL_CONTAINER)
# What each guard mode injects into a sandbox: a guarded sandbox's guard installs execd itself,
# an unguarded sandbox gets the install alone.
MODES = {"guard-always": (POLICY, [NETGUARD_CONTAINER]),
         "guard-egress-deny": (SandboxPolicy(guard=GUARD_EGRESS_DENY), [EXECD_INSTALL_CONTAINER])}
RESOURCES = ("cpu", "memory")

_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "m": Decimal("0.001"), "k": 1000,
          "M": 10**6, "G": 10**9}


def q(text) -> Decimal:
    text = str(text)
    for unit in sorted(_UNITS, key=len, reverse=True):
        if text.endswith(unit):
            return Decimal(text[: -len(unit)]) * Decimal(_UNITS[unit])
    return Decimal(text)


def requests_of(c: dict) -> dict:
    """A container's requests as the API server defaults them: a limit without a request
    becomes the request."""
    res = c.get("resources") or {}
    out = {k: q(v) for k, v in (res.get("limits") or {}).items() if k in RESOURCES}
    out.update({k: q(v) for k, v in (res.get("requests") or {}).items() if k in RESOURCES})
    return out


def effective_request(pod: dict, name: str) -> Decimal:
    """max(the highest init container's effective request, sum of the containers' requests plus
    the sidecars'); an init container's effective request adds the sidecars started before it."""
    spec = pod["spec"]
    sidecars, init_max = Decimal(0), Decimal(0)
    for c in spec.get("initContainers") or []:
        r = requests_of(c).get(name, Decimal(0))
        if c.get("restartPolicy") == "Always":
            sidecars += r
            init_max = max(init_max, sidecars)
        else:
            init_max = max(init_max, r + sidecars)
    apps = sum((requests_of(c).get(name, Decimal(0)) for c in spec["containers"]), Decimal(0))
    return max(init_max, apps + sidecars)


def qos_class(pod: dict) -> str:
    containers = list(pod["spec"].get("initContainers") or []) + list(pod["spec"]["containers"])
    any_set, guaranteed = False, True
    for c in containers:
        res = c.get("resources") or {}
        lim = {k: q(v) for k, v in (res.get("limits") or {}).items() if k in RESOURCES}
        req = requests_of(c)
        any_set = any_set or bool(req) or bool(lim)
        if set(lim) != set(RESOURCES) or any(req.get(k) != lim[k] for k in RESOURCES):
            guaranteed = False
    return "Guaranteed" if guaranteed else ("Burstable" if any_set else "BestEffort")


def without_injected(pod: dict) -> dict:
    out = copy.deepcopy(pod)
    out["spec"]["initContainers"] = [c for c in out["spec"].get("initContainers") or []
                                     if c["name"] not in INJECTED]
    return out


def container(name: str, requests: dict | None = None, limits: dict | None = None) -> dict:
    c = {"name": name, "image": "python:3.12"}
    res = {}
    if requests:
        res["requests"] = requests
    if limits:
        res["limits"] = limits
    if res:
        c["resources"] = res
    return c


def pod(*containers: dict, labels: dict | None = None) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "labels": {LABEL_SANDBOX: "true"} if labels is None else labels},
            "spec": {"containers": list(containers)}}


GUARANTEED = {"cpu": "100m", "memory": "128Mi"}
SHAPES = {
    "one-container": pod(container("sandbox", GUARANTEED, GUARANTEED)),
    "two-containers": pod(container("sandbox", {"cpu": "1", "memory": "1Gi"},
                                    {"cpu": "1", "memory": "1Gi"}),
                          container("side", {"cpu": "500m", "memory": "512Mi"},
                                    {"cpu": "500m", "memory": "512Mi"})),
    "requests-only": pod(container("sandbox", {"cpu": "250m", "memory": "300Mi"})),
    "limits-only": pod(container("sandbox", None, {"cpu": "750m", "memory": "1G"})),
    "tiny": pod(container("sandbox", {"cpu": "10m", "memory": "32Mi"},
                          {"cpu": "10m", "memory": "32Mi"})),
    "two-cpu": pod(container("sandbox", {"cpu": "2", "memory": "8Gi"},
                             {"cpu": "2", "memory": "8Gi"})),
    "with-own-init-and-sidecar": {**pod(container("sandbox", GUARANTEED, GUARANTEED)), "spec": {
        "initContainers": [container("setup", {"cpu": "3", "memory": "64Mi"},
                                     {"cpu": "3", "memory": "64Mi"}),
                           {**container("log", {"cpu": "50m", "memory": "64Mi"},
                                        {"cpu": "50m", "memory": "64Mi"}),
                            "restartPolicy": "Always"}],
        "containers": [container("sandbox", GUARANTEED, GUARANTEED)]}},
}


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("resource", RESOURCES)
def test_sandbox_effective_request_unchanged(shape, resource, mode):
    before = SHAPES[shape]
    policy, injected = MODES[mode]
    after = make_sandbox(before, policy)
    assert [c["name"] for c in after["spec"]["initContainers"]
            if c["name"] in INJECTED] == injected
    # Equalizing never lowers a request; the injected containers add nothing on top.
    assert effective_request(after, resource) == effective_request(before, resource)
    assert effective_request(after, resource) == effective_request(without_injected(after),
                                                                   resource)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_sandbox_qos_is_what_the_containers_make_it(shape):
    before = SHAPES[shape]
    after = make_sandbox(before, POLICY)
    assert qos_class(after) == "Guaranteed" == qos_class(without_injected(after))
    if qos_class(before) == "Guaranteed":
        assert qos_class(after) == qos_class(before)


def test_injected_containers_get_the_whole_pods_size():
    after = make_sandbox(SHAPES["two-containers"], POLICY)
    for c in after["spec"]["initContainers"]:
        if c["name"] in INJECTED:
            assert c["resources"] == {"requests": {"cpu": "1500m", "memory": "1536Mi"},
                                      "limits": {"cpu": "1500m", "memory": "1536Mi"}}


def test_tiny_sandbox_is_not_raised_to_the_old_fixed_size():
    after = make_sandbox(SHAPES["tiny"], POLICY)
    guard = after["spec"]["initContainers"][0]
    assert guard["name"] == NETGUARD_CONTAINER
    assert guard["resources"]["limits"] == {"cpu": "10m", "memory": "32Mi"}


def test_remutation_keeps_equal_quantities_spelled_differently():
    after = make_sandbox(SHAPES["two-containers"], POLICY)
    respelled = copy.deepcopy(after)
    for c in respelled["spec"]["initContainers"]:
        c["resources"] = {"requests": {"cpu": "1.5", "memory": "1.5Gi"},
                          "limits": {"cpu": "1.5", "memory": "1.5Gi"}}
    assert make_sandbox(respelled, POLICY) == respelled


GUARDED = {
    "best-effort": pod(container("app"), labels={}),
    "burstable": pod(container("app", {"cpu": "200m"}, {"cpu": "1", "memory": "1Gi"}),
                     labels={}),
    "guaranteed": pod(container("app", GUARANTEED, GUARANTEED),
                      container("b", {"cpu": "1", "memory": "2Gi"},
                                {"cpu": "1", "memory": "2Gi"}), labels={}),
    "requests-only": pod(container("app", {"cpu": "250m", "memory": "300Mi"}), labels={}),
}


@pytest.mark.parametrize("shape", sorted(GUARDED))
def test_guarded_pod_effective_request_and_qos_unchanged(shape):
    before = GUARDED[shape]
    after = guarded_pod(before, POLICY)
    assert after["spec"]["initContainers"][0]["name"] == NETGUARD_CONTAINER
    for resource in RESOURCES:
        assert effective_request(after, resource) == effective_request(before, resource)
    assert qos_class(after) == qos_class(before)
