"""The names every sandman component agrees on. Nothing else in the tree spells them.

execd is the one exception (a single stdlib-only file mounted into unmodified images); a test
checks its copies of these constants against this module.
"""

from __future__ import annotations

DOMAIN = "sandman.dev"

# Labels (selectable, so values are short and bounded).
LABEL_SANDBOX = f"{DOMAIN}/sandbox"  # "true": the pod is a sandbox; the webhook selects on it
LABEL_EGRESS = f"{DOMAIN}/egress"  # "deny": outbound traffic denied, the guard is mandatory
LABEL_JOB = f"{DOMAIN}/job"  # the job a pod belongs to (pacing fairness, caps, drain)
LABEL_NONCE = f"{DOMAIN}/nonce"  # one per create: finds the pod after an ambiguous create error
LABEL_STATE = f"{DOMAIN}/state"  # warm|leased, set by the controller only
# The tenant namespace a controller sandbox belongs to (--auth kubernetes); its job label is
# then `<tenant>.<job>`, so job names are scoped per tenant.
LABEL_TENANT = f"{DOMAIN}/tenant"
# A pre-pull's puller pod (controller/prepull.py): never a sandbox (no LABEL_SANDBOX, no
# managed-by), so the books, the sweep and the webhook leave it alone; the value is the first
# PREPULL_DIGEST_CHARS hex digits of the image's digest. The controller deletes what it no
# longer tracks, the chart's uninstall cleanup every one.
LABEL_PREPULL = f"{DOMAIN}/prepull"
PREPULL_DIGEST_CHARS = 32

SANDBOX_TRUE = "true"
EGRESS_DENY = "deny"
EGRESS_ALLOW = "allow"
STATE_WARM = "warm"
STATE_LEASED = "leased"
# Written just before a delete, so a delete that fails and is then lost with a controller restart
# is still recognised and redone when the books are rebuilt from labels.
STATE_DELETING = "deleting"
STATES = (STATE_WARM, STATE_LEASED, STATE_DELETING)

# Pods the controller created carry this (the standard label); its sweep touches no other pod,
# so labelled pods made by other clients (admitted by the webhook) are never swept.
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY_CONTROLLER = "sandman-controller"

# Node-pool label the controller selects nodes by by default (a pool, never an instance type);
# configurable with the controller's --node-pool-label.
LABEL_NODE_POOL_DEFAULT = f"{DOMAIN}/node-pool"

# Annotations (free-form values).
ANNOTATION_TOKEN_SHA256 = f"{DOMAIN}/token-sha256"  # SHA-256 hex of execd's token; never the token
ANNOTATION_INGRESS_FROM = f"{DOMAIN}/ingress-from"  # "CIDR,...": callers allowed to reach execd
# With egress=deny only: the destinations the pod may still reach, as sandman/egress.py renders
# them (canonical entries joined by ","). The webhook turns it into netguard's --allow-egress.
ANNOTATION_EGRESS_ALLOW = f"{DOMAIN}/egress-allow"
ANNOTATION_CONTAINER = f"{DOMAIN}/container"  # names the sandbox container (default: the first)
# A handed-out sandbox's lease (controller only): on the pod, so a restarted or new leader keeps
# it. EXPIRES_AT is RFC 3339 UTC ("2026-01-02T03:04:05Z"); after it the controller deletes the
# pod unless a renew moved it. LIFETIME is the seconds a renew without lifetime_s extends by.
ANNOTATION_EXPIRES_AT = f"{DOMAIN}/expires-at"
ANNOTATION_LIFETIME = f"{DOMAIN}/lifetime-s"
# HMAC-SHA256 (hex) of the pod's namespace, name and nonce under the controller's books key
# (--books-key-file): a mark only the key's holder can write, checked before the controller
# adopts a pod into its books (docs/controller.md "Books only the controller can write").
ANNOTATION_PROOF = f"{DOMAIN}/proof"
# Checked reuse (docs/controller.md "Reuse"): a sandbox's role is part of its warm-pool key; only
# grading pods (labelled) go back to a pool after execd's /restore, agent pods are always deleted.
LABEL_ROLE = f"{DOMAIN}/role"  # on grading pods (no label: agent)
ROLE_AGENT = "agent"
ROLE_GRADING = "grading"
ROLES = (ROLE_AGENT, ROLE_GRADING)
ANNOTATION_REUSE_COUNT = f"{DOMAIN}/reuse-count"  # times the pod went back to a pool
# Shadow grading: a reused pod's verdict against a never-used pod's, reported by the SDK (the
# `outcome` of POST /v1/sandboxes/{id}/shadow and of the counter's label).
SHADOW_AGREE = "agree"
SHADOW_CONTRADICT = "contradict"  # the reused pod is retired
SHADOW_OUTCOMES = (SHADOW_AGREE, SHADOW_CONTRADICT)
# In a grading pod's sandbox container: execd records its reuse baseline before it serves.
EXECD_BASELINE_ENV = "SANDMAN_BASELINE"
# Its watched set (execd --baseline-scope): `root`, the whole root filesystem, in grading pods.
EXECD_BASELINE_SCOPE_ENV = "SANDMAN_BASELINE_SCOPE"
BASELINE_SCOPES = ("listed", "root")
# In an agent pod's sandbox container: execd records a stat-only snapshot base of the root
# filesystem before it serves, so GET /snapshot can carry the holder's changes into a fork
# (docs/execd.md "Snapshots"). Without it /snapshot answers 409. Value "on".
EXECD_SNAPSHOT_ENV = "SANDMAN_SNAPSHOT"

