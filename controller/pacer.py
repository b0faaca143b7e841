"""The one gate every create passes: a token bucket, caps on concurrent creates and live pods
(global and per job), and a queue that is fair across jobs.

The paper's costliest incidents came from creates that went around a limit: unpaced bursts that
took down a shared webhook, and a fallback path that bypassed the pod cap (56 -> 96 pods in 35 s).
So there is no other way to get a create slot than `Pacer.acquire()`.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field


class QueueFull(Exception):
    """Raised by acquire(wait=False) when no slot is free now."""


@dataclass
class Limits:
    rate: float = 20.0  # creates/s, sustained
    burst: int = 40  # creates allowed at once after idle
    max_creating: int = 200  # create calls + pods not yet Ready, at once
    max_live: int = 20000  # pods that exist (any state) at once
    job_max_creating: int = 0  # 0: no per-job cap beyond the global one
    job_max_live: int = 0
    min_rate: float = 0.5  # the back-off never goes below this

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.burst < 1:
            raise ValueError("rate must be > 0 and burst >= 1")
        if self.max_creating < 1 or self.max_live < 1:
            raise ValueError("max_creating and max_live must be >= 1")
        if self.job_max_creating < 0 or self.job_max_live < 0:
            raise ValueError("per-job caps must be >= 0 (0: none)")


@dataclass
class _Waiter:
    job: str
    fut: asyncio.Future
    enqueued: float = field(default_factory=time.monotonic)


class Slot:
    """One granted create (or an adopted pod), counted against the caps until `gone()`.
    `done_creating()` when it stops counting as creating (Ready, or given up on); `gone()` when
    the pod is confirmed deleted or was never stored (the books call it when the entry reaches
    a terminal state). Each happens at most once; `gone()` implies `done_creating()`."""

    def __init__(self, pacer: Pacer, job: str):
        self._p = pacer
        self.job = job
        self._creating = True
        self._live = True

    def done_creating(self) -> None:
        if self._creating:
            self._creating = False
            self._p._dec("creating", self.job)

    def gone(self) -> None:
        self.done_creating()
        if self._live:
            self._live = False
            self._p._dec("live", self.job)


class Pacer:
    def __init__(self, limits: Limits, clock=time.monotonic):
        self.limits = limits
        self._clock = clock
        self._tokens = float(limits.burst)
        self._last = clock()
        self.rate = limits.rate  # current rate; lowered by back-off, recovers toward limits.rate
        self._queues: dict[str, collections.deque[_Waiter]] = collections.OrderedDict()
        self._rr: collections.deque[str] = collections.deque()  # round-robin order of jobs
        self.creating = 0
        self.live = 0
        self.job_creating: collections.Counter[str] = collections.Counter()
        self.job_live: collections.Counter[str] = collections.Counter()
        self.granted = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._backoff_until = 0.0

    # -- public --------------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._dispatch(), name="pacer")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def acquire(self, job: str, wait: bool = True) -> Slot:
        """Wait for a create slot for `job`. Cancelling the wait withdraws it (no create)."""
        self._refill()
        if not wait and not (self._queue_empty() and self._can_grant(job) and self._tokens >= 1):
            raise QueueFull(self._why_not(job))
        fut = asyncio.get_running_loop().create_future()
        q = self._queues.get(job)
        if q is None:
            q = self._queues[job] = collections.deque()
            self._rr.append(job)
        q.append(_Waiter(job, fut))
        self._wake.set()
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                # Granted in the same tick as the cancel: hand the slot back, never leak it.
                fut.result().gone()
            else:
                self._remove(job, fut)
            raise

    def adopt(self, job: str, creating: bool = False) -> Slot:
        """Count a pod that already exists (books rebuilt after a restart) against the caps."""
        s = Slot(self, job)
        self.live += 1
        self.job_live[job] += 1
        if creating:
            self.creating += 1
            self.job_creating[job] += 1
        else:
            s._creating = False
        return s

    def slow_down(self) -> None:
        """The API server said 429 or 5xx: halve the rate; it recovers over ~10 s of quiet."""
        self.rate = max(self.limits.min_rate, self.rate / 2)
        self._backoff_until = self._clock() + 10.0

    def queue_depth(self) -> dict[str, int]:
        return {j: len(q) for j, q in self._queues.items() if q}

    # -- internals -----------------------------------------------------------------------------
    def _queue_empty(self) -> bool:
        return not any(self._queues.values())

    def _why_not(self, job: str) -> str:
        lim = self.limits
        if self.live >= lim.max_live:
            return f"live pods at the cap ({lim.max_live})"
        if self.creating >= lim.max_creating:
            return f"concurrent creates at the cap ({lim.max_creating})"
        if lim.job_max_live and self.job_live[job] >= lim.job_max_live:
            return f"job {job} at its live-pod cap ({lim.job_max_live})"
        if lim.job_max_creating and self.job_creating[job] >= lim.job_max_creating:
            return f"job {job} at its concurrent-create cap ({lim.job_max_creating})"
        if not self._queue_empty():
            return "other creates are queued"
        return f"create rate limit ({self.rate:g}/s) reached"

    def _can_grant(self, job: str) -> bool:
        lim = self.limits
        return (self.live < lim.max_live and self.creating < lim.max_creating
                and not (lim.job_max_live and self.job_live[job] >= lim.job_max_live)
                and not (lim.job_max_creating and self.job_creating[job] >= lim.job_max_creating))

    def _refill(self) -> None:
        now = self._clock()
        if self.rate < self.limits.rate and now >= self._backoff_until:
            # Additive recovery: back to full rate within about 10 s of no further errors.
            self.rate = min(self.limits.rate, self.rate + self.limits.rate * (now - self._last) / 10)
        self._tokens = min(float(self.limits.burst), self._tokens + (now - self._last) * self.rate)
        self._last = now

    def _remove(self, job: str, fut: asyncio.Future) -> None:
        q = self._queues.get(job)
        if q:
            for w in q:
                if w.fut is fut:
                    q.remove(w)
                    break
        self._wake.set()

    def _dec(self, what: str, job: str) -> None:
        if what == "creating":
            self.creating -= 1
            self.job_creating[job] -= 1
        else:
            self.live -= 1
            self.job_live[job] -= 1
        self._wake.set()

    def _grant_one(self) -> bool:
        """Grant the next waiter in round-robin order whose job is under its caps."""
        for _ in range(len(self._rr)):
            job = self._rr[0]
            self._rr.rotate(-1)
            q = self._queues.get(job)
            while q and q[0].fut.done():  # cancelled waiters
                q.popleft()
            if not q:
                continue
            if not self._can_grant(job):
                continue
            w = q.popleft()
            self._tokens -= 1
            self.creating += 1
            self.live += 1
            self.job_creating[job] += 1
            self.job_live[job] += 1
            self.granted += 1
            w.fut.set_result(Slot(self, job))
            return True
        # Forget jobs with empty queues so the rotation stays short.
        for job in [j for j, q in self._queues.items() if not q]:
            del self._queues[job]
            self._rr.remove(job)
        return False

    async def _dispatch(self) -> None:
        while True:
            self._wake.clear()
            self._refill()
            progressed = False
            while self._tokens >= 1 and self._grant_one():
                progressed = True
            if progressed:
                await asyncio.sleep(0)  # let granted creates start before granting more
                continue
            delay = None
            if self._tokens < 1 and not self._queue_empty():
                delay = (1 - self._tokens) / self.rate
            # asyncio.wait, not wait_for: on 3.11 wait_for can swallow a cancel that races
            # with the event, and stop() would then wait forever.
            waiter = asyncio.ensure_future(self._wake.wait())
            try:
                await asyncio.wait({waiter}, timeout=delay)
            finally:
                waiter.cancel()
