"""The webhook against the real API server (testbed): registered by `url:` with its CA,
scoped to the test's namespace (a leftover Fail-policy configuration could not hurt other
tests), deleted in a finalizer whatever happens."""

from __future__ import annotations

import threading
import time

import pytest
from kubernetes.client.rest import ApiException

from sandman.contract import (
    ANNOTATION_TOKEN_SHA256,
    EXECD_DIR,
    LABEL_EGRESS,
    LABEL_SANDBOX,
    NETGUARD_CONTAINER,
    SANDMAN_VOLUME,
)
from sandman.podspec import SandboxPolicy, check_sandbox, make_sandbox
from testbed.webhook import registration as scoped_registration
from testbed.webhook import start_webhook, wait_webhook_active
from tests.webhook.test_server import _served_cert
from webhook import certs
from webhook import policy as policy_rules

TOKEN = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"


def make_pod(labels=None, annotations=None, **spec) -> dict:
    labels = {LABEL_SANDBOX: "true"} if labels is None else labels
    annotations = {ANNOTATION_TOKEN_SHA256: TOKEN} if annotations is None else annotations
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"generateName": "sbx-", "labels": labels, "annotations": annotations},
            "spec": {"containers": [{"name": "task", "image": "swe-task:1"}], **spec}}


def registration(cluster, namespace: str, url: str, ca: bytes):
    """Both configurations for one webhook URL, limited to one namespace."""
    return scoped_registration(cluster.admissionregistration, namespace, url, ca, "sandman-test")


def create(core, namespace: str, pod: dict, dry_run: bool = False):
    kw = {"dry_run": "All"} if dry_run else {}
    return core.create_namespaced_pod(namespace, pod, **kw)


def as_dict(api_client, obj) -> dict:
    return api_client.sanitize_for_serialization(obj)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_webhook(tmp_path_factory.mktemp("webhook-bed"))
    yield s
    s.stop()


@pytest.fixture
def registered(cluster, namespace, server):
    with registration(cluster, namespace, server.url, server.ca.read_bytes()) as reg:
        wait_webhook_active(cluster.core, namespace)
        yield reg


def test_labelled_pod_comes_out_a_sandbox_and_is_a_fixed_point(cluster, namespace, registered):
    core = cluster.core
    got = as_dict(cluster.api_client, create(core, namespace, make_pod(
        labels={LABEL_SANDBOX: "true", LABEL_EGRESS: "deny"})))
    spec = got["spec"]
    assert spec["enableServiceLinks"] is False
    assert spec["automountServiceAccountToken"] is False
    # The service-account plugin ran before us and added the token volume; it is gone.
    assert not any(v["name"].startswith("kube-api-access-") for v in spec["volumes"])
    # One injected init container: the guard, which installs execd once the rules are in.
    assert [c["name"] for c in spec["initContainers"]] == [NETGUARD_CONTAINER]
    assert spec["initContainers"][0]["args"][:2] == ["--egress", "deny"]
    assert spec["initContainers"][0]["args"][-2:] == ["--install-execd", EXECD_DIR]
    assert any(v["name"] == SANDMAN_VOLUME for v in spec["volumes"])
    for c in spec["initContainers"] + spec["containers"]:
        assert c["resources"]["requests"] == c["resources"]["limits"], c["name"]
    assert spec["containers"][0]["resources"]["limits"] == {"cpu": "2", "memory": "8Gi"}
    # The stored pod went through the API server's defaulting; mutating it again is a no-op
    # (the reinvocation path) and it passes every check.
    stored = {k: got[k] for k in ("metadata", "spec")}
    assert make_sandbox(stored, SandboxPolicy()) == stored
    assert check_sandbox(stored, SandboxPolicy()) == []

    plain = as_dict(cluster.api_client, create(core, namespace, make_pod(labels={"app": "x"})))
    assert "initContainers" not in plain["spec"]
    assert plain["spec"].get("enableServiceLinks") is not False
    assert "resources" not in plain["spec"]["containers"][0] or not plain["spec"]["containers"][
        0]["resources"]


