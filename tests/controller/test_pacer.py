"""The pacer's logic on its own (real event loop and clock, small numbers). The same rules are
proven end to end on the test bed in test_controller.py."""

from __future__ import annotations

import asyncio
import time

import pytest

from controller.pacer import Limits, Pacer, QueueFull


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
