"""Fork on the real node: an agent sandbox (real pod, execd as PID 1 with the snapshot base the
controller's SANDMAN_SNAPSHOT=on makes it record over the whole root filesystem) is changed in
its image's own tree and in a new one, then forked into 2 children: each holds the same files,
modes, links and deletions, the parent's cwd and exported variable, and a write in one is seen
in no other."""

from __future__ import annotations

from tests.e2e.test_sdk import run_trainer

SCRIPT = r"""
import json, os
from sandman.client import Client
M = ("cd /; find /work/fork /etc/fork.e2e -printf '%p %y %m %l\n' | sort; "
     "sha256sum /work/fork/a /etc/fork.e2e; test -e /etc/issue && echo issue || echo no-issue; "
     "stat -c %a /etc/passwd; cd - >/dev/null")
res = {}
with Client(timeout_s=120) as c:
    sb = c.acquire(image=os.environ["TASK_IMAGE"], job="e2e-fork", cpu="250m", memory="160Mi",
                   timeout_s=150)
    r = sb.exec("set -e; mkdir -p /work/fork/sub; echo hi > /work/fork/a; chmod 700 /work/fork/a; "
                "ln -s a /work/fork/l; echo x > /etc/fork.e2e; rm -f /etc/issue; "
                "chmod 600 /etc/passwd; cd /work/fork/sub; export FORKED=yes; LOCAL=1",
                timeout=60)
    res["shaped"] = r.exit_code
    want = sb.exec(M).output
    res["want"] = want
    kids = sb.fork(2, timeout_s=300)
    res["kids"] = [{"same": k.exec(M).output == want, "got": k.exec(M).output,
                    "shell": k.exec("pwd; echo ${FORKED-unset}${LOCAL-unset}").output.split(),
                    "pod": k.pod} for k in kids]
    kids[0].exec("echo mine > /work/fork/only")
    res["seen"] = [x.exec("test -e /work/fork/only && echo yes || echo no").output.strip()
                   for x in (kids[1], sb)]
    res["parent_pod"] = sb.pod
    for k in kids:
        k.release()
print("E2E-RESULT " + json.dumps(res))
"""


def test_an_agent_sandbox_forked_into_two_on_the_real_node(sandman, ns, figures):
    res = run_trainer(sandman, ns, "trainer-fork", SCRIPT, timeout=600)
    assert res["shaped"] == 0, res
    assert "/work/fork/l l 777 a" in res["want"] and "no-issue" in res["want"], res["want"]
    pods = {k["pod"] for k in res["kids"]} | {res["parent_pod"]}
    assert len(pods) == 3, res
    for k in res["kids"]:
        assert k["same"], (k["got"], res["want"])
        assert k["shell"] == ["/work/fork/sub", "yesunset"], k["shell"]
    assert res["seen"] == ["no", "no"], res["seen"]
    figures.add("e2e: an agent sandbox forked into 2 on the real node, each child's tree, cwd "
                "and exported env the parent's")
