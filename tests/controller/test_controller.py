"""The controller against the real test bed: round trip, warm pool, drain, pacing, fairness,
cancellation, restart, failover, sweep. Callers are real HTTP clients; pods are real API objects
on kwok nodes."""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import threading
import time

import httpx
import jsonpatch
import pytest

from sandman import contract
from sandman.podspec import SandboxPolicy, check_sandbox, make_sandbox
from testbed.cluster import audit_pod_creates
from testbed.controller import ControllerProc
from testbed.procs import wait_for
from tests.controller.harness import pods, unowned

IMAGE = "registry.invalid/swe/task:1"  # kwok never pulls


@pytest.fixture
def ctl(cluster, namespace, tmp_path):
    procs: list[ControllerProc] = []

    def make(*flags: str, start: bool = True, lease: str | None = None) -> ControllerProc:
        p = ControllerProc(namespace, cluster.kubeconfig, tmp_path / f"controller-{len(procs)}.log",
                           ["--lease-name", lease or f"ctl-{namespace}", "--lease-duration", "4",
                            "--lease-renew", "1", *flags])
        procs.append(p)
        return p.start() if start else p

    yield make
    for p in procs:
        p.kill()


def acquire(url: str, job: str = "job-a", timeout: float = 60, **kw) -> httpx.Response:
    body = {"image": IMAGE, "cpu": "1", "memory": "1Gi", "job": job, **kw}
    return httpx.post(url + "/v1/sandboxes", json=body, timeout=timeout)


def test_acquire_ready_release_round_trip(cluster, namespace, ctl):
    c = ctl()
    r = acquire(c.url, timeout_s=60)
    assert r.status_code == 201, r.text
    sb = r.json()
    assert sb["warm"] is False and sb["port"] == contract.EXECD_PORT
    assert sb["address"].startswith("127.64.")
    pod = cluster.core.read_namespaced_pod(sb["pod"], namespace)
    labels = pod.metadata.labels
    assert labels[contract.LABEL_SANDBOX] == "true" and labels[contract.LABEL_JOB] == "job-a"
    assert labels[contract.LABEL_STATE] == contract.STATE_LEASED
    assert labels[contract.LABEL_NONCE]
    # Only the token's hash is in the cluster.
    ann = pod.metadata.annotations[contract.ANNOTATION_TOKEN_SHA256]
    assert ann == hashlib.sha256(sb["token"].encode()).hexdigest()
    assert sb["token"] not in str(cluster.api_client.sanitize_for_serialization(pod))
    owner = pod.metadata.owner_references[0]
    assert owner.kind == "ConfigMap" and owner.name.startswith("sandman-job-job-a")
    c0 = pod.spec.containers[0]
    assert c0.resources.requests == c0.resources.limits == {"cpu": "1", "memory": "1Gi"}
    assert pod.spec.enable_service_links is False
    assert pod.spec.automount_service_account_token is False
    assert pod.spec.topology_spread_constraints[0].max_skew == 2
    assert pod.spec.node_selector == {contract.LABEL_NODE_POOL_DEFAULT: "sandbox"}
    t = sb["timings"]
    assert set(t) == {"queued_ms", "create_ms", "started_ms", "ready_ms", "pull_ms"}
    assert t["pull_ms"] == 0  # kwok pulls nothing: no Pulled event with a duration
    # Running seen, then execd answered. Counted from the stored create: kwok may run the pod
    # before the create call returns (its watch event already in), and that rounds to 0.0.
    assert 0 <= t["started_ms"] <= t["ready_ms"]
    got = httpx.get(f"{c.url}/v1/sandboxes/{sb['id']}").json()
    assert got["state"] == "leased"
    assert httpx.delete(f"{c.url}/v1/sandboxes/{sb['id']}").json()["released"] is True
    assert httpx.delete(f"{c.url}/v1/sandboxes/{sb['id']}").json()["released"] is False
    wait_for(lambda: not pods(cluster.core, namespace), 20, "the released pod to be deleted")
    assert httpx.get(f"{c.url}/v1/sandboxes/{sb['id']}").status_code == 404


