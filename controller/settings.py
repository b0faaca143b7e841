"""The controller's settings (`python3 -m controller serve` flags; docs/controller.md, Knobs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

from controller.demand import Budget
from controller.pacer import Limits
from sandman import contract, egress
from sandman.podspec import SandboxPolicy

# ---- the sandbox pod template (--pod-template-file): what a shared node pool asks of pods ---
# Applied by Creator.build_pod to every pod the controller builds (warm builds too). Checked
# at startup: a bad file stops the controller with one line, never a pod refused at create.
_TOLERATION_KEYS = {"key", "operator", "value", "effect", "tolerationSeconds"}
_AFFINITY_KEYS = {"nodeAffinity", "podAffinity", "podAntiAffinity"}
TEMPLATE_KEYS = ("tolerations", "affinity", "priorityClassName", "runtimeClassName",
                 "imagePullSecrets", "annotations", "labels")
# Keys a template may not set: sandman's own (state, job, token hash, ingress-from, expiry...)
# and the app.kubernetes.io/* labels that select sandman's components (a sandbox carrying the
# controller's labels would be the sandbox NetworkPolicy's "controller" peer).
_RESERVED_LABEL_PREFIXES = (contract.DOMAIN + "/", "app.kubernetes.io/")
_RESERVED_ANNOTATION_PREFIXES = (contract.DOMAIN + "/",)


def _str_map(v: object, what: str, reserved: tuple[str, ...]) -> None:
    if not isinstance(v, dict):
        raise ValueError(f"pod template: {what} must be a mapping of strings")
    for k, x in v.items():
        if not isinstance(k, str) or not isinstance(x, str):
            raise ValueError(f"pod template: {what} {k!r}: keys and values must be strings")
        if k.startswith(reserved) or k == contract.LABEL_MANAGED_BY:
            raise ValueError(f"pod template: {what} {k!r} collides with sandman's own keys "
                             f"({', '.join(p + '*' for p in reserved)})")


def check_pod_template(t: object) -> dict:
    """The template if valid, else ValueError with one line naming the bad part."""
    if t is None:
        return {}
    if not isinstance(t, dict):
        raise ValueError("pod template: must be a mapping")
    for k in t:
        if k not in TEMPLATE_KEYS:
            raise ValueError(f"pod template: unknown key {k!r} (allowed: "
                             f"{', '.join(TEMPLATE_KEYS)})")
    tol = t.get("tolerations", [])
    if not isinstance(tol, list) or not all(isinstance(x, dict) and x and set(x) <=
                                            _TOLERATION_KEYS for x in tol):
        raise ValueError("pod template: tolerations must be a list of {key, operator, value, "
                         "effect, tolerationSeconds}")
    aff = t.get("affinity", {})
    if not isinstance(aff, dict) or not set(aff) <= _AFFINITY_KEYS:
        raise ValueError("pod template: affinity may hold only nodeAffinity, podAffinity, "
                         "podAntiAffinity")
    for k in ("priorityClassName", "runtimeClassName"):
        v = t.get(k, "")
        if not isinstance(v, str) or (v and not contract.is_dns_subdomain(v)):
            raise ValueError(f"pod template: {k} {v!r} is not a valid object name")
    ips = t.get("imagePullSecrets", [])
    if not isinstance(ips, list) or not all(
            isinstance(x, dict) and set(x) == {"name"} and isinstance(x["name"], str)
            and contract.is_dns_subdomain(x["name"]) for x in ips):
        raise ValueError("pod template: imagePullSecrets must be a list of {name: SECRET}")
    _str_map(t.get("annotations", {}), "annotation", _RESERVED_ANNOTATION_PREFIXES)
    labels = t.get("labels", {})
    _str_map(labels, "label", _RESERVED_LABEL_PREFIXES)
    for k, v in labels.items():
        if not contract.is_label_value(v):
            raise ValueError(f"pod template: label {k}={v!r}: not a valid label value")
    # Empty entries (the chart renders every key) are left out of the pods.
    return {k: v for k, v in t.items() if v not in ("", [], {}, None)}




def load_pod_template(path: str) -> dict:
    """--pod-template-file: YAML or JSON (the chart mounts JSON from a ConfigMap)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"pod template {path}: {' '.join(str(e).split())}") from None
    return check_pod_template(data)


