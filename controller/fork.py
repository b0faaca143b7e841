"""Fork: n new sandboxes of a handed-out one's spec, tenant and job, each holding its state at
the call (docs/controller.md, "Fork").

The children are acquired through the normal acquire path (pacer, fairness, quotas, warm pool,
the parent's image by digest); meanwhile the parent's execd streams its state (`/snapshot`: a
tar, then its SHA-256) once into a spool bounded by its cap, and the digest is checked before
any child sees a byte; then each child's execd applies it (`/snapshot/apply`), a few at a time.
The snapshot is data: it is never unpacked or parsed here, only counted, hashed and relayed.

All or nothing: when any step fails, or the caller leaves (the route cancels the fork), every
task is cancelled and every child already handed out is released, in a task of its own that
the caller's cancel cannot interrupt; a child still being made is orphaned to the pipeline,
which parks or deletes it (controller/pipeline.py).
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import IO, TYPE_CHECKING

import httpx

from controller import metrics
from controller.books import State
from controller.errors import AcquireError, BadRequest, ForkFailed, SandboxGone
from controller.execd_client import (
    SNAPSHOT_ARCHIVE_MAX,
    ExecdClient,
    ExecdRefused,
    SnapshotBroken,
)
from controller.pods import AcquireOrder
from sandman import contract

if TYPE_CHECKING:
    from controller.core import Controller

log = logging.getLogger("controller.fork")

# Children whose copy is sent at once: each send reads the one spool from disk past
# SPOOL_IN_MEMORY, and a parent's state is sent n times over the pod network.
APPLY_CONCURRENCY = 8
SPOOL_IN_MEMORY = 1 << 20  # a snapshot this small never touches the disk


def one_line(text: object, limit: int = 300) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[:limit - 3] + "..."


class _Step(Exception):
    """A step's failure, already worded for the caller: `result` is its metric label."""

    def __init__(self, result: str, error: AcquireError):
        super().__init__(str(error))
        self.result, self.error = result, error


