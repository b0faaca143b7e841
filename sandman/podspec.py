"""What makes a pod a correct sandbox: one idempotent mutation and the checks of its result.

`make_sandbox(pod, policy)` returns a mutated deep copy; the admission webhook diffs it against
the original (jsonpatch) and the controller calls it to build its own pods, so both paths produce
the same pod. `check_sandbox(pod, policy)` lists what is wrong with a final pod object; the
validating webhook refuses on any entry. Pods are plain dicts in the API's JSON form.

Idempotency is a requirement, not a nicety: the API server re-invokes the mutating webhook
(`reinvocationPolicy: IfNeeded`) and defaults fields in between, so `make_sandbox` keeps values
that already mean the right thing (equal quantities spelled differently, defaulted fields of
injected containers) and only changes what is wrong. docs/webhook.md says why each rule exists.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import ipaddress
import posixpath
import re
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from sandman import egress as egress_entries
from sandman.api import DEFAULT_CPU, DEFAULT_MEMORY
from sandman.contract import (
    ANNOTATION_CONTAINER,
    ANNOTATION_EGRESS_ALLOW,
    ANNOTATION_INGRESS_FROM,
    ANNOTATION_TOKEN_SHA256,
    EGRESS_ALLOW,
    EGRESS_DENY,
    EXECD_DIR,
    EXECD_INSTALL_CONTAINER,
    EXECD_PATH,
    EXECD_PORT,
    EXECD_READY_PATH,
    EXECD_TOKEN_ENV,
    LABEL_EGRESS,
    LABEL_SANDBOX,
    NETGUARD_APPLY_OPTIONS,
    NETGUARD_CONTAINER,
    NETGUARD_FLAG_ALLOW_EGRESS,
    NETGUARD_FLAG_EGRESS,
    NETGUARD_FLAG_INGRESS_FROM,
    NETGUARD_FLAG_INGRESS_FROM_GATEWAY,
    NETGUARD_FLAG_INGRESS_PORT,
    NETGUARD_FLAG_INSTALL_EXECD,
    NETGUARD_FLAG_NEVER_EGRESS,
    NETGUARD_PATH,
    NETGUARD_STATUS_PATH,
    SANDBOX_TRUE,
    SANDMAN_IMAGE,
    SANDMAN_VOLUME,
    is_token_sha256,
    netguard_argparse_kwargs,
)
from sandman.quantity import format_quantity, parse_quantity

GUARD_ALWAYS = "always"  # every sandbox gets netguard (inbound guard on execd's port at least)
GUARD_EGRESS_DENY = "egress-deny"  # only pods labelled egress=deny get netguard
GUARD_MODES = (GUARD_ALWAYS, GUARD_EGRESS_DENY)

RUN_DIR = posixpath.dirname(NETGUARD_STATUS_PATH)  # writable for netguard, read-only in sandbox
# execd runs isolated from the task image's Python setup: -I ignores PYTHON* variables
# (PYTHONPATH=/testbed would put a repository's own `http` or `json` package before the
# standard library execd imports) and the user site; -S skips site, so no .pth file or
# sitecustomize of the image runs inside execd (it needs only the standard library).
EXECD_PYTHON_FLAGS = ("-I", "-S")
EXECD_COMMAND = ["python3", *EXECD_PYTHON_FLAGS, EXECD_PATH, "--listen", f"0.0.0.0:{EXECD_PORT}"]
GUARD_CAPS = ("NET_ADMIN", "NET_RAW")  # netguard's only capabilities; dropped in the sandbox
# containerd and CRI-O grant NET_RAW to every container by default; with it an AF_PACKET socket
# sends frames past every iptables rule (tests/netguard/test_net_raw.py shows it), so every
# container but the guard must drop it.
NET_RAW = "NET_RAW"
# The guard runs its file, not `-m netguard`, with the same flags as execd: -S spares every
# guarded start site's and runpy's imports (~4 ms of CPU under the pod's quota), -I keeps
# PYTHON* variables out of a root process with NET_ADMIN (netguard/__main__.py).
NETGUARD_COMMAND = ["python3", *EXECD_PYTHON_FLAGS, NETGUARD_PATH, "apply"]
# Guards an earlier release rendered, still running in pods created before an upgrade: on an
# UPDATE (the guard cannot change after create) they applied what their args say.
EARLIER_NETGUARD_COMMANDS = (["python3", "-m", "netguard", "apply"],)
# execd's command is owned by the mutation: only the interpreter may be the image's own python3
# (python3, python3.11, /usr/bin/python3.8); the rest is exactly EXECD_COMMAND[1:], so token
# flags (--token-sha256, --insecure-no-token) can never be chosen by the pod's author.
_PYTHON3 = re.compile(r"(/[A-Za-z0-9._+-]+)*/?python3(\.[0-9]+)?")
# Volume sources a sandbox (or an egress-deny pod) may use: an allowlist, so a source added to
# Kubernetes later is refused until someone decides. None of them reaches the node's filesystem
# or devices: hostPath is the obvious escape (`/`, the containerd socket), and inline csi, nfs,
# iscsi, image, ... are refused because nobody has checked what they expose. PVCs (and generic
# ephemeral volumes, which are PVCs) are admitted: a namespace's user cannot create the
# PersistentVolume behind them (cluster-scoped, the admin's storage classes decide).
VOLUME_TYPES = ("emptyDir", "configMap", "secret", "downwardAPI", "projected",
                "persistentVolumeClaim", "ephemeral")
PROJECTED_SOURCES = ("configMap", "secret", "downwardAPI", "clusterTrustBundle",
                     "serviceAccountToken")  # the token: refused by its own rule in sandboxes
# Legacy annotations the runtime still honours on some versions (AppArmor until 1.30+).
SECCOMP_POD_ANNOTATION = "seccomp.security.alpha.kubernetes.io/pod"
SECCOMP_CONTAINER_PREFIX = "container.seccomp.security.alpha.kubernetes.io/"
APPARMOR_CONTAINER_PREFIX = "container.apparmor.security.beta.kubernetes.io/"
# Pod Security Standards baseline, as k8s.io/pod-security-admission v0.36 checks it
# (policy/check_*.go); docs/webhook.md has the table, control by control.
BASELINE_SELINUX_TYPES = ("container_t", "container_init_t", "container_kvm_t",
                          "container_engine_t")  # or unset; user and role must stay unset
BASELINE_SYSCTLS = ("kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
                    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range",
                    "net.ipv4.ip_unprivileged_port_start", "net.ipv4.ip_local_reserved_ports",
                    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout",
                    "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes",
                    "net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem")
APPARMOR_TYPES = ("RuntimeDefault", "Localhost")  # securityContext.appArmorProfile.type
APPARMOR_RUNTIME_DEFAULT = "runtime/default"  # the legacy annotation's values: this,
APPARMOR_LOCALHOST_PREFIX = "localhost/"  # ...a node-local profile, or empty
CONTAINER_KINDS = ("initContainers", "containers", "ephemeralContainers")
TOKEN_FIELD_PATH = f"metadata.annotations['{ANNOTATION_TOKEN_SHA256}']"
# The service-account admission plugin runs before webhooks and has already added this volume.
SA_TOKEN_VOLUME_PREFIX = "kube-api-access-"
# Resources the injected init containers are sized by (injected_resources says how).
SIZED_RESOURCES = ("cpu", "memory", "ephemeral-storage")
# What a sandbox's containers may request besides the policy's GPU resource: an allow-list, so
# hugepages-*, another vendor's device or any extended resource the chart did not grant is
# refused (a labelled pod must not take a node's scarce devices by asking).
CORE_RESOURCES = ("cpu", "memory", "ephemeral-storage")
GPU_RESOURCE = "nvidia.com/gpu"
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
# Fields the API server defaults on containers: kept when re-mutating, so the patch stays empty.
_API_DEFAULTED = ("terminationMessagePath",)

# The injected init containers' commands. A guarded sandbox's guard also installs execd (one init
# container, one container start and one kubelet relist wait fewer than a guard and an install);
# an unguarded sandbox runs the install alone. execd/install.py says what it writes.
INSTALL_EXECD_ARGS = (NETGUARD_FLAG_INSTALL_EXECD, EXECD_DIR)


def _shortest_abbreviation(flag: str, others) -> str:
    return next(flag[:n] for n in range(3, len(flag) + 1)
                if not any(o.startswith(flag[:n]) for o in others if o != flag))


# The shortest prefix netguard's parser expands to --install-execd (argparse takes any unique
# abbreviation, and =DIR spellings): what makes a guard an installing one for installs_execd
# (tests/webhook/test_merged_init.py keeps it true of the parser).
INSTALL_FLAG_PREFIX = _shortest_abbreviation(NETGUARD_FLAG_INSTALL_EXECD,
                                             [*NETGUARD_APPLY_OPTIONS, "--help"])
EXECD_INSTALL_COMMAND = ["python3", "-m", "execd.install", EXECD_DIR]


@dataclass(frozen=True)
class SandboxPolicy:
    """The cluster-wide settings the mutation and the checks share (webhook flags)."""

    image: str = SANDMAN_IMAGE
    # The paper's reference sandbox (and the managed service's only size): 2 vCPU, 8 GiB,
    # the controller API's default size too (sandman/api.py).
    default_cpu: str = DEFAULT_CPU
    default_memory: str = DEFAULT_MEMORY
    guard: str = GUARD_ALWAYS
    # Who may reach execd's port when the pod does not say (annotation). The token authenticates;
    # this narrows who can connect. Production sets the trainers' pod CIDR.
    ingress_from: tuple[str, ...] = ("0.0.0.0/0",)
    # Controller only (the webhook leaves it None): the pod IP of the controller replica that
    # builds the pod. Its execd readiness check dials from there, and only ever on pods its own
    # process built (a new leader deletes the old one's unleased pods and never checks leased
    # ones), so each pod it builds admits exactly that address besides the ingress sources and
    # the node, through the pod's ingress-from annotation, which the webhook reads too.
    controller_ip: str | None = None
    # Secret volumes, projected secret sources and env from Secrets are refused in sandboxes
    # unless this is set: a Secret of type kubernetes.io/service-account-token (which anyone who
    # may create Secrets can still make; the token controller fills it) cannot be told apart from
    # any other Secret without reading it, and the webhook holds no right to read Secrets.
    allow_secrets: bool = False
    # GPUs (chart sandbox.gpu): at most `gpu_max` of `gpu_resource` per sandbox, in its
    # containers' limits (0: none). `gpu_tolerations` ("key[=value][:Effect]") reach the GPU
    # nodes' taints: GPU sandboxes get them, and no other sandbox may tolerate those keys.
    gpu_resource: str = GPU_RESOURCE
    gpu_max: int = 0
    gpu_tolerations: tuple[str, ...] = ()
    # Egress allowlists (the sandman.dev/egress-allow annotation; chart sandbox.egressCeiling
    # and sandbox.egressNever): every entry within the ceiling (empty: no allowlist at all),
    # none inside a never range. The never CIDRs also go to netguard (--never-egress).
    egress_ceiling: tuple[str, ...] = ()
    egress_never: tuple[str, ...] = ()
    # The API server's addresses, the webhook's own KUBERNETES_SERVICE_HOST first (netguard
    # carves that one out itself), then its endpoints. None: not judged here (the controller,
    # which checks the ceiling before it creates; the webhook judges its pods again). (): the
    # webhook could not tell, and refuses every allowlist.
    api_server: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*"
                            r"[A-Za-z0-9])?", self.gpu_resource):
            raise ValueError(f"gpu_resource must be an extended resource name such as "
                             f"{GPU_RESOURCE}, not {self.gpu_resource!r}")
        if not 0 <= self.gpu_max <= 64:
            raise ValueError(f"gpu_max must be 0 to 64, not {self.gpu_max}")
        for t in self.gpu_tolerations:
            toleration(t)
        if self.guard not in GUARD_MODES:
            raise ValueError(f"guard must be one of {GUARD_MODES}, not {self.guard!r}")
        parse_quantity(self.default_cpu)
        parse_quantity(self.default_memory)
        for cidr in self.ingress_from:
            ipaddress.ip_network(cidr, strict=False)
        if self.controller_ip is not None:
            ipaddress.ip_address(self.controller_ip)  # one address, never a network
        egress_entries.Ceiling.parse(self.egress_ceiling)
        egress_entries.parse_never(self.egress_never)
        for a in self.api_server or ():
            ipaddress.ip_address(a)


@dataclass(frozen=True)
class Refusal:
    """One broken rule. `rule` is from RULES (a bounded metric label); `container` may be ''."""

    rule: str
    container: str
    detail: str

    def message(self) -> str:
        where = f"container {self.container}: " if self.container else ""
        return f"sandman {self.rule}: {where}{self.detail}"


RULES = (
    "sandbox-container-missing",
    "ingress-from-invalid",
    "resources-unequal",
    "service-links",
    "service-account-token",
    "egress-label-invalid",
    "guard-missing",
    "guard-misconfigured",
    "host-namespace",
    "privileged",
    "net-admin-added",
    "token-hash",
    "not-mutated",
    "capability-added",
    "net-raw-not-dropped",
    "volume-type",
    "secret-refused",
    "unconfined",
    "execd-command",
    "sandman-mount",
    "guard-immutable",
    "host-port",
    "selinux",
    "sysctl",
    "sandbox-label",
    "metadata-immutable",
    "extended-resource",
    "gpu-refused",
    "gpu-toleration",
    "egress-allow-invalid",
    "egress-allow-refused",
)


# Besides `spec`, the only parts of a pod that make_sandbox and check_sandbox read. The webhook
# caches their results by these (bursts of identical pods), so anything else they start reading
# must be added here; tests/webhook/test_podspec.py checks that nothing else changes a result.
INPUT_LABELS = (LABEL_SANDBOX, LABEL_EGRESS)
INPUT_ANNOTATIONS = (ANNOTATION_CONTAINER, ANNOTATION_INGRESS_FROM, ANNOTATION_TOKEN_SHA256,
                     SECCOMP_POD_ANNOTATION, ANNOTATION_EGRESS_ALLOW)
# ...and every annotation whose name starts with one of these (per-container legacy profiles).
INPUT_ANNOTATION_PREFIXES = (SECCOMP_CONTAINER_PREFIX, APPARMOR_CONTAINER_PREFIX)


def is_input_annotation(key: str) -> bool:
    return key in INPUT_ANNOTATIONS or key.startswith(INPUT_ANNOTATION_PREFIXES)


class SandboxError(ValueError):
    """The pod cannot be made a sandbox; carries the refusal."""

    def __init__(self, refusal: Refusal):
        super().__init__(refusal.message())
        self.refusal = refusal


def toleration(text: str) -> dict:
    """"key[=value][:Effect]" as a toleration (Exists without a value, Equal with one)."""
    rest, _, effect = text.partition(":")
    key, eq, value = rest.partition("=")
    if not key or (effect and effect not in TAINT_EFFECTS) or (eq and not value):
        raise ValueError(f"toleration {text!r} is not key[=value][:Effect] (effect one of "
                         f"{', '.join(TAINT_EFFECTS)})")
    out = {"key": key, "operator": "Equal" if eq else "Exists"}
    if eq:
        out["value"] = value
    if effect:
        out["effect"] = effect
    return out


def gpu_tolerations(policy: SandboxPolicy) -> list[dict]:
    return [toleration(t) for t in policy.gpu_tolerations]


def gpu_args(p) -> None:
    """The GPU flags the controller and the webhook share (chart sandbox.gpu)."""
    p.add_argument("--gpu-max", type=int, default=0,
                   help="GPUs a sandbox may ask for (0: none, every GPU request is refused)")
    p.add_argument("--gpu-resource", default=GPU_RESOURCE,
                   help="the extended resource GPUs are counted in")
    p.add_argument("--gpu-toleration", action="append", default=None,
                   metavar="KEY[=VALUE][:EFFECT]",
                   help="a toleration of the GPU nodes' taint (repeatable): GPU sandboxes get "
                        "it, no other sandbox may tolerate its key")


def gpu_policy(args) -> dict:
    return {"gpu_max": args.gpu_max, "gpu_resource": args.gpu_resource,
            "gpu_tolerations": tuple(args.gpu_toleration or ())}


def _same_quantity(a, b) -> bool:
    try:
        return parse_quantity(a) == parse_quantity(b)
    except ValueError:
        return False


# --- helpers ---------------------------------------------------------------------------------

def is_sandbox(pod: dict) -> bool:
    """Labelled a sandbox: what the mutation, the NetworkPolicies and the controller select."""
    return _labels(pod).get(LABEL_SANDBOX) == SANDBOX_TRUE


def carries(pod: dict, name: str) -> bool:
    """The pod has an init container of sandman's name `name` (init containers never change
    after create, so an UPDATE's old and new pod agree)."""
    inits = (pod.get("spec") or {}).get("initContainers") or []
    return any(isinstance(c, dict) and c.get("name") == name for c in inits)


