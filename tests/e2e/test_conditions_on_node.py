"""Run conditions on the real node: real pods with known limits are read correctly by execd's
/conditions (the kubelet's cgroups, not fixtures), and an acquire declaring a CPU count no
pod can have is refused by the installed controller, pod after pod, until its tries are used
up: a clear ConditionsRefused, and the refusal counter rises on the leader."""

from __future__ import annotations

import json

from tests.e2e.helpers import new_token, sandbox_pod
from tests.e2e.test_sdk import run_trainer

MI = 1 << 20
# Two sizes, so a reader that hard-codes either cannot pass both.
SIZES = (("400m", 0.4, "320Mi", 320 * MI), ("150m", 0.15, "448Mi", 448 * MI))


def test_real_pods_limits_are_read_by_conditions(sandman, ns):
    token, sha = new_token()
    for i, (cpu, _, mem, _) in enumerate(SIZES):
        sandman.create(ns, sandbox_pod(f"sbx{i}", sha, cpu=cpu, memory=mem))
    for i, (_, cores, _, mem_bytes) in enumerate(SIZES):
        sandman.wait_ready(ns, f"sbx{i}", timeout=180)
        out = sandman.execd(ns, f"sbx{i}", token, """
            c = sb.conditions()
            out['c'] = c.raw
            out['nproc'] = sb.exec('nproc', timeout=30).output.strip()
            out['id'] = sb.exec('id -u; id -un', timeout=30).output.split()
        """)
        c = out["c"]
        assert abs(c["cpu_cores"] - cores) < 1e-6, c
        assert c["cpu_quota_us"] == int(cores * 100_000) and c["cpu_period_us"] == 100_000, c
        assert c["memory_limit_bytes"] == mem_bytes and c["memory_unlimited"] is False, c
        # What a command in the sandbox sees agrees with the readings.
        assert c["visible_cpu_count"] == int(out["nproc"]), (c, out["nproc"])
        assert [str(c["uid"]), c["user"]] == out["id"], (c, out["id"])
        assert c["tz"] is not None and c["pythonhashseed"] is None, c


SCRIPT = r"""
import json, os, re, ssl
import httpx
from sandman.client import Client, ConditionsRefused

# Each replica's own /metrics (by pod IP: the counter is per process), over https verified
# with the published CA for the Service's name (SNI), as the ServiceMonitor does.
TLS = ssl.create_default_context(cafile=os.environ["SANDMAN_CA_FILE"])

def refused():
    n = 0.0
    for addr in os.environ["CONTROLLERS"].split():
        with httpx.Client(verify=TLS, timeout=10) as h:
            r = h.get(f"https://{addr}/metrics",
                      extensions={"sni_hostname": os.environ["CONTROLLER_NAME"]})
        r.raise_for_status()
        text = r.text
        m = re.search(r'^sandman_controller_conditions_refused_total\{field="visible_cpus"\} (\S+)$',
                      text, re.M)
        n += float(m.group(1)) if m else 0.0
    return n

res = {"before": refused()}
with Client(timeout_s=60) as c:
    with c.acquire(image=os.environ["TASK_IMAGE"], job="e2e-cond", cpu="250m",
                   memory="160Mi", timeout_s=200,
                   conditions={"cpu_quota": 0.25, "memory_limit": "160Mi",
                               "time_limit_s": 60}) as sb:
        ck = sb.conditions_check
        res["ok"] = {"verified": ck.verified, "unverified": ck.unverified}
        res["nproc"] = int(sb.exec("nproc", timeout=30).output.strip())
    try:
        c.acquire(image=os.environ["TASK_IMAGE"], job="e2e-cond", cpu="250m",
                  memory="160Mi", timeout_s=300, conditions={"visible_cpus": 64})
        res["refused"] = None
    except ConditionsRefused as e:
        res["refused"] = str(e)
res["after"] = refused()
print("E2E-RESULT " + json.dumps(res))
"""


def test_acquire_declaring_an_impossible_cpu_count_is_refused(sandman, ns, figures):
    pods = sandman.core.list_namespaced_pod(
        sandman.inst.namespace, label_selector="app.kubernetes.io/component=controller").items
    addrs = [f"{p.status.pod_ip}:{p.spec.containers[0].ports[0].container_port}"
             for p in pods if p.status.pod_ip]
    assert addrs, "no controller pod with an IP"
    res = run_trainer(sandman, ns, "trainer-cond", SCRIPT, timeout=700,
                      CONTROLLERS=" ".join(addrs),
                      CONTROLLER_NAME=sandman.inst.controller_host())
    assert res["ok"]["verified"] == {"cpu_quota": 0.25, "memory_limit": 160 * MI}, res
    assert res["ok"]["unverified"] == ["time_limit_s"], res
    msg = res["refused"]
    assert msg and "3 pod(s) refused" in msg, json.dumps(res)
    assert f"visible_cpus: declared 64, the pod reads {res['nproc']}" in msg, msg
    assert res["after"] - res["before"] == 3, res
    figures.add(f"e2e: conditions: 1 acquire verified, 3 pods refused for visible_cpus=64 "
                f"(node shows {res['nproc']})")
