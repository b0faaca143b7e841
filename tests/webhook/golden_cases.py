"""The golden AdmissionReview inputs, one case per rule. `SANDMAN_GOLDEN_UPDATE=1 pytest
tests/webhook/test_golden.py` rewrites testdata/ (inputs and expected outputs); review the diff.

Names: mutate-* go to /mutate, validate-* to /validate. POLICIES holds the cases that run under a
non-default webhook configuration.
"""

from __future__ import annotations

import copy
import dataclasses
import zlib

from sandman.contract import (
    ANNOTATION_CONTAINER,
    ANNOTATION_EGRESS_ALLOW,
    ANNOTATION_INGRESS_FROM,
    ANNOTATION_TOKEN_SHA256,
    EXECD_PATH,
    EXECD_TOKEN_ENV,
    LABEL_EGRESS,
    LABEL_SANDBOX,
    NETGUARD_CONTAINER,
    SANDMAN_VOLUME,
)
from sandman.podspec import (
    EARLIER_NETGUARD_COMMANDS,
    GPU_RESOURCE,
    GUARD_EGRESS_DENY,
    SandboxPolicy,
    make_sandbox,
    netguard_container,
)

TOKEN = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
# docs/install.md's narrowed ingress (the trainers' pod CIDR); the controller replica that builds
# a pod admits its own pod IP on it (SandboxPolicy.controller_ip), the webhook must agree.
NARROWED = SandboxPolicy(ingress_from=("10.32.0.0/12",))
CONTROLLER = dataclasses.replace(NARROWED, controller_ip="10.200.0.7")
POLICIES = {"mutate-guard-mode-egress-deny-only": SandboxPolicy(guard=GUARD_EGRESS_DENY),
            "mutate-narrowed-ingress-default": NARROWED,
            "mutate-narrowed-ingress-controller-pod-unchanged": NARROWED,
            "validate-narrowed-ingress-controller-pod-allowed": NARROWED,
            "validate-narrowed-ingress-controller-admitted-by-a-user-refused": NARROWED,
            "validate-secret-volume-allowed-with-allow-secrets": SandboxPolicy(allow_secrets=True)}
# The chart's GPU settings: off (its default, the taint's toleration still reserved for GPU
# sandboxes) and on with at most 2 per sandbox.
GPU_TOLERATION = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
GPU_OFF = SandboxPolicy(gpu_tolerations=(f"{GPU_RESOURCE}:NoSchedule",))
GPU_ON = dataclasses.replace(GPU_OFF, gpu_max=2)
POLICIES.update({
    "validate-gpu-requested-when-disabled-refused": GPU_OFF,
    "validate-gpu-within-max-allowed": GPU_ON,
    "validate-gpu-over-max-refused": GPU_ON,
    "validate-gpu-toleration-without-gpu-refused": GPU_OFF,
    "validate-toleration-of-every-taint-refused": GPU_ON,
    "validate-gpu-in-init-container-refused": GPU_ON,
    "validate-extended-resource-in-init-container-refused": GPU_ON,
    "validate-hugepages-refused": GPU_ON,
})


def pod(labels=None, annotations=None, containers=None, **spec) -> dict:
    labels = {LABEL_SANDBOX: "true"} if labels is None else labels
    annotations = {ANNOTATION_TOKEN_SHA256: TOKEN} if annotations is None else annotations
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"generateName": "sbx-", "namespace": "team-a", "labels": labels,
                     "annotations": annotations},
        "spec": {"containers": containers or [{"name": "task", "image": "swe-task:django-11099"}],
                 **spec},
    }


def review(uid: str, obj: dict, operation: str = "CREATE", old: dict | None = None,
           dry_run: bool = False) -> dict:
    return {
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": uid, "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "team-a", "operation": operation,
            "userInfo": {"username": "system:serviceaccount:team-a:trainer"},
            "object": obj, "oldObject": old, "dryRun": dry_run,
            "options": {"apiVersion": "meta.k8s.io/v1",
                        "kind": "CreateOptions" if operation == "CREATE" else "UpdateOptions"},
        },
    }


def good(p: dict | None = None) -> dict:
    return make_sandbox(p or pod(), SandboxPolicy())


def _edit(p: dict, fn) -> dict:
    p = copy.deepcopy(p)
    fn(p)
    return p


def _res(req=None, lim=None) -> dict:
    r = {}
    if req:
        r["requests"] = req
    if lim:
        r["limits"] = lim
    return r


