"""Authentication, authorization and tenants of the controller API (controller/auth.py), on the
test bed: real ServiceAccounts, tokens from the TokenRequest API (with audiences), real RBAC
(a ClusterRole bound by RoleBindings in tenant namespaces), the API server's own TokenReview
and SubjectAccessReview. The controller runs `--auth kubernetes` over https, as the chart runs
it (a local CA: raw calls verify it, the SDK through $SANDMAN_CA_FILE)."""

from __future__ import annotations

import asyncio
import ssl
import time

import httpx
import pytest
from kubernetes import client, config

from controller import auth as A
from controller.errors import BadRequest
from sandman import api, contract
from sandman.client import Client, Forbidden, Unauthenticated
from testbed.controller import local_tls_dir
from testbed.procs import wait_for
from tests.controller.faultproxy import Fault, FaultProxy
from tests.controller.harness import pods

IMAGE = "registry.invalid/swe/task:1"  # kwok never pulls


# ---- pure logic: no cluster

def test_job_keys_scope_jobs_per_tenant():
    assert A.scoped_job("team-a", "run.1") == "team-a.run.1"
    assert A.split_job("team-a.run.1") == ("team-a", "run.1")
    assert A.split_job(A.scoped_job(None, "run-1")) == (None, "run-1")
    assert A.split_job("sandman-pool") == (None, "sandman-pool")
    with pytest.raises(BadRequest, match="longer than 63"):
        A.scoped_job("t" * 40, "j" * 30)


def test_caller_labels_are_an_allowlist():
    pol = A.LabelPolicy(("example.com",))
    pol.check({"task": "t1", "example.com/run": "r"})
    for bad in ("app.kubernetes.io/component", "sandman.dev/trainer", "kubernetes.io/x",
                "node.k8s.io/y", "x.sandman.dev/z", "other.org/k", "bad key"):
        with pytest.raises(BadRequest):
            pol.check({bad: "v"})


