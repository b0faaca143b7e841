"""The controller's books: one `Entry` per pod it owns or is about to create, each in exactly
one `State`, changed only by `Books.move` along the `TRANSITIONS` table.

Four kinds of actor change entries, each at its own await points: the entry's owner task
(controller/pipeline.py), its caller (an acquire that times out or hangs up), the warm pool
(controller/warmpool.py) and the clean-up paths (release, drain, sweep, the informer's DELETED
event). The fate of an in-flight create (its caller left, its job was drained) is part of its
state (`*_ORPHANED`, `*_DRAINED`), not a flag beside it: every actor reads one value after each
await, and the table says which changes can have happened meanwhile.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from controller import metrics
from controller import pods as P
from controller.auth import split_job
from controller.pacer import Slot
from controller.pods import SandboxSpec
from sandman import contract

if TYPE_CHECKING:
    from controller.lost import Ending

log = logging.getLogger("controller.books")

POOL_JOB = "sandman-pool"  # the pacing "job" and owner of warm pods


class State(enum.Enum):
    """An entry's state: `public` is the word the API shows (`GET /v1/sandboxes`, stats)."""

    def __init__(self, public: str, meaning: str):
        self.public = public
        self.meaning = meaning

    QUEUED = "queued", "waiting for a create slot; no request sent yet"
    WITHDRAWN = "gone", ("its caller left (or its job was drained) before the create was sent: "
                         "never sent; the owner hands the slot back")
    CREATING = "creating", "create call in flight (read-backs and retries included)"
    CREATING_ORPHANED = "creating", ("the caller left during the create: once it settles, the "
                                     "pod is parked when Ready (no per-caller state) or deleted")
    CREATING_DRAINED = "creating", ("drained or released during the create: deleted once the "
                                    "create settles")
    STARTING = "starting", "stored; waiting for Ready (+ execd /ready), then the hand-out patch"
    STARTING_ORPHANED = "starting", ("the caller left: parked once Ready (no per-caller state) "
                                     "or deleted")
    STARTING_DRAINED = "starting", ("drained or released while starting: the owner deletes it "
                                    "at the pod's next event")
    WARM = "warm", "built for a pool: Ready, unused"
    PARKED = "warm", ("a late pod whose caller left, kept for the next acquire of its key; not "
                      "trimmed as surplus, it waits out the key's idle timeout")
    CHECKING = "checking", "taken from a pool: health check and hand-out patch"
    LEASED = "leased", "handed out (or found leased after a restart)"
    DELETING = "deleting", "labelled deleting; the delete is retried until the API confirms"
    GONE = "gone", "confirmed absent (terminal)"
    FAILED = "failed", "create refused or given up: never stored (terminal)"


S = State
# Who makes each change: O the owner task, C the caller leaving, D drain or release, W the warm
# pool, I the informer (DELETED), X the delete loop or the sweep. DELETING is reachable from
# every state that may have a pod, and GONE from every state whose create was sent, so the
# fail-closed path (delete it) is always a legal move.
TRANSITIONS: dict[State, frozenset[State]] = {s: frozenset(t) for s, t in {
    S.QUEUED: {S.CREATING,  # O: slot granted
               S.WITHDRAWN},  # C, D: the create is never sent
    S.WITHDRAWN: {S.GONE},  # O: slot handed back
    S.CREATING: {S.STARTING,  # O: stored and ours
                 S.FAILED,  # O: refused, or given up
                 S.CREATING_ORPHANED,  # C
                 S.CREATING_DRAINED,  # D
                 S.DELETING,  # O: owner error
                 S.GONE},  # I: stored, then deleted before the answer came
    S.CREATING_ORPHANED: {S.STARTING_ORPHANED, S.FAILED, S.CREATING_DRAINED, S.DELETING, S.GONE},
    S.CREATING_DRAINED: {S.STARTING_DRAINED, S.FAILED, S.DELETING, S.GONE},
    S.STARTING: {S.LEASED,  # O: hand-out patch applied
                 S.WARM,  # O: a warm build, and its pool has room
                 S.STARTING_ORPHANED,  # C
                 S.STARTING_DRAINED,  # D
                 S.DELETING,  # O: failed, not Ready in the budget, surplus, patch failed
                 S.GONE},  # I
    S.STARTING_ORPHANED: {S.PARKED,  # O: Ready and no per-caller state
                          S.STARTING_DRAINED, S.DELETING, S.GONE},
    S.STARTING_DRAINED: {S.DELETING, S.GONE},
    S.WARM: {S.CHECKING,  # W: taken for an acquire
             S.DELETING,  # W: surplus or idle; D
             S.GONE},
    S.PARKED: {S.CHECKING, S.DELETING, S.GONE},
    S.CHECKING: {S.LEASED,  # W: healthy and patched
                 S.PARKED,  # R: a released grading pod restored and checked (reuse)
                 S.DELETING,  # W: unhealthy, patch failed, caller left; D
                 S.GONE},
    S.LEASED: {S.DELETING,  # D: released or drained; C: left in the tick it was handed out
               S.CHECKING,  # R: a grading pod released with reuse, being restored
               S.GONE},
    S.DELETING: {S.GONE},  # X: the API confirmed (404 included); I
    S.GONE: set(),
    S.FAILED: set(),
}.items()}
# An entry is born queued (an acquire or a warm build) or, for a pod found in the cluster with
# no entry (books rebuilt after a restart, a late create, the sweep), leased or deleting.
BORN = frozenset({S.QUEUED, S.LEASED, S.DELETING})

