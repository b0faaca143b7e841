"""The co-tenant stop rule (docs/loadtest.md "Co-tenant stop rule"): a load test on a shared
cluster stops when other tenants' pods start failing. In the paper a sandbox ramp raised other
tenants' pod-sandbox failures from 311 to 813 a minute and another team's run failed; a
pre-registered rule on the same count stopped a later experiment after 2 of 12 cells.

What counts, on pods outside the run's own namespaces, each occurrence once:
  - a `FailedCreatePodSandBox` event (the network plugin could not set the pod up, usually no
    free address; an event aggregated N times counts N),
  - an `Evicted` event,
  - a pod seen in phase Failed that was not evicted (an evicted pod has its event already).
Events and pods that existed before the guard first looked are not counted.

The rule: the idle baseline is the count per minute over `--cotenant-baseline-s` before the
run starts; the run stops when the count over the last `--cotenant-window-s` (per minute) is
above max(baseline x `--cotenant-max-ratio`, baseline + `--cotenant-min-excess`). No locust
import: loadtest/common.py runs it in a greenlet; tests drive it directly."""

from __future__ import annotations

import json
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

REASONS = ("FailedCreatePodSandBox", "Evicted")
SEEN_CAP = 100_000  # event and pod uids remembered (oldest forgotten): ~15 MB at most


@dataclass(frozen=True)
class StopRule:
    baseline_s: float = 120.0
    window_s: float = 60.0
    max_ratio: float = 2.0
    min_excess: float = 10.0  # failures per minute
    poll_s: float = 5.0

    def check(self) -> None:
        """ValueError with one line for a rule that cannot work."""
        for name in ("baseline_s", "window_s", "poll_s"):
            v = getattr(self, name)
            if not v > 0 or v > 86400:
                raise ValueError(f"--cotenant-{name[:-2].replace('_', '-')}-s must be in "
                                 f"(0, 86400], not {v:g}")
        if self.poll_s > self.window_s:
            raise ValueError(f"--cotenant-poll-s ({self.poll_s:g}) must not exceed "
                             f"--cotenant-window-s ({self.window_s:g})")
        if not self.max_ratio >= 1:
            raise ValueError(f"--cotenant-max-ratio must be >= 1, not {self.max_ratio:g}")
        if not self.min_excess >= 0:
            raise ValueError(f"--cotenant-min-excess must be >= 0, not {self.min_excess:g}")

    def threshold(self, baseline_per_min: float) -> float:
        return max(baseline_per_min * self.max_ratio, baseline_per_min + self.min_excess)