def test_controller_pod_passes_the_webhook_mutation_unchanged(cluster, namespace, ctl):
    c = ctl()
    sb = acquire(c.url).json()
    pod = cluster.api_client.sanitize_for_serialization(
        cluster.core.read_namespaced_pod(sb["pod"], namespace))
    policy = SandboxPolicy()
    # The stored pod (after API defaulting) mutates to itself: the webhook's patch is empty.
    assert jsonpatch.make_patch(pod, make_sandbox(pod, policy)).patch == []
    assert check_sandbox(pod, policy) == []


def test_warm_hit_replacement_and_idle_trim(cluster, namespace, ctl):
    c = ctl()
    spec = {"cpu": "1", "memory": "1Gi", "egress": "deny"}
    r = httpx.post(c.url + "/v1/prewarm", json={"image": IMAGE, "spec": spec, "count": 3,
                                                "idle_timeout_s": 8})
    assert r.status_code == 200, r.text

    def warm_count():
        st = httpx.get(c.url + "/v1/stats").json()["warm"]
        return sum(v["warm"] for v in st.values())

    wait_for(lambda: warm_count() == 3, 30, "3 warm pods")
    t0 = time.monotonic()
    sb = acquire(c.url, job="job-w").json()
    hit_ms = (time.monotonic() - t0) * 1000
    assert sb["warm"] is True, sb
    pod = cluster.core.read_namespaced_pod(sb["pod"], namespace)
    assert pod.metadata.labels[contract.LABEL_STATE] == contract.STATE_LEASED
    assert pod.metadata.labels[contract.LABEL_JOB] == "job-w"
    assert pod.metadata.owner_references[0].name.startswith("sandman-job-job-w")
    # A different spec never gets a warm pod.
    other = acquire(c.url, job="job-w", cpu="2").json()
    assert other["warm"] is False
    wait_for(lambda: warm_count() == 3, 30, "the replacement warm pod")
    # Idle for longer than idle_timeout_s: the warm pods go, the leased ones stay.
    wait_for(lambda: warm_count() == 0, 30, "idle trim")
    live = wait_for(lambda: (lambda ps: ps if len(ps) == 2 else None)(
        [p for p in pods(cluster.core, namespace) if not p.metadata.deletion_timestamp]),
        30, "only the 2 leased pods left")
    assert {p.metadata.name for p in live} == {sb["pod"], other["pod"]}
    print(f"warm hit acquire {hit_ms:.1f} ms")


def test_drain_deletes_only_that_job(cluster, namespace, ctl):
    c = ctl()
    a = [acquire(c.url, job="drain-me").json() for _ in range(3)]
    b = acquire(c.url, job="keep-me").json()
    r = httpx.post(c.url + "/v1/jobs/drain-me/drain").json()
    assert r["deleting"] == 3
    wait_for(lambda: {p.metadata.name for p in pods(cluster.core, namespace)} == {b["pod"]}, 30,
             "the drained job's pods to go")
    cms = {cm.metadata.name for cm in cluster.core.list_namespaced_config_map(namespace).items}
    assert not any(n.startswith("sandman-job-drain-me") for n in cms)
    assert any(n.startswith("sandman-job-keep-me") for n in cms)
    assert all(x["id"] for x in a)


class CreateWatch:
    """When each pod of the namespace first appears, from a real watch in its own process."""

    def __init__(self, kubeconfig, ns: str, seconds: float = 240):
        import subprocess
        import sys

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.controller.watch_creates", str(kubeconfig), ns,
             str(seconds)], stdout=subprocess.PIPE, text=True)
        first = self.proc.stdout.readline()
        assert first.startswith("ready"), first
        time.sleep(0.3)

    @property
    def times(self) -> dict[str, float]:
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=10)
        return {name: float(t) for name, t in (line.split() for line in out.splitlines())}

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()


