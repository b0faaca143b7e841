"""Lost sandboxes: why a handed-out sandbox ended without its holder's release, and the nodes
of leased pods that stopped being Ready (docs/controller.md, "Lost sandboxes").

A sandbox ends under its holder in three ways: its pod is deleted by another party (a
`kubectl delete`, the eviction API, pod GC once its Node is deleted), its pod fails (the
kubelet evicts it, its daemon exits), or its node is lost (the Node is NotReady for
--node-lost-after, or deleted: the controller ends the lease). The controller keeps one line
of why for each (`LostRecord`, bounded in time and number) and answers it, in place of a bare
"no sandbox", to callers that may see the sandbox (controller/routes.py).

Trust: every reason, and every decision to end a lease, is read from what the holder cannot
write. The holder runs processes in its pod, not the pod object: it can fail its readiness
probe, exit, write its container's termination message. So a node's state comes from the Node
object alone (its Ready condition: the node's kubelet and kube-controller-manager write it);
the pod gives only its spec.nodeName (the scheduler's, immutable once bound) and pod-level
fields that kube writes (phase, reason, message, the DisruptionTarget condition). Container
termination messages are never read, and a pod's own readiness only makes the controller look
at its node, never end a lease.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from controller import metrics
from controller import pods as P
from controller.books import Books, Entry, State

log = logging.getLogger("controller.lost")

# The metric's reasons (sandman_controller_leases_lost_total{reason}).
LOST_REASONS = metrics.LOST_REASONS
# How long and how many reasons are kept: a trainer asks on its next call (seconds to
# minutes later); ~300 bytes each, so the cap is ~3 MB.
KEEP_S = 3600.0
KEEP_MAX = 10_000
REASON_MAX = 300  # characters of one reason (the kubelet's eviction message is ~200)
# Nodes of leased, not-Ready pods are read again this often. kube-controller-manager marks a
# silent node's pods not Ready 40-50 s after its last heartbeat; 5 s more is small beside it.
NODE_CHECK_S = 5.0
NODE_READS_PER_CHECK = 50  # a bound on API reads per check (a rack lost at once)
# kube's own deleter that means "the node is gone": pod GC of a pod bound to no node.
POD_GC = "DeletionByPodGC"


def one_line(text: str, limit: int = REASON_MAX) -> str:
    """`text` as one printable line of at most `limit` characters."""
    s = "".join(ch if ch.isprintable() else "?" for ch in " ".join(str(text).split()))
    return s if len(s) <= limit else s[:limit - 3] + "..."


@dataclass(frozen=True)
class Ending:
    """Why a handed-out sandbox ended without its holder's release."""

    kind: str  # one of LOST_REASONS
    why: str  # one line, e.g. "its pod was deleted while leased (node n1 lost: ...)"


@dataclass(frozen=True)
class LostSandbox:
    job: str  # the scoped job key: its tenant decides who may read the reason
    ending: Ending
    at: float  # wall clock


class LostRecord:
    """The reasons of lost sandboxes by id, the oldest dropped first past `keep_max`, each
    dropped `keep_s` after it was added."""

    def __init__(self, keep_s: float = KEEP_S, keep_max: int = KEEP_MAX,
                 clock: Callable[[], float] = time.time):
        self.keep_s, self.keep_max, self.clock = keep_s, keep_max, clock
        self._by_id: OrderedDict[str, LostSandbox] = OrderedDict()

    def add(self, sid: str, job: str, ending: Ending) -> None:
        self._by_id.pop(sid, None)
        self._by_id[sid] = LostSandbox(job, ending, self.clock())
        self._trim()

    def get(self, sid: str) -> LostSandbox | None:
        self._trim()
        return self._by_id.get(sid)

    def __len__(self) -> int:
        return len(self._by_id)

    def _trim(self) -> None:
        cut = self.clock() - self.keep_s
        while self._by_id:
            first = next(iter(self._by_id.values()))
            if len(self._by_id) <= self.keep_max and first.at >= cut:
                return
            self._by_id.popitem(last=False)


