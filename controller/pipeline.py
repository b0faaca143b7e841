"""The one owner pipeline, for acquires and warm builds alike, and the deletes that end it.

Ownership rule (the paper's table A21): from the moment a create is queued until its pod is
handed out or confirmed deleted, the pod belongs to an owner task here (`Pipeline.own`), never
to the caller. A caller that disconnects, times out or is cancelled only moves its entry
(`orphan`): a queued create is withdrawn, never sent; otherwise the owner lets the create
settle and then parks the pod warm (no per-caller state) or deletes it. A drain or release
(`unwant`) moves an in-flight entry to a *_DRAINED state: the owner deletes it once the create
settles. After every await the owner reads the entry's state again; only those moves (and the
informer's GONE) can have happened meanwhile (controller/books.py, TRANSITIONS).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from kubernetes import client

from controller import metrics, tracing
from controller import pods as P
from controller.books import DRAINED, ENDING, ORPHANED, POOL_JOB, Books, Entry, State
from controller.conditions import Checker, Comparison
from controller.create import Creator
from controller.errors import AcquireError, AcquireTimeout, ConditionsRefused, PodFailed
from controller.execd_client import ExecdClient
from controller.images import digest_of
from controller.kube import Kube
from controller.pacer import Pacer
from controller.pods import SandboxSpec
from controller.settings import Settings
from sandman import contract

log = logging.getLogger("controller")
S = State
# A started pod's execd is asked every EARLY_POLL_S until it answers: a refused connection
# costs the pod nothing, and the interval is what the hand-out can lose to it (25 ms mean).
EARLY_POLL_S = 0.05
EARLY_CONNECT_S = 0.5
READY_POLL_S = 0.2  # a Ready pod whose execd check failed (a slow or wedged pod)
# An acquire answer's `timings`, in ms: in the pacing queue, the create call, create stored ->
# the sandbox container seen running, create stored -> execd answered /ready (the hand-out).
TIMINGS = ("queued_ms", "create_ms", "started_ms", "ready_ms")

# The create settled and the pod is ours: the same fate, one phase on.
STORED = {S.CREATING: S.STARTING, S.CREATING_ORPHANED: S.STARTING_ORPHANED,
          S.CREATING_DRAINED: S.STARTING_DRAINED}
# The caller left (`orphan`): a queued create is withdrawn; a sent one is parked or deleted.
ORPHAN = {S.QUEUED: S.WITHDRAWN, S.CREATING: S.CREATING_ORPHANED,
          S.STARTING: S.STARTING_ORPHANED}
# Drained or released before the create settled (`unwant`): deleted once it settles.
UNWANT = {S.QUEUED: S.WITHDRAWN, S.CREATING: S.CREATING_DRAINED,
          S.CREATING_ORPHANED: S.CREATING_DRAINED, S.STARTING: S.STARTING_DRAINED,
          S.STARTING_ORPHANED: S.STARTING_DRAINED}


def fail(e: Entry, err: AcquireError) -> None:
    """Answer the waiting caller (if any) with an error."""
    if e.handed is not None and not e.handed.done():
        e.handed.set_exception(err)
        e.handed.exception()  # mark retrieved: an abandoned caller may never read it


def ms(s: float) -> float:
    return round(s * 1000, 1)


class Pipeline:
    def __init__(self, kube: Kube, books: Books, pacer: Pacer, creator: Creator,
                 settings: Settings, spawn: Callable, has_room: Callable[[SandboxSpec], bool]):
        self.kube = kube
        self.books = books
        self.pacer = pacer
        self.creator = creator
        self.s = settings
        self.spawn = spawn
        self.has_room = has_room  # the warm pool: may a built pod of this key stay warm?
        self._execd = ExecdClient(settings.execd_port, settings.health_timeout)
        self.checker = Checker(settings.execd_port, settings.health_timeout,
                               settings.conditions_egress_probe)

    async def close(self) -> None:
        await self._execd.aclose()
        await self.checker.close()

    # ---- the owner task -----------------------------------------------------------------------
    async def own(self, e: Entry, token_sha: str, budget: float) -> None:
        """queue -> create -> Ready -> hand out (acquire) or keep warm (warm build), park or
        delete. `budget`: seconds from the create to Ready. Never cancelled by the caller;
        every exit leaves the pod handed out, warm, or being deleted."""
        try:
            if e.slot is None and e.stage is S.QUEUED:
                e.queue_wait = asyncio.ensure_future(self.pacer.acquire(e.job, role=e.spec.role))
                try:
                    with tracing.child("sandman queue"):
                        e.slot = await e.queue_wait
                except asyncio.CancelledError:
                    if e.stage is S.QUEUED:  # cancelled by something else than a withdraw
                        self.books.move(e, S.WITHDRAWN, "queue wait cancelled")
            if e.stage is S.WITHDRAWN:
                self.books.move(e, S.GONE, "withdrawn before the create was sent")
                fail(e, AcquireTimeout("withdrawn before the create was sent"))
                return
            self.books.move(e, S.CREATING, "create slot granted")
            t_c = time.monotonic()
            e.timings["queued_ms"] = ms(t_c - e.t_queued)
            if e.handed is not None:
                metrics.QUEUE_SECONDS.observe(t_c - e.t_queued)
            with tracing.child("sandman create pod", {"k8s.pod.name": e.name}):
                stored = await self.creator.create(e, token_sha)
            e.timings["create_ms"] = ms(time.monotonic() - t_c)
            if e.stage is S.GONE:  # stored, then deleted before the answer reached us
                fail(e, PodFailed(f"pod {e.name} was deleted while starting"))
                return
            if not stored:
                self.books.move(e, S.FAILED, f"create refused: {e.error}")
                fail(e, PodFailed(f"create refused: {e.error}"))
                return
            self.books.move(e, STORED[e.stage], "stored")
            e.t_created = time.monotonic()
            with tracing.child("sandman wait ready", {"k8s.pod.name": e.name}) as span:
                ok, why = await self.wait_ready(e, e.t_created + budget)
                tracing.set_attributes(span, {"sandman.ready": ok, "sandman.why": why or None})
            assert e.slot is not None  # a create holds its pacer slot (core.acquire) until here
            e.slot.done_creating()
            if ok and e.stage in DRAINED:  # drained during the last health probe
                ok, why = False, "was deleted while starting (drain)"
            elif ok and e.stage is S.GONE:
                ok, why = False, "was deleted while starting"
            if not ok:
                events = (await self.events(e) if e.handed is not None
                          and e.stage not in ORPHANED else [])
                self.delete(e, f"warm build: {why}" if e.warm_build else why)
                fail(e, PodFailed(f"pod {e.name} {why}", events))
                return
            e.timings["ready_ms"] = ms(time.monotonic() - e.t_created)
            metrics.create_to_ready(e.spec.role, time.monotonic() - e.t_created)
            if e.stage is S.STARTING_ORPHANED:
                await self._park_or_delete(e)
            elif e.warm_build:
                if self.has_room(e.spec):
                    e.warm_since = time.monotonic()
                    self.books.move(e, S.WARM, "warm build Ready")
                else:
                    self.delete(e, "warm surplus")
            elif await self.conditions_hold(e):
                await self._hand_out(e)
        except Exception as ex:  # noqa: BLE001 - the owner must clean up whatever happened
            log.exception("owner task for %s failed", e.name, extra=self.books.fields(e))
            self.fail_closed(e, f"owner error: {ex}")
            fail(e, AcquireError(f"internal error: {ex}"))

    # ---- declared run conditions (controller/conditions.py) -------------------------------
    async def conditions_hold(self, e: Entry) -> bool:
        """A fresh pod with declared conditions: True to hand it out; False when it was
        refused (deleted, its caller answered ConditionsRefused; the acquire tries another)."""
        if not e.conditions:
            return True
        v = await self.check_conditions(e, e.conditions)
        if v.ok:
            e.conditions_check = v.answer()
            return True
        self.refuse(e, v)
        fail(e, ConditionsRefused(f"pod {e.name} refused: {v.message()}"))
        return False

    async def check_conditions(self, e: Entry, declared: dict) -> Comparison:
        """Read the pod's conditions with the sandbox token this controller holds."""
        if not e.ip or not e.token:
            return Comparison(contradicted=[("probe", "an answer", "no pod IP or token")])
        return await self.checker.check(e.ip, e.token, declared)

    def refuse(self, e: Entry, v: Comparison) -> None:
        """The pod contradicts a declared condition: counted, an event, deleted."""
        for name, _, _ in v.contradicted:
            metrics.conditions_refused(name)
        msg = f"declared run conditions contradicted: {v.message()}"
        log.info("refusing %s: %s", e.name, msg, extra=self.books.fields(e))
        pod = self.books.pods.get(e.name) or {"metadata": {"name": e.name, "uid": e.uid}}
        self.spawn(self.kube.pod_event(pod, "ConditionsRefused", msg[:1000]),
                   f"event-{e.name}")
        self.delete(e, "conditions contradicted")

    def fail_closed(self, e: Entry, why: str) -> None:
        """Whatever went wrong, the pod goes: withdrawn if never sent, else deleted."""
        if e.stage in ENDING:
            return
        if e.stage is S.QUEUED:
            self.books.move(e, S.WITHDRAWN, why)
        if e.stage is S.WITHDRAWN:
            self.books.move(e, S.GONE, why)
        else:
            self.delete(e, why)

    async def _hand_out(self, e: Entry) -> None:
        lifetime = e.lifetime or self.s.default_lifetime
        expires = P.lease_end(lifetime)  # the clock starts at hand-out, not at the create
        patch = {"metadata": {"labels": {contract.LABEL_STATE: contract.STATE_LEASED, **e.labels},
                              "annotations": P.lease_annotations(lifetime, expires)}}
        try:
            await self.kube.patch_pod(e.name, patch)
        except Exception as ex:  # noqa: BLE001
            # Without the leased label a restart would delete a live sandbox: fail closed.
            self.delete(e, f"hand-out patch failed: {ex}")
            fail(e, PodFailed(f"pod {e.name} could not be marked leased: {ex}"))
            return
        if e.stage is S.STARTING:
            e.lifetime, e.expires_at = lifetime, expires
            self.books.move(e, S.LEASED, "handed out")
            log.info("handed out %s (created)", e.name, extra=self.books.fields(e))
            assert e.handed is not None  # a create for a caller carries its future
            e.handed.set_result(self.result(e, warm=False))
            return
        if e.stage is S.STARTING_ORPHANED:  # the caller left during the patch
            self.delete(e, "caller gone during hand-out")
        else:  # drained during the patch, or already gone
            self.delete(e, "drained during hand-out")
            fail(e, PodFailed(f"pod {e.name} was deleted while starting (drain)"))

    async def _park_or_delete(self, e: Entry) -> None:
        """A pod whose caller left after the create settled: reuse it warm when it holds no
        per-caller state (the paper's late grading pods), else delete it."""
        if e.eligible_for_warm():
            try:
                await self.kube.patch_pod(e.name, {"metadata": {
                    "labels": {contract.LABEL_STATE: contract.STATE_WARM,
                               contract.LABEL_JOB: POOL_JOB},
                    "ownerReferences": [await self.creator.owner_ref(POOL_JOB)]}})
            except Exception as ex:  # noqa: BLE001
                log.warning("parking %s failed (%s); deleting", e.name, ex,
                            extra=self.books.fields(e))
            else:
                if e.stage is S.STARTING_ORPHANED:
                    e.job = POOL_JOB
                    e.warm_since = time.monotonic()
                    self.books.move(e, S.PARKED, "late pod parked")  # the pool lists it
                    metrics.PARKED.inc()
                    return
        self.delete(e, "caller gone")

    def result(self, e: Entry, warm: bool) -> dict:
        return {"id": e.id, "pod": e.name, "address": e.ip, "port": self.s.execd_port,
                "token": e.token, "warm": warm,
                "timings": {k: e.timings.get(k, 0.0) for k in TIMINGS},
                "expires_at": P.iso_utc(e.expires_at) if e.expires_at else None,
                "lifetime_s": e.lifetime, "conditions": e.conditions_check,
                "image": e.spec.image, "image_digest": digest_of(e.spec.image)}

    async def events(self, e: Entry) -> list[str]:
        return await self.kube.pod_events(e.name) if e.uid else []

    # ---- callers and jobs letting go ----------------------------------------------------------
    def orphan(self, e: Entry) -> None:
        """The caller is gone. Before the create is sent: withdraw. After: the owner decides."""
        if e.stage in ORPHAN:
            self.books.move(e, ORPHAN[e.stage], "caller left")
            if e.stage is S.WITHDRAWN and e.queue_wait is not None:
                e.queue_wait.cancel()
        elif e.stage is S.LEASED and e.token is not None and e.handed is not None:
            # Handed out in the same tick the caller left: nobody holds the token.
            self.delete(e, "caller gone at hand-out")

    def unwant(self, e: Entry, why: str) -> None:
        """Drained or released: the pod goes, now or once its create settles. An owner that
        waits for Ready notices at the pod's next event (or when its budget runs out), as it
        always did; waking it here would delete sooner, but a drained warm build would then
        leave its pool below target before a following `prewarm 0` (window 15 counts creates)."""
        if e.stage in UNWANT:
            self.books.move(e, UNWANT[e.stage], why)
            if e.stage is S.WITHDRAWN and e.queue_wait is not None:
                e.queue_wait.cancel()
        else:
            self.delete(e, why)

    # ---- readiness ----------------------------------------------------------------------------
    async def wait_ready(self, e: Entry, deadline: float) -> tuple[bool, str]:
        assert e.t_created is not None  # set when the create was stored
        waker = self.books.waker(e.name)
        try:
            while True:
                if e.stage in DRAINED:
                    return False, "was deleted while starting (drain)"
                if e.stage is S.GONE:
                    return False, "was deleted while starting"
                pod = self.books.pods.get(e.name)
                if pod is not None and P.uid(pod) == e.uid:
                    bad = P.failure(pod)
                    if bad:
                        return False, bad
                    ip = P.pod_ip(pod)
                    ready = bool(P.is_ready(pod) and ip)
                    if "started_ms" not in e.timings and (ready or P.started(pod)):
                        e.timings["started_ms"] = ms(time.monotonic() - e.t_created)
                    # With the execd check, the controller asks execd itself from the moment
                    # its container runs, not after the kubelet's next probe tick (up to 1 s)
                    # and the status write that follows it.
                    early = bool(self.s.ready_check == "execd" and ip and not ready
                                 and P.started(pod))
                    if (ready or early) and ip:  # (both need the IP)
                        e.ip = ip
                        if self.s.ready_check == "pod" or await self.healthy(
                                ip, e.token, connect=EARLY_CONNECT_S if early else None):
                            return True, ""
                else:
                    ready = early = False
                left = deadline - time.monotonic()
                if left <= 0:
                    return False, "not Ready and answering execd /ready within the budget"
                # Event-driven: a pod change wakes us. Only an execd probe that failed on a
                # started or Ready pod is retried on a timer; a pod is in that window for well
                # under a second, so this is no per-pod polling at 12,000 pods.
                waker.clear()
                waiter = asyncio.ensure_future(waker.wait())
                try:
                    poll = EARLY_POLL_S if early else READY_POLL_S
                    await asyncio.wait({waiter}, timeout=min(left, poll) if (ready or early)
                                       else left)
                finally:
                    waiter.cancel()
        finally:
            self.books.drop_waker(e.name)

    async def healthy(self, ip: str, token: str | None,
                      connect: float | None = None) -> bool:
        """execd's /ready: forks a process and writes a file in the pod (a wedged pod with its
        pids or disk exhausted still answers /health), within 2 s. With the pod's `token`, only
        its own execd passes: a pod IP handed on while the last holder's execd still answers
        there (a lost node's pods, a lagging network teardown) is not Ready. `connect`: a
        shorter connect timeout, for the polls before the kubelet calls the pod Ready (a SYN
        the pod network drops while it is still being set up must not hold the next poll back
        3 s)."""
        return await self._execd.ready(ip, token, connect)

    # ---- deletes ------------------------------------------------------------------------------
    def delete(self, e: Entry, why: str) -> None:
        """Delete the pod, retried until the API confirms (idempotent)."""
        if e.stage in ENDING:
            return
        self.books.move(e, S.DELETING, why)
        log.info("deleting %s: %s", e.name, why, extra=self.books.fields(e))
        self.spawn(self._delete(e), f"delete-{e.name}")

    def adopt_for_delete(self, pod: dict, why: str) -> Entry:
        """A pod found in the cluster that no entry owns: count it, then delete it."""
        job = P.labels(pod).get(contract.LABEL_JOB, POOL_JOB)
        e = self.books.found(pod, self.pacer.adopt(job), S.DELETING)
        log.info("deleting %s: %s", e.name, why, extra=self.books.fields(e))
        self.spawn(self._delete(e), f"delete-{e.name}")
        return e

    async def _delete(self, e: Entry) -> None:
        """Retried until the API confirms (404 counts as done), 1 s to 30 s back-off (paper)."""
        backoff = 1.0
        marked = False
        while e.stage is not S.GONE:
            try:
                if not marked:
                    # Survives a restart: the rebuilt books redo a delete that was lost.
                    await self.kube.patch_pod(e.name, {"metadata": {"labels": {
                        contract.LABEL_STATE: contract.STATE_DELETING}}})
                    marked = True
                await self.kube.delete_pod(e.name, e.uid)
                metrics.deleted("ok")
                # The informer's DELETED event releases the live count; if the pod is already
                # absent from the cache, finish now.
                if e.name not in self.books.pods:
                    self.books.gone(e)
                return
            except client.ApiException as ex:
                if ex.status == 404 or (ex.status == 409 and e.uid):
                    # Gone, or the name now holds another pod (uid precondition): ours is gone.
                    metrics.deleted("gone")
                    self.books.gone(e)
                    return
                metrics.deleted("retry")
            except Exception:  # noqa: BLE001 - transport errors: retry
                metrics.deleted("retry")
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 30.0)
