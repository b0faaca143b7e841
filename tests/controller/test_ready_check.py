"""The controller hands out a warm pod only if execd's /ready passes (issue 15 item 4): a pod
that still answers /health but cannot write where the agent works is deleted, not handed out.

Real controller, real test bed, the real execd behind each kwok pod (the kubelet stand-in). The
wedge is real too: the stand-in execd's working directory (the shell's first cwd, which /ready
writes to) is made immutable (`chattr +i`), so /ready's write fails while /health still says ok.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import httpx
import pytest

from sandman import contract
from testbed.controller import ControllerProc
from testbed.procs import wait_for
from testbed.standin import Standin
from tests.controller.harness import pods

IMAGE = "registry.invalid/swe/task:1"

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("chattr"),
                                reason="needs root and chattr to wedge a stand-in execd")


def warm_count(url: str) -> int:
    st = httpx.get(url + "/v1/stats").json()["warm"]
    return sum(v["warm"] for v in st.values())


def test_wedged_warm_pod_is_deleted_not_handed_out(cluster, namespace, tmp_path):
    standin = Standin(cluster.core, namespace, tmp_path / "standin").start()
    ctl = ControllerProc(namespace, cluster.kubeconfig, tmp_path / "controller.log",
                         ["--lease-name", f"ready-{namespace}"], ready_check="execd")
    wedged: list[str] = []
    try:
        ctl.start()
        spec = {"cpu": "1", "memory": "1Gi", "egress": "deny"}
        r = httpx.post(ctl.url + "/v1/prewarm", json={"image": IMAGE, "spec": spec, "count": 2,
                                                      "idle_timeout_s": 120})
        assert r.status_code == 200, r.text
        wait_for(lambda: warm_count(ctl.url) == 2, 60, "2 warm pods")
        warm = [p for p in pods(cluster.core, namespace) if not p.metadata.deletion_timestamp]
        assert len(warm) == 2
        for p in warm:
            home = standin.workdir / p.metadata.name
            subprocess.run(["chattr", "+i", str(home)], check=True)
            wedged.append(str(home))
            url = f"http://{p.status.pod_ip}:{contract.EXECD_PORT}"
            assert wait_for(lambda u=url: httpx.get(u + contract.EXECD_READY_PATH,
                                                    trust_env=False).status_code == 503,
                            10, "/ready to fail on the wedged pod")
            assert httpx.get(url + "/health", trust_env=False).status_code == 200
        r = httpx.post(ctl.url + "/v1/sandboxes", timeout=90, json={
            "image": IMAGE, "cpu": "1", "memory": "1Gi", "job": "job-ready"})
        assert r.status_code in (200, 201), r.text
        sb = r.json()
        names = {p.metadata.name for p in warm}
        assert sb["warm"] is False and sb["pod"] not in names, sb
        # Both wedged warm pods failed the hand-out check and were deleted.
        wait_for(lambda: not names & {p.metadata.name for p in pods(cluster.core, namespace)
                                      if not p.metadata.deletion_timestamp},
                 30, "the wedged warm pods to be deleted")
        assert "failed its health check" in (tmp_path / "controller.log").read_text()
    finally:
        for home in wedged:
            subprocess.run(["chattr", "-i", home], check=False)
        ctl.kill()
        standin.stop()
