"""sandman on two real nodes (testbed/secondnode.py joins the installed bed for this module):
the controller's soft spread (maxSkew 2 over hostnames) on real scheduling, a guarded sandbox on
one node reaching its allowed peer on the other and nothing else, and a node lost under a
trainer mid-trajectory: what the trainer sees, what the controller reports, and nothing left
once the Node is deleted.

The node-loss test runs last of the module: it kills the second node.
"""

from __future__ import annotations

import json
import time

import pytest
from kubernetes import client

from sandman.contract import ANNOTATION_EGRESS_ALLOW, LABEL_EGRESS
from testbed import realnode, secondnode
from testbed.cluster import delete_namespace, new_namespace
from tests.e2e.helpers import assert_only_allowed, guard_rules, new_token, plain_pod, sandbox_pod
from tests.e2e.test_egress_svc_on_node import SVC_NS, _gone
from tests.e2e.test_sdk import bind_trainer, copy_ca, trainer_pod

FIRST, SECOND = realnode.NODE_NAME, secondnode.NAME
HOSTNAME = "kubernetes.io/hostname"
ALLOWED = f"svc/peer.{SVC_NS}:80/tcp"
# Two ports, one line each: which port of the peer was reached.
PEER_SERVER = ("import socket, threading, time\n"
               "def serve(port):\n"
               "    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
               "    s.bind(('0.0.0.0', port)); s.listen(8)\n"
               "    while True:\n"
               "        c, _ = s.accept(); c.sendall(b'peer %d\\n' % port); c.close()\n"
               "for p in (8080, 8081):\n"
               "    threading.Thread(target=serve, args=(p,), daemon=True).start()\n"
               "time.sleep(900)\n")


def _on(pod: dict, node: str) -> dict:
    pod["spec"].setdefault("nodeSelector", {})[HOSTNAME] = node
    return pod


@pytest.fixture(scope="module")
def second(e2e, figures):
    """The second node, joined untainted (the install lifted the first's taint too) after
    sandman's own pods are placed; removed after the module, asserting nothing is left."""
    if e2e.install_error:
        pytest.fail(f"helm install --wait failed: {e2e.install_error}", pytrace=False)
    sandman = e2e
    node = secondnode.SecondNode(sandman.cluster.testbed, tainted=False)
    t0 = time.monotonic()
    node.start()
    sandman.nodes[SECOND] = node
    figures.add(f"e2e second node: up in {time.monotonic() - t0:.1f}s (images imported "
                f"{node.timings.get('images', 0):.1f}s)")
    try:
        yield node
    finally:
        sandman.nodes.pop(SECOND, None)
        left = node.stop()
        assert left == [], f"the second node left: {left}"


# --- a guarded sandbox and its peer on the other node --------------------------------------

@pytest.fixture
def peer(sandman, second):
    """SVC_NS (the values' ceiling admits its Services) with a server pod on the second node
    behind Service `peer` (80 -> 8080, 81 -> 8081) and Service `other` (80 -> 8080)."""
    core = sandman.core
    delete_namespace(core, SVC_NS)
    assert _gone(core), f"namespace {SVC_NS} still terminating"
    try:
        new_namespace(core, SVC_NS)
        sandman.run_ready(SVC_NS, _on(plain_pod("peer", labels={"app": "peer"},
                                                command=["python3", "-c", PEER_SERVER]), SECOND))
        ips = {}
        for name, ports in (("peer", [(80, 8080), (81, 8081)]), ("other", [(80, 8080)])):
            ips[name] = core.create_namespaced_service(SVC_NS, {
                "apiVersion": "v1", "kind": "Service", "metadata": {"name": name},
                "spec": {"selector": {"app": "peer"},
                         "ports": [{"name": f"p{p}", "port": p, "targetPort": t,
                                    "protocol": "TCP"} for p, t in ports]}}).spec.cluster_ip
        ips["pod"] = sandman.ip(SVC_NS, "peer")
        yield ips
    finally:
        delete_namespace(core, SVC_NS)
        assert _gone(core), f"namespace {SVC_NS} not deleted"


