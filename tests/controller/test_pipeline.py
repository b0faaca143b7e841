"""The books and the one owner pipeline against a deliberately lagging and failing fake `Kube`
(tests/controller/fakekube.py): pure logic, no API server. The ownership windows themselves are
tested on the real API server in test_windows.py."""

from __future__ import annotations

import asyncio
import time

import pytest

from controller.books import State
from controller.core import Controller
from controller.errors import AcquireTimeout, PodFailed
from controller.pacer import Limits
from controller.pods import AcquireOrder, SandboxSpec
from controller.settings import Settings
from sandman import contract
from tests.controller.fakekube import FakeKube

SPEC = SandboxSpec("registry.invalid/img:1", cpu="1", memory="1Gi")
MANAGED = f"{contract.LABEL_MANAGED_BY}={contract.MANAGED_BY_CONTROLLER}"


def run(body, *, lag: float = 0.0, start_s: float | None = 0.05, timeout: float = 30.0,
        limits: Limits | None = None):
    """`body(ctl, kube)` on a started controller; afterwards no refused transition."""
    async def main():
        kube = FakeKube(lag=lag, start_s=start_s)
        ctl = Controller(kube, Settings(namespace="ns", ready_check="pod", image_pinning="off", sweep_interval=3600,
                                        limits=limits or Limits(rate=100, burst=100)))
        await ctl.start()
        try:
            await asyncio.wait_for(body(ctl, kube), timeout)
        finally:
            await ctl.stop()
        assert ctl.books.illegal == 0, "a transition the table refuses was attempted"

    asyncio.run(main())


# A wait for the controller's next state, bounded by `run`'s timeout, not by a guess of its
# speed: CI runs on 2 busy cores beside other tiers, where 2 s was once not enough.
SETTLE_S = 25.0


