"""What a sandbox may ask of a node beyond CPU and memory (sandman.podspec._resource_rules and
the ephemeral-storage sizing), as pure logic; the golden cases play the same rules through the
webhook and the CEL policy."""

from __future__ import annotations

import dataclasses

import pytest

from controller import pods as P
from sandman.podspec import (
    SandboxPolicy,
    check_sandbox,
    injected_resources,
    make_sandbox,
    toleration,
)
from tests.cli import run_main
from tests.webhook.golden_cases import GPU_OFF, GPU_ON, GPU_TOLERATION, pod
from webhook.__main__ import main as webhook_main


def _task(name: str = "task", **limits: str) -> dict:
    return {"name": name, "image": "swe-task:1", "resources": {"limits": dict(limits)}}


def _rules(p: dict, policy: SandboxPolicy) -> list[str]:
    return [r.rule for r in check_sandbox(make_sandbox(p, policy), policy)]


@pytest.mark.parametrize("text, want", [
    ("nvidia.com/gpu:NoSchedule", {"key": "nvidia.com/gpu", "operator": "Exists",
                                   "effect": "NoSchedule"}),
    ("gpu=true:NoExecute", {"key": "gpu", "operator": "Equal", "value": "true",
                            "effect": "NoExecute"}),
    ("nvidia.com/gpu", {"key": "nvidia.com/gpu", "operator": "Exists"}),
])
def test_toleration_spellings(text, want):
    assert toleration(text) == want


@pytest.mark.parametrize("text", ["", ":NoSchedule", "gpu=:NoSchedule", "gpu:Never"])
def test_bad_tolerations_and_gpu_settings_are_one_line(text):
    with pytest.raises(ValueError, match="key\\[=value\\]"):
        toleration(text)
    ran = run_main(webhook_main, ["serve", "--gpu-toleration", text])
    assert ran.returncode == 2 and len(ran.stderr.strip().splitlines()) == 2  # usage + error
    for bad in ({"gpu_resource": "gpu"}, {"gpu_resource": "nvidia.com/"}, {"gpu_max": -1},
                {"gpu_max": 65}):
        with pytest.raises(ValueError, match="gpu_"):
            SandboxPolicy(**bad)


def test_ephemeral_storage_sizes_the_injected_container_by_the_pods_total():
    p = pod(containers=[_task(**{"ephemeral-storage": "1Gi"}),
                        _task("side", **{"ephemeral-storage": "512Mi"}), _task("plain")])
    made = make_sandbox(p, SandboxPolicy())
    for c in made["spec"]["containers"][:2]:
        assert c["resources"]["requests"]["ephemeral-storage"] == \
            c["resources"]["limits"]["ephemeral-storage"]
    assert "ephemeral-storage" not in made["spec"]["containers"][2]["resources"]["limits"]
    assert injected_resources(made)["limits"]["ephemeral-storage"] == "1536Mi"
    assert made["spec"]["initContainers"][0]["resources"]["requests"]["ephemeral-storage"] == \
        "1536Mi"
    assert check_sandbox(made, SandboxPolicy()) == []
    # Both sides set and different: both take the larger (a limit is never lowered).
    both = pod(containers=[{**_task(**{"ephemeral-storage": "2Gi"}), "resources": {
        "requests": {"ephemeral-storage": "1Gi"}, "limits": {"ephemeral-storage": "2Gi"}}}])
    res = make_sandbox(both, SandboxPolicy())["spec"]["containers"][0]["resources"]
    assert res["requests"]["ephemeral-storage"] == res["limits"]["ephemeral-storage"] == "2Gi"
    # Only one side on a pod the mutation did not see: refused.
    one = make_sandbox(pod(containers=[_task(**{"ephemeral-storage": "1Gi"})]), SandboxPolicy())
    del one["spec"]["containers"][0]["resources"]["requests"]["ephemeral-storage"]
    assert "resources-unequal" in [r.rule for r in check_sandbox(one, SandboxPolicy())]


