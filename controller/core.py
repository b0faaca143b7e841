"""The controller: the acquire/release API's entry points, wired onto the parts that do the
work (docs/controller.md, "Module map"):

- books.py      entries, their State and the one transition table; the informer's pod cache
- pipeline.py   the one owner pipeline (queue -> create -> Ready -> hand out / warm / park)
                and the deletes
- create.py     one create, never duplicated (read-back by nonce, 409 adoption, new names)
- warmpool.py   warm pods per key: builds, hand-out, trim
- sweep.py      books rebuilt from labels, the sweep, drain
- pacer.py      the one create gate; kube.py the API calls (the narrow `Kube` interface)
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import time
from dataclasses import replace

from controller import auth as A
from controller import lost as L
from controller import metrics, tracing
from controller import pods as P
from controller.books import (
    ENDING,
    ENTRY_STATES,
    POOL_JOB,
    POOLED,
    TERMINAL,
    Books,
    Entry,
    State,
)
from controller.checkpoint import Checkpoints
from controller.create import Creator, new_name, token_pair
from controller.errors import (
    AcquireError,
    AcquireTimeout,
    BadOwner,
    BadRequest,
    ConditionsRefused,
    NotLeader,
    QueueFullError,
)
from controller.events import CapacitySignals
from controller.fork import Forker
from controller.idle import IdleRule
from controller.images import Pins, dockerconfigs
from controller.kube import Informer, Kube
from controller.pacer import Pacer, QueueFull, one_tenant
from controller.paused import LOAD_ATTEMPTS, Paused
from controller.pipeline import Pipeline
from controller.pods import AcquireOrder, SandboxSpec
from controller.prepull import Prepuller
from controller.requests import Requests
from controller.settings import Settings
from controller.sweep import Sweeper
from controller.warmpool import Pool, WarmPool
from sandman import api, contract, egress
from sandman.quantity import parse_quantity

log = logging.getLogger("controller")

S = State


class Controller:
    def __init__(self, kube: Kube, settings: Settings, clock=time.monotonic):
        """`clock`: the pacer's and the warm pool's time source (a virtual one in
        `python -m bench.replay`)."""
        self.kube = kube
        self.s = settings
        self.pacer = Pacer(settings.limits, clock=clock,
                           tenant_of=A.tenant_of if settings.tenants else one_tenant)
        self.books = Books(on_move=self._moved, tenants=settings.tenants)
        self.creator = Creator(kube, self.books, self.pacer, settings)
        self.pipeline = Pipeline(kube, self.books, self.pacer, self.creator, settings,
                                 self._spawn, has_room=lambda spec: self.warm.has_room(spec))
        self.warm = WarmPool(self.books, self.pacer, self.pipeline, self.creator, settings,
                             self._spawn, clock)
        # A job's tags, resolved once to digests, recorded in the job's ConfigMap so that a
        # new leader keeps them (controller/images.py).
        self.pins = Pins(settings.image_pinning, settings.registry_insecure,
                         self._pull_credentials if settings.pod_template.get(
                             "imagePullSecrets") else None,
                         record=self.creator, proof_key=settings.books_key,
                         scope=settings.namespace)
        self.sweeper = Sweeper(kube, self.books, self.pacer, self.pipeline, self.creator,
                               settings, self._spawn)
        self.informer: Informer | None = None
        self.signals = CapacitySignals(settings.namespace)
        self.prepull = Prepuller(kube, self.pacer, settings)
        self.forker = Forker(self)
        self.checkpoints = Checkpoints(self)
        # Paused sandboxes (the pause route's and the idle rule's), recorded in the API
        # server so that a new leader still answers their holders 410 (controller/paused.py).
        self.paused = Paused(kube=kube, tenants=settings.tenants, key=settings.books_key,
                             scope=settings.namespace)
        self.idle = IdleRule(self)
        # Why handed-out sandboxes ended under their holders, and the nodes of leased pods
        # that are not Ready (controller/lost.py).
        self.lost = L.LostRecord()
        self.nodes = L.Nodes(self.books, lambda name: self.kube.read_node(name), self._end_lost,
                             settings.node_lost_after)
        self._event_watches: list = []
        self.ready = False
        self._tasks: set[asyncio.Task] = set()
        self._bg: list[asyncio.Task] = []
        self.requests = Requests()  # calls keyed by the caller's request_id

    @property
    def entries(self) -> dict[str, Entry]:
        return self.books.entries

    @property
    def pools(self) -> dict[SandboxSpec, Pool]:
        return self.warm.pools

    # ---- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.pacer.start()
        self.informer = self.kube.informer(loop, self._on_event)
        self.informer.start()
        await asyncio.wait_for(self.informer.synced.wait(), timeout=60)
        # After the first sync: the books' entries name this controller's pods by uid.
        self._event_watches = self.kube.event_watches(loop, self.signals.on_event)
        for w in self._event_watches:
            w.start()
        if self._event_watches:  # their first lists prime what happened before this leader
            waits = [loop.create_task(w.tried.wait()) for w in self._event_watches]
            _, late = await asyncio.wait(waits, timeout=30)
            for t in late:
                t.cancel()
        await self._load_paused()
        self.prepull.add(list(self.s.prepull_images), pinned=True)
        self._bg = [loop.create_task(self._maintain(), name="maintain"),
                    loop.create_task(self.sweeper.loop(), name="sweep"),
                    loop.create_task(self.prepull.run(), name="prepull"),
                    loop.create_task(self.checkpoints.loop(), name="checkpoint-sweep"),
                    loop.create_task(self.idle.loop(), name="idle-rule"),
                    loop.create_task(self.nodes.loop(), name="node-check")]
        self.ready = True

    async def _load_paused(self) -> None:
        """The paused record, read before this leader answers: a holder asking about a
        paused sandbox never gets 404 from a leader that has not read it (bounded retries; the
        start fails after them, as it does when the informer never syncs)."""
        for attempt in range(LOAD_ATTEMPTS):
            try:
                await self.paused.load()
                return
            except Exception as ex:  # noqa: BLE001 - the API server's answer, or none
                if attempt == LOAD_ATTEMPTS - 1:
                    raise RuntimeError(f"the paused record ({self.paused.where()}) could "
                                       f"not be read: {ex}") from None
                log.warning("paused record: read failed (%s), retrying", ex)
                await asyncio.sleep(min(5.0, 0.5 * 2 ** attempt))

    async def stop(self) -> None:
        self.ready = False
        for t in self._bg:
            t.cancel()
        await self.prepull.stop()  # bounded: its pullers' pods go with this leader
        if self.informer:
            self.informer.stop()
        for w in self._event_watches:
            w.stop()
        await self.pacer.stop()
        await self.pipeline.close()
        await self.forker.close()
        await self.checkpoints.close()
        await self.idle.close()

    def _spawn(self, coro, name: str) -> asyncio.Task:
        t = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        t.add_done_callback(_log_crash)
        return t

    def _on_event(self, kind: str, obj) -> None:
        if kind == "SYNC":
            self.sweeper.rebuild(obj)
            return
        self._leased_pod(kind, obj)
        late = self.books.observe(kind, obj)
        if late is not None and self.sweeper.mine(late):  # a create we had given up on was stored after all
            self.pipeline.adopt_for_delete(late, "late create")

    def _leased_pod(self, kind: str, pod: dict) -> None:
        """A handed-out sandbox's pod changed: deleted by another party (its reason is kept
        once the books call it gone), ended (Failed/Succeeded: it never runs again, so the
        lease ends), or not Ready (its node is read: controller/lost.py)."""
        e = self.books.entries.get(P.name(pod))
        if e is None or e.stage is not S.LEASED or (e.uid and e.uid != P.uid(pod)):
            return
        node = self.nodes.down(P.node_name(pod))
        if kind == "DELETED":
            e.lost = L.deleted_while_leased(pod, node)
        elif (pod.get("status") or {}).get("phase") in ("Failed", "Succeeded"):
            self._end_lost(e, L.ended_while_leased(pod, node))
        elif not P.is_ready(pod):
            self.nodes.poke()

    def _end_lost(self, e: Entry, ending: L.Ending) -> None:
        """End a lease under its holder (its pod failed, its node was lost): the pod is
        deleted and the reason kept for its holder's next call."""
        if e.stage is not S.LEASED:
            return
        e.lost = ending
        log.warning("sandbox %s lost: %s", e.id, ending.why, extra=self.books.fields(e))
        self.pipeline.delete(e, f"lost: {ending.why}")
        pod = self.books.pods.get(e.name) or {"metadata": {"name": e.name, "uid": e.uid}}
        self._spawn(self.kube.pod_event(pod, "SandboxLost", f"sandman ended the lease: "
                                        f"{ending.why}"), f"event-{e.name}")

    def _moved(self, e: Entry, old: State | None, new: State) -> None:
        self.warm.moved(e, old, new)
        if e.uid and new not in TERMINAL:  # set once the create is stored, or found on a pod
            self.signals.remember(e.uid, e.spec.role)
        if new in TERMINAL:
            metrics.LIVE.set(self.pacer.live)
            if e.lost is not None and new is S.GONE:
                self.lost.add(e.id, e.job, e.lost)
                metrics.lease_lost(e.lost.kind)

    async def _maintain(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.warm.tick()
            self.sweeper.expire()
            metrics.queued(self.pacer.queue_by_role())
            metrics.LIVE.set(self.pacer.live)
            metrics.CREATING.set(self.pacer.creating)
            metrics.pacing(self.pacer.limits, self.pacer.rate)

    # ---- acquire ----------------------------------------------------------------------------
    def validate(self, spec: SandboxSpec, job: str, labels: dict, owner: dict | None) -> None:
        if not contract.is_label_value(job or "", allow_empty=False):
            raise BadRequest(f"job {job!r} is not a valid label value (1-63 of [A-Za-z0-9-_.])")
        if not spec.image or any(c.isspace() for c in spec.image):
            raise BadRequest(f"image {spec.image!r} is not an image reference")
        if spec.egress not in (contract.EGRESS_DENY, contract.EGRESS_ALLOW):
            raise BadRequest(f"egress must be deny or allow, not {spec.egress!r}")
        if spec.egress_allow:
            self.validate_egress(spec)
        for what, q in (("cpu", spec.cpu), ("memory", spec.memory)):
            try:
                if parse_quantity(q) <= 0:
                    raise ValueError
            except Exception:  # noqa: BLE001 - any parse failure is the caller's bad input
                raise BadRequest(f"{what} {q!r} is not a positive Kubernetes quantity") from None
        if spec.ephemeral_storage is not None:
            try:
                if parse_quantity(spec.ephemeral_storage) <= 0:
                    raise ValueError
            except Exception:  # noqa: BLE001 - any parse failure is the caller's bad input
                raise BadRequest(f"ephemeral_storage {spec.ephemeral_storage!r} is not a "
                                 "positive Kubernetes quantity") from None
        gpu_max = self.s.policy.gpu_max
        if spec.gpu and spec.gpu > gpu_max:
            raise BadRequest(
                f"gpu {spec.gpu}: this cluster grants sandboxes no GPUs (chart "
                "sandbox.gpu.enabled)" if gpu_max == 0 else
                f"gpu {spec.gpu}: at most {gpu_max} per sandbox (chart sandbox.gpu.max)")
        if spec.workspace is not None and not spec.workspace.startswith("/"):
            raise BadRequest(f"workspace {spec.workspace!r} must be an absolute path")
        for k, v in labels.items():
            if k.startswith(contract.DOMAIN + "/") or k == contract.LABEL_MANAGED_BY:
                raise BadRequest(f"label {k!r} is reserved for sandman")
            if not contract.is_label_value(str(v)):
                raise BadRequest(f"label {k}={v!r}: value is not a valid label value")
        if owner is not None and not (owner.get("name") and owner.get("uid")):
            raise BadRequest("owner needs both name and uid of the caller's pod")

    async def acquire(self, order: AcquireOrder) -> dict:
        """`order.conditions`: declared run conditions (controller/conditions.py), checked in
        the pod before hand-out. `order.request_id` makes a retried acquire (its answer was
        lost) return the same sandbox instead of a second one, while the first is in flight or
        still leased."""
        # Keyed by the job (tenant-scoped) too: the same id in another job is another call.
        return await self.requests.once(
            "acquire", order.job, order.request_id, order.spec, lambda: self._acquire(order),
            lambda lease: self.leased(lease["id"]))

    def prove(self, e: Entry, tokens: dict[str, str] | None) -> None:
        """Learn back a sandbox's execd token from its holder after a restart: the token the
        caller sent for `e` is kept when its SHA-256 is the pod's annotation (constant-time
        compare). A known token is never replaced; a wrong one changes nothing (the call then
        fails as it would without it). Never an authorization: the route checked the
        caller's rights on `e` first."""
        given = (tokens or {}).get(e.id)
        if e.token or not given or not e.token_sha256 or e.stage is not S.LEASED:
            return
        if hmac.compare_digest(hashlib.sha256(given.encode()).hexdigest(),
                               e.token_sha256.lower()):
            e.token = given
            log.info("sandbox %s: execd token learned back from its holder", e.id,
                     extra=self.books.fields(e))

    def leased(self, sid: str) -> bool:
        """Is sandbox `sid` handed out (an earlier answer still good for a retry)?"""
        e = self.books.entries.get(sid)
        return e is not None and e.stage is S.LEASED

    async def _acquire(self, order: AcquireOrder) -> dict:
        order = replace(order, labels=dict(order.labels or {}))  # the books' own copy
        spec, job = order.spec, order.job
        self.validate(spec, job, order.labels, order.owner)
        self.validate_conditions(order.conditions)
        # Before any pool lookup: the warm key, the pod and the answer name the job's digest.
        spec = replace(spec, image=await self.pins.pin(job, spec.image))
        order = replace(order, spec=spec)
        lifetime = self.lifetime(order.lifetime_s)
        if not self.ready:
            raise NotLeader("this controller replica is not the leader; retry")
        if order.owner is not None:
            await self.check_owner(order.owner)
        t0 = time.monotonic()
        # Pods refused for contradicting the declared conditions (each deleted), bounded by
        # --conditions-attempts and the acquire's own timeout.
        refused: list[str] = []
        attempts = self.s.conditions_attempts if order.conditions else 1
        tracing.attributes(job=job, role=spec.role, image=spec.image)
        if order.warm_ok:
            self.warm.acquired(spec, job)  # demand (validated above: never a bogus spec)
            got = await self.warm.take(order, lifetime, refused, attempts)
            metrics.warm_lookup(spec.role, got is not None)
            tracing.attributes(warm=got is not None)
            if got is not None:
                tracing.attributes(sandbox_id=got.get("id"))
                metrics.acquired("ok", True, time.monotonic() - t0)
                return got
        while True:
            left = order.timeout_s - (time.monotonic() - t0)
            if len(refused) >= attempts or (refused and left <= 0):
                metrics.acquired("failed", False)
                raise ConditionsRefused(
                    f"{len(refused)} pod(s) refused for contradicting the declared conditions "
                    f"(each deleted); last: {refused[-1]}")
            try:
                return await self._fresh(order, lifetime, left, t0)
            except ConditionsRefused as ex:
                refused.append(str(ex))
            except AcquireTimeout as ex:
                if refused:
                    raise AcquireTimeout(f"{ex}; {len(refused)} earlier pod(s) refused for "
                                         f"contradicting the declared conditions; last: "
                                         f"{refused[-1]}", ex.events) from None
                raise

    def validate_egress(self, spec: SandboxSpec) -> None:
        """An allowlist within the ceiling and outside the never ranges, before any create:
        a 400 naming each refused entry (the webhook would refuse the pod anyway)."""
        if spec.egress != contract.EGRESS_DENY:
            raise BadRequest("an egress allowlist needs egress deny")
        try:
            entries = egress.parse_list(list(spec.egress_allow))
        except ValueError as ex:
            raise BadRequest(str(ex)) from None
        why = egress.refusals(entries, self.s.ceiling, self.s.never)
        if why:
            raise BadRequest("; ".join(why))

    def validate_conditions(self, conditions: dict | None) -> None:
        if not conditions:
            return
        unknown = set(conditions) - set(api.CONDITION_FIELDS)
        if unknown:
            raise BadRequest(f"conditions: unknown field(s) {', '.join(sorted(unknown))}")
        mem = conditions.get("memory_limit")
        if mem is not None:
            try:
                if parse_quantity(mem) <= 0:
                    raise ValueError
            except Exception:  # noqa: BLE001 - any parse failure is the caller's bad input
                raise BadRequest(f"conditions.memory_limit {mem!r} is not a positive "
                                 "quantity") from None

    async def _fresh(self, order: AcquireOrder, lifetime: float, timeout_s: float,
                     t0: float) -> dict:
        """One new pod for this acquire, handed out once Ready (and its conditions hold)."""
        spec, job = order.spec, order.job
        token, token_sha = token_pair()
        e = Entry(new_name(job), spec, job, secrets.token_hex(8), token, owner=order.owner,
                  labels=order.labels, lifetime=lifetime, conditions=order.conditions or None)
        if not order.wait:
            try:
                e.slot = await self.pacer.acquire(job, wait=False, role=spec.role)
            except QueueFull as q:
                metrics.acquired("queue_full", False)
                raise QueueFullError(f"no create slot free now: {q}") from None
        self.books.add(e)
        tracing.attributes(sandbox_id=e.id, pod=e.name)
        e.handed = asyncio.get_running_loop().create_future()
        budget = max(timeout_s, self.s.ready_budget)
        self._spawn(self.pipeline.own(e, token_sha, budget), f"own-{e.name}")
        try:
            # asyncio.wait never cancels `handed` (the owner task's) and, unlike wait_for on
            # 3.11, never swallows the caller's cancel.
            done, _ = await asyncio.wait({e.handed}, timeout=timeout_s)
        except asyncio.CancelledError:
            self.pipeline.orphan(e)
            raise
        if not done:
            state = e.state
            self.pipeline.orphan(e)
            metrics.acquired("timeout", False)
            raise AcquireTimeout(f"sandbox not ready within {timeout_s:g}s "
                                 f"(state {state}); the pod is cleaned up by the controller",
                                 await self.pipeline.events(e))
        try:
            result = e.handed.result()
        except ConditionsRefused:
            raise  # the caller tries another pod, or counts the failure
        except AcquireError:
            metrics.acquired("failed", False)
            raise
        metrics.acquired("ok", False, time.monotonic() - t0)
        pull = self.signals.pull_seconds(e.uid)
        if pull is not None:  # the kubelet pulled the image for this pod (its Pulled event)
            result["timings"]["pull_ms"] = round(pull * 1000, 1)
        return result

    async def check_owner(self, owner: dict) -> None:
        """owner= must be a pod of the sandbox namespace with that uid. An ownerReference
        cannot cross namespaces: the garbage collector treats a foreign owner as absent and
        deletes the sandbox at once, so such an acquire is refused, never silently collected."""
        try:
            pod = await self.kube.read_pod(owner["name"])
        except Exception as ex:  # noqa: BLE001
            if getattr(ex, "status", None) != 404:
                raise AcquireError(f"could not check owner {owner['name']!r}: {ex}") from None
            pod = None
        if pod is None or P.uid(pod) != owner["uid"]:
            raise BadOwner(
                f"owner pod {owner['name']!r} (uid {owner['uid']}) is not in the sandbox "
                f"namespace {self.s.namespace!r}: ownerReferences cannot cross namespaces and "
                "the garbage collector would delete the sandbox at once; leave owner out and "
                "rely on lifetime_s (the SDK renews while the sandbox is open)")

    def lifetime(self, lifetime_s: float | None) -> float:
        """The lifetime an acquire or renew asks for, within the flags; BadRequest otherwise."""
        if lifetime_s is None:
            return self.s.default_lifetime
        lo, hi = self.s.min_lifetime, self.s.max_lifetime
        if not lifetime_s >= lo:  # NaN included
            raise BadRequest(f"lifetime_s {lifetime_s:g} is below the controller's minimum "
                             f"({lo:g}s)")
        if lifetime_s > hi:
            raise BadRequest(f"lifetime_s {lifetime_s:g} is above the controller's maximum "
                             f"({hi:g}s); renew before it runs out instead")
        return float(lifetime_s)

    async def renew(self, sid: str, lifetime_s: float | None) -> Entry | None:
        """expires_at = now + lifetime (the asked one, else the sandbox's own), written to the
        pod first so a new leader keeps it. None: no such handed-out sandbox (any more)."""
        e = self.books.entries.get(sid)
        if e is None or e.stage is not S.LEASED:
            metrics.renewed("gone")
            return None
        try:
            lifetime = self.lifetime(lifetime_s if lifetime_s is not None else e.lifetime)
        except BadRequest:
            metrics.renewed("refused")
            raise
        expires = P.lease_end(lifetime)
        try:
            await self.kube.patch_pod(e.name, {"metadata": {
                "annotations": P.lease_annotations(lifetime, expires)}})
        except Exception as ex:  # noqa: BLE001
            if getattr(ex, "status", None) == 404:
                metrics.renewed("gone")
                return None
            metrics.renewed("failed")
            raise AcquireError(f"renew of {sid} failed, retry: {ex}") from None
        if e.stage is not S.LEASED:  # expired, released or drained during the patch
            metrics.renewed("gone")
            return None
        e.lifetime, e.expires_at, e.renewed = lifetime, expires, True
        metrics.renewed("ok")
        return e

    # ---- release, drain, prewarm, sweep -----------------------------------------------------
    def get(self, sid: str) -> Entry | None:
        """The sandbox `sid` unless it is gone, or lost and going (its reason: `ended`)."""
        e = self.books.entries.get(sid)
        if e is None or e.state == "gone" or (e.lost is not None and e.stage in ENDING):
            return None
        return e

    def ended(self, sid: str) -> L.LostSandbox | None:
        """Why the handed-out sandbox `sid` ended under its holder, while kept
        (controller/lost.py); None when it did not (released, expired, never existed). The
        caller's rights on the record's tenant are the route's to check."""
        e = self.books.entries.get(sid)
        if e is not None and e.lost is not None and e.stage in ENDING:
            return L.LostSandbox(e.job, e.lost, time.time())
        return self.lost.get(sid)

    async def release(self, sid: str) -> bool:
        e = self.books.entries.get(sid)
        if e is None or e.stage in ENDING or e.state == "gone" or e.stage in (
                S.CREATING_DRAINED, S.STARTING_DRAINED):
            return False
        if e.stage in POOLED or e.stage is S.CHECKING or (
                e.job == POOL_JOB and e.stage is not S.LEASED):
            return False  # not handed out: nothing to release
        self.pipeline.unwant(e, "released")
        return True

    async def release_reuse(self, sid: str) -> tuple[bool, bool]:
        """Release with reuse: (released, reused). Only a handed-out grading pod (400 for an
        agent pod: its state was the agent's and is never handed on)."""
        e = self._leased_grading(sid, "may be released with reuse")
        if e is None:
            return await self.release(sid), False
        return True, await self.warm.give_back(e)

    def _leased_grading(self, sid: str, may: str) -> Entry | None:
        """The handed-out grading pod `sid`, None when it is not handed out; 400 for an agent
        pod ("only grading sandboxes <may>")."""
        e = self.books.entries.get(sid)
        if e is None or e.stage is not S.LEASED:
            return None
        if e.spec.role != contract.ROLE_GRADING:
            raise BadRequest(f"sandbox {sid} has role {e.spec.role}: only {contract.ROLE_GRADING}"
                             f" sandboxes {may}")
        return e

    async def retire(self, sid: str) -> bool:
        """The caller's grading on this pod contradicted an earlier one: delete it."""
        e = self.books.entries.get(sid)
        released = await self.release(sid)
        if released and e is not None and e.spec.role == contract.ROLE_GRADING:
            metrics.retired("caller")
        return released

    async def shadow(self, sid: str, outcome: str) -> tuple[bool, bool]:
        """The caller graded this reused grading pod's verdict again on a never-used pod:
        counted; a contradiction retires the pod, an agreement releases it for reuse.
        (released, reused); 400 for an agent pod."""
        e = self._leased_grading(sid, "are shadow-graded")
        if e is None:
            return await self.release(sid), False
        metrics.shadowed(outcome)
        if outcome == contract.SHADOW_CONTRADICT:
            self.pipeline.unwant(e, "retired: a never-used pod's verdict contradicted its own")
            metrics.retired("shadow")
            return True, False
        return True, await self.warm.give_back(e)

    async def drain(self, job: str) -> int:
        self.pins.forget(job)  # a job drained is over: its name may pin anew
        return await self.sweeper.drain(job)

    async def pinned_spec(self, spec: SandboxSpec) -> SandboxSpec:
        """A prewarm's spec by digest: its pool is keyed by what the tag names now."""
        self.validate(spec, POOL_JOB, {}, None)
        return replace(spec, image=await self.pins.pin(None, spec.image))

    async def _pull_credentials(self) -> list[dict]:
        """The pod template's pull Secrets, as the kubelet would use them for the sandboxes
        (the chart grants `get` on these names only)."""
        out = []
        for ref in self.s.pod_template.get("imagePullSecrets", []):
            try:
                out.append(await self.kube.read_secret(ref["name"]))
            except Exception as ex:  # noqa: BLE001 - one unreadable secret: ask with the rest
                log.warning("image pinning: pull secret %s unreadable: %s", ref["name"], ex)
        return dockerconfigs(out)

    async def sweep(self) -> int:
        return await self.sweeper.sweep()

    def prewarm(self, spec: SandboxSpec, count: int, idle_timeout: float | None) -> Pool:
        self.validate(spec, POOL_JOB, {}, None)
        if count < 0 or count > self.s.limits.max_live:
            raise BadRequest(f"count must be between 0 and max_live ({self.s.limits.max_live})")
        if not self.ready:
            raise NotLeader("this controller replica is not the leader; retry")
        return self.warm.prewarm(spec, count, idle_timeout)

    def stats(self) -> dict:
        per_job: dict[str, dict[str, int]] = {}
        for e in self.books.entries.values():
            j = per_job.setdefault(e.job, {s: 0 for s in ENTRY_STATES})
            j[e.state] = j.get(e.state, 0) + 1
        return {
            "queue_depth": self.pacer.queue_depth(),
            # Per tenant: waiters by role, the oldest's wait, its creating and live pods.
            "tenants": self.pacer.tenant_queues(),
            "creating": self.pacer.creating,
            "live": self.pacer.live,
            "rate": self.pacer.rate,
            "warm": {f"{k.image}|{k.cpu}|{k.memory}|{k.workspace or ''}|{k.egress}"
                     + (f"|{k.role}" if k.role != contract.ROLE_AGENT else "")
                     + (f"|allow={','.join(k.egress_allow)}" if k.egress_allow else ""):
                     {"warm": len(p.warm), "building": p.building, "target": p.target,
                      "floor": p.floor}
                     for k, p in self.pools.items()},
            "jobs": per_job,
        }


def _log_crash(t: asyncio.Task) -> None:
    if not t.cancelled() and t.exception() is not None:
        log.error("task %s crashed: %r", t.get_name(), t.exception())