class Forker:
    def __init__(self, ctl: Controller):
        self.c = ctl
        # The controller's own connections to pods: never a proxy from the environment.
        self.execd = ExecdClient(ctl.s.execd_port, ctl.s.health_timeout, trust_env=False)

    async def close(self) -> None:
        await self.execd.aclose()

    async def fork(self, sid: str, n: int, timeout_s: float,
                   request_id: str | None = None) -> list[dict]:
        """The children's acquire answers, in order; raises one AcquireError on any failure,
        after every child was released. `request_id` (caller-scoped) keys the whole call
        (controller/requests.py): a retry gets the same children, never a second copy of the
        parent's state applied to them."""
        return await self.c.requests.once(
            "fork", sid, request_id, n, lambda: self._fork(sid, n, timeout_s),
            lambda children: all(self.c.leased(ch["id"]) for ch in children))

    async def _fork(self, sid: str, n: int, timeout_s: float) -> list[dict]:
        t0 = time.monotonic()
        try:
            snapshots_on(self.c.s, "fork")
            parent = self._parent(sid)
        except AcquireError:
            metrics.forked("refused")
            raise
        deadline = t0 + timeout_s
        spool: IO[bytes] = tempfile.SpooledTemporaryFile(max_size=SPOOL_IN_MEMORY)
        got: list[dict | None] = [None] * n
        gate = asyncio.Semaphore(APPLY_CONCURRENCY)
        snap = asyncio.ensure_future(self._snapshot(parent, spool, deadline))
        kids = [asyncio.ensure_future(self._child(parent, i, n, got, snap, spool, gate,
                                                  deadline)) for i in range(n)]
        every: list[asyncio.Future] = [snap, *kids]
        ok = False
        try:
            # The parent's snapshot first: children waiting on it fail with its error too.
            ex = await first_failure(every)
            if ex is not None:
                if isinstance(ex, _Step):
                    metrics.forked(ex.result)
                    raise ex.error from None
                metrics.forked("other")
                raise AcquireError(f"fork of {sid}: internal error: {one_line(ex)}") from None
            children = [g for g in got if g is not None]
            assert len(children) == n  # every child task ended without an error
            ok = True
            size = snap.result()[0]
            metrics.FORK_SNAPSHOT_BYTES.observe(size)
            metrics.forked("ok", n, time.monotonic() - t0)
            log.info("forked %s into %s (%d bytes of state)", sid,
                     ", ".join(ch["id"] for ch in children), size)
            return children
        except asyncio.CancelledError:
            metrics.forked("client_closed")
            raise
        finally:
            if ok:
                spool.close()
            else:
                await undo_detached(self.c, f"fork of {sid}", every, got, spool.close)

    def _parent(self, sid: str):
        e = self.c.books.entries.get(sid)
        if e is None or e.stage is not State.LEASED:
            raise SandboxGone(f"no handed-out sandbox {sid} (released, drained or expired)")
        if e.spec.role == contract.ROLE_GRADING:
            raise BadRequest(f"sandbox {sid} has role {contract.ROLE_GRADING}: grading "
                             "sandboxes are never forked (their state is a grading's)")
        if not e.token or not e.ip:
            raise ForkFailed(f"fork of {sid}: this controller does not hold the sandbox's "
                             "token (it was handed out before the controller restarted)")
        return e

    async def _snapshot(self, parent, spool: IO[bytes], deadline: float) -> tuple[int, str]:
        sid = parent.id
        try:
            return await self.execd.snapshot(parent.ip, parent.token, spool,
                                             SNAPSHOT_ARCHIVE_MAX, _left(deadline))
        except ExecdRefused as ex:
            raise _Step("snapshot", ForkFailed(
                f"fork of {sid}: its execd answered {ex.status} to {ex.route.path}: "
                f"{one_line(ex.text)}")) from None
        except SnapshotBroken as ex:
            raise _Step("snapshot", ForkFailed(f"fork of {sid}: {one_line(ex)}; no child "
                                               "was given it")) from None
        except httpx.HTTPError as ex:
            raise _Step("snapshot", ForkFailed(
                f"fork of {sid}: reading its state from its execd failed: "
                f"{type(ex).__name__} {one_line(ex)}")) from None

    async def _child(self, parent, i: int, n: int, got: list[dict | None],
                     snap: asyncio.Future, spool: IO[bytes], gate: asyncio.Semaphore,
                     deadline: float, what: str = "fork") -> None:
        """One child acquired, then given the state in `spool` once `snap` has its (size,
        SHA-256). `what` names the call in errors (a checkpoint's restore uses it too)."""
        sid = parent.id
        order = AcquireOrder(
            parent.spec, parent.job, owner=parent.owner, labels=dict(parent.labels),
            timeout_s=_left(deadline), lifetime_s=parent.lifetime,
            conditions=parent.conditions)
        try:
            lease = await self.c.acquire(order)
        except AcquireError as ex:
            raise _Step("acquire", type(ex)(f"{what} of {sid}: child {i + 1} of {n}: "
                                            f"{one_line(ex)}", ex.events)) from None
        got[i] = lease  # ours from here: released by the undo if anything fails
        size, sha = await asyncio.shield(snap)
        async with gate:
            try:
                await self.execd.apply_snapshot(lease["address"], lease["token"], spool, size,
                                                sha, _left(deadline))
            except ExecdRefused as ex:
                raise _Step("apply", ForkFailed(
                    f"{what} of {sid}: child {lease['id']}'s execd answered {ex.status} to "
                    f"{ex.route.path}: {one_line(ex.text)}")) from None
            except (httpx.HTTPError, SnapshotBroken, ValueError) as ex:
                raise _Step("apply", ForkFailed(
                    f"{what} of {sid}: sending its state to child {lease['id']} failed: "
                    f"{type(ex).__name__} {one_line(ex)}")) from None


async def first_failure(tasks: Sequence[asyncio.Future]) -> BaseException | None:
    """Waits until every task ended or one failed: the first failure (in `tasks`' order), or
    None when all succeeded. The others are left running (the undo cancels them)."""
    await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    failed = [t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None]
    return failed[0].exception() if failed else None


async def undo_detached(ctl: Controller, what: str, tasks: Sequence[asyncio.Future],
                        got: Sequence[dict | None],
                        after: Callable[[], object] | None = None) -> None:
    """The undo of an all-or-nothing call that failed or whose caller left (a fork, a group):
    every task ended, then every sandbox already handed out (`got`) released. It runs in a
    task of its own: the caller's cancel cannot interrupt it halfway, and a create still in
    flight is orphaned to the pipeline by its cancelled acquire (parked or deleted there)."""
    undo = ctl._spawn(_undo(ctl, what, tasks, got, after), f"undo-{what}")
    try:
        await asyncio.shield(undo)
    except asyncio.CancelledError:
        pass  # the undo goes on by itself


async def _undo(ctl: Controller, what: str, tasks: Sequence[asyncio.Future],
                got: Sequence[dict | None], after: Callable[[], object] | None) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if after is not None:
        after()
    released = [ch["id"] for ch in got if ch is not None]
    for cid in released:
        await ctl.release(cid)
    if released:
        log.info("%s failed: released %s", what, ", ".join(released))


def snapshots_on(s, what: str) -> None:
    """Refuses `what` when the controller gives its pods no snapshot base: every child's or
    restored pod's execd would refuse the state anyway, after the pods were made."""
    if not s.snapshot_base:
        raise BadRequest(f"{what} needs sandboxes with a snapshot base, and this controller "
                         "makes none (--snapshot-base off, chart sandbox.snapshots)")


def _left(deadline: float) -> float:
    """Seconds left of the fork's budget (at least 1: a call past it fails on its own)."""
    return max(1.0, deadline - time.monotonic())
