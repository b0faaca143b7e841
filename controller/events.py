"""Capacity signals from the kubelet's events (docs/metrics.md, docs/operations.md "Alerts").

Two read-only event watches, narrowed by field selectors so the API server sends only what is
counted (the paper's co-tenant ramp saw ~800 sandbox-failure events a minute; every other pod
event of the cluster would be far more):

- cluster-wide, `reason=FailedCreatePodSandBox` on pods: how the network plugin reports a pod
  address it could not assign (19-25% of the ramp's pods in one window; 813/min of other
  tenants' events while the ramp ran, 311 idle). Counted with `scope` `sandman` when the pod is
  one this controller created (its uid, from the books' entries, never a name or a label,
  which anyone can copy), else `other`;
- in the sandbox namespace, `reason=Pulled` on sandman's pods: the pull time in the kubelet's
  message (a create that pulls took 17.4 s at the median against 4.1 s with the image present).

An event object is counted once per occurrence: Kubernetes aggregates repeats into one object
whose `count` grows, so `Seen` keeps the last count per event uid (bounded, oldest forgotten
first) and a re-list adds nothing. Sandman's events and other tenants' are kept in two maps:
another tenant, who creates as many events as it likes in its own namespace, can then only
evict its own uids, never make an aggregated sandman event count again. The first list of each watch only primes `Seen`: those
events happened before this leader watched, and counting them at once would fire the alerts on
every restart or failover.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from kubernetes import client

from controller import metrics
from controller.kube import ListWatch

log = logging.getLogger("controller.events")

REASON_SANDBOX_FAILED = "FailedCreatePodSandBox"
REASON_PULLED = "Pulled"
# Event uids remembered for the dedupe: events live one hour (the API server's default TTL);
# at the ramp's peak of ~1,400 failure events a minute, 65,536 covers ~45 minutes of distinct
# objects in ~10 MB. Forgetting the oldest can only recount an event still being aggregated.
SEEN_CAP = 65536
# Pod uids of this controller's pods (uid -> role), for pods deleted since their event.
OWN_CAP = 65536
FORBIDDEN_RETRY_S = 60.0  # a refused event watch asks again this often (event_watch)
MESSAGE_CAP = 4096  # a longer message is not the kubelet's pull message: ignored unparsed
PULL_MAX_S = 86400.0  # a pull "longer" than a day is a forged or broken message: ignored

# The kubelet: 'Successfully pulled image "x" in 3.2s (3.2s including waiting)', older ones
# 'Successfully pulled image "x" in 3.204843s', newer ones append '. Image size: N bytes.'
# The duration is Go's time.Duration text: up to 4 parts of number + unit.
_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_PART = r"\d{1,12}(?:\.\d{1,12})?(?:ms|us|µs|ns|h|m|s)"
_PULLED = re.compile(r'Successfully pulled image "[^"\n]{1,2048}" in ((?:' + _PART
                     + r'){1,4})(?= \(|\. |\.?$)')
_PARTS = re.compile(r"(\d{1,12}(?:\.\d{1,12})?)(ms|us|µs|ns|h|m|s)")


def pull_seconds(message: object) -> float | None:
    """The pull time in a kubelet `Pulled` message (without its wait in the pull queue), or None
    for anything else: 'already present', odd, forged or absurd messages are ignored."""
    if not isinstance(message, str) or len(message) > MESSAGE_CAP:
        return None
    m = _PULLED.match(message)
    if m is None:
        return None
    total = sum(float(n) * _UNITS[u] for n, u in _PARTS.findall(m.group(1)))
    if not math.isfinite(total) or total < 0 or total > PULL_MAX_S:
        return None
    return total


def occurrences(ev: dict) -> int:
    """How many times the event object says it happened: `count` (core/v1), else
    `series.count` (events.k8s.io), else 1; anything not a sane integer counts as 1."""
    for n in (ev.get("count"), (ev.get("series") or {}).get("count")):
        if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 10**9:
            return n
    return 1


class Seen:
    """Last count per event uid, at most `cap` uids (the least recently seen forgotten)."""

    def __init__(self, cap: int = SEEN_CAP):
        self.cap = cap
        self._last: OrderedDict[str, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._last)

    def new(self, uid: str, count: int, counted: int = 0) -> int:
        """Occurrences of this event not counted yet (0 for a repeat or a re-list); `counted`:
        occurrences already counted elsewhere."""
        last = max(self._last.pop(uid, 0), counted)
        self._last[uid] = max(last, count)
        while len(self._last) > self.cap:
            self._last.popitem(last=False)
        return max(0, count - last)

    def forget(self, uid: str) -> int:
        """Drops the uid; returns the count it had (0 if unknown)."""
        return self._last.pop(uid, 0)


def slim_event(ev: dict) -> dict:
    """The fields counted, nothing else (the watch thread drops the rest before the loop)."""
    meta = ev.get("metadata") or {}
    obj = ev.get("involvedObject") or {}
    msg = ev.get("message")
    return {"uid": str(meta.get("uid") or ""), "reason": ev.get("reason"),
            "count": occurrences(ev),
            "kind": obj.get("kind"), "namespace": obj.get("namespace"), "pod_uid": obj.get("uid"),
            "message": msg if isinstance(msg, str) and len(msg) <= MESSAGE_CAP else None}


class CapacitySignals:
    """Counts the events the two watches deliver into controller/metrics.py; runs on the loop."""

    def __init__(self, namespace: str, seen_cap: int = SEEN_CAP, own_cap: int = OWN_CAP):
        self.ns = namespace
        self.seen_own = Seen(seen_cap)  # sandman's pods' events: out of other tenants' reach
        self.seen_other = Seen(seen_cap)
        self.own_cap = own_cap
        self._own: OrderedDict[str, str] = OrderedDict()  # pod uid -> role
        # pod uid -> the pull its kubelet reported, for the acquire's timings (bounded alike)
        self._pulls: OrderedDict[str, float] = OrderedDict()

    def remember(self, pod_uid: str, role: str) -> None:
        """A pod this controller created (or adopted from its books) has this uid."""
        self._own.pop(pod_uid, None)
        self._own[pod_uid] = role
        while len(self._own) > self.own_cap:
            self._own.popitem(last=False)

    def pull_seconds(self, pod_uid: str | None) -> float | None:
        """The pull this pod's kubelet reported (None: the image was present, or no Pulled
        event seen yet)."""
        return self._pulls.get(pod_uid) if pod_uid else None

    def is_own(self, ev: dict) -> bool:
        return (ev.get("kind") == "Pod" and ev.get("namespace") == self.ns
                and isinstance(ev.get("pod_uid"), str) and ev["pod_uid"] in self._own)

    def on_event(self, kind: str, obj: Any, prime: bool = False) -> None:
        """`kind`: SYNC (a list; `prime`: the watch's first one), ADDED, MODIFIED, DELETED."""
        if kind == "SYNC":
            for ev in obj:
                self._count(ev, prime)
        elif kind == "DELETED":  # expired: its uid never comes back
            self.seen_own.forget(obj.get("uid") or "")
            self.seen_other.forget(obj.get("uid") or "")
        elif kind in ("ADDED", "MODIFIED"):
            self._count(obj, False)

    def _count(self, ev: dict, prime: bool) -> None:
        uid = ev.get("uid")
        if not uid or ev.get("kind") != "Pod":
            return
        own = self.is_own(ev)
        if own:  # an event seen before its pod was remembered was counted as another's
            n = self.seen_own.new(uid, ev.get("count") or 1, self.seen_other.forget(uid))
        else:
            n = self.seen_other.new(uid, ev.get("count") or 1)
        if n <= 0 or prime:
            return
        if ev.get("reason") == REASON_SANDBOX_FAILED:
            metrics.pod_address_failures("sandman" if own else "other", n)
        elif ev.get("reason") == REASON_PULLED and own:
            secs = pull_seconds(ev.get("message"))
            if secs is not None:
                metrics.IMAGE_PULL_SECONDS.observe(secs)
                self._pulls[ev["pod_uid"]] = secs
                while len(self._pulls) > self.own_cap:
                    self._pulls.popitem(last=False)


def event_watch(core: client.CoreV1Api, loop: asyncio.AbstractEventLoop,
                on_event: Callable[..., None], field_selector: str,
                namespace: str | None = None) -> ListWatch:
    """List + watch of core/v1 events with a field selector (every namespace with None), slim
    (`slim_event`), the first list flagged to prime `Seen`. A refusal (403: the RBAC was not
    granted) is retried every minute, never fatal: the signals are advice, the acquires do not
    need them, so the start waits for `tried`, not `synced`."""
    def list_events(**kw: Any) -> Any:
        kw.update(field_selector=field_selector, _preload_content=False)
        if namespace is None:
            return core.list_event_for_all_namespaces(**kw)
        return core.list_namespaced_event(namespace, **kw)

    return ListWatch(f"event-watch-{'ns' if namespace else 'all'} ({field_selector})",
                     list_events, slim_event, loop, on_event, prime=True,
                     forbidden_retry_s=FORBIDDEN_RETRY_S)


def watches(core: client.CoreV1Api, namespace: str, loop: asyncio.AbstractEventLoop,
            on_event: Callable[..., None]) -> list[ListWatch]:
    """The two watches the signals need (module docstring)."""
    pod = "involvedObject.kind=Pod"
    return [event_watch(core, loop, on_event, f"reason={REASON_SANDBOX_FAILED},{pod}"),
            event_watch(core, loop, on_event, f"reason={REASON_PULLED},{pod}", namespace)]

