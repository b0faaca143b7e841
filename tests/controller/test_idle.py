"""The idle rule's pure parts (controller/idle.py): which sandboxes a tick asks, when one
counts as idle or as used during its checkpoint, the back-off, the bounded record of paused
ids, a pause whose record fails, and the wire's SandboxPaused. The whole path runs on the bed
(test_checkpoint_on_testbed.py, the idle pause)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from controller import idle as I
from controller import paused as P
from controller.books import State
from controller.errors import CheckpointFailed
from controller.settings import Settings
from sandman import api, contract
from sandman.client import errors
from tests.controller.fakekube import FakeKube, Fault

CK = "team-a." + "ab" * 32


def entry(sid: str, stage=State.LEASED, role=contract.ROLE_AGENT, token="t", ip="10.0.0.1"):
    return SimpleNamespace(id=sid, stage=stage, spec=SimpleNamespace(role=role), token=token,
                           ip=ip)


def test_only_handed_out_agent_sandboxes_whose_token_is_held_are_asked():
    es = [entry("a"), entry("grading", role=contract.ROLE_GRADING),
          entry("warm", stage=State.WARM), entry("no-token", token=None),
          entry("no-ip", ip=None), entry("b")]
    assert [e.id for e in I.due(es, 100.0, {}, {})] == ["a", "b"]


def test_a_tick_is_bounded_and_asks_the_longest_unasked_first():
    es = [entry(f"s{i}") for i in range(100)]
    asked = {f"s{i}": float(100 - i) for i in range(100)}  # s99 asked longest ago
    got = [e.id for e in I.due(es, 1000.0, asked, {}, limit=I.TICK_MAX)]
    assert len(got) == I.TICK_MAX and got[0] == "s99" and "s0" not in got


def test_a_sandbox_in_back_off_is_not_asked():
    es = [entry("a"), entry("b")]
    assert [e.id for e in I.due(es, 10.0, {}, {"a": 11.0})] == ["b"]
    assert [e.id for e in I.due(es, 11.0, {}, {"a": 11.0})] == ["a", "b"]


def test_the_back_off_doubles_and_is_capped():
    waits = [I.backoff_s(60.0, n) for n in range(1, 30)]
    assert waits[0] == 60.0 and waits[1] == 120.0
    assert waits == sorted(waits)
    assert max(waits) == I.BACKOFF_MAX_S
    assert I.backoff_s(1.0, 1) >= 10.0  # a tiny rule still waits, never tries every tick


def test_a_running_request_is_never_idle_and_a_new_hand_out_is_not_idle_yet():
    assert I.idle_for(idle_s=9999.0, busy=1, known_s=9999.0) == 0.0
    # A warm pod's execd was idle long before its hand-out: the controller's own count rules.
    assert I.idle_for(idle_s=9999.0, busy=0, known_s=3.0) == 3.0
    assert I.idle_for(idle_s=5.0, busy=0, known_s=9999.0) == 5.0


def test_a_call_during_the_checkpoint_is_seen():
    # First read at t=100: idle 30 s (last use ended at 70).
    assert not I.used_since(100.0, 30.0, 110.0, 40.0, 0)  # still ended at 70
    assert not I.used_since(100.0, 30.0, 110.0, 39.8, 0)  # clock rounding
    assert I.used_since(100.0, 30.0, 110.0, 2.0, 0)  # a call ended at 108
    assert I.used_since(100.0, 30.0, 110.0, 0.0, 1)  # one runs


def test_paused_ids_expire_with_their_checkpoint_and_are_bounded():
    p = I.Paused(cap=3)
    for i in range(5):
        p.add(f"s{i}", I.PausedSandbox("team-a/j", CK, until=1000.0))
    assert p.get("s0", now=1.0) is None and p.get("s1", now=1.0) is None  # the oldest went
    assert p.get("s4", now=999.0).checkpoint == CK
    assert p.get("s4", now=1000.0) is None  # expired with the checkpoint
    assert "s4" not in p.items


def test_the_tick_interval_follows_the_rule_within_bounds():
    assert I.tick_s(2.0) == 1.0 and I.tick_s(120.0) == 30.0 and I.tick_s(86400.0) == 60.0


def test_the_rule_is_off_by_default_and_needs_checkpoints():
    assert Settings.pause_idle_after == 0
    with pytest.raises(ValueError, match="needs checkpoints"):
        Settings(namespace="sbx", pause_idle_after=60.0)
    with pytest.raises(ValueError, match=">= 0"):
        Settings(namespace="sbx", pause_idle_after=-1.0, checkpoint_registry="r:5000/ck")


def test_the_wire_says_the_checkpoint_only_on_a_pause():
    assert "checkpoint" not in api.Error("SandboxGone", "m").to_json()["error"]
    body = api.Error(api.SANDBOX_PAUSED.type, "m", [], CK).to_json()
    err = errors.controller_error(410, body)
    assert isinstance(err, errors.SandboxPaused) and isinstance(err, errors.SandboxGone)
    assert err.handle == CK


def test_a_pause_answer_without_its_checkpoint_is_a_protocol_error():
    body = api.Error(api.SANDBOX_PAUSED.type, "m").to_json()
    assert type(errors.controller_error(410, body)) is errors.ProtocolError
    body["error"]["checkpoint"] = 5
    assert type(errors.controller_error(410, body)) is errors.ProtocolError


# ---- one tick, with the controller's parts faked (pure logic: no Kubernetes, no pod)

class FakeExecd:
    def __init__(self, answers: list[tuple[float, int]]):
        self.answers = list(answers)
        self.asked = 0

    async def activity(self, ip: str, token: str):
        self.asked += 1
        idle_s, busy = self.answers.pop(0) if self.answers else (0.0, 1)
        return SimpleNamespace(idle_s=idle_s, busy=busy)

    async def aclose(self) -> None:
        pass


class FakeCheckpoints:
    def __init__(self, fail: bool):
        self.fail = fail
        self.calls = 0

    async def checkpoint(self, entries, timeout_s):
        self.calls += 1
        if self.fail:
            raise CheckpointFailed("checkpoint registry: refused")
        return SimpleNamespace(id=CK, expires_at="2099-01-08T00:00:00Z")


def rule(e, execd: FakeExecd, fail: bool = False):
    released: list[str] = []

    async def release(sid: str) -> bool:
        released.append(sid)
        return True
    s = SimpleNamespace(pause_idle_after=60.0, execd_port=9470, checkpoint_ttl=3600.0)
    ctl = SimpleNamespace(s=s, books=SimpleNamespace(entries={e.id: e}),
                          checkpoints=FakeCheckpoints(fail), release=release,
                          paused=I.Paused())
    r = I.IdleRule(ctl)
    asyncio.run(r.execd._http.aclose())
    r.execd = execd
    r.known[e.id] = -1e9  # handed out long ago
    return r, ctl, released


def tick(r) -> int:
    return asyncio.run(r.tick())


def test_an_idle_sandbox_is_paused_and_remembered_for_its_tenant():
    e = entry("a")
    e.job, e.name = "team-a/j", "pod-a"
    r, ctl, released = rule(e, FakeExecd([(120.0, 0), (121.0, 0)]))
    assert tick(r) == 1 and released == ["a"]
    assert r.paused.get("a").checkpoint == CK and r.paused.get("a").job == "team-a/j"


def test_a_failed_checkpoint_leaves_it_leased_and_backs_off():
    e = entry("a")
    e.job, e.name = "team-a/j", "pod-a"
    execd = FakeExecd([(120.0, 0)] * 5)
    r, ctl, released = rule(e, execd, fail=True)
    assert tick(r) == 0 and released == [] and ctl.checkpoints.calls == 1
    assert r.paused.get("a") is None
    assert tick(r) == 0 and ctl.checkpoints.calls == 1 and execd.asked == 1  # backed off


def test_a_sandbox_used_during_its_checkpoint_stays_leased():
    e = entry("a")
    e.job, e.name = "team-a/j", "pod-a"
    r, ctl, released = rule(e, FakeExecd([(120.0, 0), (0.0, 1)]))
    assert tick(r) == 0 and released == [] and r.paused.get("a") is None


def test_a_busy_or_recent_sandbox_is_not_checkpointed():
    for answer in ((0.0, 1), (30.0, 0)):
        e = entry("a")
        e.job, e.name = "team-a/j", "pod-a"
        r, ctl, released = rule(e, FakeExecd([answer]))
        assert tick(r) == 0 and ctl.checkpoints.calls == 0 and released == []


def test_a_pause_whose_record_fails_leaves_it_leased_and_backs_off():
    e = entry("sbx-a")
    e.job, e.name = "team-a.j", "pod-a"
    kube = FakeKube()
    kube.faults.append(Fault("create_cm", "500"))
    r, ctl, released = rule(e, FakeExecd([(120.0, 0)] * 4))
    r.paused = P.Paused(kube=kube, tenants=True, scope="sbx")
    assert tick(r) == 0 and released == [] and r.paused.get("sbx-a") is None
    assert r.fails["sbx-a"] == 1 and r.retry_at["sbx-a"] > 0  # backed off, as a failed checkpoint
    assert P.RECORD_NAME not in kube.config_maps
