"""Lost sandboxes, the logic (controller/lost.py): the reasons a leased pod's end is given, the
bounded record of them, and the node check on fakes. The behaviour on the real control plane:
test_lost_on_testbed.py."""

from __future__ import annotations

import asyncio

from controller import lost as L
from controller import metrics
from controller.books import Books, Entry, State
from controller.pods import SandboxSpec

NODE = "n1"


def _pod(name: str = "sbx-a", *, ready: bool = True, node: str | None = NODE, **status) -> dict:
    st = {"phase": "Running", "conditions": [{"type": "Ready",
                                              "status": "True" if ready else "False"}]}
    st.update(status)
    spec: dict = {"containers": [{"name": "sandbox", "image": "img"}]}
    if node:
        spec["nodeName"] = node
    return {"metadata": {"name": name, "uid": f"u-{name}"}, "spec": spec, "status": st}


def _node(status: str, reason: str = "NodeStatusUnknown",
          message: str = "Kubelet stopped posting node status.") -> dict:
    return {"metadata": {"name": NODE}, "status": {"conditions": [
        {"type": "Ready", "status": status, "reason": reason, "message": message,
         "lastTransitionTime": "2026-12-07T18:20:01Z"}]}}


def test_the_metric_reasons_are_the_module_reasons():
    assert L.LOST_REASONS == metrics.LOST_REASONS


def test_one_line_is_one_bounded_printable_line():
    text = L.one_line("a\nb\r\n\tc\x1b[31m" + "x" * 1000)
    assert "\n" not in text and "\r" not in text and "\x1b" not in text
    assert text.startswith("a b c?[31m") and len(text) == L.REASON_MAX


def test_the_record_is_bounded_in_number_and_time():
    now = [1000.0]
    rec = L.LostRecord(keep_s=60, keep_max=3, clock=lambda: now[0])
    for i in range(5):
        rec.add(f"s{i}", "job", L.Ending("deleted", f"why {i}"))
    assert len(rec) == 3 and rec.get("s0") is None and rec.get("s4").ending.why == "why 4"
    now[0] += 61
    assert rec.get("s4") is None and len(rec) == 0


def test_a_plain_delete_says_so():
    e = L.deleted_while_leased(_pod(), None)
    assert e.kind == "deleted" and "deleted while leased" in e.why


def test_kube_deleters_give_their_reason():
    gc = _pod(phase="Failed", conditions=[{"type": "DisruptionTarget", "status": "True",
                                           "reason": "DeletionByPodGC",
                                           "message": "PodGC: node no longer exists"}])
    e = L.deleted_while_leased(gc, None)
    assert e.kind == "node_lost"
    assert e.why == ("its pod was deleted while leased on node n1 (DeletionByPodGC: PodGC: "
                     "node no longer exists)")
    evicted = _pod(conditions=[{"type": "DisruptionTarget", "status": "True",
                                "reason": "EvictionByEvictionAPI",
                                "message": "Eviction API: evicting"}])
    assert L.deleted_while_leased(evicted, None).kind == "evicted"
    kubelet = _pod(phase="Failed", reason="Evicted", message="The node was low on resource: "
                                                             "memory.")
    e = L.ended_while_leased(kubelet, None)
    assert e.kind == "evicted" and "Evicted: The node was low on resource: memory." in e.why
    assert L.ended_while_leased(_pod(phase="Failed"), None) == L.Ending(
        "failed", "its pod ended while leased (phase Failed)")


def test_a_down_node_names_itself_in_the_reason():
    st = L.read_state(_node("Unknown"), None, 5.0)
    e = L.deleted_while_leased(_pod(), st)
    assert e.kind == "node_lost"
    assert e.why == ("its pod was deleted while leased (node n1 is not Ready (Unknown) since "
                     "2026-12-07T18:20:01Z: NodeStatusUnknown: Kubelet stopped posting node "
                     "status.)")
    assert L.read_state(None, None, 5.0).words(NODE) == "node n1 was deleted"


