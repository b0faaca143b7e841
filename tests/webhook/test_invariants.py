"""Property test (issue 13): random labelled pods through the webhook's handlers, and every pod
that is ADMITTED (mutation patch applied with jsonpatch, then validation; for UPDATEs a random
ephemeral container added) satisfies the invariants docs/webhook.md states. The invariants are
written here from the docs, independently of sandman/podspec.py's checks. Seeded `random`,
pure logic; a few thousand pods in a few seconds."""

from __future__ import annotations

import base64
import copy
import json
import posixpath
import random
import re
from collections import Counter

import jsonpatch
import pytest

from sandman.contract import (
    ANNOTATION_TOKEN_SHA256,
    EXECD_PATH,
    LABEL_EGRESS,
    LABEL_SANDBOX,
    NETGUARD_CONTAINER,
    SANDMAN_VOLUME,
)
from sandman.podspec import SandboxPolicy, netguard_container
from webhook import admission

POLICY = SandboxPolicy()
CASES = 2000
TOKEN = "ab" * 32
SAFE_VOLUMES = {"emptyDir", "configMap", "downwardAPI", "persistentVolumeClaim", "ephemeral",
                "projected", "secret"}

CAP_ADDS = [[], [], [], ["ALL"], ["all"], ["NET_ADMIN"], ["NET_RAW"], ["cap_net_raw"],
            ["SYS_ADMIN"], ["CHOWN"], ["SYS_MODULE", "BPF"]]
CAP_DROPS = [[], ["ALL"], ["NET_RAW"], ["net_raw"], ["CAP_NET_RAW"], ["SYS_PTRACE"]]
PROFILES = [None, None, "RuntimeDefault", "Unconfined", "unconfined", "Localhost"]
VOLUMES = [
    {"hostPath": {"path": "/"}},
    {"hostPath": {"path": "/run/containerd/containerd.sock"}},
    {"emptyDir": {}},
    {"configMap": {"name": "c"}},
    {"secret": {"secretName": "legacy-sa-token"}},
    {"persistentVolumeClaim": {"claimName": "data"}},
    {"projected": {"sources": [{"serviceAccountToken": {"path": "token"}}]}},
    {"projected": {"sources": [{"secret": {"name": "s"}}]}},
    {"projected": {"sources": [{"configMap": {"name": "c"}}]}},
    {"csi": {"driver": "x"}},
    {"nfs": {"server": "10.0.0.1", "path": "/"}},
]
PATHS = ["/data", "//sandman", "/sandman/", "/./sandman", "/sandman/run", "/x/../sandman", "/tmp"]
COMMANDS = [None, ["sleep", "infinity"], ["python3", EXECD_PATH, "--listen", "0.0.0.0:9470"],
            ["python3", EXECD_PATH, "--insecure-no-token"],
            ["python3", EXECD_PATH, "--listen", "0.0.0.0:9470", "--token-sha256", "0" * 64],
            ["/bin/sh", EXECD_PATH, "--listen", "0.0.0.0:9470"]]


def _security_context(r: random.Random) -> dict | None:
    if r.random() < 0.25:
        return None
    sc: dict = {}
    if r.random() < 0.7:
        sc["capabilities"] = {"add": list(r.choice(CAP_ADDS)), "drop": list(r.choice(CAP_DROPS))}
    if r.random() < 0.1:
        sc["privileged"] = True
    for field in ("seccompProfile", "appArmorProfile"):
        t = r.choice(PROFILES)
        if t:
            sc[field] = {"type": t, **({"localhostProfile": "p.json"} if t == "Localhost"
                                       else {})}
    return sc


def _container(r: random.Random, name: str, volumes: list[str], sidecar: bool = False) -> dict:
    c: dict = {"name": name, "image": "img"}
    sc = _security_context(r)
    if sc is not None:
        c["securityContext"] = sc
    if sidecar and r.random() < 0.5:
        c["restartPolicy"] = "Always"
    if volumes and r.random() < 0.4:
        c["volumeMounts"] = [{"name": r.choice(volumes), "mountPath": r.choice(PATHS)}]
    if r.random() < 0.1:
        c["env"] = [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "s", "key": "token"}}}]
    return c