async def _fire(url: str, bodies: list[dict], delay_s: float = 0.0) -> list[tuple]:
    await asyncio.sleep(delay_s)
    limits = httpx.Limits(max_connections=len(bodies) + 10, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=300, limits=limits) as cl:
        async def one(b):
            r = await cl.post(url + "/v1/sandboxes", json=b)
            return r.status_code, r.json(), time.monotonic()

        return await asyncio.gather(*(one(b) for b in bodies), return_exceptions=True)


@pytest.mark.timing
def test_pacing_600_acquires_at_50_per_second(cluster, namespace, ctl, figures):
    # burst 5, not 1: with a bucket of one token every late wake-up of the event loop (a few
    # ms under 600 open requests) is lost for good, and 50/s came out as 45.6/s.
    rate, burst = 50, 5
    c = ctl("--rate", str(rate), "--burst", str(burst), "--max-creating", "1000")
    cw = CreateWatch(cluster.kubeconfig, namespace)
    bodies = [{"image": IMAGE, "cpu": "100m", "memory": "128Mi", "job": "burst"}] * 600
    res = asyncio.run(_fire(c.url, bodies))
    time.sleep(1)
    watched = cw.times
    assert all(s == 201 for s, _, _ in res), [r for r in res if r[0] != 201][:3]
    assert len(watched) == 600, f"{len(watched)} pods seen by the watch for 600 acquires"
    # The windows are checked on when the API server received each create (its audit log),
    # not on when the watch delivered it: delivery bunches under CPU load (a run beside a CPU
    # burner saw 114 in a window while the controller's grants held 49.3/s). An external
    # cluster has no audit log here: the watch's times are the fallback.
    if cluster.testbed is not None and cluster.testbed.audit:
        ts, source = audit_pod_creates(cluster.testbed.audit_log, namespace), "audit"
    else:
        ts, source = sorted(watched.values()), "watch"
    assert len(ts) == 600, f"{len(ts)} creates in the {source} times for 600 acquires"
    # A bucket lets at most burst + rate * w through in any window of w seconds. Between the
    # grant and the API server's receipt each create crosses a thread pool, the GIL and the
    # loopback, and on a loaded 2-core machine that delay varies by up to ~0.2 s (a run beside
    # a CPU burner saw 65 in a window); 0.25 s of it is allowed. An unpaced or bypassed create
    # path, or a second bucket, shows here as 100+ per window.
    worst = max(sum(1 for t in ts[i:i + 3 * rate] if t - ts[i] < 1.0) for i in range(len(ts)))
    achieved = (len(ts) - 1) / (ts[-1] - ts[0])
    figures.add(f"controller pacing: 600 acquires at rate {rate}/s: achieved {achieved:.1f}/s, "
                f"max creates in any 1 s window {worst} ({source} times)")
    assert worst <= burst + rate * 1.25, f"{worst} creates in one 1 s window"
    assert abs(achieved - rate) / rate <= 0.05, f"achieved {achieved:.1f}/s"


@pytest.mark.timing
def test_fairness_small_job_not_starved(cluster, namespace, ctl, figures):
    c = ctl("--rate", "50", "--burst", "1", "--max-creating", "1000")
    big = [{"image": IMAGE, "cpu": "100m", "memory": "128Mi", "job": "big"}] * 500
    small = [{"image": IMAGE, "cpu": "100m", "memory": "128Mi", "job": "small"}] * 10

    async def main():
        t0 = time.monotonic()
        a, b = await asyncio.gather(_fire(c.url, big), _fire(c.url, small, delay_s=0.5))
        return t0, a, b

    t0, a, b = asyncio.run(main())
    assert all(s == 201 for s, _, _ in a + b)
    big_end = max(t for _, _, t in a) - t0
    small_end = max(t for _, _, t in b) - t0
    figures.add(f"controller fairness: job of 10 done at {small_end:.1f}s, job of 500 at "
                f"{big_end:.1f}s (rate 50/s)")
    assert small_end < big_end / 3, (small_end, big_end)