# Set by the kubelet in every container: the API server's ClusterIP. netguard and the webhook
# read it as an address no egress allowlist may reach.
KUBERNETES_SERVICE_HOST_ENV = "KUBERNETES_SERVICE_HOST"

# execd inside a sandbox.
EXECD_PORT = 9470
EXECD_DIR = "/sandman"
EXECD_PATH = f"{EXECD_DIR}/execd.py"
EXECD_TOKEN_ENV = "SANDMAN_TOKEN_SHA256"
# execd's readiness route: forks a process and writes+fsyncs a file, 503 when the pod is wedged
# (the kubelet's readiness probe and the controller's hand-out check use it; /health does not).
EXECD_READY_PATH = "/ready"
# The guard's entry point in the sandman image: a link to netguard/__main__.py
# (images/Dockerfile), run as a file so the guard's start pays neither runpy nor site.
NETGUARD_PATH = "/opt/sandman/netguard.py"
# netguard writes its status here, on a volume shared with the sandbox container.
NETGUARD_STATUS_PATH = f"{EXECD_DIR}/run/netguard.json"

# netguard's `apply` command line, spelled once: the webhook renders a guard's args with these
# flags and judges them with a parser built from this table (sandman/podspec.py); netguard's
# argparse parser is built from it (netguard/args.py, which adds the help) and its fast reader
# reads it (netguard/cli.py). Here, not in netguard, so the webhook imports nothing of netguard;
# netguard's start imports this module already, so the table costs it no import.
NETGUARD_FLAG_EGRESS = "--egress"
NETGUARD_FLAG_ALLOW_EGRESS = "--allow-egress"
NETGUARD_FLAG_NEVER_EGRESS = "--never-egress"
NETGUARD_FLAG_INGRESS_PORT = "--ingress-port"
NETGUARD_FLAG_INGRESS_FROM = "--ingress-from"
NETGUARD_FLAG_INGRESS_FROM_GATEWAY = "--ingress-from-gateway"
NETGUARD_FLAG_INSTALL_EXECD = "--install-execd"
NETGUARD_BACKENDS = ("nft", "legacy")  # the iptables backends netguard drives (netguard/xtables.py)
NETGUARD_VERIFY_TIMEOUT = 1.0  # seconds a probe may take by default (netguard/verify.py)
# flag: (dest, kind, choices or the constant, default); a kind is "str" (with its choices, or
# None), "int", "float", "append" (a repeatable string), "const" (a flag that stores the
# constant) or "false" (a flag that stores False). The ruleset options are also those of
# `render` and `check`.
NETGUARD_RULESET_OPTIONS: dict[str, tuple[str, str, object, object]] = {
    NETGUARD_FLAG_EGRESS: ("egress", "str", (EGRESS_DENY, EGRESS_ALLOW), None),
    NETGUARD_FLAG_ALLOW_EGRESS: ("allow_egress", "append", None, None),
    NETGUARD_FLAG_NEVER_EGRESS: ("never_egress", "append", None, None),
    NETGUARD_FLAG_INGRESS_PORT: ("ingress_port", "int", None, None),
    NETGUARD_FLAG_INGRESS_FROM: ("ingress_from", "append", None, None),
    NETGUARD_FLAG_INGRESS_FROM_GATEWAY: ("ingress_from_gateway", "const", True, None),
}
NETGUARD_APPLY_OPTIONS: dict[str, tuple[str, str, object, object]] = {
    "--log-format": ("log_format", "str", ("text", "json"), "text"),
    **NETGUARD_RULESET_OPTIONS,
    "--backend": ("backend", "str", ("auto",) + NETGUARD_BACKENDS, "auto"),
    "--no-verify": ("verify", "false", None, True),
    "--verify-blocked": ("verify_blocked", "append", None, ()),  # () reads as a new []
    "--verify-timeout": ("verify_timeout", "float", None, NETGUARD_VERIFY_TIMEOUT),
    "--status-file": ("status_file", "str", None, NETGUARD_STATUS_PATH),
    NETGUARD_FLAG_INSTALL_EXECD: ("install_execd", "str", None, None),
}


