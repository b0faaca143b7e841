"""The controller's books and the life of every pod it creates.

Ownership rule (the paper's table A21): from the moment an acquire is queued until its pod is
handed out or confirmed deleted, the pod belongs to an owner task here, never to the caller. A
caller that disconnects, times out or is cancelled only marks its entry abandoned; the owner task
then withdraws the create (still queued), or lets the create settle and parks the pod warm
(eligible: no per-caller state) or deletes it.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import logging
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from kubernetes import client

from controller import metrics
from controller.errors import (  # noqa: F401 - re-exported for controller/api.py
    AcquireError,
    AcquireTimeout,
    BadRequest,
    NotLeader,
    PodFailed,
    QueueFullError,
)
from controller.errors import FirstAttemptLeft as _FirstAttemptLeft
from controller.kube import AMBIGUOUS_STATUSES, Kube, PodInformer, is_transport_error
from controller.pacer import Pacer, QueueFull, Slot
from controller.pods import SandboxSpec
from controller.pods import deleting as _deleting
from controller.pods import failure as _failure
from controller.pods import is_ready as _is_ready
from controller.pods import labels as _labels
from controller.pods import meta as _meta
from controller.pods import name as _name
from controller.pods import pod_ip as _pod_ip
from controller.pods import spec_of as _spec_of
from controller.pods import uid as _uid
from controller.settings import Settings  # noqa: F401 - re-exported for controller/__main__.py
from sandman import contract
from sandman.sandbox import make_sandbox

log = logging.getLogger("controller")

POOL_JOB = "sandman-pool"  # the pacing "job" and owner of warm pods
JOB_RE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")  # a label value
ENTRY_STATES = ("queued", "creating", "starting", "warm", "checking", "leased", "deleting",
                "gone", "failed")


@dataclass
class Entry:
    name: str
    spec: SandboxSpec
    job: str
    nonce: str
    token: str | None
    owner: dict | None = None
    labels: dict = field(default_factory=dict)
    state: str = "queued"
    uid: str | None = None
    ip: str | None = None
    slot: Slot | None = None
    abandoned: bool = False
    warm_build: bool = False
    handed: asyncio.Future | None = None
    queue_wait: asyncio.Task | None = None
    t_queued: float = field(default_factory=time.monotonic)
    t_created: float | None = None
    timings: dict = field(default_factory=dict)
    created_wall: float = field(default_factory=time.time)
    warm_since: float | None = None
    error: str | None = None
    deleting: bool = False
    owner_ref: dict | None = None  # the job's ConfigMap, when no caller pod owns it
    parked: bool = False  # a late pod kept warm after its caller left (not a built warm pod)

    @property
    def id(self) -> str:
        return self.name

    def eligible_for_warm(self) -> bool:
        # Per-caller state (an owner, custom labels) must never reach another caller.
        return self.owner is None and not self.labels and self.token is not None


@dataclass
class Pool:
    target: int = 0
    idle_timeout: float = 300.0
    last_used: float = field(default_factory=time.monotonic)
    warm: list[Entry] = field(default_factory=list)  # Ready, unused, oldest first
    building: int = 0
    checking: int = 0


def token_pair() -> tuple[str, str]:
    token = secrets.token_urlsafe(32)
    return token, hashlib.sha256(token.encode()).hexdigest()


def job_object_name(job: str) -> str:
    safe = re.sub(r"[^a-z0-9-]", "-", job.lower()).strip("-")[:40] or "job"
    return f"sandman-job-{safe}-{hashlib.sha256(job.encode()).hexdigest()[:8]}"


class Controller:
    def __init__(self, kube: Kube, settings: Settings):
        self.kube = kube
        self.s = settings
        self.pacer = Pacer(settings.limits)
        self.entries: dict[str, Entry] = {}
        self.pods: dict[str, Any] = {}  # informer cache: name -> slim pod dict (kube.slim_pod)
        self.pools: dict[SandboxSpec, Pool] = {}
        self.job_owner_uid: dict[str, str] = {}
        self._wakers: dict[str, asyncio.Event] = {}
        self._tasks: set[asyncio.Task] = set()
        self._http = httpx.AsyncClient(timeout=settings.health_timeout)
        self.informer: PodInformer | None = None
        self.ready = False
        self._bg: list[asyncio.Task] = []
        self._retired: set[str] = set()  # names whose creates were given up: delete on sight
        self._requests: dict[tuple[str, str], asyncio.Future] = {}  # (job, request_id)

    # ---- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.pacer.start()
        self.informer = PodInformer(self.kube, loop, self._on_event)
        self.informer.start()
        await asyncio.wait_for(self.informer.synced.wait(), timeout=60)
        self._bg = [loop.create_task(self._maintain(), name="maintain"),
                    loop.create_task(self._sweep_loop(), name="sweep")]
        self.ready = True

    async def stop(self) -> None:
        self.ready = False
        for t in self._bg:
            t.cancel()
        if self.informer:
            self.informer.stop()
        await self.pacer.stop()
        await self._http.aclose()

    def _spawn(self, coro, name: str) -> asyncio.Task:
        t = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        t.add_done_callback(_log_crash)
        return t

    # ---- informer ---------------------------------------------------------------------------
    def _on_event(self, kind: str, obj) -> None:
        if kind == "SYNC":
            self._rebuild(obj)
            return
        name = _name(obj)
        if kind == "DELETED":
            self.pods.pop(name, None)
            e = self.entries.get(name)
            if e is not None and (e.uid is None or e.uid == _uid(obj)):
                self._gone(e)
        else:
            self.pods[name] = obj
            e = self.entries.get(name)
            if e is None and name in self._retired and not _deleting(obj):
                # A create we had given up on was stored after all: delete it now.
                self._retired.discard(name)
                self._adopt_for_delete(obj)
        w = self._wakers.get(name)
        if w:
            w.set()

    def _rebuild(self, pods: list) -> None:
        """Books from labels after a (re)start: no pod is forgotten.

        leased -> a live sandbox (its caller holds the token); warm -> deleted (its token died
        with the old process); no state or deleting -> the old owner's create or delete, redone.
        """
        for pod in pods:
            self.pods[_name(pod)] = pod
            labels = _labels(pod)
            state = labels.get(contract.LABEL_STATE)
            job = labels.get(contract.LABEL_JOB, POOL_JOB)
            if _name(pod) in self.entries:
                continue
            e = Entry(_name(pod), _spec_of(pod), job, labels.get(contract.LABEL_NONCE, ""),
                      None, uid=_uid(pod), ip=_pod_ip(pod))
            e.slot = self.pacer.adopt(job)
            self.entries[e.name] = e
            if state == contract.STATE_LEASED and not _deleting(pod):
                e.state = "leased"
            else:
                self._schedule_delete(e, "rebuilt without an owner (restart)")
        metrics.LIVE.set(self.pacer.live)

    def _adopt_for_delete(self, pod) -> None:
        labels = _labels(pod)
        job = labels.get(contract.LABEL_JOB, POOL_JOB)
        e = Entry(_name(pod), _spec_of(pod), job, labels.get(contract.LABEL_NONCE, ""),
                  None, uid=_uid(pod))
        e.slot = self.pacer.adopt(job)
        self.entries[e.name] = e
        self._schedule_delete(e, "late create")

    def _gone(self, e: Entry) -> None:
        if e.state == "gone":
            return
        e.state = "gone"
        if e.slot:
            e.slot.gone()
        self.entries.pop(e.name, None)
        for pool in self.pools.values():
            if e in pool.warm:
                pool.warm.remove(e)
        metrics.LIVE.set(self.pacer.live)

    # ---- acquire ----------------------------------------------------------------------------
    def validate(self, spec: SandboxSpec, job: str, labels: dict, owner: dict | None) -> None:
        if not JOB_RE.match(job or ""):
            raise BadRequest(f"job {job!r} is not a valid label value (1-63 of [A-Za-z0-9-_.])")
        if not spec.image or any(c.isspace() for c in spec.image):
            raise BadRequest(f"image {spec.image!r} is not an image reference")
        if spec.egress not in (contract.EGRESS_DENY, contract.EGRESS_ALLOW):
            raise BadRequest(f"egress must be deny or allow, not {spec.egress!r}")
        from sandman.sandbox import parse_quantity

        for what, q in (("cpu", spec.cpu), ("memory", spec.memory)):
            try:
                if parse_quantity(q) <= 0:
                    raise ValueError
            except Exception:  # noqa: BLE001 - any parse failure is the caller's bad input
                raise BadRequest(f"{what} {q!r} is not a positive Kubernetes quantity") from None
        if spec.workspace is not None and not spec.workspace.startswith("/"):
            raise BadRequest(f"workspace {spec.workspace!r} must be an absolute path")
        for k, v in labels.items():
            if k.startswith(contract.DOMAIN + "/") or k == contract.LABEL_MANAGED_BY:
                raise BadRequest(f"label {k!r} is reserved for sandman")
            if not JOB_RE.match(str(v)) and v != "":
                raise BadRequest(f"label {k}={v!r}: value is not a valid label value")
        if owner is not None and not (owner.get("name") and owner.get("uid")):
            raise BadRequest("owner needs both name and uid of the caller's pod")

    async def acquire(self, spec: SandboxSpec, job: str, *, owner: dict | None = None,
                      labels: dict | None = None, timeout_s: float = 300.0,
                      warm_ok: bool = True, wait: bool = True,
                      request_id: str | None = None) -> dict:
        """`request_id` makes a retried acquire (its answer was lost) return the same sandbox
        instead of a second one, while the first is in flight or still leased."""
        if request_id is None:
            return await self._acquire(spec, job, owner=owner, labels=labels,
                                       timeout_s=timeout_s, warm_ok=warm_ok, wait=wait)
        key = (job, request_id)
        for _ in range(100):  # bounded: each pass waits for a whole earlier attempt
            prior = self._requests.get(key)
            if prior is None:
                break
            if prior.done():
                if not prior.cancelled() and prior.exception() is None:
                    e = self.entries.get(prior.result()["id"])
                    if e is not None and e.state == "leased":
                        return prior.result()
                break
            try:
                return await asyncio.shield(prior)
            except _FirstAttemptLeft:
                # Its caller left before the answer (the sandbox is parked or deleted): this
                # retry acquires anew. Looping lets a second concurrent retry wait on the
                # first retry's attempt instead of starting a third.
                continue
        fut = asyncio.get_running_loop().create_future()
        self._requests[key] = fut
        while len(self._requests) > 10000:  # bounded: the oldest keys are forgotten
            self._requests.pop(next(iter(self._requests)))
        try:
            result = await self._acquire(spec, job, owner=owner, labels=labels,
                                         timeout_s=timeout_s, warm_ok=warm_ok, wait=wait)
        except BaseException as ex:
            self._requests.pop(key, None)
            if not fut.done():
                fut.set_exception(ex if isinstance(ex, AcquireError)
                                  else _FirstAttemptLeft("the first attempt of this request_id "
                                                         "was abandoned; retry"))
                fut.exception()
            raise
        fut.set_result(result)
        return result

    async def _acquire(self, spec: SandboxSpec, job: str, *, owner: dict | None,
                       labels: dict | None, timeout_s: float, warm_ok: bool,
                       wait: bool) -> dict:
        labels = dict(labels or {})
        self.validate(spec, job, labels, owner)
        if not self.ready:
            raise NotLeader("this controller replica is not the leader; retry")
        t0 = time.monotonic()
        if warm_ok:
            got = await self._take_warm(spec, job, owner, labels)
            if got is not None:
                metrics.acquired("ok", True, time.monotonic() - t0)
                return got
        token, token_sha = token_pair()
        e = Entry(self._new_name(job), spec, job, secrets.token_hex(8), token, owner=owner,
                  labels=labels)
        e.handed = asyncio.get_running_loop().create_future()
        self.entries[e.name] = e
        if not wait:
            try:
                e.slot = await self.pacer.acquire(job, wait=False)
            except QueueFull as q:
                self.entries.pop(e.name, None)
                metrics.acquired("queue_full", False)
                raise QueueFullError(f"no create slot free now: {q}") from None
        self._spawn(self._own(e, token_sha, timeout_s), f"own-{e.name}")
        try:
            # asyncio.wait never cancels `handed` (the owner task's) and, unlike wait_for on
            # 3.11, never swallows the caller's cancel.
            done, _ = await asyncio.wait({e.handed}, timeout=timeout_s)
        except asyncio.CancelledError:
            self._abandon(e)
            raise
        if not done:
            self._abandon(e)
            metrics.acquired("timeout", False)
            raise AcquireTimeout(f"sandbox not ready within {timeout_s:g}s "
                                 f"(state {e.state}); the pod is cleaned up by the controller",
                                 await self._events(e))
        try:
            result = e.handed.result()
        except AcquireError:
            metrics.acquired("failed", False)
            raise
        metrics.acquired("ok", False, time.monotonic() - t0)
        return result

    def _abandon(self, e: Entry) -> None:
        """The caller is gone. Before the create is sent: withdraw. After: the owner decides."""
        e.abandoned = True
        if e.state == "queued" and e.queue_wait is not None:
            e.queue_wait.cancel()
        elif e.state == "leased" and e.token is not None and e.handed is not None:
            # Handed out in the same tick the caller left: nobody holds the token.
            self._schedule_delete(e, "caller gone at hand-out")

    async def _events(self, e: Entry) -> list[str]:
        return await self.kube.pod_events(e.name) if e.uid else []

    def _new_name(self, job: str) -> str:
        safe = re.sub(r"[^a-z0-9-]", "-", job.lower()).strip("-")[:30] or "sbx"
        return f"sbx-{safe}-{secrets.token_hex(5)}"

    async def _own(self, e: Entry, token_sha: str, timeout_s: float) -> None:
        """The owner task: queue -> create -> Ready -> hand out, park or delete. Never cancelled
        by the caller; every exit path leaves the pod handed out, warm, or being deleted."""
        try:
            if e.slot is None:
                e.queue_wait = asyncio.ensure_future(self.pacer.acquire(e.job))
                try:
                    e.slot = await e.queue_wait
                except asyncio.CancelledError:
                    self.entries.pop(e.name, None)
                    e.state = "gone"
                    _fail(e, AcquireTimeout("withdrawn before the create was sent"))
                    return
            e.state = "creating"
            e.timings["queued_ms"] = _ms(time.monotonic() - e.t_queued)
            metrics.QUEUE_SECONDS.observe(time.monotonic() - e.t_queued)
            t_c = time.monotonic()
            stored = await self._create(e, token_sha)
            e.timings["create_ms"] = _ms(time.monotonic() - t_c)
            if not stored:
                e.slot.gone()
                self.entries.pop(e.name, None)
                e.state = "failed"
                _fail(e, PodFailed(f"create refused: {e.error}"))
                return
            e.state = "starting"
            e.t_created = time.monotonic()
            ok, why = await self._wait_ready(e, e.t_created + max(timeout_s,
                                                                   self.s.ready_budget))
            e.slot.done_creating()
            if not ok:
                events = await self._events(e)
                self._schedule_delete(e, why)
                _fail(e, PodFailed(f"pod {e.name} {why}", events))
                return
            e.timings["ready_ms"] = _ms(time.monotonic() - e.t_created)
            if e.abandoned:
                await self._park_or_delete(e)
                return
            await self._hand_out(e)
        except Exception as ex:  # noqa: BLE001 - the owner must clean up whatever happened
            log.exception("owner task for %s failed", e.name)
            if e.uid or e.state in ("creating", "starting"):
                self._schedule_delete(e, f"owner error: {ex}")
            else:
                self.entries.pop(e.name, None)
                if e.slot:
                    e.slot.gone()
            _fail(e, AcquireError(f"internal error: {ex}"))

    async def _hand_out(self, e: Entry) -> None:
        patch = {"metadata": {"labels": {contract.LABEL_STATE: contract.STATE_LEASED, **e.labels}}}
        try:
            await self.kube.patch_pod(e.name, patch)
        except Exception as ex:  # noqa: BLE001
            # Without the leased label a restart would delete a live sandbox: fail closed.
            self._schedule_delete(e, f"hand-out patch failed: {ex}")
            _fail(e, PodFailed(f"pod {e.name} could not be marked leased: {ex}"))
            return
        if e.abandoned:  # the caller left during the patch
            self._schedule_delete(e, "caller gone during hand-out")
            return
        e.state = "leased"
        e.handed.set_result(self._result(e, warm=False))

    def _result(self, e: Entry, warm: bool) -> dict:
        return {"id": e.id, "pod": e.name, "address": e.ip, "port": self.s.execd_port,
                "token": e.token, "warm": warm,
                "timings": {k: e.timings.get(k, 0.0) for k in ("queued_ms", "create_ms",
                                                                "ready_ms")}}

    # ---- create -----------------------------------------------------------------------------
    def build_pod(self, e: Entry, token_sha: str) -> dict:
        labels = {
            contract.LABEL_SANDBOX: contract.SANDBOX_TRUE,
            contract.LABEL_JOB: e.job,
            contract.LABEL_NONCE: e.nonce,
            contract.LABEL_EGRESS: e.spec.egress,
            contract.LABEL_MANAGED_BY: contract.MANAGED_BY_CONTROLLER,
        }
        if e.warm_build:
            labels[contract.LABEL_STATE] = contract.STATE_WARM
        container = {"name": "sandbox", "image": e.spec.image,
                     "resources": {"requests": {"cpu": e.spec.cpu, "memory": e.spec.memory},
                                   "limits": {"cpu": e.spec.cpu, "memory": e.spec.memory}}}
        if e.spec.workspace:
            container["workingDir"] = e.spec.workspace
        spec: dict = {
            "containers": [container],
            # A sandbox whose daemon died has lost its state: surface it, don't restart it.
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 5,
            # Soft spread: crowded nodes failed address assignment 31-55% of the time (paper).
            "topologySpreadConstraints": [{
                "maxSkew": 2, "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": {
                    contract.LABEL_MANAGED_BY: contract.MANAGED_BY_CONTROLLER}}}],
        }
        if self.s.node_pool_label:
            k, v = self.s.node_pool_label.split("=", 1)
            spec["nodeSelector"] = {k: v}
        meta = {"name": e.name, "namespace": self.s.namespace, "labels": labels,
                "annotations": {contract.ANNOTATION_TOKEN_SHA256: token_sha}}
        if e.owner:
            meta["ownerReferences"] = [{"apiVersion": "v1", "kind": "Pod",
                                        "name": e.owner["name"], "uid": e.owner["uid"]}]
        elif e.owner_ref is not None:
            meta["ownerReferences"] = [e.owner_ref]
        return make_sandbox({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec},
                            self.s.policy)

    async def _owner_ref(self, job: str) -> dict:
        """The per-job ConfigMap that owns the job's pods, so the GC removes them at job end."""
        name = job_object_name(job)
        uid = self.job_owner_uid.get(job)
        if uid is None:
            body = {"metadata": {"name": name, "labels": {
                contract.LABEL_MANAGED_BY: contract.MANAGED_BY_CONTROLLER,
                contract.LABEL_JOB: job}}}
            try:
                cm = await self.kube.call(self.kube.core.create_namespaced_config_map,
                                          self.s.namespace, body)
            except client.ApiException as ex:
                if ex.status != 409:
                    raise
                cm = await self.kube.call(self.kube.core.read_namespaced_config_map, name,
                                          self.s.namespace)
            uid = cm.metadata.uid
            self.job_owner_uid[job] = uid
        return {"apiVersion": "v1", "kind": "ConfigMap", "name": name, "uid": uid}

    async def _create(self, e: Entry, token_sha: str) -> bool:
        """Create the pod; True when it is stored and ours. Ambiguous answers are resolved by
        reading back by name and nonce; a foreign pod holding the name is never touched."""
        e.owner_ref = None if e.owner else await self._owner_ref(e.job)
        body = self.build_pod(e, token_sha)
        backoff = 0.2
        for _attempt in range(8):
            try:
                pod = await self.kube.create_pod(body)
                e.uid = _uid(pod)
                metrics.created("ok")
                return True
            except client.ApiException as ex:
                if ex.status == 409:
                    mine = await self._read_back(e)
                    if mine:
                        metrics.created("ok_after_conflict")
                        return True
                    if mine is False:  # another tenant's pod holds the name: new name, new create
                        metrics.created("name_conflict")
                        e.name = self._rename(e)
                        body = self.build_pod(e, token_sha)
                        continue
                elif ex.status == 429 or ex.status in AMBIGUOUS_STATUSES:
                    self.pacer.slow_down()
                    metrics.API_BACKOFF.inc()
                    if ex.status in AMBIGUOUS_STATUSES:
                        mine = await self._read_back(e)
                        if mine:
                            metrics.created("ok_after_error")
                            return True
                else:
                    e.error = f"{ex.status} {_reason(ex)}"
                    metrics.created("refused")
                    return False
            except Exception as ex:  # noqa: BLE001
                if not is_transport_error(ex):
                    raise
                metrics.created("transport_error")
                self.pacer.slow_down()
                mine = await self._read_back(e)
                if mine:
                    return True
            # Not stored (or unknown): retry with the SAME name and nonce, so a create that was
            # stored late answers 409 with our nonce and is adopted, never duplicated.
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)
        e.error = "create kept failing; gave up"
        # It may still be stored late: the informer deletes it on sight, the sweep backs it up.
        self._retired.add(e.name)
        return False

    def _rename(self, e: Entry) -> str:
        old = e.name
        self.entries.pop(old, None)
        e.name = self._new_name(e.job)
        self.entries[e.name] = e
        return e.name

    async def _read_back(self, e: Entry) -> bool | None:
        """True: the pod with our name carries our nonce (ours). False: absent or foreign.
        None: could not tell (the read failed too)."""
        for _ in range(5):
            try:
                pod = await self.kube.read_pod(e.name)
            except client.ApiException as ex:
                if ex.status == 404:
                    return False
                await asyncio.sleep(0.2)
                continue
            except Exception:  # noqa: BLE001
                await asyncio.sleep(0.2)
                continue
            if _labels(pod).get(contract.LABEL_NONCE) == e.nonce:
                e.uid = _uid(pod)
                return True
            return False
        return None

    # ---- readiness --------------------------------------------------------------------------
    async def _wait_ready(self, e: Entry, deadline: float) -> tuple[bool, str]:
        waker = self._wakers.setdefault(e.name, asyncio.Event())
        try:
            while True:
                if e.deleting:
                    return False, "was deleted while starting (drain)"
                pod = self.pods.get(e.name)
                if pod is not None and _uid(pod) == e.uid:
                    bad = _failure(pod)
                    if bad:
                        return False, bad
                    ready = _is_ready(pod) and _pod_ip(pod)
                    if ready:
                        e.ip = _pod_ip(pod)
                        if self.s.ready_check == "pod" or await self._healthy(e.ip):
                            return True, ""
                else:
                    ready = False
                left = deadline - time.monotonic()
                if left <= 0:
                    return False, "not Ready and answering execd /health within the budget"
                # Event-driven: a pod change wakes us. Only an execd probe that failed on a
                # Ready pod is retried on a timer (no per-pod polling at 12,000 pods).
                waker.clear()
                waiter = asyncio.ensure_future(waker.wait())
                try:
                    await asyncio.wait({waiter}, timeout=min(left, 0.2) if ready else left)
                finally:
                    waiter.cancel()
        finally:
            self._wakers.pop(e.name, None)

    async def _healthy(self, ip: str) -> bool:
        host = f"[{ip}]" if ":" in ip else ip
        try:
            r = await self._http.get(f"http://{host}:{self.s.execd_port}/health")
            return r.status_code == 200 and r.json().get("ok") is True
        except Exception:  # noqa: BLE001 - not answering yet
            return False

    # ---- warm pool --------------------------------------------------------------------------
    def prewarm(self, spec: SandboxSpec, count: int, idle_timeout: float | None) -> Pool:
        self.validate(spec, POOL_JOB, {}, None)
        if count < 0 or count > self.s.limits.max_live:
            raise BadRequest(f"count must be between 0 and max_live ({self.s.limits.max_live})")
        if not self.ready:
            raise NotLeader("this controller replica is not the leader; retry")
        pool = self.pools.setdefault(spec, Pool(idle_timeout=self.s.default_idle_timeout))
        pool.target = count
        if idle_timeout is not None:
            pool.idle_timeout = idle_timeout
        pool.last_used = time.monotonic()
        self._fill(spec)
        return pool

    def _fill(self, spec: SandboxSpec) -> None:
        pool = self.pools.get(spec)
        if pool is None:
            return
        need = pool.target - (len(pool.warm) + pool.building + pool.checking)
        for _ in range(max(0, need)):
            pool.building += 1
            self._spawn(self._build_warm(spec), "warm-build")

    async def _build_warm(self, spec: SandboxSpec) -> None:
        pool = self.pools[spec]
        token, token_sha = token_pair()
        e = Entry(self._new_name("warm"), spec, POOL_JOB, secrets.token_hex(8), token,
                  warm_build=True)
        self.entries[e.name] = e
        try:
            await self._own_warm(e, token_sha)
        finally:
            pool.building -= 1

    async def _own_warm(self, e: Entry, token_sha: str) -> None:
        try:
            e.queue_wait = asyncio.ensure_future(self.pacer.acquire(POOL_JOB))
            try:
                e.slot = await e.queue_wait
            except asyncio.CancelledError:
                self.entries.pop(e.name, None)
                return
            e.state = "creating"
            if not await self._create(e, token_sha):
                e.slot.gone()
                self.entries.pop(e.name, None)
                return
            e.state = "starting"
            e.t_created = time.monotonic()
            ok, why = await self._wait_ready(e, e.t_created + self.s.ready_budget)
            e.slot.done_creating()
            if not ok or e.deleting:
                self._schedule_delete(e, f"warm build: {why or 'drained'}")
                return
            pool = self.pools.get(e.spec)
            if pool is None or len(pool.warm) + pool.checking >= pool.target:
                self._schedule_delete(e, "warm surplus")
                return
            e.state = "warm"
            e.warm_since = time.monotonic()
            pool.warm.append(e)
        except Exception as ex:  # noqa: BLE001
            log.exception("warm build %s failed", e.name)
            self._schedule_delete(e, f"warm build error: {ex}")

    async def _park_or_delete(self, e: Entry) -> None:
        """A pod whose caller left after the create settled: reuse it warm when it holds no
        per-caller state (the paper's late grading pods), else delete it."""
        if e.eligible_for_warm():
            try:
                await self.kube.patch_pod(e.name, {"metadata": {
                    "labels": {contract.LABEL_STATE: contract.STATE_WARM,
                               contract.LABEL_JOB: POOL_JOB},
                    "ownerReferences": [await self._owner_ref(POOL_JOB)]}})
                pool = self.pools.setdefault(e.spec, Pool(idle_timeout=self.s.default_idle_timeout,
                                                          target=0))
                e.state = "warm"
                e.job = POOL_JOB
                e.parked = True
                e.warm_since = time.monotonic()
                pool.warm.append(e)
                metrics.PARKED.inc()
                return
            except Exception as ex:  # noqa: BLE001
                log.warning("parking %s failed (%s); deleting", e.name, ex)
        self._schedule_delete(e, "caller gone")

    async def _take_warm(self, spec: SandboxSpec, job: str, owner: dict | None,
                         labels: dict) -> dict | None:
        pool = self.pools.get(spec)
        if pool is None:
            return None
        pool.last_used = time.monotonic()
        while pool.warm:
            e = pool.warm.pop(0)  # oldest first; surplus is trimmed newest first
            pool.checking += 1
            e.state = "checking"
            try:
                t0 = time.monotonic()
                if self.s.ready_check == "pod":
                    ok = _is_ready(self.pods.get(e.name))
                else:
                    ok = await self._healthy(e.ip)
                if not ok:
                    self._schedule_delete(e, "warm pod failed its health check")
                    continue
                ref = ({"apiVersion": "v1", "kind": "Pod", "name": owner["name"],
                        "uid": owner["uid"]} if owner else await self._owner_ref(job))
                try:
                    await self.kube.patch_pod(e.name, {"metadata": {
                        "labels": {contract.LABEL_STATE: contract.STATE_LEASED,
                                   contract.LABEL_JOB: job, **labels},
                        "ownerReferences": [ref]}})
                except Exception as ex:  # noqa: BLE001
                    self._schedule_delete(e, f"warm hand-out patch failed: {ex}")
                    continue
                # Move the pod's count from the pool to the job for the per-job caps.
                if e.slot:
                    e.slot.gone()
                e.slot = self.pacer.adopt(job)
                e.job, e.owner, e.labels, e.state = job, owner, labels, "leased"
                e.timings = {"queued_ms": 0.0, "create_ms": 0.0,
                             "ready_ms": _ms(time.monotonic() - t0)}
                return self._result(e, warm=True)
            finally:
                pool.checking -= 1
                if pool.target > 0:
                    self._fill(spec)  # the replacement goes through the same bucket
        return None

    # ---- release, drain, delete -------------------------------------------------------------
    def get(self, sid: str) -> Entry | None:
        e = self.entries.get(sid)
        return e if e and e.state != "gone" else None

    async def release(self, sid: str) -> bool:
        e = self.entries.get(sid)
        if e is None or e.state in ("gone",) or e.deleting:
            return False
        if e.state in ("warm", "checking") or e.job == POOL_JOB and e.state != "leased":
            return False  # not handed out: nothing to release
        self._schedule_delete(e, "released")
        return True

    async def drain(self, job: str) -> int:
        n = 0
        for e in list(self.entries.values()):
            if e.job != job or e.deleting or e.state == "gone":
                continue
            n += 1
            if e.state == "queued":
                self._abandon(e)
            elif e.state in ("creating", "starting"):
                e.abandoned = True
                e.deleting = True  # the owner task deletes once the create settles
            else:
                self._schedule_delete(e, "job drained")
        self._spawn(self._delete_job_object(job), f"drain-{job}")
        return n

    async def _delete_job_object(self, job: str) -> None:
        name = job_object_name(job)
        self.job_owner_uid.pop(job, None)
        for _ in range(10):
            try:
                await self.kube.call(self.kube.core.delete_namespaced_config_map, name,
                                     self.s.namespace)
                return
            except client.ApiException as ex:
                if ex.status == 404:
                    return
            except Exception:  # noqa: BLE001
                pass
            await asyncio.sleep(1)

    def _schedule_delete(self, e: Entry, why: str) -> None:
        if e.deleting and e.state == "deleting":
            return
        e.deleting = True
        e.state = "deleting"
        self.entries[e.name] = e
        for pool in self.pools.values():
            if e in pool.warm:
                pool.warm.remove(e)
        log.info("deleting %s: %s", e.name, why)
        self._spawn(self._delete(e), f"delete-{e.name}")

    async def _delete(self, e: Entry) -> None:
        """Retried until the API confirms (404 counts as done), 1 s to 30 s back-off (paper)."""
        backoff = 1.0
        marked = False
        while e.state != "gone":
            try:
                if not marked:
                    # Survives a restart: the rebuilt books redo a delete that was lost.
                    await self.kube.patch_pod(e.name, {"metadata": {"labels": {
                        contract.LABEL_STATE: contract.STATE_DELETING}}})
                    marked = True
                await self.kube.delete_pod(e.name, e.uid)
                metrics.deleted("ok")
                self._forget_after_delete(e)
                return
            except client.ApiException as ex:
                if ex.status == 404 or (ex.status == 409 and e.uid):
                    # Gone, or the name now holds another pod (uid precondition): ours is gone.
                    metrics.deleted("gone")
                    self._gone(e)
                    return
                metrics.deleted("retry")
            except Exception:  # noqa: BLE001 - transport errors: retry
                metrics.deleted("retry")
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 30.0)

    def _forget_after_delete(self, e: Entry) -> None:
        # The API accepted the delete; the informer's DELETED event releases the live count.
        # If the pod is already absent from the cache, finish now.
        if e.name not in self.pods:
            self._gone(e)

    # ---- periodic work ----------------------------------------------------------------------
    async def _maintain(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for spec, pool in list(self.pools.items()):
                if pool.target and now - pool.last_used > pool.idle_timeout:
                    pool.target = 0  # idle key: the pool for it is emptied
                built = [e for e in pool.warm if not e.parked]
                while len(built) > pool.target:  # built surplus, newest first
                    victim = built.pop()
                    pool.warm.remove(victim)
                    self._schedule_delete(victim, "warm surplus or idle")
                for e in [e for e in pool.warm
                          if e.parked and now - (e.warm_since or now) > pool.idle_timeout]:
                    pool.warm.remove(e)  # a parked late pod waits out its key's idle timeout
                    self._schedule_delete(e, "parked pod idle")
                if pool.target:
                    self._fill(spec)
            metrics.QUEUE_DEPTH.set(sum(self.pacer.queue_depth().values()))
            metrics.LIVE.set(self.pacer.live)
            metrics.CREATING.set(self.pacer.creating)

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.s.sweep_interval)
            try:
                await self.sweep()
            except Exception as ex:  # noqa: BLE001
                log.warning("sweep failed: %s", ex)

    async def sweep(self) -> int:
        """Delete the controller's pods that nothing owns (the paper had no such sweep)."""
        sel = f"{contract.LABEL_MANAGED_BY}={contract.MANAGED_BY_CONTROLLER}"
        pods = await self.kube.list_pods(sel)
        seen = set()
        n = 0
        now = time.time()
        for pod in pods:
            seen.add(_name(pod))
            e = self.entries.get(_name(pod))
            if e is not None and e.uid in (None, _uid(pod)):
                continue
            if _deleting(pod):
                continue
            created = _meta(pod).get("creationTimestamp")
            age = now - (dt.datetime.fromisoformat(created.replace("Z", "+00:00")).timestamp()
                         if created else now)
            if age < self.s.sweep_grace:
                continue
            self._adopt_for_delete(pod)
            metrics.SWEPT.inc()
            n += 1
        for e in list(self.entries.values()):
            if e.state == "deleting" and e.name not in seen and e.uid is not None:
                self._gone(e)
        return n

    # ---- stats ------------------------------------------------------------------------------
    def stats(self) -> dict:
        per_job: dict[str, dict[str, int]] = {}
        for e in self.entries.values():
            j = per_job.setdefault(e.job, {s: 0 for s in ENTRY_STATES})
            j[e.state] = j.get(e.state, 0) + 1
        return {
            "queue_depth": self.pacer.queue_depth(),
            "creating": self.pacer.creating,
            "live": self.pacer.live,
            "rate": self.pacer.rate,
            "warm": {f"{k.image}|{k.cpu}|{k.memory}|{k.workspace or ''}|{k.egress}":
                     {"warm": len(p.warm), "building": p.building, "target": p.target}
                     for k, p in self.pools.items()},
            "jobs": per_job,
        }


def _fail(e: Entry, err: AcquireError) -> None:
    if e.handed is not None and not e.handed.done():
        e.handed.set_exception(err)
        e.handed.exception()  # mark retrieved: an abandoned caller may never read it


def _ms(s: float) -> float:
    return round(s * 1000, 1)


def _reason(ex: client.ApiException) -> str:
    import json

    try:
        return json.loads(ex.body).get("message", ex.reason)
    except Exception:  # noqa: BLE001
        return str(ex.reason)


def _log_crash(t: asyncio.Task) -> None:
    if not t.cancelled() and t.exception() is not None:
        log.error("task %s crashed: %r", t.get_name(), t.exception())
