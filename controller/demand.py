"""Demand sizing of the warm pool: how many warm pods each key should hold, from its recent
acquires, within a global warm budget. Pure logic on an injected clock (no I/O, no asyncio),
so the same inputs always give the same targets (tests/controller/test_demand.py,
`python -m bench.replay`).

Per key (`SandboxSpec`), with `now` from the pool's clock:
- acquire rate `lam`: an exponentially weighted moving average of the key's acquires per
  second with time constant TAU_S: each acquire adds 1/TAU_S, and the sum decays by
  exp(-dt/TAU_S). 60 s: a GRPO group's gradings arrive over minutes; a shorter constant forgets
  a group between two of its gradings, a longer one keeps a finished group's pods for minutes.
- refill time `R`: how long a fresh create takes from its queueing to Ready, measured on every
  create of this image and size whatever its role: `R = mean + REFILL_K * dev`, the mean an
  EWMA (weight REFILL_ALPHA for the newest) and `dev` the same EWMA of |sample - mean|, as
  TCP sizes its retransmission timeout (Jacobson/Karels, K = 4). The mean alone undercounts:
  create times are heavy-tailed (the paper: p50 about 5.5 s, p99 24-60 s), and in the replay
  (`python -m bench.replay`) sizing on the mean left 88% grading hits, on mean + 4 dev 95.6%.
  The first sample sets dev to half of it. None until one pod of it became Ready: demand
  never builds a spec that has not proved it starts (a bogus image or size is never built
  warm, whatever is requested).
- expected demand during one refill `m = lam * R` (Little's law); the target covers it at
  about Z standard deviations of a Poisson count: `ceil(m + Z * sqrt(m))`, at least 1 while
  the key is active. Z = 2 leaves a refill short ~2.5% of the time, in line with the >= 95%
  grading hits the paper's 300 s pool kept (94.5-97.7%).
- active: an acquire of the key within its idle timeout (default 300 s, the paper's sweet spot:
  94.5-97.7% hits at about half the idle cost of 2,100 s). A grading key is also active while
  its rollout twin (same image and size, role agent) was acquired within the idle timeout or
  holds a leased pod: every rollout is graded minutes later (1.42-1.59 grading pods per
  rollout in campaigns A-D), and without that signal each group's first grading would miss.
  An inactive key's target is 0.
- only keys of `roles` are sized by demand (default grading): grading acquisition sits on the
  learner's critical path, rollout acquisition at most 0.9% of step time, and a rollout key is
  requested by a whole group within a second and then not for 13-44 minutes, so a pool refilled
  after the burst would idle through the gap.

Each key's demand target is capped at `per_key`; an admin prewarm sets a floor that is always
granted. The budget (`pods`, `cpu`; floors count against it) is then handed out in rounds,
grading keys before rollout keys. A round gives one pod to each tenant (the one whose acquire
of the key was the latest; "" when unscoped), to its next key in a rotation that starts with
its key of the larger expected demand `m` (ties: the key's text); the tenant with the busiest
key goes first. So a tenant that spreads its acquires over thousands of keys gets as many pods
per round as one with a single key, and within a tenant every key has its first pod before any
has a second.
"""

from __future__ import annotations

import collections
import functools
import math
from collections import OrderedDict
from dataclasses import dataclass, replace

from sandman import contract
from sandman.quantity import parse_quantity

TAU_S = 60.0
REFILL_ALPHA = 0.3
REFILL_K = 4.0
Z = 2.0
# Keys remembered at once; the least recently acquired is forgotten first. A tenant that
# requests many distinct specs grows this table, never the pool: targets are capped per key
# and in total.
MAX_KEYS = 4096


def twin(spec, role: str):
    """The same image and size in another role."""
    return replace(spec, role=role)


def cpu_of(spec) -> float:
    """The cores a pod of `spec` requests."""
    return _cores(spec.cpu)


@functools.lru_cache(maxsize=1024)
def _cores(quantity: str) -> float:
    try:
        return float(parse_quantity(quantity))
    except Exception:  # noqa: BLE001 - validated at acquire; a bad one counts as one core
        return 1.0


@dataclass
class KeyDemand:
    rate: float = 0.0  # acquires/s at `at`
    at: float = 0.0
    last: float = -math.inf  # the last acquire of this key
    armed: float = -math.inf  # the last acquire of its rollout twin (grading keys)
    tenant: str = ""  # whose acquire (or rollout) was the latest; "" unscoped

    def lam(self, now: float, tau: float) -> float:
        return self.rate * math.exp(-max(0.0, now - self.at) / tau)


@dataclass(frozen=True)
class Budget:
    pods: int = 0  # 0: demand sizing off (floors only)
    cpu: float = 0.0  # cores; 0: no CPU bound beyond `pods`
    per_key: int = 8  # one GRPO group
    roles: tuple[str, ...] = (contract.ROLE_GRADING,)

    def __post_init__(self) -> None:
        if self.pods < 0 or self.cpu < 0 or self.per_key < 1:
            raise ValueError("warm budget: pods and cpu must be >= 0 and per_key >= 1")
        bad = set(self.roles) - set(contract.ROLES)
        if bad:
            raise ValueError(f"warm demand roles must be among {', '.join(contract.ROLES)}, "
                             f"not {', '.join(sorted(bad))}")


