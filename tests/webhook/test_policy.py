"""The ValidatingAdmissionPolicy (webhook/policy.py) on the real API server of the test bed.

Agreement: every golden AdmissionReview in testdata/ (whatever cases exist when this runs) goes
through the Python check (`webhook.admission`, what the golden files pin) and, as a real pod
create (`dryRun=All`) or update, through the API server with ONLY the policy registered (no
webhook). The policy enforces a subset of the Python rules, so:
- a pod the Python check refuses for a rule in that subset is refused by the policy, for one of
  the rules the Python check named;
- a pod the Python check admits (for /mutate cases: after applying its patch) is admitted.
Every disagreement is one line naming the case; the test fails on any.
"""

from __future__ import annotations

import copy
import json
import re
import secrets
from pathlib import Path

import jsonpatch
import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from sandman.contract import (
    ANNOTATION_TOKEN_SHA256,
    LABEL_EGRESS,
    LABEL_SANDBOX,
    NETGUARD_CONTAINER,
)
from sandman.podspec import SandboxPolicy, make_sandbox
from tests.webhook import golden_cases
from tests.webhook.test_golden import CASES, TESTDATA, decode
from webhook import admission, policy

# The webhook's rule name -> the policy's, where the policy's rule is wider (any added
# capability, not only NET_ADMIN/NET_RAW). The containment rules the policy shares by name
# (net-raw-not-dropped, unconfined, secret-refused, ...) need no entry: policy.RULE_NAMES.
EQUIVALENT = {"net-admin-added": "capability-added"}
EXEMPT = "sandman-test/policy-exempt"  # the binding skips pods carrying it (an UPDATE's old pod)
_RULE = re.compile(r"sandman ([a-z-]+):")
TOKEN = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"


def _policy_for(name: str) -> SandboxPolicy:
    return golden_cases.POLICIES.get(name, SandboxPolicy())


def python_verdict(name: str, review: dict) -> tuple[bool, set[str], dict | None]:
    """(allowed, refused rules, the pod to play): /mutate cases play the patched pod."""
    pol = _policy_for(name)
    req = review["request"]
    if name.startswith("mutate-"):
        out, _, _ = admission.mutate(review, pol)
        resp = decode(out)["response"]
        if not resp["allowed"]:
            return False, _rules(resp["status"]["message"]), None
        obj = req["object"]
        if resp.get("patch"):
            obj = jsonpatch.apply_patch(obj, resp["patch"])
        if req["operation"] != "CREATE":
            return True, set(), None  # not mutated on UPDATE: nothing new to play
        # The patched pod must pass the validating check too (test_golden pins it).
        v = dict(review, request=dict(req, object=obj))
        out, _ = admission.validate(v, pol)
        resp = out["response"]
        rules = set() if resp["allowed"] else _rules(resp["status"]["message"])
        return resp["allowed"], rules, obj
    out, _ = admission.validate(review, pol)
    resp = out["response"]
    rules = set() if resp["allowed"] else _rules(resp["status"]["message"])
    return resp["allowed"], rules, req["object"]


def _rules(message: str) -> set[str]:
    """The rules a refusal names. The policy's not-mutated covers only the first of the
    webhook's two (the install container missing), not "make_sandbox would change it"."""
    rules = set(_RULE.findall(message))
    if "not-mutated" in rules and "did not run on this pod" not in message:
        rules = (rules - {"not-mutated"}) | {"not-mutated (the pod differs)"}
    return rules


def _subset(rules: set[str]) -> set[str]:
    return {EQUIVALENT.get(r, r) for r in rules} & set(policy.RULE_NAMES)


def _clean(obj: dict) -> dict:
    obj = copy.deepcopy(obj)
    meta = obj.setdefault("metadata", {})
    meta.pop("namespace", None)
    for k in ("uid", "resourceVersion", "creationTimestamp"):
        meta.pop(k, None)
    if not meta.get("name"):
        meta.setdefault("generateName", "case-")
    obj.pop("status", None)
    return obj