PRE_CREATE = frozenset({S.QUEUED, S.WITHDRAWN})
ORPHANED = frozenset({S.CREATING_ORPHANED, S.STARTING_ORPHANED})
DRAINED = frozenset({S.CREATING_DRAINED, S.STARTING_DRAINED})
POOLED = frozenset({S.WARM, S.PARKED})
TERMINAL = frozenset({S.GONE, S.FAILED})
ENDING = TERMINAL | {S.DELETING}
# Public words, in the order the stats show them.
ENTRY_STATES = ("queued", "creating", "starting", "warm", "checking", "leased", "deleting",
                "gone", "failed")


class IllegalTransition(RuntimeError):
    """A change the table does not allow: two actors disagree about an entry (a bug).

    Raised, not just logged, because raising is the safer of the two: the refused change is not
    applied, so the books never claim a state the pod is not in (a deleted pod handed out, a
    leased one trimmed as warm), and the actor stops where it stands. Every actor's error path
    fails closed by deleting the pod, and DELETING is legal from every state that may have a
    pod, so a refused move can cost one sandbox but never leaves a pod without an owner. Logging
    and carrying on would let the two actors keep acting on different pictures of one pod."""

    def __init__(self, name: str, frm: State, to: State, why: str):
        super().__init__(f"illegal transition of {name}: {frm.name} -> {to.name} ({why})")
        self.frm, self.to = frm, to


@dataclass(eq=False)
class Entry:
    name: str
    spec: SandboxSpec
    job: str
    nonce: str
    token: str | None
    owner: dict | None = None
    labels: dict = field(default_factory=dict)
    _stage: State = State.QUEUED  # written only by Books.move
    uid: str | None = None
    ip: str | None = None
    # The pod's annotation, for an entry found without its token (a restart): a holder's
    # token that hashes to it is learned back (Controller.prove).
    token_sha256: str | None = None
    slot: Slot | None = None
    warm_build: bool = False  # created for a pool, not for a caller
    handed: asyncio.Future | None = None  # the caller's answer; None for warm builds
    queue_wait: asyncio.Future | None = None
    t_queued: float = field(default_factory=time.monotonic)
    t_created: float | None = None
    timings: dict = field(default_factory=dict)
    created_wall: float = field(default_factory=time.time)
    warm_since: float | None = None
    conditions: dict | None = None  # declared run conditions (controller/conditions.py)
    conditions_check: dict | None = None  # {"verified", "unverified"} once checked
    error: str | None = None
    owner_ref: dict | None = None  # the job's ConfigMap, when no caller pod owns it
    lifetime: float | None = None  # seconds from hand-out (or renew) to expiry
    expires_at: float | None = None  # wall clock (epoch s), set at hand-out; None: never
    renewed: bool = False
    reuse_count: int = 0  # times this pod went back to a pool after a checked restore
    # The tenant whose grading ran in it last (None: unscoped): a reused pod goes back only to
    # that tenant's gradings, never across tenants.
    reuse_tenant: str | None = None
    # Why it ended under its holder (pod deleted by another party, failed, node lost),
    # set before it goes; kept past GONE in the controller's record (controller/lost.py).
    lost: Ending | None = None

    @property
    def stage(self) -> State:
        return self._stage

    @property
    def state(self) -> str:
        """The public word (the API's `state`)."""
        return self._stage.public

    @property
    def id(self) -> str:
        return self.name

    def eligible_for_warm(self) -> bool:
        # Per-caller state (an owner, custom labels) must never reach another caller.
        return self.owner is None and not self.labels and self.token is not None