def test_a_guarded_sandbox_reaches_its_peer_on_the_other_node_and_nothing_else(sandman, ns,
                                                                               peer, second):
    targets = {"allowed": (peer["peer"], 80), "service-other-port": (peer["peer"], 81),
               "other-service": (peer["other"], 80), "peer-pod-direct": (peer["pod"], 8080)}
    _token, sha = new_token()
    sandman.create(ns, _on(sandbox_pod("sbx", sha, labels={LABEL_EGRESS: "deny"},
                                       annotations={ANNOTATION_EGRESS_ALLOW: ALLOWED}), FIRST))
    sandman.run_ready(ns, _on(plain_pod("control"), FIRST))
    deadline = time.monotonic() + 30  # kube-proxy's rules for the new Services
    while True:
        control = {k: sandman.probe(ns, "control", "tcp", h, str(p)) for k, (h, p) in targets.items()}
        if all(p.ok for p in control.values()) or time.monotonic() > deadline:
            break
        time.sleep(1)
    pod = sandman.wait_ready(ns, "sbx")
    assert pod.spec.node_name == FIRST
    assert sandman.core.read_namespaced_pod("peer", SVC_NS).spec.node_name == SECOND
    got = {k: sandman.probe(ns, "sbx", "tcp", h, str(p)) for k, (h, p) in targets.items()}
    assert_only_allowed(control, got, ("service-other-port", "other-service", "peer-pod-direct"))
    assert got["allowed"].detail.startswith("peer 8080"), got["allowed"]
    rules = guard_rules(sandman, ns, pod, ALLOWED)
    assert f"-d {peer['peer']}/32 -p tcp -m tcp --dport 80" in rules, rules


# --- spread, and a node lost mid-trajectory -------------------------------------------------

N = 6
TRAINER = r"""
import json, os, sys, time
from concurrent.futures import ThreadPoolExecutor
from sandman.client import Client, SandboxGone

N = int(os.environ["N"])
out = {"errors": {}, "gone": {}, "problems": {}}
def emit(tag, obj):
    print(tag + " " + json.dumps(obj), flush=True)

with Client(timeout_s=60) as c:
    with ThreadPoolExecutor(N) as ex:
        sbs = list(ex.map(lambda _: c.acquire(image=os.environ["TASK_IMAGE"], job="e2e-two-nodes",
                                              cpu="200m", memory="128Mi", timeout_s=150), range(N)))
    for sb in sbs:
        sb.exec("echo step-1 > /tmp/progress", timeout=30)
    emit("E2E-STAGE1", {sb.pod: sb.id for sb in sbs})
    # The trajectory goes on, one step a second, until the test has killed a node and every
    # sandbox that failed is reported gone by the controller (bounded).
    live, failed, t0 = list(sbs), [], time.monotonic()
    while time.monotonic() - t0 < float(os.environ["BOUND_S"]):
        for sb in list(live):
            try:
                sb.exec("echo step >> /tmp/progress", timeout=20)
            except Exception as e:
                out["errors"][sb.pod] = [type(e).__name__, str(e), round(time.monotonic() - t0, 1)]
                live.remove(sb); failed.append(sb)
        for sb in list(failed):
            try:
                problem = c.get(sb.id).problem
                if problem and sb.pod not in out["problems"]:
                    out["problems"][sb.pod] = [problem, round(time.monotonic() - t0, 1)]
                    if len(out["problems"]) == len(out["errors"]):
                        emit("E2E-PROBLEMS", out["problems"])
            except SandboxGone as e:
                out["gone"][sb.pod] = [str(e), round(time.monotonic() - t0, 1)]
                failed.remove(sb)
        if out["errors"] and not failed:
            break
        time.sleep(1)
    out["healthy"] = [sb.exec("cat /tmp/progress | head -1", timeout=30).output.strip()
                      for sb in live]
    for sb in live:
        sb.release()
    # The controller's books: nothing of the job is left once the released pods are deleted.
    for _ in range(60):
        out["left"] = [[v.id, v.state] for v in c.list(job="e2e-two-nodes")]
        if not out["left"]:
            break
        time.sleep(1)
emit("E2E-RESULT", out)
"""


def _logs_line(sandman, ns: str, name: str, tag: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for ln in sandman.logs(ns, name).splitlines():
            if ln.startswith(tag + " "):
                return json.loads(ln[len(tag) + 1:])
        pod = sandman.core.read_namespaced_pod(name, ns)
        if pod.status.phase in ("Succeeded", "Failed"):
            break
        time.sleep(1)
    raise AssertionError(f"trainer never printed {tag}: {sandman.logs(ns, name)[-3000:]}\n"
                         f"{sandman.describe(ns, name)}")


def _node_ready(core, name: str) -> bool:
    node = core.read_node(name)
    return any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])