class Bed:
    """One policy + binding per distinct SandboxPolicy of the cases, each binding scoped to its
    own namespace; removed (and the namespaces) at the end."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.api = client.AdmissionregistrationV1Api(cluster.api_client)
        self.run = secrets.token_hex(3)
        self.namespaces: dict[SandboxPolicy, str] = {}
        self.names: list[str] = []

    def namespace_for(self, pol: SandboxPolicy) -> str:
        if pol not in self.namespaces:
            i = len(self.namespaces)
            ns = self.cluster.new_namespace(f"vap-{i}")
            name = f"sandman-agree-{self.run}-{i}"
            self.api.create_validating_admission_policy(policy.admission_policy(name, pol))
            self.names.append(name)
            b = policy.binding(name, name, {"matchLabels": {
                "kubernetes.io/metadata.name": ns}})
            b["spec"]["matchResources"]["objectSelector"] = {
                "matchExpressions": [{"key": EXEMPT, "operator": "DoesNotExist"}]}
            self.api.create_validating_admission_policy_binding(b)
            self.namespaces[pol] = ns
            wait_policy_active(self.cluster.core, ns)
        return self.namespaces[pol]

    def close(self) -> None:
        for name in self.names:
            for delete in (self.api.delete_validating_admission_policy_binding,
                           self.api.delete_validating_admission_policy):
                try:
                    delete(name)
                except ApiException as e:
                    if e.status != 404:
                        raise
        for ns in self.namespaces.values():
            self.cluster.delete_namespace(ns)


def _unguarded_deny_pod() -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"generateName": "probe-", "labels": {LABEL_EGRESS: "deny"}},
            "spec": {"containers": [{"name": "task", "image": "swe-task:1"}]}}


def wait_policy_active(core, namespace: str, timeout: float = 30) -> None:
    """The API server loads new policies and bindings asynchronously (about a second)."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            core.create_namespaced_pod(namespace, _unguarded_deny_pod(), dry_run="All")
        except ApiException as e:
            if e.status == 403 and "guard-missing" in str(e.body):
                return
            raise
        if time.monotonic() > deadline:
            raise AssertionError(f"the policy is not enforced in {namespace} after {timeout}s")
        time.sleep(0.2)


def play(bed: Bed, name: str, review: dict, obj: dict) -> tuple[str, str]:
    """('admitted' | 'policy' | 'api', message) for the case's pod on the test bed."""
    ns = bed.namespace_for(_policy_for(name))
    core = bed.cluster.core
    req = review["request"]
    try:
        if req["operation"] == "CREATE":
            sent = _clean(obj)
            kept = json.loads(core.create_namespaced_pod(
                ns, sent, dry_run="All", _preload_content=False).data)["spec"]
            # A field of a feature the server has off is dropped before admission (1.33:
            # spec.resources, PodLevelResources): the case did not reach the policy as written.
            dropped = sorted(k for k, v in sent["spec"].items()
                             if v not in (None, [], {}, "") and k not in kept)
            if dropped:
                return "api", "the API server dropped spec." + ", spec.".join(dropped)
        else:
            old = _clean(req["oldObject"])
            old["metadata"].setdefault("labels", {})[EXEMPT] = "true"
            stored = core.create_namespaced_pod(ns, old)
            if req.get("subResource") == "ephemeralcontainers":
                # What `kubectl debug` does: the pod's own update cannot add ephemeral
                # containers. The exemption goes first (a label update the policy lets through:
                # it changes none of its inputs), then the subresource sends the whole pod.
                core.patch_namespaced_pod(stored.metadata.name, ns, [{
                    "op": "remove", "path": "/metadata/labels/" + EXEMPT.replace("/", "~1")}])
                core.patch_namespaced_pod_ephemeralcontainers(
                    stored.metadata.name, ns, {"spec": {"ephemeralContainers": obj["spec"][
                        "ephemeralContainers"]}}, dry_run="All")
                return "admitted", ""
            # The update the case makes, as a JSON patch on the pod as stored (with its
            # defaults and node), which also drops the exemption.
            ops = list(jsonpatch.make_patch(_clean(req["oldObject"]), _clean(obj)))
            ops.append({"op": "remove",
                        "path": "/metadata/labels/" + EXEMPT.replace("/", "~1")})
            core.patch_namespaced_pod(stored.metadata.name, ns, ops, dry_run="All")
    except ApiException as e:
        body = str(e.body)
        try:
            body = json.loads(body)["message"]
        except (ValueError, KeyError):
            pass
        return ("policy" if "ValidatingAdmissionPolicy" in body else "api"), body
    return "admitted", ""


