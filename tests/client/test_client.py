"""The SDK's controller half (acquire, release, get, list; error mapping; retries that cannot
create a second sandbox), against a stand-in controller on real HTTP that hands out a real
execd. Each test runs through both twins (`flavor`)."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from sandman.client import (
    AcquireTimeout,
    AsyncClient,
    BadRequest,
    ControllerError,
    ControllerUnreachable,
    NotLeader,
    Owner,
    PodFailed,
    QueueFull,
    SandboxGone,
    SandmanError,
    Unauthorized,
)
from testbed.procs import refused_port

from .conftest import FAST_RETRY, CutProxy, Execd, FakeController, Flavor


def test_acquire_sends_the_documented_body_and_release_on_exit(flavor: Flavor,
                                                               controller: FakeController,
                                                               caplog) -> None:
    caplog.set_level(logging.DEBUG)

    async def body():
        async with flavor.client(controller.url) as client:
            async with await client.acquire("img:1", job="job-a") as sb:
                assert sb.id in controller.sandboxes
                assert sb.pod == f"pod-{sb.id}" and sb.warm is False
                assert sb.timings.ready_ms == 30.25
                assert (await sb.exec("echo in-sandbox")).output == "in-sandbox\n"
                assert controller.target.token not in repr(sb)
                sid = sb.id
            assert sid not in controller.sandboxes  # released on leaving the block
            assert len(controller.calls("DELETE")) == 1
            with pytest.raises(SandboxGone):
                await sb.exec("true")

    flavor.run(body)
    (_, _, sent), = controller.calls("POST")
    assert sent == {"image": "img:1", "cpu": "2", "memory": "8Gi", "workspace": None,
                    "egress": "deny", "job": "job-a", "owner": None, "labels": {},
                    "timeout_s": 300, "warm_ok": True, "wait": True,
                    "request_id": sent["request_id"], "lifetime_s": None, "namespace": None,
                    "role": "agent", "conditions": None, "reused_ok": False}
    assert controller.target.token not in caplog.text


def test_acquire_options_and_list(flavor: Flavor, controller: FakeController) -> None:
    async def body():
        async with flavor.client(controller.url) as client:
            a = await client.acquire("img:2", job="j1", cpu=4, memory="16Gi", egress="allow",
                                     workspace="/testbed", owner=Owner("trainer-0", "u-1"),
                                     labels={"task": "t1"}, timeout_s=60, warm_ok=False,
                                     wait=False, lifetime_s=600,
                                     conditions={"cpu_quota": 4, "tz": "UTC"})
            b = await client.acquire("img:2", job="j2")
            assert [s.id for s in await client.list(job="j1")] == [a.id]
            assert {s.id for s in await client.list()} == {a.id, b.id}
            info = await client.get(a.id)
            assert (info.id, info.job, info.state, info.port) == (a.id, "j1", "leased",
                                                                  a.port)
            assert await client.release(a.id) is True
            assert await client.release(a.id) is False  # idempotent
            with pytest.raises(SandboxGone):
                await client.get(a.id)
        # Leaving the client released b, which nobody released by hand.
        assert controller.sandboxes == {}

    flavor.run(body)
    sent = controller.calls("POST")[0][2]
    assert sent == {"image": "img:2", "cpu": "4", "memory": "16Gi", "workspace": "/testbed",
                    "egress": "allow", "job": "j1", "owner": {"name": "trainer-0", "uid": "u-1"},
                    "labels": {"task": "t1"}, "timeout_s": 60, "warm_ok": False, "wait": False,
                    "request_id": sent["request_id"], "lifetime_s": 600, "namespace": None,
                    "role": "agent",
                    "conditions": {"egress": None, "cpu_quota": 4, "visible_cpus": None,
                                   "memory_limit": None, "user": None, "tz": "UTC",
                                   "hash_seed": None, "time_limit_s": None},
                    "reused_ok": False}
    # Each acquire has its own request_id (one per logical call, shared by its retries).
    assert len({c[2]["request_id"] for c in controller.calls("POST")}) == 2


def test_with_sandbox_releases_on_exception(flavor: Flavor, controller: FakeController) -> None:
    async def body():
        async with flavor.client(controller.url) as client:
            with pytest.raises(KeyError):
                async with await client.acquire("img", job="j") as sb:
                    await sb.exec("true")
                    raise KeyError("agent crashed")
            assert controller.sandboxes == {}
            assert sb.released

    flavor.run(body)


@pytest.mark.parametrize("status,typ,cls", [
    (504, "AcquireTimeout", AcquireTimeout),
    (429, "QueueFull", QueueFull),
    (400, "BadRequest", BadRequest),
    (422, "BadRequest", BadRequest),
    (502, "PodFailed", PodFailed),
    (500, "SomethingNew", ControllerError),
])
def test_controller_errors_are_typed(flavor: Flavor, controller: FakeController, status: int,
                                     typ: str, cls: type) -> None:
    events = ["Warning Failed: ErrImagePull", "Warning BackOff: Back-off pulling image"]
    controller.answers.append((status, {"error": {"type": typ, "message": f"said {typ}",
                                                  "events": events}}))

    async def body():
        async with flavor.client(controller.url) as client:
            with pytest.raises(cls) as ei:
                await client.acquire("img", job="j")
            return ei.value

    err = flavor.run(body)
    assert type(err) is cls and err.status == status and err.type == typ
    assert err.events == events and "said" in str(err)
    assert len(controller.calls("POST")) == 1  # none of these is retried
    if cls is AcquireTimeout:
        assert isinstance(err, TimeoutError)


def test_error_without_the_documented_body_maps_by_status(flavor: Flavor,
                                                          controller: FakeController) -> None:
    controller.answers.append((504, "gateway timeout (from a proxy, not JSON of ours)"))

    async def body():
        async with flavor.client(controller.url) as client:
            with pytest.raises(AcquireTimeout):
                await client.acquire("img", job="j")

    flavor.run(body)


def test_not_leader_is_retried(flavor: Flavor, controller: FakeController) -> None:
    not_leader = (503, {"error": {"type": "NotLeader", "message": "standby", "events": []}})
    controller.answers += [not_leader, not_leader]

    async def body():
        async with flavor.client(controller.url) as client:
            sb = await client.acquire("img", job="j")
            assert (await sb.exec("true")).ok
            controller.answers += [not_leader] * FAST_RETRY.attempts
            with pytest.raises(NotLeader):
                await client.acquire("img", job="j")

    flavor.run(body)
    assert len(controller.calls("POST")) == 3 + FAST_RETRY.attempts


def test_acquire_with_a_lost_answer_is_retried_and_gets_the_same_sandbox(
        flavor: Flavor, controller: FakeController) -> None:
    """The controller got the acquire but its answer was lost: the retry carries the same
    request_id, so it gets the first attempt's sandbox and no second one exists."""
    proxy = CutProxy(controller.port)
    proxy.plan.append(("before_answer", "/v1/sandboxes"))
    try:
        async def body():
            async with flavor.client(f"http://127.0.0.1:{proxy.port}") as client:
                sb = await client.acquire("img", job="lost")
                assert [s.id for s in await client.list(job="lost")] == [sb.id]
                assert (await sb.exec("echo once")).output == "once\n"
                assert await client.release(sb.id) is True

        flavor.run(body)
    finally:
        proxy.close()
    posts = controller.calls("POST")
    assert len(posts) == 2, "the lost answer's acquire was not retried"
    assert posts[0][2]["request_id"] == posts[1][2]["request_id"]
    assert len(posts[0][2]["request_id"]) >= 16
    assert controller.sandboxes == {}