def netguard_argparse_kwargs(flag: str) -> dict[str, object]:
    """The keyword arguments of argparse's add_argument for the `apply` option `flag`."""
    dest, kind, extra, default = NETGUARD_APPLY_OPTIONS[flag]
    if kind == "const":
        return {"action": "store_const", "const": extra, "default": default}
    if kind == "false":
        return {"dest": dest, "action": "store_false"}
    kw: dict[str, object] = {"default": list(default) if isinstance(default, tuple) else default}
    if kind == "append":
        kw["action"] = "append"
    elif kind in ("int", "float"):
        kw["type"] = int if kind == "int" else float
    elif extra is not None:
        kw["choices"] = extra
    return kw

_SHA256_HEX = r"[0-9a-f]{64}"


def _fullmatch(pattern: str, value: str) -> bool:
    # `re` here, not at import: netguard's start imports this module under the pod's own CPU
    # quota, and re (with enum) is ~4 ms of it. re caches the compiled pattern.
    import re

    return re.fullmatch(pattern, value) is not None


def is_token_sha256(value: str | None) -> bool:
    """True for a lowercase 64-hex SHA-256 digest, the only accepted token-hash form.
    fullmatch: `$` would also accept a trailing newline, which the policy's CEL refuses."""
    return _fullmatch(_SHA256_HEX, value or "")


# Kubernetes' label syntax: a value is empty or 1-63 of [A-Za-z0-9-_.], alphanumeric at both
# ends; a key's name part (after an optional `prefix/`) is a non-empty value. fullmatch again:
# the API server refuses "job\n", so nothing of ours may accept it first.
_LABEL_VALUE = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
# A DNS-1123 subdomain (a label key's prefix, object names): lowercase, at most 253 characters.
_DNS_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"


def is_label_value(value: str, *, allow_empty: bool = True) -> bool:
    """True for a valid label value; the empty value only with `allow_empty`."""
    if value == "":
        return allow_empty
    return isinstance(value, str) and _fullmatch(_LABEL_VALUE, value)


def is_label_name(name: str) -> bool:
    """True for a valid label key's name part (what follows `prefix/`, or the whole key)."""
    return is_label_value(name, allow_empty=False)


_DNS_LABEL = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"


def is_dns_label(name: str) -> bool:
    """True for a DNS-1123 label: a namespace name."""
    return isinstance(name, str) and _fullmatch(_DNS_LABEL, name)


def is_dns_subdomain(name: str) -> bool:
    """True for a DNS-1123 subdomain: a label key's prefix, or an object name."""
    return isinstance(name, str) and len(name) <= 253 and _fullmatch(_DNS_SUBDOMAIN, name)

# The one sandman image: it carries netguard and the execd.py that the webhook copies into pods.
SANDMAN_IMAGE = "ghcr.io/sandman-dev/sandman:0.2.0"
# Names the webhook (sandman/podspec.py) gives what it injects into a sandbox pod.
NETGUARD_CONTAINER = "sandman-netguard"  # always initContainers[0] when present
EXECD_INSTALL_CONTAINER = "sandman-execd-install"  # copies execd.py into SANDMAN_VOLUME
SANDMAN_VOLUME = "sandman"  # emptyDir: execd.py and run/ (netguard status); read-only in sandbox
