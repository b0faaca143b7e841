"""Egress allowlists through the real controller on the test bed: an acquire's list is checked
against the controller's ceiling and never ranges before any create (a 400 naming the entry,
no pod), the pod carries egress=deny and the canonical list in its annotation, the list is
part of the warm-pool key (a pod built for one list is never handed to another, nor to plain
deny), the sandbox's info reports it, and a restarted controller reads each leased sandbox's
list back from its pod (the books are rebuilt from the pods)."""

from __future__ import annotations

import httpx
import pytest

from sandman import contract
from testbed.controller import ControllerProc
from testbed.procs import wait_for

pytestmark = pytest.mark.testbed

IMAGE = "registry.invalid/swe/task:1"  # kwok never pulls
CEILING = ("198.18.0.0/15:*/tcp", "svc/*.infra:3141")
NEVER = "198.19.255.0/24"  # inside the ceiling: entries within it are refused
LIST_A = ["198.18.0.1/32:8181/tcp", "svc/pypi-mirror.infra:3141/tcp"]
LIST_B = ["198.18.0.1/32:8182/tcp"]


def _start(namespace, cluster, tmp_path, name: str) -> ControllerProc:
    return ControllerProc(namespace, cluster.kubeconfig, tmp_path / f"{name}.log",
                          ["--lease-name", f"ctl-{namespace}", "--lease-duration", "4",
                           "--lease-renew", "1", "--egress-ceiling", ",".join(CEILING),
                           "--egress-never", NEVER]).start()


@pytest.fixture
def ctl(cluster, namespace, tmp_path):
    p = _start(namespace, cluster, tmp_path, "controller")
    yield p
    p.kill()


def acquire(url: str, egress, **kw) -> httpx.Response:
    body = {"image": IMAGE, "cpu": "1", "memory": "1Gi", "job": "job-e", "timeout_s": 60,
            "egress": egress, **kw}
    return httpx.post(url + "/v1/sandboxes", json=body, timeout=90)


def _pods(cluster, namespace) -> list:
    return cluster.core.list_namespaced_pod(namespace).items


def _warm(url: str) -> dict:
    return {k: v["warm"] for k, v in httpx.get(url + "/v1/stats").json()["warm"].items()
            if v["warm"]}


def test_the_list_is_the_pods_and_its_warm_key(cluster, namespace, ctl, tmp_path):
    r = httpx.post(ctl.url + "/v1/prewarm", json={
        "image": IMAGE, "count": 1, "idle_timeout_s": 300,
        "spec": {"cpu": "1", "memory": "1Gi", "egress": {"allow": list(reversed(LIST_A))}}})
    assert r.status_code == 200, r.text
    wait_for(lambda: sum(_warm(ctl.url).values()) == 1, 30, "1 warm allowlisted pod")
    (key,) = _warm(ctl.url)
    assert key.endswith("|deny|allow=" + ",".join(LIST_A)), key
    # Another list, and plain deny: never the warm pod built for LIST_A.
    for egress in ({"allow": LIST_B}, "deny"):
        other = acquire(ctl.url, egress)
        assert other.status_code == 201, other.text
        assert other.json()["warm"] is False, egress
    assert sum(_warm(ctl.url).values()) == 1
    # The same list spelled otherwise (no protocol, another order, a duplicate) is the key.
    same = acquire(ctl.url, {"allow": ["svc/pypi-mirror.infra:3141", "198.18.0.1:8181",
                                       "198.18.0.1/32:8181/tcp"]})
    assert same.status_code == 201 and same.json()["warm"] is True, same.text
    pod = cluster.core.read_namespaced_pod(same.json()["pod"], namespace)
    assert pod.metadata.labels[contract.LABEL_EGRESS] == contract.EGRESS_DENY
    assert pod.metadata.annotations[contract.ANNOTATION_EGRESS_ALLOW] == ",".join(LIST_A)
    info = httpx.get(ctl.url + f"/v1/sandboxes/{same.json()['id']}").json()
    assert (info["egress"], info["egress_allow"]) == ("deny", LIST_A)
    b = httpx.get(ctl.url + f"/v1/sandboxes/{acquire_id(ctl.url, 'job-e', LIST_B)}").json()
    assert b["egress_allow"] == LIST_B
    plain = [i for i in httpx.get(ctl.url + "/v1/sandboxes").json()["items"]
             if "egress_allow" not in i]
    assert plain and all(i["egress"] == "deny" for i in plain)

    # A restarted controller rebuilds its books from the pods: each leased sandbox's list
    # (its key) comes back from the annotation.
    ctl.kill()
    again = _start(namespace, cluster, tmp_path, "controller-2")
    try:
        def by_pod() -> dict:
            items = httpx.get(again.url + "/v1/sandboxes").json()["items"]
            return {i["pod"]: i.get("egress_allow") for i in items}

        wait_for(lambda: same.json()["pod"] in by_pod(), 30, "the leased pods adopted")
        got = by_pod()
        assert got[same.json()["pod"]] == LIST_A and got[b["pod"]] == LIST_B, got
        assert [v for v in got.values() if v is None], got  # the plain deny one
    finally:
        again.kill()


def acquire_id(url: str, job: str, allow: list[str]) -> str:
    items = httpx.get(url + "/v1/sandboxes", params={"job": job}).json()["items"]
    return next(i["id"] for i in items if i.get("egress_allow") == allow)


@pytest.mark.parametrize("allow,says", [
    (["10.0.0.0/8:22"], "egress entry '10.0.0.0/8:22/tcp' is outside the cluster's ceiling"),
    (["198.18.0.1:8181/udp"], "'198.18.0.1/32:8181/udp' is outside the cluster's ceiling"),
    (["198.16.0.0/14:80"], "'198.16.0.0/14:80/tcp' is outside"),  # a widened CIDR
    (["svc/pypi-mirror.other:3141"], "'svc/pypi-mirror.other:3141/tcp' is outside"),
    (["svc/pypi-mirror.infra:80"], "'svc/pypi-mirror.infra:80/tcp' is outside"),
    (["169.254.169.254:80"], "'169.254.169.254/32:80/tcp' is never allowed"),
    (["198.19.255.7:443"], "'198.19.255.7/32:443/tcp' is never allowed"),  # --egress-never
    (["198.18.0.1:8181", "10.0.0.1:80"], "'10.0.0.1/32:80/tcp' is outside"),  # one bad of two
])
def test_an_entry_outside_the_ceiling_is_refused_before_any_create(cluster, namespace, ctl,
                                                                   allow, says):
    before = len(_pods(cluster, namespace))
    r = acquire(ctl.url, {"allow": allow})
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert says in msg and "\n" not in msg, msg
    p = httpx.post(ctl.url + "/v1/prewarm", json={"image": IMAGE, "count": 1,
                                                   "spec": {"egress": {"allow": allow}}})
    assert p.status_code == 400 and says in p.json()["error"]["message"], p.text
    assert len(_pods(cluster, namespace)) == before


def test_a_wider_entry_is_admitted_with_the_never_range_inside_it(cluster, namespace, ctl):
    # 198.18.0.0/15 contains the admin's never range: admitted here, carved out by netguard
    # and the NetworkPolicy (their tests).
    r = acquire(ctl.url, {"allow": ["198.18.0.0/15:443"]})
    assert r.status_code == 201, r.text
