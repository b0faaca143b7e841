"""ephemeral-storage on the real node through the installed chart: a trainer's acquire asking for
a disk size gets a Ready sandbox (the real scheduler fits it, the webhook and the admission
policy admit the controller's pod) whose container carries the size in requests and limits,
and a GPU acquire is refused with one line (the chart's default grants none)."""

from __future__ import annotations

from kubernetes import client

from tests.e2e.test_sdk import run_trainer

# The sandbox is left leased (no release, no client close) so the test can read the stored
# pod; the test deletes it, and its lifetime bounds it if the test dies first.
SCRIPT = r"""
import json, os, sys
from sandman.client import BadRequest, Client
res = {}
c = Client(timeout_s=60)
try:
    c.acquire(image=os.environ["TASK_IMAGE"], job="e2e-disk", gpu=1, timeout_s=30)
    res["gpu"] = None
except BadRequest as e:
    res["gpu"] = str(e)
sb = c.acquire(image=os.environ["TASK_IMAGE"], job="e2e-disk", cpu="250m", memory="160Mi",
               ephemeral_storage="256Mi", timeout_s=200, lifetime_s=120, renew=False)
res["pod"] = sb.pod
res["write"] = sb.exec("head -c 1048576 /dev/zero > /tmp/f && wc -c < /tmp/f",
                       timeout=30).output.strip()
print("E2E-RESULT " + json.dumps(res), flush=True)
os._exit(0)
"""


def test_ephemeral_storage_reaches_the_real_pod_and_gpus_are_refused(sandman, ns):
    res = run_trainer(sandman, ns, "trainer-disk", SCRIPT, timeout=500)
    sbx_ns = sandman.inst.sandbox_namespace
    try:
        msg = res["gpu"]
        assert msg and "no GPUs" in msg and "\n" not in msg, res
        assert res["write"] == "1048576", res
        pod = sandman.core.read_namespaced_pod(res["pod"], sbx_ns)
        res_ = pod.spec.containers[0].resources
        assert res_.requests["ephemeral-storage"] == res_.limits["ephemeral-storage"] == "256Mi"
        # The injected guard is sized by the pod's containers: the pod's request is unchanged.
        init = pod.spec.init_containers[0].resources
        assert init.requests["ephemeral-storage"] == "256Mi", init
        assert not [t for t in pod.spec.tolerations or [] if t.key == "nvidia.com/gpu"]
    finally:
        try:
            sandman.core.delete_namespaced_pod(res["pod"], sbx_ns, grace_period_seconds=0)
        except client.ApiException as e:
            if e.status != 404:
                raise