def installs_execd(pod: dict) -> bool:
    """The pod carries what only the mutation of a sandbox adds: the install init container, or
    a guard with --install-execd in any spelling netguard's parser takes (INSTALL_FLAG_PREFIX).
    Init containers never change after create, so an UPDATE's old and new pod agree."""
    inits = (pod.get("spec") or {}).get("initContainers") or []
    return carries(pod, EXECD_INSTALL_CONTAINER) or any(
        isinstance(c, dict) and c.get("name") == NETGUARD_CONTAINER
        and any(str(a).startswith(INSTALL_FLAG_PREFIX) for a in c.get("args") or [])
        for c in inits)


def judged_sandbox(pod: dict) -> bool:
    """Judged as a sandbox: labelled one, or carrying what only the mutation of a sandbox adds
    (installs_execd), whatever its labels say now."""
    return is_sandbox(pod) or installs_execd(pod)


def is_judged(pod: dict) -> bool:
    """In the validating webhook's scope: sandman's labels, or sandman's init containers."""
    return (judged_sandbox(pod) or LABEL_EGRESS in _labels(pod)
            or carries(pod, NETGUARD_CONTAINER))


def _dict_at(obj: dict, key: str) -> dict:
    """obj[key] when it is an object, else {} (a hostile pod may put anything there)."""
    value = obj.get(key)
    return value if isinstance(value, dict) else {}