@pytest.fixture(scope="module")
def bed(cluster):
    b = Bed(cluster)
    yield b
    b.close()


def test_policy_agrees_with_the_python_check_on_every_golden_case(bed, figures):
    assert CASES, "no golden cases"
    disagreements, played, skipped, counts = [], 0, [], {"refused": 0, "admitted": 0}
    unplayable: list[str] = []
    for name in CASES:
        review = json.loads((TESTDATA / f"{name}.json").read_text())
        allowed, rules, obj = python_verdict(name, review)
        if obj is None:
            skipped.append(f"{name} (python: refused by {sorted(rules)}, not a policy rule)"
                           if not allowed else f"{name} (UPDATE, nothing to play)")
            continue
        wanted = _subset(rules)
        if not allowed and not wanted:
            skipped.append(f"{name} (python refuses by {sorted(rules)}, outside the policy)")
            continue
        got, message = play(bed, name, review, obj)
        if got == "api":
            # The API server's own validation refused the pod before admission (the bed runs
            # without --allow-privileged; a case may not be a valid pod), or dropped a field of
            # a feature it has off: nothing to compare.
            skipped.append(f"{name} (API validation: {message[:120]})")
            unplayable.append(name)
            continue
        played += 1
        if allowed:
            counts["admitted"] += 1
            if got != "admitted":
                disagreements.append(f"{name}: python admits, the bed says {got}: {message}")
        else:
            counts["refused"] += 1
            policy_rules = set(_RULE.findall(message))
            if got != "policy":
                disagreements.append(f"{name}: python refuses {sorted(wanted)}, the bed says "
                                     f"{got}: {message[:300]}")
            elif not policy_rules & wanted:
                disagreements.append(f"{name}: python refuses {sorted(wanted)}, the policy "
                                     f"refuses for {sorted(policy_rules)}: {message[:300]}")
    figures.add(f"policy agreement: {played} golden cases played on the bed "
                f"({counts['refused']} refused by both, {counts['admitted']} admitted by both), "
                f"{len(skipped) - len(unplayable)} outside the policy's rules, "
                f"{len(unplayable)} refused (or cut) by the API server before admission "
                f"({', '.join(unplayable)})")
    assert not disagreements, "\n".join(disagreements)
    assert counts["refused"] >= 5 and counts["admitted"] >= 5, counts