def random_pod(r: random.Random) -> dict:
    labels = {}
    sandbox = r.choice(["true", "true", None, "yes"])
    if sandbox:
        labels[LABEL_SANDBOX] = sandbox
    egress = r.choice(["deny", "deny", "allow", None, "Deny"])
    if egress:
        labels[LABEL_EGRESS] = egress
    volumes = []
    for i in range(r.randint(0, 2)):
        volumes.append({"name": f"v{i}", **copy.deepcopy(r.choice(VOLUMES))})
    names = [v["name"] for v in volumes]
    spec: dict = {"containers": [_container(r, f"c{i}", names) for i in range(r.randint(1, 3))]}
    cmd = r.choice(COMMANDS)
    if cmd:
        spec["containers"][0]["command"] = cmd
    inits = [_container(r, f"i{i}", names, sidecar=True) for i in range(r.randint(0, 2))]
    if r.random() < 0.15:
        spec["hostNetwork"] = True
    if r.random() < 0.1:
        spec["securityContext"] = {"seccompProfile": {"type": r.choice(["Unconfined",
                                                                         "RuntimeDefault"])}}
    annotations = {ANNOTATION_TOKEN_SHA256: TOKEN}
    if r.random() < 0.05:
        annotations["container.apparmor.security.beta.kubernetes.io/c0"] = "unconfined"
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "p", "namespace": "t", "labels": labels,
                        "annotations": annotations}, "spec": spec}
    # Not-mutated pods (no sandbox label) must bring the guard themselves: sometimes the right
    # one, sometimes a lookalike.
    if sandbox != "true" and egress == "deny" and r.random() < 0.8:
        volumes.append({"name": SANDMAN_VOLUME, "emptyDir": {}})
        guard = netguard_container(pod, POLICY)
        tamper = r.choice(["none", "none", "none", "sh", "allow-prefix", "env", "sidecar",
                           "caps"])
        if tamper == "sh":
            guard["command"] = ["sh", "-c", "exit 0"]
        elif tamper == "allow-prefix":
            guard["args"] = ["--allow-egress", "0.0.0.0/0", *guard["args"]]
        elif tamper == "env":
            guard["env"] = [{"name": "SANDMAN_NODE_IP", "value": "0.0.0.0/0"}]
        elif tamper == "sidecar":
            guard["restartPolicy"] = "Always"
        elif tamper == "caps":
            guard["securityContext"]["capabilities"]["add"].append("SYS_ADMIN")
        inits.insert(0, guard)
        if r.random() < 0.7:  # what a careful author adds to every other container
            for c in spec["containers"] + inits[1:]:
                c.setdefault("securityContext", {}).setdefault("capabilities", {}).setdefault(
                    "drop", []).append("NET_RAW")
    if r.random() < 0.4:  # a careful author: only the mistakes a mutation can fix remain
        spec.pop("hostNetwork", None)
        spec.pop("securityContext", None)
        annotations.pop("container.apparmor.security.beta.kubernetes.io/c0", None)
        volumes[:] = [v for v in volumes if set(v) & {"emptyDir", "configMap", "name"} == set(v)]
        for c in spec["containers"] + inits:
            sc = c.get("securityContext") or {}
            if c["name"] == NETGUARD_CONTAINER:
                continue
            sc.pop("privileged", None)
            (sc.get("capabilities") or {}).pop("add", None)
            for f in ("seccompProfile", "appArmorProfile"):
                sc.pop(f, None)
            c.pop("env", None)
            if c.get("volumeMounts") and c["volumeMounts"][0]["name"] not in {
                    v["name"] for v in volumes}:
                c.pop("volumeMounts")
    if inits:
        spec["initContainers"] = inits
    if volumes:
        spec["volumes"] = volumes
    return pod


def _review(pod: dict, operation: str = "CREATE", old: dict | None = None) -> dict:
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "u", "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "operation": operation, "object": pod, "oldObject": old}}


def admitted(pod: dict, operation: str = "CREATE", old: dict | None = None) -> dict | None:
    """The stored pod if the webhooks admit it (mutation then validation), else None."""
    if operation == "CREATE":
        out, _, _ = admission.mutate(_review(pod), POLICY)
        if not out["response"]["allowed"]:
            return None
        patch = out["response"].get("patch")
        if patch:
            pod = jsonpatch.apply_patch(pod, json.loads(base64.b64decode(patch)))
    out, _ = admission.validate(_review(pod, operation, old), POLICY)
    return pod if out["response"]["allowed"] else None


# --- the invariants, from docs/webhook.md ---------------------------------------------------

def _caps(values) -> set[str]:
    return {str(v).upper().removeprefix("CAP_") for v in values or []}


def _all(spec: dict):
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        for i, c in enumerate(spec.get(kind) or []):
            yield kind, i, c


def _quantity_equal(a, b) -> bool:
    from sandman.quantity import parse_quantity

    return a is not None and b is not None and parse_quantity(a) == parse_quantity(b)


