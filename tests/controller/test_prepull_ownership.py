"""Whose puller is it: the pre-pull reads, adopts and deletes only pods it created. Pure logic
and the in-memory Kube (tests/controller/fakekube.py; the create's timing is the point); on the
kwok bed's real API server: test_prepull_stop_on_testbed.py.

- a pod met under a puller's name is adopted only when it is this create's own (its command is
  drawn per create and unknown to anyone until the create stores it): another controller's
  puller, an earlier leader's or a planted copy is a squatter, never believed;
- the sweep deletes an untracked labelled pod only when it is a puller as written (it runs no
  program) and, under a books key, carries the controller's proof;
- stopping cancels the pullers and deletes, by name and uid, every pod they created, a create
  still in flight at the stop included; a pod of that name it did not create is left alone."""

from __future__ import annotations

import asyncio
import copy

from controller import prepull as PP
from controller.create import proof
from controller.pacer import Limits, Pacer
from controller.settings import Settings
from sandman import contract
from tests.controller.fakekube import FakeKube

IMAGE = f"registry.example/swe/task@sha256:{'ef' * 32}"
NODE = "node-1"
KEY = b"k" * 32


def prepuller(key: bytes | None = None, kube=None, pacer=None) -> PP.Prepuller:
    return PP.Prepuller(kube, pacer, Settings(namespace="sbx", books_key=key))


def stored(body: dict, uid: str = "u-1") -> dict:
    pod = copy.deepcopy(body)
    pod["metadata"]["uid"] = uid
    return pod


def test_only_this_create_s_own_pod_is_adopted():
    p = prepuller()
    body = p.body(IMAGE, NODE)
    assert PP.adoptable(stored(body), body)
    # A puller as written by another draw: an earlier leader's, another release's, or a
    # tenant's copy of one. It was not this create's: its status is not the controller's word.
    other = p.body(IMAGE, NODE)
    assert not PP.adoptable(stored(other), body)


def test_the_sweep_deletes_only_pullers_as_written():
    p = prepuller()
    puller = stored(p.body(IMAGE, NODE))
    assert PP.sweepable(puller, None, "sbx")
    # A tenant's labelled pod that runs something: not the controller's to delete.
    runs = copy.deepcopy(puller)
    runs["spec"]["containers"][0]["command"] = ["sleep", "3600"]
    assert not PP.sweepable(runs, None, "sbx")
    sibling = copy.deepcopy(puller)
    sibling["spec"]["containers"].append({"name": "a", "image": "registry.invalid/a:1"})
    assert not PP.sweepable(sibling, None, "sbx")
    init = copy.deepcopy(puller)
    init["spec"]["initContainers"] = [{"name": "a", "image": "registry.invalid/a:1"}]
    assert not PP.sweepable(init, None, "sbx")
    unlabelled = copy.deepcopy(puller)
    unlabelled["metadata"]["labels"] = {}
    assert not PP.sweepable(unlabelled, None, "sbx")


def test_under_a_books_key_the_sweep_needs_the_controller_s_proof():
    p = prepuller(KEY)
    body = p.body(IMAGE, NODE)
    nonce = body["metadata"]["labels"][contract.LABEL_NONCE]
    assert body["metadata"]["annotations"][contract.ANNOTATION_PROOF] == proof(
        KEY, "sbx", body["metadata"]["name"], nonce)
    assert PP.sweepable(stored(body), KEY, "sbx")
    # A puller as written without the proof (a tenant's copy, another release's puller).
    assert not PP.sweepable(stored(prepuller().body(IMAGE, NODE)), KEY, "sbx")
    assert not PP.sweepable(stored(prepuller(b"o" * 32).body(IMAGE, NODE)), KEY, "sbx")
    # A real puller's proof copied onto another name proves nothing.
    moved = stored(body)
    moved["metadata"]["name"] = PP.puller_name(IMAGE, "node-2")
    assert not PP.sweepable(moved, KEY, "sbx")