def test_unreachable_controller_is_bounded(flavor: Flavor) -> None:
    with refused_port() as dead:  # held: nothing listens there meanwhile
        _unreachable_is_bounded(flavor, f"http://127.0.0.1:{dead}")


def _unreachable_is_bounded(flavor: Flavor, url: str) -> None:
    async def body():
        async with flavor.client(url) as client:
            t0 = time.monotonic()
            with pytest.raises(ControllerUnreachable) as ei:
                await client.acquire("img", job="j", timeout_s=1)
            assert time.monotonic() - t0 < 1 + 30 + FAST_RETRY.budget_s
            assert "after 4 attempts" in str(ei.value)

    flavor.run(body)


def test_sandbox_gone_when_the_controller_deleted_it(flavor: Flavor,
                                                     controller: FakeController,
                                                     fresh_execd: Execd) -> None:
    controller.target = fresh_execd

    async def body():
        async with flavor.client(controller.url) as client:
            sb = await client.acquire("img", job="j")
            assert (await sb.exec("true")).ok
            controller.sandboxes.pop(sb.id)  # deleted behind our back (drain, sweep...)
            fresh_execd.stop()  # and its pod is gone
            with pytest.raises(SandboxGone):
                await sb.exec("true")
            with pytest.raises(SandboxGone):  # known now: not even sent
                await sb.read("/etc/hostname")

    flavor.run(body)