def test_caller_timeouts_and_disconnects_leave_no_unowned_pod(cluster, namespace, ctl):
    c = ctl("--rate", "4", "--burst", "1")
    # 12 acquires with a 1.5 s budget at 4 creates/s: some are withdrawn while queued, some
    # time out after their create was sent; both must end owned (warm) or deleted.
    bodies = [{"image": IMAGE, "cpu": "100m", "memory": "128Mi", "job": "impatient",
               "timeout_s": 1.5}] * 12
    res = asyncio.run(_fire(c.url, bodies))
    codes = [s for s, _, _ in res]
    assert 504 in codes
    assert all(r["error"]["type"] == "AcquireTimeout" for s, r, _ in res if s == 504)
    handed = {r["pod"] for s, r, _ in res if s == 201}

    # Disconnects: clients that give up (client-side timeout) while their acquire is queued.
    # Each carries a request id, as the SDK's do: an answer the controller sent as the client
    # gave up is lost in flight (no server can tell a response was read), and the client's
    # retry with the same id is how that lease finds its holder instead of waiting out its
    # lifetime. Twelve: the impatient round parks at most seven warm pods (one burst token and
    # four a second for 1.5 s), so some of these queue for a token past 0.5 s and are withdrawn.
    gone = [{"image": IMAGE, "cpu": "100m", "memory": "128Mi", "job": "gone",
             "request_id": f"gone-{i}"} for i in range(12)]

    async def impatient():
        async with httpx.AsyncClient(timeout=0.5) as cl:
            outs = await asyncio.gather(*(cl.post(c.url + "/v1/sandboxes", json=b)
                                          for b in gone), return_exceptions=True)
        return outs

    outs = asyncio.run(impatient())
    answered = {b["request_id"]: o.json()["pod"] for b, o in zip(gone, outs, strict=True)
                if isinstance(o, httpx.Response) and o.status_code == 201}
    assert len(answered) < len(gone), "every acquire answered inside 0.5 s: none was withdrawn"
    handed |= set(answered.values())
    time.sleep(3)
    # Withdrawn creates ended warm or deleted; the only leases to job "gone" are the ones
    # some caller holds or whose answer went out as its caller left.
    leased = {p.metadata.name for p in pods(cluster.core, namespace)
              if (p.metadata.labels or {}).get(contract.LABEL_STATE) == contract.STATE_LEASED}
    in_flight = leased - handed
    assert len(in_flight) <= len(gone) - len(answered), (in_flight, answered)
    # The callers come back with their request ids: an answered one gets the same sandbox, a
    # lost answer is recovered, a withdrawn one acquires anew (a warm pod or a new create).
    again = asyncio.run(_fire(c.url, gone))
    assert all(not isinstance(r, BaseException) and r[0] == 201 for r in again), again
    retried = {b["request_id"]: r[1]["pod"] for b, r in zip(gone, again, strict=True)}
    assert all(retried[k] == v for k, v in answered.items()), (retried, answered)
    assert in_flight <= set(retried.values()), (in_flight, retried)
    assert len(set(retried.values())) == len(gone)
    handed |= set(retried.values())
    assert unowned(cluster.core, namespace, c.url, handed) == []
    leased = {p.metadata.name for p in pods(cluster.core, namespace)
              if (p.metadata.labels or {}).get(contract.LABEL_STATE) == contract.STATE_LEASED}
    assert leased <= handed


def test_wait_false_over_cap_is_429_and_bad_input_is_one_line(cluster, namespace, ctl):
    c = ctl("--max-live", "1")
    assert acquire(c.url, warm_ok=False).status_code == 201
    r = acquire(c.url, wait=False)
    assert r.status_code == 429 and r.json()["error"]["type"] == "QueueFull"
    assert "cap" in r.json()["error"]["message"]
    for body, needle in [({"job": "x", "cpu": "1"}, "image"),
                         ({"image": IMAGE, "job": "no spaces allowed"}, "job"),
                         ({"image": IMAGE, "job": "x", "egress": "maybe"}, "egress"),
                         ({"image": IMAGE, "job": "x", "memory": "-1Gi"}, "memory"),
                         ({"image": IMAGE, "job": "x", "labels": {"sandman.dev/job": "y"}},
                          "reserved"),
                         ({"image": IMAGE, "job": "x", "timeout_s": -1}, "timeout_s")]:
        r = httpx.post(c.url + "/v1/sandboxes", json=body, timeout=10)
        assert r.status_code in (400, 422), (body, r.text)
        msg = r.json()["error"]["message"]
        assert needle in msg and "\n" not in msg, msg
    assert len(pods(cluster.core, namespace)) == 1