def one_node_kube(create_s: float = 0.0) -> FakeKube:
    """The API server with one Ready node and no kubelet (a puller stays Pending)."""
    k = FakeKube(start_s=None, api_s=0.0, create_s=create_s)
    k.nodes = [{"metadata": {"name": NODE}, "spec": {},
                "status": {"conditions": [{"type": "Ready", "status": "True"}]}}]
    return k


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


async def started(kube: FakeKube) -> tuple[PP.Prepuller, Pacer, asyncio.Task]:
    pacer = Pacer(Limits(rate=1000, burst=1000))
    pacer.start()
    # Under a books key: a squatter shaped like a puller is not the sweep's either.
    p = prepuller(KEY, kube=kube, pacer=pacer)
    p.add([IMAGE])
    return p, pacer, asyncio.get_running_loop().create_task(p.run())


def test_stop_deletes_a_puller_being_watched():
    async def main():
        kube = one_node_kube()
        p, pacer, task = await started(kube)
        name = PP.puller_name(IMAGE, NODE)
        for _ in range(200):
            if name in kube.pods:
                break
            await asyncio.sleep(0.01)
        uid = kube.pods[name]["metadata"]["uid"]
        await p.stop()
        assert task.done()
        await pacer.stop()
        return kube, uid

    kube, uid = run(main())
    assert kube.pods == {}
    assert (PP.puller_name(IMAGE, NODE), uid) in kube.deletes


def test_stop_deletes_the_pod_of_a_create_still_in_flight():
    """The create's call outlives the cancelled puller (the client's thread goes on): the pod
    it stores is deleted by its uid, not left for the next leader."""
    async def main():
        kube = one_node_kube(create_s=0.5)
        p, pacer, task = await started(kube)
        for _ in range(500):  # the create is in flight (stored only in 0.5 s)
            if kube.count("create"):
                break
            await asyncio.sleep(0.01)
        await p.stop()
        await pacer.stop()
        return kube

    kube = run(main())
    assert kube.pods == {}
    [(name, uid)] = kube.deletes
    assert name == PP.puller_name(IMAGE, NODE) and [uid] == kube.created_uids


def test_stop_never_deletes_a_pod_it_did_not_create():
    async def main():
        kube = one_node_kube()
        # Another controller's puller, as written, under the name: a squatter here.
        kube.put(stored(prepuller().body(IMAGE, NODE), "theirs"))
        p, pacer, task = await started(kube)
        for _ in range(200):
            per = p.images[IMAGE]
            if per.get(NODE) and per[NODE].state != PP.PENDING:
                break
            await asyncio.sleep(0.01)
        st = p.images[IMAGE][NODE]
        await p.stop()
        await pacer.stop()
        return kube, st

    kube, st = run(main())
    assert st.state == PP.FAILED and "did not create" in st.reason, st
    assert kube.pods[PP.puller_name(IMAGE, NODE)]["metadata"]["uid"] == "theirs"
    assert all(uid != "theirs" for _, uid in kube.deletes)


def test_a_leftover_being_deleted_gives_up_its_name():
    """An earlier leader's puller being deleted (a deletionTimestamp) is waited out, not
    reported as a squatter: its name is free again shortly."""
    async def main():
        kube = one_node_kube()
        name = PP.puller_name(IMAGE, NODE)
        going = stored(prepuller().body(IMAGE, NODE), "old")
        going["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        kube.put(going)
        asyncio.get_running_loop().call_later(0.3, kube.remove, name)
        p, pacer, task = await started(kube)
        for _ in range(300):
            if kube.pods.get(name, going)["metadata"]["uid"] != "old":
                break
            await asyncio.sleep(0.01)
        st = p.images[IMAGE][NODE]
        mine = kube.pods[name]["metadata"]["uid"]
        await p.stop()
        await pacer.stop()
        return kube, st, mine

    kube, st, mine = run(main())
    assert st.state == PP.PENDING, st
    assert mine != "old" and kube.pods == {}
