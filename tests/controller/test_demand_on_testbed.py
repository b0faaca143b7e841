"""Demand-sized warm pools against the test bed: the real controller process (flags as `serve`
takes them) and real API objects on kwok nodes. A grading key that receives acquires grows
warm pods; many distinct keys stay within the global budget; an idle key shrinks to zero."""

from __future__ import annotations

import time

import httpx
import pytest

from sandman import contract
from testbed.controller import ControllerProc
from testbed.procs import wait_for
from tests.controller.harness import pods

pytestmark = pytest.mark.testbed

BUDGET = 3
PER_KEY = 2
IDLE_S = 6


@pytest.fixture
def ctl(cluster, namespace, tmp_path):
    p = ControllerProc(namespace, cluster.kubeconfig, tmp_path / "controller.log",
                       ["--lease-name", f"demand-{namespace}", "--warm-budget-pods", str(BUDGET),
                        "--warm-max-per-key", str(PER_KEY), "--idle-timeout", str(IDLE_S)])
    try:
        yield p.start()
    finally:
        p.kill()


def grade(url: str, image: str) -> dict:
    r = httpx.post(url + "/v1/sandboxes", json={
        "image": image, "cpu": "1", "memory": "1Gi", "job": "grade", "role": "grading",
        "timeout_s": 60}, timeout=90)
    assert r.status_code == 201, r.text
    sb = r.json()
    assert httpx.delete(f"{url}/v1/sandboxes/{sb['id']}", timeout=30).json()["released"]
    return sb


def warm_pods(cluster, namespace, image: str | None = None) -> list:
    return [p for p in pods(cluster.core, namespace)
            if not p.metadata.deletion_timestamp
            and (p.metadata.labels or {}).get(contract.LABEL_STATE) == contract.STATE_WARM
            and (image is None or p.spec.containers[0].image == image)]


def test_acquired_key_grows_idle_key_shrinks_all_within_the_budget(cluster, namespace, ctl):
    hot = "registry.invalid/swe/grader-hot:1"
    assert grade(ctl.url, hot)["warm"] is False  # nothing warm before the key had demand
    wait_for(lambda: warm_pods(cluster, namespace, hot), 30, "a warm pod of the acquired key")
    assert grade(ctl.url, hot)["warm"] is True

    # Hostile: acquires spread over many distinct keys never push the pools past the budget.
    seen = 0
    for i in range(6):
        grade(ctl.url, f"registry.invalid/swe/grader-{i}:1")
        grade(ctl.url, hot)  # keeps the hot key active
        seen = max(seen, len(warm_pods(cluster, namespace)))
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:
        seen = max(seen, len(warm_pods(cluster, namespace)))
        time.sleep(0.2)
    assert 1 <= seen <= BUDGET
    stats = httpx.get(f"{ctl.url}/v1/stats", timeout=10).json()["warm"]
    assert sum(v["target"] for v in stats.values()) <= BUDGET
    assert all(v["target"] <= PER_KEY for v in stats.values())

    # Idle: every key's pool is emptied once its idle timeout has passed.
    wait_for(lambda: not warm_pods(cluster, namespace), IDLE_S + 20,
             "the idle keys' warm pods to be deleted")
    stats = httpx.get(f"{ctl.url}/v1/stats", timeout=10).json()["warm"]
    assert all(v["target"] == 0 for v in stats.values())
