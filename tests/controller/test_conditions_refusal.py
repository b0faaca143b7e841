"""The controller refuses pods that contradict an acquire's declared conditions, on the test
bed: a real controller (`--ready-check execd`), kwok pods, and a real execd behind each pod
(testbed/standin.py). kwok applies no cgroup limits, so each pod's execd reads a real cgroup
v2 tree this test builds (`conditions_root`): the first pod(s) get a tree that contradicts the
declaration, later ones a matching tree. Visible CPUs and egress are read for real (the
pod's shell affinity; a connection to a listener this test opens on 127.0.0.1).
"""

from __future__ import annotations

import re
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from sandman import api
from sandman.client import Client, ConditionsRefused
from testbed.controller import ControllerProc
from testbed.procs import wait_for
from testbed.standin import Standin
from tests.controller.harness import pods

IMAGE = "registry.invalid/swe/task:1"
GI = 1 << 30


def cgroup_tree(root: Path, cores: float, memory: int) -> str:
    """A cgroup v2 container view (cgroup namespace) with these limits at the pod level."""
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text("0::/pod/ctr\n")
    (root / "proc/self/mountinfo").write_text(
        "30 25 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n")
    cg = root / "sys/fs/cgroup"
    (cg / "pod/ctr").mkdir(parents=True)
    (cg / "cgroup.controllers").write_text("cpuset cpu memory pids\n")
    (cg / "pod/cpu.max").write_text(f"{int(cores * 100000)} 100000\n")
    (cg / "pod/memory.max").write_text(f"{memory}\n")
    (cg / "pod/ctr/cpu.max").write_text("max 100000\n")
    (cg / "pod/ctr/memory.max").write_text("max\n")
    return str(root)


class Roots:
    """Which tree each new pod's execd reads: `bad` for the first `n_bad` pods, then `good`."""

    def __init__(self, tmp: Path, n_bad: int):
        self.bad = cgroup_tree(tmp / "bad", 1.0, GI)  # 1 core where 2 are declared
        self.good = cgroup_tree(tmp / "good", 2.0, GI)
        self.n_bad = n_bad
        self.order: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, pod: str) -> str:
        with self._lock:
            self.order.append(pod)
            return self.bad if len(self.order) <= self.n_bad else self.good


@pytest.fixture
def listener():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    yield srv.getsockname()[1]
    srv.close()


def start(cluster, namespace, tmp_path, roots, listener, *flags):
    standin = Standin(cluster.core, namespace, tmp_path / "standin",
                      conditions_root=roots).start()
    ctl = ControllerProc(namespace, cluster.kubeconfig, tmp_path / "controller.log",
                         ["--lease-name", f"cond-{namespace}", "--conditions-attempts", "3",
                          "--conditions-egress-probe", f"127.0.0.1:{listener}", *flags],
                         ready_check="execd")
    try:
        ctl.start()
    except BaseException:
        standin.stop()
        raise
    return ctl, standin


@pytest.fixture
def stack(cluster, namespace, tmp_path, listener, request):
    roots = Roots(tmp_path, getattr(request, "param", 1))
    ctl, standin = start(cluster, namespace, tmp_path, roots, listener)
    try:
        yield ctl, standin, roots
    finally:
        ctl.kill()
        standin.stop()


def refused_count(ctl, field: str) -> float:
    text = httpx.get(ctl.url + api.METRICS.path, timeout=5).text
    m = re.search(r'^sandman_controller_conditions_refused_total\{field="' + field + r'"\} ([0-9.e+]+)$',
                  text, re.M)
    return float(m.group(1)) if m else 0.0


def live_pods(cluster, namespace) -> set[str]:
    return {p.metadata.name for p in pods(cluster.core, namespace)
            if not p.metadata.deletion_timestamp}


def events_of(cluster, namespace, pod: str) -> list[str]:
    evs = cluster.core.list_namespaced_event(namespace).items
    return [f"{e.reason}: {e.message}" for e in evs if e.involved_object.name == pod]


DECLARED = {"cpu_quota": 2, "memory_limit": "1Gi", "tz": "UTC", "hash_seed": "7",
            "time_limit_s": 30}


def test_contradicted_pod_is_refused_and_replaced(cluster, namespace, stack):
    ctl, standin, roots = stack
    with Client(ctl.url) as cl:
        with cl.acquire(IMAGE, job="cond", cpu="2", memory="1Gi", timeout_s=90,
                        conditions=DECLARED) as sb:
            assert len(roots.order) == 2, roots.order
            refused, handed = roots.order
            assert sb.pod == handed and sb.pod in standin.alive()
            check = sb.conditions_check
            assert check.verified == {"cpu_quota": 2.0, "memory_limit": GI, "tz": "UTC",
                                      "hash_seed": "7"}
            assert check.unverified == ["time_limit_s"]
            # The declared seed was applied to the shell, and survives its restart.
            assert sb.exec("echo $PYTHONHASHSEED").output.strip() == "7"
            sb.reset()
            assert sb.exec("echo $PYTHONHASHSEED").output.strip() == "7"
            # What the sandbox reads itself agrees with what the controller verified.
            c = sb.conditions()
            assert c.cpus == 2.0 and c.memory_limit_bytes == GI
            # The refused pod is deleted, with an event saying why, and counted.
            wait_for(lambda: refused not in live_pods(cluster, namespace), 20, "refused pod gone")
            ev = wait_for(lambda: [e for e in events_of(cluster, namespace, refused)
                                   if e.startswith("ConditionsRefused")], 10, "refusal event")
            assert "cpu_quota: declared 2.0, the pod reads 1.0" in ev[0], ev
            assert refused_count(ctl, "cpu_quota") == 1
            assert refused_count(ctl, "memory_limit") == 0


