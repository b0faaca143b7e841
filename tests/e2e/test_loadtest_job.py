"""locust in the cluster: the load-test image (images/Dockerfile `loadtest` target) runs as the
Job `python -m loadtest.job` renders (RBAC, trainer label, in-cluster leak audit, the
controller's URL and token from env), against the chart installed on the real node. The
`two-runs` shape (two runs starting within one second, RUN_USERS users each) passes its
thresholds; the same Job with a task that raises fails.

The node is small (2 CPUs, kubelet maxPods 110; each sandbox asks at least the injected init
containers' 100m / 128Mi): far fewer than a run's 64 sandboxes fit at once. The test measures that
ceiling (from the node's allocatable and what is scheduled, and the peak of Running sandboxes
seen), and the acquires, several times that ceiling, queue in the controller and the scheduler
and are served as released sandboxes free room, within the acquire timeout. The paper's run
start is 64 users (128 in two-runs); this node serves ~8 sandboxes per ~30 s wave, so 64 a
run would take ~4 min here: 8 a run (16 acquires, over twice the ceiling) queue the same
way. The full size runs on a bigger cluster through `python -m loadtest.job`."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from loadtest.audit import job_label
from loadtest.job import TRAINERS_NS_LABEL, render
from sandman import contract
from sandman.quantity import parse_quantity
from testbed import realnode
from tests.e2e.helpers import SDK_CA, TASK_IMAGE, copy_ca, placement

RUN_USERS = 8  # per run: 2 x 8 acquires, over twice what fits on the node at once (7 here)
RAISING = Path(__file__).resolve().parents[1] / "loadtest" / "files" / "raising.py"
SANDBOX_CPU, SANDBOX_MEMORY = "100m", "128Mi"  # = the injected init containers' size


def _pod_request(pod: client.V1Pod, name: str) -> float:
    """A pod's effective request (max of each init container, sum of the containers)."""
    spec = pod.spec

    def req(cs):
        return [parse_quantity(((c.resources and c.resources.requests) or {}).get(name, "0"))
                for c in cs or []]
    return float(max([sum(req(spec.containers)), *req(spec.init_containers)]))


JOB_CPU, JOB_MEMORY = "300m", "384Mi"  # the locust pod's


def ceiling(e2e) -> dict:
    """How many sandboxes of SANDBOX_CPU/SANDBOX_MEMORY fit beside what runs on the node and
    the locust pod (not scheduled yet when this is called)."""
    node = e2e.core.read_node(realnode.NODE_NAME)
    pods = [p for p in e2e.core.list_pod_for_all_namespaces(
        field_selector=f"spec.nodeName={node.metadata.name}").items
        if p.status.phase not in ("Succeeded", "Failed")]
    alloc = node.status.allocatable
    free_cpu = (float(parse_quantity(alloc["cpu"])) - float(parse_quantity(JOB_CPU))
                - sum(_pod_request(p, "cpu") for p in pods))
    free_mem = (float(parse_quantity(alloc["memory"])) - float(parse_quantity(JOB_MEMORY))
                - sum(_pod_request(p, "memory") for p in pods))
    # The injected init containers take the sandbox's own size (sandman.podspec
    # injected_resources), so a sandbox's request is its own.
    per_cpu = float(parse_quantity(SANDBOX_CPU))
    per_mem = float(parse_quantity(SANDBOX_MEMORY))
    # In milli-CPUs and bytes, as integers: a float floor division said 0.7 // 0.1 == 6.
    fit = {"cpu": round(free_cpu * 1000) // round(per_cpu * 1000),
           "memory": round(free_mem) // round(per_mem),
           "pods": int(alloc["pods"]) - len(pods) - 1}
    return {"fits": min(fit.values()), "by": fit, "allocatable_cpu": alloc["cpu"],
            "node_pods": len(pods), "free_cpu": round(free_cpu, 3)}


def run_job(sandman, ns: str, name: str, image: str, locust_args: list[str],
            locustfile_text: str | None = None, timeout: float = 900) -> dict:
    """Apply the rendered objects, wait for the Job to finish while counting Running sandboxes
    of its run; returns status, logs, summary, peak."""
    # The controller serves https: the Job verifies it with the admin's copy of the CA in
    # its own namespace (docs/install.md "Trainers: the CA").
    copy_ca(sandman.cluster.api_client, sandman.inst, ns)
    objs = render(name=name, namespace=ns, sandbox_namespace=sandman.inst.sandbox_namespace,
                  image=image, image_pull_policy="Never",
                  controller_url=sandman.inst.controller_url_in_cluster(),
                  ca_configmap=SDK_CA,
                  locust_args=locust_args, cpu=JOB_CPU, memory=JOB_MEMORY,
                  locustfile="raising.py" if locustfile_text else "acquire_burst",
                  locustfile_text=locustfile_text, deadline_s=int(timeout),
                  node_selector=placement()["nodeSelector"],
                  tolerations=placement()["tolerations"])
    sandman.inst.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(objs))
    batch = client.BatchV1Api(sandman.cluster.api_client)
    sbx_ns, peak, t0 = sandman.inst.sandbox_namespace, 0, time.monotonic()
    deadline = t0 + timeout + 60
    job = None
    try:
        while time.monotonic() < deadline:
            job = batch.read_namespaced_job(name, ns)
            if job.status.succeeded or job.status.failed:
                break
            running = [p for p in sandman.core.list_namespaced_pod(
                sbx_ns, label_selector=f"{contract.LABEL_JOB}={job_label(ns, name)}").items
                if p.status.phase == "Running"]
            peak = max(peak, len(running))
            time.sleep(1.0)
        took = time.monotonic() - t0
        pods = sandman.core.list_namespaced_pod(ns, label_selector=f"job-name={name}").items
        assert pods, f"job {name}: no pod"
        logs = sandman.logs(ns, pods[0].metadata.name)
        lines = [ln for ln in logs.splitlines() if ln.startswith("SANDMAN-SUMMARY ")]
        return {"succeeded": bool(job and job.status.succeeded),
                "failed": bool(job and job.status.failed), "logs": logs, "took": took,
                "summary": json.loads(lines[-1].split(" ", 1)[1]) if lines else None,
                "peak": peak, "describe": sandman.describe(ns, pods[0].metadata.name)}
    finally:
        # The sandbox-namespace Role and binding are not in the test namespace.
        for o in objs:
            if o["metadata"]["namespace"] == sbx_ns:
                sandman.inst.kubectl("delete", o["kind"].lower(), o["metadata"]["name"],
                                     "-n", sbx_ns, "--ignore-not-found", check=False)


