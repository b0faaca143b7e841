"""The SDK's side of checked reuse against the fake controller: what goes on the wire.
(The real controller and execd: tests/controller/test_reuse_on_testbed.py.)"""

from __future__ import annotations

import pytest

from sandman.client import BadRequest

from .conftest import FakeController, Flavor


def test_grading_acquire_release_with_reuse_and_retire(flavor: Flavor,
                                                       controller: FakeController) -> None:
    async def body():
        async with flavor.client(controller.url) as client:
            g = await client.acquire("img:1", job="grade", role="grading")
            assert await g.release(reuse=True) is True
            assert g.reused is True
            assert await g.release(reuse=True) is False  # idempotent, nothing sent again
            a = await client.acquire("img:1", job="agent")
            assert await a.release() is True and a.reused is False
            r = await client.acquire("img:1", job="grade", role="grading")
            assert await r.retire() is True and r.released
            assert await r.retire() is False
            assert await client.release(r.id, reuse=True) is False  # already gone

    flavor.run(body)
    posts = [sent for _, path, sent in controller.calls("POST") if path == "/v1/sandboxes"]
    assert [p["role"] for p in posts] == ["grading", "agent", "grading"]
    deletes = [path for _, path, _ in controller.calls("DELETE")]
    assert deletes[0].endswith("?reuse=true") and "?" not in deletes[1]
    retires = [path for _, path, _ in controller.calls("POST") if path.endswith("/retire")]
    assert len(retires) == 1


def test_bad_role_is_refused_before_sending(flavor: Flavor, controller: FakeController) -> None:
    async def body():
        async with flavor.client(controller.url) as client:
            with pytest.raises((BadRequest, ValueError), match="role"):
                await client.acquire("img:1", job="j", role="judge")

    flavor.run(body)
    assert controller.calls("POST") == []
