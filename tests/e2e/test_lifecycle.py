"""helm install --wait, helm test, helm upgrade --wait, helm uninstall of charts/sandman on the
real node. Runs last in tests/e2e (conftest orders it): it ends the install.

Catches, on real pods (kwok marked them all Ready): a standby controller that is never Ready
(`helm install --wait` and a rolling upgrade with maxUnavailable 0 never finish), a default
guard that cannot start (helm test's sandbox never Ready), a narrowed `sandbox.ingressFrom`
that locks the controller's execd check (and so helm test) out, or the kubelet's probes (they
come from the bridge's address on this CNI), and an uninstall that leaves the controller's
run-time objects (its sandboxes, ConfigMaps, Lease) or the helm test pod behind.
"""

from __future__ import annotations

import base64
import hashlib
import ssl
import sys
import time

import pytest

from sandman.contract import LABEL_MANAGED_BY, MANAGED_BY_CONTROLLER
from testbed import realnode
from tests.e2e.helpers import TASK_IMAGE, TRAINER_LABEL, bind_trainer, plain_pod

# A CIDR no pod is in: "the trainers' CIDR" of an install where neither the controller nor
# the helm test pod is a trainer.
NARROWED = realnode.OUTSIDE_NET
AFTER_UNINSTALL: dict[str, list[str]] = {}


def _deployments(inst) -> dict[str, dict]:
    items = inst.kget("deployments", "-n", inst.namespace)["items"]
    return {d["metadata"]["labels"]["app.kubernetes.io/component"]: d for d in items}


def _rolled_out(d: dict) -> bool:
    st, want = d.get("status", {}), d["spec"]["replicas"]
    return (st.get("observedGeneration") == d["metadata"]["generation"]
            and st.get("updatedReplicas") == want and st.get("readyReplicas") == want
            and st.get("replicas") == want and not st.get("unavailableReplicas"))


def test_narrowed_ingress_still_admits_the_controller_and_helm_test(sandman, figures):
    """sandbox.ingressFrom narrowed to a CIDR neither the controller nor the helm test pod is
    in: the controller's execd check (a sandbox is Ready for it only when execd answers it
    through the guard) and `helm test` must still get through. Nothing else is listed: the
    kubelet's probes (from the bridge's address on this CNI, not status.hostIP) get in through
    the guard's --ingress-from-gateway."""
    inst = sandman.inst
    t0 = time.monotonic()
    inst.upgrade({"sandbox": {"ingressFrom": [NARROWED]}})
    try:
        res = inst.test(check=False)
        assert res.returncode == 0, (f"helm test with sandbox.ingressFrom={NARROWED} failed:\n"
                                     f"{res.stdout[-3000:]}{res.stderr[-2000:]}")
    finally:
        inst.upgrade()
        figures.add(f"e2e: narrowed ingressFrom: upgrade, helm test, upgrade back "
                    f"{time.monotonic() - t0:.1f}s")


# Run in a caller pod's netns: acquire one sandbox and exit WITHOUT releasing it (no close),
# so it is still leased, running, when the release is uninstalled.
# Runs in the caller pod's network namespace with the host's files, so no cluster DNS: it
# dials the Service's cluster IP and verifies the certificate for the Service's name (SNI).
# First a bare handshake the same way: the certificate served is printed, to be compared with
# the chart's Secret.
ACQUIRE_AND_KEEP = """
import hashlib, socket, ssl, sys, urllib.parse, httpx
url, image, token, ca, name = sys.argv[1:6]
u = urllib.parse.urlsplit(url)
with socket.create_connection((u.hostname, u.port), timeout=30) as raw, \\
        ssl.create_default_context(cafile=ca).wrap_socket(raw, server_hostname=name) as tls:
    print("E2E-CERT " + hashlib.sha256(tls.getpeercert(binary_form=True)).hexdigest())
with httpx.Client(verify=ssl.create_default_context(cafile=ca), timeout=150) as c:
    r = c.post(url + "/v1/sandboxes", json={"image": image, "job": "e2e-uninstall",
                                            "cpu": "100m", "memory": "128Mi", "timeout_s": 120},
               headers={"Authorization": "Bearer " + token}, extensions={"sni_hostname": name})
r.raise_for_status()
print("E2E-POD " + r.json()["pod"])
"""