def _labels(pod: dict) -> dict:
    return (pod.get("metadata") or {}).get("labels") or {}


def _annotations(pod: dict) -> dict:
    return (pod.get("metadata") or {}).get("annotations") or {}


def _cap(name: str) -> str:
    name = str(name).upper()
    return name[4:] if name.startswith("CAP_") else name


def guard_required(pod: dict, policy: SandboxPolicy) -> bool:
    if _labels(pod).get(LABEL_EGRESS) == EGRESS_DENY:
        return True
    return is_sandbox(pod) and policy.guard == GUARD_ALWAYS


def sandbox_container_index(pod: dict) -> int:
    """Index in spec.containers of the container that runs execd."""
    containers = (pod.get("spec") or {}).get("containers") or []
    wanted = _annotations(pod).get(ANNOTATION_CONTAINER)
    if wanted is None:
        if containers:
            return 0
        raise SandboxError(Refusal("sandbox-container-missing", "", "the pod has no containers"))
    for i, c in enumerate(containers):
        if c.get("name") == wanted:
            return i
    raise SandboxError(Refusal(
        "sandbox-container-missing", wanted,
        f"annotation {ANNOTATION_CONTAINER} names a container the pod does not have"))


def ingress_cidrs(pod: dict, policy: SandboxPolicy) -> list[str]:
    raw = _annotations(pod).get(ANNOTATION_INGRESS_FROM)
    if raw is None:
        return list(policy.ingress_from)
    cidrs = [part.strip() for part in raw.split(",") if part.strip()]
    for cidr in cidrs:
        try:
            ipaddress.ip_network(cidr, strict=False)
        except ValueError:
            raise SandboxError(Refusal(
                "ingress-from-invalid", "",
                f"annotation {ANNOTATION_INGRESS_FROM} has {cidr!r}, not a CIDR")) from None
    if not cidrs:
        raise SandboxError(Refusal(
            "ingress-from-invalid", "", f"annotation {ANNOTATION_INGRESS_FROM} is empty"))
    return cidrs


# The kubelet probes execd's /health from the node: the guard must let the node in, or a
# narrowed --ingress-from (the trainers' CIDR) would leave every sandbox unready. The kubelet
# expands $(VAR) in args from the container's env (downward API status.hostIP). On a bridge
# CNI the probes come from the bridge's address instead, the pod's default gateway, which
# netguard resolves in the pod's netns (--ingress-from-gateway; docs/netguard.md).
NODE_IP_ENV = "SANDMAN_NODE_IP"


def admit_controller(pod: dict, policy: SandboxPolicy) -> None:
    """With `policy.controller_ip` (the controller building this pod), make sure the pod's
    ingress sources admit that one address: when the annotation or the policy already covers
    it (the default 0.0.0.0/0 does), nothing changes; otherwise the pod gets the ingress-from
    annotation = its sources + the address as a /32 (/128). docs/install.md's narrowed
    `sandbox.ingressFrom` locked the controller's execd check out before this."""
    if not policy.controller_ip:
        return
    ip = ipaddress.ip_address(policy.controller_ip)
    cidrs = ingress_cidrs(pod, policy)
    for cidr in cidrs:
        net = ipaddress.ip_network(cidr, strict=False)
        if net.version == ip.version and ip in net:  # `in` alone ignores the version
            return
    meta = pod.setdefault("metadata", {})
    annotations = meta.get("annotations")
    if not isinstance(annotations, dict):
        annotations = meta["annotations"] = {}
    annotations[ANNOTATION_INGRESS_FROM] = ",".join([*cidrs, f"{ip}/{ip.max_prefixlen}"])


def egress_allow(pod: dict, policy: SandboxPolicy) -> list[str]:
    """The pod's allowlist entries (annotation ANNOTATION_EGRESS_ALLOW), [] without one;
    SandboxError when the annotation is not sandman/egress.py's canonical text, the pod is not
    egress=deny, or an entry is outside the ceiling or inside a never range."""
    raw = _annotations(pod).get(ANNOTATION_EGRESS_ALLOW)
    if raw is None:
        return []
    where = f"annotation {ANNOTATION_EGRESS_ALLOW}"
    if _labels(pod).get(LABEL_EGRESS) != EGRESS_DENY:
        raise SandboxError(Refusal("egress-allow-invalid", "", f"{where} needs label "
                                   f"{LABEL_EGRESS}={EGRESS_DENY} (without it egress is open "
                                   "and the list would promise nothing)"))
    if not isinstance(raw, str):
        raise SandboxError(Refusal("egress-allow-invalid", "", f"{where} must be a string"))
    try:
        entries = egress_entries.parse_list(raw)
    except ValueError as e:
        raise SandboxError(Refusal("egress-allow-invalid", "", f"{where}: {e}")) from None
    canonical = egress_entries.render(entries)
    if not entries or canonical != raw:
        # One spelling only: the policy's CEL compares the guard's args with the text as it is.
        raise SandboxError(Refusal("egress-allow-invalid", "", f"{where} must be written "
                                   f"canonically ({canonical!r}), not {raw[:200]!r}"))
    why = egress_refusals(entries, policy)
    if why:
        raise SandboxError(Refusal("egress-allow-refused", "", "; ".join(why)))
    if any(e.kind == egress_entries.SVC for e in entries) and not _cluster_dns_only(pod):
        # netguard resolves svc/ entries inside the pod: /etc/hosts (hostAliases) and the
        # resolver the pod names (dnsConfig, dnsPolicy) would let its author pick the address.
        raise SandboxError(Refusal("egress-allow-refused", "", f"{where} has svc/ entries, "
                                   "which netguard resolves through the cluster's DNS: the pod "
                                   "must set no hostAliases, no dnsConfig and dnsPolicy "
                                   "ClusterFirst (or none)"))
    return [e.text for e in entries]


def _cluster_dns_only(pod: dict) -> bool:
    spec = pod.get("spec") or {}
    return (not spec.get("hostAliases") and spec.get("dnsConfig") is None
            and spec.get("dnsPolicy") in (None, "ClusterFirst"))


def egress_refusals(entries, policy: SandboxPolicy) -> list[str]:
    """One line per entry the cluster does not admit (sandman/egress.py's refusals), plus the
    API server's endpoints: an entry containing one that netguard cannot carve out (only its
    own KUBERNETES_SERVICE_HOST and the never CIDRs) is refused."""
    if policy.api_server is not None and not policy.api_server:
        return ["egress allowlists are refused: the webhook cannot tell the API server's "
                "address (KUBERNETES_SERVICE_HOST is not set in its environment)"]
    api = [ipaddress.ip_network(a) for a in policy.api_server or ()]
    never = egress_entries.parse_never(policy.egress_never)
    out = egress_entries.refusals(entries, egress_entries.Ceiling.parse(policy.egress_ceiling),
                                  never=never + tuple(api))
    if out:
        return out
    carved = egress_entries.never_ranges(never + tuple(api[:1]))
    for e in entries:
        for a in api[1:]:
            if e.network is not None and a.version == e.network.version and \
                    a.subnet_of(e.network) and not any(  # type: ignore[arg-type]
                        n.version == a.version and a.subnet_of(n)  # type: ignore[arg-type]
                        for n in carved):
                out.append(f"egress entry {e.text!r} contains the API server's endpoint "
                           f"{a.network_address}, which only sandbox.egressNever can carve out")
    return out


def netguard_args(pod: dict, policy: SandboxPolicy) -> list[str]:
    egress = EGRESS_DENY if _labels(pod).get(LABEL_EGRESS) == EGRESS_DENY else EGRESS_ALLOW
    args = [NETGUARD_FLAG_EGRESS, egress, NETGUARD_FLAG_INGRESS_PORT, str(EXECD_PORT)]
    for cidr in ingress_cidrs(pod, policy):
        args += [NETGUARD_FLAG_INGRESS_FROM, cidr]
    allow = egress_allow(pod, policy)
    for entry in allow:
        args += [NETGUARD_FLAG_ALLOW_EGRESS, entry]
    for cidr in policy.egress_never if allow else ():
        args += [NETGUARD_FLAG_NEVER_EGRESS, cidr]
    return args + list(GUARD_ARGS_TAIL)


# The end of every guard's args: the node's own address and the pod's gateway (the kubelet's
# probes come from one of them). webhook/policy.py's CEL renders the same tail.
GUARD_ARGS_TAIL = (NETGUARD_FLAG_INGRESS_FROM, f"$({NODE_IP_ENV})", NETGUARD_FLAG_INGRESS_FROM_GATEWAY)


