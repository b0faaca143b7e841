"""The grading demo on the real node (issue 15, Done-when; docs/grading.md): a trainer pod runs
`sandman.client.grading` against the installed controller, with the grading task image
(testbed/taskimage.py: a git repository with pytest tests at /testbed) as real pods.

- preflight: the reference patch passes, the empty patch fails, so the task is kept;
- an agent sandbox plants a conftest.py that forces every test to pass: capture_patch leaves
  it out (the patch is then empty and fails); after a fix made with the byte-safe editor the
  captured patch passes; the raw planted patch given to grade() directly is graded without
  its conftest.py too, and fails;
- a grading whose pod is deleted through the API server while its suite runs, on both
  attempts, comes back no_verdict, never failed;
- checked reuse: nine gradings with reuse=True run on one pod (reused 8 times, the chart's
  --max-reuse; the controller restores it and requires a clean /diff before each hand-out),
  the ninth release deletes it; the next pod, found clean, is retired and never handed out
  again; a grading declaring more CPUs than the node has is refused, so no_verdict.
"""

from __future__ import annotations

import base64
import json
import subprocess
import tempfile
import time
from pathlib import Path

from sandman.contract import LABEL_JOB
from testbed import taskimage
from tests.e2e.helpers import crictl_exec
from tests.e2e.test_sdk import run_trainer, trainer_pod

SLEEP = 45  # the killed grading's suite sleeps this long before pytest: the kill lands inside

PLANTED_CONFTEST = (
    "import pytest\n\n\n"
    "@pytest.hookimpl(hookwrapper=True)\n"
    "def pytest_runtest_makereport(item, call):\n"
    "    outcome = yield\n"
    "    outcome.get_result().outcome = 'passed'\n")

COMMON = r"""
import base64, dataclasses, json, os
from sandman.client import Client
from sandman.client.grading import Task, capture_patch, grade, preflight
spec = json.loads(os.environ["GRADING_TASK"])
spec["reference_patch"] = base64.b64decode(spec["reference_patch"])
task = Task(**spec, cpu="250m", memory="256Mi")
KW = dict(acquire_timeout_s=150, retry_backoff_s=1.0)
def show(r):
    return {"verdict": str(r.verdict), "reason": r.reason, "attempts": r.attempts,
            "summary": r.summary, "excluded": [e.path for e in r.excluded],
            "infra": list(r.infra_errors), "exit_code": r.exit_code, "pods": list(r.pods),
            "shadow": r.shadow}
res = {}
"""

DEMO = COMMON + r"""
with Client(timeout_s=60) as c:
    pf = preflight(c, [task], job="e2e-grade", **KW)
    res["kept"] = [t.name for t in pf.kept]
    res["dropped"] = [why for _, why in pf.dropped]
    ref, empty = pf.results[task.name]
    res["reference"], res["empty"] = show(ref), show(empty) if empty else None
    with c.acquire(task.image, job="e2e-agent", cpu="250m", memory="256Mi",
                   timeout_s=150) as agent:
        agent.write(task.repo + "/conftest.py", os.environ["PLANTED"])
        planted, ex1 = capture_patch(agent, task.base_commit, repo=task.repo)
        e = agent.edit(task.repo + "/calc/__init__.py", "return a - b", "return a + b")
        fixed, ex2 = capture_patch(agent, task.base_commit, repo=task.repo)
    res["capture_planted"] = {"patch": planted.decode(), "excluded": [x.path for x in ex1]}
    res["capture_fixed"] = {"patch": fixed.decode(), "excluded": [x.path for x in ex2],
                            "edit_line": e.line}
    res["graded_planted"] = show(grade(c, task, planted, job="e2e-grade", **KW))
    res["graded_fixed"] = show(grade(c, task, fixed, job="e2e-grade", **KW))
    raw = base64.b64decode(os.environ["RAW_PLANTED"])
    res["graded_raw_planted"] = show(grade(c, task, raw, job="e2e-grade", **KW))
print("E2E-RESULT " + json.dumps(res))
"""

KILLED = COMMON + r"""
slow = dataclasses.replace(task, test_command="sleep __SLEEP__; " + task.command)
with Client(timeout_s=60) as c:
    res["killed"] = show(grade(c, slow, task.reference_patch, job="e2e-grade-kill",
                               attempts=2, **KW))
print("E2E-RESULT " + json.dumps(res))
""".replace("__SLEEP__", str(SLEEP))