def test_not_ready_within_budget_is_deleted_with_events(cluster, namespace, ctl):
    # execd never answers on kwok pods: the readiness check fails within the budget.
    c = ctl("--ready-check", "execd", "--ready-budget", "3")
    r = acquire(c.url, timeout_s=3)
    assert r.status_code in (502, 504), r.text
    assert r.json()["error"]["type"] in ("AcquireTimeout", "PodFailed")
    wait_for(lambda: all(p.metadata.deletion_timestamp for p in pods(cluster.core, namespace))
             or not pods(cluster.core, namespace), 20, "the pod that never got ready to go")


# The residual window below is about a millisecond on a quiet machine; beside the real node's
# session 3 pods fell in it: the bound is a count within a time window, so it runs alone.
@pytest.mark.timing
def test_sigkill_mid_burst_then_restart_leaks_nothing(cluster, namespace, ctl):
    c = ctl("--rate", "20", "--burst", "1")
    cw = CreateWatch(cluster.kubeconfig, namespace)
    results: list = []

    def fire():
        results.extend(asyncio.run(_fire(c.url, [{"image": IMAGE, "cpu": "100m",
                                                   "memory": "128Mi", "job": "k"}] * 100)))

    t = threading.Thread(target=fire)
    t.start()
    time.sleep(2.0)
    c.kill()
    t.join(30)
    handed = {r[1]["pod"] for r in results if isinstance(r, tuple) and r[0] == 201}
    assert any(not isinstance(r, tuple) for r in results), "the kill should have cut requests"
    c2 = ctl("--rate", "20", "--burst", "1", lease=f"ctl-{namespace}")
    time.sleep(2)
    # Pods of the killed process that no caller got are deleted by the new leader's rebuild.
    # One residual window stays: killed after marking a pod leased, before its answer was
    # written (about a millisecond). Such a pod is still owned by its job's ConfigMap, so the
    # garbage collector or a drain removes it; it must never be ownerless.
    bad = unowned(cluster.core, namespace, c2.url, handed)
    for name in bad:
        p = cluster.core.read_namespaced_pod(name, namespace)
        assert p.metadata.labels[contract.LABEL_STATE] == contract.STATE_LEASED, name
        assert p.metadata.owner_references[0].kind == "ConfigMap", name
    assert len(bad) <= 2, f"{len(bad)} leased pods whose answer was lost: {bad}"
    left = {p.metadata.name for p in pods(cluster.core, namespace)
            if not p.metadata.deletion_timestamp}
    assert left <= handed | set(bad)
    created = cw.times
    assert len(created) <= 100, "more pods than acquires: a create was repeated"
    # The queue resumes on the new leader.
    assert acquire(c2.url, job="k").status_code == 201


def _role(url: str) -> str | None:
    try:
        r = httpx.get(url + "/readyz", timeout=1)
    except httpx.HTTPError:
        return None
    return r.json().get("role") if r.status_code == 200 else None