def test_spread_then_a_node_lost_mid_trajectory(sandman, ns, second, figures):
    """Last of the module. N sandboxes acquired at once spread over the two nodes (soft,
    maxSkew 2); the second node is then killed under the trainer: its next call on those
    sandboxes fails with one clear line, the controller's view names the NotReady node, and
    once the Node is deleted the controller reports them gone with that reason; the trainer's
    other sandboxes never notice, and nothing of the dead node's sandboxes is left."""
    core, sbx_ns = sandman.core, sandman.inst.sandbox_namespace
    url = sandman.inst.controller_url_in_cluster()
    bind_trainer(sandman.cluster.api_client, ns)
    copy_ca(sandman.cluster.api_client, sandman.inst, ns)
    sandman.create(ns, _on(trainer_pod("trainer", sandman.inst.image_ref, TRAINER, url,
                                       N=str(N), BOUND_S="240"), FIRST))
    stage1 = _logs_line(sandman, ns, "trainer", "E2E-STAGE1", 240)
    where = {pod: core.read_namespaced_pod(pod, sbx_ns).spec.node_name for pod in stage1}
    counts = {n: sum(1 for v in where.values() if v == n) for n in (FIRST, SECOND)}
    figures.add(f"e2e spread of {N} acquires over 2 real nodes: {counts}")
    assert sum(counts.values()) == N and all(counts.values()), where
    assert abs(counts[FIRST] - counts[SECOND]) <= 2, where  # maxSkew 2, ScheduleAnyway
    lost = sorted(p for p, n in where.items() if n == SECOND)

    t_kill = time.monotonic()
    second.kill()
    deadline = time.monotonic() + 150  # the node monitor's grace period, then its taint
    while _node_ready(core, SECOND) and time.monotonic() < deadline:
        time.sleep(2)
    assert not _node_ready(core, SECOND), "the killed node still Ready"
    not_ready_s = time.monotonic() - t_kill
    # The controller says so to the holder before the lease ends (the view's problem) ...
    problems = _logs_line(sandman, ns, "trainer", "E2E-PROBLEMS", 120)
    assert sorted(problems) == lost, problems
    for problem, _t in problems.values():
        assert f"node {SECOND} is not Ready" in problem and "\n" not in problem, problems
    # ... then the cluster gives the machine up: its Node is deleted, and the controller
    # ends those leases with that reason (pod GC would delete the pods too).
    second.delete_node()
    res = _logs_line(sandman, ns, "trainer", "E2E-RESULT", 300)
    figures.add(f"e2e node lost: NotReady after {not_ready_s:.0f}s; the trainer's next call "
                f"failed after {sorted(e[2] for e in res['errors'].values())}s "
                f"({sorted({e[0] for e in res['errors'].values()})}), the view's problem after "
                f"{sorted(p[1] for p in problems.values())}s, gone after "
                f"{sorted(g[1] for g in res['gone'].values())}s; e.g. "
                f"{next(iter(res['gone'].values()))[0]!r}")
    # Exactly the lost node's sandboxes failed, each with one line, and each was then
    # reported gone by the controller; the others went on to the end.
    assert sorted(res["errors"]) == lost, res
    for kind, message, _t in res["errors"].values():
        assert kind in ("SandboxUnreachable", "SandboxGone"), res["errors"]
        assert "\n" not in message and message, res["errors"]
    assert sorted(res["gone"]) == lost, res
    for message, _t in res["gone"].values():
        assert f"node {SECOND} was deleted" in message and "\n" not in message, res["gone"]
    assert res["left"] == [], res
    assert res["healthy"] == ["step-1"] * (N - len(lost)), res
    # Nothing left: no pod of the job, no pod bound to the deleted node.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        left = [p.metadata.name for p in core.list_namespaced_pod(
            sbx_ns, field_selector=f"spec.nodeName={SECOND}").items]
        left += [p.metadata.name for p in core.list_namespaced_pod(sbx_ns).items
                 if p.metadata.name in stage1 and p.metadata.name not in lost]
        if not left:
            break
        time.sleep(2)
    assert not left, left
    with pytest.raises(client.ApiException) as e:
        core.read_node(SECOND)
    assert e.value.status == 404
