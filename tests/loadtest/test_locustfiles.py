"""Each locustfile headless for a few seconds against the test bed: the real webhook
(registered by url:, scoped to the test's namespace), the real controller, and for execd_storm
a real execd on every kwok pod's loopback IP (the kubelet stand-in, testbed/standin.py). Small
user counts."""

from __future__ import annotations

import json
import sys

import pytest

from loadtest import report
from loadtest.job import MASTER_PORT, render
from testbed.controller import start_controller
from testbed.procs import Proc, reserve_port
from testbed.stack import locust
from testbed.standin import start_standin
from testbed.webhook import registration, start_webhook, wait_webhook_active


@pytest.fixture(scope="module")
def webhook(tmp_path_factory):
    wh = start_webhook(tmp_path_factory.mktemp("lt-webhook"), "--log-level", "warning")
    yield wh.url, wh.ca
    wh.stop()


@pytest.fixture
def stack(cluster, namespace, webhook, tmp_path):
    url, ca = webhook
    reg = registration(cluster.admissionregistration, namespace, url, ca.read_bytes(),
                       "sandman-lt").create()
    procs = []
    try:
        wait_webhook_active(cluster.core, namespace)
        yield {"ns": namespace, "kc": str(cluster.kubeconfig), "webhook": url, "ca": str(ca),
               "procs": procs, "tmp": tmp_path}
    finally:
        for p in reversed(procs):
            p.stop()
        reg.delete()


def controller(stack, ready_check="pod"):
    ctl = start_controller(stack["ns"], stack["kc"], stack["tmp"] / "controller.log",
                           ["--lease-name", f"lt-{stack['ns']}", "--rate", "20",
                            "--burst", "40", "--log-level", "WARNING"], ready_check)
    stack["procs"].append(ctl)
    return ctl.url


def common_args(stack, url, name):
    return ["--controller-url", url, "--kubeconfig", stack["kc"], "--namespace", stack["ns"],
            "--csv", str(stack["tmp"] / name), "--html", str(stack["tmp"] / f"{name}.html")]


def summary(stack, name) -> dict:
    return json.loads((stack["tmp"] / f"{name}_sandman.json").read_text())


def test_acquire_burst64_through_webhook_and_controller(stack, figures):
    url = controller(stack)
    log = stack["tmp"] / "burst.log"
    code = locust("acquire_burst.py", ["--shape", "burst64", "--hold-s", "1", "--max-leaked", "0",
                                       "--pacing-rate", "20", "--max-p99-ms", "60000",
                                       *common_args(stack, url, "burst64")], log, timeout=180)
    s = summary(stack, "burst64")
    assert code == 0, log.read_text()[-3000:]
    assert s["stats"]["ACQUIRE /v1/sandboxes"] | {"p50_ms": 0, "p99_ms": 0} == {
        "type": "ACQUIRE", "name": "/v1/sandboxes", "requests": 64, "failures": 0,
        "p50_ms": 0, "p99_ms": 0}
    # Create-to-Ready from the watch, apart from the API latency: one per pod created.
    assert s["stats"]["POD_READY pod first seen -> Ready"]["requests"] == 64
    assert s["leaked"] == [] and s["audit"].startswith("0 pod(s)")
    # The controller paced: 64 creates took more than the bucket's 40 at once.
    firsts = sorted(p[0] for p in s["pods"].values())
    assert firsts[-1] - firsts[0] > 0.8
    text, page = report.build(stack["tmp"])
    for png in ("burst64_creates.png", "burst64_acquire.png", "burst64_ready.png"):
        assert (stack["tmp"] / png).stat().st_size > 5000
    assert "| burst64 | 64 | 0 | 64 |" in text and page.exists()
    assert (stack["tmp"] / "burst64.html").exists()
    r = report.summarize(report.load(stack["tmp"] / "burst64_sandman.json"))
    figures.add(f"loadtest burst64 on the test bed: acquire p50/p99 {r['acq_p50']:.0f}/"
                f"{r['acq_p99']:.0f} ms, create-to-Ready p50/p99 {r['ready_p50']:.0f}/"
                f"{r['ready_p99']:.0f} ms, peak {r['peak_rate']} creates/s at --rate 20 --burst 40")