def _refusal(core, namespace: str, pod: dict, dry_run: bool = False, status: int = 403) -> str:
    try:
        create(core, namespace, pod, dry_run=dry_run)
    except ApiException as e:
        assert e.status == status, e.body
        return e.body
    raise AssertionError(f"created, expected a refusal: {pod['metadata']}")


FORBIDDEN = {
    "host-namespace": make_pod(hostNetwork=True),
    # "privileged" is covered by the golden cases only: this API server runs without
    # --allow-privileged, so it refuses such pods itself before admission webhooks.
    "net-admin-added": make_pod(containers=[{"name": "task", "image": "x", "securityContext": {
        "capabilities": {"add": ["NET_ADMIN"]}}}]),
    "token-hash": make_pod(annotations={}),
    "egress-label-invalid": make_pod(labels={LABEL_SANDBOX: "true", LABEL_EGRESS: "Deny"}),
    # Without the sandbox label the mutation never runs: the egress entry still validates.
    "guard-missing": make_pod(labels={LABEL_EGRESS: "deny"}),
    "sandbox-container-missing": make_pod(annotations={ANNOTATION_TOKEN_SHA256: TOKEN,
                                                      "sandman.dev/container": "agent"}),
    "service-account-token": make_pod(volumes=[{"name": "aws", "projected": {"sources": [
        {"serviceAccountToken": {"path": "token", "audience": "sts"}}]}}]),
}


def test_forbidden_pods_refused_with_their_rule(cluster, namespace, registered):
    core = cluster.core
    for rule, pod in FORBIDDEN.items():
        body = _refusal(core, namespace, pod)
        assert f"sandman {rule}:" in body, (rule, body)
        # dryRun=All is answered like a real request.
        assert f"sandman {rule}:" in _refusal(core, namespace, pod, dry_run=True), rule
    assert core.list_namespaced_pod(namespace).items == []

    # An update that flips a guarded-for-allow sandbox to egress=deny is refused...
    pod = create(core, namespace, make_pod())
    body = None
    try:
        core.patch_namespaced_pod(pod.metadata.name, namespace,
                                  {"metadata": {"labels": {LABEL_EGRESS: "deny"}}})
    except ApiException as e:
        body = e.body
    assert body and "sandman guard-misconfigured:" in body, body
    # ...while an unrelated label change on the same sandbox is admitted.
    core.patch_namespaced_pod(pod.metadata.name, namespace,
                              {"metadata": {"labels": {"team": "a"}}})


def test_dry_run_mutates_and_stores_nothing(cluster, namespace, registered):
    got = create(cluster.core, namespace, make_pod(), dry_run=True)
    assert got.spec.init_containers[0].name == NETGUARD_CONTAINER
    assert got.spec.enable_service_links is False
    assert cluster.core.list_namespaced_pod(namespace).items == []


def test_webhook_down_refuses_sandboxes_only(cluster, namespace, tmp_path):
    server = start_webhook(tmp_path / "down")
    try:
        with registration(cluster, namespace, server.url, server.ca.read_bytes()):
            wait_webhook_active(cluster.core, namespace)
            server.stop()
            body = _refusal(cluster.core, namespace, make_pod(), status=500)
            assert "failed calling webhook" in body, body
            # Unlabelled pods are never sent to the webhook: they still create.
            cluster.core.create_namespaced_pod(namespace, make_pod(labels={"app": "web"}))
    finally:
        server.stop()