def test_policy_admits_the_controllers_pods_and_refuses_what_the_webhook_would_fix(bed):
    """make_sandbox's output passes in every mode; the client's raw pod (what arrives when the
    mutating configuration is gone) is refused with the rules that matter."""
    ns = bed.namespace_for(SandboxPolicy())
    raw = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"generateName": "raw-", "labels": {LABEL_SANDBOX: "true",
                                                            LABEL_EGRESS: "deny"},
                        "annotations": {ANNOTATION_TOKEN_SHA256: TOKEN}},
           "spec": {"containers": [{"name": "task", "image": "swe-task:1"}]}}
    bed.cluster.core.create_namespaced_pod(ns, make_sandbox(raw, SandboxPolicy()), dry_run="All")
    with pytest.raises(ApiException) as e:
        bed.cluster.core.create_namespaced_pod(ns, raw, dry_run="All")
    assert e.value.status == 403 and "sandman guard-missing" in e.value.body, e.value.body
    # A guard whose args allow egress under a deny label, or run something else.
    good = make_sandbox(raw, SandboxPolicy())
    for edit, rule in (
            (lambda g: g.update(args=["--egress", "allow"] + g["args"][2:]), "guard-misconfigured"),
            (lambda g: g.update(command=["sh", "-c", "exit 0"]), "guard-misconfigured"),
            (lambda g: g.update(image="evil/netguard:1"), "guard-misconfigured"),
            (lambda g: g["securityContext"]["capabilities"].update(add=["ALL"]),
             "guard-misconfigured")):
        pod = copy.deepcopy(good)
        g = pod["spec"]["initContainers"][0]
        assert g["name"] == NETGUARD_CONTAINER
        edit(g)
        with pytest.raises(ApiException) as e:
            bed.cluster.core.create_namespaced_pod(ns, pod, dry_run="All")
        assert e.value.status == 403 and f"sandman {rule}" in e.value.body, e.value.body
    # Added capabilities anywhere else, in any spelling, and hostPath (the volume allowlist).
    for edit, rule in (
            (lambda s: s["containers"][0].setdefault("securityContext", {}).update(
                capabilities={"add": ["all"]}), "capability-added"),
            (lambda s: s["containers"].append({"name": "side", "image": "x", "resources": s[
                "containers"][0]["resources"], "securityContext": {"capabilities": {
                    "add": ["cap_sys_admin"]}}}), "capability-added"),
            (lambda s: s["volumes"].append({"name": "root", "hostPath": {"path": "/"}}),
             "volume-type")):
        pod = copy.deepcopy(good)
        edit(pod["spec"])
        with pytest.raises(ApiException) as e:
            bed.cluster.core.create_namespaced_pod(ns, pod, dry_run="All")
        assert e.value.status == 403 and f"sandman {rule}" in e.value.body, e.value.body


def _guard_args_edits(args: list[str]) -> dict[str, list[str]]:
    """Guard args an attacker writes near the exact ones: each pair still a flag and a value,
    most of the same length, so only a comparison of every position refuses them all."""
    allow = [i for i, a in enumerate(args) if a == "--allow-egress"]
    never = args.index("--never-egress")
    tail = len(args) - 1 - args[::-1].index("--ingress-from")  # --ingress-from $(SANDMAN_NODE_IP)
    a, b = allow[0], allow[1]
    return {
        "two allow pairs swapped": args[:a] + args[b:b + 2] + args[a:a + 2] + args[b + 2:],
        "a pair's flag and value swapped": args[:a] + [args[a + 1], args[a]] + args[a + 2:],
        "the never pair dropped": args[:never] + args[never + 2:],
        "the never pair replaced by a copy of an allow pair":
            args[:never] + args[a:a + 2] + args[never + 2:],
        "an allow pair repeated": args[:a] + args[a:a + 2] + args[a:],
        "an argument appended": args + ["--ingress-from=0.0.0.0/0"],
        "the last argument dropped": args[:-1],
        "the tail moved before the pairs": args[:4] + args[tail:] + args[4:tail],
        "egress allow in the head": ["--egress", "allow"] + args[2:],
    }


def test_policy_compares_the_guard_args_at_every_position(bed):
    """The policy checks the guard's args as head, flag/value pairs and tail, position by
    position (no flatten() before 1.35): as strict as comparing the lists. A sandbox with
    allow-egress entries and a never range is admitted as rendered, and refused as
    guard-misconfigured for each reordered, dropped, repeated or extra argument, as the
    Python check refuses it."""
    review = golden_cases.egress_allow_cases()["validate-egress-allow-within-ceiling-allowed"]
    pol = golden_cases.EGRESS_POLICY
    ns = bed.namespace_for(pol)
    good = _clean(review["request"]["object"])
    bed.cluster.core.create_namespaced_pod(ns, good, dry_run="All")
    edits = _guard_args_edits(good["spec"]["initContainers"][0]["args"])
    assert len({tuple(v) for v in edits.values()}) == len(edits), "two edits are the same"
    for what, args in edits.items():
        pod = copy.deepcopy(good)
        g = pod["spec"]["initContainers"][0]
        assert g["name"] == NETGUARD_CONTAINER and args != g["args"], what
        g["args"] = args
        out, _ = admission.validate(dict(review, request=dict(review["request"], object=pod)),
                                    pol)
        assert not out["response"]["allowed"], f"{what}: the Python check admits it"
        body = _refused_by_policy(
            lambda p=pod: bed.cluster.core.create_namespaced_pod(ns, p, dry_run="All"))
        assert "sandman guard-misconfigured:" in body, f"{what}: {body}"


