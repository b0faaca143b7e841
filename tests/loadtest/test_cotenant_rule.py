"""The co-tenant stop rule (loadtest/cotenant.py): what counts and what does not, the threshold
over the idle baseline, memory under a flood; then on the test bed, a locust run that a
co-tenant failure storm stops with exit code 3 and a report line, and the same run beside a
quiet co-tenant (and a storm in the run's own namespace) that ends normally."""

from __future__ import annotations

import json
import secrets
import threading
import time
from pathlib import Path

import pytest

from loadtest import cotenant as C
from loadtest import report
from loadtest.run import COTENANT_STOP, EXIT_OK
from testbed.controller import start_controller
from testbed.stack import locust

OWN = "sandboxes"


def event(uid: str, ns: str, reason: str = "FailedCreatePodSandBox", count: int | None = 1,
          kind: str = "Pod") -> dict:
    return {"metadata": {"uid": uid, "namespace": ns}, "reason": reason, "count": count,
            "involvedObject": {"kind": kind, "namespace": ns, "name": "p", "uid": "u-" + uid}}


def failed_pod(uid: str, ns: str, reason: str | None = None, phase: str = "Failed") -> dict:
    st = {"phase": phase} | ({"reason": reason} if reason else {})
    return {"metadata": {"uid": uid, "namespace": ns}, "status": st}


# ---- the logic --------------------------------------------------------------------------------

def test_what_counts_on_other_tenants_pods():
    t = C.Tally({OWN, "lt-job"})
    n = t.add([event("a", "team-b"), event("b", "team-b", reason="Evicted", count=3),
               event("c", "team-c", count=None)],
              [failed_pod("p1", "team-b"), failed_pod("p2", "team-b", reason="Evicted")])
    assert n == 1 + 3 + 1 + 1  # the evicted pod's event is its count, its phase is not again


def test_what_never_counts():
    t = C.Tally({OWN, "lt-job"})
    n = t.add([event("own", OWN), event("job", "lt-job"),  # the run's own namespaces
               event("node", "team-b", kind="Node"),  # not a pod
               event("sched", "team-b", reason="FailedScheduling"),  # not a failure we count
               {"metadata": {}, "reason": "Evicted", "involvedObject": {"kind": "Pod"}},
               {}, {"metadata": None, "involvedObject": None}],
              [failed_pod("p", OWN), failed_pod("q", "team-b", phase="Running"), {}])
    assert n == 0


def test_each_occurrence_counts_once_across_relists():
    t = C.Tally({OWN})
    assert t.add([event("a", "team-b", count=2)], []) == 2
    assert t.add([event("a", "team-b", count=2)], [failed_pod("p", "team-b")]) == 1
    assert t.add([event("a", "team-b", count=5)], [failed_pod("p", "team-b")]) == 3
    assert t.add([event("a", "team-b", count=1)], []) == 0  # never backwards


def test_a_flood_keeps_memory_bounded():
    t = C.Tally({OWN}, cap=500)
    total = sum(t.add([event(f"e{i}", "team-b")], [failed_pod(f"p{i}", "team-b")])
                for i in range(5000))
    assert total == 10000 and len(t) == 1000


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def test_the_rule_fires_above_the_baseline_and_not_at_it():
    clock = Clock()
    feed: list[list[dict]] = []
    made = iter(range(10**6))

    def read():
        return [event(f"e{next(made)}", "team-b") for _ in range(feed.pop(0) if feed else 0)], []

    rule = C.StopRule(baseline_s=60, window_s=60, poll_s=10, max_ratio=2, min_excess=10)
    g = C.Guard(read, {OWN}, rule, clock)
    feed[:] = [500] + [5] * 6  # 500 old events (primed, not counted), then 5 per 10 s
    assert g.measure_baseline(clock.sleep) == pytest.approx(30.0)  # 30/min
    assert rule.threshold(30.0) == 60.0
    for _ in range(12):  # the same rate during the run: never fires
        clock.sleep(10)
        feed.append(5)
        assert not g.poll().fired
    verdicts = []
    for _ in range(6):  # 12 per 10 s: 72/min once the window is full of it
        clock.sleep(10)
        feed.append(12)
        verdicts.append(g.poll())
    assert [v.fired for v in verdicts][-1] and verdicts[-1].per_min == pytest.approx(72.0)
    assert not verdicts[0].fired  # one poll of 12 among five of 5: 37/min
    line = verdicts[-1].line(rule, 30.0)
    assert "72.0/min" in line and "threshold 60.0/min" in line and "baseline 30.0/min" in line


def test_an_idle_baseline_needs_the_minimum_excess():
    clock = Clock()
    rule = C.StopRule(baseline_s=10, window_s=60, poll_s=5, min_excess=10)
    g = C.Guard(lambda: ([], []), {OWN}, rule, clock)
    assert g.measure_baseline(clock.sleep) == 0.0
    assert not g.record(10).fired  # 10/min is not above 0 + 10
    assert g.record(1).fired


