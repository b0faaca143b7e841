"""The capacity signals on the test bed's real API server (the logic: test_event_signals.py):
the controller's event watches count FailedCreatePodSandBox events on its own pods apart from
other tenants' (a lookalike pod in another namespace with the same name and labels, and an
event naming our pod with another uid, are other tenants'), read pull times from Pulled events
and ignore a forged message, observe create-to-Ready, and after a restart count nothing that
happened before it (the first list primes) while still knowing its adopted pods by uid.

Events are created directly, as the kubelet reports them (kwok runs no kubelet)."""

from __future__ import annotations

import secrets
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sandman.client import Client
from testbed.controller import start_controller

IMAGE = "registry.invalid/swe/task:1"
pytestmark = pytest.mark.testbed


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url + "/metrics", timeout=5).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def value(m: dict, name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


FAIL = "sandman_controller_pod_address_failures_total"
PULL = "sandman_controller_image_pull_seconds"


def post_event(core, ns: str, pod: str, pod_uid: str, reason: str, message: str,
               count: int = 1) -> str:
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    ev = core.create_namespaced_event(ns, {
        "metadata": {"generateName": f"{pod}."},
        "involvedObject": {"apiVersion": "v1", "kind": "Pod", "namespace": ns, "name": pod,
                           "uid": pod_uid},
        "reason": reason, "message": message, "count": count,
        "type": "Warning" if reason.startswith("Failed") else "Normal",
        "firstTimestamp": now, "lastTimestamp": now,
        "source": {"component": "kubelet", "host": "kwok-node-000"}})
    return ev.metadata.name


def wait_for(url: str, want: dict[tuple, float], timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        got = {k: value(m, k[0], **dict(k[1])) for k in want}
        if got == want:
            return m
        assert time.monotonic() < deadline, f"metrics {got} != {want}"
        time.sleep(0.3)


def key(name: str, **labels: str) -> tuple:
    return (name, tuple(sorted(labels.items())))


def test_signals_count_own_and_other_pods_apart(cluster, namespace, tmp_path):
    ctl = start_controller(namespace, cluster.kubeconfig, tmp_path / "ctl.log",
                           ["--lease-name", f"sig-{namespace}"])
    other = cluster.new_namespace("cotenant")
    core = cluster.core
    try:
        with Client(ctl.url) as cl:
            sb = cl.acquire(IMAGE, job="signals", cpu="100m", memory="128Mi", timeout_s=60)
            ours = core.read_namespaced_pod(sb.pod, namespace)
            uid = ours.metadata.uid
            # A co-tenant's lookalike: our pod's name and labels, in its own namespace.
            look = core.create_namespaced_pod(other, {
                "metadata": {"name": sb.pod, "labels": dict(ours.metadata.labels)},
                "spec": {"containers": [{"name": "c", "image": IMAGE}]}})
            failed = "Failed to create pod sandbox: failed to assign an IP address to container"
            post_event(core, namespace, sb.pod, uid, "FailedCreatePodSandBox", failed)
            storm = post_event(core, other, sb.pod, look.metadata.uid, "FailedCreatePodSandBox",
                               failed, count=2)
            # Our pod's name in our namespace, but not our pod's uid: not ours.
            post_event(core, namespace, sb.pod, secrets.token_hex(8), "FailedCreatePodSandBox",
                       failed)
            post_event(core, namespace, sb.pod, uid, "Pulled",
                       f'Successfully pulled image "{IMAGE}" in 3.2s (3.5s including waiting)')
            post_event(core, namespace, sb.pod, uid, "Pulled",
                       f'Successfully pulled image "{IMAGE}" in 99999999h (forged)')
            post_event(core, other, sb.pod, look.metadata.uid, "Pulled",
                       f'Successfully pulled image "{IMAGE}" in 7s')
            # The kubelet aggregates a repeat into the same object: 2 -> 5 is 3 more.
            core.patch_namespaced_event(storm, other, {"count": 5})
            m = wait_for(ctl.url, {key(FAIL, scope="sandman"): 1.0,
                                   key(FAIL, scope="other"): 6.0,
                                   key(PULL + "_count"): 1.0})
            assert value(m, PULL + "_sum") == pytest.approx(3.2)
            assert value(m, "sandman_controller_create_to_ready_seconds_count",
                         role="agent") == 1.0

            # A restart: the first list primes (nothing counted twice, nothing old at all),
            # and the adopted leased pod is still known as ours by its uid.
            ctl.stop()
            ctl.start()
            post_event(core, namespace, sb.pod, uid, "FailedCreatePodSandBox", failed)
            core.patch_namespaced_event(storm, other, {"count": 6})
            wait_for(ctl.url, {key(FAIL, scope="sandman"): 1.0, key(FAIL, scope="other"): 1.0,
                               key(PULL + "_count"): 0.0})
            sb.release()
    finally:
        ctl.stop()
        cluster.delete_namespace(other)