def test_reused_pod_address_is_gone_not_unauthorized(flavor: Flavor,
                                                     controller: FakeController,
                                                     execd: Execd) -> None:
    """Another sandbox's execd answers at our pod's old address: its 401 means our sandbox
    is gone once the controller confirms it; while the controller still has the sandbox, it
    is a real Unauthorized."""

    controller.token = "not-" + execd.token  # as if another sandbox now had the address

    async def body():
        async with flavor.client(controller.url) as client:
            sb = await client.acquire("img", job="j")
            with pytest.raises(Unauthorized):
                await sb.exec("true")
            controller.sandboxes.pop(sb.id)
            with pytest.raises(SandboxGone):
                await sb.exec("true")

    flavor.run(body)


def test_cancelled_acquire_still_releases_its_sandbox(controller: FakeController) -> None:
    """asyncio only. The caller gives up while the controller is still creating: the
    acquire runs on and the sandbox it gets is released, not orphaned (the paper's
    cancelled-create leak)."""
    controller.acquire_delay_s = 0.5

    async def body():
        async with AsyncClient(controller.url, retry=FAST_RETRY) as client:
            caller = asyncio.ensure_future(client.acquire("img", job="cancelled"))
            await asyncio.sleep(0.1)
            caller.cancel()
            with pytest.raises(asyncio.CancelledError):
                await caller
            deadline = time.monotonic() + 5
            while not controller.calls("DELETE") and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert len(controller.calls("DELETE")) == 1
            assert controller.sandboxes == {}

    asyncio.run(asyncio.wait_for(body(), 20))
    assert len(controller.calls("POST")) == 1


def test_bad_arguments_are_refused_before_sending(flavor: Flavor,
                                                  controller: FakeController) -> None:
    async def body():
        async with flavor.client(controller.url) as client:
            with pytest.raises(BadRequest):
                await client.acquire("img", job="j", egress="maybe")
            with pytest.raises(BadRequest):
                await client.acquire("img", job="")
            with pytest.raises(SandmanError):
                await client.get("")

    flavor.run(body)
    assert controller.requests == []


def test_prewarm_and_drain(flavor: Flavor, controller: FakeController) -> None:
    async def body():
        async with flavor.client(controller.url) as client:
            pool = await client.prewarm("img:4", 3, cpu=1, idle_timeout_s=60)
            assert (pool.target, pool.building) == (3, 3)
            a = await client.acquire("img:4", job="ending")
            b = await client.acquire("img:4", job="ending")
            keep = await client.acquire("img:4", job="other")
            assert await client.drain("ending") == 2
            for sb in (a, b):
                with pytest.raises(SandboxGone):  # known gone: not even sent
                    await sb.exec("true")
            assert (await keep.exec("true")).ok
            assert set(controller.sandboxes) == {keep.id}

    flavor.run(body)
    (_, _, sent), = controller.calls("POST", "/v1/prewarm")
    assert sent == {"image": "img:4", "count": 3, "idle_timeout_s": 60,
                    "spec": {"cpu": "1", "memory": "8Gi", "workspace": None, "egress": "deny",
                             "role": "agent"}}


def test_release_survives_the_callers_cancellation(controller: FakeController) -> None:
    """asyncio only. The task is cancelled while leaving `async with sandbox` is releasing:
    the cancellation reaches the caller, and the release still completes."""
    controller.release_delay_s = 1.5  # margin for a loaded machine: the cancel lands inside

    async def body():
        async with AsyncClient(controller.url, retry=FAST_RETRY) as client:
            entered = asyncio.Event()

            async def rollout():
                async with await client.acquire("img", job="j") as sb:
                    await sb.exec("true")
                    entered.set()
                # leaving the block: the release (DELETE, held 1.5 s) is in flight

            task = asyncio.ensure_future(rollout())
            await entered.wait()
            deadline = time.monotonic() + 5
            while not controller.calls("DELETE") and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            task.cancel()  # cancels the caller mid-release
            with pytest.raises(asyncio.CancelledError):
                await task
            assert controller.sandboxes, "the DELETE is still held by the controller"
            deadline = time.monotonic() + 5
            while controller.sandboxes and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert controller.sandboxes == {}
        assert len(controller.calls("DELETE")) == 1  # aclose did not release it twice

    asyncio.run(asyncio.wait_for(body(), 20))