async def until(pred, timeout: float, what: str, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(interval)


def stages(ctl: Controller) -> dict[State, int]:
    out: dict[State, int] = {}
    for e in ctl.books.entries.values():
        out[e.stage] = out.get(e.stage, 0) + 1
    return out


# ---- stale cache -> extra creates -------------------------------------------------------------
LAG = 1.5


def test_the_fake_reproduces_stale_cache_over_creation():
    """The bug class, on purpose: a filler that counts pods in the lagging list every 0.25 s
    creates far more than its target. (So the next test's bound is not vacuous.)"""
    async def main():
        kube = FakeKube(lag=LAG)
        target = 3
        t_end = time.monotonic() + 2.0
        n = 0
        while time.monotonic() < t_end:
            have = len(await kube.list_pods(MANAGED))
            for _ in range(target - have):
                n += 1
                await kube.create_pod({"metadata": {"name": f"naive-{n}", "labels": {
                    contract.LABEL_MANAGED_BY: contract.MANAGED_BY_CONTROLLER}}})
            await asyncio.sleep(0.25)
        return len(kube.created_names)

    assert asyncio.run(main()) > 3 * 3


@pytest.mark.slow
def test_stale_cache_never_creates_more_than_the_pool_target():
    """The pool counts its own books (warm + building + checking), never the cache: with the
    watch and the list LAG s behind, maintenance ticks and hand-outs create exactly target +
    one replacement per hand-out."""
    async def body(ctl: Controller, kube: FakeKube):
        ctl.prewarm(SPEC, 3, None)
        await asyncio.sleep(LAG + 1.2)  # a tick or two while the cache shows nothing
        assert kube.count("create") == 3
        await until(lambda: len(ctl.pools[SPEC].warm) == 3, LAG + 3, "3 warm pods")
        got = [await ctl.acquire(AcquireOrder(SPEC, "job-a", timeout_s=10)) for _ in range(2)]
        assert all(g["warm"] for g in got)
        await asyncio.sleep(LAG + 1.2)
        assert kube.count("create") == 5 and len(kube.pods) == 5
        await until(lambda: len(ctl.pools[SPEC].warm) == 3, LAG + 3, "the pool refilled")
        assert kube.count("create") == 5

    run(body, lag=LAG)


def test_acquires_under_a_lagging_watch_make_one_pod_each():
    async def body(ctl: Controller, kube: FakeKube):
        order = AcquireOrder(SPEC, "job-a", warm_ok=False, timeout_s=10)
        got = await asyncio.gather(*(ctl.acquire(order) for _ in range(10)))
        assert len({g["pod"] for g in got}) == 10
        assert len(kube.created_names) == 10 and kube.count("create") == 10
        assert stages(ctl) == {State.LEASED: 10}

    run(body, lag=0.5)


# ---- lost and ambiguous answers ---------------------------------------------------------------
@pytest.mark.parametrize("mode", ["lost", "504-stored"])
def test_a_create_whose_answer_is_lost_is_adopted_not_duplicated(mode):
    async def body(ctl: Controller, kube: FakeKube):
        kube.fault("create", mode)
        got = await ctl.acquire(AcquireOrder(SPEC, "job-a", timeout_s=10))
        assert kube.created_names == [got["pod"]], "a second pod was created"
        assert ("read", got["pod"]) in kube.calls, "no read-back by name"
        assert stages(ctl) == {State.LEASED: 1}

    run(body, lag=0.3)


def test_a_refused_create_500_is_retried_under_the_same_name():
    async def body(ctl: Controller, kube: FakeKube):
        kube.fault("create", "500", count=2)
        got = await ctl.acquire(AcquireOrder(SPEC, "job-a", timeout_s=10))
        assert kube.created_names == [got["pod"]]
        assert {n for m, n in kube.calls if m == "create"} == {got["pod"]}

    run(body)


@pytest.mark.parametrize(("mode", "deletes"), [("500", 2), ("lost", 1)])
def test_a_failed_delete_is_retried_until_gone(mode, deletes):
    """500: not applied, retried after 1 s. Lost answer: applied; the informer's DELETED event
    confirms it before the retry is due, and the books let go of it (window 20)."""
    async def body(ctl: Controller, kube: FakeKube):
        got = await ctl.acquire(AcquireOrder(SPEC, "job-a", timeout_s=10))
        kube.fault("delete", mode)
        assert await ctl.release(got["id"]) is True
        await until(lambda: not kube.pods and not ctl.books.entries, 5, "the retried delete")
        await asyncio.sleep(1.2)  # a retry would be due by now
        assert kube.count("delete") == deletes
        assert ctl.pacer.live == 0

    run(body, lag=0.2)


# ---- callers that leave, drains ---------------------------------------------------------------
def test_a_late_grading_pod_is_parked_and_reused():
    async def body(ctl: Controller, kube: FakeKube):
        with pytest.raises(AcquireTimeout):
            await ctl.acquire(AcquireOrder(SPEC, "job-a", timeout_s=0.2))
        await until(lambda: stages(ctl) == {State.PARKED: 1}, 5, "the late pod parked")
        name = next(iter(ctl.books.entries))
        await asyncio.sleep(1.2)  # a maintenance tick: a parked pod is not surplus
        got = await ctl.acquire(AcquireOrder(SPEC, "job-a", timeout_s=5))
        assert got["warm"] and got["pod"] == name
        assert len(kube.created_names) == 1

    run(body, start_s=0.6)


def test_a_late_rollout_pod_is_deleted_not_parked():
    async def body(ctl: Controller, kube: FakeKube):
        with pytest.raises(AcquireTimeout):
            await ctl.acquire(AcquireOrder(SPEC, "job-a", labels={"run": "r1"}, timeout_s=0.2))
        await until(lambda: not kube.pods and not ctl.books.entries, 5, "the late pod deleted")
        labels_patched = [n for m, n in kube.calls if m == "patch"]
        assert len(labels_patched) == 1  # the deleting label only: never parked nor leased

    run(body, start_s=0.6)


def test_a_caller_leaving_while_queued_withdraws_the_create():
    async def body(ctl: Controller, kube: FakeKube):
        first = asyncio.ensure_future(ctl.acquire(AcquireOrder(SPEC, "job-a", timeout_s=10)))
        second = asyncio.ensure_future(ctl.acquire(AcquireOrder(SPEC, "job-a", timeout_s=10)))
        await until(lambda: stages(ctl).get(State.QUEUED) == 1, 2, "the second queued")
        second.cancel()
        await first
        await until(lambda: stages(ctl) == {State.LEASED: 1}, 2, "the withdraw")
        assert len(kube.created_names) == 1 and ctl.pacer.live == 1

    run(body, limits=Limits(rate=1, burst=1))


@pytest.mark.parametrize("moves", ["after_the_drain", "with_the_drain"])
def test_drain_while_starting_deletes_once_the_pod_moves(moves):
    """A drained pod that waits for Ready is never handed out or parked: its owner deletes it
    once, at the pod's next event (here: Ready), and its caller gets PodFailed. The pod moves
    when the test says: after the drain answered (the drain alone deletes nothing), or with
    its Ready event already on its way when the drain comes, as under load a pod's event (its
    ADDED, or a wake-up the owner had not yet run) often was."""
    async def body(ctl: Controller, kube: FakeKube):
        call = asyncio.ensure_future(ctl.acquire(AcquireOrder(SPEC, "job-a", timeout_s=30)))
        await until(lambda: stages(ctl) == {State.STARTING: 1}, SETTLE_S, "the pod to be starting")
        (name,) = ctl.books.entries
        uid = kube.pods[name]["metadata"]["uid"]
        woken = ctl.books.waker(name)  # the owner's, while it waits for Ready
        # The owner has seen the pod's ADDED and run every wake-up: nothing moves the pod now.
        await until(lambda: name in ctl.books.pods and not woken.is_set(), SETTLE_S,
                    "the owner to wait for the pod's next event")
        if moves == "with_the_drain":
            kube.start(name)  # its event is delivered in the loop's next turn, after the drain
        assert await ctl.drain("job-a") == 1
        if moves == "after_the_drain":
            assert stages(ctl) == {State.STARTING_DRAINED: 1}, "deleted before the pod moved"
            assert await ctl.drain("job-a") == 0  # already going
            assert not kube.deletes
            kube.start(name)
        with pytest.raises(PodFailed, match="drain"):
            await call
        await until(lambda: not kube.pods and not ctl.books.entries, SETTLE_S,
                    "the drained pod gone")
        assert kube.deletes == [(name, uid)], "deleted other than once"
        assert [m for m, n in kube.calls if m == "patch"] == ["patch"], "labelled other than deleting"

    run(body, start_s=None)


def test_drain_while_the_create_is_in_flight_deletes_once_it_settles():
    async def body(ctl: Controller, kube: FakeKube):
        kube.fault("create", "hold")
        call = asyncio.ensure_future(ctl.acquire(AcquireOrder(SPEC, "job-a", timeout_s=30)))
        await until(lambda: stages(ctl) == {State.CREATING: 1}, 2, "the create in flight")
        await until(lambda: kube.count("create") == 1, 2, "the create at the API")
        assert await ctl.drain("job-a") == 1
        assert stages(ctl) == {State.CREATING_DRAINED: 1}
        kube.release_held()
        with pytest.raises(PodFailed, match="drain"):
            await call
        await until(lambda: not kube.pods and not ctl.books.entries, 3, "the drained pod gone")
        assert len(kube.created_names) == 1

    run(body)


def test_a_warm_hand_out_interrupted_mid_patch_is_deleted_not_stuck():
    """A caller cancelled during the hand-out patch leaves no entry CHECKING forever: the pod
    may already carry the caller's labels, so it is deleted."""
    async def body(ctl: Controller, kube: FakeKube):
        ctl.prewarm(SPEC, 1, None)
        await until(lambda: len(ctl.pools[SPEC].warm) == 1, 5, "a warm pod")
        name = ctl.pools[SPEC].warm[0].name
        ctl.prewarm(SPEC, 0, None)
        kube.fault("patch", "hold")
        call = asyncio.ensure_future(ctl.acquire(AcquireOrder(SPEC, "job-a", timeout_s=10)))
        await until(lambda: ctl.books.entries[name].stage is State.CHECKING, 2, "the check")
        await until(lambda: ("patch", name) in kube.calls, 2, "the hand-out patch")
        call.cancel()
        kube.release_held()
        with pytest.raises(asyncio.CancelledError):
            await call
        await until(lambda: name not in kube.pods and not ctl.books.entries, 5, "the delete")
        assert ctl.pools[SPEC].checking == 0 and ctl.pools[SPEC].warm == []

    run(body)