def test_hostile_a_holder_written_termination_message_is_never_a_reason():
    """The holder's processes write their container's termination message (and exit codes):
    a pod whose sandbox container says "node n2 lost" is still a plain deleted pod."""
    forged = _pod(phase="Failed", containerStatuses=[{"name": "sandbox", "state": {
        "terminated": {"exitCode": 1, "reason": "Error",
                       "message": "DeletionByPodGC: node n2 was deleted"}}}])
    for e in (L.deleted_while_leased(forged, None), L.ended_while_leased(forged, None)):
        assert "n2" not in e.why and e.kind != "node_lost"


def _books(*pods: dict) -> Books:
    b = Books()
    for p in pods:
        name = p["metadata"]["name"]
        b.add(Entry(name, SandboxSpec("img"), "job", "nonce", "tok", uid=p["metadata"]["uid"],
                    _stage=State.LEASED))
        b.pods[name] = p
    return b


def _nodes(books: Books, node: dict | None, lost_after: float = 120.0):
    now = [100.0]
    ended: list[tuple[str, L.Ending]] = []
    reads: list[str] = []

    async def read(name: str):
        reads.append(name)
        return node

    def end(e: Entry, ending: L.Ending) -> None:
        ended.append((e.id, ending))
        books.move(e, State.DELETING, "lost")

    n = L.Nodes(books, read, end, lost_after, clock=lambda: now[0])
    return n, now, ended, reads


def test_a_not_ready_node_shows_then_ends_its_leases_after_the_bound():
    b = _books(_pod("sbx-a", ready=False), _pod("sbx-b", ready=False))
    n, now, ended, _ = _nodes(b, _node("Unknown"))
    assert asyncio.run(n.check()) == 0
    problem = n.problem(b.entries["sbx-a"])
    assert problem is not None and problem.startswith("node n1 is not Ready (Unknown) since "
                                                      "2026-12-07T18:20:01Z")
    assert "ends the lease in 120s" in problem
    now[0] += 119
    assert asyncio.run(n.check()) == 0
    now[0] += 1
    assert asyncio.run(n.check()) == 2
    assert {sid for sid, _ in ended} == {"sbx-a", "sbx-b"}
    assert all(e.kind == "node_lost" and "after 120s" in e.why for _, e in ended)


def test_a_deleted_node_ends_its_leases_at_once_even_with_the_bound_off():
    b = _books(_pod(ready=False))
    n, _, ended, _ = _nodes(b, None, lost_after=0)
    assert asyncio.run(n.check()) == 1
    assert ended[0][1].why == "its node was lost (node n1 was deleted)"


def test_a_node_that_recovers_is_forgotten():
    b = _books(_pod(ready=False))
    n, now, ended, _ = _nodes(b, _node("Unknown"))
    asyncio.run(n.check())
    b.pods["sbx-a"] = _pod(ready=True)
    now[0] += 500
    assert asyncio.run(n.check()) == 0 and not ended and n.states == {}


def test_hostile_a_pod_made_not_ready_never_ends_a_lease():
    """The holder can fail its pod's readiness (kill execd, fill its disk). That makes the
    controller read the pod's Node, nothing more: the Node says Ready, so neither its lease
    nor its neighbour's on the same node ends, however long, and no problem is shown."""
    b = _books(_pod("sbx-a", ready=False), _pod("sbx-b", ready=True))
    n, now, ended, reads = _nodes(b, _node("True", "KubeletReady", "kubelet is posting"))
    for _ in range(3):
        asyncio.run(n.check())
        now[0] += 1000
    assert reads == [NODE] * 3 and not ended
    assert n.problem(b.entries["sbx-a"]) is None and n.problem(b.entries["sbx-b"]) is None


def test_only_nodes_of_leased_not_ready_pods_are_read_and_bounded():
    pods = [_pod(f"sbx-{i}", ready=False, node=f"n{i}") for i in range(5)]
    b = _books(*pods, _pod("sbx-ok", node="healthy"))
    n, _, _, reads = _nodes(b, _node("True"))
    n.max_reads = 3
    asyncio.run(n.check())
    assert len(reads) == 3 and "healthy" not in reads
    asyncio.run(n.check())  # the least recently read next
    assert set(reads) == {f"n{i}" for i in range(5)}