REUSE = COMMON + r"""
kw = dict(job="e2e-grade-reuse", **KW)
with Client(timeout_s=60) as c:
    # shadow=0: the shadow's sampling is random (3% of reused verdicts graded again on a
    # never-used pod, 2 attempts); tests/client/test_grading_integrity.py pins it to 1.
    res["rounds"] = [show(grade(c, task, task.reference_patch, reuse=True, shadow=0, **kw))
                     for _ in range(10)]
    # The tenth grading's pod went back to the pool: take it as a reused pod, see it clean,
    # then retire it (as a caller whose grading contradicted an earlier one would).
    get = dict(job="e2e-grade-reuse", cpu=task.cpu, memory=task.memory, timeout_s=150,
               role="grading", reused_ok=True)
    sb = c.acquire(task.image, **get)
    res["parked_pod"], res["parked_warm"] = sb.pod, sb.warm
    res["parked_diff"] = sb._http.get("/diff").json()
    res["retired"] = sb.retire()
    nxt = c.acquire(task.image, **get)
    res["after_retire"] = [nxt.pod, nxt.warm]
    nxt.release()
    many = dataclasses.replace(task, conditions={"visible_cpus": 64})
    res["refused"] = show(grade(c, many, task.reference_patch, job="e2e-grade-cond",
                                attempts=1, **KW))
print("E2E-RESULT " + json.dumps(res))
"""


def _task_env(image: str) -> dict[str, str]:
    spec = taskimage.task(image)
    spec["reference_patch"] = base64.b64encode(spec["reference_patch"]).decode()
    with tempfile.TemporaryDirectory() as d:
        repo = Path(d) / "repo"
        taskimage.make_repo(repo)
        (repo / "conftest.py").write_text(PLANTED_CONFTEST)
        subprocess.run(["git", "-C", str(repo), "add", "-N", "conftest.py"], check=True)
        raw = subprocess.run(["git", "-C", str(repo), "diff", "--binary"], check=True,
                             capture_output=True).stdout
    return {"GRADING_TASK": json.dumps(spec), "PLANTED": PLANTED_CONFTEST,
            "RAW_PLANTED": base64.b64encode(raw).decode()}


def test_grading_demo(sandman, ns, figures) -> None:
    (image,) = sandman.rn.load_images("grading_task")
    t0 = time.monotonic()
    res = run_trainer(sandman, ns, "grader", DEMO, timeout=600, **_task_env(image))
    took = time.monotonic() - t0
    assert res["kept"] == ["calc-add"], res
    assert res["reference"]["verdict"] == "passed", res["reference"]
    assert res["reference"]["summary"] == {"passed": 3}, res["reference"]
    assert res["empty"]["verdict"] == "failed", res["empty"]
    assert res["empty"]["summary"] == {"failed": 2, "passed": 1}, res["empty"]
    # The planted conftest.py never reaches a grading pod.
    assert res["capture_planted"] == {"patch": "", "excluded": ["conftest.py"]}, res
    assert res["graded_planted"]["verdict"] == "failed", res["graded_planted"]
    cap = res["capture_fixed"]
    assert cap["excluded"] == ["conftest.py"] and "+    return a + b" in cap["patch"], cap
    assert "conftest" not in cap["patch"] and cap["edit_line"] == 5, cap
    assert res["graded_fixed"]["verdict"] == "passed", res["graded_fixed"]
    raw = res["graded_raw_planted"]
    assert raw["verdict"] == "failed" and raw["excluded"] == ["conftest.py"], raw
    for key in ("reference", "empty", "graded_planted", "graded_fixed", "graded_raw_planted"):
        assert res[key]["attempts"] == 1 and not res[key]["infra"], res[key]
    figures.add(f"e2e: grading demo (preflight, agent sandbox, 5 gradings on never-used "
                f"pods): {took:.1f}s")


