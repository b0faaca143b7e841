"""The sandbox pod template (--pod-template-file): checked at startup, applied to every pod the
controller builds (warm builds too). On the test bed: a tainted kwok node of its own pool gets
the sandboxes through the template's toleration, with its priority class, runtime class, pull
secret, annotations and labels."""

from __future__ import annotations

import json
import secrets

import httpx
import pytest
from kubernetes import client

from controller import __main__ as controller_main
from controller.settings import check_pod_template
from sandman import api, contract
from testbed.cluster import KWOK_NODE_ANNOTATION
from testbed.controller import ControllerProc
from testbed.procs import wait_for
from tests.cli import run_main

IMAGE = "registry.invalid/swe/task:1"


@pytest.mark.parametrize("template, words", [
    ({"labels": {contract.LABEL_JOB: "x"}}, "collides with sandman's own keys"),
    ({"labels": {"app.kubernetes.io/component": "controller"}}, "collides"),
    ({"labels": {contract.LABEL_MANAGED_BY: "me"}}, "collides"),
    ({"annotations": {contract.ANNOTATION_INGRESS_FROM: "0.0.0.0/0"}}, "collides"),
    ({"nodeName": "n1"}, "unknown key 'nodeName'"),
    ({"priorityClassName": "Not_A_Name"}, "priorityClassName"),
    ({"tolerations": [{"key": "k", "bogus": 1}]}, "tolerations"),
    ({"imagePullSecrets": ["regcred"]}, "imagePullSecrets"),
    ({"affinity": {"nodeSelector": {}}}, "affinity"),
    ({"labels": {"team": "has space"}}, "not a valid label value"),
])
def test_bad_templates_are_refused_with_one_line(template, words):
    with pytest.raises(ValueError) as ei:
        check_pod_template(template)
    assert words in str(ei.value) and "\n" not in str(ei.value)


def test_empty_entries_are_left_out():
    assert check_pod_template({"tolerations": [], "affinity": {}, "priorityClassName": "",
                               "runtimeClassName": "", "imagePullSecrets": [],
                               "annotations": {}, "labels": {}}) == {}
    assert check_pod_template(None) == {}


def test_the_controller_refuses_a_bad_template_file_at_startup(tmp_path):
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps({"labels": {contract.LABEL_STATE: "leased"}}))
    argv = ["serve", "--namespace", "x", "--kubeconfig", str(tmp_path / "none"),
            "--pod-template-file", str(bad)]
    p = run_main(controller_main.main, argv)  # as `python -m controller` (tests/cli.py)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "collides with sandman's own keys" in lines[0], p.stderr
    bad.write_text("labels: [unclosed")
    p = run_main(controller_main.main, argv)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_sandboxes_follow_the_template_onto_a_tainted_pool(cluster, namespace, tmp_path):
    tag = secrets.token_hex(3)
    pool, node_name, prio, rtc = f"tainted-{tag}", f"kwok-tainted-{tag}", f"sbx-{tag}", \
        f"gvisor-{tag}"
    core = cluster.core
    sched = client.SchedulingV1Api(cluster.api_client)
    nodeapi = client.NodeV1Api(cluster.api_client)
    core.create_node({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": node_name, "annotations": {KWOK_NODE_ANNOTATION: "fake"},
                     "labels": {"type": "kwok", "kubernetes.io/hostname": node_name,
                                contract.LABEL_NODE_POOL_DEFAULT: pool}},
        "spec": {"taints": [{"key": "dedicated", "value": "sandbox", "effect": "NoSchedule"}]},
        "status": {"allocatable": {"cpu": "100", "memory": "400Gi", "pods": "100"},
                   "capacity": {"cpu": "100", "memory": "400Gi", "pods": "100"}}})
    sched.create_priority_class({"metadata": {"name": prio}, "value": 1000})
    nodeapi.create_runtime_class({"metadata": {"name": rtc}, "handler": "runsc"})
    template = {
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "sandbox",
                         "effect": "NoSchedule"}],
        "priorityClassName": prio, "runtimeClassName": rtc,
        "imagePullSecrets": [{"name": "regcred"}],
        "annotations": {"karpenter.sh/do-not-disrupt": "true"},
        "labels": {"team": "rl"},
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": "type", "operator": "In", "values": ["kwok"]}]}]}}},
    }
    f = tmp_path / "pod-template.json"
    f.write_text(json.dumps(template))
    ctl = ControllerProc(namespace, cluster.kubeconfig, tmp_path / "controller.log",
                         ["--lease-name", f"tpl-{namespace}", "--pod-template-file", str(f),
                          "--node-pool-label", f"{contract.LABEL_NODE_POOL_DEFAULT}={pool}"])
    try:
        wait_for(lambda: any(c.type == "Ready" and c.status == "True" for c in
                             (core.read_node(node_name).status.conditions or [])), 60,
                 "the tainted node Ready")
        ctl.start()
        r = httpx.post(ctl.url + api.ACQUIRE.path, timeout=70, json={
            "image": IMAGE, "cpu": "1", "memory": "1Gi", "job": "tpl", "timeout_s": 60})
        assert r.status_code == 201, r.text
        r = httpx.post(ctl.url + api.PREWARM.path, timeout=10, json={
            "image": IMAGE, "count": 1, "spec": {"cpu": "1", "memory": "1Gi"}})
        assert r.status_code == 200, r.text
        wait_for(lambda: len(core.list_namespaced_pod(namespace).items) == 2, 60, "warm build")
        for pod in core.list_namespaced_pod(namespace).items:
            wait_for(lambda p=pod: core.read_namespaced_pod(p.metadata.name, namespace)
                     .spec.node_name, 60, "scheduled")
            pod = core.read_namespaced_pod(pod.metadata.name, namespace)
            # Only the template's toleration lets a pod onto the tainted node.
            assert pod.spec.node_name == node_name
            assert pod.spec.priority_class_name == prio and pod.spec.priority == 1000
            assert pod.spec.runtime_class_name == rtc
            assert [s.name for s in pod.spec.image_pull_secrets] == ["regcred"]
            assert pod.metadata.annotations["karpenter.sh/do-not-disrupt"] == "true"
            assert contract.ANNOTATION_TOKEN_SHA256 in pod.metadata.annotations
            assert pod.metadata.labels["team"] == "rl"
            assert pod.metadata.labels[contract.LABEL_MANAGED_BY] == \
                contract.MANAGED_BY_CONTROLLER
            assert pod.spec.affinity.node_affinity is not None
    finally:
        ctl.kill()
        for pod in core.list_namespaced_pod(namespace).items:
            core.delete_namespaced_pod(pod.metadata.name, namespace, grace_period_seconds=0)
        core.delete_node(node_name)
        sched.delete_priority_class(prio)
        nodeapi.delete_runtime_class(rtc)