def test_leak_audit_finds_a_planted_pod(cluster, stack):
    from loadtest.audit import leak_audit

    url = controller(stack)
    job = "lt-planted"
    planted = cluster.core.create_namespaced_pod(stack["ns"], {
        "metadata": {"generateName": "planted-", "labels": {"sandman.dev/job": job}},
        "spec": {"containers": [{"name": "c", "image": "registry.invalid/x:1"}],
                 "terminationGracePeriodSeconds": 0}}).metadata.name
    assert leak_audit(cluster.core, stack["ns"], job, settle_s=0) == [planted]
    log = stack["tmp"] / "leak.log"
    code = locust("acquire_burst.py", ["--shape", "burst64", "--hold-s", "0", "--job", job,
                                       "--max-leaked", "0", "--leak-settle-s", "5",
                                       *common_args(stack, url, "leak")], log, timeout=180)
    s = summary(stack, "leak")
    assert code == 1, log.read_text()[-3000:]
    # Only the planted pod: the run's own 64 were released and deleted.
    assert s["leaked"] == [planted]
    assert s["leaked_detail"][planted]["labels"]["sandman.dev/job"] == job
    assert s["stats"][f"LEAK {planted}"]["failures"] == 1
    assert "threshold FAIL: leaked pods 1 <= 0" in log.read_text()
    assert s["stats"]["ACQUIRE /v1/sandboxes"]["failures"] == 0


def test_an_audit_that_selects_none_of_the_runs_pods_fails_the_run(stack):
    """A wrong tenant (the controller here runs unscoped, so its pods' job label is the bare
    job): the audit would find no pod whatever was left. The run must fail, not pass
    vacuously (it did when the chart's tenant-scoped labels met the bare job name)."""
    url = controller(stack)
    log = stack["tmp"] / "tenant.log"
    code = locust("acquire_burst.py", ["--shape", "burst64", "--hold-s", "0", "--job", "lt-t",
                                       "--tenant", "someone-else", "--max-leaked", "0",
                                       "--leak-settle-s", "2",
                                       *common_args(stack, url, "tenant")], log, timeout=180)
    s = summary(stack, "tenant")
    assert code == 1, log.read_text()[-3000:]
    assert s["stats"]["ACQUIRE /v1/sandboxes"]["failures"] == 0
    assert s["audit"].startswith("failed: 64 sandbox(es) created, but the pod watch saw no pod "
                                 "labelled sandman.dev/job=someone-else.lt-t"), s["audit"]


def test_admission_storm_dry_run_and_raw_reviews(stack):
    log = stack["tmp"] / "adm.log"
    code = locust("testbed/locustfiles/admission_storm.py", ["-u", "4", "-r", "4", "-t", "6s",
                                         "--webhook-url", stack["webhook"],
                                         "--webhook-ca", stack["ca"], "--max-p99-ms", "5000",
                                         *common_args(stack, "http://127.0.0.1:9", "adm")],
                  log, timeout=120)
    s = summary(stack, "adm")
    assert code == 0, log.read_text()[-3000:]
    st = s["stats"]
    assert st["POD_CREATE pods (dryRun=All)"]["requests"] > 5
    assert st["POD_CREATE pods (dryRun=All)"]["failures"] == 0
    assert st["ADMISSION_REVIEW /mutate"]["requests"] > 5
    assert st["ADMISSION_REVIEW /validate"]["failures"] == 0
    # Dry runs stored nothing.
    assert not cluster_pods(stack)


def cluster_pods(stack) -> list:
    from loadtest.audit import core_api

    return core_api(stack["kc"]).list_namespaced_pod(stack["ns"]).items


def test_execd_storm_against_real_execds(stack):
    stack["procs"].append(start_standin(stack["ns"], stack["kc"], stack["tmp"] / "standin.log",
                                        max_procs=10))
    url = controller(stack, ready_check="execd")
    log = stack["tmp"] / "execd.log"
    code = locust("execd_storm.py", ["-u", "4", "-r", "4", "-t", "8s", "--max-leaked", "0",
                                     "--max-p99-ms", "5000", "--leak-settle-s", "20",
                                     *common_args(stack, url, "execd")], log, timeout=150)
    s = summary(stack, "execd")
    assert code == 0, log.read_text()[-3000:]
    st = s["stats"]
    assert st["ACQUIRE /v1/sandboxes"]["requests"] == 4
    assert st["EXEC /exec"]["requests"] > 10 and st["EXEC /exec"]["failures"] == 0
    assert st["FILE_WRITE /files/write"]["requests"] > 2
    assert st["FILE_READ /files"]["failures"] == 0
    assert "FILE_READ /files (content)" not in st
    assert s["leaked"] == []


def test_acquire_with_commands_in_steady_shape(stack):
    """--commands runs real execd calls in each held sandbox; steady's pacing users cycle."""
    stack["procs"].append(start_standin(stack["ns"], stack["kc"], stack["tmp"] / "standin.log",
                                        max_procs=10))
    url = controller(stack, ready_check="execd")
    log = stack["tmp"] / "steady.log"
    # base users = round(0.4 x (hold 1 + 2)) = 1, cycling every 3 s; no burst within 8 s.
    code = locust("acquire_burst.py", ["--shape", "steady", "--steady-rate", "0.4", "--hold-s", "1",
                                       "--steady-s", "8", "--burst-every-s", "100",
                                       "--commands", "2", "--max-leaked", "0",
                                       "--leak-settle-s", "20",
                                       *common_args(stack, url, "steady")], log, timeout=120)
    s = summary(stack, "steady")
    assert code == 0, log.read_text()[-3000:]
    st = s["stats"]
    cycles = st["ACQUIRE /v1/sandboxes"]["requests"]
    assert cycles >= 2 and st["RELEASE /v1/sandboxes/{id}"]["requests"] == cycles
    assert st["EXEC /exec (turn)"]["requests"] == 2 * cycles
    assert st["EXEC /exec (turn)"]["failures"] == 0
    assert [x["label"] for x in s["stages"]] == ["base0"]