def test_ca_rotation_under_a_create_loop_has_no_failed_create(cluster, namespace, tmp_path,
                                                              figures):
    """Kyverno's order: new CA into the bundle, caBundle patched, then the new serving cert."""
    core = cluster.core
    certdir = tmp_path / "tls"
    common = dict(namespace=namespace, secret="sandman-webhook-tls", dns_names=["localhost"],
                  ip_addresses=["127.0.0.1"], write_dir=str(certdir), propagation_seconds=2)
    first = certs.ensure(core, cluster.admissionregistration, **common)
    assert first.ca_rotated and first.leaf_issued
    server = start_webhook(tmp_path / "srv", certdir=certdir)
    try:
        with registration(cluster, namespace, server.url, first.bundle_pem) as reg:
            names = dict(mutating=[reg.name], validating=[reg.name])
            again = certs.ensure(core, cluster.admissionregistration, **common, **names)
            assert not (again.ca_rotated or again.bundle_patched or again.leaf_issued)
            wait_webhook_active(core, namespace)

            stop = threading.Event()
            results = {"ok": 0, "failed": []}

            def loop():
                deadline = time.monotonic() + 120
                while not stop.is_set() and time.monotonic() < deadline and results["ok"] < 2000:
                    try:
                        create(core, namespace, make_pod())
                        results["ok"] += 1
                    except ApiException as e:
                        results["failed"].append(e.body[:300])
                    time.sleep(0.02)

            worker = threading.Thread(target=loop)
            worker.start()
            deadline_start = time.monotonic() + 30
            try:
                while results["ok"] < 5 and time.monotonic() < deadline_start:
                    time.sleep(0.1)
                before = results["ok"]
                rotated = certs.ensure(core, cluster.admissionregistration, **common, **names,
                                       force_ca_rotation=True)
                during = results["ok"] - before
                # Once the server presents the new CA's certificate (it polls its files every
                # second and closes older connections), keep creating a little longer.
                new_ca = certs.split_bundle(rotated.bundle_pem)[0]
                deadline = time.monotonic() + 15
                while _served_cert(server.port, rotated.bundle_pem).issuer != new_ca.subject:
                    assert time.monotonic() < deadline, "new certificate not served in 15 s"
                    time.sleep(0.2)
                after_reload = results["ok"]
                deadline = time.monotonic() + 30
                while results["ok"] < after_reload + 10 and time.monotonic() < deadline:
                    time.sleep(0.1)
            finally:
                stop.set()
                worker.join(30)
            assert rotated.ca_rotated and rotated.bundle_patched and rotated.leaf_issued
            assert len(certs.split_bundle(rotated.bundle_pem)) == 2
            assert results["failed"] == [], results["failed"][:3]
            assert during > 0 and results["ok"] >= after_reload + 10, results["ok"]
            stored = core.read_namespaced_secret("sandman-webhook-tls", namespace)
            assert stored.type == "kubernetes.io/tls"
            figures.add(f"webhook CA rotation: {results['ok']} pod creates ({during} while "
                        f"ensure() ran), {len(results['failed'])} failed")

            # Control: the wrong order (a certificate whose CA is not yet in the bundle) does
            # break creates, so the zero above measures the order, not a blind loop.
            rogue_ca, rogue_key = certs.new_ca()
            cert, key = certs.new_serving(rogue_ca, rogue_key, ["localhost"], ["127.0.0.1"])
            certs.write_pair(str(certdir), cert, key, rogue_ca)
            deadline = time.monotonic() + 15
            while True:
                try:
                    create(core, namespace, make_pod(), dry_run=True)
                except ApiException as e:
                    assert "x509" in e.body or "certificate" in e.body, e.body
                    break
                assert time.monotonic() < deadline, "a certificate of an unknown CA was accepted"
                time.sleep(0.2)
    finally:
        server.stop()


def test_certs_cli_ensure_is_idempotent(cluster, namespace, tmp_path):
    import json
    import subprocess
    import sys

    from tests.webhook.conftest import ROOT

    cmd = [sys.executable, "-m", "webhook", "certs", "ensure", "--kubeconfig",
           str(cluster.kubeconfig), "--namespace", namespace, "--service", "sandman-webhook",
           "--ip", "127.0.0.1", "--write-dir", str(tmp_path)]
    runs = [json.loads(subprocess.run(cmd, cwd=ROOT, capture_output=True, check=True,
                                      timeout=60).stdout) for _ in range(2)]
    assert runs[0] == {"ca_rotated": True, "bundle_patched": False, "leaf_issued": True}
    assert runs[1] == {"ca_rotated": False, "bundle_patched": False, "leaf_issued": False}
    leaf = certs.split_bundle((tmp_path / "tls.crt").read_bytes())[0]
    assert certs._sans(leaf) == (set(certs.service_dns_names("sandman-webhook", namespace)),
                                 {"127.0.0.1"})


