"""Sandbox lifetime on the test bed: expiry, renew (the route and the SDK's background renewing),
a SIGKILLed trainer leaking nothing, expiry kept across a leader change, owner= refused across
namespaces. Real controller processes, real pods on kwok nodes, a real SDK subprocess."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from sandman import api, contract
from sandman.client import AsyncClient, BadOwner, Client
from testbed.controller import ControllerProc
from testbed.procs import wait_for

# Lifetimes and renewals of a few seconds, measured against the clock: the timing tier.
pytestmark = pytest.mark.timing

IMAGE = "registry.invalid/swe/task:1"  # kwok never pulls
# Lifetimes of a few seconds keep these tests fast; the default minimum is 30 s.
FLAGS = ["--min-lifetime", "1", "--default-lifetime", "60", "--max-lifetime", "120",
         "--lease-duration", "3", "--lease-renew", "1"]


@pytest.fixture
def ctl(cluster, namespace, tmp_path):
    procs: list[ControllerProc] = []

    def make(*flags: str) -> ControllerProc:
        p = ControllerProc(namespace, cluster.kubeconfig,
                           tmp_path / f"controller-{len(procs)}.log",
                           ["--lease-name", f"life-{namespace}", *FLAGS, *flags])
        procs.append(p)
        return p.start()

    yield make
    for p in procs:
        p.kill()


def acquire(url: str, **kw) -> httpx.Response:
    body = {"image": IMAGE, "cpu": "1", "memory": "1Gi", "job": "life", "timeout_s": 60, **kw}
    return httpx.post(url + api.ACQUIRE.path, json=body, timeout=70)


def alive(cluster, namespace: str, pod: str) -> bool:
    """The pod exists, is not being deleted, and is still leased."""
    try:
        p = cluster.core.read_namespaced_pod(pod, namespace)
    except Exception:  # noqa: BLE001 - 404: gone
        return False
    return (p.metadata.deletion_timestamp is None
            and (p.metadata.labels or {}).get(contract.LABEL_STATE) == contract.STATE_LEASED)


def expired_events(cluster, namespace: str, pod: str) -> list:
    return [e for e in cluster.core.list_namespaced_event(namespace).items
            if e.involved_object.name == pod and e.reason == "SandboxExpired"]


def metric(url: str, name: str, label: str) -> float:
    for line in httpx.get(url + api.METRICS.path, timeout=5).text.splitlines():
        if line.startswith(f"{name}{{{label}}} "):
            return float(line.split()[-1])
    return 0.0


def test_an_unrenewed_sandbox_is_deleted_after_its_lifetime(cluster, namespace, ctl):
    c = ctl()
    r = acquire(c.url, lifetime_s=3)
    assert r.status_code == 201, r.text
    sb = r.json()
    assert sb["lifetime_s"] == 3 and sb["expires_at"].endswith("Z")
    pod = cluster.core.read_namespaced_pod(sb["pod"], namespace)
    ann = pod.metadata.annotations
    assert ann[contract.ANNOTATION_EXPIRES_AT] == sb["expires_at"]
    assert ann[contract.ANNOTATION_LIFETIME] == "3"
    view = httpx.get(c.url + api.GET.url(id=sb["id"]), timeout=5).json()
    assert view["expires_at"] == sb["expires_at"] and view["lifetime_s"] == 3
    t0 = time.monotonic()
    # Gone within the lifetime + one expiry pass (1 s) + API latency.
    wait_for(lambda: not alive(cluster, namespace, sb["pod"]), 3 + 1 + 5, "expiry")
    assert time.monotonic() - t0 > 1.0  # not deleted at once: it lived its lifetime
    ev = wait_for(lambda: expired_events(cluster, namespace, sb["pod"]), 10, "the event")
    assert "never renewed" in ev[0].message and ev[0].involved_object.kind == "Pod"
    assert metric(c.url, "sandman_controller_expired_total", 'renewed="false"') == 1
    r = httpx.get(c.url + api.GET.url(id=sb["id"]), timeout=5)
    assert r.status_code == 404 or r.json()["state"] in ("deleting", "gone")


def test_lifetime_bounds_are_refused_with_one_line(cluster, namespace, ctl):
    c = ctl()
    for bad, words in ((121, "above the controller's maximum (120s)"),
                       (0.5, "below the controller's minimum (1s)"),
                       (-3, "below the controller's minimum")):
        r = acquire(c.url, lifetime_s=bad)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "BadRequest" and words in err["message"]
        assert "\n" not in err["message"]
    r = acquire(c.url, lifetime_s="soon")
    assert r.status_code == 422 and r.json()["error"]["type"] == "BadRequest"
    assert "lifetime_s" in r.json()["error"]["message"]
    # Nothing was created for the refused requests.
    assert not cluster.core.list_namespaced_pod(namespace).items


def test_renew_route_extends_and_is_bounded(cluster, namespace, ctl):
    c = ctl()
    sb = acquire(c.url, lifetime_s=3).json()
    renew = api.RENEW.url(id=sb["id"])
    r = httpx.post(c.url + renew, json={"lifetime_s": 500}, timeout=5)
    assert r.status_code == 400 and "maximum" in r.json()["error"]["message"]
    r = httpx.post(c.url + renew, json={"lifetime_s": 20}, timeout=5)
    assert r.status_code == 200, r.text
    assert r.json()["lifetime_s"] == 20 and r.json()["expires_at"] > sb["expires_at"]
    ann = cluster.core.read_namespaced_pod(sb["pod"], namespace).metadata.annotations
    assert ann[contract.ANNOTATION_EXPIRES_AT] == r.json()["expires_at"]
    time.sleep(6)  # past the first lifetime and an expiry pass
    assert alive(cluster, namespace, sb["pod"])
    # No body: the sandbox's own (last) lifetime.
    r = httpx.post(c.url + renew, timeout=5)
    assert r.status_code == 200 and r.json()["lifetime_s"] == 20
    r = httpx.post(c.url + api.RENEW.url(id="sbx-nobody-00000"), timeout=5)
    assert r.status_code == 404 and r.json()["error"]["type"] == "SandboxGone"
    httpx.delete(c.url + api.RELEASE.url(id=sb["id"]), timeout=5)
    r = httpx.post(c.url + renew, timeout=5)
    assert r.status_code == 404


def test_a_renewing_sdk_keeps_its_sandboxes_past_their_lifetime(cluster, namespace, ctl):
    c = ctl()
    with Client(c.url) as cl:
        with cl.acquire(IMAGE, job="life", cpu="1", memory="1Gi", lifetime_s=3,
                        timeout_s=60) as sb:
            first = sb.expires_at
            time.sleep(8)  # more than 2 lifetimes + the expiry pass
            assert alive(cluster, namespace, sb.pod)
            assert sb.expires_at > first  # renewed in the background
            pod = sb.pod
        # Released on leaving: renewing stopped, nothing renews a released sandbox.
        wait_for(lambda: not alive(cluster, namespace, pod), 10, "release")

    async def main() -> str:
        async with AsyncClient(c.url) as cl:
            sb = await cl.acquire(IMAGE, job="life", cpu="1", memory="1Gi", lifetime_s=3,
                                  timeout_s=60)
            async with sb:
                await asyncio.sleep(8)
                assert alive(cluster, namespace, sb.pod)
                assert sb._renewer is not None and not sb._renewer.done()
            await asyncio.sleep(0.1)
            assert sb._renewer.done()  # stopped by the release
            return sb.pod

    pod = asyncio.run(main())
    wait_for(lambda: not alive(cluster, namespace, pod), 10, "release")
    assert metric(c.url, "sandman_controller_expired_total", 'renewed="true"') == 0
    assert metric(c.url, "sandman_controller_renews_total", 'result="ok"') >= 4


TRAINER = """
import sys, time
from sandman.client import Client
cl = Client(sys.argv[1])
sb = cl.acquire("registry.invalid/swe/task:1", job="trainer", cpu="1", memory="1Gi",
                lifetime_s=3, timeout_s=60)
