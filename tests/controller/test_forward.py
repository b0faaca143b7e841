"""Readiness and forwarding of the controller's HTTP app, without a cluster: two real uvicorn
servers on 127.0.0.1 (a "leader" with a stand-in controller, a "standby" wrapped in
ForwardToLeader). The same behaviour against the test bed with two real controller processes
is tests/controller/test_controller.py::test_standby_is_ready_and_serves_through_the_leader."""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
import time
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import uvicorn

from controller.forward import LEADER_HEADER, ForwardToLeader
from controller.routes import build_app
from controller.tls import PeerCA, ServingTLS
from sandman import logs
from webhook import certs as C

LOOPBACK = "127.0.0.1"


class StandIn:
    """What the routes call on the controller."""

    idle = SimpleNamespace(paused={})  # the idle rule's record: nothing paused

    def __init__(self) -> None:
        self.ready = True
        self.entries: dict[str, Any] = {}
        self.cancelled = threading.Event()
        self.block = False
        self.n = 0
        self.fields: list[dict[str, str]] = []  # the log fields bound in each acquire

    async def acquire(self, order):
        self.n += 1
        self.fields.append(logs.bound())
        if self.block:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        return {"id": f"sb-{self.n}", "pod": f"p-{self.n}", "address": "10.0.0.1",
                "port": 9470, "token": "t", "warm": False, "timings": {}}

    def get(self, sid):
        return None

    def ended(self, sid):
        return None  # no lost sandbox's reason

    async def release(self, sid):
        return sid == "sb-1"


class Elector:
    """The parts of LeaderElector that /readyz and the forwarder read."""

    def __init__(self, identity: str, is_leader: bool = False, connected: bool = True):
        self.identity, self.is_leader, self._connected = identity, is_leader, connected
        self.duration = 4.0
        self.holder: str | None = None
        self.leader_url: str | None = None

    def connected(self) -> bool:
        return self._connected


def _serve(app, tls: ssl.SSLContext | None = None
           ) -> tuple[str, uvicorn.Server, threading.Thread, socket.socket]:
    sock = socket.socket()
    sock.bind((LOOPBACK, 0))
    srv = uvicorn.Server(uvicorn.Config(
        app, log_level="warning", lifespan="off",
        **({"ssl_context_factory": lambda _c, _d: tls} if tls else {})))
    t = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert srv.started
    scheme = "https" if tls else "http"
    return f"{scheme}://{LOOPBACK}:{sock.getsockname()[1]}", srv, t, sock


def _replica(identity: str, elector: Elector, controller: StandIn | None, **tls):
    state: dict[str, Any] = {"elector": elector}
    if controller is not None:
        state["controller"] = controller

    def serving():
        c = state.get("controller")
        return c is not None and c.ready

    def target():
        if elector.is_leader or not elector.connected() or not elector.leader_url:
            return None
        return elector.holder, elector.leader_url

    return ForwardToLeader(build_app(state), serving, target, identity=identity, **tls), state


@pytest.fixture
def pair():
    ctl = StandIn()
    lead_el = Elector("leader-1", is_leader=True)
    leader, _ = _replica("leader-1", lead_el, ctl)
    stand_el = Elector("standby-1")
    standby, _ = _replica("standby-1", stand_el, None)
    servers = [_serve(leader), _serve(standby)]
    stand_el.holder, stand_el.leader_url = "leader-1", servers[0][0]
    try:
        yield servers[0][0], servers[1][0], ctl, stand_el
    finally:
        for _url, srv, t, sock in servers:
            srv.should_exit = True
            t.join(10)
            sock.close()


def test_both_replicas_ready_and_liveness_never_depends_on_the_api(pair):
    leader, standby, ctl, el = pair
    assert httpx.get(leader + "/readyz").json() == {"ok": True, "role": "leader"}
    r = httpx.get(standby + "/readyz")
    assert r.status_code == 200 and r.json()["role"] == "standby"
    el._connected = False  # the standby lost the API server: it cannot tell who leads
    assert httpx.get(standby + "/readyz").status_code == 503
    assert httpx.get(standby + "/livez").status_code == 200
    assert httpx.get(standby + "/healthz").status_code == 200
    ctl.ready = False  # elected, informer not synced yet: cannot serve
    assert httpx.get(leader + "/readyz").status_code == 503


def test_standby_forwards_api_calls_and_the_answers_come_back_unchanged(pair):
    leader, standby, ctl, _ = pair
    r = httpx.post(standby + "/v1/sandboxes", json={"image": "i", "job": "j"})
    assert r.status_code == 201 and r.json()["id"] == "sb-1" and ctl.n == 1
    assert httpx.delete(standby + "/v1/sandboxes/sb-1").json() == {
        "id": "sb-1", "released": True, "reused": False}
    gone = httpx.get(standby + "/v1/sandboxes/sb-9")
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "SandboxGone"
    bad = httpx.post(standby + "/v1/sandboxes", json={"image": "i"})
    assert bad.status_code == 422 and bad.json()["error"]["type"] == "BadRequest"
    listed = httpx.get(standby + "/v1/sandboxes", params={"job": "j"})
    assert listed.status_code == 200 and listed.json() == {"items": []}