def injected_resources(pod: dict, policy: SandboxPolicy | None = None) -> dict:
    """What each injected init container requests and limits: per resource, the sum over the
    pod's containers of their requests (a container's limit when it sets no request, as the API
    server defaults it), requests == limits. A pod's effective request is the larger of its
    biggest init container and the sum of its containers, so this never raises it, keeps a
    Guaranteed pod Guaranteed, and hands the init containers, which run before any container,
    the whole pod's CPU and memory instead of a slice of it. A resource no container sets stays
    unset (any value would raise the request of a pod that has none; make_sandbox has already
    given every sandbox container its size). With `policy` (a sandbox), the containers count
    as make_sandbox sizes them, so a container's unequal resources are its own refusal only."""
    containers = (pod.get("spec") or {}).get("containers") or []
    if policy is not None:
        containers = [copy.deepcopy(c) for c in containers if isinstance(c, dict)]
        for c in containers:
            _equalize_resources(c, policy)
    sized = {}
    for name in SIZED_RESOURCES:
        total, declared = Decimal(0), False
        for c in containers:
            res = (c.get("resources") or {}) if isinstance(c, dict) else {}
            value = (res.get("requests") or {}).get(name)
            if value is None:
                value = (res.get("limits") or {}).get(name)
            if value is None:
                continue
            try:
                total += parse_quantity(value)
            except ValueError:
                continue  # the API server refuses the pod with its own message
            declared = True
        if declared:
            sized[name] = format_quantity(total, binary=name != "cpu")
    if not sized:
        return {}
    return {"requests": dict(sized), "limits": dict(sized)}