def test_grading_pod_killed_mid_run_is_no_verdict(sandman, ns, figures) -> None:
    """Each grading pod of the job is deleted through the API server once its suite is
    running (seen inside the pod): the grading retries on a new pod, then says no_verdict."""
    (image,) = sandman.rn.load_images("grading_task")
    url = sandman.inst.controller_url_in_cluster()
    from tests.e2e.helpers import bind_trainer, copy_ca

    bind_trainer(sandman.cluster.api_client, ns)
    copy_ca(sandman.cluster.api_client, sandman.inst, ns)  # $SANDMAN_CA_FILE: https
    sandman.create(ns, trainer_pod("grader-killed", sandman.inst.image_ref, KILLED, url,
                                   **_task_env(image)))
    killed: list[str] = []
    count = (f"for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done"
             f" | grep -c '^sleep {SLEEP} '")
    deadline = time.monotonic() + 420
    while len(killed) < 2 and time.monotonic() < deadline:
        phase = sandman.core.read_namespaced_pod("grader-killed", ns).status.phase
        if phase in ("Succeeded", "Failed"):
            break
        # The controller keys a tenant's job as "<namespace>.<job>" (docs/controller.md).
        pods = sandman.core.list_pod_for_all_namespaces(
            label_selector=f"{LABEL_JOB} in (e2e-grade-kill,{ns}.e2e-grade-kill)").items
        for p in pods:
            name, sbx = p.metadata.name, p.metadata.namespace
            if name in killed or p.metadata.deletion_timestamp or p.status.phase != "Running":
                continue
            try:
                r = crictl_exec(sandman, sbx, name, ["bash", "-c", count], timeout=20)
            except AssertionError:
                continue  # not ready yet
            if r.stdout.strip() not in ("", "0"):
                sandman.delete(sbx, name)
                killed.append(name)
        time.sleep(1)
    pod = sandman.wait_done(ns, "grader-killed", timeout=300)
    logs = sandman.logs(ns, "grader-killed")
    lines = [ln for ln in logs.splitlines() if ln.startswith("E2E-RESULT ")]
    assert pod.status.phase == "Succeeded" and lines, logs[-3000:]
    r = json.loads(lines[-1][len("E2E-RESULT "):])["killed"]
    assert len(killed) == 2, (killed, r)
    assert r["verdict"] == "no_verdict" and r["attempts"] == 2, r
    assert sorted(r["pods"]) == sorted(killed), (r["pods"], killed)
    assert len(r["infra"]) == 2, r
    assert all("(run the suite)" in e for e in r["infra"]), r["infra"]  # killed mid-suite
    figures.add(f"e2e: grading with its pod deleted mid-suite twice -> no_verdict; "
                f"infra errors: {' | '.join(e[:90] for e in r['infra'])}")


def test_grading_pod_reused_then_retired_and_a_contradicted_pod_refused(sandman, ns,
                                                                         figures) -> None:
    (image,) = sandman.rn.load_images("grading_task")
    t0 = time.monotonic()
    res = run_trainer(sandman, ns, "grader-reuse", REUSE, timeout=900, **_task_env(image))
    took = time.monotonic() - t0
    rounds = res["rounds"]
    assert [r["verdict"] for r in rounds] == ["passed"] * 10, rounds
    assert all(r["attempts"] == 1 and not r["infra"] and not r["shadow"] for r in rounds), [
        (r["attempts"], r["infra"], r["shadow"], r["pods"]) for r in rounds]
    first = rounds[0]["pods"]
    assert len(first) == 1, rounds[0]
    # One pod for nine gradings (reused 8 times), deleted at its ninth release.
    assert [r["pods"] for r in rounds[:9]] == [first] * 9, [r["pods"] for r in rounds]
    assert rounds[9]["pods"] != first, rounds[9]
    assert res["parked_pod"] == rounds[9]["pods"][0] and res["parked_warm"] is True, res
    assert res["parked_diff"]["clean"] is True, res["parked_diff"]["changes"][:10]
    assert res["retired"] is True
    assert res["after_retire"][0] not in (res["parked_pod"], first[0]), res
    assert res["after_retire"][1] is False, res  # nothing reusable left: a fresh pod
    refused = res["refused"]
    assert refused["verdict"] == "no_verdict", refused
    assert any("ConditionsRefused" in e and "visible_cpus" in e for e in refused["infra"]), \
        refused["infra"]
    figures.add(f"e2e: grading with checked reuse (9 gradings on one pod, then a new one, "
                f"retired) and a refused CPU declaration: {took:.1f}s")
