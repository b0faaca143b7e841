"""Checked reuse on the real node: a grading sandbox (real pod, execd as PID 1 with its default
baseline over the workspace, /etc, /usr/local, /opt, $HOME, /tmp and the package dirs) is
changed, released with reuse, handed out again with a new token and a clean /diff, 8 times,
then deleted at the 9th release (--max-reuse 8, the controller's default)."""

from __future__ import annotations

from tests.e2e.test_sdk import run_trainer

SCRIPT = r"""
import json
from sandman.client import Client
res = {"rounds": []}
kw = dict(job="e2e-reuse", cpu="250m", memory="160Mi", timeout_s=150, role="grading",
          reused_ok=True)
import os
with Client(timeout_s=120) as c:
    sb = c.acquire(image=os.environ["TASK_IMAGE"], **kw)
    res["pod"] = sb.pod
    res["first_diff"] = sb._http.get("/diff").json()
    for i in range(9):
        sb.exec(f"echo {i} > /tmp/answer.py; echo 'x{i}' >> /etc/hostname.e2e; "
                f"chmod 600 /etc/passwd; ln -sfn /nowhere /opt/link{i}; export GRADED={i}; "
                "(setsid sleep 600 >/dev/null 2>&1 < /dev/null &)", timeout=60)
        dirty = sb._http.get("/diff").json()
        old_auth = sb._http.headers["authorization"]
        sb.release(reuse=True)
        rnd = {"dirty": len(dirty["changes"]), "reused": sb.reused}
        if not sb.reused:
            res["rounds"].append(rnd)
            break
        sb = c.acquire(image=os.environ["TASK_IMAGE"], **kw)
        d = sb._http.get("/diff").json()
        rnd.update(same_pod=sb.pod == res["pod"], warm=sb.warm, clean=d["clean"],
                   left=d["changes"][:5],
                   new_token=sb._http.headers["authorization"] != old_auth,
                   shell=sb.exec("echo ${GRADED-unset}; stat -c %a /etc/passwd; "
                                 "ls /tmp/answer.py /etc/hostname.e2e 2>&1 | wc -l").output.split())
        res["rounds"].append(rnd)
print("E2E-RESULT " + json.dumps(res))
"""


def test_grading_pod_reused_8_times_then_deleted(sandman, ns, figures):
    res = run_trainer(sandman, ns, "trainer-reuse", SCRIPT, timeout=600)
    assert res["first_diff"]["clean"] is True, res["first_diff"]["changes"][:10]
    rounds = res["rounds"]
    assert len(rounds) == 9, rounds
    for i, r in enumerate(rounds[:8]):
        assert r["reused"] is True and r["dirty"] >= 5, (i, r)
        assert r["same_pod"] and r["warm"] and r["new_token"], (i, r)
        assert r["clean"] is True, (i, r["left"])
        assert r["shell"] == ["unset", "644", "2"], (i, r["shell"])  # ls: 2 "No such" lines
    assert rounds[8]["reused"] is False
    figures.add("e2e: a grading pod reused 8 times, /diff clean after each, deleted at the 9th")