def _guard_security_context() -> dict:
    return {
        "capabilities": {"add": list(GUARD_CAPS), "drop": ["ALL"]},
        "privileged": False,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        # iptables needs uid 0 with the two capabilities, whatever the pod's default user.
        "runAsUser": 0,
        "runAsNonRoot": False,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def netguard_container(pod: dict, policy: SandboxPolicy) -> dict:
    """The guard as sandman renders it for `pod`. A sandbox's guard installs execd too, so it
    mounts the whole sandman volume; any other guarded pod's guard sees only run/, where it
    writes its status. A pod judged a sandbox by its own installing guard (judged_sandbox) gets
    that guard: what refuses it without the label is the label's own rule."""
    sandbox = judged_sandbox(pod)
    mount = ({"name": SANDMAN_VOLUME, "mountPath": EXECD_DIR} if sandbox else
             {"name": SANDMAN_VOLUME, "mountPath": RUN_DIR, "subPath": "run"})
    return {
        "name": NETGUARD_CONTAINER,
        "image": policy.image,
        "imagePullPolicy": "IfNotPresent",
        "command": list(NETGUARD_COMMAND),
        "args": netguard_args(pod, policy) + (list(INSTALL_EXECD_ARGS) if sandbox else []),
        "env": [{"name": NODE_IP_ENV,
                 "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.hostIP"}}}],
        "resources": injected_resources(pod, policy if judged_sandbox(pod) else None),
        "securityContext": _guard_security_context(),
        "volumeMounts": [mount],
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def execd_install_container(pod: dict, policy: SandboxPolicy) -> dict:
    return {
        "name": EXECD_INSTALL_CONTAINER,
        "image": policy.image,
        "imagePullPolicy": "IfNotPresent",
        "command": list(EXECD_INSTALL_COMMAND),
        "resources": injected_resources(pod, policy),
        "securityContext": {
            "capabilities": {"drop": ["ALL"]},
            "privileged": False,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumeMounts": [{"name": SANDMAN_VOLUME, "mountPath": EXECD_DIR}],
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def _keep_defaulted(wanted: dict, existing: dict | None) -> dict:
    for key in _API_DEFAULTED:
        if existing and key in existing and key not in wanted:
            wanted[key] = existing[key]
    # Equal quantities spelled differently (the API server's canonical form) are kept.
    if existing and _same_resources(existing.get("resources"), wanted.get("resources")):
        wanted["resources"] = existing["resources"]
    return wanted


def _is_sa_token_volume(volume: dict) -> bool:
    sources = (volume.get("projected") or {}).get("sources") or []
    return any("serviceAccountToken" in s for s in sources)


def _all_containers(spec: dict) -> list[dict]:
    return list(spec.get("initContainers") or []) + list(spec.get("containers") or [])


# --- the mutation ----------------------------------------------------------------------------

def make_sandbox(pod: dict, policy: SandboxPolicy) -> dict:
    """Return a deep copy of `pod` made into a correct sandbox. Idempotent.

    Raises SandboxError when the pod cannot be one (no such sandbox container, bad CIDRs).
    """
    out = copy.deepcopy(pod)
    spec = out.setdefault("spec", {})
    index = sandbox_container_index(out)
    admit_controller(out, policy)
    # The containers' sizes first: the injected init containers are sized by them.
    for c in spec["containers"]:
        _equalize_resources(c, policy)
    guard = netguard_container(out, policy) if guard_required(out, policy) else None

    spec["enableServiceLinks"] = False
    spec["automountServiceAccountToken"] = False
    _drop_injected_sa_token(spec)
    _ensure_volume(spec)
    _ensure_init_containers(out, guard, policy)

    for c in spec.get("initContainers") or []:
        if c.get("name") not in (NETGUARD_CONTAINER, EXECD_INSTALL_CONTAINER):
            _sandman_volume_read_only(c)
            _drop_net_raw(c)
    for i, c in enumerate(spec["containers"]):
        _sandman_volume_read_only(c)
        if i != index:
            _drop_net_raw(c)
    _make_sandbox_container(spec["containers"][index], spec)

    for c in _all_containers(spec):
        _equalize_resources(c, policy)
    if isinstance(spec.get("resources"), dict):  # pod-level resources (Kubernetes >= 1.32)
        _equalize_resources(spec, None)
    return out


def guarded_pod(pod: dict, policy: SandboxPolicy) -> dict:
    """An egress-deny pod WITHOUT the sandbox label as the validating webhook admits it (such
    pods are never mutated): sandman's guard at initContainers[0], the `sandman` volume it writes
    its status to, NET_RAW dropped in every other init container and container. What
    `python3 -m webhook guard` prints for their authors; the other rules (no added
    capabilities, no hostPath, ...) stay the author's to meet."""
    out = copy.deepcopy(pod)
    labels = out.setdefault("metadata", {}).setdefault("labels", {})
    labels[LABEL_EGRESS] = EGRESS_DENY
    spec = out.setdefault("spec", {})
    inits = [c for c in spec.get("initContainers") or [] if c.get("name") != NETGUARD_CONTAINER]
    for c in inits + list(spec.get("containers") or []):
        _drop_net_raw(c)
    spec["initContainers"] = [netguard_container(out, policy)] + inits
    if not any(v.get("name") == SANDMAN_VOLUME for v in spec.get("volumes") or []):
        spec.setdefault("volumes", []).append({"name": SANDMAN_VOLUME, "emptyDir": {}})
    return out


def injected_token_volumes(spec: dict) -> list[str]:
    """Names of the token volumes the service-account plugin added (make_sandbox removes them
    and every mount of them)."""
    return [v["name"] for v in spec.get("volumes") or []
            if isinstance(v, dict) and str(v.get("name", "")).startswith(SA_TOKEN_VOLUME_PREFIX)
            and _is_sa_token_volume(v)]


def _drop_injected_sa_token(spec: dict) -> None:
    volumes = spec.get("volumes") or []
    gone = set(injected_token_volumes(spec))
    if not gone:
        return
    spec["volumes"] = [v for v in volumes if v.get("name") not in gone]
    for c in _all_containers(spec):
        if "volumeMounts" in c:
            c["volumeMounts"] = [m for m in c["volumeMounts"] if m.get("name") not in gone]


def _ensure_volume(spec: dict) -> None:
    volumes = spec.setdefault("volumes", [])
    for i, v in enumerate(volumes):
        if v.get("name") == SANDMAN_VOLUME:
            if set(v) != {"name", "emptyDir"}:
                volumes[i] = {"name": SANDMAN_VOLUME, "emptyDir": {}}
            return
    volumes.append({"name": SANDMAN_VOLUME, "emptyDir": {}})


def _ensure_init_containers(pod: dict, guard: dict | None, policy: SandboxPolicy) -> None:
    spec = pod["spec"]
    inits = spec.get("initContainers") or []
    existing = {c.get("name"): c for c in inits}
    others = [c for c in inits if c.get("name") not in (NETGUARD_CONTAINER, EXECD_INSTALL_CONTAINER)]
    if guard is not None:  # a sandbox's guard installs execd itself
        ours = [_keep_defaulted(guard, existing.get(NETGUARD_CONTAINER))]
    else:
        ours = [_keep_defaulted(execd_install_container(pod, policy),
                                existing.get(EXECD_INSTALL_CONTAINER))]
    spec["initContainers"] = ours + others


def _sandman_volume_read_only(c: dict) -> None:
    for m in c.get("volumeMounts") or []:
        if m.get("name") == SANDMAN_VOLUME and m.get("readOnly") is not True:
            m["readOnly"] = True


def normalize_path(path) -> str:
    """One spelling per path: `//sandman`, `/sandman/`, `/./sandman`, `/x/../sandman` and
    `sandman` are all `/sandman` (posixpath.normpath alone keeps a leading `//`)."""
    return posixpath.normpath("/" + str(path).lstrip("/"))


def _under_execd_dir(path: str) -> bool:
    path = normalize_path(path)
    return path == EXECD_DIR or path.startswith(EXECD_DIR + "/")


def execd_argv_ok(c: dict) -> bool:
    """The container runs exactly `<python3> -I -S /sandman/execd.py --listen 0.0.0.0:9470`."""
    argv = list(c.get("command") or []) + list(c.get("args") or [])
    return (len(argv) == len(EXECD_COMMAND) and argv[1:] == EXECD_COMMAND[1:]
            and isinstance(argv[0], str) and _PYTHON3.fullmatch(argv[0]) is not None)


def _drop_net_raw(c: dict) -> None:
    sc = c.get("securityContext") or {}
    caps = sc.get("capabilities") or {}
    drop = list(caps.get("drop") or [])
    if {_cap(d) for d in drop} & {NET_RAW, "ALL"}:
        return
    caps["drop"] = drop + [NET_RAW]
    sc["capabilities"] = caps
    c["securityContext"] = sc


def _make_sandbox_container(c: dict, spec: dict) -> None:
    if not execd_argv_ok(c):
        # The author's choice of interpreter (python3.8, /usr/bin/python3) is kept; the rest is
        # sandman's.
        argv = list(c.get("command") or []) + list(c.get("args") or [])
        python = argv[0] if argv and isinstance(argv[0], str) and _PYTHON3.fullmatch(
            argv[0]) else EXECD_COMMAND[0]
        c["command"] = [python, *EXECD_COMMAND[1:]]
        c.pop("args", None)

    # execd.py and netguard's status come only from the sandman volume, read-only.
    mounts = c.get("volumeMounts") or []
    kept, have = [], False
    for m in mounts:
        ours = (m.get("name") == SANDMAN_VOLUME and m.get("mountPath") == EXECD_DIR
                and m.get("readOnly") is True and not m.get("subPath") and not m.get("subPathExpr"))
        if ours and not have:
            kept.append(m)
            have = True
        elif m.get("name") != SANDMAN_VOLUME and not _under_execd_dir(m.get("mountPath", "")):
            kept.append(m)
    if not have:
        kept.append({"name": SANDMAN_VOLUME, "mountPath": EXECD_DIR, "readOnly": True})
    if kept != mounts:
        c["volumeMounts"] = kept

    env = c.get("env") or []
    token = [e for e in env if e.get("name") == EXECD_TOKEN_ENV]
    good = (len(token) == 1 and "value" not in token[0]
            and ((token[0].get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
            == TOKEN_FIELD_PATH)
    if not good:
        c["env"] = [e for e in env if e.get("name") != EXECD_TOKEN_ENV] + [{
            "name": EXECD_TOKEN_ENV,
            "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": TOKEN_FIELD_PATH}},
        }]

    probe = c.get("readinessProbe") or {}
    http = probe.get("httpGet") or {}
    if not (http.get("path") == EXECD_READY_PATH and http.get("port") in (EXECD_PORT, "execd")):
        # Readiness is on a plain client's path to a sandbox (the controller asks execd itself);
        # /ready (not /health) forks and writes a file, so a wedged pod (pids exhausted, disk
        # full) goes NotReady. No startupProbe: there is no liveness probe for it to hold off,
        # and readiness would only start a period after it succeeded.
        c["readinessProbe"] = {
            "httpGet": {"path": EXECD_READY_PATH, "port": EXECD_PORT},
            # The API's minimum: a refused first probe (sent as the container starts, possibly
            # before the launcher listens) costs at most this until the next one.
            "periodSeconds": 1,
            # /ready answers within 2 s; a probe the launcher's socket holds also waits out
            # execd's start.
            "timeoutSeconds": 3,
            # One slow answer on a busy node does not take a held sandbox out of Ready; 3 s of
            # failures does.
            "failureThreshold": 3,
        }

    ports = c.get("ports") or []
    if not any(p.get("containerPort") == EXECD_PORT for p in ports):
        port = {"containerPort": EXECD_PORT, "protocol": "TCP"}
        if not any(p.get("name") == "execd" for p in ports):
            port = {"name": "execd", **port}
        c["ports"] = ports + [port]

    sc = c.get("securityContext") or {}
    caps = sc.get("capabilities") or {}
    drop = list(caps.get("drop") or [])
    dropped = {_cap(d) for d in drop}
    missing = [cap for cap in GUARD_CAPS if cap not in dropped and "ALL" not in dropped]
    if missing:
        caps["drop"] = drop + missing
        sc["capabilities"] = caps
    pod_seccomp = (spec.get("securityContext") or {}).get("seccompProfile")
    if not pod_seccomp and not sc.get("seccompProfile"):
        sc["seccompProfile"] = {"type": "RuntimeDefault"}
    if sc and sc != c.get("securityContext"):
        c["securityContext"] = sc


def _equalize_resources(c: dict, policy: SandboxPolicy | None) -> None:
    """requests == limits for cpu, memory and ephemeral-storage: copy the side that is set, else
    the default size (ephemeral-storage has none: unset stays unset);
    when both are set and differ, both take the larger (a limit is never lowered). Without a
    policy (pod-level resources) a resource neither side sets stays unset."""
    res = c.get("resources") or {}
    requests = dict(res.get("requests") or {})
    limits = dict(res.get("limits") or {})
    defaults = ((("cpu", policy.default_cpu), ("memory", policy.default_memory),
                 ("ephemeral-storage", None)) if policy else (("cpu", None), ("memory", None)))
    for name, default in defaults:
        req, lim = requests.get(name), limits.get(name)
        value: Any  # a quantity as the pod spells it (the pod's own JSON: any type)
        if req is None and lim is None:
            if default is None:
                continue
            value = default
        elif req is None:
            value = lim
        elif lim is None:
            value = req
        else:
            try:
                value = lim if parse_quantity(lim) >= parse_quantity(req) else req
            except ValueError:
                value = lim  # the API server rejects the malformed one with its own message
        if req is None or not _same_quantity(req, value):
            requests[name] = value
        if lim is None or not _same_quantity(lim, value):
            limits[name] = value
    if requests != (res.get("requests") or {}) or limits != (res.get("limits") or {}):
        c["resources"] = {**res, "requests": requests, "limits": limits}


# --- the checks ------------------------------------------------------------------------------
#
# An allowlist: every container of every kind (containers, initContainers including sidecars
# with restartPolicy Always, ephemeralContainers) is judged, and what is not known to be safe is
# refused. docs/webhook.md lists each rule with its reason and the invariants they keep.

def _every_container(spec: dict):
    for kind in CONTAINER_KINDS:
        for i, c in enumerate(spec.get(kind) or []):
            if isinstance(c, dict):
                yield kind, i, c


def _is_guard_slot(kind: str, i: int, c: dict, guarded: bool) -> bool:
    return guarded and kind == "initContainers" and i == 0 and c.get("name") == NETGUARD_CONTAINER


def _is_injected(kind: str, c: dict) -> bool:
    return kind == "initContainers" and c.get("name") in (NETGUARD_CONTAINER,
                                                           EXECD_INSTALL_CONTAINER)


def _sandbox_container_name(pod: dict) -> str | None:
    try:
        return ((pod.get("spec") or {}).get("containers") or [])[
            sandbox_container_index(pod)].get("name")
    except SandboxError:
        return None  # make_sandbox reports it


def check_sandbox(pod: dict, policy: SandboxPolicy) -> list[Refusal]:
    """Everything that makes the final pod object not a correct sandbox (empty: admit).

    Applies to pods labelled as sandboxes and to any pod carrying the egress label; an
    egress-deny pod without the sandbox label is not mutated, so it must carry the guard and
    the pod-level rules itself (the refusals say what to add). Each refusal once: the guard's
    check and the mutation meet the same bad annotation."""
    return _unique(_check_sandbox(pod, policy))


def _check_sandbox(pod: dict, policy: SandboxPolicy) -> list[Refusal]:
    labels = _labels(pod)
    sandbox = judged_sandbox(pod)
    egress = labels.get(LABEL_EGRESS)
    spec = pod.get("spec") or {}
    out: list[Refusal] = []

    if sandbox and not installs_execd(pod):
        out.append(Refusal("not-mutated", "", "sandman's mutating webhook did not run on this "
                           "pod (is its configuration missing?); what is wrong follows"))
    if sandbox and not is_sandbox(pod):
        out.append(Refusal("sandbox-label", "", f"the pod carries sandman's execd install "
                           f"({EXECD_INSTALL_CONTAINER}, or netguard's {INSTALL_EXECD_ARGS[0]}) "
                           f"but is not labelled {LABEL_SANDBOX}="
                           f"{SANDBOX_TRUE}: the label is what the sandbox NetworkPolicies, the "
                           "controller and the webhook select on"))
    if egress is not None and egress not in (EGRESS_DENY, EGRESS_ALLOW):
        out.append(Refusal("egress-label-invalid", "",
                           f"label {LABEL_EGRESS}={egress!r} is neither {EGRESS_DENY!r} nor "
                           f"{EGRESS_ALLOW!r}; a mistyped deny would leave egress open"))
    # A pod carrying sandman's guard is judged as guarded, whatever its labels say.
    guarded = (egress == EGRESS_DENY or (sandbox and policy.guard == GUARD_ALWAYS)
               or carries(pod, NETGUARD_CONTAINER))
    if guarded:
        out.extend(_check_guard(pod, policy))  # the allowlist's checks come with the args
    elif ANNOTATION_EGRESS_ALLOW in _annotations(pod):
        try:
            egress_allow(pod, policy)
        except SandboxError as e:
            out.append(e.refusal)
    if not (sandbox or guarded):
        return out  # egress=allow without the sandbox label: nothing is promised

    if sandbox:
        for c in _all_containers(spec):
            out.extend(_check_resources(c))
        out.extend(_resource_rules(pod, policy))
        if isinstance(spec.get("resources"), dict):
            out.extend(_check_resources(spec, pod_level=True))
        if spec.get("enableServiceLinks") is not False:
            out.append(Refusal("service-links", "",
                               "enableServiceLinks must be false (every Service in the namespace "
                               "becomes environment variables in the sandbox)"))
        if spec.get("automountServiceAccountToken") is not False:
            out.append(Refusal("service-account-token", "",
                               "automountServiceAccountToken must be false"))
    out.extend(_pod_rules(pod, policy, sandbox, guarded))
    if not sandbox:
        return out

    token = _annotations(pod).get(ANNOTATION_TOKEN_SHA256)
    if token is None:
        out.append(Refusal("token-hash", "", f"annotation {ANNOTATION_TOKEN_SHA256} is missing"))
    elif not is_token_sha256(token):
        out.append(Refusal("token-hash", "",
                           f"annotation {ANNOTATION_TOKEN_SHA256} must be 64 lowercase hex "
                           f"characters (got {len(token)} characters: {token[:8]}...)"))
    try:
        mutated = make_sandbox(pod, policy)
    except SandboxError as e:
        out.append(e.refusal)
        return out
    c = spec["containers"][sandbox_container_index(pod)]
    if not execd_argv_ok(c):
        argv = " ".join(map(str, list(c.get("command") or []) + list(c.get("args") or [])))
        out.append(Refusal("execd-command", c.get("name", ""),
                           f"runs {argv[:120]!r}; sandman owns execd's command ("
                           f"{' '.join(EXECD_COMMAND)}), so its token flags (and "
                           "--insecure-no-token) cannot be chosen by the pod"))
    if not out and mutated != pod:
        out.append(Refusal("not-mutated", "", "the pod is not what sandman's mutation makes "
                           f"(first difference at {_first_difference(pod, mutated)}); "
                           "is the mutating webhook configuration missing?"))
    return out


def check_update(pod: dict, old, policy: SandboxPolicy) -> list[Refusal]:
    """An UPDATE (labels, annotations, images, `pods/ephemeralcontainers`) judged on the new pod
    itself, never on which refusals the old pod already had: a pod that becomes a sandbox gets
    every create rule; a pod that becomes egress=deny gets the pod-level rules, and any pod
    labelled deny must carry a guard that applied deny; sandman's init containers never change;
    every ephemeral container this update adds is judged like any container. Rules that depend
    on the webhook's settings of the day (the guard's exact args, the image tag) are judged at
    create only, so a policy change does not lock running sandboxes out of label updates."""
    if not isinstance(old, dict):
        return check_sandbox(pod, policy)
    identity = _identity_rules(pod, old)
    if is_sandbox(pod) and not is_sandbox(old):
        return identity + check_sandbox(pod, policy)
    sandbox = judged_sandbox(pod) or judged_sandbox(old)
    labels = _labels(pod)
    egress = labels.get(LABEL_EGRESS)
    deny = egress == EGRESS_DENY
    was_deny = _labels(old).get(LABEL_EGRESS) == EGRESS_DENY
    spec, old_spec = pod.get("spec") or {}, old.get("spec") or {}
    out: list[Refusal] = identity
    if egress is not None and egress not in (EGRESS_DENY, EGRESS_ALLOW):
        out.append(Refusal("egress-label-invalid", "",
                           f"label {LABEL_EGRESS}={egress!r} is neither {EGRESS_DENY!r} nor "
                           f"{EGRESS_ALLOW!r}; a mistyped deny would leave egress open"))

    def injected(s: dict) -> dict:
        return {c.get("name"): c for c in s.get("initContainers") or []
                if _is_injected("initContainers", c)}
    before, after = injected(old_spec), injected(spec)
    for name in (NETGUARD_CONTAINER, EXECD_INSTALL_CONTAINER):
        if before.get(name) != after.get(name):
            out.append(Refusal("guard-immutable", name,
                               "sandman's init containers (image, command, args) cannot change "
                               "after create: a new image is a new, unchecked guard"))
    if deny:
        out.extend(_guard_applied_deny(pod))
        if not was_deny:
            out.extend(_pod_rules(pod, policy, sandbox, True))
    if sandbox or deny or carries(pod, NETGUARD_CONTAINER):
        known = {c.get("name") for c in old_spec.get("ephemeralContainers") or []
                 if isinstance(c, dict)}
        for i, c in enumerate(spec.get("ephemeralContainers") or []):
            if isinstance(c, dict) and c.get("name") not in known:
                out.extend(_container_rules("ephemeralContainers", i, c, policy, sandbox, deny,
                                            False))
        # A legacy profile annotation added now applies to containers added later.
        before = _annotations(old)
        out.extend(profile_annotation_rules({k: v for k, v in _annotations(pod).items()
                                             if before.get(k) != v}))
    if is_sandbox(pod):
        token = _annotations(pod).get(ANNOTATION_TOKEN_SHA256)
        if not is_token_sha256(token):
            out.append(Refusal("token-hash", "", f"annotation {ANNOTATION_TOKEN_SHA256} must "
                               "stay 64 lowercase hex characters"))
    return _unique(out)


def _identity_rules(pod: dict, old: dict) -> list[Refusal]:
    """What makes the webhook, the policy and the sandbox NetworkPolicies judge and select a
    pod never changes after create: the sandbox label, an egress deny, a sandbox's token hash.
    Without this an UPDATE stripping them left the pod's next ephemeral container unjudged."""
    out = []
    why = "; a new pod is needed"
    if is_sandbox(old) and not is_sandbox(pod):
        out.append(Refusal("metadata-immutable", "", f"label {LABEL_SANDBOX}={SANDBOX_TRUE} "
                           f"cannot be removed or changed{why}"))
    if _labels(old).get(LABEL_EGRESS) == EGRESS_DENY and \
            _labels(pod).get(LABEL_EGRESS) != EGRESS_DENY:
        out.append(Refusal("metadata-immutable", "", f"label {LABEL_EGRESS}={EGRESS_DENY} "
                           f"cannot be removed or changed{why}"))
    token = ANNOTATION_TOKEN_SHA256
    if judged_sandbox(old) and (token in _annotations(old), _annotations(old).get(token)) != (
            token in _annotations(pod), _annotations(pod).get(token)):
        out.append(Refusal("metadata-immutable", "", f"annotation {token} cannot change after "
                           f"create (execd reads it when its container starts){why}"))
    allow = ANNOTATION_EGRESS_ALLOW
    if (allow in _annotations(old), _annotations(old).get(allow)) != (
            allow in _annotations(pod), _annotations(pod).get(allow)):
        out.append(Refusal("metadata-immutable", "", f"annotation {allow} cannot change after "
                           f"create (netguard applied the list when the pod started){why}"))
    return out


def _unique(refusals: list[Refusal]) -> list[Refusal]:
    seen, out = set(), []
    for r in refusals:
        if r not in seen:
            seen.add(r)
            out.append(r)
    return out


def _pod_rules(pod: dict, policy: SandboxPolicy, sandbox: bool, guarded: bool) -> list[Refusal]:
    """What no sandbox and no egress-deny pod may have, whichever container kind has it."""
    spec = pod.get("spec") or {}
    out: list[Refusal] = []
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            out.append(Refusal("host-namespace", "", f"{key} must not be set on a sandbox or an "
                               "egress-deny pod"))
    out.extend(_volume_rules(spec, policy, sandbox))
    psc = _dict_at(spec, "securityContext")
    if (psc.get("windowsOptions") or {}).get("hostProcess"):
        out.append(Refusal("privileged", "", "hostProcess pods are not allowed"))
    out.extend(_profile_rules(psc, ""))
    out.extend(_selinux_rules(psc, ""))
    bad = [str(s.get("name")) for s in psc.get("sysctls") or []
           if isinstance(s, dict) and s.get("name") not in BASELINE_SYSCTLS]
    if bad:
        out.append(Refusal("sysctl", "", f"sysctls {', '.join(bad)} are not in Pod Security "
                           f"baseline's safe set ({', '.join(BASELINE_SYSCTLS)})"))
    out.extend(profile_annotation_rules(_annotations(pod)))
    execd_container = _sandbox_container_name(pod) if sandbox else None
    for kind, i, c in _every_container(spec):
        out.extend(_container_rules(kind, i, c, policy, sandbox, guarded,
                                    kind == "containers" and c.get("name") == execd_container))
    return out


def profile_annotation_rules(annotations: dict) -> list[Refusal]:
    """The legacy seccomp and AppArmor annotations: never unconfined; AppArmor's only
    runtime/default, localhost/<profile> or empty (baseline)."""
    out = []
    for key, value in annotations.items():
        value = str(value)
        if key.startswith(APPARMOR_CONTAINER_PREFIX):
            if value and value != APPARMOR_RUNTIME_DEFAULT and \
                    not value.startswith(APPARMOR_LOCALHOST_PREFIX):
                out.append(Refusal("unconfined", "", f"annotation {key} is {value[:40]!r}; "
                                   f"allowed: {APPARMOR_RUNTIME_DEFAULT}, "
                                   f"{APPARMOR_LOCALHOST_PREFIX}<profile>"))
        elif (key == SECCOMP_POD_ANNOTATION or key.startswith(SECCOMP_CONTAINER_PREFIX)) and \
                value.lower() == "unconfined":
            out.append(Refusal("unconfined", "", f"annotation {key} is unconfined"))
    return out


def _profile_rules(sc: dict, name: str) -> list[Refusal]:
    """seccomp never Unconfined; AppArmor only RuntimeDefault or Localhost (baseline)."""
    where = "securityContext" if name else "pod securityContext"
    out = []
    if ((sc.get("seccompProfile") or {}).get("type") or "").lower() == "unconfined":
        out.append(Refusal("unconfined", name, f"{where}.seccompProfile is Unconfined"))
    apparmor = sc.get("appArmorProfile")
    if isinstance(apparmor, dict) and apparmor.get("type") not in APPARMOR_TYPES:
        out.append(Refusal("unconfined", name, f"{where}.appArmorProfile is "
                           f"{apparmor.get('type')}; allowed: {', '.join(APPARMOR_TYPES)}"))
    return out


def _selinux_rules(sc: dict, name: str) -> list[Refusal]:
    """A custom SELinux type (spc_t runs unconfined), user or role escapes the container
    policy (baseline: type from BASELINE_SELINUX_TYPES, user and role unset)."""
    opts = sc.get("seLinuxOptions")
    if not isinstance(opts, dict):
        return []
    where = "securityContext" if name else "pod securityContext"
    out = []
    if (opts.get("type") or "") not in ("", *BASELINE_SELINUX_TYPES):
        out.append(Refusal("selinux", name, f"{where}.seLinuxOptions.type {opts.get('type')} is "
                           f"not one of {', '.join(BASELINE_SELINUX_TYPES)}"))
    for field in ("user", "role"):
        if opts.get(field):
            out.append(Refusal("selinux", name, f"{where}.seLinuxOptions.{field} must not be "
                               "set"))
    return out


def _volume_rules(spec: dict, policy: SandboxPolicy, sandbox: bool) -> list[Refusal]:
    out: list[Refusal] = []
    secrets_refused = sandbox and not policy.allow_secrets
    why_secret = ("a Secret of type service-account-token cannot be told from others at "
                  "admission (the webhook's --allow-secrets admits them)")
    for v in spec.get("volumes") or []:
        if not isinstance(v, dict):
            continue
        name = v.get("name", "")
        kinds = [k for k in v if k != "name"]
        if len(kinds) != 1 or kinds[0] not in VOLUME_TYPES:
            out.append(Refusal("volume-type", "", f"volume {name} is {'+'.join(kinds) or 'empty'}"
                               f"; allowed: {', '.join(VOLUME_TYPES)}"))
            continue
        if kinds[0] == "secret" and secrets_refused:
            secret = (v.get("secret") or {}).get("secretName")
            out.append(Refusal("secret-refused", "",
                               f"volume {name} mounts Secret {secret}; {why_secret}"))
        if kinds[0] != "projected":
            continue
        sources = (v.get("projected") or {}).get("sources") or []
        if sandbox and any(isinstance(s, dict) and "serviceAccountToken" in s for s in sources):
            out.append(Refusal("service-account-token", "",
                               f"volume {name} projects a service-account token"))
        for src in sources:
            src = src if isinstance(src, dict) else {"?": src}
            bad = [k for k in src if k not in PROJECTED_SOURCES]
            if bad:
                out.append(Refusal("volume-type", "", f"volume {name} projects {'+'.join(bad)}"
                                   f"; allowed: {', '.join(PROJECTED_SOURCES)}"))
            if "secret" in src and secrets_refused:
                out.append(Refusal("secret-refused", "", f"volume {name} projects Secret "
                                   f"{(src.get('secret') or {}).get('name')}; {why_secret}"))
    return out


def _container_rules(kind: str, i: int, c: dict, policy: SandboxPolicy, sandbox: bool,
                     guarded: bool, execd_container: bool) -> list[Refusal]:
    name = c.get("name", "")
    sc = _dict_at(c, "securityContext")
    out: list[Refusal] = []
    if sc.get("privileged"):
        out.append(Refusal("privileged", name, "privileged containers are not allowed"))
    if (sc.get("windowsOptions") or {}).get("hostProcess"):
        out.append(Refusal("privileged", name, "hostProcess containers are not allowed"))
    if _is_guard_slot(kind, i, c, guarded):
        pass  # the guard's capabilities are checked whole by _check_guard
    else:
        caps = sc.get("capabilities") or {}
        added = sorted({_cap(a) for a in caps.get("add") or []})
        net = [a for a in added if a in GUARD_CAPS]
        other = [a for a in added if a not in GUARD_CAPS]
        if net:
            out.append(Refusal("net-admin-added", name,
                               f"adds {','.join(net)}; it shares the pod's network and could "
                               "undo the guard (only initContainers[0] netguard may)"))
        if other:
            extra = " (ALL is every capability, NET_ADMIN included)" if "ALL" in other else ""
            out.append(Refusal("capability-added", name,
                               f"adds {','.join(other)}{extra}; no container but sandman's "
                               "guard may add capabilities"))
        if not {_cap(d) for d in caps.get("drop") or []} & {NET_RAW, "ALL"}:
            out.append(Refusal("net-raw-not-dropped", name,
                               "add NET_RAW (or ALL) to securityContext.capabilities.drop: "
                               "runtimes grant it by default and an AF_PACKET socket sends "
                               "past the guard's rules"))
        if name == NETGUARD_CONTAINER and kind == "initContainers" and i != 0:
            out.append(Refusal("guard-misconfigured", name, "netguard must be initContainers[0]"))
    out.extend(_profile_rules(sc, name))
    out.extend(_selinux_rules(sc, name))
    ports = [p.get("hostPort") for p in c.get("ports") or [] if isinstance(p, dict)]
    if any(ports):
        out.append(Refusal("host-port", name, f"hostPort {', '.join(map(str, filter(None, ports)))}"
                           " opens the node's port past the pod's guard"))
    if sc.get("procMount") not in (None, "Default"):
        out.append(Refusal("unconfined", name, f"procMount {sc.get('procMount')} unmasks /proc"))
    if sandbox and not policy.allow_secrets:
        for e in c.get("env") or []:
            if isinstance(e, dict) and (e.get("valueFrom") or {}).get("secretKeyRef"):
                out.append(Refusal("secret-refused", name, f"env {e.get('name')} comes from a "
                                   "Secret, which may hold a service-account token"))
        for e in c.get("envFrom") or []:
            if isinstance(e, dict) and e.get("secretRef"):
                out.append(Refusal("secret-refused", name, "envFrom a Secret, which may hold a "
                                   "service-account token"))
    if sandbox and not _is_injected(kind, c):
        for m in c.get("volumeMounts") or []:
            if not isinstance(m, dict):
                continue
            path = m.get("mountPath", "")
            if m.get("name") == SANDMAN_VOLUME and m.get("readOnly") is not True:
                out.append(Refusal("sandman-mount", name, f"mounts the sandman volume writable "
                                   f"at {path}; only sandman's init containers may write it"))
            elif execd_container and m.get("name") != SANDMAN_VOLUME and _under_execd_dir(path):
                out.append(Refusal("sandman-mount", name, f"mounts {m.get('name')} at {path}, "
                                   f"which shadows the read-only {EXECD_DIR}"))
    return out


def _check_resources(c: dict, pod_level: bool = False) -> list[Refusal]:
    res = c.get("resources") or {}
    requests, limits = res.get("requests") or {}, res.get("limits") or {}
    out = []
    for name in ("cpu", "memory") if pod_level else CORE_RESOURCES:
        req, lim = requests.get(name), limits.get(name)
        if (pod_level or name == "ephemeral-storage") and req is None and lim is None:
            continue
        if req is None or lim is None or not _same_quantity(req, lim):
            where = "pod-level resources: " if pod_level else ""
            out.append(Refusal("resources-unequal", "" if pod_level else c.get("name", ""),
                               f"{where}{name} requests {req} != limits {lim}"))
    return out


def _gpus(c: dict, resource: str) -> Decimal:
    """GPUs a container asks for: its limit (the API server copies it into the request), else
    its request; a non-integer count is what the API server refuses itself."""
    res = c.get("resources") or {}
    value = (res.get("limits") or {}).get(resource, (res.get("requests") or {}).get(resource))
    try:
        return parse_quantity(value) if value is not None else Decimal(0)
    except ValueError:
        return Decimal(0)


def _resource_rules(pod: dict, policy: SandboxPolicy) -> list[Refusal]:
    """Only cpu, memory, ephemeral-storage and, where the chart allows GPUs, at most
    policy.gpu_max of its GPU resource in the containers (never an init container: it runs
    before the pod's other containers and would hold its devices for the pod's life). No other
    sandbox tolerates the GPU nodes' taints."""
    spec = pod.get("spec") or {}
    gpu = policy.gpu_resource
    out: list[Refusal] = []
    total = Decimal(0)
    for kind, _, c in _every_container(spec):
        res = _dict_at(c, "resources")
        names = sorted({str(k) for side in ("requests", "limits")
                        for k in (res.get(side) or {}) if k not in CORE_RESOURCES})
        name = c.get("name", "")
        for r in names:
            if r != gpu:
                out.append(Refusal("extended-resource", name, f"{kind} asks for {r}; a sandbox "
                                   f"may ask only for {', '.join(CORE_RESOURCES)} and {gpu}"))
            elif kind != "containers":
                out.append(Refusal("gpu-refused", name, f"{kind} asks for {gpu}; only the "
                                   "sandbox's containers may"))
            elif policy.gpu_max == 0:
                out.append(Refusal("gpu-refused", name, f"asks for {gpu}; this cluster grants "
                                   "sandboxes no GPUs (chart sandbox.gpu.enabled)"))
        if kind == "containers":
            total += _gpus(c, gpu)
    if 0 < policy.gpu_max < total:
        out.append(Refusal("gpu-refused", "", f"the pod asks for {total} {gpu}; at most "
                           f"{policy.gpu_max} per sandbox (chart sandbox.gpu.max)"))
    pod_level = _dict_at(spec, "resources")
    extra = sorted({str(k) for side in ("requests", "limits") for k in (pod_level.get(side) or {})
                    if k not in ("cpu", "memory")})
    if extra:
        out.append(Refusal("extended-resource", "", f"pod-level resources ask for "
                           f"{', '.join(extra)}; only cpu and memory"))
    keys = {toleration(t)["key"] for t in policy.gpu_tolerations}
    if keys and total == 0:
        for t in spec.get("tolerations") or []:
            if not isinstance(t, dict):
                continue
            key = t.get("key") or ""
            if key in keys or (not key and t.get("operator") == "Exists"):
                out.append(Refusal("gpu-toleration", "", f"tolerates {key or 'every taint'} "
                                   f"without asking for {gpu}: GPU nodes are for GPU sandboxes"))
    return out


def _same_resources(a, b) -> bool:
    a, b = a or {}, b or {}
    for side in set(a) | set(b):
        x, y = a.get(side) or {}, b.get(side) or {}
        if set(x) != set(y) or not all(_same_quantity(x[k], y[k]) for k in x):
            return False
    return True


def _guard_missing(pod: dict, inits: list) -> list[Refusal]:
    why = ("egress is denied by label" if _labels(pod).get(LABEL_EGRESS) == EGRESS_DENY
           else "the cluster guards every sandbox")
    first = inits[0].get("name") if inits else "absent"
    fix = "" if is_sandbox(pod) else (
        f" (label it {LABEL_SANDBOX}={SANDBOX_TRUE} to have the guard injected, or add it "
        "as initContainers[0] exactly as `python3 -m webhook guard -f POD.json` prints it)")
    return [Refusal("guard-missing", NETGUARD_CONTAINER,
                    f"{why} but initContainers[0] is {first}, not netguard; "
                    f"a label alone is not enforcement{fix}")]


def _check_guard(pod: dict, policy: SandboxPolicy) -> list[Refusal]:
    """The whole guard container, exactly as netguard_container renders it for this pod (the
    API server's defaulted fields aside, quantities compared by value): image, command, args,
    env (the node-IP variable is expanded into --ingress-from), mounts, working directory,
    securityContext, and nothing more (a restartPolicy would make it a sidecar that the pod's
    containers do not wait for)."""
    spec = pod.get("spec") or {}
    inits = spec.get("initContainers") or []
    if not inits or not isinstance(inits[0], dict) or inits[0].get("name") != NETGUARD_CONTAINER:
        return _guard_missing(pod, inits if inits and isinstance(inits[0], dict) else [])
    try:
        wanted = netguard_container(pod, policy)
    except SandboxError as e:
        return [e.refusal]
    g = inits[0]
    sc = _dict_at(g, "securityContext")
    caps = sc.get("capabilities") or {}
    problems = []
    if g.get("image") != policy.image:
        problems.append(f"image {g.get('image')} is not {policy.image}")
    if {_cap(a) for a in caps.get("add") or []} != set(GUARD_CAPS):
        problems.append(f"capabilities.add must be exactly {','.join(GUARD_CAPS)}")
    if "ALL" not in {_cap(d) for d in caps.get("drop") or []}:
        problems.append("capabilities.drop must be ALL")
    if sc.get("readOnlyRootFilesystem") is not True:
        problems.append("readOnlyRootFilesystem must be true")
    if sc.get("privileged"):
        problems.append("must not be privileged")
    if not problems and sc != wanted["securityContext"]:
        problems.append(f"securityContext must be {wanted['securityContext']}")
    if g.get("command") != wanted["command"]:
        problems.append(f"command must be {' '.join(wanted['command'])}")
    if g.get("args") != wanted["args"]:
        problems.append(f"args are not the pod's policy ({' '.join(wanted['args'])})")
    if not _same_resources(g.get("resources"), wanted["resources"]):
        problems.append(f"resources must be {wanted['resources']}")
    # The service-account plugin mounts its token volume into every container of a pod the
    # mutation does not touch (an egress-deny pod without the sandbox label): not the guard's.
    tokens = set(injected_token_volumes(spec))
    mounts = [m for m in g.get("volumeMounts") or [] if m.get("name") not in tokens]
    if mounts != wanted["volumeMounts"]:
        problems.append(f"volumeMounts must be {wanted['volumeMounts']} as sandman renders it")
    skip = {"name", "image", "command", "args", "securityContext", "resources", "volumeMounts",
            *_API_DEFAULTED}
    for key in sorted((set(g) | set(wanted)) - skip):
        if g.get(key) != wanted.get(key):
            problems.append(f"{key} must not be set" if key not in wanted else
                            f"{key} must be {wanted[key]} as sandman renders it")
    return [Refusal("guard-misconfigured", NETGUARD_CONTAINER, p) for p in problems]


@functools.lru_cache(maxsize=1)
def _guard_apply_parser():
    """netguard's `apply` options as its parser has them (sandman.contract's table, and -h),
    so abbreviations and defaults read as they do in the guard."""
    import argparse

    p = argparse.ArgumentParser(prog="netguard apply")
    for flag in NETGUARD_APPLY_OPTIONS:
        p.add_argument(flag, **netguard_argparse_kwargs(flag))
    return p


@functools.lru_cache(maxsize=64)
def _args_apply_deny(args: tuple[str, ...], allowed: tuple[str, ...] = ()) -> bool:
    """netguard's apply parser (_guard_apply_parser) on the guard's args: egress deny (or the default) and no
    --allow-egress but the pod's own allowlist (`allowed`, its annotation's entries, which
    cannot change after create). Cached: every label update of a running deny sandbox asks
    (the controller's acquire), and a pod's args never change."""
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            parsed = _guard_apply_parser().parse_args(list(args))
    except SystemExit:
        return False
    given = [p for a in parsed.allow_egress or () for p in a.split(",")]
    return parsed.egress in (None, EGRESS_DENY) and given == list(allowed)


def _guard_applied_deny(pod: dict) -> list[Refusal]:
    """On UPDATE: did the pod's own guard (its args cannot change) apply egress deny? Judged
    with netguard's apply parser, so abbreviations and defaults mean what they mean to it."""
    spec = pod.get("spec") or {}
    inits = spec.get("initContainers") or []
    if not inits or not isinstance(inits[0], dict) or inits[0].get("name") != NETGUARD_CONTAINER:
        return _guard_missing(pod, inits if inits and isinstance(inits[0], dict) else [])
    g = inits[0]
    problems = []
    if g.get("command") != NETGUARD_COMMAND and g.get("command") not in EARLIER_NETGUARD_COMMANDS:
        problems.append(f"command {g.get('command')} is not {' '.join(NETGUARD_COMMAND)}")
    raw = _annotations(pod).get(ANNOTATION_EGRESS_ALLOW)
    allowed = tuple(raw.split(",")) if isinstance(raw, str) and raw else ()
    if not _args_apply_deny(tuple(map(str, g.get("args") or [])), allowed):
        problems.append(f"the running guard did not apply egress deny (args "
                        f"{' '.join(map(str, g.get('args') or []))}); relabelling it to deny "
                        "needs a new pod")
    if (g.get("securityContext") or {}) != _guard_security_context():
        problems.append("its securityContext is not the one sandman renders")
    return [Refusal("guard-misconfigured", NETGUARD_CONTAINER, p) for p in problems]


def _first_difference(a, b, path: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in list(a) + [k for k in b if k not in a]:
            if a.get(key) != b.get(key):
                return _first_difference(a.get(key), b.get(key), f"{path}/{key}")
    if isinstance(a, list) and isinstance(b, list):
        for i in range(max(len(a), len(b))):
            x = a[i] if i < len(a) else None
            y = b[i] if i < len(b) else None
            if x != y:
                return _first_difference(x, y, f"{path}/{i}")
    return path or "/"
