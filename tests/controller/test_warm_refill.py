"""A hand-out's refill waits for its pool's other hand-outs in flight (controller/warmpool.py
`refill`): in a burst, the refills' creates would otherwise meet the hand-outs' patches at the
API server. The burst's figures are make bench-warmburst's; this pins the rule."""

import asyncio

from controller import warmpool as W


def _pool_and_calls(monkeypatch, checking: int):
    wp = W.WarmPool.__new__(W.WarmPool)
    calls: list[str] = []
    pool = W.Pool(target=4, checking=checking)
    wp.fill = lambda spec: calls.append(spec)  # type: ignore[method-assign]
    wp.spawn = lambda coro, name: asyncio.get_running_loop().create_task(coro)
    return wp, pool, calls


def test_a_lone_hand_out_refills_at_once(monkeypatch):
    async def run():
        wp, pool, calls = _pool_and_calls(monkeypatch, 0)
        wp.refill("key", pool)
        assert calls == ["key"]
    asyncio.run(run())


def test_in_a_burst_one_refill_waits_until_the_hand_outs_are_done(monkeypatch):
    async def run():
        wp, pool, calls = _pool_and_calls(monkeypatch, 3)
        for _ in range(3):
            wp.refill("key", pool)
        await asyncio.sleep(0.1)
        assert calls == [] and pool.refill_waiting
        pool.checking = 0
        await asyncio.sleep(0.1)
        assert calls == ["key"] and not pool.refill_waiting  # one fill tops the pool up
    asyncio.run(run())


def test_a_refill_never_waits_past_its_bound(monkeypatch):
    monkeypatch.setattr(W, "REFILL_DEFER_S", 0.1)

    async def run():
        wp, pool, calls = _pool_and_calls(monkeypatch, 5)  # hand-outs that never end
        wp.refill("key", pool)
        await asyncio.sleep(0.3)
        assert calls == ["key"]
    asyncio.run(run())