@dataclass
class Settings:
    namespace: str
    limits: Limits = field(default_factory=Limits)
    ready_check: str = "execd"  # execd: Ready AND execd /ready passes; pod: Ready alone (kwok)
    node_pool_label: str = f"{contract.LABEL_NODE_POOL_DEFAULT}=sandbox"
    sweep_interval: float = 30.0
    sweep_grace: float = 120.0  # an unowned pod younger than this may still be a create in flight
    default_idle_timeout: float = 300.0  # the paper's measured sweet spot for warm pods
    # Demand sizing of warm pools within a global budget (controller/demand.py); pods 0: off,
    # pools hold only what `prewarm` asks.
    warm_budget: Budget = field(default_factory=Budget)
    policy: SandboxPolicy = field(default_factory=SandboxPolicy)
    execd_port: int = contract.EXECD_PORT
    # Above execd /ready's own 2 s budget (it answers 503 itself when a check overruns), like
    # the kubelet probe's 3 s timeout: a slow but honest answer is not a lost one.
    health_timeout: float = 3.0
    # An owner waits this long for Ready (+ execd /ready) after its create, whatever the
    # caller's timeout_s: a pod that turns Ready just after its caller gave up is parked for the
    # next acquire of its key instead of deleted (the paper's late grading pods).
    ready_budget: float = 120.0
    api_timeout: float = 15.0  # one API call; the controller retries, never the client library
    # A handed-out sandbox lives this long unless renewed (acquire's lifetime_s, bounded by
    # min/max): a trainer killed with SIGKILL leaks its sandboxes for at most this long.
    default_lifetime: float = 3600.0
    min_lifetime: float = 30.0  # a shorter one would make the SDK renew every few seconds
    max_lifetime: float = 86400.0
    pod_template: dict = field(default_factory=dict)  # checked: check_pod_template
    # Declared conditions: pods tried per acquire before ConditionsRefused (within timeout_s),
    # and a host:port that a pod with outbound network reaches (execd's egress probe).
    conditions_attempts: int = 3
    conditions_egress_probe: str | None = None
    tenants: bool = False  # --auth kubernetes: job keys are `<tenant>.<job>`, pods labelled
    max_reuse: int = 8  # a grading pod goes back to its pool at most this many times
    # execd's watched set in grading pods: root (the whole root filesystem; a change outside
    # the copied roots retires the pod) or listed (execd's listed roots only).
    baseline_scope: str = "root"
    # --snapshot-base: agent pods' execd records the snapshot base fork, checkpoints and pause
    # need (one stat walk of the image before the pod is ready, its entries in execd's memory).
    snapshot_base: bool = True
    restore_timeout: float = 120.0  # execd /restore of a released grading pod
    # --books-key-file: pods must carry its proof (create.proof) to enter the books; None:
    # the sandbox and managed-by labels alone (then the books policy must guard the labels).
    books_key: bytes | None = None
    # --prepull-image (chart controller.prepull.images): pulled onto the sandbox node pool at
    # start and onto every node that joins it (controller/prepull.py); checked refs.
    prepull_images: tuple[str, ...] = ()
    # --image-pinning: resolve (a job's tags resolved once to digests), require (tags
    # refused) or off (references as given); --registry-insecure: registries asked over
    # plain http (controller/images.py).
    image_pinning: str = "resolve"
    registry_insecure: tuple[str, ...] = ()
    # Checkpoints (controller/checkpoint.py): HOST[:PORT]/PREFIX of the registry they are
    # stored in (None: off), over plain http or not, (user, password) for it, how long each
    # is kept, the most state bytes one holds, and the seconds between TTL sweeps.
    checkpoint_registry: str | None = None
    checkpoint_insecure: bool = False
    # (user, password), or a source read at each registry call (controller/oci.py AuthFile)
    checkpoint_credentials: Any = None
    checkpoint_ttl: float = 7 * 86400.0
    checkpoint_max_bytes: int = 16 << 30
    checkpoint_sweep_interval: float = 600.0
    # The idle rule (controller/idle.py): a handed-out agent sandbox with no holder call to
    # its execd for this many seconds is paused (checkpoint, then release). 0: off.
    pause_idle_after: float = 0.0
    # A handed-out sandbox whose Node is not Ready this long (this controller's clock) is ended
    # with a reason (controller/lost.py); one whose Node is deleted at once. 0: only then.
    # 120 s: past a kubelet restart or a short partition (the node is already 40-50 s
    # silent when it turns NotReady), well before kube's own eviction (300 s, and the pod then
    # stays Terminating until the Node is deleted).
    node_lost_after: float = 120.0

    # The API server's addresses (KUBERNETES_SERVICE_HOST): never in an allowlist, besides
    # the policy's egress_never (chart sandbox.egressNever) and sandman/egress.py's NEVER.
    api_server: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # An acquire's allowlist is checked against these before its create (the ceiling and
        # the admin's never ranges are the policy's: the webhook's flags, the same values).
        self.ceiling = egress.Ceiling.parse(list(self.policy.egress_ceiling))
        self.never = egress.parse_never(list(self.policy.egress_never) + list(self.api_server))
        if self.image_pinning not in ("resolve", "require", "off"):
            raise ValueError("image_pinning must be resolve, require or off")
        if self.ready_check not in ("execd", "pod"):
            raise ValueError("ready_check must be execd or pod")
        if self.baseline_scope not in contract.BASELINE_SCOPES:
            raise ValueError("baseline_scope must be listed or root")
        if self.node_pool_label and "=" not in self.node_pool_label:
            raise ValueError("node_pool_label must be key=value")
        self.pod_template = check_pod_template(self.pod_template)
        if self.books_key is not None and len(self.books_key) < 16:
            raise ValueError("books_key must be at least 16 bytes")
        if self.checkpoint_registry is not None and "/" not in self.checkpoint_registry.strip("/"):
            raise ValueError("checkpoint_registry must be HOST[:PORT]/PREFIX")
        if self.checkpoint_ttl <= 0 or self.checkpoint_max_bytes <= 0:
            raise ValueError("checkpoint_ttl and checkpoint_max_bytes must be > 0")
        if self.pause_idle_after < 0:
            raise ValueError("pause_idle_after must be >= 0 (0: off)")
        if self.pause_idle_after and (self.checkpoint_registry is None
                                      or not self.snapshot_base):
            raise ValueError("pause_idle_after needs checkpoints (checkpoint_registry and "
                             "snapshot_base)")
        if not self.node_lost_after >= 0:
            raise ValueError("node_lost_after must be >= 0 (0: end leases only on deleted nodes)")
        if self.conditions_attempts < 1:
            raise ValueError("conditions_attempts must be >= 1")
        if not 0 < self.min_lifetime <= self.default_lifetime <= self.max_lifetime:
            raise ValueError("lifetimes must satisfy 0 < min <= default <= max "
                             f"(got {self.min_lifetime:g}, {self.default_lifetime:g}, "
                             f"{self.max_lifetime:g})")
