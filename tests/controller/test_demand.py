"""Demand sizing of the warm pool (controller/demand.py): the estimator and the budget on a
fake clock (pure logic), then the warm pool driving them inside a controller on the in-memory
`Kube` (tests/controller/fakekube.py). The real API server: test_demand_on_testbed.py."""

from __future__ import annotations

import asyncio
import math

import pytest

from controller.core import Controller
from controller.demand import REFILL_K, TAU_S, Budget, Demand, allocate, cpu_of, twin
from controller.errors import BadRequest
from controller.pacer import Limits
from controller.pods import AcquireOrder, SandboxSpec
from controller.settings import Settings
from sandman import contract
from tests.controller.fakekube import FakeKube

G = contract.ROLE_GRADING
A = contract.ROLE_AGENT
BUDGET = Budget(pods=16, cpu=32.0, per_key=8)


def key(i: int = 0, role: str = G, cpu: str = "2") -> SandboxSpec:
    return SandboxSpec(f"registry.invalid/task-{i}:1", cpu=cpu, memory="1Gi", role=role)


# ---- the estimator ----------------------------------------------------------------------------
def test_no_target_before_a_pod_of_the_spec_was_ready():
    d = Demand(BUDGET)
    for t in range(20):
        d.acquired(key(), float(t))
    assert d.want(key(), 20.0, 300.0) == 0  # not proven: a bogus image is never built warm
    d.ready(key(), 5.0)
    assert d.want(key(), 20.0, 300.0) > 0


def test_the_target_is_the_stated_formula():
    d = Demand(BUDGET)
    d.ready(key(), 6.0)
    for i in range(8):  # a GRPO group's gradings within a second
        d.acquired(key(), 100.0 + i / 8)
    now = 101.0
    lam = sum(math.exp(-(now - (100.0 + i / 8)) / TAU_S) for i in range(8)) / TAU_S
    m = lam * (6.0 + REFILL_K * 3.0)  # one sample: mean 6, deviation half of it
    assert d.expected(key(), now) == pytest.approx(m)
    assert d.want(key(), now, 300.0) == math.ceil(m + 2 * math.sqrt(m))


def test_a_quiet_key_keeps_at_least_one_pod_and_the_per_key_cap_holds():
    d = Demand(BUDGET)
    d.ready(key(), 1.0)
    d.acquired(key(), 0.0)
    assert d.expected(key(), 250.0) < 0.01 and d.want(key(), 250.0, 300.0) == 1
    for i in range(10_000):  # hammering one key
        d.acquired(key(), 1.0 + i / 1000)
    assert d.want(key(), 11.0, 300.0) == BUDGET.per_key


def test_refill_time_is_an_ewma_shared_by_the_roles():
    d = Demand(BUDGET)
    d.ready(key(role=A), 10.0)
    d.ready(key(role=G), 20.0)
    mean, dev = 0.3 * 20 + 0.7 * 10, 0.3 * 10 + 0.7 * 5
    assert d.refill[twin(key(), A)] == pytest.approx(mean)
    assert d.refill_time(key(role=G)) == pytest.approx(mean + REFILL_K * dev)
    d.ready(key(), float("nan"))  # ignored
    assert d.refill_time(key()) == pytest.approx(mean + REFILL_K * dev)


def test_idle_key_goes_to_zero_after_its_idle_timeout():
    d = Demand(BUDGET)
    d.ready(key(), 5.0)
    d.acquired(key(), 0.0)
    assert d.want(key(), 300.0, 300.0) == 1
    assert d.want(key(), 300.1, 300.0) == 0
    assert d.want(key(), 31.0, 30.0) == 0  # the key's own idle timeout


def test_a_rollout_arms_its_grading_twin_while_it_is_held():
    d = Demand(BUDGET)
    d.ready(key(role=A), 5.0)
    d.acquired(key(role=A), 0.0)
    assert d.want(key(role=A), 1.0, 300.0) == 0  # rollout keys are not sized by default
    assert d.want(key(role=G), 1.0, 300.0) == 1  # its gradings come minutes later
    assert d.want(key(role=G), 400.0, 300.0) == 0
    assert d.want(key(role=G), 400.0, 300.0, twin_leased=3) == 1  # still rolling out


