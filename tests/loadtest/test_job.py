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


def _matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_workers_zero_is_the_single_process_job():
    assert [o["kind"] for o in render(**BASE)] == [
        "ServiceAccount", "RoleBinding", "Role", "RoleBinding", "Job"]
    args = render(**BASE)[-1]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not {"--master", "--worker", "--expect-workers"} & set(args)
    with pytest.raises(ValueError, match="--workers -1"):
        render(**{**BASE, "workers": -1})


def test_workers_render_a_master_n_workers_and_only_the_master_port_between_them():
    objs = render(**BASE, workers=2, worker_cpu="1", worker_memory="1Gi")
    by_name = {(o["kind"], o["metadata"]["name"]): o for o in objs}
    master, workers = by_name[("Job", "lt")], by_name[("Job", "lt-worker")]
    svc, netpol = by_name[("Service", "lt-master")], by_name[("NetworkPolicy", "lt-master")]
    m_pod, w_pod = master["spec"]["template"], workers["spec"]["template"]
    m_args = m_pod["spec"]["containers"][0]["args"]
    # The master keeps every run option of the single process, plus the master's own.
    assert m_args[:len(m_args) - 7] == render(**BASE)[-1]["spec"]["template"]["spec"][
        "containers"][0]["args"]
    assert m_args[-7:] == ["--master", "--master-bind-port", "5557", "--expect-workers", "2",
                           "--expect-workers-max-wait", "300"]
    w = w_pod["spec"]["containers"][0]
    assert w["args"] == ["acquire_burst", "--worker", "--master-host", "lt-master",
                         "--master-port", "5557"]
    assert w["resources"]["limits"] == {"cpu": "1", "memory": "1Gi"}
    assert workers["spec"]["completions"] == workers["spec"]["parallelism"] == 2
    assert workers["spec"]["backoffLimit"] == 0 and workers["spec"]["activeDeadlineSeconds"]
    # Workers call the controller as trainers, with the same token and URL as the master.
    assert w_pod["metadata"]["labels"]["sandman.dev/trainer"] == "true"
    assert w["env"] == m_pod["spec"]["containers"][0]["env"]
    # The Service reaches the master's pod, never a worker's.
    assert _matches(svc["spec"]["selector"], m_pod["metadata"]["labels"])
    assert not _matches(svc["spec"]["selector"], w_pod["metadata"]["labels"])
    assert svc["spec"]["ports"] == [{"name": "locust-master", "port": 5557,
                                     "targetPort": 5557, "protocol": "TCP"}]
    # The policy isolates the master; its one rule admits the workers on 5557 and nothing else.
    spec = netpol["spec"]
    assert _matches(spec["podSelector"]["matchLabels"], m_pod["metadata"]["labels"])
    assert not _matches(spec["podSelector"]["matchLabels"], w_pod["metadata"]["labels"])
    assert spec["policyTypes"] == ["Ingress"]
    [rule] = spec["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 5557}]
    [peer] = rule["from"]
    assert list(peer) == ["podSelector"]  # no namespaceSelector, no ipBlock: this run's pods
    assert _matches(peer["podSelector"]["matchLabels"], w_pod["metadata"]["labels"])
    assert not _matches(peer["podSelector"]["matchLabels"], m_pod["metadata"]["labels"])
    # Another run's workers in the same namespace are not admitted.
    other = {o["metadata"]["name"]: o for o in render(**{**BASE, "name": "lt2"}, workers=1)}
    assert not _matches(peer["podSelector"]["matchLabels"],
                        other["lt2-worker"]["spec"]["template"]["metadata"]["labels"])


def test_cli_workers(capsys):
    assert main(["--namespace", "t", "--image", "i", "--controller-url", "https://c:1",
                 "--ca-configmap", "ca", "--workers", "3", "--worker-cpu", "2"]) == 0
    objs = {o["metadata"]["name"]: o for o in yaml.safe_load_all(capsys.readouterr().out)
            if o["kind"] == "Job"}
    spec = objs["sandman-loadtest-worker"]["spec"]
    assert spec["parallelism"] == 3
    assert spec["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"] == "2"