def test_on_request_reports_each_call_once(flavor: Flavor, controller: FakeController) -> None:
    """The hook the load tests feed locust with: one report per call, retries included, with
    the route's kind and template and the error the call raised."""
    seen: list[tuple] = []

    def hook(kind, name, elapsed_ms, length, exc):
        seen.append((kind, name, elapsed_ms >= 0, length > 0, type(exc).__name__ if exc else None))

    def broken(*a):
        raise RuntimeError("a broken hook must not break the call")

    async def body():
        async with flavor.client(controller.url, on_request=hook) as client:
            async with await client.acquire("img", job="j") as sb:
                await sb.exec("true")
            with pytest.raises(SandboxGone):
                await client.get("sb-none")
        async with flavor.client(controller.url, on_request=broken) as client:
            await client.list()

    flavor.run(body)
    assert seen == [("ACQUIRE", "/v1/sandboxes", True, True, None),
                    ("EXEC", "/exec", True, True, None),
                    ("RELEASE", "/v1/sandboxes/{id}", True, True, None),
                    ("GET", "/v1/sandboxes/{id}", True, False, "SandboxGone")]


@pytest.mark.slow
def test_renewing_survives_failures_and_stops_at_release(flavor: Flavor,
                                                        controller: FakeController,
                                                        caplog) -> None:
    """Renews at a third of the lifetime; a failed renew is logged and retried sooner, never
    raised into the caller's work; releasing stops it. SandboxGone stops it with one error."""
    controller.lifetime_s = 3.0  # renews at 1 s; a failure is retried 0.5 s later
    controller.renew_answers = [(500, {"error": {"type": "InternalError", "message": "boom",
                                                 "events": []}})] * 2

    def renews() -> int:
        return len([c for c in controller.calls("POST") if c[1].endswith("/renew")])

    async def body():
        async with flavor.client(controller.url) as client:
            async with await client.acquire("img", job="j") as sb:
                for _ in range(100):  # bounded: ~5 s of work while it renews
                    assert (await sb.exec("echo ok")).output.strip() == "ok"
                    if renews() >= 4 and sb.expires_at != "2026-01-01T00:00:00Z":
                        break
                    await asyncio.sleep(0.05)
                assert renews() >= 4 and sb.expires_at != "2026-01-01T00:00:00Z"
            n = renews()
            await asyncio.sleep(1.3)
            assert renews() == n  # released: nothing renews it any more
            # Gone at the controller: renewing stops with one error line, work goes on.
            sb2 = await client.acquire("img", job="j")
            controller.sandboxes.clear()
            await asyncio.sleep(1.3)
            n = renews()
            assert n >= 1
            await asyncio.sleep(1.3)
            assert renews() == n
            await sb2.aclose()

    with caplog.at_level("INFO", logger="sandman.client"):
        flavor.run(body)
    assert "renew failed (ControllerError: boom" in caplog.text and "retrying in" in caplog.text
    assert "it is gone or expired, renewing stops" in caplog.text
def test_in_cluster_config_from_the_environment(tmp_path, monkeypatch) -> None:
    """`Client()` reads SANDMAN_URL and SANDMAN_TOKEN_FILE, and reads the token again when the
    kubelet rotates the file; a missing URL or token file is one clear error."""
    from sandman.client import Client, _core
    from sandman.client.errors import SandmanError

    for k in (_core.ENV_URL, _core.ENV_TOKEN_FILE, _core.ENV_CA_FILE):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(SandmanError, match="SANDMAN_URL"):
        Client()
    tok = tmp_path / "token"
    tok.write_text("first\n")
    monkeypatch.setenv(_core.ENV_URL, "https://127.0.0.1:1/")
    monkeypatch.setenv(_core.ENV_TOKEN_FILE, str(tok))
    with Client() as c:
        assert c.url == "https://127.0.0.1:1"
        assert c._token.header() == {"Authorization": "Bearer first"}
        new = tmp_path / "token.new"  # the kubelet's atomic swap
        new.write_text("second-longer")
        new.replace(tok)
        assert c._token.header() == {"Authorization": "Bearer second-longer"}
    with Client("https://127.0.0.1:1", token="given") as c:
        assert c._token.header() == {"Authorization": "Bearer given"}
    monkeypatch.setenv(_core.ENV_TOKEN_FILE, str(tmp_path / "missing"))
    with pytest.raises(SandmanError, match="token file"):
        Client()