def _count(ev: dict) -> int:
    n = ev.get("count")
    if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 10**9:
        return n
    n = (ev.get("series") or {}).get("count") if isinstance(ev.get("series"), dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 10**9 else 1


class Tally:
    """New failure occurrences on other tenants' pods, from listed events and Failed pods."""

    def __init__(self, own_namespaces: Iterable[str], cap: int = SEEN_CAP):
        self.own = frozenset(own_namespaces)
        self.cap = cap
        self._events: OrderedDict[str, int] = OrderedDict()  # event uid -> last count
        self._failed: OrderedDict[str, None] = OrderedDict()  # pod uid

    def _remember(self, d: OrderedDict, key: str, value) -> None:
        d.pop(key, None)
        d[key] = value
        while len(d) > self.cap:
            d.popitem(last=False)

    def add(self, events: Iterable[dict], failed_pods: Iterable[dict]) -> int:
        new = 0
        for ev in events:
            obj = ev.get("involvedObject") or {}
            uid = (ev.get("metadata") or {}).get("uid")
            if (not isinstance(uid, str) or obj.get("kind") != "Pod"
                    or ev.get("reason") not in REASONS or obj.get("namespace") in self.own):
                continue
            n = _count(ev)
            last = self._events.get(uid, 0)
            self._remember(self._events, uid, max(n, last))
            new += max(0, n - last)
        for pod in failed_pods:
            meta = pod.get("metadata") or {}
            st = pod.get("status") or {}
            uid = meta.get("uid")
            if (not isinstance(uid, str) or meta.get("namespace") in self.own
                    or st.get("phase") != "Failed" or st.get("reason") == "Evicted"
                    or uid in self._failed):
                continue
            self._remember(self._failed, uid, None)
            new += 1
        return new

    def __len__(self) -> int:
        return len(self._events) + len(self._failed)


class ClusterReader:
    """Lists what the tally reads, cluster-wide (read-only: list on events and pods)."""

    def __init__(self, core):
        self.core = core

    def _items(self, fn: Callable, selector: str) -> list[dict]:
        r = fn(field_selector=selector, _preload_content=False, _request_timeout=30)
        return json.loads(r.data).get("items") or []

    def read(self) -> tuple[list[dict], list[dict]]:
        events: list[dict] = []
        for reason in REASONS:
            events += self._items(self.core.list_event_for_all_namespaces,
                                  f"reason={reason},involvedObject.kind=Pod")
        pods = self._items(self.core.list_pod_for_all_namespaces, "status.phase=Failed")
        return events, pods


@dataclass
class StopCheck:
    per_min: float
    threshold: float
    fired: bool

    def line(self, rule: StopRule, baseline_per_min: float) -> str:
        return (f"co-tenant stop rule: other tenants' pod failures {self.per_min:.1f}/min over "
                f"the last {rule.window_s:g} s > threshold {self.threshold:.1f}/min (idle "
                f"baseline {baseline_per_min:.1f}/min over {rule.baseline_s:g} s, x"
                f"{rule.max_ratio:g} or +{rule.min_excess:g}/min)")


class Guard:
    """Baseline first (`measure_baseline`), then `poll()` every `rule.poll_s` during the run."""

    def __init__(self, read: Callable[[], tuple[list[dict], list[dict]]],
                 own_namespaces: Iterable[str], rule: StopRule,
                 clock: Callable[[], float] = time.monotonic):
        self.read = read
        self.rule = rule
        self.tally = Tally(own_namespaces)
        self.clock = clock
        self.baseline_per_min: float | None = None
        self.baseline_count = 0
        self._window: deque[tuple[float, int]] = deque()
        self.total = 0
        self.last_ok = clock()

    def prime(self) -> None:
        """What exists now happened before the guard looked: remembered, not counted."""
        self.tally.add(*self.read())
        self.last_ok = self.clock()

    def measure_baseline(self, sleep: Callable[[float], None]) -> float:
        self.prime()
        t0 = self.clock()
        end = t0 + self.rule.baseline_s
        n = 0
        for _ in range(int(self.rule.baseline_s / self.rule.poll_s) + 2):  # bounded
            left = end - self.clock()
            if left <= 0:
                break
            sleep(min(self.rule.poll_s, left))
            n += self.tally.add(*self.read())
        self.baseline_count = n
        self.baseline_per_min = n * 60.0 / max(self.clock() - t0, 1e-9)
        self.last_ok = self.clock()
        return self.baseline_per_min

    def record(self, n: int) -> StopCheck:
        """`n` new failures now; the verdict on the window that ends now."""
        now = self.clock()
        self.total += n
        self._window.append((now, n))
        while self._window and self._window[0][0] <= now - self.rule.window_s:
            self._window.popleft()
        per_min = sum(k for _, k in self._window) * 60.0 / self.rule.window_s
        thr = self.rule.threshold(self.baseline_per_min or 0.0)
        return StopCheck(per_min, thr, per_min > thr)

    def poll(self) -> StopCheck:
        """One read; a read that fails raises, and `blind_s()` grows."""
        got = self.read()
        self.last_ok = self.clock()
        return self.record(self.tally.add(*got))

    def blind_s(self) -> float:
        return self.clock() - self.last_ok