print(sb.pod, flush=True)
time.sleep(120)
"""


def test_a_sigkilled_trainer_leaks_nothing_after_the_lifetime(cluster, namespace, ctl):
    c = ctl()
    proc = subprocess.Popen([sys.executable, "-c", TRAINER, c.url], stdout=subprocess.PIPE,
                            text=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                                os.path.abspath(__file__)))))
    try:
        pod = proc.stdout.readline().strip()
        assert pod, "the trainer printed no pod"
        time.sleep(6)  # two lifetimes: its renewing kept it
        assert alive(cluster, namespace, pod)
        proc.send_signal(signal.SIGKILL)  # no release, no atexit, nothing
        proc.wait(10)
        t0 = time.monotonic()
        wait_for(lambda: not alive(cluster, namespace, pod), 3 + 1 + 5, "the leak's end")
        assert time.monotonic() - t0 > 0.5  # it was the expiry, not the kill
        wait_for(lambda: not [p for p in cluster.core.list_namespaced_pod(namespace).items
                              if not p.metadata.deletion_timestamp], 15, "no pod left")
        assert metric(c.url, "sandman_controller_expired_total", 'renewed="true"') == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_expiry_survives_a_leader_change(cluster, namespace, ctl):
    a = ctl()
    short = acquire(a.url, lifetime_s=12).json()
    long_ = acquire(a.url, lifetime_s=100).json()
    a.kill()  # SIGKILL: the new leader knows the lifetimes only from the pods
    b = ctl()  # waits for "leader": after the killed one's lease (3 s) lapsed
    view = httpx.get(b.url + api.GET.url(id=short["id"]), timeout=5).json()
    assert view["expires_at"] == short["expires_at"] and view["lifetime_s"] == 12
    wait_for(lambda: not alive(cluster, namespace, short["pod"]), 12 + 1 + 5, "expiry by b")
    wait_for(lambda: expired_events(cluster, namespace, short["pod"]), 10, "b's event")
    assert metric(b.url, "sandman_controller_expired_total", 'renewed="false"') == 1
    assert alive(cluster, namespace, long_["pod"])


def test_owner_in_another_namespace_is_refused(cluster, namespace, ctl):
    """ownerReferences cannot cross namespaces: the GC would delete the sandbox at once."""
    c = ctl()
    other = cluster.new_namespace("life-owner")
    try:
        _owner_refused(cluster, namespace, c, other)
    finally:
        cluster.delete_namespace(other)


def _owner_refused(cluster, namespace: str, c: ControllerProc, other: str) -> None:
    trainer = cluster.core.create_namespaced_pod(other, {
        "metadata": {"name": "trainer"},
        "spec": {"containers": [{"name": "t", "image": "registry.invalid/trainer:1"}]}})
    r = acquire(c.url, owner={"name": "trainer", "uid": trainer.metadata.uid})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == api.BAD_OWNER.type and "namespace" in err["message"]
    with Client(c.url) as cl, pytest.raises(BadOwner):
        cl.acquire(IMAGE, job="life", cpu="1", memory="1Gi", timeout_s=60,
                   owner={"name": "trainer", "uid": trainer.metadata.uid})
    assert not cluster.core.list_namespaced_pod(namespace).items
    # The same name in the sandbox namespace but another uid: refused too.
    local = cluster.core.create_namespaced_pod(namespace, {
        "metadata": {"name": "trainer"},
        "spec": {"containers": [{"name": "t", "image": "registry.invalid/trainer:1"}]}})
    r = acquire(c.url, owner={"name": "trainer", "uid": trainer.metadata.uid})
    assert r.status_code == 400 and r.json()["error"]["type"] == api.BAD_OWNER.type
    # A same-namespace owner works, and the GC keeps the sandbox while the owner lives.
    r = acquire(c.url, owner={"name": "trainer", "uid": local.metadata.uid})
    assert r.status_code == 201, r.text
    time.sleep(3)
    assert alive(cluster, namespace, r.json()["pod"])
    refs = cluster.core.read_namespaced_pod(r.json()["pod"], namespace).metadata.owner_references
    assert [(o.kind, o.name, o.uid) for o in refs] == [("Pod", "trainer", local.metadata.uid)]
