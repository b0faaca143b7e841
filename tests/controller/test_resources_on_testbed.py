"""ephemeral-storage and GPUs through the real controller on the test bed: the size reaches the
pod's requests and limits, is part of the warm-pool key, and a GPU acquire is refused with one
line where the chart grants none."""

from __future__ import annotations

import httpx
import jsonpatch
import pytest

from sandman.podspec import SandboxPolicy, check_sandbox, make_sandbox
from testbed.controller import ControllerProc
from testbed.procs import wait_for

pytestmark = pytest.mark.testbed

IMAGE = "registry.invalid/swe/task:1"  # kwok never pulls
GPU_TOLERATION = "nvidia.com/gpu:NoSchedule"
POLICY = SandboxPolicy(gpu_tolerations=(GPU_TOLERATION,))  # the chart's default: GPUs off


@pytest.fixture
def ctl(cluster, namespace, tmp_path):
    p = ControllerProc(namespace, cluster.kubeconfig, tmp_path / "controller.log",
                       ["--lease-name", f"ctl-{namespace}", "--lease-duration", "4",
                        "--lease-renew", "1", "--gpu-toleration", GPU_TOLERATION]).start()
    yield p
    p.kill()


def acquire(url: str, **kw) -> httpx.Response:
    body = {"image": IMAGE, "cpu": "1", "memory": "1Gi", "job": "job-r", "timeout_s": 60, **kw}
    return httpx.post(url + "/v1/sandboxes", json=body, timeout=90)


def test_ephemeral_storage_is_in_requests_and_limits_and_in_the_warm_key(cluster, namespace,
                                                                           ctl):
    r = httpx.post(ctl.url + "/v1/prewarm", json={
        "image": IMAGE, "count": 1, "idle_timeout_s": 120,
        "spec": {"cpu": "1", "memory": "1Gi", "egress": "deny"}})
    assert r.status_code == 200, r.text

    def warm() -> int:
        return sum(v["warm"] for v in httpx.get(ctl.url + "/v1/stats").json()["warm"].values())

    wait_for(lambda: warm() == 1, 30, "1 warm pod without ephemeral-storage")
    # Same cpu, memory, image and egress, another disk size: never the warm pod.
    sized = acquire(ctl.url, ephemeral_storage="2Gi")
    assert sized.status_code == 201, sized.text
    assert sized.json()["warm"] is False
    assert warm() == 1
    pod = cluster.api_client.sanitize_for_serialization(
        cluster.core.read_namespaced_pod(sized.json()["pod"], namespace))
    res = pod["spec"]["containers"][0]["resources"]
    assert res["requests"] == res["limits"] == {"cpu": "1", "memory": "1Gi",
                                                "ephemeral-storage": "2Gi"}
    # The injected init container is sized by the pod's containers: the effective request stays.
    assert pod["spec"]["initContainers"][0]["resources"]["limits"]["ephemeral-storage"] == "2Gi"
    # Not a GPU sandbox: none of the GPU nodes' tolerations.
    assert not any(t.get("key") == "nvidia.com/gpu" for t in pod["spec"].get("tolerations", []))
    # The stored pod is what the webhook would make of it, and passes its checks.
    assert jsonpatch.make_patch(pod, make_sandbox(pod, POLICY)).patch == []
    assert check_sandbox(pod, POLICY) == []
    # The spec without a disk size does get the warm pod.
    plain = acquire(ctl.url)
    assert plain.status_code == 201 and plain.json()["warm"] is True, plain.text


def test_gpu_refused_with_one_line_where_the_chart_grants_none(cluster, namespace, ctl):
    for body, needle in [({"gpu": 1}, "no GPUs"), ({"gpu": -1}, "gpu"),
                         ({"gpu": "many"}, "gpu"), ({"ephemeral_storage": "lots"},
                                                    "ephemeral_storage"),
                         ({"ephemeral_storage": "0"}, "ephemeral_storage")]:
        r = acquire(ctl.url, **body)
        assert r.status_code in (400, 422), (body, r.text)
        msg = r.json()["error"]["message"]
        assert needle in msg and "\n" not in msg, msg
    r = httpx.post(ctl.url + "/v1/prewarm", json={"image": IMAGE, "count": 1,
                                                  "spec": {"gpu": 1}}, timeout=10)
    assert r.status_code == 400 and "no GPUs" in r.json()["error"]["message"], r.text
    assert not cluster.core.list_namespaced_pod(namespace).items
