"""The warm pool: never-used pods per key `SandboxSpec` (image, cpu, memory, workspace, egress),
built through the same pacer and owner pipeline as every other create.

A pool's `warm` list mirrors the books: an entry is in it exactly while its state is WARM or
PARKED, kept by `moved` (the books' `on_move` hook), so no other code edits the list. Handed out
only to an exactly matching request, oldest first, after a health check; each hand-out triggers
one replacement build. A key unused for its idle timeout is emptied; built surplus is trimmed
newest first; parked late pods are not surplus, they wait out the key's idle timeout.

A pool's target is its admin floor (`prewarm`) plus what demand sizing grants it within the
global warm budget (controller/demand.py states the estimator and the order), recomputed every
tick on the pool's injected clock, so the sizing is deterministic given that clock.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from controller import metrics
from controller import pods as P
from controller.books import POOL_JOB, POOLED, TERMINAL, Books, Entry, State
from controller.create import Creator, new_name, tenant_labels, tenant_of, token_pair
from controller.demand import Budget, Demand, allocate, cpu_of, twin
from controller.execd_client import ExecdClient, ExecdRefused
from controller.pacer import Pacer
from controller.pipeline import Pipeline, ms
from controller.pods import AcquireOrder, SandboxSpec
from controller.settings import Settings
from sandman import contract, logs

S = State
# A burst of hand-outs and their pool's refills meet at the same API server: the hand-outs are
# callers waiting now, the refills the pool's next callers (seconds away: a create, a start).
# So a hand-out's refill waits while other hand-outs of its pool are in flight, at most
# REFILL_DEFER_S; a lone hand-out refills at once, as before.
REFILL_DEFER_S = 2.0
REFILL_POLL_S = 0.02
log = logging.getLogger("controller.warmpool")


@dataclass
class Pool:
    target: int = 0  # floor + the demand share granted within the budget (recomputed per tick)
    idle_timeout: float = 300.0
    last_used: float = 0.0  # on the pool's clock; set when the pool is made
    floor: int = 0  # the admin's prewarm count; reset when the key goes idle
    warm: list[Entry] = field(default_factory=list)  # WARM or PARKED, oldest first
    building: int = 0  # warm builds whose owner task runs
    checking: int = 0  # taken for an acquire, being checked and patched (CHECKING)
    refill_waiting: bool = False  # a refill waits for this pool's hand-outs in flight


class WarmPool:
    def __init__(self, books: Books, pacer: Pacer, pipeline: Pipeline, creator: Creator,
                 settings: Settings, spawn: Callable, clock: Callable[[], float] = time.monotonic):
        self.books = books
        self.clock = clock
        self.demand = Demand(getattr(settings, "warm_budget", None) or Budget())
        self._born: dict[Entry, float] = {}  # entry -> queued at (pool clock): refill times
        self._pooled: dict[Entry, float] = {}  # WARM/PARKED entry -> idle time counted up to
        self._leased: dict[SandboxSpec, int] = {}  # LEASED entries per rollout key
        self.idle_pod_s = 0.0  # pod-seconds and CPU-seconds spent WARM or PARKED, since start
        self.idle_cpu_s = 0.0
        self.pacer = pacer
        self.pipeline = pipeline
        self.creator = creator
        self.s = settings
        self.spawn = spawn
        self.pools: dict[SandboxSpec, Pool] = {}

    def _pool(self, spec: SandboxSpec) -> Pool:
        pool = self.pools.get(spec)
        if pool is None:
            pool = self.pools[spec] = Pool(idle_timeout=self.s.default_idle_timeout,
                                           last_used=self.clock())
        return pool

    def moved(self, e: Entry, old: State | None, new: State) -> None:
        """The books' on_move hook: keeps `warm` and `checking` equal to the books, and the
        demand's refill times, idle pod-seconds and leased rollouts."""
        now = self.clock()
        if old is None and new is S.QUEUED:
            self._born[e] = now
        elif new in (S.WARM, S.LEASED, S.PARKED) and e in self._born:
            self.demand.ready(e.spec, now - self._born.pop(e))
        if new in TERMINAL or new is S.DELETING:
            self._born.pop(e, None)
        if old in POOLED:
            self._idle_until(e, now)
            del self._pooled[e]
        if new in POOLED:
            self._pooled[e] = now
            e.warm_since = now  # on the pool's clock: the parked pods' idle timeout
        if e.spec.role == contract.ROLE_AGENT and (old is S.LEASED) != (new is S.LEASED):
            n = self._leased.get(e.spec, 0) + (1 if new is S.LEASED else -1)
            if n > 0:
                self._leased[e.spec] = n
            else:
                self._leased.pop(e.spec, None)
        if old in POOLED or old is S.CHECKING:
            pool = self.pools[e.spec]
            if old is S.CHECKING:
                pool.checking -= 1
            else:
                pool.warm.remove(e)
        if new in POOLED or new is S.CHECKING:
            # A late pod is parked into its key's pool even when nobody prewarmed that key.
            pool = self._pool(e.spec)
            if new is S.CHECKING:
                pool.checking += 1
            else:
                pool.warm.append(e)

    def has_room(self, spec: SandboxSpec) -> bool:
        pool = self.pools.get(spec)
        return pool is not None and len(pool.warm) + pool.checking < pool.target

    def _idle_until(self, e: Entry, now: float) -> None:
        dt = max(0.0, now - self._pooled.get(e, now))
        self._pooled[e] = now
        if dt:
            self.idle_pod_s += dt
            self.idle_cpu_s += dt * cpu_of(e.spec)
            metrics.warm_idle(dt, dt * cpu_of(e.spec))

    def acquired(self, spec: SandboxSpec, job: str) -> None:
        """An acquire by `job` that may take a warm pod (validated): demand for its key."""
        now = self.clock()
        self.demand.acquired(spec, now, tenant_of(self.s, job) or "")
        pool = self.pools.get(spec)
        if pool is not None:
            pool.last_used = now

    def prewarm(self, spec: SandboxSpec, count: int, idle_timeout: float | None) -> Pool:
        pool = self._pool(spec)
        pool.floor = count
        if idle_timeout is not None:
            pool.idle_timeout = idle_timeout
        pool.last_used = self.clock()
        self.resize()
        self.fill(spec)
        return pool

    def resize(self) -> None:
        """Every pool's target: its floor, plus its demand share within the budget."""
        now = self.clock()
        budget = self.demand.budget
        rows = []
        for spec in list(self.demand.keys) + [k for k in self.pools if k not in
                                              self.demand.keys]:
            pool = self.pools.get(spec)
            idle = pool.idle_timeout if pool else self.s.default_idle_timeout
            want = self.demand.want(spec, now, idle, self._leased.get(
                twin(spec, contract.ROLE_AGENT), 0))
            floor = pool.floor if pool else 0
            if want or floor:
                k = self.demand.keys.get(spec)
                rows.append((spec, floor, want, self.demand.expected(spec, now),
                             k.tenant if k else ""))
        targets = allocate(rows, budget)
        for spec, pool in self.pools.items():
            pool.target = targets.pop(spec, 0)
        for spec, n in targets.items():
            if n:
                self._pool(spec).target = n
        in_use = [(spec, len(p.warm) + p.building) for spec, p in self.pools.items()]
        metrics.warm_budget(sum(n for _, n in in_use), budget.pods,
                            sum(n * cpu_of(spec) for spec, n in in_use), budget.cpu)

    def fill(self, spec: SandboxSpec) -> None:
        pool = self.pools.get(spec)
        if pool is None:
            return
        need = pool.target - (len(pool.warm) + pool.building + pool.checking)
        for _ in range(max(0, need)):
            pool.building += 1
            # The pool's, not the request's that set it off: its lines carry no request id.
            logs.unbound(self.spawn, self._build(spec, pool), "warm-build")

    def refill(self, spec: SandboxSpec, pool: Pool) -> None:
        """fill() after a hand-out: at once when no other hand-out of the pool is in flight,
        else once none is (at most REFILL_DEFER_S later; one waiting refill per pool)."""
        if pool.checking == 0:
            self.fill(spec)
            return
        if pool.refill_waiting:
            return
        pool.refill_waiting = True

        async def later() -> None:
            deadline = time.monotonic() + REFILL_DEFER_S
            try:
                while pool.checking > 0 and time.monotonic() < deadline:
                    await asyncio.sleep(REFILL_POLL_S)
            finally:
                pool.refill_waiting = False
                self.fill(spec)

        logs.unbound(self.spawn, later(), "warm-refill")

    async def _build(self, spec: SandboxSpec, pool: Pool) -> None:
        token, token_sha = token_pair()
        e = self.books.add(Entry(new_name("warm"), spec, POOL_JOB, secrets.token_hex(8), token,
                                 warm_build=True))
        try:
            await self.pipeline.own(e, token_sha, self.s.ready_budget)
        finally:
            pool.building -= 1

    # ---- hand-out ---------------------------------------------------------------------------
    async def take(self, order: AcquireOrder, lifetime: float | None = None,
                   refused: list[str] | None = None, max_refused: int = 1) -> dict | None:
        """A warm pod of exactly the order's spec, handed out to its job; None when there is
        none. With declared conditions, a pod contradicting them is refused (its message
        appended to `refused`) and the next one tried, until `max_refused` refusals in all. A
        pod an earlier grading ran in (reuse_count > 0) only with `reused_ok`, and only to the
        tenant that grading belonged to: by default a grading gets a never-used pod, and a pod
        never crosses tenants."""
        spec, job, reused_ok = order.spec, order.job, order.reused_ok
        pool = self.pools.get(spec)
        if pool is None:
            return None
        pool.last_used = self.clock()
        refused = refused if refused is not None else []
        tenant = tenant_of(self.s, job)
        while len(refused) < max_refused:
            # Oldest first; surplus is trimmed newest first.
            e = next((x for x in pool.warm if not x.reuse_count
                      or (reused_ok and x.reuse_tenant == tenant)), None)
            if e is None:
                break
            self.books.move(e, S.CHECKING, "taken for an acquire")
            try:
                got = await self._hand_out(e, order, lifetime or self.s.default_lifetime,
                                           refused)
            except BaseException:
                # The caller was cancelled mid-check, or an API call failed: the pod may already
                # carry the caller's labels, so it goes (fail closed, never back to the pool).
                if e.stage is S.CHECKING:
                    self.pipeline.delete(e, "warm hand-out interrupted")
                raise
            finally:
                if pool.target > 0:
                    self.refill(spec, pool)  # the replacement goes through the same bucket
            if got is not None:
                return got
        return None

    async def _hand_out(self, e: Entry, order: AcquireOrder, lifetime: float,
                        refused: list[str] | None = None) -> dict | None:
        job, owner, labels, conditions = order.job, order.owner, order.labels, order.conditions
        t0 = time.monotonic()
        if self.s.ready_check == "pod":
            ok = P.is_ready(self.books.pods.get(e.name))
        else:
            ok = e.ip is not None and await self.pipeline.healthy(e.ip, e.token)  # has its IP
        if e.stage is not S.CHECKING:  # drained or deleted meanwhile: its delete stands
            return None
        if not ok:
            self.pipeline.delete(e, "warm pod failed its health check")
            return None
        check = None
        if conditions:
            v = await self.pipeline.check_conditions(e, conditions)
            if e.stage is not S.CHECKING:
                return None
            if not v.ok:
                self.pipeline.refuse(e, v)
                if refused is not None:
                    refused.append(f"pod {e.name} refused: {v.message()}")
                return None
            check = v.answer()
        ref = ({"apiVersion": "v1", "kind": "Pod", "name": owner["name"], "uid": owner["uid"]}
               if owner else await self.creator.owner_ref(job))
        # A warm pod never expires: its lifetime starts here, at hand-out.
        expires = P.lease_end(lifetime)
        try:
            await self.pipeline.kube.patch_pod(e.name, {"metadata": {
                "labels": {contract.LABEL_STATE: contract.STATE_LEASED,
                           contract.LABEL_JOB: job, **tenant_labels(self.s, job), **labels},
                "annotations": P.lease_annotations(lifetime, expires),
                "ownerReferences": [ref]}})
        except Exception as ex:  # noqa: BLE001
            self.pipeline.delete(e, f"warm hand-out patch failed: {ex}")
            return None
        if e.stage is not S.CHECKING:
            return None
        # Move the pod's count from the pool to the job for the per-job caps.
        if e.slot:
            e.slot.gone()
        e.slot = self.pacer.adopt(job)
        e.job, e.owner, e.labels = job, owner, labels
        e.lifetime, e.expires_at = lifetime, expires
        e.conditions, e.conditions_check = conditions, check
        self.books.move(e, S.LEASED, "warm hand-out")
        log.info("handed out %s (warm)", e.name, extra=self.books.fields(e))
        e.timings = {"queued_ms": 0.0, "create_ms": 0.0, "started_ms": 0.0,
                     "ready_ms": ms(time.monotonic() - t0)}
        # A pod an earlier grading ran in says so: the SDK may shadow its verdict.
        return {**self.pipeline.result(e, warm=True), "reuses": e.reuse_count}

    # ---- checked reuse: a released grading pod back to its pool ------------------------------
    async def give_back(self, e: Entry) -> bool:
        """`e` is a LEASED grading pod its caller released with reuse. Rotate execd's token
        first (the old holder loses access before anything is checked), restore, re-check
        `/diff` is clean, then park it in its key's pool with a new token for the next holder.
        True: back in the pool; False: deleted (or gone meanwhile)."""
        if e.reuse_count >= self.s.max_reuse:
            metrics.retired("max_reuse")
            self.pipeline.delete(e, f"reused {e.reuse_count} times (--max-reuse)")
            return False
        self.books.move(e, S.CHECKING, "released for reuse")
        token, token_sha = token_pair()
        try:
            why = await self._restore(e, token, token_sha)
        except BaseException:
            if e.stage is S.CHECKING:
                self.pipeline.delete(e, "reuse interrupted")
            raise
        if e.stage is not S.CHECKING:  # drained or deleted meanwhile: its delete stands
            return False
        if why:
            metrics.RESTORE_FAILURES.inc()
            self.pipeline.delete(e, f"not restorable: {why}")
            return False
        drop = {k: None for k in {**e.labels, **tenant_labels(self.s, e.job)}}
        try:
            await self.pipeline.kube.patch_pod(e.name, {"metadata": {
                "labels": {**drop, contract.LABEL_STATE: contract.STATE_WARM,
                           contract.LABEL_JOB: POOL_JOB},
                "annotations": {**{k: None for k in P.LEASE_ANNOTATIONS},
                                contract.ANNOTATION_REUSE_COUNT: str(e.reuse_count + 1)},
                # replace, not merge (by uid): the last holder's owner must not stay, or its
                # job's drain or its pod's deletion would take the pool's pod with it
                "ownerReferences": [await self.creator.owner_ref(POOL_JOB),
                                    {"$patch": "replace"}]}})
        except Exception as ex:  # noqa: BLE001
            self.pipeline.delete(e, f"reuse patch failed: {ex}")
            return False
        if e.stage is not S.CHECKING:
            return False
        if e.slot:
            e.slot.gone()
        e.slot = self.pacer.adopt(POOL_JOB)
        e.token, e.reuse_count = token, e.reuse_count + 1
        e.reuse_tenant = tenant_of(self.s, e.job)
        e.job, e.owner, e.labels = POOL_JOB, None, {}
        e.lifetime = e.expires_at = None
        e.renewed = False
        e.warm_since = time.monotonic()
        # PARKED, not WARM: not counted as built surplus; it waits out its key's idle timeout.
        self.books.move(e, S.PARKED, f"restored for reuse ({e.reuse_count})")
        metrics.REUSES.inc()
        return True

    async def _restore(self, e: Entry, token: str, token_sha: str) -> str | None:
        """execd: new token, /restore, /diff; None when clean, else why not."""
        if not e.ip or not e.token:
            return "no address or no known token (books rebuilt since the hand-out?)"
        step = "token rotation"
        try:
            async with ExecdClient(self.s.execd_port, self.s.restore_timeout,
                                   trust_env=False) as c:
                await c.rotate_token(e.ip, e.token, token_sha)
                step = "restore"
                got = await c.restore(e.ip, token)
                if not got.restored:
                    return f"restore left {got.left!r:.300}"
                step = "diff"
                d = await c.diff(e.ip, token)
                if not d.clean:
                    return f"not clean after restore: {d.changes!r:.300}"
        except ExecdRefused as r:
            return f"{step}: HTTP {r.status}" + (f": {r.text}" if step == "restore" else "")
        except (httpx.HTTPError, ValueError) as ex:
            return f"execd: {type(ex).__name__}: {ex}"
        return None

    # ---- maintenance (once a second) ----------------------------------------------------------
    def tick(self) -> None:
        now = self.clock()
        for e in list(self._pooled):
            self._idle_until(e, now)
        for pool in self.pools.values():
            if pool.floor and now - pool.last_used > pool.idle_timeout:
                pool.floor = 0  # idle key: the admin's floor lapses, the pool is emptied
        self.resize()
        for spec, pool in list(self.pools.items()):
            built = [e for e in pool.warm if e.stage is S.WARM]
            while len(built) > pool.target:  # built surplus, newest first
                self.pipeline.delete(built.pop(), "warm surplus or idle")
            for e in [e for e in pool.warm
                      if e.stage is S.PARKED and now - (e.warm_since or now) > pool.idle_timeout]:
                self.pipeline.delete(e, "parked pod idle")  # waits out its key's idle timeout
            if pool.target:
                self.fill(spec)