def test_the_webhook_bounds_the_pods_gpu_total_not_each_container():
    one_each = pod(containers=[_task(**{"nvidia.com/gpu": "1"}),
                               _task("side", **{"nvidia.com/gpu": "1"})],
                   tolerations=[dict(GPU_TOLERATION)])
    assert _rules(one_each, dataclasses.replace(GPU_ON, gpu_max=2)) == []
    assert _rules(one_each, dataclasses.replace(GPU_ON, gpu_max=1)) == ["gpu-refused"]
    assert _rules(one_each, GPU_OFF) == ["gpu-refused", "gpu-refused"]


@pytest.mark.parametrize("tol, refused", [
    ({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoExecute"}, True),
    ({"key": "nvidia.com/gpu", "operator": "Equal", "value": "present"}, True),
    ({"operator": "Exists"}, True),
    ({"operator": "Exists", "effect": "NoSchedule"}, True),
    ({"key": "dedicated", "operator": "Equal", "value": "sandbox", "effect": "NoSchedule"},
     False),
    ({"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute",
      "tolerationSeconds": 300}, False),
])
def test_only_gpu_sandboxes_tolerate_the_gpu_nodes(tol, refused):
    cpu_only = pod(tolerations=[tol])
    assert (_rules(cpu_only, GPU_OFF) == ["gpu-toleration"]) is refused
    with_gpu = pod(containers=[_task(**{"nvidia.com/gpu": "1"})], tolerations=[tol])
    assert _rules(with_gpu, GPU_ON) == []
    # No GPU tolerations configured: the rule has nothing to protect.
    assert _rules(cpu_only, SandboxPolicy()) == []


@pytest.mark.parametrize("name", ["hugepages-1Gi", "example.com/fpga", "amd.com/gpu",
                                  "nvidia.com/mig-1g.5gb", "squat.ai/fuse"])
def test_any_other_resource_is_refused_in_every_container_kind(name):
    assert _rules(pod(containers=[_task(**{name: "1"})]), GPU_ON) == ["extended-resource"]
    inits = [{"name": "setup", "image": "busybox:1", "resources": {"limits": {name: "1"}}}]
    assert _rules(pod(initContainers=inits), GPU_ON) == ["extended-resource"]
    level = make_sandbox(pod(), GPU_ON)
    level["spec"]["resources"] = {"requests": {name: "1"}, "limits": {name: "1"}}
    assert "extended-resource" in [r.rule for r in check_sandbox(level, GPU_ON)]


def test_another_gpu_resource_name_is_what_the_chart_says():
    amd = dataclasses.replace(GPU_ON, gpu_resource="amd.com/gpu")
    assert _rules(pod(containers=[_task(**{"amd.com/gpu": "1"})]), amd) == []
    assert _rules(pod(containers=[_task(**{"nvidia.com/gpu": "1"})]), amd) == [
        "extended-resource"]


def test_the_books_read_storage_and_gpus_back_from_a_pod_and_its_slim_copy():
    spec = P.SandboxSpec("img", "1", "1Gi", ephemeral_storage="10Gi", gpu=2)
    stored = {"metadata": {"name": "sbx"}, "spec": {"containers": [{
        "name": "sandbox", "image": "img", "resources": {
            "requests": {"cpu": "1", "memory": "1Gi", "ephemeral-storage": "10Gi",
                         "nvidia.com/gpu": "2"},
            "limits": {"cpu": "1", "memory": "1Gi", "ephemeral-storage": "10Gi",
                       "nvidia.com/gpu": "2"}}}]}}
    assert P.spec_of(stored) == P.spec_of(P.slim_pod(stored)) == spec
    del stored["spec"]["containers"][0]["resources"]["requests"]["ephemeral-storage"]
    del stored["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"]
    assert P.spec_of(stored) == P.SandboxSpec("img", "1", "1Gi")