def cases() -> dict[str, dict]:
    sa_volume = {"name": "kube-api-access-x7k2p", "projected": {"defaultMode": 420, "sources": [
        {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
    ]}}
    sa_mount = {"name": "kube-api-access-x7k2p", "readOnly": True,
                "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}
    task = {"name": "task", "image": "swe-task:django-11099"}
    c = {}
    # --- mutation, one case per rule ---
    c["mutate-minimal-default-size-and-guard"] = review("m1", pod())
    c["mutate-unlabelled-untouched"] = review("m2", pod(labels={"app": "web"}))
    c["mutate-sandbox-label-not-true-untouched"] = review("m3", pod(labels={LABEL_SANDBOX: "yes"}))
    c["mutate-resources-copy-limits-to-requests"] = review("m4", pod(containers=[
        {**task, "resources": _res(lim={"cpu": "1", "memory": "2Gi"})}]))
    c["mutate-resources-copy-requests-to-limits"] = review("m5", pod(containers=[
        {**task, "resources": _res(req={"cpu": "500m", "memory": "1Gi"})}]))
    c["mutate-resources-never-lower-limit"] = review("m6", pod(containers=[
        {**task, "resources": _res(req={"cpu": "1", "memory": "1Gi"},
                                   lim={"cpu": "4", "memory": "16Gi"})}]))
    c["mutate-resources-equal-spelling-kept"] = review("m7", pod(containers=[
        {**task, "resources": _res(req={"cpu": "1000m", "memory": "1024Mi"},
                                   lim={"cpu": "1", "memory": "1Gi"})}]))
    c["mutate-resources-pod-level-equalized"] = review("m28", pod(resources=_res(
        req={"cpu": "1"}, lim={"cpu": "2", "memory": "4Gi"})))
    c["mutate-egress-deny-guard-args"] = review("m8", pod(labels={LABEL_SANDBOX: "true",
                                                                  LABEL_EGRESS: "deny"}))
    c["mutate-ingress-from-annotation"] = review("m9", pod(annotations={
        ANNOTATION_TOKEN_SHA256: TOKEN, ANNOTATION_INGRESS_FROM: "10.1.0.0/16, fd00::/64"}))
    c["mutate-ingress-from-invalid-denied"] = review("m10", pod(annotations={
        ANNOTATION_TOKEN_SHA256: TOKEN, ANNOTATION_INGRESS_FROM: "10.1.0.0/16,trainers"}))
    c["mutate-named-sandbox-container"] = review("m11", pod(
        annotations={ANNOTATION_TOKEN_SHA256: TOKEN, ANNOTATION_CONTAINER: "task"},
        containers=[{"name": "proxy", "image": "envoy:1", "resources": _res(
            lim={"cpu": "100m", "memory": "64Mi"})}, task]))
    c["mutate-named-container-missing-denied"] = review("m12", pod(
        annotations={ANNOTATION_TOKEN_SHA256: TOKEN, ANNOTATION_CONTAINER: "agent"}))
    c["mutate-already-runs-execd-command-kept"] = review("m13", pod(containers=[
        {**task, "command": ["/usr/bin/python3.8", "-I", "-S", EXECD_PATH, "--listen",
                             "0.0.0.0:9470"]}]))
    # Without -I -S the image's PYTHONPATH, .pth files and sitecustomize would run in execd.
    c["mutate-execd-command-without-isolation-gets-it-interpreter-kept"] = review("m28", pod(
        containers=[{**task, "command": ["/usr/bin/python3.8", EXECD_PATH, "--listen",
                                         "0.0.0.0:9470"]}]))
    c["mutate-command-and-args-replaced"] = review("m14", pod(containers=[
        {**task, "command": ["sleep"], "args": ["infinity"]}]))
    c["mutate-pod-seccomp-respected"] = review("m15", pod(
        securityContext={"seccompProfile": {"type": "Localhost",
                                            "localhostProfile": "profiles/sandbox.json"}}))
    c["mutate-drop-caps-merged"] = review("m16", pod(containers=[
        {**task, "securityContext": {"capabilities": {"drop": ["SYS_PTRACE"]},
                                     "allowPrivilegeEscalation": True}}]))
    c["mutate-injected-sa-token-removed"] = review("m17", pod(
        containers=[{**task, "volumeMounts": [sa_mount]}], volumes=[sa_volume],
        serviceAccountName="default"))
    c["mutate-service-links-and-automount-overridden"] = review("m18", pod(
        enableServiceLinks=True, automountServiceAccountToken=True))
    c["mutate-user-init-containers-kept-after-ours"] = review("m19", pod(initContainers=[
        {"name": "fetch-repo", "image": "alpine/git", "resources": _res(req={"cpu": "250m"})}]))
    c["mutate-tampered-netguard-replaced"] = review("m20", pod(initContainers=[
        {"name": "fetch-repo", "image": "alpine/git"},
        {"name": NETGUARD_CONTAINER, "image": "evil/netguard", "command": ["true"],
         "securityContext": {"privileged": True}}]))
    c["mutate-literal-token-env-replaced"] = review("m21", pod(containers=[
        {**task, "env": [{"name": EXECD_TOKEN_ENV, "value": TOKEN}, {"name": "PIP_NO_INDEX",
                                                                      "value": "1"}]}]))
    c["mutate-mount-over-sandman-dir-removed"] = review("m22", pod(
        containers=[{**task, "volumeMounts": [{"name": "fake", "mountPath": "/sandman/run"}]}],
        volumes=[{"name": "fake", "emptyDir": {}}]))
    c["mutate-guard-mode-egress-deny-only"] = review("m23", pod())
    c["mutate-dry-run-same-as-real"] = review("m24", pod(), dry_run=True)
    c["mutate-idempotent-mutated-pod-empty-patch"] = review("m25", good())
    c["mutate-idempotent-egress-deny"] = review("m26", good(pod(labels={
        LABEL_SANDBOX: "true", LABEL_EGRESS: "deny"})))
    c["mutate-update-not-mutated"] = review("m27", pod(), operation="UPDATE", old=pod())

    # --- validation, one case per rule ---
    g = good()
    c["validate-mutated-pod-allowed"] = review("v1", g)
    c["validate-unlabelled-allowed"] = review("v2", pod(labels={"app": "web"}, annotations={}))
    c["validate-unmutated-refused"] = review("v3", pod())
    c["validate-resources-unequal"] = review("v4", _edit(g, lambda p: p["spec"]["containers"][0][
        "resources"]["requests"].update(cpu="500m")))
    with_init = good(pod(initContainers=[{"name": "setup", "image": "busybox:1"}]))
    c["validate-resources-missing-init"] = review("v5", _edit(
        with_init, lambda p: p["spec"]["initContainers"][1].pop("resources")))
    c["validate-resources-pod-level-unequal"] = review("v27", _edit(
        g, lambda p: p["spec"].update(resources=_res(req={"memory": "1Gi"},
                                                     lim={"memory": "2Gi"}))))
    c["validate-service-links"] = review("v6", _edit(
        g, lambda p: p["spec"].pop("enableServiceLinks")))
    c["validate-sa-token-automount"] = review("v7", _edit(
        g, lambda p: p["spec"].update(automountServiceAccountToken=True)))
    c["validate-sa-token-projected-volume"] = review("v8", _edit(
        g, lambda p: p["spec"]["volumes"].append({"name": "aws-token", "projected": {
            "sources": [{"serviceAccountToken": {"audience": "sts.amazonaws.com",
                                                 "path": "token"}}]}})))
    c["validate-egress-deny-without-sandbox-label"] = review("v9", pod(
        labels={LABEL_EGRESS: "deny"}))
    c["validate-egress-label-invalid"] = review("v10", _edit(
        g, lambda p: p["metadata"]["labels"].update({LABEL_EGRESS: "Deny"})))
    c["validate-guard-missing"] = review("v11", _edit(
        g, lambda p: p["spec"]["initContainers"].pop(0)))
    c["validate-guard-not-first"] = review("v12", _edit(
        with_init, lambda p: p["spec"]["initContainers"].reverse()))
    c["validate-guard-wrong-image"] = review("v13", _edit(
        g, lambda p: p["spec"]["initContainers"][0].update(image="ghcr.io/someone/netguard:1")))
    c["validate-guard-extra-capability"] = review("v14", _edit(
        g, lambda p: p["spec"]["initContainers"][0]["securityContext"]["capabilities"][
            "add"].append("SYS_ADMIN")))
    c["validate-guard-writable-root"] = review("v15", _edit(
        g, lambda p: p["spec"]["initContainers"][0]["securityContext"].update(
            readOnlyRootFilesystem=False)))
    c["validate-guard-args-allow-under-deny-label"] = review("v16", _edit(
        g, lambda p: p["metadata"]["labels"].update({LABEL_EGRESS: "deny"})))
    c["validate-host-network"] = review("v17", _edit(g, lambda p: p["spec"].update(
        hostNetwork=True)))
    c["validate-host-pid-ipc"] = review("v18", _edit(g, lambda p: p["spec"].update(
        hostPID=True, hostIPC=True)))
    c["validate-privileged"] = review("v19", _edit(
        g, lambda p: p["spec"]["containers"][0]["securityContext"].update(privileged=True)))
    c["validate-net-admin-added"] = review("v20", _edit(
        g, lambda p: p["spec"]["containers"][0]["securityContext"]["capabilities"].update(
            add=["NET_ADMIN"])))
    c["validate-token-hash-missing"] = review("v21", _edit(
        g, lambda p: p["metadata"]["annotations"].pop(ANNOTATION_TOKEN_SHA256)))
    c["validate-token-hash-malformed"] = review("v22", _edit(
        g, lambda p: p["metadata"]["annotations"].update({ANNOTATION_TOKEN_SHA256: TOKEN.upper()})))
    # `re.match` with `$` accepted a trailing newline; the policy's CEL never did.
    c["validate-token-hash-trailing-newline-refused"] = review("v22n", _edit(
        g, lambda p: p["metadata"]["annotations"].update({ANNOTATION_TOKEN_SHA256: TOKEN + "\n"})))
    c["validate-not-mutated-probe-removed"] = review("v23", _edit(
        g, lambda p: p["spec"]["containers"][0].pop("readinessProbe")))
    c["validate-dry-run-same-as-real"] = review("v24", pod(), dry_run=True)
    c["validate-update-old-pod-finalizer-removal-allowed"] = review(
        "v25", pod(), operation="UPDATE",
        old=_edit(pod(), lambda p: p["metadata"].update(finalizers=["example.com/x"])))
    c["validate-update-egress-flipped-to-deny-refused"] = review(
        "v26", _edit(g, lambda p: p["metadata"]["labels"].update({LABEL_EGRESS: "deny"})),
        operation="UPDATE", old=g)
    # --- narrowed ingress: who netguard admits (sandman.dev/ingress-from is the record) ---
    ctl_pod = make_sandbox(pod(labels={LABEL_SANDBOX: "true", LABEL_EGRESS: "deny"}), CONTROLLER)
    c["mutate-narrowed-ingress-default"] = review("n1", pod())
    c["mutate-narrowed-ingress-controller-pod-unchanged"] = review("n2", ctl_pod)
    c["validate-narrowed-ingress-controller-pod-allowed"] = review("n3", ctl_pod)
    # The guard's args must be the pod's own policy: a guard that admits more than the pod's
    # annotation says is refused, whoever added the extra source.
    c["validate-narrowed-ingress-controller-admitted-by-a-user-refused"] = review("n4", _edit(
        ctl_pod, lambda p: p["metadata"]["annotations"].pop(ANNOTATION_INGRESS_FROM)))
    c.update(bypass_cases())
    c.update(resource_cases())
    c.update(egress_allow_cases())
    return c


# Egress allowlists (the sandman.dev/egress-allow annotation) under an admin's ceiling and never
# list; the API server's ClusterIP as the webhook reads it from its own environment.
EGRESS_POLICY = SandboxPolicy(
    egress_ceiling=("10.0.0.0/8:*/tcp", "[fd00::/8]:443/tcp", "svc/*.infra:*/tcp"),
    egress_never=("10.100.0.0/16",), api_server=("10.96.0.1",))
# The same cluster with a wider ceiling: what a pod built elsewhere (or by hand) asks for.
EGRESS_WIDE = dataclasses.replace(EGRESS_POLICY, egress_ceiling=("0.0.0.0/0:*/tcp",
                                                                "svc/*.other:*/tcp"))
# Every address of both families in the ceiling: only a never range refuses an entry.
EGRESS_EVERYWHERE = dataclasses.replace(EGRESS_POLICY, egress_ceiling=("0.0.0.0/0:*/tcp",
                                                                       "[::/0]:*/tcp"))
ALLOWLIST = "10.0.0.0/8:443/tcp,[fd00:1::/64]:443/tcp,svc/pypi.infra:3141/tcp"


def egress_allow_cases() -> dict[str, dict]:
    def allow_pod(allow: str = ALLOWLIST, egress: str = "deny") -> dict:
        return pod(labels={LABEL_SANDBOX: "true", LABEL_EGRESS: egress}, annotations={
            ANNOTATION_TOKEN_SHA256: TOKEN, ANNOTATION_EGRESS_ALLOW: allow})

    made = make_sandbox(allow_pod(), EGRESS_POLICY)
    c = {
        "mutate-egress-allow-guard-args": review("e1", allow_pod()),
        "mutate-egress-allow-outside-ceiling-refused": review("e2", allow_pod(
            "10.0.0.0/8:443/tcp,192.168.0.0/16:443/tcp")),
        "validate-egress-allow-within-ceiling-allowed": review("e3", made),
        # Built under a wider ceiling, judged under the cluster's: the guard args would open it.
        "validate-egress-allow-widened-cidr-refused": review("e4", make_sandbox(
            allow_pod("0.0.0.0/0:443/tcp"), EGRESS_WIDE)),
        "validate-egress-allow-svc-outside-namespace-refused": review("e5", make_sandbox(
            allow_pod("svc/pypi.other:3141/tcp"), EGRESS_WIDE)),
        "validate-egress-allow-extra-guard-args-refused": review("e6", _edit(
            made, lambda p: p["spec"]["initContainers"][0]["args"].extend(
                ["--allow-egress", "0.0.0.0/0:443/tcp"]))),
        "validate-egress-allow-never-args-dropped-refused": review("e7", _edit(
            made, lambda p: p["spec"]["initContainers"][0].update(args=[
                a for a in p["spec"]["initContainers"][0]["args"]
                if a not in ("--never-egress", "10.100.0.0/16")]))),
        "validate-egress-allow-with-egress-allow-label-refused": review("e8", _edit(
            made, lambda p: p["metadata"]["labels"].update({LABEL_EGRESS: "allow"}))),
        "validate-egress-allow-not-canonical-refused": review("e9", _edit(
            made, lambda p: p["metadata"]["annotations"].update(
                {ANNOTATION_EGRESS_ALLOW: "10.0.0.0/8:443"}))),
        "validate-egress-allow-annotation-edited-on-update-refused": review("e10", _edit(
            made, lambda p: p["metadata"]["annotations"].update(
                {ANNOTATION_EGRESS_ALLOW: "10.0.0.0/8:443/tcp"})), "UPDATE", old=made),
        "validate-egress-allow-state-label-on-update-allowed": review("e11", _edit(
            made, lambda p: p["metadata"]["labels"].update({"sandman.dev/state": "leased"})),
            "UPDATE", old=made),
        # The metadata address as IPv4-mapped IPv6, annotation and guard written by hand.
        "validate-egress-allow-ipv4-mapped-refused": review("e12", _edit(made, _mapped)),
        # /etc/hosts in every container, netguard's too: the pod's author would pick the
        # address a svc/ entry resolves to; so would a resolver of its own.
        "validate-egress-allow-svc-with-host-aliases-refused": review("e13", _edit(
            made, lambda p: p["spec"].update(hostAliases=[
                {"ip": "203.0.113.7", "hostnames": ["pypi.infra.svc.cluster.local"]}]))),
        "validate-egress-allow-svc-with-own-resolver-refused": review("e14", _edit(
            made, lambda p: p["spec"].update(dnsPolicy="None", dnsConfig={
                "nameservers": ["203.0.113.53"], "searches": ["svc.cluster.local"]}))),
        "validate-egress-allow-cidr-with-host-aliases-allowed": review("e15", make_sandbox(
            _edit(allow_pod("10.0.0.0/8:443/tcp"), lambda p: p["spec"].update(hostAliases=[
                {"ip": "10.1.2.3", "hostnames": ["mirror.local"]}])), EGRESS_POLICY)),
        # The metadata address inside prefixes that embed IPv4 (a relay or a translator
        # reaches it), annotation and guard written by hand; judged under EGRESS_EVERYWHERE.
        "validate-egress-allow-6to4-metadata-refused": review("e16", _edit(
            made, _by_hand("[2002:a9fe:a9fe::/48]:80/tcp"))),
        "validate-egress-allow-local-nat64-metadata-refused": review("e17", _edit(
            made, _by_hand("[64:ff9b:1::a9fe:a9fe/128]:80/tcp"))),
    }
    assert set(c) == set(EGRESS_CASES)
    return c


def _by_hand(entry: str):
    def edit(p: dict) -> None:
        p["metadata"]["annotations"][ANNOTATION_EGRESS_ALLOW] = entry
        args = p["spec"]["initContainers"][0]["args"]
        i = args.index("--allow-egress")
        args[i:i + 6] = ["--allow-egress", entry]  # the three entries of ALLOWLIST, replaced
    return edit


_mapped = _by_hand("[::ffff:a9fe:a9fe/128]:80/tcp")


EGRESS_CASES = (
    "mutate-egress-allow-guard-args", "mutate-egress-allow-outside-ceiling-refused",
    "validate-egress-allow-within-ceiling-allowed", "validate-egress-allow-widened-cidr-refused",
    "validate-egress-allow-svc-outside-namespace-refused",
    "validate-egress-allow-extra-guard-args-refused",
    "validate-egress-allow-never-args-dropped-refused",
    "validate-egress-allow-with-egress-allow-label-refused",
    "validate-egress-allow-not-canonical-refused",
    "validate-egress-allow-6to4-metadata-refused",
    "validate-egress-allow-local-nat64-metadata-refused",
    "validate-egress-allow-annotation-edited-on-update-refused",
    "validate-egress-allow-state-label-on-update-allowed",
    "validate-egress-allow-ipv4-mapped-refused",
    "validate-egress-allow-svc-with-host-aliases-refused",
    "validate-egress-allow-svc-with-own-resolver-refused",
    "validate-egress-allow-cidr-with-host-aliases-allowed")
# At import, not as cases() runs: a test worker may judge a case without building the list.
POLICIES.update(dict.fromkeys(EGRESS_CASES, EGRESS_POLICY))
POLICIES.update(dict.fromkeys(("validate-egress-allow-6to4-metadata-refused",
                               "validate-egress-allow-local-nat64-metadata-refused"),
                              EGRESS_EVERYWHERE))


def _limits(**limits) -> dict:
    return {"resources": {"limits": {k.replace("_", "-").replace("nvidia-com-gpu",
                                                                  GPU_RESOURCE): v
                                     for k, v in limits.items()}}}


def resource_cases() -> dict[str, dict]:
    """What a sandbox may ask of a node besides CPU and memory: ephemeral-storage (requests ==
    limits, like cpu and memory), the chart's GPU resource where allowed, and nothing else.
    Written as an attacker who can create a labelled pod would try it."""
    c = {}

    def add(name, obj, **kw):  # uid from the name: adding a case changes no other file
        c[name] = review(f"r-{zlib.crc32(name.encode()):08x}", obj, **kw)

    task = {"name": "task", "image": "swe-task:django-11099"}
    setup = {"name": "setup", "image": "busybox:1"}
    gpu_task = {**task, **_limits(nvidia_com_gpu="1")}
    # A labelled pod asking for a GPU where the chart grants none (the default).
    add("validate-gpu-requested-when-disabled-refused", good(pod(containers=[gpu_task])))
    add("validate-gpu-within-max-allowed", good(pod(
        containers=[gpu_task], tolerations=[dict(GPU_TOLERATION)])))
    add("validate-gpu-over-max-refused", good(pod(
        containers=[{**task, **_limits(nvidia_com_gpu="3")}], tolerations=[dict(GPU_TOLERATION)])))
    # The GPU nodes' taint tolerated without a GPU: a CPU sandbox squatting on a GPU node.
    add("validate-gpu-toleration-without-gpu-refused", good(pod(
        tolerations=[dict(GPU_TOLERATION)])))
    add("validate-toleration-of-every-taint-refused", good(pod(
        tolerations=[{"operator": "Exists"}])))
    # Smuggled through an init container: it runs first and holds its devices for the pod's
    # life (the pod's request is the larger of its largest init container and its containers).
    add("validate-gpu-in-init-container-refused", good(pod(
        initContainers=[{**setup, **_limits(nvidia_com_gpu="1")}])))
    add("validate-extended-resource-in-init-container-refused", good(pod(
        initContainers=[{**setup, **_limits(**{"example.com/fpga": "1"})}])))
    add("validate-hugepages-refused", good(pod(
        containers=[{**task, **_limits(**{"hugepages-2Mi": "64Mi"})}])))
    # ephemeral-storage: requests == limits when either is set; the mutation copies the side
    # that is set (the larger when both differ, like cpu and memory) and sizes the injected
    # init container by the pod's total, so the pod's effective request is unchanged.
    add("mutate-ephemeral-storage-limit-copied-to-request", pod(
        containers=[{**task, **_limits(ephemeral_storage="10Gi")}]))
    storage = good(pod(containers=[{**task, **_limits(ephemeral_storage="10Gi")}]))
    add("validate-ephemeral-storage-unequal-refused", _edit(
        storage, lambda p: p["spec"]["containers"][0]["resources"]["requests"].update(
            {"ephemeral-storage": "1Gi"})))
    add("validate-ephemeral-storage-equal-allowed", storage)
    return c


# An older webhook (image tag of the day before an upgrade) built these running pods: under
# today's policy their guard already fails `guard-misconfigured`, which main's UPDATE rule (new
# refusals minus the old pod's) used to mask.
OLD_IMAGE = "ghcr.io/sandman-dev/sandman:0.0.9"
SIDECAR = {"name": "proxy", "image": "envoy:1"}
DROP_NET_RAW = {"capabilities": {"drop": ["NET_RAW"]}}


def deny_pod(**spec) -> dict:
    """An egress-deny pod without the sandbox label (never mutated) that carries everything it
    must: the guard exactly as sandman renders it and NET_RAW dropped elsewhere."""
    p = pod(labels={LABEL_EGRESS: "deny"}, annotations={},
            containers=[{"name": "worker", "image": "batch:1", "securityContext": DROP_NET_RAW}],
            volumes=[{"name": SANDMAN_VOLUME, "emptyDir": {}}], **spec)
    p["spec"]["initContainers"] = [netguard_container(p, SandboxPolicy())]
    return p


def two_init_layout(sandbox: dict) -> dict:
    """A guarded sandbox as the mutation made it before its guard installed execd: the guard
    without --install-execd, the volume's run/ only, then sandman-execd-install."""
    p = copy.deepcopy(sandbox)
    guard = p["spec"]["initContainers"][0]
    assert guard["name"] == NETGUARD_CONTAINER and guard["args"][-2] == "--install-execd"
    guard["args"] = guard["args"][:-2]
    guard["volumeMounts"] = [{"name": SANDMAN_VOLUME, "mountPath": "/sandman/run",
                              "subPath": "run"}]
    p["spec"]["initContainers"].insert(1, {
        "name": "sandman-execd-install", "image": guard["image"],
        "imagePullPolicy": "IfNotPresent", "command": ["python3", "-c", "..."],
        "resources": guard["resources"],
        "securityContext": {"capabilities": {"drop": ["ALL"]}, "privileged": False,
                            "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "volumeMounts": [{"name": SANDMAN_VOLUME, "mountPath": "/sandman"}],
        "terminationMessagePolicy": "FallbackToLogsOnError"})
    return p


def ephemeral(p: dict, **container) -> dict:
    """What `kubectl debug` sends: UPDATE of pods/ephemeralcontainers with the whole pod."""
    new = _edit(p, lambda q: q["spec"].setdefault("ephemeralContainers", []).append(
        {"name": "debugger", "image": "busybox",
         # The pod's own container (a sandbox's is `task`, deny_pod's `worker`).
         "targetContainerName": p["spec"]["containers"][0]["name"], **container}))
    r = review("e", new, operation="UPDATE", old=p)
    r["request"]["subResource"] = "ephemeralcontainers"
    r["request"]["resource"] = {"group": "", "version": "v1", "resource": "pods"}
    return r


def bypass_cases() -> dict[str, dict]:
    """Issue 13: each of these was admitted by main."""
    task = {"name": "task", "image": "swe-task:django-11099"}
    two = good(pod(containers=[task, SIDECAR]))
    g = good()
    c = {}

    def add(name, obj, **kw):  # uid from the name: adding a case changes no other file
        c[name] = review(f"b-{zlib.crc32(name.encode()):08x}", obj, **kw)

    def caps(index, kind="containers", **sc):
        return lambda p: p["spec"][kind][index].setdefault("securityContext", {}).setdefault(
            "capabilities", {}).update(**sc)

    # 1. added capabilities, any case, any container kind
    add("mutate-net-raw-dropped-in-every-other-container", pod(
        containers=[task, SIDECAR], initContainers=[
            {"name": "log-shipper", "image": "fluent-bit:3", "restartPolicy": "Always"}]))
    add("validate-cap-all-in-sidecar-refused", _edit(two, caps(1, add=["all"])))
    sidecar_init = good(pod(initContainers=[{"name": "log-shipper", "image": "fluent-bit:3",
                                             "restartPolicy": "Always"}]))
    add("validate-cap-all-in-init-sidecar-refused", _edit(sidecar_init, caps(1, "initContainers",
                                                                             add=["ALL"])))
    add("validate-cap-all-in-sandbox-container-refused", _edit(g, caps(0, add=["ALL"])))
    add("validate-cap-sys-admin-refused", _edit(g, caps(0, add=["SYS_ADMIN", "CAP_SYS_MODULE"])))
    add("validate-net-raw-not-dropped-in-sidecar-refused", _edit(two, caps(1, drop=[])))
    # 2. volumes, seccomp/AppArmor, secrets
    add("validate-hostpath-root-refused", _edit(g, lambda p: p["spec"]["volumes"].append(
        {"name": "host", "hostPath": {"path": "/"}})))
    add("validate-hostpath-containerd-socket-refused", _edit(two, lambda p: p["spec"][
        "volumes"].append({"name": "cri", "hostPath": {
            "path": "/run/containerd/containerd.sock", "type": "Socket"}})))
    add("validate-csi-inline-volume-refused", _edit(g, lambda p: p["spec"]["volumes"].append(
        {"name": "s3", "csi": {"driver": "s3.csi.aws.com"}})))
    add("validate-pvc-and-configmap-volumes-allowed", _edit(g, lambda p: p["spec"][
        "volumes"].extend([{"name": "data", "persistentVolumeClaim": {"claimName": "swe"}},
                           {"name": "cfg", "configMap": {"name": "task"}},
                           {"name": "info", "downwardAPI": {"items": []}}])))
    add("validate-secret-volume-legacy-sa-token-refused", _edit(
        g, lambda p: p["spec"]["volumes"].append(
            {"name": "tok", "secret": {"secretName": "trainer-token"}})))
    add("validate-secret-volume-allowed-with-allow-secrets", _edit(
        g, lambda p: p["spec"]["volumes"].append(
            {"name": "tok", "secret": {"secretName": "api-keys"}})))
    add("validate-projected-secret-refused", _edit(g, lambda p: p["spec"]["volumes"].append(
        {"name": "tok", "projected": {"sources": [{"secret": {"name": "trainer-token"}}]}})))
    add("validate-env-from-secret-refused", _edit(g, lambda p: p["spec"]["containers"][0][
        "env"].append({"name": "K8S_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": "trainer-token", "key": "token"}}})))
    add("validate-seccomp-unconfined-pod-refused", _edit(g, lambda p: p["spec"].update(
        securityContext={"seccompProfile": {"type": "Unconfined"}})))
    add("validate-seccomp-unconfined-container-refused", _edit(g, lambda p: p["spec"][
        "containers"][0]["securityContext"].update(seccompProfile={"type": "Unconfined"})))
    add("validate-apparmor-unconfined-container-refused", _edit(g, lambda p: p["spec"][
        "containers"][0]["securityContext"].update(appArmorProfile={"type": "Unconfined"})))
    add("validate-apparmor-annotation-unconfined-refused", _edit(g, lambda p: p["metadata"][
        "annotations"].update({"container.apparmor.security.beta.kubernetes.io/task":
                               "unconfined"})))
    add("validate-seccomp-pod-annotation-unconfined-refused", _edit(g, lambda p: p["metadata"][
        "annotations"].update({"seccomp.security.alpha.kubernetes.io/pod": "unconfined"})))
    # 7. execd's command belongs to the mutation
    add("mutate-execd-insecure-no-token-replaced", pod(containers=[
        {**task, "command": ["python3", EXECD_PATH, "--insecure-no-token"]}]))
    add("mutate-execd-author-token-flag-replaced", pod(containers=[
        {**task, "command": ["python3", EXECD_PATH], "args": ["--token-sha256", "0" * 64]}]))
    add("validate-execd-insecure-no-token-refused", _edit(g, lambda p: p["spec"]["containers"][
        0].update(args=["--insecure-no-token"])))
    # 8. one spelling per path
    for n, path in (("double-slash", "//sandman"), ("trailing-slash", "/sandman/"),
                    ("dot", "/./sandman")):
        add(f"mutate-mount-{n}-over-sandman-removed", pod(
            containers=[{**task, "volumeMounts": [{"name": "fake", "mountPath": path}]}],
            volumes=[{"name": "fake", "emptyDir": {}}]))
    add("validate-mount-double-slash-shadows-sandman-refused", _edit(g, lambda p: (
        p["spec"]["volumes"].append({"name": "fake", "emptyDir": {}}),
        p["spec"]["containers"][0]["volumeMounts"].append(
            {"name": "fake", "mountPath": "//sandman"}))))
    # 3. UPDATE judged on the new pod's own guard
    old_allow = make_sandbox(pod(), SandboxPolicy(image=OLD_IMAGE))
    add("validate-update-relabel-deny-after-image-upgrade-refused", _edit(
        old_allow, lambda p: p["metadata"]["labels"].update({LABEL_EGRESS: "deny"})),
        operation="UPDATE", old=old_allow)
    unguarded = make_sandbox(pod(), SandboxPolicy(guard=GUARD_EGRESS_DENY))
    add("validate-update-relabel-deny-after-guard-switch-refused", _edit(
        unguarded, lambda p: p["metadata"]["labels"].update({LABEL_EGRESS: "deny"})),
        operation="UPDATE", old=unguarded)
    add("validate-update-guard-image-swapped-refused", _edit(
        old_allow, lambda p: p["spec"]["initContainers"][0].update(image="evil/netguard:1")),
        operation="UPDATE", old=old_allow)
    add("validate-update-label-change-after-image-upgrade-allowed", _edit(
        old_allow, lambda p: p["metadata"]["labels"].update(team="a")),
        operation="UPDATE", old=old_allow)
    # A sandbox created before the guard installed execd: a guard without --install-execd that
    # sees only run/, then the install container. Its label updates are still judged by the
    # rules of its own kind: admitted, and stripping what makes it a sandbox still refused.
    two_inits = two_init_layout(make_sandbox(pod(), SandboxPolicy(image=OLD_IMAGE)))
    add("validate-update-two-init-layout-label-change-allowed", _edit(
        two_inits, lambda p: p["metadata"]["labels"].update(team="a")),
        operation="UPDATE", old=two_inits)
    add("validate-update-two-init-layout-sandbox-label-removed-refused", _edit(
        two_inits, lambda p: p["metadata"]["labels"].pop(LABEL_SANDBOX)),
        operation="UPDATE", old=two_inits)
    old_deny = make_sandbox(pod(labels={LABEL_SANDBOX: "true", LABEL_EGRESS: "deny"}),
                            SandboxPolicy(image=OLD_IMAGE))
    add("validate-update-deny-pod-relabelled-after-upgrade-allowed", _edit(
        old_deny, lambda p: p["metadata"]["labels"].update(team="a")),
        operation="UPDATE", old=old_deny)
    # A deny sandbox whose guard an earlier release started as `python3 -m netguard apply`:
    # its label updates stay admitted; the same guard in a new pod is refused.
    earlier = copy.deepcopy(old_deny)
    earlier["spec"]["initContainers"][0]["command"] = list(EARLIER_NETGUARD_COMMANDS[0])
    add("validate-update-earlier-guard-command-label-change-allowed", _edit(
        earlier, lambda p: p["metadata"]["labels"].update(team="a")),
        operation="UPDATE", old=earlier)
    fresh = make_sandbox(pod(labels={LABEL_SANDBOX: "true", LABEL_EGRESS: "deny"}),
                         SandboxPolicy())
    fresh["spec"]["initContainers"][0]["command"] = list(EARLIER_NETGUARD_COMMANDS[0])
    add("validate-earlier-guard-command-at-create-refused", fresh)
    # 4. pods/ephemeralcontainers
    c["validate-ephemeral-netadmin-refused"] = ephemeral(g, securityContext={
        "capabilities": {"add": ["NET_ADMIN", "NET_RAW"]}})
    c["validate-ephemeral-sysadmin-refused"] = ephemeral(g, securityContext={
        "privileged": True})
    c["validate-ephemeral-default-profile-refused"] = ephemeral(g)
    c["validate-ephemeral-restricted-allowed"] = ephemeral(g, securityContext={
        "capabilities": {"drop": ["ALL"]}})
    c["validate-ephemeral-on-egress-deny-pod-refused"] = ephemeral(deny_pod(), securityContext={
        "capabilities": {"add": ["NET_ADMIN"]}})
    # 9. Pod Security Standards baseline, control by control (docs/webhook.md's table)
    def task_sc(**sc):
        return lambda p: p["spec"]["containers"][0]["securityContext"].update(**sc)

    def pod_sc(**sc):
        return lambda p: p["spec"].update(securityContext=sc)

    apparmor_task = "container.apparmor.security.beta.kubernetes.io/task"
    add("validate-host-port-refused", _edit(g, lambda p: p["spec"]["containers"][0][
        "ports"].append({"containerPort": 8080, "hostPort": 8080})))
    add("validate-selinux-spc-t-refused", _edit(g, task_sc(seLinuxOptions={"type": "spc_t"})))
    add("validate-selinux-pod-type-refused", _edit(g, pod_sc(
        seLinuxOptions={"type": "unconfined_t"})))
    add("validate-selinux-user-role-refused", _edit(g, task_sc(
        seLinuxOptions={"user": "system_u", "role": "system_r"})))
    add("validate-selinux-container-t-allowed", _edit(g, task_sc(
        seLinuxOptions={"type": "container_t", "level": "s0:c123,c456"})))
    add("validate-sysctl-unsafe-refused", _edit(g, pod_sc(sysctls=[
        {"name": "kernel.msgmax", "value": "65536"}])))
    add("validate-sysctl-safe-allowed", _edit(g, pod_sc(sysctls=[
        {"name": "net.ipv4.ip_unprivileged_port_start", "value": "0"},
        {"name": "net.ipv4.tcp_keepalive_time", "value": "60"}])))
    add("validate-apparmor-annotation-other-refused", _edit(g, lambda p: p["metadata"][
        "annotations"].update({apparmor_task: "foo"})))
    add("validate-apparmor-pod-unconfined-refused", _edit(g, pod_sc(
        appArmorProfile={"type": "Unconfined"})))
    add("validate-apparmor-localhost-allowed", _edit(g, lambda p: (
        task_sc(appArmorProfile={"type": "Localhost", "localhostProfile": "sandbox"})(p),
        p["metadata"]["annotations"].update({apparmor_task: "localhost/sandbox"}))))
    # API validation allows Unmasked only in a user namespace (hostUsers: false).
    add("validate-procmount-unmasked-refused", _edit(g, lambda p: (
        task_sc(procMount="Unmasked")(p), p["spec"].update(hostUsers=False))))
    add("validate-host-process-refused", _edit(g, task_sc(windowsOptions={"hostProcess": True})))
    c["validate-ephemeral-selinux-spc-t-refused"] = ephemeral(g, securityContext={
        "capabilities": {"drop": ["ALL"]}, "seLinuxOptions": {"type": "spc_t"}})
    c["validate-ephemeral-procmount-unmasked-refused"] = ephemeral(g, securityContext={
        "capabilities": {"drop": ["ALL"]}, "procMount": "Unmasked"})
    add("validate-update-apparmor-annotation-added-refused", _edit(g, lambda p: p["metadata"][
        "annotations"].update({"container.apparmor.security.beta.kubernetes.io/debugger":
                               "unconfined"})), operation="UPDATE", old=g)
    # 10. what makes a pod judged never changes; sandman's init containers make it a sandbox
    deny_sandbox = good(pod(labels={LABEL_SANDBOX: "true", LABEL_EGRESS: "deny"}))
    add("validate-update-sandbox-label-removed-refused", _edit(
        deny_sandbox, lambda p: p["metadata"]["labels"].pop(LABEL_SANDBOX)),
        operation="UPDATE", old=deny_sandbox)
    add("validate-update-egress-deny-to-allow-refused", _edit(
        deny_sandbox, lambda p: p["metadata"]["labels"].update({LABEL_EGRESS: "allow"})),
        operation="UPDATE", old=deny_sandbox)
    add("validate-update-egress-deny-removed-from-deny-pod-refused", _edit(
        deny_pod(), lambda p: p["metadata"]["labels"].pop(LABEL_EGRESS)),
        operation="UPDATE", old=deny_pod())
    add("validate-update-token-changed-refused", _edit(g, lambda p: p["metadata"][
        "annotations"].update({ANNOTATION_TOKEN_SHA256: "ab" * 32})), operation="UPDATE", old=g)
    unlabelled = _edit(g, lambda p: p["metadata"].update(labels={"app": "x"}))
    add("validate-installing-guard-without-sandbox-label-refused", unlabelled)
    add("validate-install-container-without-sandbox-label-refused", _edit(
        make_sandbox(pod(), SandboxPolicy(guard=GUARD_EGRESS_DENY)),
        lambda p: p["metadata"].update(labels={"app": "x"})))
    # A sandbox's one init container is the guard that also installs execd: its install
    # argument, its whole-volume mount and the standalone install beside it are sandman's only.
    add("validate-installing-guard-abbreviated-flag-without-label-refused", _edit(
        unlabelled, lambda p: p["spec"]["initContainers"][0].update(args=[
            *p["spec"]["initContainers"][0]["args"][:-2], "--inst=/sandman"])))
    add("validate-sandbox-guard-without-install-refused", _edit(
        g, lambda p: p["spec"]["initContainers"][0].update(
            args=p["spec"]["initContainers"][0]["args"][:-2])))
    add("validate-sandbox-guard-installs-elsewhere-refused", _edit(
        g, lambda p: p["spec"]["initContainers"][0]["args"].__setitem__(-1, "/tmp")))
    add("validate-sandbox-guard-mount-subpath-refused", _edit(
        g, lambda p: p["spec"]["initContainers"][0]["volumeMounts"][0].update(subPath="run")))
    add("validate-sandbox-guard-plus-attacker-install-container-refused", _edit(
        g, lambda p: p["spec"]["initContainers"].append({
            "name": "sandman-execd-install", "image": "evil/execd:1",
            "command": ["sh", "-c", "echo 'print(1)' > /sandman/execd.py"],
            "resources": p["spec"]["initContainers"][0]["resources"],
            "securityContext": {"capabilities": {"drop": ["ALL"]}},
            "volumeMounts": [{"name": SANDMAN_VOLUME, "mountPath": "/sandman"}]})))
    add("validate-deny-pod-guard-installing-execd-refused", _edit(
        deny_pod(), lambda p: p["spec"]["initContainers"][0]["args"].extend(
            ["--install-execd", "/sandman"])))
    c["validate-ephemeral-netadmin-on-unlabelled-sandbox-refused"] = ephemeral(
        unlabelled, securityContext={"privileged": True, "capabilities": {"add": ["NET_ADMIN"]}})
    c["validate-ephemeral-restricted-on-unlabelled-sandbox-allowed"] = ephemeral(
        unlabelled, securityContext={"capabilities": {"drop": ["ALL"]}})
    # 5. egress=deny without the sandbox label: the whole guard and the pod-level rules
    add("validate-egress-deny-correct-pod-allowed", deny_pod())
    # What the API server stores: the service-account plugin mounted its token everywhere.
    plugin_token = {"name": "kube-api-access-4x7rq", "projected": {"sources": [
        {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}}]}}
    plugin_mount = {"name": "kube-api-access-4x7rq", "readOnly": True,
                    "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}
    add("validate-egress-deny-plugin-token-mount-allowed", _edit(deny_pod(), lambda p: (
        p["spec"]["volumes"].append(plugin_token),
        [c.setdefault("volumeMounts", []).append(plugin_mount)
         for c in p["spec"]["initContainers"] + p["spec"]["containers"]])))
    add("validate-egress-deny-guard-sh-exit-refused", _edit(deny_pod(), lambda p: p["spec"][
        "initContainers"][0].update(command=["sh", "-c", "exit 0"])))
    add("validate-egress-deny-guard-allow-egress-prefix-refused", _edit(
        deny_pod(), lambda p: p["spec"]["initContainers"][0].update(args=[
            "--allow-egress", "0.0.0.0/0", "--allow-egress", "::/0",
            *p["spec"]["initContainers"][0]["args"]])))
    add("validate-egress-deny-guard-env-overridden-refused", _edit(
        deny_pod(), lambda p: p["spec"]["initContainers"][0].update(
            env=[{"name": "SANDMAN_NODE_IP", "value": "0.0.0.0/0"}])))
    add("validate-egress-deny-guard-as-sidecar-refused", _edit(
        deny_pod(), lambda p: p["spec"]["initContainers"][0].update(restartPolicy="Always")))
    add("validate-egress-deny-net-admin-sidecar-refused", _edit(deny_pod(), lambda p: p["spec"][
        "containers"].append({"name": "helper", "image": "x", "securityContext": {
            "capabilities": {"add": ["NET_ADMIN"], "drop": ["NET_RAW"]}}})))
    add("validate-egress-deny-privileged-refused", _edit(deny_pod(), lambda p: p["spec"][
        "containers"][0]["securityContext"].update(privileged=True)))
    add("validate-egress-deny-host-network-refused", deny_pod(hostNetwork=True))
    add("validate-egress-deny-net-raw-kept-refused", _edit(deny_pod(), lambda p: p["spec"][
        "containers"][0].pop("securityContext")))
    add("validate-egress-deny-hostpath-refused", _edit(deny_pod(), lambda p: p["spec"][
        "volumes"].append({"name": "host", "hostPath": {"path": "/"}})))
    return c
