"""Checked reuse of grading pods against the test bed: the real controller, kwok pods and the
real execd behind each (testbed/standin.py; its baseline covers the pod's own directory only).

release(reuse=True) rotates execd's token, restores, re-checks /diff and parks the pod in its
key's pool; the next grading acquire of that key gets the same pod with a new token. After
--max-reuse reuses, or a retire, or a restore that cannot be checked, the pod is deleted.
"""

from __future__ import annotations

import re

import httpx
import pytest

from sandman import contract
from sandman.client import BadRequest, Client, Unauthorized
from testbed.procs import wait_for
from tests.controller.harness import pods, standin_stack

IMAGE = "registry.invalid/swe/grader:1"
MAX_REUSE = 8


@pytest.fixture
def stack(cluster, namespace, tmp_path):
    with standin_stack(cluster, namespace, tmp_path, "reuse", "--max-reuse",
                       str(MAX_REUSE)) as got:
        yield got


def live(cluster, namespace) -> list:
    return [p for p in pods(cluster.core, namespace) if not p.metadata.deletion_timestamp]


def metric(ctl, name: str) -> float:
    text = httpx.get(f"{ctl.url}/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def auth(sb) -> dict:
    return {"Authorization": sb._http.headers["authorization"]}


def execd_diff(sb) -> dict:
    r = httpx.get(f"http://{sb.address}:{sb.port}/diff", timeout=30, headers=auth(sb),
                  trust_env=False)
    assert r.status_code == 200, r.text
    return r.json()


def test_grading_pod_reused_max_times_then_deleted(cluster, namespace, stack):
    ctl, standin = stack
    with Client(ctl.url) as cl:
        first = cl.acquire(IMAGE, job="grade", cpu="1", memory="1Gi", timeout_s=60,
                           role="grading")
        pod = first.pod
        p = next(p for p in live(cluster, namespace) if p.metadata.name == pod)
        assert p.metadata.labels[contract.LABEL_ROLE] == contract.ROLE_GRADING
        assert execd_diff(first)["clean"] is True
        sb, tokens = first, set()
        for i in range(MAX_REUSE + 1):
            tokens.add(auth(sb)["Authorization"])
            sb.exec(f"echo {i} > planted.py; export GRADED={i}; "
                    "setsid sleep 1000 >/dev/null 2>&1 < /dev/null &")
            assert not execd_diff(sb)["clean"]
            old = sb
            assert sb.release(reuse=True) is True
            if i == MAX_REUSE:
                assert sb.reused is False  # reused MAX_REUSE times: deleted
                break
            assert sb.reused is True, f"round {i}"
            # The old holder's token no longer opens the pod.
            r = httpx.get(f"http://{old.address}:{old.port}/state", timeout=10,
                          headers=auth(old), trust_env=False)
            assert r.status_code == 401
            sb = cl.acquire(IMAGE, job="grade", cpu="1", memory="1Gi", timeout_s=60,
                            role="grading", reused_ok=True)
            assert sb.pod == pod and sb.warm is True
            assert auth(sb)["Authorization"] not in tokens
            d = execd_diff(sb)
            assert d["clean"] is True, d["changes"]
            out = sb.exec("ls; echo ${GRADED-unset}").output.split()
            assert out == ["unset"], out
            got = next(p for p in live(cluster, namespace) if p.metadata.name == pod)
            assert got.metadata.annotations[contract.ANNOTATION_REUSE_COUNT] == str(i + 1)
            assert got.metadata.labels[contract.LABEL_JOB] == "grade"
        wait_for(lambda: pod not in {p.metadata.name for p in live(cluster, namespace)}, 20,
                 "the pod reused MAX_REUSE times is deleted")
    assert metric(ctl, "sandman_controller_reuses_total") == MAX_REUSE
    assert metric(ctl, 'sandman_controller_retirements_total{reason="max_reuse"}') == 1


def test_agent_pod_cannot_be_reused_and_is_not_handed_to_grading(cluster, namespace, stack):
    ctl, standin = stack
    with Client(ctl.url) as cl:
        sb = cl.acquire(IMAGE, job="agent", cpu="1", memory="1Gi", timeout_s=60)
        assert contract.LABEL_ROLE not in (next(
            p for p in live(cluster, namespace) if p.metadata.name == sb.pod).metadata.labels
            or {})
        with pytest.raises(BadRequest, match="only grading"):
            cl.release(sb.id, reuse=True)
        assert sb.release() is True
        # A grading pod parked in its pool is never handed to an agent acquire (key: role).
        g = cl.acquire(IMAGE, job="g", cpu="1", memory="1Gi", timeout_s=60, role="grading")
        assert g.release(reuse=True) is True and g.reused is True
        a = cl.acquire(IMAGE, job="agent", cpu="1", memory="1Gi", timeout_s=60)
        assert a.pod != g.pod and a.warm is False
        a.release()
        stats = httpx.get(f"{ctl.url}/v1/stats", timeout=10).json()
        assert any(k.endswith("|grading") for k in stats["warm"]), stats["warm"]


def test_a_grading_gets_a_reused_pod_only_when_it_says_so(cluster, namespace, stack):
    """grade() without reuse promises a never-used pod: a pod parked after a reuse release is
    handed only to an acquire with reused_ok=True, and reused_ok is refused for an agent."""
    ctl, standin = stack
    with Client(ctl.url) as cl:
        with pytest.raises(BadRequest, match="reused_ok"):
            cl.acquire(IMAGE, job="agent", cpu="1", memory="1Gi", timeout_s=60,
                       reused_ok=True)
        g = cl.acquire(IMAGE, job="g", cpu="1", memory="1Gi", timeout_s=60, role="grading")
        assert g.release(reuse=True) is True and g.reused is True
        fresh = cl.acquire(IMAGE, job="g", cpu="1", memory="1Gi", timeout_s=60,
                           role="grading")
        assert fresh.pod != g.pod and fresh.warm is False
        again = cl.acquire(IMAGE, job="g", cpu="1", memory="1Gi", timeout_s=60,
                           role="grading", reused_ok=True)
        assert again.pod == g.pod and again.warm is True
        fresh.release()
        again.release()


def test_retire_deletes_and_counts(cluster, namespace, stack):
    ctl, standin = stack
    with Client(ctl.url) as cl:
        sb = cl.acquire(IMAGE, job="grade", cpu="1", memory="1Gi", timeout_s=60,
                        role="grading")
        pod = sb.pod
        assert sb.retire() is True
        wait_for(lambda: pod not in {p.metadata.name for p in live(cluster, namespace)}, 20,
                 "retired pod deleted")
    assert metric(ctl, 'sandman_controller_retirements_total{reason="caller"}') == 1


def test_shadow_contradiction_retires_and_counts(cluster, namespace, stack):
    """A reused pod's acquire says it was reused; the SDK's shadow report of a contradiction
    deletes it (never handed out again) and counts it, an agreement sends it back for reuse;
    an agent pod cannot be reported."""
    ctl, standin = stack
    with Client(ctl.url) as cl:
        g = cl.acquire(IMAGE, job="grade", cpu="1", memory="1Gi", timeout_s=60,
                       role="grading")
        assert g.reuses == 0
        assert g.release(reuse=True) is True and g.reused is True
        again = cl.acquire(IMAGE, job="grade", cpu="1", memory="1Gi", timeout_s=60,
                           role="grading", reused_ok=True)
        assert again.pod == g.pod and again.reuses == 1
        assert again.report_shadow("agree") is True and again.reused is True
        third = cl.acquire(IMAGE, job="grade", cpu="1", memory="1Gi", timeout_s=60,
                           role="grading", reused_ok=True)
        assert third.pod == g.pod and third.reuses == 2
        assert third.report_shadow("contradict") is True and third.reused is False
        wait_for(lambda: g.pod not in {p.metadata.name for p in live(cluster, namespace)}, 20,
                 "contradicted pod deleted")
        agent = cl.acquire(IMAGE, job="agent", cpu="1", memory="1Gi", timeout_s=60)
        with pytest.raises(BadRequest, match="shadow"):
            agent.report_shadow("contradict")
        with pytest.raises(BadRequest, match="outcome"):
            cl.report_shadow(agent.id, "maybe")
        agent.release()
    assert metric(ctl, 'sandman_shadow_grading_total{outcome="contradict"}') == 1
    assert metric(ctl, 'sandman_shadow_grading_total{outcome="agree"}') == 1
    assert metric(ctl, 'sandman_controller_retirements_total{reason="shadow"}') == 1


def test_pod_that_cannot_be_checked_is_deleted(cluster, namespace, stack):
    """The holder rotated execd's token itself: the controller cannot restore or check the
    pod, so it deletes it (fail closed) and counts a restore failure."""
    ctl, standin = stack
    with Client(ctl.url) as cl:
        sb = cl.acquire(IMAGE, job="grade", cpu="1", memory="1Gi", timeout_s=60,
                        role="grading")
        pod = sb.pod
        r = httpx.post(f"http://{sb.address}:{sb.port}/token", timeout=10, trust_env=False,
                       json={"token_sha256": "0" * 64},
                       headers=auth(sb))
        assert r.status_code == 200
        with pytest.raises(Unauthorized):
            sb.exec("true")
        assert sb.release(reuse=True) is True and sb.reused is False
        wait_for(lambda: pod not in {p.metadata.name for p in live(cluster, namespace)}, 20,
                 "unrestorable pod deleted")
    assert metric(ctl, "sandman_controller_restore_failures_total") == 1


def test_grading_pod_passes_the_webhook_mutation_unchanged(cluster, namespace, stack):
    """Invariant 7 for the grading variant: its role label and SANDMAN_BASELINE env are part
    of a pod the webhook admits as it is."""
    import jsonpatch

    from sandman.podspec import SandboxPolicy, check_sandbox, make_sandbox
    ctl, standin = stack
    with Client(ctl.url) as cl:
        sb = cl.acquire(IMAGE, job="grade", cpu="1", memory="1Gi", timeout_s=60,
                        role="grading")
        pod = cluster.api_client.sanitize_for_serialization(
            cluster.core.read_namespaced_pod(sb.pod, namespace))
        env = pod["spec"]["containers"][0].get("env") or []
        assert {"name": contract.EXECD_BASELINE_ENV, "value": "on"} in env
        # The whole root filesystem is watched by default.
        assert {"name": contract.EXECD_BASELINE_SCOPE_ENV, "value": "root"} in env
        policy = SandboxPolicy()
        assert jsonpatch.make_patch(pod, make_sandbox(pod, policy)).patch == []
        assert check_sandbox(pod, policy) == []
        sb.release()