class Books:
    """Entries by pod name, the informer's slim copy of each pod, and the names of creates that
    were given up on (deleted on sight if they appear). `on_move(entry, old, new)` runs after
    every change (`old` is None when an entry is added); the warm pool keeps its lists with it.
    """

    def __init__(self, on_move: Callable[[Entry, State | None, State], None] | None = None,
                 tenants: bool = False):
        self.tenants = tenants  # --auth kubernetes: job keys are `<tenant>.<job>`
        self.entries: dict[str, Entry] = {}
        self.pods: dict[str, dict] = {}  # informer cache: name -> slim pod (pods.slim_pod)
        self.retired: set[str] = set()
        self.on_move = on_move or (lambda e, old, new: None)
        self.illegal = 0  # refused transitions (each also logged and counted in metrics)
        self._wakers: dict[str, asyncio.Event] = {}

    def fields(self, e: Entry) -> dict[str, str | None]:
        """The ids of a log line about `e` (`extra=`, sandman/logs.py): its sandbox id, its
        job as the caller named it and its tenant (None, so left out even inside a tenant's
        request, for the warm pool's and unscoped jobs)."""
        tenant, job = split_job(e.job) if self.tenants else (None, e.job)
        return {"sandbox": e.id, "job": job, "tenant": tenant}

    # ---- changes ---------------------------------------------------------------------------
    def add(self, e: Entry) -> Entry:
        if e.stage not in BORN:
            raise IllegalTransition(e.name, e.stage, e.stage, "an entry cannot be born here")
        self.entries[e.name] = e
        self.on_move(e, None, e.stage)
        return e

    def found(self, pod: dict, slot: Slot, stage: State) -> Entry:
        """An entry for a pod found in the cluster with none (restart, late create, sweep)."""
        labels = P.labels(pod)
        e = Entry(P.name(pod), P.spec_of(pod), labels.get(contract.LABEL_JOB, POOL_JOB),
                  labels.get(contract.LABEL_NONCE, ""), None, uid=P.uid(pod),
                  ip=P.pod_ip(pod), slot=slot, _stage=stage,
                  token_sha256=P.annotation(pod, contract.ANNOTATION_TOKEN_SHA256))
        # The lease survives a restart or a new leader: it is read back from the pod.
        e.lifetime, e.expires_at = P.lifetime(pod), P.expires_at(pod)
        return self.add(e)

    def move(self, e: Entry, to: State, why: str = "") -> None:
        frm = e.stage
        if to not in TRANSITIONS[frm]:
            self.illegal += 1
            metrics.illegal_transition(frm.name, to.name)
            log.error("illegal transition of %s: %s -> %s (%s); refused", e.name, frm.name,
                      to.name, why, extra=self.fields(e))
            raise IllegalTransition(e.name, frm, to, why)
        e._stage = to
        if to in TERMINAL:
            # A terminal entry no longer counts against the caps and leaves the books.
            if e.slot is not None:
                e.slot.gone()
            if self.entries.get(e.name) is e:
                del self.entries[e.name]
        self.on_move(e, frm, to)

    def gone(self, e: Entry) -> None:
        """The pod is confirmed absent (idempotent)."""
        if e.stage not in TERMINAL:
            self.move(e, State.GONE, "confirmed absent")

    def rename(self, e: Entry, new: str) -> None:
        if self.entries.get(e.name) is e:
            del self.entries[e.name]
        e.name = new
        self.entries[new] = e

    # ---- the informer's view ---------------------------------------------------------------
    def observe(self, kind: str, pod: dict) -> dict | None:
        """One ADDED/MODIFIED/DELETED event. Returns the pod when it is a create this controller
        had given up on (the caller deletes it), else None."""
        name = P.name(pod)
        late = None
        if kind == "DELETED":
            self.pods.pop(name, None)
            e = self.entries.get(name)
            if (e is not None and e.stage not in PRE_CREATE
                    and (e.uid is None or e.uid == P.uid(pod))):
                self.gone(e)
        else:
            self.pods[name] = pod
            if name not in self.entries and name in self.retired and not P.deleting(pod):
                self.retired.discard(name)
                late = pod
        self.wake(name)
        return late

    def waker(self, name: str) -> asyncio.Event:
        return self._wakers.setdefault(name, asyncio.Event())

    def drop_waker(self, name: str) -> None:
        self._wakers.pop(name, None)

    def wake(self, name: str) -> None:
        w = self._wakers.get(name)
        if w:
            w.set()
