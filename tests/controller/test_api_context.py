"""The controller's HTTP layer around every call (controller/routes.py RequestContext), without
a cluster: the app served in-process over httpx's ASGI transport, with a stand-in for the
controller the routes call. Per-route metrics are labelled by route template, so no caller
can add series; every line logged while serving a call carries its request id and the ids the
call names. The same on a real controller process against the test bed:
tests/controller/test_controller.py::test_json_logs_one_object_per_line."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import random
import string
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client import REGISTRY

from controller import metrics
from controller.routes import REQUEST_ID_HEADER, build_app
from sandman import api, logs

HTTP = "sandman_controller_http_requests_total"


class StandIn:
    """What the acquire and get routes call on the controller; its acquire logs as the real
    one's hand-out does, from the task the route started."""

    idle = SimpleNamespace(paused={})  # the idle rule's record: nothing paused

    ready = True
    entries: dict = {}

    def __init__(self) -> None:
        self.n = 0

    async def acquire(self, order):
        self.n += 1
        await asyncio.sleep(0.01 * random.random())  # interleave concurrent calls
        logging.getLogger("controller.pipeline").info("handed out sb-%d", self.n)
        return {"id": f"sb-{self.n}", "pod": f"sb-{self.n}", "address": "10.0.0.1",
                "port": 9470, "token": "t", "warm": False, "timings": {}}

    def get(self, sid):
        return None

    def ended(self, sid):
        return None  # no lost sandbox's reason (controller/lost.py)

    async def release(self, sid):
        return False


def series() -> dict[tuple[str, ...], float]:
    return {(s.labels["route"], s.labels["method"], s.labels["code"]): s.value
            for fam in REGISTRY.collect() if fam.name + "_total" == HTTP
            for s in fam.samples if s.name == HTTP}


def client() -> httpx.AsyncClient:
    app = build_app({"controller": StandIn()})
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False), base_url="http://ctl")


def word(rng: random.Random, n: int = 12) -> str:
    return "".join(rng.choice(string.ascii_lowercase + string.digits) for _ in range(n))


def test_unknown_paths_and_methods_add_no_series():
    """An attacker's 400 calls to made-up paths, ids and methods: the raw paths and methods
    never become label values; what they add is at most the `unmatched` and `other` series."""
    rng = random.Random(7)

    async def run() -> tuple[dict, dict]:
        async with client() as c:
            await c.get("/v1/sandboxes/warmup")
            before = series()
            for i in range(400):
                method = rng.choice(["GET", "POST", "DELETE", word(rng, 6).upper()])
                path = rng.choice([f"/v1/sandboxes/{word(rng)}", f"/{word(rng)}",
                                   f"/v1/sandboxes/{word(rng)}/{word(rng)}",
                                   f"/v1/{word(rng)}/drain?x={word(rng)}", f"/{'a/' * i}"])
                await c.request(method, path)
            return before, series()

    before, after = asyncio.run(run())
    new = set(after) - set(before)
    allowed = set(metrics.ROUTE_TEMPLATES)
    assert all(r in allowed for r, _, _ in after), "a raw path became a route label"
    assert all(m in metrics.METHODS + ("other",) for _, m, _ in after)
    assert all(code in metrics.CODES for _, _, code in after)
    # Each made-up call lands in one of few series: a template or `unmatched`, by a known
    # method or `other`, by status.
    assert len(new) <= 16, sorted(new)
    assert any(r == "unmatched" for r, _, _ in new)
    assert any(m == "other" for _, m, _ in new)


def test_matched_calls_are_counted_under_their_template():
    async def run() -> tuple[dict, dict]:
        async with client() as c:
            before = series()
            for sid in ("sb-a", "sb-b", "sb-c"):
                assert (await c.get(api.GET.url(id=sid))).status_code == 404
            assert (await c.get(api.LIVEZ.path)).status_code == 200
            return before, series()

    before, after = asyncio.run(run())
    key = (api.GET.path, "GET", "404")
    assert after[key] - before.get(key, 0) == 3
    live = (api.LIVEZ.path, "GET", "200")
    assert after[live] - before.get(live, 0) == 1
    hist = REGISTRY.get_sample_value("sandman_controller_http_request_duration_seconds_count",
                                     {"route": api.GET.path, "method": "GET"})
    assert hist is not None and hist >= 3


@pytest.mark.parametrize("given", ["a b", 'x"}, "sandbox": "forged', "z" * 65, "",
                                   "\xe9".encode("latin-1")])
def test_a_request_id_that_is_not_a_plain_short_token_is_replaced(given):
    async def run() -> httpx.Response:
        async with client() as c:
            return await c.get(api.LIVEZ.path, headers={REQUEST_ID_HEADER: given})

    got = asyncio.run(run()).headers[REQUEST_ID_HEADER]
    assert got != (given.decode("latin-1") if isinstance(given, bytes) else given)
    assert len(got) == 16 and all(ch in string.hexdigits for ch in got)


def test_a_plain_request_id_is_kept_and_answered():
    async def run() -> httpx.Response:
        async with client() as c:
            return await c.get(api.LIVEZ.path, headers={REQUEST_ID_HEADER: "trainer-7:step.12"})

    assert asyncio.run(run()).headers[REQUEST_ID_HEADER] == "trainer-7:step.12"


@pytest.fixture
def json_logs():
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    buf = io.StringIO()
    logs.configure("INFO", "json")
    root.handlers[0].setStream(buf)
    yield buf
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])


def test_concurrent_calls_lines_carry_their_own_ids(json_logs):
    """20 acquires at once, each of its own job: the line each one's task logged carries that
    call's request id and job, never another call's (the ids are per task, not global)."""
    async def run() -> list[httpx.Response]:
        async with client() as c:
            return list(await asyncio.gather(*(
                c.post(api.ACQUIRE.path, json={"image": "python:3.11-slim", "job": f"job-{i}"},
                       headers={REQUEST_ID_HEADER: f"req-{i}"}) for i in range(20))))

    answers = asyncio.run(run())
    assert all(r.status_code == 201 for r in answers), [r.text for r in answers]
    lines = [json.loads(ln) for ln in json_logs.getvalue().splitlines()]
    handed = [x for x in lines if x["message"].startswith("handed out")]
    assert len(handed) == 20
    for i in range(20):
        mine = [x for x in handed if x.get("request_id") == f"req-{i}"]
        assert len(mine) == 1 and mine[0]["job"] == f"job-{i}", mine
    # Outside a call nothing is bound.
    assert logs.bound() == {}
