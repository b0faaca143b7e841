"""The SDK against the real controller HTTP app (`controller.routes.build_app`, served by uvicorn
on 127.0.0.1), so the error shapes the SDK maps are the ones the controller really sends: a
standby's NotLeader, FastAPI's validation error as BadRequest, SandboxGone, and a 201 acquire
answer. The controller's Kubernetes side is replaced by a small stand-in object; end-to-end
tests against the whole controller and a cluster live with the controller's tests."""

from __future__ import annotations

import socket
import threading
import time
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import uvicorn

from controller import routes as api
from sandman import api as wire
from sandman.client.errors import BadRequest, controller_error

from .conftest import FAST_RETRY, LOOPBACK, Execd, Flavor


class StandIn:
    """What the API calls on the controller: acquire, get, release, `ready`."""

    idle = SimpleNamespace(paused={})  # the idle rule's record: nothing paused

    def __init__(self, ex: Execd) -> None:
        self.ex = ex
        self.ready = True
        self.leased: dict[str, dict[str, Any]] = {}
        self.acquires: list[dict[str, Any]] = []

    async def acquire(self, order: Any) -> dict[str, Any]:
        self.acquires.append({"image": order.spec.image, "cpu": order.spec.cpu,
                              "job": order.job, "labels": order.labels})
        sid = f"sb-{len(self.acquires)}"
        self.leased[sid] = {"job": order.job}
        return {"id": sid, "pod": f"pod-{sid}", "address": self.ex.address,
                "port": self.ex.port, "token": self.ex.token, "warm": True,
                "timings": {"queued_ms": 0.5, "create_ms": 0, "ready_ms": 2.0}}

    def get(self, sid: str) -> None:
        return None  # every lookup: no such sandbox

    def ended(self, sid: str) -> None:
        return None  # nor a lost one's reason

    async def release(self, sid: str) -> bool:
        return self.leased.pop(sid, None) is not None


@pytest.fixture
def real_api():
    state: dict[str, Any] = {}
    app = api.build_app(state)
    sock = socket.socket()
    sock.bind((LOOPBACK, 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    t = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while not srv.started and time.monotonic() < deadline and t.is_alive():
        time.sleep(0.02)
    assert srv.started, "uvicorn did not start"
    try:
        yield f"http://{LOOPBACK}:{port}", state
    finally:
        srv.should_exit = True
        t.join(10)
        sock.close()


def test_standby_and_validation_errors(flavor: Flavor, real_api) -> None:
    url, _ = real_api
    from sandman.client import NotLeader, Owner

    async def body():
        async with flavor.client(url) as client:
            with pytest.raises(NotLeader) as ei:  # retried FAST_RETRY.attempts times first
                await client.acquire("img", job="j")
            assert ei.value.status == 503
            with pytest.raises(BadRequest) as ei:  # the contract's check, before sending
                await client.acquire("img", job="j", timeout_s=0)
            assert ei.value.status is None and "timeout_s" in ei.value.message
            with pytest.raises(NotLeader):
                await client.release("sb-x")
            # Every body the SDK sends passes the real API's validation (extra fields are
            # refused there): a standby answers NotLeader only after validating it.
            with pytest.raises(NotLeader):
                await client.acquire("img", job="j", cpu=1, memory="1Gi", egress="allow",
                                     workspace="/w", owner=Owner("p", "u"), labels={"k": "v"},
                                     timeout_s=5, warm_ok=False, wait=False, lifetime_s=30)
            with pytest.raises(NotLeader):
                await client.renew("sb-x", 60)
            with pytest.raises(NotLeader):
                await client.prewarm("img", 2, cpu="500m", idle_timeout_s=30)
            with pytest.raises(NotLeader):
                await client.drain("j")

    t0 = time.monotonic()
    flavor.run(body)
    assert time.monotonic() - t0 < 3 * (FAST_RETRY.budget_s + 1)
    # The same body sent anyway: the server's validation answers the error the SDK maps.
    r = httpx.post(url + wire.ACQUIRE.path, json={"image": "img", "job": "j", "timeout_s": 0})
    err = controller_error(r.status_code, r.json())
    assert isinstance(err, BadRequest) and err.status == 422, r.text
    assert err.message == "timeout_s: must be > 0 and <= 3600"
    r = httpx.post(url + wire.ACQUIRE.path, json={"image": "img", "job": "j", "cpu": True})
    err = controller_error(r.status_code, r.json())
    assert isinstance(err, BadRequest) and err.message.startswith("cpu: "), r.text


def test_acquire_exec_release_through_the_real_app(flavor: Flavor, real_api,
                                                   execd: Execd) -> None:
    url, state = real_api
    ctl = state["controller"] = StandIn(execd)
    from sandman.client import SandboxGone

    async def body():
        async with flavor.client(url) as client:
            async with await client.acquire("img:3", job="j", cpu=1, labels={"a": "b"}) as sb:
                assert sb.id == "sb-1" and sb.warm is True and sb.timings.ready_ms == 2.0
                assert (await sb.exec("echo via-real-api")).output == "via-real-api\n"
            assert ctl.leased == {}
            with pytest.raises(SandboxGone):
                await client.get("sb-1")

    flavor.run(body)
    assert ctl.acquires[0]["cpu"] == "1" and ctl.acquires[0]["labels"] == {"a": "b"}
