"""The idle rule (--pause-idle-after, off at 0; docs/controller.md "Idle pause"): a handed-out
agent sandbox whose holder made no call to its execd for that long is paused through the
pause path (a checkpoint of it, then its release). The holder finds the checkpoint's id by
asking for the sandbox (410 SandboxPaused, to its own tenant only) and resumes it from there.

Each tick asks at most TICK_MAX execds (`GET /activity`, which is not use), those asked
longest ago first. A sandbox is idle only when execd says so AND this controller has known
it handed out for that long (a warm pod's execd was idle before its hand-out). One whose
checkpoint failed stays leased and is not tried again before its back-off ends; one its
holder used during the checkpoint stays leased (that checkpoint expires unused)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import httpx

from controller import metrics
from controller.books import State
from controller.errors import AcquireError
from controller.execd_client import ExecdClient, ExecdRefused
from controller.fork import one_line
from controller.paused import Paused, PausedSandbox, Unrecorded, until_of
from sandman import contract

if TYPE_CHECKING:
    from controller.books import Entry
    from controller.core import Controller

log = logging.getLogger("controller.idle")

TICK_MAX = 32  # execds asked per tick
ASK_CONCURRENCY = 8
ASK_TIMEOUT_S = 5.0
PAUSE_TIMEOUT_S = 600.0  # one pause's checkpoint
BACKOFF_MAX_S = 3600.0
USED_SLACK_S = 0.5  # clock rounding between two /activity reads


def tick_s(after: float) -> float:
    """Seconds between ticks: a quarter of the rule, within [1, 60]."""
    return min(60.0, max(1.0, after / 4))


def backoff_s(after: float, fails: int) -> float:
    """Wait before trying again a sandbox whose pause failed `fails` times: the rule's time,
    doubled at each failure, at most BACKOFF_MAX_S."""
    return min(BACKOFF_MAX_S, max(after, 10.0) * 2 ** min(fails - 1, 16))


def pausable(e: Entry) -> bool:
    """A handed-out agent sandbox this controller holds the token of."""
    return (e.stage is State.LEASED and e.spec.role != contract.ROLE_GRADING
            and bool(e.token) and bool(e.ip))


def due(entries: Iterable[Entry], now: float, asked: dict[str, float],
        retry_at: dict[str, float], limit: int = TICK_MAX) -> list[Entry]:
    """The sandboxes to ask this tick: pausable, out of back-off, asked longest ago first."""
    got = [e for e in entries if pausable(e) and retry_at.get(e.id, 0.0) <= now]
    got.sort(key=lambda e: asked.get(e.id, 0.0))
    return got[:limit]


def idle_for(idle_s: float, busy: int, known_s: float) -> float:
    """Seconds the sandbox counts as idle: 0 while a request runs, else execd's idle time,
    at most the time this controller has known it handed out."""
    return 0.0 if busy else min(idle_s, known_s)


def used_since(first_at: float, first_idle: float, now: float, idle_s: float,
               busy: int) -> bool:
    """Whether a call came between two reads of /activity (the first at `first_at` answering
    `first_idle`, the second at `now`): its last use moved later, or one runs."""
    return bool(busy) or (now - idle_s) > (first_at - first_idle) + USED_SLACK_S


class IdleRule:
    def __init__(self, ctl: Controller):
        self.c = ctl
        self.after = ctl.s.pause_idle_after
        self.paused: Paused = ctl.paused  # the controller's, shared with the pause route
        self.known: dict[str, float] = {}  # id -> monotonic time first seen handed out
        self.asked: dict[str, float] = {}
        self.retry_at: dict[str, float] = {}
        self.fails: dict[str, int] = {}
        self.execd = ExecdClient(ctl.s.execd_port, ASK_TIMEOUT_S, trust_env=False)

    async def close(self) -> None:
        await self.execd.aclose()

    async def loop(self) -> None:
        if not self.after:
            return
        while True:
            await asyncio.sleep(tick_s(self.after))
            try:
                await self.tick()
            except Exception as ex:  # noqa: BLE001 - the next tick tries again
                log.warning("idle rule: %s", one_line(ex))

    def _failed(self, sid: str) -> float:
        """One more failed pause of `sid` (counted): the seconds before its next try."""
        n = self.fails.get(sid, 0) + 1
        self.fails[sid] = n
        wait = backoff_s(self.after, n)
        self.retry_at[sid] = time.monotonic() + wait
        metrics.idle_paused("failed")
        return wait

    def _forget_gone(self, now: float) -> None:
        live = {e.id for e in list(self.c.books.entries.values()) if pausable(e)}
        for d in (self.known, self.asked, self.retry_at, self.fails):
            for sid in [s for s in d if s not in live]:
                del d[sid]
        for sid in live:
            self.known.setdefault(sid, now)

    async def tick(self) -> int:
        """One round: returns the sandboxes paused."""
        now = time.monotonic()
        self._forget_gone(now)
        batch = due(list(self.c.books.entries.values()), now, self.asked, self.retry_at)
        gate = asyncio.Semaphore(ASK_CONCURRENCY)

        async def one(e: Entry) -> bool:
            async with gate:
                return await self._one(e)
        got = await asyncio.gather(*(one(e) for e in batch))
        return sum(got)

    async def _ask(self, e: Entry) -> tuple[float, float, int] | None:
        assert e.ip and e.token
        try:
            a = await self.execd.activity(e.ip, e.token)
        except (ExecdRefused, httpx.HTTPError, ValueError) as ex:
            log.info("idle rule: %s's execd did not say its activity: %s", e.id,
                     one_line(ex))
            return None
        return time.monotonic(), a.idle_s, a.busy

    async def _one(self, e: Entry) -> bool:
        sid = e.id
        self.asked[sid] = time.monotonic()
        first = await self._ask(e)
        if first is None or not pausable(e):
            return False
        at, idle_s, busy = first
        idle = idle_for(idle_s, busy, at - self.known.get(sid, at))
        if idle < self.after:
            return False
        try:
            ck = await self.c.checkpoints.checkpoint([e], PAUSE_TIMEOUT_S)
        except AcquireError as ex:
            wait = self._failed(sid)
            log.warning("idle rule: sandbox %s (job %s) idle %.0fs, its checkpoint failed "
                        "(left leased, next try in %.0fs): %s", sid, e.job, idle, wait,
                        one_line(ex))
            return False
        second = await self._ask(e) if pausable(e) else None
        if second is None or used_since(at, idle_s, *second):
            # Used meanwhile (or not known): the holder keeps it; the checkpoint expires.
            metrics.idle_paused("used")
            log.info("idle rule: sandbox %s (job %s) was used during its checkpoint %s: "
                     "left leased", sid, e.job, ck.id)
            return False
        # Recorded (in the API server too) before the release: the holder's next look finds
        # the checkpoint, never a bare 404, also from a new leader.
        try:
            await self.paused.record(sid, PausedSandbox(e.job, ck.id, until_of(ck.expires_at)))
        except Unrecorded as ex:
            wait = self._failed(sid)
            log.warning("idle rule: sandbox %s (job %s) left leased (next try in %.0fs): "
                        "%s; its checkpoint %s is valid until its TTL", sid, e.job, wait,
                        ex, ck.id)
            return False
        if not await self.c.release(sid):  # its holder released it meanwhile
            await self.paused.unrecord([sid])
            return False
        metrics.idle_paused("ok")
        log.info("idle rule: paused sandbox %s (job %s, pod %s) after %.0fs idle: checkpoint "
                 "%s, expires %s", sid, e.job, e.name, idle, ck.id, ck.expires_at)
        return True