def test_a_forwarded_call_keeps_its_request_id_on_the_leader(pair):
    """The caller's X-Request-Id goes through the standby: the leader's lines about the call
    carry it as `request_id` and the answer brings it back. Without one, the answer carries the
    id the leader made, the one its lines carry."""
    leader, standby, ctl, _ = pair
    r = httpx.post(standby + "/v1/sandboxes", json={"image": "i", "job": "j"},
                   headers={"x-request-id": "trace-77"})
    assert r.status_code == 201 and r.headers["x-request-id"] == "trace-77"
    assert ctl.fields[-1]["request_id"] == "trace-77"
    r = httpx.post(standby + "/v1/sandboxes", json={"image": "i", "job": "j"})
    assert r.status_code == 201 and ctl.fields[-1]["request_id"] == r.headers["x-request-id"]
    assert r.headers.get_list("x-request-id") == [r.headers["x-request-id"]]


def test_a_call_forwarded_to_a_replica_that_is_not_the_holder_is_refused(pair):
    leader, standby, ctl, _ = pair
    # A stale view: the standby means a holder the receiving replica is not.
    r = httpx.post(leader + "/v1/sandboxes", json={"image": "i", "job": "j"},
                   headers={LEADER_HEADER: "leader-0"})
    assert r.status_code == 503 and r.json()["error"]["type"] == "NotLeader"
    assert r.headers["connection"] == "close" and ctl.n == 0
    # Sent to a standby with the header: never forwarded again (no loops).
    r = httpx.post(standby + "/v1/sandboxes", json={"image": "i", "job": "j"},
                   headers={LEADER_HEADER: "leader-1"})
    assert r.status_code == 503 and ctl.n == 0


def test_no_leader_to_forward_to_answers_not_leader_and_closes_the_connection(pair):
    _leader, standby, ctl, el = pair
    el.leader_url = None  # failover: nobody holds the lease
    r = httpx.post(standby + "/v1/sandboxes", json={"image": "i", "job": "j"})
    assert r.status_code == 503 and r.json()["error"]["type"] == "NotLeader"
    assert r.headers["connection"] == "close" and r.headers["retry-after"] == "1"
    dead = socket.socket()
    dead.bind((LOOPBACK, 0))  # bound, never listening: connection refused
    el.leader_url = f"http://{LOOPBACK}:{dead.getsockname()[1]}"
    t0 = time.monotonic()
    r = httpx.post(standby + "/v1/sandboxes", json={"image": "i", "job": "j"})
    dead.close()
    assert r.status_code == 503 and r.json()["error"]["type"] == "NotLeader"
    assert r.headers["connection"] == "close" and time.monotonic() - t0 < 3
    assert ctl.n == 0


def test_a_caller_leaving_the_standby_cancels_the_acquire_on_the_leader(pair):
    _leader, standby, ctl, _ = pair
    ctl.block = True
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(standby + "/v1/sandboxes", json={"image": "i", "job": "j"}, timeout=1.0)
    assert ctl.cancelled.wait(5), "the leader never learnt that the caller left"


# ---- over TLS: the leader serves the chart's kind of certificate (the Service's DNS name
# only; the standby reaches it by IP), the standby verifies it or forwards nothing.

SVC = "sandman-controller.sandman-system.svc"


@pytest.fixture(scope="module")
def leader_tls(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    ca = C.new_ca("test-ca")
    cert, key = C.new_serving(ca[0], ca[1], [SVC])
    (d / "tls.crt").write_bytes(cert)
    (d / "tls.key").write_bytes(key)
    (d / "ca.crt").write_bytes(ca[0])
    other = C.new_ca("another-ca")
    (d / "other.crt").write_bytes(other[0])
    return d


@pytest.mark.parametrize("case", [pytest.param("verified", marks=pytest.mark.slow), "unknown CA",
                                  "other name", "plain http leader"])
def test_standby_forwards_only_to_a_verified_https_leader(leader_tls, case):
    ctl = StandIn()
    leader, _ = _replica("leader-1", Elector("leader-1", is_leader=True), ctl)
    tls = None if case == "plain http leader" else ServingTLS(str(leader_tls / "tls.crt"),
                                                              str(leader_tls / "tls.key"))
    ca = leader_tls / ("other.crt" if case == "unknown CA" else "ca.crt")
    el = Elector("standby-1")
    standby, _ = _replica("standby-1", el, None, verify=PeerCA(str(ca)).context,
                          server_name="wrong.example" if case == "other name" else SVC,
                          require_https=True)
    servers = [_serve(leader, tls.context if tls else None), _serve(standby)]
    el.holder, el.leader_url = "leader-1", servers[0][0]
    try:
        r = httpx.post(servers[1][0] + "/v1/sandboxes", json={"image": "i", "job": "j"})
        if case == "verified":
            assert r.status_code == 201 and r.json()["id"] == "sb-1" and ctl.n == 1, r.text
        else:  # nothing reached the leader: the caller retries (NotLeader), never in clear
            assert r.status_code == 503 and r.json()["error"]["type"] == "NotLeader", r.text
            assert ctl.n == 0
    finally:
        for _url, srv, t, sock in servers:
            srv.should_exit = True
            t.join(10)
            sock.close()
