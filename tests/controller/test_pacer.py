"""The pacer's logic on its own (real event loop and clock, small numbers). The same rules are
proven end to end on the test bed in test_controller.py."""

from __future__ import annotations

import asyncio
import time

import pytest

from controller.auth import tenant_of
from controller.pacer import GRADING_RUN, Limits, Pacer, QueueFull


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


def test_burst_then_rate():
    async def main():
        p = Pacer(Limits(rate=20, burst=5, max_creating=1000, max_live=1000))
        p.start()
        t0 = time.monotonic()
        times = []
        for s in await asyncio.gather(*(p.acquire("a") for _ in range(25))):
            times.append(time.monotonic() - t0)
            s.gone()
        await p.stop()
        return max(times)

    # 5 at once, then 20 more at 20/s: about 1 s; never faster than the bucket allows.
    assert 0.9 <= run(main()) < 2.5


def test_caps_hold_and_release():
    async def main():
        p = Pacer(Limits(rate=1000, burst=1000, max_creating=3, max_live=5))
        p.start()
        slots = [await p.acquire("a") for _ in range(3)]
        waiting = asyncio.ensure_future(p.acquire("a"))
        await asyncio.sleep(0.05)
        assert not waiting.done(), "a 4th concurrent create went around max_creating"
        slots[0].done_creating()
        s4 = await asyncio.wait_for(waiting, 1)
        slots[1].done_creating()
        s5 = await p.acquire("a")
        assert p.live == 5
        blocked = asyncio.ensure_future(p.acquire("a"))
        await asyncio.sleep(0.05)
        assert not blocked.done(), "a 6th pod went around max_live"
        s5.gone()
        await asyncio.wait_for(blocked, 1)
        for s in slots + [s4]:
            s.gone()
        await p.stop()

    run(main())


def test_fair_round_robin_between_jobs():
    async def main():
        p = Pacer(Limits(rate=50, burst=1, max_creating=10000, max_live=10000))
        p.start()
        order: list[str] = []

        async def one(job):
            s = await p.acquire(job)
            order.append(job)
            s.gone()

        big = [asyncio.ensure_future(one("A")) for _ in range(100)]
        await asyncio.sleep(0.1)
        small = [asyncio.ensure_future(one("B")) for _ in range(5)]
        await asyncio.gather(*small)
        done_a = len(order) - 5
        for t in big:
            t.cancel()
        await asyncio.gather(*big, return_exceptions=True)
        await p.stop()
        return done_a

    # B's 5 were interleaved with A's queue, not served after A's 100.
    assert run(main()) < 20


def test_cancel_withdraws_and_wait_false_fails_fast():
    async def main():
        p = Pacer(Limits(rate=1, burst=1, max_creating=100, max_live=100))
        p.start()
        s = await p.acquire("a")
        t = asyncio.ensure_future(p.acquire("a"))
        await asyncio.sleep(0.01)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert p.live == 1 and p.creating == 1, "a withdrawn wait must not hold a slot"
        with pytest.raises(QueueFull, match="rate"):
            await p.acquire("a", wait=False)
        s.gone()
        await p.stop()

    run(main())


def test_slow_down_halves_and_recovers():
    p = Pacer(Limits(rate=40, burst=1))
    p.slow_down()
    assert p.rate == 20
    p.slow_down()
    assert p.rate == 10
    p._backoff_until = 0
    p._last -= 20  # 20 s of quiet
    p._refill()
    assert p.rate == 40


def test_bad_limits_rejected():
    with pytest.raises(ValueError):
        Limits(rate=0)
    with pytest.raises(ValueError):
        Limits(max_live=0)


# --- tenants and roles ------------------------------------------------------------------------

def _grant_order(p: Pacer, waiters: list[tuple[str, str]], n: int) -> list[tuple[str, str]]:
    """Queue `waiters` ((job, role) each, in that order) on a stopped pacer, then start it with
    one create at a time (max_creating 1): the order of the first `n` grants, each handed back
    at once. The rest are withdrawn."""
    async def main():
        order: list[tuple[str, str]] = []
        done = asyncio.Event()

        async def one(job, role):
            s = await p.acquire(job, role=role)
            order.append((job, role))
            s.gone()
            if len(order) >= n:
                done.set()

        tasks = [asyncio.ensure_future(one(j, r)) for j, r in waiters]
        await asyncio.sleep(0)  # every waiter queued before the first grant
        p.start()
        await asyncio.wait_for(done.wait(), 20)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await p.stop()
        assert p.live == 0 and p.creating == 0 and p.queue_depth() == {}
        return order[:n]

    return run(main())


