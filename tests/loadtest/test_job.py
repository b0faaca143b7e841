"""The in-cluster Job's manifest (loadtest/job.py) and the `python -m loadtest` runner it
starts. The Job itself runs on the real node in tests/e2e/test_loadtest_job.py."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
import yaml

from loadtest import __main__ as runner
from loadtest.job import main, render
from tests.loadtest.test_thresholds import FakeController

BASE = dict(name="lt", namespace="trainers", sandbox_namespace="sandboxes", image="img:1",
            controller_url="https://sandman-controller.sandman-system.svc:8080",
            ca_configmap="sandman-ca", locust_args=["--shape", "two-runs"])


def _by_kind(objs):
    return {(o["kind"], o["metadata"]["namespace"]): o for o in objs}


def test_the_job_acquires_as_a_trainer_and_audits_in_cluster():
    objs = _by_kind(render(**BASE))
    job = objs[("Job", "trainers")]
    pod = job["spec"]["template"]
    c = pod["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["SANDMAN_URL"] == BASE["controller_url"]
    assert env["SANDMAN_TOKEN_FILE"] == "/var/run/secrets/sandman/token"
    assert c["args"][:4] == ["acquire_burst", "--only-summary", "--kubeconfig", "in-cluster"]
    assert c["args"][-2:] == ["--shape", "two-runs"]
    assert "--namespace" in c["args"] and c["args"][c["args"].index("--namespace") + 1] == (
        "sandboxes")
    assert pod["metadata"]["labels"]["sandman.dev/trainer"] == "true"
    assert job["spec"]["backoffLimit"] == 0 and pod["spec"]["automountServiceAccountToken"]
    token = pod["spec"]["volumes"][0]["projected"]["sources"][0]["serviceAccountToken"]
    assert token["audience"] == "sandman"
    # RBAC: acquire as a user of its tenant; read pods (no more) where the sandboxes are.
    assert objs[("RoleBinding", "trainers")]["roleRef"]["name"] == "sandman-user"
    assert objs[("Role", "sandboxes")]["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    assert objs[("RoleBinding", "sandboxes")]["subjects"] == [
        {"kind": "ServiceAccount", "name": "lt", "namespace": "trainers"}]


def test_https_job_mounts_the_ca_and_refuses_without_one_or_over_http():
    url = "https://sandman-controller.sandman-system.svc:8080"
    with pytest.raises(ValueError, match="needs --ca-configmap"):
        render(**{**BASE, "controller_url": url, "ca_configmap": ""})
    # Its pod carries a projected token: never over plain http (the SDK would refuse it there).
    with pytest.raises(ValueError, match="must be https"):
        render(**{**BASE, "controller_url": "http://sandman-controller.sandman-system.svc:8080"})
    objs = _by_kind(render(**{**BASE, "controller_url": url, "ca_configmap": "sandman-ca"}))
    spec = objs[("Job", "trainers")]["spec"]["template"]["spec"]
    env = {e["name"]: e["value"] for e in spec["containers"][0]["env"]}
    assert env["SANDMAN_CA_FILE"] == "/var/run/secrets/sandman-ca/ca.crt"
    assert {"name": "sandman-ca", "configMap": {"name": "sandman-ca"}} in spec["volumes"]


def test_cli_renders_a_local_locustfile_into_a_configmap(tmp_path, capsys):
    lf = tmp_path / "mine.py"
    lf.write_text("# a locustfile\n")
    assert main(["--namespace", "t", "--image", "i", "--controller-url", "https://c:1",
                 "--ca-configmap", "sandman-ca", "--locustfile-path", str(lf), "--node-selector", "pool=x",
                 "--toleration", "k=v:NoSchedule", "--", "--shape", "burst64"]) == 0
    objs = _by_kind(yaml.safe_load_all(capsys.readouterr().out))
    assert objs[("ConfigMap", "t")]["data"] == {"mine.py": "# a locustfile\n"}
    spec = objs[("Job", "t")]["spec"]["template"]["spec"]
    assert spec["containers"][0]["args"][0] == "/etc/loadtest/mine.py"
    assert spec["nodeSelector"] == {"pool": "x"}
    assert spec["tolerations"] == [{"key": "k", "operator": "Equal", "value": "v",
                                    "effect": "NoSchedule"}]
    assert main(["--namespace", "t", "--image", "i",
                 "--controller-url", "https://c:1"]) == 2
    assert "needs --ca-configmap" in capsys.readouterr().err


@pytest.mark.slow
def test_runner_passes_locusts_exit_code_and_prints_the_summary(tmp_path):
    """`python -m loadtest acquire_burst ...` (what the Job runs) against a fake controller:
    exit 0 and one SANDMAN-SUMMARY line; the raising locustfile by path: exit 1."""
    srv = FakeController("ok")
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        def run(target: str, name: str):
            return subprocess.run(
                [sys.executable, "-m", "loadtest", target, "--only-summary", "--shape",
                 "burst64", "--hold-s", "0", "--budget-s", "30", "--controller-url", srv.url,
                 "--max-leaked", "-1", "--csv", str(tmp_path / name)],
                capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin"})

        ok = run("acquire_burst", "ok")
        lines = [ln for ln in ok.stdout.splitlines() if ln.startswith("SANDMAN-SUMMARY ")]
        assert ok.returncode == 0 and len(lines) == 1, ok.stdout[-2000:] + ok.stderr[-2000:]
        doc = json.loads(lines[0].split(" ", 1)[1])
        assert doc["exit_code"] == 0 and doc["stats"]["ACQUIRE /v1/sandboxes"]["requests"] == 64
        bad = run(str(runner.HERE.parent / "tests" / "loadtest" / "files" / "raising.py"), "bad")
        assert bad.returncode == 1, bad.stdout[-2000:] + bad.stderr[-2000:]
    finally:
        srv.shutdown()
        srv.server_close()
    with pytest.raises(SystemExit, match="unknown locustfile"):
        runner.main(["nope"])