def test_policy_rule_names_are_documented():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "webhook.md").read_text()
    section = doc.split("## The policy", 1)[1].split("\n## ", 1)[0]
    for rule in policy.RULE_NAMES:
        assert f"`{rule}`" in section, f"docs/webhook.md's policy section lacks {rule}"


def _refused_by_policy(call) -> str:
    """The policy's message for a refused call; fails unless the policy refused it."""
    with pytest.raises(ApiException) as e:
        call()
    body = str(e.value.body)
    assert e.value.status == 403 and "ValidatingAdmissionPolicy" in body, body
    return body


def test_policy_alone_refuses_an_egress_deny_pod_that_keeps_net_raw(bed):
    """An egress-deny pod without the sandbox label is never mutated: with only the policy
    registered (no webhook), a container that keeps the runtime's NET_RAW (an AF_PACKET socket
    sends past netguard's deny: tests/netguard/test_net_raw.py), a guard whose env opens its
    ingress, an nfs volume (mounted from the node's network), an Unconfined profile are each
    refused; the correct pod is admitted."""
    ns = bed.namespace_for(SandboxPolicy())
    core = bed.cluster.core
    good = golden_cases.deny_pod()
    good["metadata"] = {"generateName": "deny-", "labels": {LABEL_EGRESS: "deny"}}
    core.create_namespaced_pod(ns, good, dry_run="All")
    for edit, rule in (
            (lambda s: s["containers"][0].pop("securityContext"), "net-raw-not-dropped"),
            (lambda s: s["containers"][0]["securityContext"]["capabilities"].update(
                drop=["CHOWN"]), "net-raw-not-dropped"),
            (lambda s: s["initContainers"].append({"name": "prep", "image": "x"}),
             "net-raw-not-dropped"),
            (lambda s: s["initContainers"][0].update(
                env=[{"name": "SANDMAN_NODE_IP", "value": "0.0.0.0/0"}]), "guard-misconfigured"),
            (lambda s: s["initContainers"][0].update(workingDir="/tmp"), "guard-misconfigured"),
            (lambda s: s["volumes"].append({"name": "out", "nfs": {
                "server": "127.0.0.1", "path": "/x"}}), "volume-type"),
            (lambda s: s["containers"][0]["securityContext"].update(
                seccompProfile={"type": "Unconfined"}), "unconfined"),
            (lambda s: s.update(securityContext={"appArmorProfile": {"type": "Unconfined"}}),
             "unconfined")):
        pod = copy.deepcopy(good)
        edit(pod["spec"])
        body = _refused_by_policy(lambda p=pod: core.create_namespaced_pod(ns, p, dry_run="All"))
        assert f"sandman {rule}:" in body, body
    # Any spelling of the drop counts, like the webhook's.
    for drop in (["net_raw"], ["CAP_NET_RAW"], ["all"], ["cap_all"]):
        pod = copy.deepcopy(good)
        pod["spec"]["containers"][0]["securityContext"]["capabilities"]["drop"] = drop
        core.create_namespaced_pod(ns, pod, dry_run="All")


def _debug(core, ns: str, pod: str, **container) -> None:
    core.patch_namespaced_pod_ephemeralcontainers(pod, ns, {"spec": {"ephemeralContainers": [
        {"name": "debugger", "image": "busybox", **container}]}}, dry_run="All")


