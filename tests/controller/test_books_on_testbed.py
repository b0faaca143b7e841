"""Books only the controller can write, on the test bed's real API server (the logic:
test_books_integrity.py).

Any pod creator can write the controller's labels. Five pods labelled managed-by=sandman-controller,
state=leased (no sandbox label) must not fill `--max-live 5` on a leader start, and must be
neither labelled nor deleted by the controller; the books ValidatingAdmissionPolicy refuses such
a create or label change from anyone but the controller's user.
"""

from __future__ import annotations

import time

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from sandman import contract
from sandman.client import Client
from testbed.controller import start_controller
from webhook import policy

IMAGE = "registry.invalid/swe/task:1"
pytestmark = pytest.mark.testbed


def forged(name: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {
                contract.LABEL_MANAGED_BY: contract.MANAGED_BY_CONTROLLER,
                contract.LABEL_STATE: contract.STATE_LEASED,
                contract.LABEL_JOB: "victim.run", contract.LABEL_NONCE: "0123456789abcdef"}},
            "spec": {"containers": [{"name": "c", "image": IMAGE}]}}


def _wait_gone(core, namespace: str, selector: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while core.list_namespaced_pod(namespace, label_selector=selector).items:
        assert time.monotonic() < deadline, f"pods {selector} not deleted within {timeout:g}s"
        time.sleep(0.2)


def test_forged_leased_pods_never_fill_the_caps_across_leader_starts(cluster, namespace,
                                                                       tmp_path):
    for i in range(5):
        cluster.core.create_namespaced_pod(namespace, forged(f"forged-{i}"))
    flags = ["--max-live", "5", "--sweep-interval", "1", "--sweep-grace", "0"]
    for start in range(2):  # the first leader start, then a restart
        ctl = start_controller(namespace, cluster.kubeconfig, tmp_path / f"ctl-{start}.log",
                               flags)
        try:
            with Client(ctl.url) as cl:
                got = [cl.acquire(IMAGE, job=f"other-{start}", cpu="1", memory="1Gi",
                                  timeout_s=60) for _ in range(5)]
                time.sleep(2)  # a sweep or two
                for sb in got:
                    sb.release()
                # A release answers before its delete lands; killed earlier, the next leader
                # rightly adopts the still-leased pods as live and they fill the cap.
                _wait_gone(cluster.core, namespace, f"{contract.LABEL_JOB}=other-{start}")
        finally:
            ctl.kill()
    for i in range(5):
        p = cluster.core.read_namespaced_pod(f"forged-{i}", namespace)
        assert p.metadata.deletion_timestamp is None
        assert p.metadata.labels[contract.LABEL_STATE] == contract.STATE_LEASED


def _me(cluster) -> str:
    review = client.AuthenticationV1Api(cluster.api_client).create_self_subject_review(
        {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
    return review.status.user_info.username


def _refused(core, namespace: str, body: dict) -> str | None:
    try:
        core.create_namespaced_pod(namespace, body, dry_run="All")
    except ApiException as e:
        if e.status == 403 and policy.BOOKS_RULE in (e.body or ""):
            return e.body
        raise
    return None


@pytest.mark.parametrize("allowed", [False, True], ids=["other-user", "controller-user"])
def test_books_policy_refuses_the_labels_from_anyone_but_the_controller(cluster, namespace,
                                                                          allowed):
    api = client.AdmissionregistrationV1Api(cluster.api_client)
    name = f"sandman-books-{namespace}"
    me = _me(cluster)
    user = me if allowed else policy.controller_user("sandman-system", "sandman-controller")
    api.create_validating_admission_policy(policy.books_policy(name, user))
    api.create_validating_admission_policy_binding(policy.binding(
        name, name, {"matchLabels": {"kubernetes.io/metadata.name": namespace}}))
    try:
        plain = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "plain"},
                 "spec": {"containers": [{"name": "c", "image": IMAGE}]}}
        cluster.core.create_namespaced_pod(namespace, plain)
        if allowed:
            time.sleep(5)  # the policy is loaded within about a second
            assert _refused(cluster.core, namespace, forged("forged")) is None
            return
        deadline = time.monotonic() + 30
        while (why := _refused(cluster.core, namespace, forged("forged"))) is None:
            assert time.monotonic() < deadline, "the books policy never took effect"
            time.sleep(0.5)
        assert me in why
        # A label change onto a pod that had none: refused too.
        with pytest.raises(ApiException) as ex:
            cluster.core.patch_namespaced_pod("plain", namespace, {"metadata": {"labels": {
                contract.LABEL_STATE: contract.STATE_LEASED}}})
        assert ex.value.status == 403 and policy.BOOKS_RULE in ex.value.body
        # Other labels, and managed-by values of other tools, stay free.
        cluster.core.patch_namespaced_pod("plain", namespace, {"metadata": {"labels": {
            "team": "rl", contract.LABEL_MANAGED_BY: "Helm"}}})
    finally:
        api.delete_validating_admission_policy_binding(name)
        api.delete_validating_admission_policy(name)
