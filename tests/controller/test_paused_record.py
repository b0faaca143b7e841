"""The paused record's pure parts (controller/paused.py): what an entry must be to be believed,
the bound, and the write before the pause is done, against the fake API (its ConfigMap calls).
The whole path, with a controller killed and started again, runs on the bed
(test_idle_on_testbed.py)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from controller import paused as P
from tests.controller.fakekube import FakeKube, Fault

KEY = b"k" * 32
SCOPE = "sbx"
NOW = 1_000_000.0
CK_A = "team-a." + "ab" * 32
CK_B = "team-b." + "cd" * 32
SID = "sbx-team-a-j-0123456789"


def good(sid: str = SID, job: str = "team-a.j", ck: str = CK_A, until: float = NOW + 60,
         key: bytes | None = KEY) -> str:
    return P.encode(sid, P.PausedSandbox(job, ck, until), key, SCOPE)


def check(sid, raw, key: bytes | None = KEY, tenants: bool = True) -> P.PausedSandbox:
    return P.check(sid, raw, NOW, tenants=tenants, key=key, scope=SCOPE)


def test_an_entry_this_controller_wrote_is_read_back():
    p = check(SID, good())
    assert (p.job, p.checkpoint, p.until) == ("team-a.j", CK_A, NOW + 60)
    # Unscoped (--auth none): the checkpoint is of the `local` repository.
    ck = "local." + "ef" * 32
    assert check(SID, good(job="j", ck=ck, key=None), key=None, tenants=False).checkpoint == ck


@pytest.mark.parametrize("sid, raw, why", [
    ("Not_An_Id", good(), "not a sandbox id"),
    ("x" * 64, good(), "not a sandbox id"),
    (SID, 5, "not text"),
    (SID, good()[:-1] + " " * P.VALUE_MAX + "}", "not text of at most"),
    (SID, "{" * 50, "not JSON"),
    (SID, "[1, 2]", "not a paused sandbox's"),
    (SID, json.dumps({"job": "team-a.j", "checkpoint": CK_A, "until": NOW + 60, "x": 1}),
     "not a paused sandbox's"),
    (SID, good(job="team a.j"), "not a job key"),
    (SID, good(job="j"), "names no tenant"),
    (SID, good(ck="team-a.xyz"), "not a checkpoint id"),
    (SID, good(ck=5), "not a checkpoint id"),
    # Tenant b's job naming tenant a's checkpoint, and the other way round.
    (SID, good(job="team-b.j"), "not of its job's tenant"),
    (SID, good(ck=CK_B), "not of its job's tenant"),
    (SID, good(until=NOW), "expired"),
    (SID, json.dumps({"job": "team-a.j", "checkpoint": CK_A, "until": True}), "not a time"),
    (SID, good().replace('"until":' + str(int(NOW + 60)), '"until":NaN'), "not a time"),
    (SID, good().replace('"until":' + str(int(NOW + 60)), '"until":Infinity'), "not a time"),
    (SID, good(key=None), "proof"),
    (SID, good(key=b"z" * 32), "proof"),
    # A real entry's proof copied to another id, or to a later expiry.
    ("sbx-team-a-j-9999999999", good(), "proof"),
    (SID, json.dumps({**json.loads(good()), "until": NOW + 999}), "proof"),
])
def test_hostile_entries_are_refused(sid, raw, why):
    with pytest.raises(ValueError, match=why):
        check(sid, raw)


def test_without_a_books_key_a_tenant_still_cannot_name_another_tenants_checkpoint():
    with pytest.raises(ValueError, match="not of its job's tenant"):
        check(SID, good(job="team-b.j", key=None), key=None)


def test_the_read_keeps_the_newest_within_its_bound_and_says_why_it_refused_the_rest():
    data = {f"sbx-j-{i:010d}": good(f"sbx-j-{i:010d}", until=NOW + 10 + i) for i in range(5)}
    data["sbx-bad-0000000000"] = "nope"
    kept, refused = P.parse(data, NOW, tenants=True, key=KEY, scope=SCOPE, cap=3)
    assert [sid for sid, _ in kept] == [f"sbx-j-{i:010d}" for i in (2, 3, 4)]
    assert set(refused) == {"sbx-j-0000000000", "sbx-j-0000000001", "sbx-bad-0000000000"}
    assert "bound" in refused["sbx-j-0000000000"] and "JSON" in refused["sbx-bad-0000000000"]


def paused(kube: FakeKube | None = None, cap: int = P.PAUSED_MAX, **kw) -> P.Paused:
    return P.Paused(cap, kube, tenants=True, key=KEY, scope=SCOPE, **kw)


def entry(i: int, until: float = 4e9) -> tuple[str, P.PausedSandbox]:
    return f"sbx-team-a-j-{i:010d}", P.PausedSandbox("team-a.j", CK_A, until)


def test_a_pause_is_written_to_the_api_before_it_is_done_and_read_back_by_a_new_leader():
    kube = FakeKube()
    asyncio.run(paused(kube).record(*entry(1)))
    data = kube.config_maps[P.RECORD_NAME]["data"]
    assert list(data) == [entry(1)[0]]
    again = paused(kube)  # a new leader: nothing in memory until it reads the record
    assert again.get(entry(1)[0]) is None
    assert asyncio.run(again.load()) == 1
    assert again.get(entry(1)[0]) == entry(1)[1]


def test_an_unwritten_record_fails_the_pause_and_is_not_remembered():
    kube = FakeKube()
    kube.faults.append(Fault("patch_cm", "500"))
    p = paused(kube)
    with pytest.raises(P.Unrecorded, match="could not be recorded in ConfigMap sbx/sandman-paused"):
        asyncio.run(p.record(*entry(1)))
    assert p.get(entry(1)[0]) is None


def test_the_bound_drops_the_oldest_from_memory_and_from_the_record(caplog):
    kube = FakeKube()
    p = paused(kube, cap=2)
    for i in range(3):
        asyncio.run(p.record(*entry(i)))
    assert list(p.items) == [entry(1)[0], entry(2)[0]]
    assert set(kube.config_maps[P.RECORD_NAME]["data"]) == set(p.items)
    assert "forgotten: the record holds at most 2" in caplog.text and entry(0)[0] in caplog.text
    # The byte bound too: one entry takes ~220 bytes.
    small = paused(FakeKube(), max_bytes=500)
    for i in range(4):
        asyncio.run(small.record(*entry(i)))
    assert list(small.items) == [entry(2)[0], entry(3)[0]]


def test_a_planted_entry_is_refused_and_deleted_when_a_leader_reads_the_record(caplog):
    kube = FakeKube()
    asyncio.run(paused(kube).record(*entry(1)))
    data = kube.config_maps[P.RECORD_NAME]["data"]
    data["sbx-team-b-j-0123456789"] = good("sbx-team-b-j-0123456789", job="team-b.j")
    data["sbx-old-0123456789"] = good("sbx-old-0123456789", until=1.0)
    p = paused(kube)
    assert asyncio.run(p.load()) == 1
    assert set(p.items) == {entry(1)[0]} and set(data) == {entry(1)[0]}
    assert "not of its job's tenant" in caplog.text and "expired" in caplog.text


def test_an_unreadable_record_fails_the_load():
    kube = FakeKube()
    kube.faults.append(Fault("read_cm", "500"))
    with pytest.raises(Exception, match="Internal Server Error"):
        asyncio.run(paused(kube).load())


def test_expired_entries_are_forgotten_and_deleted():
    kube = FakeKube()
    p = paused(kube)
    now = time.time()
    sid, e = entry(1, until=now + 60)
    asyncio.run(p.record(sid, e))
    assert p.expired(now + 1) == [] and p.expired(now + 60) == [sid]
    asyncio.run(p.unrecord([sid]))
    assert kube.config_maps[P.RECORD_NAME]["data"] == {}
