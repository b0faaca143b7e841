"""Declared run conditions: the comparison (pure logic) and the request model's checks.

The readings these compare come from execd's /conditions (tests/execd/test_conditions.py
builds real cgroup trees for them); the controller's refusal on the test bed is in
tests/controller/test_conditions_refusal.py, on real pods in tests/e2e/test_conditions_on_node.py.
"""

from __future__ import annotations

import pytest

from controller import conditions as C
from sandman import api
from sandman.client import BadRequest, _core

GI = 1 << 30

# An execd answer as the real route gives it (field names only; values vary per test).
POD = {"cpu_quota_us": 150000, "cpu_period_us": 100000, "cpu_unlimited": False,
       "cpu_cores": 1.5, "visible_cpus": [0, 1], "visible_cpu_count": 2,
       "memory_limit_bytes": 3 * GI, "memory_unlimited": False, "uid": 1000, "gid": 1000,
       "user": "agent", "tz_env": None, "localtime": "Etc/UTC", "tz": "Etc/UTC",
       "pythonhashseed": "0", "netguard_mode": "deny", "egress": None}


def test_all_matching_fields_are_verified_with_their_readings():
    v = C.compare({"cpu_quota": 1.5, "visible_cpus": 2, "memory_limit": "3Gi", "user": "agent",
                   "tz": "UTC", "hash_seed": "0", "egress": "deny", "time_limit_s": 60.0}, POD)
    assert v.ok and not v.contradicted
    assert v.verified == {"cpu_quota": 1.5, "visible_cpus": 2, "memory_limit": 3 * GI,
                          "user": "agent", "tz": "Etc/UTC", "hash_seed": "0",
                          "egress": "deny"}
    assert v.unverified == ["time_limit_s"]  # never readable: the grader's
    assert v.answer() == {"verified": v.verified, "unverified": ["time_limit_s"]}


@pytest.mark.parametrize("field,declared,read", [
    ("cpu_quota", 2.0, 1.5), ("cpu_quota", 1.4, 1.5), ("visible_cpus", 4, 2),
    ("visible_cpus", 1, 2), ("memory_limit", "8Gi", 3 * GI), ("memory_limit", "3G", 3 * GI),
    ("user", "root", "agent"), ("user", "0", "agent"), ("tz", "Europe/Paris", "Etc/UTC"),
    ("hash_seed", "1", "0"), ("hash_seed", "random", "0"), ("egress", "allow", "deny")])
def test_each_field_contradicted(field, declared, read):
    v = C.compare({field: declared}, POD)
    assert not v.ok and v.contradicted == [(field, declared, read)]
    assert field in v.message() and repr(declared) in v.message()
    assert v.verified == {} and v.unverified == []


def test_tolerances_and_equivalences():
    assert C.compare({"cpu_quota": 1.504}, POD).ok  # a rounding, not another size
    assert C.compare({"memory_limit": "3221225472"}, POD).ok
    # The kernel rounds memory.max down to a page.
    assert C.compare({"memory_limit": "1000000"}, {**POD, "memory_limit_bytes": 999424}).ok
    for tz in ("UTC", "Etc/UTC", ":UTC", "Zulu", "posix/UTC", "GMT"):
        assert C.compare({"tz": tz}, POD).ok, tz
    assert C.compare({"user": "1000"}, POD).ok  # a uid as digits
    assert C.compare({"hash_seed": "random"}, {**POD, "pythonhashseed": None}).ok


def test_unlimited_contradicts_a_declared_limit():
    pod = {**POD, "cpu_quota_us": None, "cpu_cores": None, "cpu_unlimited": True,
           "memory_limit_bytes": None, "memory_unlimited": True}
    v = C.compare({"cpu_quota": 2, "memory_limit": "8Gi"}, pod)
    assert v.contradicted == [("cpu_quota", 2, "unlimited"), ("memory_limit", "8Gi",
                                                               "unlimited")]


def test_unreadable_fields_never_refuse():
    pod = {k: None for k in POD}
    del pod["pythonhashseed"]  # an execd that does not report it at all
    v = C.compare({"cpu_quota": 2, "visible_cpus": 3, "memory_limit": "1Gi", "user": "x",
                   "tz": "UTC", "hash_seed": "0", "egress": "deny"}, pod)
    assert v.ok and v.verified == {}
    assert v.unverified == ["egress", "cpu_quota", "visible_cpus", "memory_limit", "user",
                            "tz", "hash_seed"]
    # A uid without a passwd entry can answer a uid, not a name.
    v = C.compare({"user": "agent"}, {**POD, "user": None})
    assert v.ok and v.unverified == ["user"]
    assert not C.compare({"user": "0"}, {**POD, "user": None}).ok