class Demand:
    def __init__(self, budget: Budget, tau: float = TAU_S, alpha: float = REFILL_ALPHA,
                 z: float = Z, max_keys: int = MAX_KEYS):
        self.budget = budget
        self.tau, self.alpha, self.z, self.max_keys = tau, alpha, z, max_keys
        self.keys: OrderedDict = OrderedDict()  # spec -> KeyDemand, least recent first
        self.refill: OrderedDict = OrderedDict()  # spec with role agent -> EWMA seconds
        self.refill_dev: dict = {}  # the same keys -> EWMA of |sample - refill|
        self.k = REFILL_K

    def _key(self, spec) -> KeyDemand:
        k = self.keys.get(spec)
        if k is None:
            k = self.keys[spec] = KeyDemand()
            while len(self.keys) > self.max_keys:
                self.keys.popitem(last=False)
        self.keys.move_to_end(spec)
        return k

    def acquired(self, spec, now: float, tenant: str = "") -> None:
        k = self._key(spec)
        k.rate = k.lam(now, self.tau) + 1.0 / self.tau
        k.at = k.last = now
        k.tenant = tenant
        if spec.role == contract.ROLE_AGENT:
            tw = self._key(twin(spec, contract.ROLE_GRADING))
            tw.armed, tw.tenant = now, tenant

    def ready(self, spec, seconds: float) -> None:
        """A fresh pod of `spec` became Ready `seconds` after it was queued."""
        if not seconds >= 0:
            return
        base = twin(spec, contract.ROLE_AGENT)
        old = self.refill.get(base)
        if old is None:
            self.refill[base], self.refill_dev[base] = seconds, seconds / 2
        else:
            self.refill_dev[base] = (self.alpha * abs(seconds - old)
                                     + (1 - self.alpha) * self.refill_dev[base])
            self.refill[base] = self.alpha * seconds + (1 - self.alpha) * old
        self.refill.move_to_end(base)
        while len(self.refill) > self.max_keys:
            self.refill_dev.pop(self.refill.popitem(last=False)[0], None)

    def refill_time(self, spec) -> float | None:
        """R = mean + K * mean deviation of the refill times (None: none measured)."""
        base = twin(spec, contract.ROLE_AGENT)
        r = self.refill.get(base)
        return None if r is None else r + self.k * self.refill_dev[base]

    def expected(self, spec, now: float) -> float:
        """m = lam * R: the acquires expected during one refill (0 without a measured R)."""
        k = self.keys.get(spec)
        r = self.refill_time(spec)
        if k is None or r is None:
            return 0.0
        return k.lam(now, self.tau) * r

    def active(self, spec, now: float, idle_timeout: float, twin_leased: int = 0) -> bool:
        k = self.keys.get(spec)
        if k is None:
            return False
        if now - k.last <= idle_timeout:
            return True
        if spec.role == contract.ROLE_GRADING:
            return now - k.armed <= idle_timeout or twin_leased > 0
        return False

    def want(self, spec, now: float, idle_timeout: float, twin_leased: int = 0) -> int:
        """The key's demand target before the budget: 0 when demand sizing is off, the role is
        not sized, the key is inactive or its spec never became Ready."""
        if not self.budget.pods or spec.role not in self.budget.roles:
            return 0
        if twin(spec, contract.ROLE_AGENT) not in self.refill:
            return 0
        if not self.active(spec, now, idle_timeout, twin_leased):
            return 0
        m = self.expected(spec, now)
        return min(self.budget.per_key, max(1, math.ceil(m + self.z * math.sqrt(m))))


def allocate(rows: list[tuple], budget: Budget) -> dict:
    """Targets within the budget. `rows`: (spec, floor, want, m[, tenant]) per key; floors
    first, in full, then the demand above them as the module docstring orders it."""
    out = {r[0]: r[1] for r in rows}
    pods = budget.pods - sum(out.values())
    cpu = budget.cpu - sum(r[1] * cpu_of(r[0]) for r in rows)
    for role in (contract.ROLE_GRADING, contract.ROLE_AGENT):
        # tenant -> its keys wanting more than they have, the busiest first
        queues: dict[str, collections.deque] = {}
        for r in sorted((r for r in rows if r[0].role == role and r[2] > r[1]),
                        key=lambda r: (-r[3], repr(r[0]))):
            queues.setdefault(r[4] if len(r) > 4 else "", collections.deque()).append(r)
        # the tenant whose busiest key expects the most goes first in every round
        tenants = sorted(queues, key=lambda t: (-queues[t][0][3], t))
        while tenants and pods > 0:
            for t in tenants:
                q = queues[t]
                while q:  # this tenant's next key that still fits the CPU left
                    r = q.popleft()
                    c = cpu_of(r[0])
                    if not (budget.cpu and c > cpu + 1e-9):
                        break
                else:
                    continue
                out[r[0]] += 1
                pods -= 1
                cpu -= c
                if out[r[0]] < r[2]:
                    q.append(r)  # to the back of its tenant's rotation
                if pods <= 0:
                    break
            tenants = [t for t in tenants if queues[t]]
    return out