def test_leader_failover_rebuilds_books(cluster, namespace, ctl):
    lease = f"ha-{namespace}"
    a = ctl(lease=lease)
    b = ctl(lease=lease, start=False)
    b.start(wait_ready=False)
    b.wait_ready(15, role="standby")  # ready as a standby: readiness is not leadership
    time.sleep(2)
    assert (_role(a.url), _role(b.url)) == ("leader", "standby"), "two leaders"
    sb = acquire(a.url).json()
    t0 = time.monotonic()
    a.kill()
    wait_for(lambda: _role(b.url) == "leader", 30, "the standby to lead")
    took = time.monotonic() - t0
    assert took < 15, f"standby took {took:.1f}s to lead"
    got = httpx.get(f"{b.url}/v1/sandboxes/{sb['id']}")
    assert got.status_code == 200 and got.json()["state"] == "leased"
    assert httpx.delete(f"{b.url}/v1/sandboxes/{sb['id']}").json()["released"] is True


def test_standby_is_ready_and_serves_through_the_leader(cluster, namespace, ctl):
    """Two replicas behind one Service: both must be Ready (kwok hid that a standby answered
    /readyz 503, which kept a 2-replica Deployment at 1/2: `helm install --wait` timed out and
    a rolling update never scaled the old leader down). The Service then routes to both, so
    an API call that lands on the standby must be served: the standby forwards it to the
    leader named in the Lease, and while no leader answers it says NotLeader (503, retryable,
    connection closed) and the SDK retries until the standby has taken over."""
    from sandman.client import Client, RetryPolicy

    lease = f"ha-{namespace}"
    a = ctl(lease=lease)  # leader: ready once its books are synced
    b = ctl(lease=lease, start=False)
    b.start(wait_ready=False)
    b.wait_ready(15, role="standby")  # the standby is Ready too
    ra, rb = httpx.get(a.url + "/readyz"), httpx.get(b.url + "/readyz")
    assert (ra.status_code, rb.status_code) == (200, 200)
    assert (ra.json()["role"], rb.json()["role"]) == ("leader", "standby")
    assert httpx.get(b.url + "/livez").status_code == 200

    # Raw HTTP to the standby: served by the leader, one set of books.
    r = acquire(b.url, job="via-standby")
    assert r.status_code == 201, r.text
    sb = r.json()
    assert httpx.get(f"{a.url}/v1/sandboxes/{sb['id']}").json()["state"] == "leased"
    assert httpx.get(f"{b.url}/v1/sandboxes/{sb['id']}").json()["state"] == "leased"
    assert httpx.get(f"{b.url}/v1/sandboxes/nope").status_code == 404  # errors pass through
    bad = httpx.post(f"{b.url}/v1/sandboxes", json={"image": IMAGE})
    assert bad.status_code == 422 and bad.json()["error"]["type"] == "BadRequest"

    # The SDK through the standby, then across a failover: the leader dies, the standby keeps
    # answering NotLeader until the lease lapses (4 s here), the SDK retries, the standby leads.
    retry = RetryPolicy(attempts=60, backoff_s=0.2, backoff_max_s=1.0, budget_s=40)
    with Client(b.url, retry=retry) as client:
        s1 = client.acquire(IMAGE, job="sdk", cpu="100m", memory="128Mi", timeout_s=30)
        assert client.get(s1.id).state == "leased"
        a.kill()
        t0 = time.monotonic()
        s2 = client.acquire(IMAGE, job="sdk", cpu="100m", memory="128Mi", timeout_s=30)
        took = time.monotonic() - t0
        assert _role(b.url) == "leader"
        assert client.get(s1.id).state == "leased"  # the new leader rebuilt the books
        assert client.release(s2.id) is True and client.release(s1.id) is True
    assert took < 30, f"the SDK needed {took:.1f}s across the failover"
    assert httpx.delete(f"{b.url}/v1/sandboxes/{sb['id']}").json()["released"] is True