def test_unmutated_pod_refused_with_the_reason(cluster, namespace, server):
    """Only the validating configuration registered (the mutating one lost): a labelled pod
    reaches validation unmutated and is refused, saying so."""
    with registration(cluster, namespace, server.url, server.ca.read_bytes()) as reg:
        cluster.admissionregistration.delete_mutating_webhook_configuration(reg.name)
        deadline = time.monotonic() + 15
        body = ""
        while "sandman not-mutated:" not in body:
            assert time.monotonic() < deadline, body or "never refused"
            time.sleep(0.2)
            try:  # admitted or refused otherwise until the API server has seen both changes
                create(cluster.core, namespace, make_pod(), dry_run=True)
            except ApiException as e:
                body = e.body
        assert "did not run on this pod" in body and "sandman service-links:" in body


# --- issue 13: the bypasses, on the real API server -------------------------------------------

def _bed_object(obj: dict, namespace: str) -> dict:
    import copy

    obj = copy.deepcopy(obj)
    obj["metadata"]["namespace"] = namespace
    return obj


def _first_rule(refusals) -> str:
    return refusals[0].rule


# Cases that are no valid pod: the API server's validation refuses them (422) before any
# admission, so the golden files alone hold what the handlers answer.
INVALID_PODS = {
    # An AppArmor annotation is runtime/default, localhost/<profile> or unconfined; any other
    # value is an invalid profile name (the `unconfined` one is played).
    "validate-apparmor-annotation-other-refused": "invalid AppArmor profile name",
    # hostProcess needs every container hostProcess and hostNetwork, sandman's injected init
    # containers included, which the mutation never renders so.
    "validate-host-process-refused": "HostProcess",
}
# Cases the webhook configurations do not select (neither label): the policy refuses them,
# tests/webhook/test_policy.py plays them on the bed.
UNSELECTED = {"validate-install-container-without-sandbox-label-refused": "sandbox-label",
              "validate-installing-guard-without-sandbox-label-refused": "sandbox-label",
              "validate-installing-guard-abbreviated-flag-without-label-refused":
                  "sandbox-label"}


def test_bypass_pods_refused_by_the_api_server_with_their_rule(cluster, namespace, registered):
    """Every CREATE case of golden_cases.bypass_cases() sent to the real API server: it answers
    as the handlers do in process (tests/webhook/test_invariants.admitted: mutation patch
    applied, then validation). Refused pods name the rule; a sandbox whose only fault the
    mutation fixes (NET_RAW kept in a sidecar, execd flags, a //sandman mount) is stored fixed.
    Privileged cases are left to the goldens: this API server refuses them before admission."""
    from tests.webhook import golden_cases
    from tests.webhook.test_invariants import admitted, assert_invariants

    core, policy = cluster.core, SandboxPolicy()
    wrong = []
    checked = 0
    for name, review in golden_cases.bypass_cases().items():
        request = review["request"]
        obj = request["object"]
        if request["operation"] != "CREATE" or "privileged" in name:
            continue
        if name in UNSELECTED:
            labels = obj["metadata"].get("labels") or {}
            assert LABEL_SANDBOX not in labels and LABEL_EGRESS not in labels, name
            assert UNSELECTED[name] in policy_rules.RULE_NAMES, name
            continue
        expected = admitted(obj)
        checked += 1
        try:
            got = as_dict(cluster.api_client, create(core, namespace, _bed_object(obj, namespace)))
        except ApiException as e:
            if name in INVALID_PODS:
                if e.status != 422 or INVALID_PODS[name] not in e.body:
                    wrong.append(f"{name}: expected API validation to refuse it: {e.status} "
                                 f"{e.body[:300]}")
                continue
            if expected is not None:
                wrong.append(f"{name}: refused but admitted in process: {e.body[:300]}")
                continue
            rule = _first_rule(check_sandbox(obj, policy) or [
                r for r in check_sandbox(make_sandbox(obj, policy), policy)])
            if e.status != 403 or f"sandman {rule}:" not in e.body:
                wrong.append(f"{name}: expected sandman {rule}: got {e.status} {e.body[:300]}")
            continue
        if name in INVALID_PODS:
            wrong.append(f"{name}: admitted by the API server, which validation should refuse")
            continue
        if expected is None:
            wrong.append(f"{name}: admitted by the API server, refused in process")
            continue
        stored = {k: got[k] for k in ("metadata", "spec")}
        assert_invariants(stored)
        assert check_sandbox(stored, policy) == [], name
    assert checked >= 25, checked
    assert wrong == [], "\n".join(wrong)
    # Only the pods the handlers admit were stored.
    assert len(core.list_namespaced_pod(namespace).items) == sum(
        1 for n, r in golden_cases.bypass_cases().items()
        if r["request"]["operation"] == "CREATE" and "privileged" not in n
        and n not in INVALID_PODS and n not in UNSELECTED
        and admitted(r["request"]["object"]) is not None)