def _managed_pods(inst) -> list[str]:
    return [p["metadata"]["name"] for p in inst.kget(
        "pods", "-n", inst.sandbox_namespace, "-l",
        f"{LABEL_MANAGED_BY}={MANAGED_BY_CONTROLLER}")["items"]]


def test_install_test_upgrade_uninstall(sandman, ns, figures, tmp_path):
    inst = sandman.inst
    # Every replica Ready, the standby included. This runs after the package's other tests,
    # which kill replicas and upgrade (helm's --wait may return with one replica still
    # starting), so the Deployments are given a bounded time to be whole again first.
    deadline = time.monotonic() + 180
    deps = _deployments(inst)
    while not all(_rolled_out(d) for d in deps.values()) and time.monotonic() < deadline:
        time.sleep(1)
        deps = _deployments(inst)
    assert set(deps) == {"webhook", "controller"}, sorted(deps)
    assert deps["webhook"]["status"].get("readyReplicas") == 3, deps["webhook"]["status"]
    assert deps["controller"]["status"].get("readyReplicas") == 2, deps["controller"]["status"]
    jobs = inst.kget("jobs", "-n", inst.namespace)["items"]
    assert jobs and all(j["status"].get("succeeded") == 1 for j in jobs), \
        [j["status"] for j in jobs]

    t0 = time.monotonic()
    res = inst.test(check=False)
    assert res.returncode == 0, f"helm test failed:\n{res.stdout[-3000:]}{res.stderr[-2000:]}"
    assert "ok: acquired, ran `echo ok`, released" in res.stdout, res.stdout[-2000:]
    t_test = time.monotonic() - t0

    # A changed value both Deployments take (a policy arg): the webhook and the controller
    # roll with maxUnavailable 0, which needs every new replica, standby included, Ready.
    revisions = {k: d["metadata"]["annotations"]["deployment.kubernetes.io/revision"]
                 for k, d in deps.items()}
    took = inst.upgrade({"sandbox": {"guard": "egress-deny"}})
    deps = _deployments(inst)
    for k, d in deps.items():
        assert d["metadata"]["annotations"]["deployment.kubernetes.io/revision"] != revisions[k], k
        assert "--guard=egress-deny" in d["spec"]["template"]["spec"]["containers"][0]["args"], k
        assert _rolled_out(d), (k, d["status"])
    # Every pod of the old ReplicaSets is gone or on its way out (deleted after the rollout).
    hashes = {_template_hash(inst, k) for k in deps}
    old_pods = [p["metadata"]["name"] for p in inst.kget("pods", "-n", inst.namespace)["items"]
                if p["metadata"].get("labels", {}).get("app.kubernetes.io/component")
                in ("webhook", "controller")
                and p["metadata"]["labels"].get("pod-template-hash") not in hashes
                and not p["metadata"].get("deletionTimestamp")]
    assert not old_pods, f"pods of the old ReplicaSets still live: {old_pods}"

    t1 = time.monotonic()
    res = inst.test(check=False)
    assert res.returncode == 0, f"helm test after the upgrade:\n{res.stdout[-3000:]}"
    t_test2 = time.monotonic() - t1

    # A sandbox still running (leased, never released) when the release goes.
    # A trainer as docs/sdk.md sets one up: its namespace labelled and bound to sandman-user,
    # the pod labelled (the controller's NetworkPolicy), a token for the controller's audience.
    bind_trainer(sandman.cluster.api_client, ns)
    sandman.run_ready(ns, plain_pod("caller", labels={TRAINER_LABEL: "true"}))
    token = sandman.core.create_namespaced_service_account_token("default", ns, {
        "spec": {"audiences": ["sandman"], "expirationSeconds": 600}}).status.token
    svc = inst.kget("service", inst.controller_service(), "-n", inst.namespace)["spec"]
    ca = tmp_path / "ca.crt"
    ca.write_text(inst.ca_bundle())
    res = sandman.netns(ns, "caller", [sys.executable, "-c", ACQUIRE_AND_KEEP,
                                       f"https://{svc['clusterIP']}:{svc['ports'][0]['port']}",
                                       TASK_IMAGE, token, str(ca), inst.controller_host()],
                        timeout=180)
    kept = [ln.split()[1] for ln in res.stdout.splitlines() if ln.startswith("E2E-POD ")]
    assert res.returncode == 0 and kept, f"acquire failed: {res.stderr[-2000:]}"
    # The controller serves https with the chart's certificate: the leaf in the Secret the
    # chart mounts (verified above with the published CA, for the Service's name).
    served = [ln.split()[1] for ln in res.stdout.splitlines() if ln.startswith("E2E-CERT ")]
    secret = inst.kget("secret", f"{inst.controller_service()}-tls", "-n", inst.namespace)
    leaf = base64.b64decode(secret["data"]["tls.crt"]).decode()
    leaf = leaf[:leaf.index("-----END CERTIFICATE-----") + len("-----END CERTIFICATE-----")]
    assert served == [hashlib.sha256(ssl.PEM_cert_to_DER_cert(leaf)).hexdigest()], served
    assert kept[0] in _managed_pods(inst), (kept, _managed_pods(inst))

    t2 = time.monotonic()
    inst.uninstall()
    # Helm's own objects, then the post-delete hook's cleanup (the test pod, the controller's
    # sandboxes, ConfigMaps and Lease); the hook's Job pod and the sandboxes go through the GC
    # and their grace periods.
    test_pod = f"pod/{inst.release}-test"
    deadline = time.monotonic() + 90
    left = inst.leftovers() + inst.runtime_leftovers()
    while left and time.monotonic() < deadline:
        time.sleep(1)
        left = inst.leftovers() + inst.runtime_leftovers()
    # Here Helm's rendered objects; the rest (test_nothing_at_all_left_after_uninstall) is the
    # cleanup hook's: the helm test pod and what the controller made at run time.
    by_helm = [n for n in inst.leftovers() if n != test_pod]
    assert not by_helm, f"left after helm uninstall: {by_helm}"
    AFTER_UNINSTALL["runtime"] = sorted(
        [f"{inst.namespace}/{n}" for n in inst.leftovers() if n == test_pod]
        + inst.runtime_leftovers())
    figures.add(f"e2e: helm test {t_test:.1f}s; upgrade --wait (both Deployments rolled) "
                f"{took:.1f}s; helm test again {t_test2:.1f}s; uninstall + nothing left "
                f"{time.monotonic() - t2:.1f}s")


def _template_hash(inst, component: str) -> str:
    rs = inst.kget("replicasets", "-n", inst.namespace, "-l",
                   f"app.kubernetes.io/component={component}")["items"]
    live = [r for r in rs if r["spec"].get("replicas")]
    assert len(live) == 1, [(r["metadata"]["name"], r["spec"].get("replicas")) for r in rs]
    return live[0]["metadata"]["labels"]["pod-template-hash"]



def test_nothing_at_all_left_after_uninstall():
    """Found on the real node: helm uninstall left the helm test pod (hook policy
    before-hook-creation), the controller's Lease and its per-job ConfigMaps, and any sandbox
    still running. The chart's post-delete hook (controller/cleanup.py) removes them."""
    if "runtime" not in AFTER_UNINSTALL:
        pytest.fail("test_install_test_upgrade_uninstall did not get to its uninstall",
                    pytrace=False)
    assert AFTER_UNINSTALL["runtime"] == []