def test_off_without_a_pod_budget_and_roles_are_checked():
    d = Demand(Budget())
    d.ready(key(), 5.0)
    d.acquired(key(), 0.0)
    assert d.want(key(), 1.0, 300.0) == 0
    with pytest.raises(ValueError, match="roles"):
        Budget(pods=1, roles=("sidecar",))
    with pytest.raises(ValueError):
        Budget(pods=-1)


def test_remembered_keys_are_bounded():
    d = Demand(BUDGET, max_keys=100)
    for i in range(1000):
        d.acquired(key(i), float(i))
        d.ready(key(i), 5.0)
    assert len(d.keys) <= 100 and len(d.refill) <= 100
    assert key(999) in d.keys and key(0) not in d.keys  # least recent forgotten first


# ---- the budget -------------------------------------------------------------------------------
def test_floors_first_then_grading_then_by_expected_demand():
    rows = [(key(1, A), 0, 4, 9.0), (key(2, G), 0, 4, 0.5), (key(3, G), 0, 4, 2.0),
            (key(4, A), 3, 3, 0.0)]
    got = allocate(rows, Budget(pods=8, per_key=8))
    assert got[key(4, A)] == 3  # the admin's floor, in full
    # 5 pods left: grading keys first, one pod per key per round, the busier key first
    assert got[key(3, G)] == 3 and got[key(2, G)] == 2 and got[key(1, A)] == 0
    assert sum(got.values()) == 8


def test_cpu_budget_binds_before_pods():
    rows = [(key(1, G, cpu="4"), 0, 8, 3.0), (key(2, G, cpu="500m"), 0, 8, 1.0)]
    got = allocate(rows, Budget(pods=100, cpu=10.0, per_key=8))
    assert got[key(1, G, cpu="4")] * 4 + got[key(2, G, cpu="500m")] * 0.5 <= 10.0
    assert got[key(1, G, cpu="4")] == 2 and got[key(2, G, cpu="500m")] == 4


def test_hostile_many_distinct_keys_cannot_pass_the_budget():
    """One tenant hammering acquires over 2,000 distinct specs: each key's target is capped and
    the total stays within the budget in pods and in CPU."""
    d = Demand(BUDGET)
    specs = [key(i, cpu=f"{1000 + i}m") for i in range(2000)]
    for rnd in range(5):
        for i, s in enumerate(specs):
            d.acquired(s, rnd + i / 10_000)
            d.ready(s, 30.0)
    now = 5.0
    rows = [(s, 0, d.want(s, now, 300.0), d.expected(s, now)) for s in d.keys]
    assert max(r[2] for r in rows) <= BUDGET.per_key
    got = allocate(rows, BUDGET)
    assert sum(got.values()) <= BUDGET.pods
    assert sum(n * cpu_of(s) for s, n in got.items()) <= BUDGET.cpu


def test_hostile_tenant_spreading_over_many_keys_gets_no_more_per_round_than_one_key():
    """Tenant `evil` hammers 200 keys (each expecting much), `victim` has one quiet key: every
    round gives each tenant one pod, so the victim's key gets what it wants."""
    rows = [(key(i), 0, 8, 50.0, "evil") for i in range(200)]
    rows.append((key(999), 0, 3, 0.1, "victim"))
    got = allocate(rows, Budget(pods=8, per_key=8))
    assert got[key(999)] == 3 and sum(got.values()) == 8
    # The evil tenant's 5 go one per key, its busiest keys first.
    assert sorted(n for s, n in got.items() if s != key(999)) == [0] * 195 + [1] * 5


def test_hostile_tenant_through_acquires():
    async def body(ctl, kube, clock):
        for i in range(10):
            for _ in range(4):
                got = await ctl.acquire(AcquireOrder(key(i, cpu="1"), "evil.spread",
                                                     warm_ok=True, timeout_s=10))
                await ctl.release(got["id"])
        got = await ctl.acquire(AcquireOrder(key(50, cpu="1"), "victim.grade", warm_ok=True,
                                             timeout_s=10))
        await ctl.release(got["id"])
        await settle(ctl, kube)
        assert ctl.pools[key(50, cpu="1")].target >= 1
        assert sum(p.target for p in ctl.pools.values()) <= 4

    run(body, Budget(pods=4, per_key=2), tenants=True)


