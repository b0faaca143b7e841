"""The group acquire's request model and both SDK twins against a scripted controller: the
body sent, the answer read, the members released together, a short answer refused."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from sandman import api
from sandman.client import AsyncClient, BadRequest, Client, ProtocolError


def controller(answer_count: int | None = None):
    seen: list[tuple[str, str, dict]] = []

    def handler(req: httpx.Request) -> httpx.Response:
        body = json.loads(req.content) if req.content else {}
        seen.append((req.method, req.url.path, body))
        if req.url.path == api.GROUP.path:
            n = body["count"] if answer_count is None else answer_count
            return httpx.Response(201, json={"sandboxes": [
                {"id": f"s{i}", "pod": f"p{i}", "address": "127.0.0.1", "port": 1,
                 "token": "t", "warm": i == 0} for i in range(n)]})
        if req.method == "DELETE":
            return httpx.Response(200, json={"id": req.url.path.rsplit("/", 1)[1],
                                             "released": True})
        return httpx.Response(404, json={"error": {"type": "SandboxGone", "message": "no",
                                                   "events": []}})
    return httpx.MockTransport(handler), seen


@pytest.mark.parametrize("count", [0, 257, True, 2.5, None])
def test_count_is_bounded_and_required(count):
    with pytest.raises(ValueError, match="count: must be an integer 1 to 256"):
        api.GroupRequest(image="img", job="j", count=count)


def test_the_body_is_an_acquire_s_and_count():
    body = api.GroupRequest(image="img", job="j", count=3, cpu="1").to_json()
    assert body["count"] == 3 and body["cpu"] == "1" and body["job"] == "j"


def test_sync_group_sends_one_call_and_releases_every_member_on_exit():
    transport, seen = controller()
    with Client("http://ctl", transport=transport) as cl:
        with cl.acquire_group("img", 3, job="grpo", cpu=1, memory="1Gi", renew=False) as g:
            assert [sb.id for sb in g] == ["s0", "s1", "s2"] and g[0].warm and not g[1].warm
        assert all(sb.released for sb in g)
    method, path, body = seen[0]
    assert (method, path, body["count"], body["cpu"], body["job"]) == (
        "POST", api.GROUP.path, 3, "1", "grpo")
    assert body["request_id"]
    assert [p for m, p, _ in seen[1:] if m == "DELETE"] == [
        api.RELEASE.url(id=f"s{i}") for i in range(3)]


def test_a_bad_count_is_refused_before_anything_is_sent():
    transport, seen = controller()
    with Client("http://ctl", transport=transport) as cl:
        with pytest.raises(BadRequest, match="count"):
            cl.acquire_group("img", 0, job="grpo")
    assert seen == []


def test_an_answer_with_fewer_members_is_a_protocol_error():
    transport, _ = controller(answer_count=1)
    with Client("http://ctl", transport=transport) as cl:
        with pytest.raises(ProtocolError, match="asked for 2"):
            cl.acquire_group("img", 2, job="grpo", renew=False)


def test_async_group_releases_every_member_on_exit():
    transport, seen = controller()

    async def run() -> None:
        async with AsyncClient("http://ctl", transport=transport) as cl:
            async with cl.acquire_group("img", 2, job="grpo", renew=False) as g:
                assert len(g) == 2
            assert all(sb.released for sb in g)

    asyncio.run(run())
    assert sum(m == "DELETE" for m, _, _ in seen) == 2