def assert_invariants(pod: dict) -> None:
    labels = pod["metadata"].get("labels") or {}
    sandbox = labels.get(LABEL_SANDBOX) == "true"
    deny = labels.get(LABEL_EGRESS) == "deny"
    spec = pod["spec"]
    assert labels.get(LABEL_EGRESS) in (None, "deny", "allow")
    if not (sandbox or deny):
        return
    inits = spec.get("initContainers") or []
    guard_present = bool(inits) and inits[0].get("name") == NETGUARD_CONTAINER
    # No container but the guard can gain NET_ADMIN/NET_RAW/any added capability.
    for kind, i, c in _all(spec):
        sc = c.get("securityContext") or {}
        assert not sc.get("privileged"), c["name"]
        for f in ("seccompProfile", "appArmorProfile"):
            assert ((sc.get(f) or {}).get("type") or "").lower() != "unconfined", c["name"]
        if guard_present and kind == "initContainers" and i == 0:
            assert _caps(sc["capabilities"]["add"]) == {"NET_ADMIN", "NET_RAW"}
            assert _caps(sc["capabilities"]["drop"]) == {"ALL"}
            continue
        caps = sc.get("capabilities") or {}
        assert not _caps(caps.get("add")), (c["name"], caps)
        assert _caps(caps.get("drop")) & {"NET_RAW", "ALL"}, (c["name"], caps)
    # egress-deny => a correct first guard.
    if deny:
        assert guard_present
        g = inits[0]
        assert g["image"] == POLICY.image
        assert g["command"] == ["python3", "-I", "-S", "/opt/sandman/netguard.py", "apply"]
        assert g["args"][:2] == ["--egress", "deny"]
        assert not any(str(a).startswith("--a") for a in g["args"])
        assert "restartPolicy" not in g and "envFrom" not in g and "workingDir" not in g
        assert g["env"] == netguard_container(pod, POLICY)["env"]
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        assert not spec.get(key)
    assert ((spec.get("securityContext") or {}).get("seccompProfile") or {}).get(
        "type") != "Unconfined"
    assert "unconfined" not in (pod["metadata"].get("annotations") or {}).values()
    for v in spec.get("volumes") or []:
        assert set(v) - {"name"} <= SAFE_VOLUMES, v
    if not sandbox:
        return
    # requests == limits; no token; execd owned; /sandman not shadowed.
    for kind, _, c in _all(spec):
        if kind == "ephemeralContainers":
            continue
        r = c["resources"]
        for name in ("cpu", "memory"):
            assert _quantity_equal(r["requests"].get(name), r["limits"].get(name)), c["name"]
    assert spec["automountServiceAccountToken"] is False
    for v in spec.get("volumes") or []:
        assert "secret" not in v
        for s in (v.get("projected") or {}).get("sources") or []:
            assert "serviceAccountToken" not in s and "secret" not in s
    for _, _, c in _all(spec):
        assert not any("secretKeyRef" in (e.get("valueFrom") or {}) for e in c.get("env") or [])
    task = spec["containers"][0]
    argv = (task.get("command") or []) + (task.get("args") or [])
    assert re.fullmatch(r".*python3(\.\d+)?", argv[0]) and argv[1:] == [
        "-I", "-S", EXECD_PATH, "--listen", "0.0.0.0:9470"], argv
    for m in task.get("volumeMounts") or []:
        path = posixpath.normpath("/" + m["mountPath"].lstrip("/"))
        if path == "/sandman" or path.startswith("/sandman/"):
            assert m["name"] == SANDMAN_VOLUME and m.get("readOnly") is True, m


@pytest.mark.slow
def test_every_admitted_pod_keeps_the_invariants():
    r = random.Random(13)
    seen = Counter()
    for _ in range(CASES):
        pod = random_pod(r)
        labels = pod["metadata"]["labels"]
        kind = ("sandbox" if labels.get(LABEL_SANDBOX) == "true" else
                "deny-only" if labels.get(LABEL_EGRESS) == "deny" else "other")
        stored = admitted(copy.deepcopy(pod))
        seen[(kind, stored is not None)] += 1
        if stored is None:
            continue
        assert_invariants(stored)
        # kubectl debug on the admitted pod: a random ephemeral container.
        debug = _container(r, "debugger", [])
        new = copy.deepcopy(stored)
        new["spec"].setdefault("ephemeralContainers", []).append(debug)
        after = admitted(new, "UPDATE", stored)
        seen[("update", after is not None)] += 1
        if after is not None:
            assert_invariants(after)
        # A relabel to egress=deny is admitted only if the invariants still hold.
        relabelled = copy.deepcopy(stored)
        relabelled["metadata"]["labels"][LABEL_EGRESS] = "deny"
        after = admitted(relabelled, "UPDATE", stored)
        seen[("relabel", after is not None)] += 1
        if after is not None:
            assert_invariants(after)
    # Not vacuous: each kind of pod is both admitted and refused a fair number of times.
    for key in ("sandbox", "deny-only", "update", "relabel"):
        assert seen[(key, True)] >= 30 and seen[(key, False)] >= 30, sorted(seen.items())


def test_guard_cli_prints_an_admitted_egress_deny_pod():
    """The refusal of an unmutated egress-deny pod points at `python3 -m webhook guard`; what it
    prints is admitted, and a pod that is not JSON gets one line and exit code 1."""
    import subprocess
    import sys

    from tests.webhook.conftest import ROOT

    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "batch", "labels": {LABEL_EGRESS: "deny"}},
           "spec": {"initContainers": [{"name": "fetch", "image": "git"},
                                       {"name": "logs", "image": "fb", "restartPolicy": "Always"}],
                    "containers": [{"name": "worker", "image": "batch:1"}]}}
    refused, _ = admission.validate(_review(pod), POLICY)
    assert "python3 -m webhook guard" in refused["response"]["status"]["message"]
    p = subprocess.run([sys.executable, "-m", "webhook", "guard"], input=json.dumps(pod),
                       cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    guarded = json.loads(p.stdout)
    out, _ = admission.validate(_review(guarded), POLICY)
    assert out["response"]["allowed"], out
    assert_invariants(guarded)
    bad = subprocess.run([sys.executable, "-m", "webhook", "guard"], input="{not json",
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