@pytest.fixture
def loadtest_image(sandman) -> str:
    t0 = time.monotonic()
    (ref,) = sandman.rn.load_images("loadtest")
    sandman.image_s = time.monotonic() - t0
    return ref


@pytest.mark.timeout(1800)  # two Jobs, sandboxes in waves of ~8 (see above)
def test_two_runs_as_a_job_passes_and_a_raising_task_fails(sandman, ns, loadtest_image,
                                                           figures):
    sandman.core.patch_namespace(ns, {"metadata": {"labels": {TRAINERS_NS_LABEL: "true"}}})
    cap = ceiling(sandman)
    # Waves of ~8 sandboxes at ~25-37 s each (docs/benchmarks.md "real node"): the last of
    # 2 * RUN_USERS acquires waits several waves; the acquire timeout and the budget allow 16.
    common = ["--image", TASK_IMAGE, "--cpu", SANDBOX_CPU, "--memory", SANDBOX_MEMORY,
              "--hold-s", "1", "--max-leaked", "0", "--leak-settle-s", "120"]
    res = run_job(sandman, ns, "lt-two-runs", loadtest_image,
                  ["--shape", "two-runs", "--run-users", str(RUN_USERS),
                   "--acquire-timeout-s", "600", "--budget-s", "700",
                   "--max-p99-ms", "600000", *common], timeout=900)
    s = res["summary"]
    print("LOADTEST-E2E two-runs", json.dumps({"took": res["took"], "peak": res["peak"],
                                                "cap": cap, "summary": s}))
    assert res["succeeded"] and s, f"{res['describe']}\n{res['logs'][-4000:]}"
    acq = s["stats"]["ACQUIRE /v1/sandboxes"]
    assert acq["requests"] == 2 * RUN_USERS and acq["failures"] == 0, acq
    assert 2 * RUN_USERS > 2 * cap["fits"], cap  # the acquires did queue
    assert s["exit_code"] == 0 and all(t["ok"] for t in s["thresholds"]), s["thresholds"]
    assert s["leaked"] == [] and s["audit"].startswith("0 pod(s)"), s["audit"]
    # The audit selected the run's pods (tenant-scoped job label), not nothing.
    ready = s["stats"]["POD_READY pod first seen -> Ready"]["requests"]
    assert ready >= 2 * RUN_USERS * 3 // 4, s["stats"]
    assert 0 < res["peak"] <= cap["fits"], (res["peak"], cap)
    figures.add(f"e2e loadtest Job: two-runs ({2 * RUN_USERS} acquires in 1 s) on the real node: "
                f"{res['took']:.0f}s, acquire p50 {acq['p50_ms'] / 1000:.1f}s p99 "
                f"{acq['p99_ms'] / 1000:.1f}s, 0 failures, 0 leaked; at most {res['peak']} "
                f"sandboxes Running at once (ceiling {cap['fits']}: {cap['by']}, "
                f"{cap['node_pods']} pods on the node, {cap['free_cpu']} CPU free of "
                f"{cap['allocatable_cpu']})")

    # The raising variant small (2 users, one cycle each, then their task raises every second
    # until -t ends the run): the shape is not what it tests, and the node is shared. -t
    # covers a cold acquire (a wave, ~30 s, slower beside other tests) and the cycle.
    shape_import = "from loadtest.acquire_burst import SandmanShape  # noqa: F401"
    text = RAISING.read_text()
    assert shape_import in text
    text = text.replace(shape_import, "# (no shape: -u/-r/-t)")
    bad = run_job(sandman, ns, "lt-raising", loadtest_image,
                  ["-u", "2", "-r", "2", "-t", "90s", "--acquire-timeout-s", "80",
                   "--max-p99-ms", "90000", *common], locustfile_text=text, timeout=400)
    assert bad["failed"] and not bad["succeeded"], f"{bad['describe']}\n{bad['logs'][-4000:]}"
    assert "threshold FAIL: task exceptions" in bad["logs"], bad["logs"][-4000:]
    bs = bad["summary"]
    print("LOADTEST-E2E raising", json.dumps({"took": bad["took"], "summary": bs}))
    assert bs["exit_code"] == 1 and "task raised on purpose" in bs["exceptions"][0]["msg"]
    assert bs["stats"]["ACQUIRE /v1/sandboxes"]["failures"] == 0  # only the task failed
    assert bs["stats"]["ACQUIRE /v1/sandboxes"]["requests"] == 2
    figures.add(f"e2e loadtest Job with a raising task: failed as it must, {bad['took']:.0f}s")
