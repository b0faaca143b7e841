"""Group acquires: `count` sandboxes of one spec in one call (docs/controller.md, "Group
acquires"), for a trainer's N rollouts of one task.

Each member is one acquire through the normal path, so a group is paced as `count` creates
under the same budget, caps and fairness as single acquires (the pacer sees `count` waiters of
the job, served in its round-robin with every other job's), and the warm pool of the key serves
what it holds first. All or nothing, with fork's undo (controller/fork.py): on any member's
failure, or when the caller leaves, every member already handed out is released and every
create still queued or in flight is withdrawn, parked or deleted by the pipeline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from controller import metrics
from controller.errors import AcquireError, BadRequest
from controller.fork import first_failure, one_line, undo_detached
from controller.pods import AcquireOrder

if TYPE_CHECKING:
    from controller.core import Controller

log = logging.getLogger("controller.group")


def never_fits(ctl: Controller, job: str, count: int) -> str | None:
    """Why a group of `count` can never be had at once under the live-pod caps (its members
    would wait for the group's own pods to go), or None."""
    lim = ctl.pacer.limits
    if count > lim.max_live:
        return f"the controller's live-pod cap ({lim.max_live})"
    if lim.job_max_live and count > lim.job_max_live:
        return f"the job's live-pod cap ({lim.job_max_live})"
    if lim.tenant_max_live and ctl.s.tenants and count > lim.tenant_max_live:
        return f"the tenant's live-pod cap ({lim.tenant_max_live})"
    return None


async def acquire_group(ctl: Controller, order: AcquireOrder, count: int) -> list[dict]:
    """The members' acquire answers, in order; one AcquireError on any failure, after every
    member was released. `order.request_id` (caller-scoped) keys the whole call
    (controller/requests.py): a retry gets the same group, the members have no key of their
    own."""
    return await ctl.requests.once(
        "group", order.job, order.request_id, (order.spec, count),
        lambda: _group(ctl, replace(order, request_id=None), count),
        lambda leases: all(ctl.leased(g["id"]) for g in leases))


async def _group(ctl: Controller, order: AcquireOrder, count: int) -> list[dict]:
    t0 = time.monotonic()
    cap = never_fits(ctl, order.job, count)
    if cap is not None:
        metrics.grouped("refused")
        raise BadRequest(f"a group of {count} can never fit under {cap}; ask for fewer")
    got: list[dict | None] = [None] * count

    async def member(i: int) -> None:
        got[i] = await ctl.acquire(order)

    tasks = [asyncio.ensure_future(member(i)) for i in range(count)]
    ok = False
    what = f"group of {count} for job {order.job}"
    try:
        ex = await first_failure(tasks)
        if ex is not None:
            if isinstance(ex, AcquireError):
                metrics.grouped("refused" if isinstance(ex, BadRequest) else "acquire")
                raise type(ex)(f"{what}: {one_line(ex)}; no member was kept",
                               ex.events) from None
            metrics.grouped("other")
            raise AcquireError(f"{what}: internal error: {one_line(ex)}") from None
        leases = [g for g in got if g is not None]
        assert len(leases) == count  # every member ended without an error
        ok = True
        metrics.grouped("ok", leases, time.monotonic() - t0)
        log.info("%s: %s (%d warm)", what, ", ".join(g["id"] for g in leases),
                 sum(bool(g.get("warm")) for g in leases))
        return leases
    except asyncio.CancelledError:
        metrics.grouped("client_closed")
        raise
    finally:
        if not ok:
            await undo_detached(ctl, what, tasks, got)