def test_matching_pod_is_handed_out_at_once(cluster, namespace, tmp_path, listener):
    roots = Roots(tmp_path, 0)
    ctl, standin = start(cluster, namespace, tmp_path, roots, listener)
    try:
        with Client(ctl.url) as cl:
            with cl.acquire(IMAGE, job="cond", cpu="2", memory="1Gi", timeout_s=90,
                            conditions={"cpu_quota": 2, "egress": "allow",
                                        "hash_seed": "random"}) as sb:
                assert roots.order == [sb.pod]
                # egress: the pod reached this test's listener, so outbound works.
                assert sb.conditions_check.verified == {"cpu_quota": 2.0, "egress": "allow",
                                                        "hash_seed": "random"}
            with cl.acquire(IMAGE, job="cond", cpu="2", memory="1Gi", timeout_s=90) as sb:
                assert sb.conditions_check is None  # nothing declared, nothing probed
        assert refused_count(ctl, "cpu_quota") == 0 and refused_count(ctl, "egress") == 0
    finally:
        ctl.kill()
        standin.stop()


def test_declared_cpu_count_the_pod_cannot_have_fails_after_its_retries(cluster, namespace,
                                                                        stack):
    ctl, standin, roots = stack
    import os

    have = len(os.sched_getaffinity(0))
    t0 = time.monotonic()
    with Client(ctl.url) as cl, pytest.raises(ConditionsRefused) as ei:
        cl.acquire(IMAGE, job="cond", cpu="2", memory="1Gi", timeout_s=90,
                   conditions={"visible_cpus": have + 62})
    assert time.monotonic() - t0 < 90
    msg = str(ei.value)
    assert "3 pod(s) refused" in msg and f"visible_cpus: declared {have + 62}" in msg, msg
    assert f"the pod reads {have}" in msg
    assert len(roots.order) == 3
    assert refused_count(ctl, "visible_cpus") == 3
    wait_for(lambda: not (set(roots.order) & live_pods(cluster, namespace)), 30,
             "every refused pod deleted")


def test_egress_deny_contradicted_by_a_reachable_listener(cluster, namespace, stack):
    ctl, standin, roots = stack
    with Client(ctl.url) as cl, pytest.raises(ConditionsRefused, match="egress: declared"):
        cl.acquire(IMAGE, job="cond", cpu="2", memory="1Gi", timeout_s=90,
                   conditions={"egress": "deny"})
    assert refused_count(ctl, "egress") == 3


def test_warm_pod_contradicting_is_refused_and_a_fresh_one_handed_out(cluster, namespace,
                                                                      stack):
    ctl, standin, roots = stack
    with Client(ctl.url) as cl:
        cl.prewarm(IMAGE, count=1, cpu="2", memory="1Gi")
        wait_for(lambda: httpx.get(ctl.url + api.STATS.path).json()["warm"] and any(
            v["warm"] == 1 for v in httpx.get(ctl.url + api.STATS.path).json()["warm"].values()),
            60, "one warm pod")
        warm_pod = roots.order[0]
        cl.prewarm(IMAGE, count=0, cpu="2", memory="1Gi")  # no replacement build after it
        with cl.acquire(IMAGE, job="cond", cpu="2", memory="1Gi", timeout_s=90,
                        conditions={"cpu_quota": 2}) as sb:
            assert sb.pod != warm_pod and not sb.warm
            assert sb.conditions_check.verified == {"cpu_quota": 2.0}
        wait_for(lambda: warm_pod not in live_pods(cluster, namespace), 20, "warm pod gone")
    assert refused_count(ctl, "cpu_quota") == 1


def test_bad_declarations_are_refused_in_one_line(stack):
    ctl, _, roots = stack
    for conds, field in (({"cpu_quota": -1}, "cpu_quota"), ({"memory_limit": "lots"},
                                                             "memory_limit"),
                         ({"cpus": 2}, "cpus")):
        r = httpx.post(ctl.url + api.ACQUIRE.path, timeout=10,
                       json={"image": IMAGE, "job": "cond", "conditions": conds})
        assert r.status_code in (400, 422), r.text
        err = r.json()["error"]
        assert err["type"] == "BadRequest" and field in err["message"]
        assert "\n" not in err["message"]
    assert roots.order == []  # nothing was created