def test_ttl_cache_is_bounded_in_size_and_time(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(A.time, "monotonic", lambda: now[0])
    c = A.TTLCache(ttl=10, size=2)
    c.put("a", 1)
    c.put("b", 2)
    assert c.get("a") == (True, 1)  # a is now the most recently used
    c.put("c", 3)
    assert c.get("b") == (False, None) and len(c) == 2
    now[0] += 10.5
    assert c.get("a") == (False, None) and c.get("c") == (False, None)


def test_service_account_namespace_is_the_default_tenant():
    assert A.Caller("system:serviceaccount:team-a:trainer").namespace == "team-a"
    assert A.Caller("alice@example.com").namespace is None
    assert A.Caller("u", "1").key != A.Caller("u", "2").key


def test_concurrent_questions_share_one_review_and_errors_are_not_cached():
    """A run start of many acquires with one token sends one TokenReview; a review that
    failed is asked again next time (never remembered, neither as a pass nor as a refusal).
    The review itself is replaced here: pure logic (the real one runs on the test bed below)."""
    ka = A.KubeAuth(client.ApiClient(), ttl=10)
    calls: list[str] = []

    def review(token: str):
        calls.append(token)
        time.sleep(0.05)
        if token == "down":
            raise A.AuthUnavailable("no answer")
        return None if token == "refused" else A.Caller("system:serviceaccount:a:b")

    ka._review = review

    async def main():
        got = await asyncio.gather(*(ka.authenticate("Bearer good") for _ in range(50)))
        assert {c.username for c in got} == {"system:serviceaccount:a:b"}
        for tok in ("down", "down", "refused", "refused"):
            with pytest.raises((A.AuthUnavailable, A.Unauthenticated)):
                await ka.authenticate(f"Bearer {tok}")

    try:
        asyncio.run(main())
    finally:
        ka.close()
    assert calls.count("good") == 1
    assert calls.count("down") == 2  # errors are not cached
    assert calls.count("refused") == 1  # a refusal is an answer: cached for the TTL


# ---- on the test bed

class _Verified:
    """httpx's get/post/delete, verifying the controller with the local CA."""

    def __getattr__(self, verb: str):
        def call(url: str, **kw) -> httpx.Response:
            ctx = ssl.create_default_context(cafile=str(local_tls_dir() / "ca.crt"))
            return httpx.request(verb.upper(), url, verify=ctx, **kw)
        return call


H = _Verified()


def bearer(token: str | None) -> dict:
    return {"Authorization": f"Bearer {token}"} if token else {}


def acquire(url: str, token: str | None, job: str = "run-1", **kw) -> httpx.Response:
    body = {"image": IMAGE, "cpu": "1", "memory": "1Gi", "job": job, "timeout_s": 60, **kw}
    return H.post(url + api.ACQUIRE.path, json=body, headers=bearer(token), timeout=90)


def err(r: httpx.Response) -> str:
    return r.json()["error"]["type"]


def test_who_may_call_and_tenants_never_meet(cluster, namespace, tenants, authctl, tmp_path,
                                             monkeypatch):
    a, b, shared = tenants.namespace("ta"), tenants.namespace("tb"), tenants.namespace("ts")
    tenants.account(a, "trainer")
    tenants.account(a, "other")  # same tenant, another identity
    tenants.account(a, "norbac")
    tenants.account(b, "trainer")
    tenants.bind(a, a, "trainer")
    tenants.bind(a, a, "other", name="sandman-user-other")
    tenants.bind(b, b, "trainer")
    tenants.bind(shared, a, "trainer")
    tok_a, tok_b = tenants.token(a, "trainer"), tenants.token(b, "trainer")
    ctl = authctl()
    assert ctl.url.startswith("https://")
    monkeypatch.setenv("SANDMAN_CA_FILE", str(local_tls_dir() / "ca.crt"))

    # Who: no token, a token for another audience, garbage -> 401 with WWW-Authenticate.
    for tok in (None, tenants.token(a, "trainer", audience="https://kubernetes.default.svc"),
                "not-a-token"):
        r = acquire(ctl.url, tok)
        assert r.status_code == 401 and err(r) == "Unauthenticated", r.text
        assert r.headers["www-authenticate"] == "Bearer"
        r = H.get(ctl.url + api.LIST.path, headers=bearer(tok), timeout=10)
        assert r.status_code == 401, r.text
    # What: a valid identity without RBAC -> 403, and nothing is created.
    tok_none = tenants.token(a, "norbac")
    for r in (acquire(ctl.url, tok_none),
              H.get(ctl.url + api.LIST.path, headers=bearer(tok_none), timeout=10),
              H.post(ctl.url + api.DRAIN.url(job="run-1"), headers=bearer(tok_none),
                         timeout=10)):
        assert r.status_code == 403 and err(r) == "Forbidden", r.text
    assert pods(cluster.core, namespace) == []
    with Client(ctl.url) as anonymous, pytest.raises(Unauthenticated):  # the SDK's type
        anonymous.list()
    # Probes and metrics stay open (the kubelet and Prometheus carry no token).
    assert H.get(ctl.url + api.READYZ.path, timeout=5).status_code == 200

    # Allowed: A through the SDK with `Client()` and the environment only (URL, token file,
    # CA file); B by hand, with
    # the same job name and the same request_id as A's.
    token_file = tmp_path / "token"
    token_file.write_text(tok_a)
    monkeypatch.setenv("SANDMAN_URL", ctl.url)
    monkeypatch.setenv("SANDMAN_TOKEN_FILE", str(token_file))
    with Client() as ca:
        sa = ca.acquire(IMAGE, job="run-1", cpu="1", memory="1Gi", timeout_s=60)
        rb = acquire(ctl.url, tok_b, request_id="rid-1")
        assert rb.status_code == 201, rb.text
        sb = rb.json()
        pod_a = cluster.core.read_namespaced_pod(sa.pod, namespace).metadata.labels
        assert pod_a[contract.LABEL_TENANT] == a and pod_a[contract.LABEL_JOB] == f"{a}.run-1"

        # A sees only its tenant: list, get, release and drain of B's are refused.
        seen = ca.list()
        assert [(s.id, s.job, s.tenant) for s in seen] == [(sa.id, "run-1", a)]
        assert ca.list(job="run-1") and not ca.list(namespace=shared)
        with pytest.raises(Forbidden):
            ca.list(namespace=b)
        with pytest.raises(Forbidden):
            ca.get(sb["id"])
        with pytest.raises(Forbidden):
            ca.release(sb["id"])
        with pytest.raises(Forbidden):  # renewing would keep B's pod past B's lifetime
            ca.renew(sb["id"])
        with pytest.raises(Forbidden):
            ca.drain("run-1", namespace=b)
        # Replays of B's request_id (same job name) by A, and of A's by another identity of
        # A's tenant, get a sandbox of their own: never B's (nor A's) id or token.
        ra = acquire(ctl.url, tok_a, request_id="rid-1")
        assert ra.status_code == 201 and ra.json()["id"] != sb["id"], ra.text
        assert ra.json()["token"] != sb["token"]
        rid_a = "rid-a"
        first = acquire(ctl.url, tok_a, request_id=rid_a).json()
        again = acquire(ctl.url, tok_a, request_id=rid_a).json()
        assert again["id"] == first["id"]  # the owner's own retry is still deduplicated
        other = acquire(ctl.url, tenants.token(a, "other"), request_id=rid_a)
        assert other.status_code == 201 and other.json()["id"] != first["id"], other.text
        # An explicit tenant: allowed where A is bound (shared), refused elsewhere (B).
        rs = acquire(ctl.url, tok_a, namespace=shared)
        assert rs.status_code == 201, rs.text
        assert acquire(ctl.url, tok_a, namespace=b).status_code == 403
        # A's drain of "run-1" takes A's sandboxes only; B's survives, still leased.
        assert ca.drain("run-1") == 4
        got = H.get(ctl.url + api.GET.url(id=sb["id"]), headers=bearer(tok_b), timeout=10)
        assert got.status_code == 200 and got.json()["state"] == "leased", got.text
        assert got.json()["tenant"] == b and got.json()["job"] == "run-1"
        # Admin operations need cluster-wide rights (sandman-admin through a
        # ClusterRoleBinding): a tenant's binding is not enough.
        r = H.post(ctl.url + api.PREWARM.path, json={"image": IMAGE, "count": 5},
                       headers=bearer(tok_a), timeout=10)
        assert r.status_code == 403, r.text
        assert H.get(ctl.url + api.STATS.path, headers=bearer(tok_a),
                         timeout=10).status_code == 403
        # Labels: never Kubernetes' or sandman's own (the controller's pod labels would make a
        # sandbox the sandbox NetworkPolicy's "controller" peer).
        r = acquire(ctl.url, tok_a, labels={"app.kubernetes.io/component": "controller"})
        assert r.status_code == 400 and "reserved" in r.json()["error"]["message"], r.text
        # B releases its own, A the one in the shared tenant.
        for sid, tok in ((sb["id"], tok_b), (rs.json()["id"], tok_a)):
            rel = H.delete(ctl.url + api.RELEASE.url(id=sid), headers=bearer(tok),
                               timeout=10)
            assert rel.json()["released"] is True, rel.text
    wait_for(lambda: not [p for p in pods(cluster.core, namespace)
                          if not p.metadata.deletion_timestamp], 30, "every pod released")


def test_revoked_binding_takes_effect_within_the_cache_ttl(cluster, tenants, authctl):
    a = tenants.namespace("tr")
    tenants.account(a, "trainer")
    tenants.bind(a, a, "trainer")
    tok = tenants.token(a, "trainer")
    ctl = authctl("--auth-cache-ttl", "1")
    url = ctl.url + api.LIST.path
    assert H.get(url, headers=bearer(tok), timeout=10).status_code == 200
    tenants.rbac.delete_namespaced_role_binding("sandman-user", a)
    wait_for(lambda: H.get(url, headers=bearer(tok), timeout=10).status_code == 403,
             10, "the revoked binding to be refused")


def test_an_api_server_that_cannot_answer_fails_closed(cluster, namespace, tenants, authctl,
                                                       tmp_path):
    """TokenReview and SubjectAccessReview answered 500 by a fault proxy in front of the API
    server: 503 AuthUnavailable, never a pass, and the error is not cached either way."""
    a = tenants.namespace("tf")
    tenants.account(a, "trainer")
    tenants.bind(a, a, "trainer")
    tok = tenants.token(a, "trainer")
    cfg = client.Configuration()
    config.load_kube_config(config_file=str(cluster.kubeconfig), client_configuration=cfg)
    proxy = FaultProxy(cfg.host, cfg.ssl_ca_cert, cfg.cert_file, cfg.key_file,
                       tmp_path / "proxy").start()
    try:
        ctl = authctl(kubeconfig=proxy.kubeconfig(tmp_path / "proxy.kubeconfig"))
        url = ctl.url + api.LIST.path
        tr = proxy.add(Fault("POST", r"/tokenreviews$", forward=False, answer=500, count=1))
        r = H.get(url, headers=bearer(tok), timeout=20)
        assert r.status_code == 503 and err(r) == "AuthUnavailable", r.text
        assert tr.fired == 1
        sar = proxy.add(Fault("POST", r"/subjectaccessreviews$", forward=False, answer=500,
                             count=1))
        r = H.get(url, headers=bearer(tok), timeout=20)
        assert r.status_code == 503 and err(r) == "AuthUnavailable", r.text
        assert sar.fired == 1
        # The API server answers again: the same token and question now pass.
        assert H.get(url, headers=bearer(tok), timeout=20).status_code == 200
    finally:
        proxy.stop()