def _update_refusal(fn) -> str:
    try:
        fn()
    except ApiException as e:
        assert e.status == 403, e.body
        return e.body
    raise AssertionError("admitted, expected a refusal")


def test_updates_judged_on_the_new_pods_own_guard(cluster, namespace, server):
    """Running sandboxes built by an older webhook (another image tag; `--guard egress-deny`)
    exist before today's webhook is registered; then: a relabel to egress=deny is refused when
    their guard applied allow or there is none, a swapped guard image is refused, an unrelated
    label change is admitted, and `kubectl debug` (pods/ephemeralcontainers) is judged."""
    from tests.webhook.golden_cases import OLD_IMAGE

    core = cluster.core
    from sandman.podspec import GUARD_EGRESS_DENY

    def make(policy):
        pod = make_sandbox(make_pod(), policy)
        return create(core, namespace, pod).metadata.name

    old_allow = make(SandboxPolicy(image=OLD_IMAGE))
    unguarded = make(SandboxPolicy(guard=GUARD_EGRESS_DENY))
    current = make(SandboxPolicy())
    with registration(cluster, namespace, server.url, server.ca.read_bytes()):
        wait_webhook_active(core, namespace)
        deny = {"metadata": {"labels": {LABEL_EGRESS: "deny"}}}
        deadline = time.monotonic() + 15
        while True:  # the validating configuration may be picked up a moment after the other
            try:
                core.patch_namespaced_pod(old_allow, namespace, deny, dry_run="All")
            except ApiException as e:
                body = e.body
                break
            assert time.monotonic() < deadline, "relabel to deny never refused"
            time.sleep(0.2)
        assert "sandman guard-misconfigured:" in body and "did not apply egress deny" in body, body
        body = _update_refusal(lambda: core.patch_namespaced_pod(unguarded, namespace, deny))
        assert "sandman guard-missing:" in body, body
        body = _update_refusal(lambda: core.patch_namespaced_pod(old_allow, namespace, {
            "spec": {"initContainers": [{"name": NETGUARD_CONTAINER,
                                         "image": "evil/netguard:1"}]}}))
        assert "sandman guard-immutable:" in body, body
        core.patch_namespaced_pod(old_allow, namespace, {"metadata": {"labels": {"team": "a"}}})

        def debug(name, pod_name, **sc):
            return core.patch_namespaced_pod_ephemeralcontainers(pod_name, namespace, {
                "spec": {"ephemeralContainers": [{"name": name, "image": "busybox",
                                                  "targetContainerName": "task", **sc}]}})
        body = _update_refusal(lambda: debug("netadmin", current, securityContext={
            "capabilities": {"add": ["NET_ADMIN", "NET_RAW"]}}))
        assert "sandman net-admin-added: container netadmin:" in body, body
        body = _update_refusal(lambda: debug("plain", current))
        assert "sandman net-raw-not-dropped: container plain:" in body, body
        debug("restricted", current, securityContext={"capabilities": {"drop": ["ALL"]}})
        got = core.read_namespaced_pod(current, namespace)
        assert [c.name for c in got.spec.ephemeral_containers] == ["restricted"]