@pytest.mark.parametrize(("kw", "msg"), [
    ({"baseline_s": -1}, "--cotenant-baseline-s must be in (0, 86400]"),
    ({"window_s": float("nan")}, "--cotenant-window-s must be in (0, 86400]"),
    ({"poll_s": 0}, "--cotenant-poll-s must be in (0, 86400]"),
    ({"poll_s": 90, "window_s": 60}, "--cotenant-poll-s (90) must not exceed"),
    ({"max_ratio": 0.5}, "--cotenant-max-ratio must be >= 1"),
    ({"min_excess": -1}, "--cotenant-min-excess must be >= 0"),
])
def test_bad_rules_get_one_line(kw, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        C.StopRule(**kw).check()


# ---- on the test bed ----------------------------------------------------------------------------

def _storm(cluster, ns: str, n: int, failed_pods: int = 0) -> None:
    """Kubelet-like events on pods of `ns`, the way the kubelet reports them (core/v1 Events),
    plus pods that end Failed (unschedulable, so kwok leaves their status alone)."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for i in range(n):
        cluster.core.create_namespaced_event(ns, {
            "metadata": {"generateName": "storm-"},
            "involvedObject": {"apiVersion": "v1", "kind": "Pod", "namespace": ns,
                               "name": f"victim-{i}", "uid": secrets.token_hex(8)},
            "reason": "FailedCreatePodSandBox", "type": "Warning", "count": 1,
            "message": "Failed to create pod sandbox: failed to assign an IP address",
            "firstTimestamp": now, "lastTimestamp": now,
            "source": {"component": "kubelet", "host": "kwok-node-000"}})
    for i in range(failed_pods):
        name = f"failed-{i}"
        cluster.core.create_namespaced_pod(ns, {
            "metadata": {"name": name},
            "spec": {"nodeSelector": {"sandman.dev/no-such-node": "x"},
                     "containers": [{"name": "c", "image": "registry.invalid/x:1"}]}})
        cluster.core.patch_namespaced_pod_status(name, ns, {"status": {"phase": "Failed"}})


def _run(cluster, namespace: str, tmp: Path, name: str, during) -> tuple[int, dict, str]:
    """acquire_burst with the rule on (3 s baseline, 6 s window); `during(...)` runs once the
    run's first pod exists, while its 4 sandboxes are held for 20 s."""
    ctl = start_controller(namespace, cluster.kubeconfig, tmp / f"{name}-controller.log",
                           ["--lease-name", f"ct-{name}", "--log-level", "WARNING"])
    log = tmp / f"{name}.log"
    out: list[int] = []
    try:
        args = ["--shape", "burst64", "--run-users", "4", "--hold-s", "20", "--max-leaked", "0",
                "--controller-url", ctl.url, "--kubeconfig", str(cluster.kubeconfig),
                "--namespace", namespace, "--csv", str(tmp / name),
                "--cotenant-baseline-s", "3", "--cotenant-window-s", "6",
                "--cotenant-poll-s", "1", "--cotenant-min-excess", "10"]
        t = threading.Thread(target=lambda: out.append(locust("acquire_burst.py", args, log,
                                                              timeout=120)))
        t.start()
        deadline = time.monotonic() + 60
        while not cluster.core.list_namespaced_pod(namespace).items:
            assert t.is_alive(), log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the run created no pod in 60 s"
            time.sleep(0.2)
        during()
        t.join(150)
        assert not t.is_alive() and out, "locust did not end"
    finally:
        ctl.stop()
    return out[0], json.loads((tmp / f"{name}_sandman.json").read_text()), log.read_text()


def test_a_cotenant_failure_storm_stops_the_run(cluster, namespace, tmp_path):
    other = cluster.new_namespace("cotenant")
    try:
        code, s, log = _run(cluster, namespace, tmp_path, "storm",
                            lambda: _storm(cluster, other, 30, failed_pods=3))
    finally:
        cluster.delete_namespace(other)
    assert code == COTENANT_STOP, log[-3000:]
    c = s["cotenant"]
    assert c["stopped"].startswith("co-tenant stop rule: other tenants' pod failures"), c
    base = c["baseline_per_min"]
    assert c["threshold_per_min"] == pytest.approx(max(base * 2, base + 10), abs=0.01)
    assert s["exit_code"] == COTENANT_STOP and s["leaked"] == [], s
    assert {"check": c["stopped"], "ok": False} in s["thresholds"]
    text, _ = report.build(tmp_path)
    assert f"storm: STOPPED (exit {COTENANT_STOP}): co-tenant stop rule:" in text


def test_a_quiet_cotenant_lets_the_run_end(cluster, namespace, tmp_path):
    # The run's own namespace fails all along (a storm there is the run's own business): the
    # rule watches other tenants only.
    code, s, log = _run(cluster, namespace, tmp_path, "quiet",
                        lambda: _storm(cluster, namespace, 30))
    assert code == EXIT_OK, log[-3000:]
    c = s["cotenant"]
    assert c["stopped"] is None and c.get("peak_per_min", 0) <= c["threshold_per_min"], c
    text, _ = report.build(tmp_path)
    assert "quiet: co-tenant stop rule held" in text