def test_egress_readings():
    # An outbound connection made by the pod proves egress, whatever the guard's status says.
    opened = {**POD, "egress": {"target": "127.0.0.1:9", "open": True}}
    assert C.compare({"egress": "deny"}, opened).contradicted == [("egress", "deny", "allow")]
    closed = {**POD, "egress": {"target": "127.0.0.1:9", "open": False}, "netguard_mode": None}
    assert C.compare({"egress": "deny"}, closed).unverified == ["egress"]
    assert C.compare({"egress": "allow"}, {**POD, "netguard_mode": "allow"}).ok


def test_older_execd_answer_quota_from_quota_and_period():
    pod = {k: v for k, v in POD.items() if k != "cpu_cores"}
    pod.update(cpu_quota_us=250000, cpu_period_us=100000)
    assert C.compare({"cpu_quota": 2.5}, pod).verified == {"cpu_quota": 2.5}


# ---- the request model ------------------------------------------------------------------

@pytest.mark.parametrize("fields,msg", [
    ({"egress": "open"}, "conditions.egress"), ({"cpu_quota": 0}, "conditions.cpu_quota"),
    ({"cpu_quota": True}, "conditions.cpu_quota"), ({"visible_cpus": 1.5}, "visible_cpus"),
    ({"memory_limit": "8 Gi"}, "memory_limit"), ({"memory_limit": "0"}, "memory_limit"),
    ({"user": "a:b"}, "conditions.user"), ({"tz": ""}, "conditions.tz"),
    ({"hash_seed": "x"}, "hash_seed"), ({"time_limit_s": 0}, "time_limit_s")])
def test_model_refuses_bad_declarations_in_one_line(fields, msg):
    with pytest.raises(ValueError) as ei:
        api.Conditions(**fields)
    assert str(ei.value).startswith("conditions.") and msg in str(ei.value)
    assert "\n" not in str(ei.value)
    with pytest.raises(BadRequest):
        _core.conditions_of(fields)


def test_sdk_refuses_unknown_fields_and_keeps_known_ones():
    with pytest.raises(BadRequest, match="cpus"):
        _core.conditions_of({"cpus": 2})
    c = _core.conditions_of({"cpu_quota": 1.5, "memory_limit": "0.5Gi", "hash_seed": "0"})
    assert c.declared() == {"cpu_quota": 1.5, "memory_limit": "0.5Gi", "hash_seed": "0"}
    body = api.AcquireRequest(image="i", job="j", conditions=c).to_json()
    assert body["conditions"]["cpu_quota"] == 1.5 and body["conditions"]["user"] is None


# ---- the probe against a real execd --------------------------------------------------------

def test_checker_reads_a_real_execd_and_fails_closed_on_a_wrong_token(tmp_path):
    import asyncio
    import os

    from tests.execd.conftest import TOKEN, start_execd

    d = start_execd(tmp_path, env={"TZ": ":Europe/Paris"})
    n = len(os.sched_getaffinity(0))
    try:
        async def main():
            ck = C.Checker(d.port, 2.0)
            try:
                good = await ck.check("127.0.0.1", TOKEN, {"visible_cpus": n, "tz": "Europe/Paris",
                                                           "hash_seed": "42"})
                bad = await ck.check("127.0.0.1", "not-the-token", {"tz": "Europe/Paris"})
                more = await ck.check("127.0.0.1", TOKEN, {"visible_cpus": n + 1})
            finally:
                await ck.close()
            return good, bad, more

        good, bad, more = asyncio.run(main())
        assert good.ok and good.verified == {"visible_cpus": n, "tz": "Europe/Paris",
                                             "hash_seed": "42"}
        # The seed was applied to the shell (and its successors), not only reported.
        assert d.exec("echo $PYTHONHASHSEED")["output"].strip() == "42"
        assert bad.contradicted[0][0] == "probe" and "401" in bad.message()
        assert more.contradicted == [("visible_cpus", n + 1, n)]
    finally:
        d.stop()