def test_policy_alone_judges_ephemeral_containers_through_the_subresource(bed):
    """`kubectl debug` (pods/ephemeralcontainers) on a sandbox, with only the policy: its
    legacy profile keeps NET_RAW and is refused; a debugger that drops it is admitted, also on
    a pod admitted before the rule whose own containers keep NET_RAW (check_update judges
    only the containers an update adds); Unconfined and env from a Secret are refused."""
    ns = bed.namespace_for(SandboxPolicy())
    core = bed.cluster.core
    raw = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"generateName": "dbg-", "labels": {LABEL_SANDBOX: "true"},
                        "annotations": {ANNOTATION_TOKEN_SHA256: TOKEN}},
           "spec": {"containers": [{"name": "task", "image": "swe-task:1"}]}}
    pod = core.create_namespaced_pod(ns, make_sandbox(raw, SandboxPolicy())).metadata.name
    drop = {"capabilities": {"drop": ["ALL"]}}
    for container, rule in (
            ({}, "net-raw-not-dropped"),
            ({"securityContext": {"capabilities": {"drop": ["CHOWN"]}}}, "net-raw-not-dropped"),
            ({"securityContext": {**drop, "seccompProfile": {"type": "Unconfined"}}},
             "unconfined"),
            ({"securityContext": drop, "env": [{"name": "T", "valueFrom": {
                "secretKeyRef": {"name": "s", "key": "k"}}}]}, "secret-refused")):
        body = _refused_by_policy(lambda c=container: _debug(core, ns, pod, **c))
        assert f"sandman {rule}:" in body, body
    _debug(core, ns, pod, securityContext=drop)
    _debug(core, ns, pod, securityContext={"capabilities": {"drop": ["NET_RAW"]}})
    # A sandbox from before the rule (created exempt, NET_RAW kept): debugging it with a
    # debugger that drops NET_RAW is admitted, like the webhook's check_update does.
    old = make_sandbox(raw, SandboxPolicy())
    old["metadata"]["labels"][EXEMPT] = "true"
    old["spec"]["containers"][0]["securityContext"]["capabilities"]["drop"] = ["CHOWN"]
    name = core.create_namespaced_pod(ns, old).metadata.name
    core.patch_namespaced_pod(name, ns, [{"op": "remove", "path": "/metadata/labels/"
                                          + EXEMPT.replace("/", "~1")}])
    _debug(core, ns, name, securityContext=drop)
    body = _refused_by_policy(lambda: _debug(core, ns, name))
    assert "sandman net-raw-not-dropped:" in body, body
    # ...but labelling such a pod a sandbox judges it whole (check_update: a new sandbox).
    unlabelled = copy.deepcopy(old)
    del unlabelled["metadata"]["labels"][LABEL_SANDBOX]
    name = core.create_namespaced_pod(ns, unlabelled).metadata.name
    body = _refused_by_policy(lambda: core.patch_namespaced_pod(name, ns, [
        {"op": "add", "path": "/metadata/labels/" + LABEL_SANDBOX.replace("/", "~1"),
         "value": "true"},
        {"op": "remove", "path": "/metadata/labels/" + EXEMPT.replace("/", "~1")}],
        dry_run="All"))
    assert "sandman net-raw-not-dropped:" in body, body