def _fast(**kw) -> Pacer:
    return Pacer(Limits(rate=10000, burst=10000, max_creating=1, max_live=100000, **kw),
                 tenant_of=tenant_of)


def test_a_tenant_gets_no_more_for_spreading_its_acquires_over_many_jobs():
    # Tenant a: 500 acquires over 50 job names, queued first; tenant b: 20 after them.
    a = [(f"a.job{i % 50}", "agent") for i in range(500)]
    b = [("b.eval", "agent")] * 20
    order = _grant_order(_fast(), a + b, 40)
    # A fair two-way split: b's 20 within the first 40 grants (a per-job round robin gave b
    # 1 slot in 51).
    assert sum(1 for job, _ in order if job.startswith("b.")) == 20, order


def test_tenant_weights_set_the_shares():
    a = [("a.x", "agent")] * 100
    b = [("b.y", "agent")] * 100
    order = _grant_order(_fast(tenant_weights={"b": 3}), a + b, 40)
    assert sum(1 for job, _ in order if job.startswith("b.")) == 30, order


def test_a_grading_acquire_goes_before_queued_rollouts_and_rollouts_still_move():
    rollouts = [(f"t.roll{i % 8}", "agent") for i in range(200)]
    order = _grant_order(_fast(), rollouts + [("t.grade", "grading")], 1)
    assert order == [("t.grade", "grading")]
    # A grading flood: rollouts keep 1 grant in GRADING_RUN + 1.
    grading = [("t.grade", "grading")] * 100
    order = _grant_order(_fast(), rollouts + grading, 50)
    roles = [r for _, r in order]
    assert roles.count("agent") == 50 // (GRADING_RUN + 1), roles
    for i in range(0, 50, GRADING_RUN + 1):
        assert roles[i:i + GRADING_RUN + 1].count("agent") == 1, roles


def test_a_tenant_at_its_cap_waits_without_holding_up_the_others():
    async def main():
        p = Pacer(Limits(rate=10000, burst=10000, max_creating=100, max_live=100,
                         tenant_max_live=2), tenant_of=tenant_of)
        p.start()
        held = [await p.acquire("a.x"), await p.acquire("a.y")]
        third = asyncio.ensure_future(p.acquire("a.z"))
        other = await asyncio.wait_for(p.acquire("b.x"), 2)  # b is not held up behind a
        await asyncio.sleep(0.05)
        assert not third.done(), "a third live pod of tenant a went around tenant_max_live"
        with pytest.raises(QueueFull, match="tenant a at its live-pod cap"):
            await p.acquire("a.w", wait=False)
        assert p.tenant_queues()["a"]["queued"] == {"agent": 1}
        held[0].gone()
        (await asyncio.wait_for(third, 2)).gone()
        for s in (held[1], other):
            s.gone()
        assert p.tenant_live == {"a": 0, "b": 0}
        await p.stop()

    run(main())


def test_bad_tenant_limits_rejected():
    for bad in ({"a": 0}, {"a": 1.5}, {"a": True}):
        with pytest.raises(ValueError, match="tenant weight"):
            Limits(tenant_weights=bad)
    with pytest.raises(ValueError):
        Limits(tenant_max_live=-1)
    with pytest.raises(ValueError, match="role"):
        run(_fast().acquire("a.x", role="superuser"))


def test_tenant_flags_reach_the_pacer_and_bad_ones_say_why():
    from controller.__main__ import parse_args, settings_from, tenant_weights

    args = parse_args(["serve", "--namespace", "sbx", "--tenant-max-live", "500",
                       "--tenant-max-creating", "50", "--tenant-weight", "rl-team=3",
                       "--tenant-weight", "eval=1"])
    lim = settings_from(args).limits
    assert (lim.tenant_max_live, lim.tenant_max_creating) == (500, 50)
    assert lim.tenant_weights == {"rl-team": 3, "eval": 1}
    for bad in ("rl-team", "rl-team=0", "rl-team=x", "Bad_NS=2", "=2"):
        with pytest.raises(ValueError, match="expected NAMESPACE=N") as e:
            tenant_weights([bad])
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="given twice"):
        tenant_weights(["a=1", "a=2"])