def test_sweep_deletes_unowned_controller_pods_only(cluster, namespace, ctl):
    c = ctl("--sweep-interval", "1", "--sweep-grace", "2")

    def pod(name, labels):
        return {"metadata": {"name": name, "labels": labels},
                "spec": {"containers": [{"name": "c", "image": IMAGE}],
                         "terminationGracePeriodSeconds": 0}}

    # As if a crashed create left it: the labels the controller's create writes (a sandbox,
    # the controller's), no entry in any book.
    cluster.core.create_namespaced_pod(namespace, pod("orphan", {
        contract.LABEL_SANDBOX: "true",
        contract.LABEL_MANAGED_BY: contract.MANAGED_BY_CONTROLLER,
        contract.LABEL_NONCE: secrets.token_hex(4)}))
    # Another client's sandbox (the webhook admits these): never the controller's to sweep.
    other = cluster.core.create_namespaced_pod(namespace, pod("tenant", {
        contract.LABEL_SANDBOX: "true"}))
    wait_for(lambda: "orphan" not in {p.metadata.name for p in pods(cluster.core, namespace)
                                      if not p.metadata.deletion_timestamp}, 20, "the sweep")
    still = cluster.core.read_namespaced_pod("tenant", namespace)
    assert still.metadata.uid == other.metadata.uid and not still.metadata.deletion_timestamp
    assert "sandman_controller_swept_total 1.0" in httpx.get(c.url + "/metrics").text


def test_acquire_request_id_is_idempotent(cluster, namespace, ctl):
    c = ctl()
    first = acquire(c.url, job="idem", request_id="try-1").json()
    again = acquire(c.url, job="idem", request_id="try-1").json()
    assert again["id"] == first["id"] and again["token"] == first["token"]
    other = acquire(c.url, job="idem", request_id="try-2").json()
    assert other["id"] != first["id"]
    live = [p for p in pods(cluster.core, namespace) if not p.metadata.deletion_timestamp]
    assert len(live) == 2, "a retried acquire made a second pod"
    # Once released, the key no longer returns the dead sandbox.
    httpx.delete(f"{c.url}/v1/sandboxes/{first['id']}")
    fresh = acquire(c.url, job="idem", request_id="try-1").json()
    assert fresh["id"] != first["id"]


def test_json_logs_one_object_per_line(cluster, namespace, ctl):
    """`--log-format json`: the controller's lines (its own, uvicorn's, a start-up refusal)
    are each one JSON object with time, level, logger and message, and a sandbox's lines carry
    its ids as fields."""
    import json
    import subprocess
    import sys

    c = ctl("--log-format", "json")
    r = acquire(c.url)
    assert r.status_code == 201, r.text
    # A sandbox's lines are found by its id as a field, not by matching messages: its
    # hand-out and its release, each with the job and the id of the call that caused it (the
    # acquire's made by the controller, the release's the caller's own X-Request-Id), and
    # none of another sandbox's.
    other = acquire(c.url, job="job-b")
    assert other.status_code == 201, other.text
    sid = r.json()["id"]
    rel = httpx.delete(f"{c.url}/v1/sandboxes/{sid}", headers={"X-Request-Id": "release-1"},
                       timeout=30)
    assert rel.status_code == 200 and rel.headers["x-request-id"] == "release-1"
    c.kill()
    lines = [ln for ln in c.log.read_text().splitlines() if ln.strip()]
    assert lines
    parsed = [json.loads(ln) for ln in lines]  # every line, not only some
    assert all({"time", "level", "logger", "message"} <= set(x) for x in parsed)
    assert any(x["logger"].startswith("controller") for x in parsed)
    mine = [x for x in parsed if x.get("sandbox") == sid]
    assert [(x["message"], x["job"], x["request_id"]) for x in mine] == [
        (f"handed out {sid} (created)", "job-a", r.headers["x-request-id"]),
        (f"deleting {sid}: released", "job-a", "release-1")], mine
    assert not any(x.get("sandbox") == sid for x in parsed
                   if x.get("request_id") == other.headers["x-request-id"])
    bad = subprocess.run([sys.executable, "-m", "controller", "serve", "--namespace", namespace,
                          "--kubeconfig", str(cluster.kubeconfig), "--listen", "127.0.0.1:x",
                          "--log-format", "json"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    err = [json.loads(ln) for ln in bad.stderr.splitlines() if ln.strip()]
    assert err[-1]["level"] == "ERROR" and err[-1]["message"].startswith("controller:")