# ---- nodes ---------------------------------------------------------------------------------

@dataclass
class NodeState:
    """A node as its Node object says, when this controller last read it."""

    ready: bool
    gone: bool = False  # no Node object (deleted), or being deleted
    status: str = ""  # the Ready condition's status (False, Unknown)
    why: str = ""  # the Ready condition's reason and message, one line
    since: str | None = None  # the Ready condition's lastTransitionTime, as written
    down_at: float | None = None  # this controller's clock when it first saw it down
    checked: float = 0.0

    def words(self, name: str) -> str:
        if self.gone:
            return f"node {name} was deleted"
        since = f" since {self.since}" if self.since else ""
        why = f": {self.why}" if self.why else ""
        return one_line(f"node {name} is not Ready ({self.status or 'no Ready condition'})"
                        f"{since}{why}")


def read_state(node: dict | None, prev: NodeState | None, now: float) -> NodeState:
    """The state of a node from its object (None: it does not exist)."""
    if node is None or (node.get("metadata") or {}).get("deletionTimestamp"):
        st = NodeState(ready=False, gone=True)
    else:
        cond: dict = next((c for c in (node.get("status") or {}).get("conditions") or []
                     if c.get("type") == "Ready"), {})
        status = str(cond.get("status") or "")
        why = ": ".join(str(cond[k]) for k in ("reason", "message") if cond.get(k))
        st = NodeState(ready=status == "True", status=status, why=one_line(why, 160),
                       since=cond.get("lastTransitionTime"))
    if not st.ready:
        st.down_at = prev.down_at if prev is not None and prev.down_at is not None else now
    st.checked = now
    return st


# ---- why a leased pod ended ----------------------------------------------------------------

def _kube_words(pod: dict) -> str | None:
    """kube's own reason for ending the pod: its DisruptionTarget, else its pod-level reason
    and message (the kubelet's eviction), one line; None without either."""
    d = P.disruption(pod)
    if d is not None:
        return one_line(": ".join(x for x in d if x)) or "DisruptionTarget"
    st = pod.get("status") or {}
    words = ": ".join(str(st[k]) for k in ("reason", "message") if st.get(k))
    return one_line(words) if words else None


def _kind(pod: dict, fallback: str) -> str:
    d = P.disruption(pod)
    if d is not None:
        return "node_lost" if d[0] == POD_GC else "evicted"
    if (pod.get("status") or {}).get("reason") == "Evicted":
        return "evicted"
    return fallback


def deleted_while_leased(pod: dict, node: NodeState | None) -> Ending:
    """A leased pod's DELETED event (not the controller's own delete): why, from its final
    state and its node's."""
    name = P.node_name(pod)
    if node is not None and name and not node.ready:
        return Ending("node_lost", f"its pod was deleted while leased ({node.words(name)})")
    kube = _kube_words(pod)
    if kube is None:
        return Ending("deleted", "its pod was deleted while leased, by another party than "
                                 "its holder's release (no reason recorded on the pod)")
    kind = _kind(pod, "failed" if (pod.get("status") or {}).get("phase") == "Failed"
                 else "deleted")
    where = f" on node {name}" if name else ""
    return Ending(kind, f"its pod was deleted while leased{where} ({kube})")


def ended_while_leased(pod: dict, node: NodeState | None) -> Ending:
    """A leased pod in phase Failed or Succeeded: it never runs again."""
    name = P.node_name(pod)
    phase = (pod.get("status") or {}).get("phase")
    if node is not None and name and not node.ready:
        return Ending("node_lost", f"its pod stopped while leased ({node.words(name)})")
    kube = _kube_words(pod)
    return Ending(_kind(pod, "failed"), f"its pod ended while leased (phase {phase}"
                                        + (f": {kube})" if kube else ")"))


# ---- the nodes of leased pods that are not Ready -------------------------------------------

