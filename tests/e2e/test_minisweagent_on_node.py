"""mini-swe-agent on the real node: its `DefaultAgent` with its deterministic test model runs a
task to its end in a `SandmanEnvironment` whose sandbox the installed controller acquired (a
real pod of the task image, execd PID 1): the scripted actions read, edit and test a file,
fail once, time out once and submit; the file is edited in the pod, the pod is gone after
cleanup(). The trainer is this host's venv (tests/e2e/minisweagent_trainer.py) in a trainer
pod's network namespace, as a trainer reaches the controller and the sandboxes."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from kubernetes import client

from tests.e2e.helpers import TASK_IMAGE, TRAINER_LABEL, bind_trainer, plain_pod
from tests.e2e.minisweagent_trainer import SOLVED

TRAINER = Path(__file__).with_name("minisweagent_trainer.py")


def test_default_agent_to_the_task_end_on_the_real_node(sandman, ns, figures, tmp_path):
    inst = sandman.inst
    bind_trainer(sandman.cluster.api_client, ns)
    sandman.run_ready(ns, plain_pod("caller", labels={TRAINER_LABEL: "true"}))
    token = sandman.core.create_namespaced_service_account_token("default", ns, {
        "spec": {"audiences": ["sandman"], "expirationSeconds": 900}}).status.token
    svc = inst.kget("service", inst.controller_service(), "-n", inst.namespace)["spec"]
    ca = tmp_path / "ca.crt"
    ca.write_text(inst.ca_bundle())
    task = tmp_path / "task"
    (task / "pkg").mkdir(parents=True)
    (task / "pkg" / "greet.py").write_text("def greet():\n    return 'hello world'\n")
    url = f"https://{inst.controller_host()}:{svc['ports'][0]['port']}"
    t0 = time.monotonic()
    res = sandman.netns(ns, "caller", [sys.executable, str(TRAINER), url, svc["clusterIP"],
                                       token, str(ca), TASK_IMAGE, str(task)], timeout=400)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("E2E-RESULT ")]
    assert res.returncode == 0 and lines, f"trainer failed: {res.stderr[-3000:]}"
    out = json.loads(lines[-1][len("E2E-RESULT "):])
    assert out["result"] == {"exit_status": "Submitted", "submission": SOLVED}, out
    obs = out["observations"]
    assert "hello world" in obs[0] and "<returncode>0</returncode>" in obs[1], obs
    assert "tested" in obs[2], obs[2]
    assert "<returncode>2</returncode>" in obs[3] and "No such file" in obs[3], obs[3]
    assert "<returncode>-1</returncode>" in obs[4] and "timed out after 3" in obs[4], obs[4]
    assert out["file"] == SOLVED
    # The template's system information is the pod's kernel (the node's), not a guess.
    assert out["uname"] in out["system_info"]
    assert out["released"], out
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            sandman.core.read_namespaced_pod(out["pod"], inst.sandbox_namespace)
        except client.ApiException as e:
            if e.status == 404:
                break
            raise
        time.sleep(0.5)
    else:
        raise AssertionError(f"sandbox pod {out['pod']} still there 60 s after cleanup()")
    figures.add(f"e2e: mini-swe-agent DefaultAgent, 6 steps to Submitted on the real node: "
                f"acquire {out['acquire_s']:.1f}s, run {out['run_s']:.1f}s, total "
                f"{time.monotonic() - t0:.1f}s")
