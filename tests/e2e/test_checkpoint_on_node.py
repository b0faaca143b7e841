"""Checkpoints on the real node: the installed controller (upgraded for this test to store
checkpoints in the bed's real local registry, testbed/registry.py, reached from its pod through
a relay on the node IP: pods never reach the host's loopback) checkpoints a job's real agent
pods of the task image, changed in the image's own tree and in a new one; the originals are
released, as by a trainer that crashed, and a restore makes each anew in a new pod with the same
files (sha256 manifest), modes, links, deletions, cwd and exported variable. Then one sandbox
is paused and resumed. The chart is upgraded back afterwards."""

from __future__ import annotations

import json
import urllib.request

import pytest

from tests.e2e.test_sdk import run_trainer

PREFIX = "sandman/checkpoints"

SCRIPT = r"""
import json, os
from sandman.client import Client
M = ("cd /; find /work/ck /etc/ck.e2e -printf '%p %y %m %l\n' | sort; "
     "find /work/ck /etc/ck.e2e -type f -exec sha256sum {} + | sort; "
     "test -e /etc/issue && echo issue || echo no-issue; stat -c %a /etc/passwd; cd - >/dev/null")
SHELL = 'pwd; echo "${CKPT-unset}"; echo "${LOCAL-unset}"'
N = int(os.environ["N"])
res = {}
def shape(sb, i):
    return sb.exec(f"set -e; mkdir -p /work/ck/d{i}/sub; echo n={i} > /work/ck/d{i}/a; "
                   f"chmod 700 /work/ck/d{i}/a; ln -s a /work/ck/d{i}/l; echo {i} > /etc/ck.e2e; "
                   f"rm -f /etc/issue; chmod 600 /etc/passwd; cd /work/ck/d{i}/sub; "
                   f"export CKPT=sb{i}; LOCAL=1", timeout=60).exit_code
c = Client(timeout_s=120)
try:
    kw = dict(cpu="250m", memory="160Mi", timeout_s=300)
    sbs = [c.acquire(image=os.environ["TASK_IMAGE"], job="e2e-ck", **kw) for _ in range(N)]
    res["shaped"] = [shape(sb, i) for i, sb in enumerate(sbs)]
    want = {sb.id: [sb.exec(M).output, sb.exec(SHELL).output.split()] for sb in sbs}
    res["want"] = want
    ck = c.checkpoint(job="e2e-ck", timeout_s=300)
    res["ck"] = {"id": ck.id, "n": len(ck.sandboxes),
                 "digests": all(s.digest.startswith("sha256:") for s in ck.sandboxes)}
    old_pods = [sb.pod for sb in sbs]
    for sb in sbs:  # gone, as a crashed trainer's
        sb.release()
    got = c.restore(ck.id, timeout_s=300)
    res["restored"] = {old: {"tree": new.exec(M).output, "shell": new.exec(SHELL).output.split(),
                             "pod": new.pod, "new_id": new.id not in want}
                       for old, new in got.items()}
    res["old_pods"] = old_pods
    for new in got.values():
        new.release()
    sb = c.acquire(image=os.environ["TASK_IMAGE"], job="e2e-pause", **kw)
    res["pause_shaped"] = shape(sb, 9)
    pwant = [sb.exec(M).output, sb.exec(SHELL).output.split()]
    handle = sb.pause(timeout_s=300)
    res["paused_released"] = sb.released
    back = c.resume(handle, timeout_s=300)
    res["resumed"] = {"same": [back.exec(M).output, back.exec(SHELL).output.split()] == pwant,
                      "want": pwant, "got": [back.exec(M).output, back.exec(SHELL).output.split()],
                      "pod": back.pod, "old_pod": sb.pod}
    back.release()
except Exception as e:
    # The sandboxes stay (no release, no close) so the test can read their execd's log.
    print("E2E-RESULT " + json.dumps({"error": f"{type(e).__name__}: {e}", **res}), flush=True)
    os._exit(0)
c.close()
print("E2E-RESULT " + json.dumps(res))
"""


@pytest.fixture
def checkpoints(sandman):
    """The local registry, a relay to it on the node IP, and the install upgraded to use it;
    all undone after."""
    from testbed.registry import LocalRegistry
    from testbed.relay import Relay

    reg = LocalRegistry(sandman.cluster.testbed).start()
    relay = None
    try:
        relay = Relay(sandman.rn.node_ip, "127.0.0.1", reg.port).start()
        sandman.inst.upgrade({"controller": {"checkpoints": {
            "registry": f"{sandman.rn.node_ip}:{relay.port}/{PREFIX}", "insecure": True}}})
        try:
            yield reg
        finally:
            sandman.inst.upgrade()
    finally:
        if relay is not None:
            relay.stop()
        reg.stop()


def catalog(reg) -> list[str]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://{reg.host}/v2/_catalog", timeout=10) as r:
        return json.load(r).get("repositories") or []


@pytest.mark.timeout(1800)
def test_agent_sandboxes_checkpointed_and_restored_on_the_real_node(sandman, ns, checkpoints,
                                                                     figures):
    n = 3
    res = run_trainer(sandman, ns, "trainer-ck", SCRIPT, timeout=900, N=str(n))
    if "error" in res:
        sbx = sandman.inst.sandbox_namespace
        pods = sandman.inst.kubectl("get", "pods", "-n", sbx, "-o", "name").stdout.split()
        logs = [sandman.inst.kubectl("logs", "-n", sbx, p, "--all-containers", "--tail", "30",
                                     check=False).stdout for p in pods]
        pytest.fail(f"{res['error']}\n" + "\n".join(logs)[-6000:], pytrace=False)
    assert res["shaped"] == [0] * n, res
    assert res["ck"]["n"] == n and res["ck"]["digests"], res["ck"]
    # The states are in the local registry, under the prefix the chart named.
    assert any(r.startswith(PREFIX + "/") for r in catalog(checkpoints)), catalog(checkpoints)
    assert set(res["restored"]) == set(res["want"])
    for old, new in res["restored"].items():
        tree, shell = res["want"][old]
        assert "no-issue" in tree and "\n600\n" in tree and " l 777 a" in tree, tree
        assert new["new_id"] and new["pod"] not in res["old_pods"], new
        assert new["tree"] == tree, (old, new["tree"], tree)
        # cwd and the exported variable come back; a variable that was not exported does not.
        assert new["shell"] == shell[:2] + ["unset"], (new["shell"], shell)
    assert res["pause_shaped"] == 0 and res["paused_released"] is True, res
    r = res["resumed"]
    assert r["pod"] != r["old_pod"], r
    assert r["got"][0] == r["want"][0], r
    assert r["got"][1] == r["want"][1][:2] + ["unset"], r
    figures.add(f"e2e: {n} agent sandboxes checkpointed into the bed's registry and restored in "
                "new pods on the real node, trees, cwd and exported env equal; one paused and "
                "resumed")