def test_acquire_burst_in_groups(stack):
    """--group-size: each user's one GROUP call gets its members, released together; each
    member is one of the run's acquires and nothing leaks."""
    url = controller(stack)
    log = stack["tmp"] / "groups.log"
    code = locust("acquire_burst.py", ["--shape", "burst64", "--run-users", "4", "--group-size",
                                       "3", "--hold-s", "1", "--max-leaked", "0",
                                       "--max-p99-ms", "60000",
                                       *common_args(stack, url, "groups")], log, timeout=180)
    s = summary(stack, "groups")
    assert code == 0, log.read_text()[-3000:]
    st = s["stats"]
    assert st["GROUP /v1/groups"]["requests"] == 4 and st["GROUP /v1/groups"]["failures"] == 0
    assert "ACQUIRE /v1/sandboxes" not in st
    assert st["RELEASE /v1/sandboxes/{id}"]["requests"] == 12
    assert s["leaked"] == [] and s["audit"].startswith("0 pod(s)")


def test_distributed_master_and_two_workers_as_the_job_renders_them(stack):
    """loadtest/job.py --workers 2: the master's and the workers' command lines as rendered,
    run here as local processes (kwok runs no container); only the in-cluster bits are swapped
    for the bed's (kubeconfig, csv dir, master address, a free port). The shape runs on the
    master and advances on the counts the workers report: 8 users finish on 2 workers."""
    url = controller(stack)
    name = "lt-dist"
    objs = render(name=name, namespace="trainers", sandbox_namespace=stack["ns"], image="i",
                  controller_url="https://c:1", ca_configmap="ca", workers=2,
                  locust_args=["--shape", "burst64", "--run-users", "8", "--hold-s", "1",
                               "--max-leaked", "0", "--leak-settle-s", "20"])
    jobs = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Job"}
    assert jobs[f"{name}-worker"]["spec"]["parallelism"] == 2

    def cmd(job: dict) -> list[str]:
        c = job["spec"]["template"]["spec"]["containers"][0]
        assert c["command"] == ["python3", "-m", "loadtest"]
        return [sys.executable, "-m", "loadtest", *c["args"]]

    # locust's master takes its port on its command line: one outside the ephemeral range,
    # held for this process (a bind(0)-and-close port goes back to the kernel).
    port, csv = str(reserve_port()), str(stack["tmp"] / "dist")
    local = {"in-cluster": stack["kc"], "/tmp/loadtest/run": csv, f"{name}-master": "127.0.0.1",
             str(MASTER_PORT): port}
    master_cmd = [local.get(a, a) for a in cmd(jobs[name])] + ["--master-bind-host",
                                                               "127.0.0.1"]
    worker_cmd = [local.get(a, a) for a in cmd(jobs[f"{name}-worker"])]
    env = {"SANDMAN_URL": url, "SANDMAN_TOKEN_FILE": "", "SANDMAN_CA_FILE": ""}
    master = Proc("master", master_cmd, stack["tmp"] / "master.log", env=env).start()
    workers = [Proc(f"worker{i}", worker_cmd, stack["tmp"] / f"worker{i}.log", env=env).start()
               for i in range(2)]
    procs = [master, *workers]
    try:
        code = master.wait(120)
        worker_codes = [w.wait(30) for w in workers]
    finally:
        for p in procs:
            p.stop()
    log = master.tail(6000)
    assert code == 0, log
    assert worker_codes == [0, 0], [w.tail() for w in workers]
    assert "2 workers connected" in master.log.read_text()
    s = summary(stack, "dist")
    assert s["job"] == name
    assert s["stats"]["ACQUIRE /v1/sandboxes"]["requests"] == 8
    assert s["stats"]["ACQUIRE /v1/sandboxes"]["failures"] == 0
    assert s["stats"]["RELEASE /v1/sandboxes/{id}"]["requests"] == 8
    # Both workers ran users and acquired; the master's watch and audit saw the run's pods.
    assert len(s["workers"]) == 2 and all(w["acquires"] > 0 for w in s["workers"].values())
    assert sum(w["done"] for w in s["workers"].values()) == 8
    assert s["stats"]["POD_READY pod first seen -> Ready"]["requests"] == 8
    assert s["leaked"] == [] and s["audit"].startswith("0 pod(s)")
    assert not any(p.group_alive() for p in procs)