# ---- inside the controller (in-memory Kube) ---------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def run(body, budget: Budget, start_s: float | None = 0.02, tenants: bool = False):
    async def main():
        kube = FakeKube(start_s=start_s)
        clock = Clock()
        ctl = Controller(kube, Settings(namespace="ns", ready_check="pod", image_pinning="off", sweep_interval=3600,
                                        limits=Limits(rate=1000, burst=1000),
                                        warm_budget=budget, tenants=tenants), clock=clock)
        await ctl.start()
        try:
            await asyncio.wait_for(body(ctl, kube, clock), 30)
        finally:
            await ctl.stop()
        assert ctl.books.illegal == 0

    asyncio.run(main())


async def settle(ctl, kube, rounds: int = 20) -> None:
    for _ in range(rounds):
        ctl.warm.tick()
        await asyncio.sleep(0.03)


def warm_count(ctl) -> int:
    return sum(len(p.warm) + p.building for p in ctl.pools.values())


def test_pool_grows_with_acquires_shrinks_when_idle_and_stays_in_budget():
    async def body(ctl, kube, clock):
        spec = key(7)
        got = await ctl.acquire(AcquireOrder(spec, "job-a", warm_ok=True, timeout_s=10))
        await ctl.release(got["id"])
        await settle(ctl, kube)
        assert ctl.pools[spec].target == 1 and len(ctl.pools[spec].warm) == 1
        got = await ctl.acquire(AcquireOrder(spec, "job-a", warm_ok=True, timeout_s=10))
        assert got["warm"] is True
        await ctl.release(got["id"])
        clock.now += 301  # past the idle timeout: the key's pool is emptied
        await settle(ctl, kube)
        assert ctl.pools[spec].target == 0 and warm_count(ctl) == 0

    run(body, Budget(pods=4, cpu=8.0, per_key=2))


def test_hostile_distinct_keys_through_acquires_stay_within_the_budget():
    async def body(ctl, kube, clock):
        for i in range(12):
            for _ in range(3):
                got = await ctl.acquire(AcquireOrder(key(i, cpu="1"), "tenant-x",
                                                     warm_ok=True, timeout_s=10))
                await ctl.release(got["id"])
        await settle(ctl, kube)
        assert all(p.target <= 2 for p in ctl.pools.values())
        assert sum(p.target for p in ctl.pools.values()) <= 5
        assert warm_count(ctl) <= 5

    run(body, Budget(pods=5, cpu=100.0, per_key=2))


def test_a_bogus_spec_never_becomes_a_warm_key():
    async def body(ctl, kube, clock):
        bad = SandboxSpec("bad image ref", cpu="1", memory="1Gi", role=G)
        for _ in range(5):
            with pytest.raises(BadRequest):
                await ctl.acquire(AcquireOrder(bad, "job-a", timeout_s=1))
        assert bad not in ctl.warm.demand.keys and bad not in ctl.pools
        # A well-formed spec whose pods never start (an image that cannot be pulled): its
        # acquires time out and the pool builds nothing for it.
        never = key(9)
        for _ in range(3):
            with pytest.raises(Exception):  # noqa: B017 - AcquireTimeout
                await ctl.acquire(AcquireOrder(never, "job-a", warm_ok=True, timeout_s=0.2))
        await settle(ctl, kube)
        assert ctl.pools.get(never) is None or ctl.pools[never].target == 0

    run(body, Budget(pods=8, per_key=4), start_s=None)


def test_prewarm_floor_holds_without_demand_and_lapses_when_idle():
    async def body(ctl, kube, clock):
        spec = key(3, role=A)
        ctl.prewarm(spec, 2, 60)
        await settle(ctl, kube)
        assert ctl.pools[spec].target == 2 and len(ctl.pools[spec].warm) == 2
        clock.now += 61
        await settle(ctl, kube)
        assert ctl.pools[spec].target == 0 and warm_count(ctl) == 0

    run(body, Budget())
