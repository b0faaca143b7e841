"""controller/requests.py: a whole call keyed by the caller's request_id. Pure logic; the bed
tests (test_group_on_testbed.py, test_controller.py -k request_id) drive it through the API."""

from __future__ import annotations

import asyncio

import pytest

from controller.errors import BadRequest, QueueFullError
from controller.requests import Requests


def run(coro):
    return asyncio.run(coro)


def test_a_retry_while_the_first_attempt_runs_gets_its_answer_and_runs_nothing():
    async def go():
        r, calls = Requests(), []
        gate = asyncio.Event()

        async def work(tag):
            calls.append(tag)
            await gate.wait()
            return {"id": tag}

        first = asyncio.ensure_future(r.once("fork", "s", "j:1", 2, lambda: work("a"),
                                             lambda _: True))
        await asyncio.sleep(0)
        retry = asyncio.ensure_future(r.once("fork", "s", "j:1", 2, lambda: work("b"),
                                             lambda _: True))
        await asyncio.sleep(0)
        gate.set()
        assert await first == await retry == {"id": "a"}
        assert calls == ["a"]
    run(go())


def test_a_retry_after_the_first_caller_left_starts_anew_and_shares_nothing():
    async def go():
        r, calls = Requests(), []

        async def slow(tag):
            calls.append(tag)
            await asyncio.sleep(10)
            return tag

        async def quick(tag):
            calls.append(tag)
            return tag

        first = asyncio.ensure_future(r.once("group", "j", "j:1", 3, lambda: slow("a"),
                                             lambda _: True))
        await asyncio.sleep(0)
        retry = asyncio.ensure_future(r.once("group", "j", "j:1", 3, lambda: quick("b"),
                                             lambda _: True))
        await asyncio.sleep(0)
        first.cancel()
        assert await retry == "b"
        assert calls == ["a", "b"]
    run(go())


def test_an_answer_is_reused_only_while_alive():
    async def go():
        r, n = Requests(), []

        async def work():
            n.append(1)
            return len(n)

        alive = {1: True}
        assert await r.once("acquire", "j", "j:1", "spec", work, lambda a: alive.get(a, False)) == 1
        assert await r.once("acquire", "j", "j:1", "spec", work, lambda a: alive.get(a, False)) == 1
        alive[1] = False  # released since: a retry acquires anew
        assert await r.once("acquire", "j", "j:1", "spec", work, lambda a: alive.get(a, False)) == 2
    run(go())


def test_the_same_request_id_with_other_arguments_is_refused_in_one_line():
    async def go():
        r = Requests()

        async def work():
            return "x"

        await r.once("fork", "s", "j:7", 2, work, lambda _: True)
        with pytest.raises(BadRequest) as ex:
            await r.once("fork", "s", "j:7", 3, work, lambda _: True)
        assert "\n" not in str(ex.value) and "'7'" in str(ex.value)
        # Another call, scope or id is another key.
        assert await r.once("group", "s", "j:7", 3, work, lambda _: True) == "x"
        assert await r.once("fork", "t", "j:7", 3, work, lambda _: True) == "x"
    run(go())


def test_a_refusal_is_the_retrys_answer_too_and_then_forgotten():
    async def go():
        r, n = Requests(), []
        gate = asyncio.Event()

        async def refused():
            n.append(1)
            await gate.wait()
            raise QueueFullError("queue full")

        first = asyncio.ensure_future(r.once("acquire", "j", "j:1", 0, refused, lambda _: True))
        await asyncio.sleep(0)
        retry = asyncio.ensure_future(r.once("acquire", "j", "j:1", 0, refused, lambda _: True))
        await asyncio.sleep(0)
        gate.set()
        for f in (first, retry):
            with pytest.raises(QueueFullError):
                await f
        assert n == [1] and len(r) == 0
    run(go())


def test_keys_are_bounded():
    async def go():
        r = Requests(max_keys=3)

        async def work():
            return 1

        for i in range(10):
            await r.once("acquire", "j", f"j:{i}", 0, work, lambda _: True)
        assert len(r) == 3
    run(go())