class Nodes:
    """Reads the Node of every leased pod that is not Ready (and only those), every
    NODE_CHECK_S or sooner when `poke()`d, and ends the leases on a node that is deleted or
    not Ready for `lost_after` seconds of this controller's clock (0: only deleted nodes).

    `read_node(name)` is the Node object or None when there is none (a 404, or an empty list
    by name); `end(entry, ending)` ends a lease (the controller deletes the pod)."""

    def __init__(self, books: Books, read_node: Callable, end: Callable[[Entry, Ending], None],
                 lost_after: float, clock: Callable[[], float] = time.monotonic,
                 interval: float = NODE_CHECK_S, max_reads: int = NODE_READS_PER_CHECK):
        self.books, self.read_node, self.end = books, read_node, end
        self.lost_after, self.clock = lost_after, clock
        self.interval, self.max_reads = interval, max_reads
        self.states: dict[str, NodeState] = {}
        self._poked = asyncio.Event()

    def poke(self) -> None:
        """A leased pod stopped being Ready: check its node at the next turn."""
        self._poked.set()

    def down(self, name: str | None) -> NodeState | None:
        """The node's last read state when it was down, else None."""
        st = self.states.get(name or "")
        return st if st is not None and not st.ready else None

    def problem(self, e: Entry) -> str | None:
        """One line for a leased sandbox whose node is down (SandboxView.problem)."""
        if e.stage is not State.LEASED:
            return None
        pod = self.books.pods.get(e.name)
        name = P.node_name(pod) if pod is not None else None
        st = self.down(name)
        if st is None or name is None:
            return None
        end = ""
        if self.lost_after > 0 and st.down_at is not None and not st.gone:
            left = max(0.0, self.lost_after - (self.clock() - st.down_at))
            end = f"; the controller ends the lease in {left:.0f}s unless it recovers"
        return one_line(f"{st.words(name)}: its execd cannot be reached{end}", 400)

    def watched(self) -> dict[str, list[Entry]]:
        """Leased entries whose pod is not Ready, by node."""
        out: dict[str, list[Entry]] = {}
        for e in self.books.entries.values():
            if e.stage is not State.LEASED:
                continue
            pod = self.books.pods.get(e.name)
            if pod is None or (e.uid and P.uid(pod) != e.uid) or P.is_ready(pod):
                continue
            name = P.node_name(pod)
            if name:
                out.setdefault(name, []).append(e)
        return out

    async def loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._poked.wait(), timeout=self.interval)
            except TimeoutError:
                pass
            self._poked.clear()
            try:
                await self.check()
            except Exception:  # noqa: BLE001 - the next turn tries again
                log.exception("node check failed")
            await asyncio.sleep(1.0)  # pokes come with pod events: at most one check a second

    async def check(self) -> int:
        """Read the watched nodes (the least recently read first, at most max_reads) and end
        the leases on lost ones. Returns the leases ended."""
        want = self.watched()
        for name in list(self.states):
            if name not in want:
                del self.states[name]  # its pods are Ready again, or gone: read anew if needed
        order = sorted(want, key=lambda n: self.states[n].checked if n in self.states else 0.0)
        for name in order[:self.max_reads]:
            try:
                node = await self.read_node(name)
            except Exception as ex:  # noqa: BLE001 - an unanswered read says nothing
                log.warning("node %s: read failed: %s", name, ex)
                continue
            prev = self.states.get(name)
            st = self.states[name] = read_state(node, prev, self.clock())
            if not st.ready and (prev is None or prev.ready):
                log.warning("%s; %d leased sandbox(es) on it", st.words(name),
                            len(want[name]))
        ended = 0
        now = self.clock()
        for name, entries in want.items():
            down = self.down(name)
            if down is None:
                continue
            if not down.gone and not (self.lost_after > 0 and down.down_at is not None
                                      and now - down.down_at >= self.lost_after):
                continue
            how = ("" if down.gone else
                   f"; the controller ended the lease after {self.lost_after:g}s")
            for e in entries:
                if e.stage is State.LEASED:
                    self.end(e, Ending("node_lost", one_line(
                        f"its node was lost ({down.words(name)}){how}", 400)))
                    ended += 1
        return ended