def test_policy_alone_refuses_stripping_what_makes_a_pod_judged(bed):
    """With only the policy: an UPDATE removing the sandbox label, undoing egress=deny or
    changing the token hash is refused (oldObject); a pod that lost its labels before this rule
    (created exempt) still carries sandman's init containers, so a NET_ADMIN
    debugger on it is refused and a restricted one admitted."""
    ns = bed.namespace_for(SandboxPolicy())
    core = bed.cluster.core
    raw = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"generateName": "strip-", "labels": {LABEL_SANDBOX: "true",
                                                              LABEL_EGRESS: "deny"},
                        "annotations": {ANNOTATION_TOKEN_SHA256: TOKEN}},
           "spec": {"containers": [{"name": "task", "image": "swe-task:1"}]}}
    name = core.create_namespaced_pod(ns, make_sandbox(raw, SandboxPolicy())).metadata.name
    for op in ({"op": "remove", "path": "/metadata/labels/" + LABEL_SANDBOX.replace("/", "~1")},
               {"op": "replace", "path": "/metadata/labels/" + LABEL_EGRESS.replace("/", "~1"),
                "value": "allow"},
               {"op": "remove", "path": "/metadata/labels"},
               {"op": "replace", "path": "/metadata/annotations/"
                + ANNOTATION_TOKEN_SHA256.replace("/", "~1"), "value": "ab" * 32}):
        body = _refused_by_policy(lambda o=op: core.patch_namespaced_pod(name, ns, [o],
                                                                          dry_run="All"))
        assert "sandman metadata-immutable:" in body, (op, body)
    core.patch_namespaced_pod(name, ns, [{"op": "add", "path": "/metadata/labels/team",
                                          "value": "a"}], dry_run="All")
    # An egress-allow sandbox, so its guard's args still match the labels it is left with.
    stripped = make_sandbox(dict(raw, metadata=dict(raw["metadata"], labels={
        LABEL_SANDBOX: "true"})), SandboxPolicy())
    stripped["metadata"]["labels"] = {EXEMPT: "true"}
    body = _refused_by_policy(lambda: core.create_namespaced_pod(ns, dict(
        stripped, metadata=dict(stripped["metadata"], labels={"app": "x"})), dry_run="All"))
    assert "sandman sandbox-label:" in body, body
    name = core.create_namespaced_pod(ns, stripped).metadata.name
    core.patch_namespaced_pod(name, ns, [{"op": "remove", "path": "/metadata/labels/"
                                          + EXEMPT.replace("/", "~1")}])
    # Not privileged: the bed's API server refuses that before admission.
    body = _refused_by_policy(lambda: _debug(core, ns, name, securityContext={
        "capabilities": {"add": ["NET_ADMIN"]}}))
    assert "sandman capability-added:" in body, body
    _debug(core, ns, name, securityContext={"capabilities": {"drop": ["ALL"]}})


def test_policy_alone_enforces_pod_security_baseline(bed):
    """Each baseline control the webhook added (hostPort, SELinux, sysctls, AppArmor) refused by
    the policy alone at create and, for containers, through pods/ephemeralcontainers."""
    ns = bed.namespace_for(SandboxPolicy())
    core = bed.cluster.core
    raw = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"generateName": "pss-", "labels": {LABEL_SANDBOX: "true"},
                        "annotations": {ANNOTATION_TOKEN_SHA256: TOKEN}},
           "spec": {"containers": [{"name": "task", "image": "swe-task:1"}]}}
    good = make_sandbox(raw, SandboxPolicy())
    core.create_namespaced_pod(ns, good, dry_run="All")

    def task_sc(**sc):
        return lambda p: p["spec"]["containers"][0]["securityContext"].update(**sc)

    for edit, rule in (
            (lambda p: p["spec"]["containers"][0]["ports"].append(
                {"containerPort": 8080, "hostPort": 8080}), "host-port"),
            (task_sc(seLinuxOptions={"type": "spc_t"}), "selinux"),
            (task_sc(seLinuxOptions={"user": "system_u"}), "selinux"),
            (lambda p: p["spec"].update(securityContext={"seLinuxOptions": {
                "role": "system_r"}}), "selinux"),
            (lambda p: p["spec"].update(securityContext={"sysctls": [
                {"name": "kernel.msgmax", "value": "65536"}]}), "sysctl"),
            # API validation allows Unmasked only in a user namespace.
            (lambda p: (task_sc(procMount="Unmasked")(p), p["spec"].update(hostUsers=False)),
             "unconfined")):
        pod = copy.deepcopy(good)
        edit(pod)
        body = _refused_by_policy(lambda p=pod: core.create_namespaced_pod(ns, p, dry_run="All"))
        assert f"sandman {rule}:" in body, body
    for edit in (task_sc(seLinuxOptions={"type": "container_t"}),
                 lambda p: p["spec"].update(securityContext={"sysctls": [
                     {"name": "net.ipv4.tcp_keepalive_time", "value": "60"}]})):
        pod = copy.deepcopy(good)
        edit(pod)
        core.create_namespaced_pod(ns, pod, dry_run="All")
    name = core.create_namespaced_pod(ns, good).metadata.name
    body = _refused_by_policy(lambda: _debug(core, ns, name, securityContext={
        "capabilities": {"drop": ["ALL"]}, "seLinuxOptions": {"type": "spc_t"}}))
    assert "sandman selinux:" in body, body
