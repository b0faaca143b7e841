"""The controller's HTTP API as it goes over the wire: route paths, request and answer bodies,
error types, the default sandbox size. Nothing else in the tree spells them.

Read by the controller (`controller/routes.py` serves these routes and validates these bodies),
the SDK (`sandman.client` sends them), the load tests, and the chart (`charts/gen_contract.py`
writes the route paths into `_contract.tpl`). Stdlib only and Python >= 3.9: the client
distribution (`sandman-client`, client/pyproject.toml) ships it with the SDK.

The request models are plain dataclasses that FastAPI validates as they are: pydantic reads
`__pydantic_config__` (unknown fields refused; a number is accepted where a quantity string is
expected) and runs `__post_init__`, which holds the checks both sides make. Built by the SDK,
the same `__post_init__` raises ValueError before anything is sent.
"""

from __future__ import annotations

import re
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, NamedTuple, TypeVar
from urllib.parse import quote

from sandman import contract, quantity

# ---- the default sandbox: the paper's reference size, requests equal limits

DEFAULT_CPU = "2"
DEFAULT_MEMORY = "8Gi"
DEFAULT_EGRESS = contract.EGRESS_DENY
DEFAULT_ROLE = contract.ROLE_AGENT
EGRESS_VALUES = (contract.EGRESS_DENY, contract.EGRESS_ALLOW)
# `egress` may also be `{"allow": [entries]}` (sandman/egress.py's grammar): outbound denied
# but for those entries, within the cluster's ceiling. The only key of that object.
EGRESS_ALLOW_KEY = "allow"
DEFAULT_ACQUIRE_TIMEOUT_S = 300.0
MAX_ACQUIRE_TIMEOUT_S = 3600.0
MAX_REQUEST_ID_LEN = 128
# GPUs per sandbox the wire accepts; the cluster's own bound is the controller's --gpu-max
# (chart sandbox.gpu.max), 0 unless the chart enables GPUs. A node has at most 8 or 16.
MAX_GPU = 64

# Request models are keyword-only where dataclasses can say so (3.10+, so on the server); on a
# 3.9 client they are plain dataclasses, and the SDK passes every field by keyword.
_KW_ONLY: dict[str, Any] = {"kw_only": True} if sys.version_info >= (3, 10) else {}


# ---- routes

class Route(NamedTuple):
    """One route: `kind` names the operation (the SDK's `on_request` hook and locust's request
    type report it), `path` is a template whose `{id}` / `{job}` are path parameters."""

    kind: str
    method: str
    path: str

    def url(self, **params: str) -> str:
        """The path with its parameters filled in, each quoted as one path segment."""
        return self.path.format(**{k: quote(str(v), safe="") for k, v in params.items()})


ACQUIRE = Route("ACQUIRE", "POST", "/v1/sandboxes")
LIST = Route("LIST", "GET", "/v1/sandboxes")
GET = Route("GET", "GET", "/v1/sandboxes/{id}")
RELEASE = Route("RELEASE", "DELETE", "/v1/sandboxes/{id}")
PREWARM = Route("PREWARM", "POST", "/v1/prewarm")
RENEW = Route("RENEW", "POST", "/v1/sandboxes/{id}/renew")  # pushes expires_at back
# The caller's grading contradicted an earlier one on this pod: delete it, never reuse it.
RETIRE = Route("RETIRE", "POST", "/v1/sandboxes/{id}/retire")
# A reused grading pod's verdict was graded again on a never-used pod (ShadowReport): counted;
# "contradict" retires the pod, "agree" releases it for reuse. The rights of a release.
SHADOW = Route("SHADOW", "POST", "/v1/sandboxes/{id}/shadow")
# RELEASE with `?reuse=true` (grading pods): restored, checked, back to its warm pool.
RELEASE_REUSE_PARAM = "reuse"
# n new sandboxes of this one's spec, tenant and job, each holding its state at the call
# (docs/controller.md "Fork"). The rights of a release.
FORK = Route("FORK", "POST", "/v1/sandboxes/{id}/fork")
# A group: `count` sandboxes of one spec in one call, all ready or none left (docs/controller.md
# "Group acquires"). The rights of an acquire.
GROUP = Route("GROUP", "POST", "/v1/groups")
# Checkpoints (docs/controller.md "Checkpoints"): the state of named sandboxes, or of a job's
# agent sandboxes, stored in the admin's registry as one artifact each; one id for the set.
# The rights of a fork; RESTORE makes every sandbox of it anew (the rights of an acquire in
# the checkpoint's tenant), PAUSE is a checkpoint of one sandbox and its release.
CHECKPOINT = Route("CHECKPOINT", "POST", "/v1/checkpoints")
RESTORE = Route("RESTORE", "POST", "/v1/checkpoints/{id}/restore")
PAUSE = Route("PAUSE", "POST", "/v1/sandboxes/{id}/pause")
DRAIN = Route("DRAIN", "POST", "/v1/jobs/{job}/drain")
STATS = Route("STATS", "GET", "/v1/stats")
# Image pre-pull (admin): pull images, by digest, onto every node of the sandbox node pool;
# GET reports each image's progress per node (docs/controller.md "Pre-pull").
PREPULL = Route("PREPULL", "POST", "/v1/images")
IMAGES = Route("IMAGES", "GET", "/v1/images")
HEALTHZ = Route("HEALTHZ", "GET", "/healthz")  # the process is alive (same as LIVEZ)
LIVEZ = Route("LIVEZ", "GET", "/livez")  # the process and its event loop answer; never the API
READYZ = Route("READYZ", "GET", "/readyz")  # this replica can serve (a standby forwards)
METRICS = Route("METRICS", "GET", "/metrics")  # Prometheus text format
ROUTES = (ACQUIRE, LIST, GET, RELEASE, RENEW, RETIRE, SHADOW, FORK, GROUP, CHECKPOINT, RESTORE,
          PAUSE, PREWARM, DRAIN, STATS, PREPULL, IMAGES, HEALTHZ, LIVEZ, READYZ, METRICS)

# execd's routes, bodies and limits (the tree caps and header among them) are
# sandman/execd_api.py's.


# ---- errors: `{"error": {"type", "message", "events"}}`, the type decides, never the message

class ErrorType(NamedTuple):
    status: int
    type: str


BAD_REQUEST = ErrorType(400, "BadRequest")  # refused by the controller's checks
# owner= names no pod of the sandbox namespace: an ownerReference cannot cross namespaces and
# the garbage collector would delete the sandbox at once, so the acquire is refused instead.
BAD_OWNER = ErrorType(400, "BadOwner")
INVALID_BODY = ErrorType(422, "BadRequest")  # refused by the body's validation: same type
# No such sandbox (released, expired, never made). One that ended under its holder (its pod
# deleted by another party, failed, its node lost) says why, in one line, to callers that
# may see it: "sandbox ID is gone: its pod was deleted while leased (...)".
SANDBOX_GONE = ErrorType(404, "SandboxGone")
UNAUTHENTICATED = ErrorType(401, "Unauthenticated")  # no token, or one the API server refused
FORBIDDEN = ErrorType(403, "Forbidden")  # the caller's RBAC does not allow it in that tenant
QUEUE_FULL = ErrorType(429, "QueueFull")  # wait=false and over a cap
CLIENT_CLOSED = ErrorType(499, "ClientClosed")  # to a caller that left: nobody reads it
INTERNAL_ERROR = ErrorType(500, "InternalError")
POD_FAILED = ErrorType(502, "PodFailed")  # events: the pod's last events
NOT_LEADER = ErrorType(503, "NotLeader")  # no leader to forward to; retry on a new connection
NOT_READY = ErrorType(503, "NotReady")  # /readyz only: this replica cannot serve yet
# The API server did not answer the TokenReview/SubjectAccessReview: refused (fail closed).
AUTH_UNAVAILABLE = ErrorType(503, "AuthUnavailable")
ACQUIRE_TIMEOUT = ErrorType(504, "AcquireTimeout")
# Every pod tried contradicted a declared condition (each was deleted): the cluster cannot
# give what was declared, the message names the field, the declared and the read value.
CONDITIONS_REFUSED = ErrorType(502, "ConditionsRefused")
# A tag the controller could not resolve to a digest (registry unreachable, no credentials):
# refused, never a pod by tag, which would pin nothing for the job.
IMAGE_UNRESOLVED = ErrorType(502, "ImageUnresolved")
# A fork's children were had but the parent's state did not reach every one of them (the
# parent's execd could not give it, its digest was wrong, a child's execd refused it): every
# child was released, one line says which step and which pod.
FORK_FAILED = ErrorType(502, "ForkFailed")
# A checkpoint or a restore that did not complete: the registry refused or failed, an artifact
# is not the bytes its digest names (changed in the registry), over the size bound, or a
# sandbox's execd refused; nothing of it is left (no partial checkpoint, no restored sandbox).
CHECKPOINT_FAILED = ErrorType(502, "CheckpointFailed")
# No such checkpoint in the caller's tenant, or past its TTL (deleted or about to be).
CHECKPOINT_GONE = ErrorType(404, "CheckpointGone")
# The sandbox was paused (its holder's pause or the idle rule: checkpoint, then release): the
# error's `checkpoint` names the checkpoint to resume it from. Said only to callers of the
# sandbox's tenant (anyone else gets SandboxGone), and only until that checkpoint expires.
SANDBOX_PAUSED = ErrorType(410, "SandboxPaused")
ERRORS = (BAD_REQUEST, BAD_OWNER, INVALID_BODY, SANDBOX_GONE, QUEUE_FULL, CLIENT_CLOSED,
          INTERNAL_ERROR, POD_FAILED, CONDITIONS_REFUSED, NOT_LEADER, NOT_READY, ACQUIRE_TIMEOUT, UNAUTHENTICATED,
          FORBIDDEN, AUTH_UNAVAILABLE, IMAGE_UNRESOLVED, FORK_FAILED, CHECKPOINT_FAILED,
          CHECKPOINT_GONE, SANDBOX_PAUSED)
ERROR_TYPES = frozenset(e.type for e in ERRORS)


# ---- bodies

class _Model:
    # pydantic (the controller's FastAPI) reads this off the dataclass; the SDK never does.
    __pydantic_config__: ClassVar[dict[str, Any]] = {"extra": "forbid",
                                                     "coerce_numbers_to_str": True}
    # Every subclass is a dataclass: what asdict() needs to see.
    __dataclass_fields__: ClassVar[dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = _drop_late_defaults(asdict(self))
        return out


# Fields added to the bodies after their first release, with their defaults: left out of a
# body at their default, so this SDK still talks to a controller that predates them (it
# refuses unknown fields), and a body that does not use them reads as it always did.
_LATE_FIELDS: dict[str, Any] = {"ephemeral_storage": None, "gpu": 0, "egress_allow": None,
                                "problem": None, "lost": None}


def _drop_late_defaults(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _drop_late_defaults(v) for k, v in obj.items()
                if not (k in _LATE_FIELDS and type(v) is type(_LATE_FIELDS[k])
                        and v == _LATE_FIELDS[k])}
    if isinstance(obj, list):  # a list's items (SandboxList's views)
        return [_drop_late_defaults(v) for v in obj]
    return obj


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_lifetime(lifetime_s: Any) -> None:
    # Only the type here: the bounds are the controller's flags (a 400 names them).
    _check(lifetime_s is None or (not isinstance(lifetime_s, bool)
                                  and isinstance(lifetime_s, (int, float))
                                  and lifetime_s == lifetime_s),
           "lifetime_s: must be a number of seconds")


# The controller parses the value; this refuses what can never be one ("two", "2 CPUs", a
# negative size) before anything is sent.
def _check_size(cpu: Any, memory: Any) -> None:
    _check(quantity.is_quantity(cpu),
           f"cpu: must be a Kubernetes quantity such as 2, 500m or 1.5, not {cpu!r}")
    _check(quantity.is_quantity(memory),
           f"memory: must be a Kubernetes quantity such as 8Gi or 512Mi, not {memory!r}")


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _allowlist(items: Any, where: str) -> list[str]:
    """Entries in canonical form (sorted, deduplicated), or ValueError in one line."""
    _check(isinstance(items, (list, tuple)) and len(items) > 0
           and all(isinstance(x, str) for x in items),
           f"{where}: must be a non-empty list of entries such as \"10.0.0.0/8:443\", "
           f"not {_short(items)}")
    from sandman import egress  # only where an allowlist is given

    try:
        entries = egress.parse_list(list(items))
        text = egress.render(entries)
    except ValueError as e:
        raise ValueError(f"{where}: {' '.join(str(e).split())}") from None
    return text.split(",")


def canonical_egress(egress: Any, where: str = "egress") -> str | dict[str, list[str]]:
    """`deny` or `allow` as given; `{"allow": [entries]}` with its entries canonical.
    ValueError in one line for anything else."""
    if isinstance(egress, str) and egress in EGRESS_VALUES:
        return egress
    _check(isinstance(egress, dict) and list(egress) == [EGRESS_ALLOW_KEY],
           f"{where}: must be {' or '.join(EGRESS_VALUES)} or {{\"{EGRESS_ALLOW_KEY}\": "
           f"[entries]}}, not {_short(egress)}")
    return {EGRESS_ALLOW_KEY: _allowlist(egress[EGRESS_ALLOW_KEY],
                                         f"{where}.{EGRESS_ALLOW_KEY}")}


def egress_parts(egress: str | dict[str, list[str]]) -> tuple[str, tuple[str, ...]]:
    """A canonical egress value as the pod carries it: the egress label's value and the
    allowlist (the annotation's entries). An allowlist always means egress deny."""
    if isinstance(egress, dict):
        return contract.EGRESS_DENY, tuple(egress[EGRESS_ALLOW_KEY])
    return egress, ()


def _set(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)  # frozen: canonical values replace what was given


def _check_extra(ephemeral_storage: Any, gpu: Any) -> None:
    _check(ephemeral_storage is None or (isinstance(ephemeral_storage, str)
                                         and quantity.is_positive_plain(ephemeral_storage)),
           "ephemeral_storage: must be a positive Kubernetes quantity such as 10Gi, "
           f"not {ephemeral_storage!r}")
    _check(not isinstance(gpu, bool) and isinstance(gpu, int) and 0 <= gpu <= MAX_GPU,
           f"gpu: must be an integer 0 to {MAX_GPU}, not {gpu!r}")


def _check_role(role: Any) -> None:
    _check(role in contract.ROLES, f"role: must be one of {', '.join(contract.ROLES)}, "
           f"not {role!r}")


@dataclass(frozen=True)
class Owner(_Model):
    """Who the sandbox belongs to (the trainer's pod): the controller sets an owner reference,
    so the garbage collector deletes the sandbox if the trainer's pod goes first."""

    name: str
    uid: str


@dataclass(frozen=True)
class Spec(_Model):
    """What a sandbox is made of besides its image; with the image, the warm-pool key."""

    cpu: str = DEFAULT_CPU
    memory: str = DEFAULT_MEMORY
    workspace: str | None = None
    # "deny" | "allow" | {"allow": [entries]}: an allowlist is part of the warm-pool key.
    egress: str | dict[str, Any] = DEFAULT_EGRESS
    role: str = DEFAULT_ROLE  # grading pods may be reused (release with reuse=true)
    # Requests == limits on the sandbox container; None: the node's default (no request).
    ephemeral_storage: str | None = None
    gpu: int = 0  # the chart's GPU resource (limits), only where the chart allows GPUs

    def __post_init__(self) -> None:
        _check_size(self.cpu, self.memory)
        _set(self, "egress", canonical_egress(self.egress, "egress"))
        _check_role(self.role)
        _check_extra(self.ephemeral_storage, self.gpu)


# The declarable run conditions; a refusal's metric label is one of these (or "probe").
CONDITION_FIELDS = ("egress", "cpu_quota", "visible_cpus", "memory_limit", "user", "tz",
                    "hash_seed", "time_limit_s", "egress_allow")


def _number(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and v == v


# Every field has a default, so no kw_only (which Python 3.9 clients lack): pass by keyword.
@dataclass(frozen=True)
class Conditions(_Model):
    """Run conditions an acquire declares (docs/controller.md, "Declared conditions"). The
    controller reads them inside the pod before hand-out and refuses a pod that contradicts
    any it can read; `time_limit_s` is never read (it is the grader's), always unverified."""

    # "deny" | "allow": outbound network; {"allow": [entries]} is egress "deny" plus
    # egress_allow (so declared, it reads back as those two fields).
    egress: str | dict[str, Any] | None = None
    cpu_quota: float | None = None  # cores of CFS quota (cgroup cpu.max / cfs_quota_us)
    visible_cpus: int | None = None  # CPUs the tests may run on (affinity within cpuset)
    memory_limit: str | None = None  # a quantity, e.g. "8Gi": the cgroup memory limit
    user: str | None = None  # a user name, or a uid as digits
    tz: str | None = None  # e.g. "UTC", "Europe/Paris"
    hash_seed: str | None = None  # PYTHONHASHSEED; "random" for unset
    time_limit_s: float | None = None
    # The allowlist netguard applied in the pod (canonical entries): exactly these. Last, so
    # positional construction keeps its meaning.
    egress_allow: list[str] | None = None

    def __post_init__(self) -> None:
        if self.egress is not None:
            mode, entries = egress_parts(canonical_egress(self.egress, "conditions.egress"))
            _set(self, "egress", mode)
            if entries:
                _check(self.egress_allow is None
                       or _allowlist(self.egress_allow, "conditions.egress_allow")
                       == list(entries),
                       "conditions.egress_allow: differs from the allowlist in "
                       "conditions.egress; declare it once")
                _set(self, "egress_allow", list(entries))
        if self.egress_allow is not None:
            _set(self, "egress_allow", _allowlist(self.egress_allow, "conditions.egress_allow"))
            _check(self.egress in (None, contract.EGRESS_DENY),
                   "conditions.egress_allow: an allowlist only exists with egress deny")
        _check(self.cpu_quota is None or (_number(self.cpu_quota) and 0 < self.cpu_quota
                                          <= 4096),
               "conditions.cpu_quota: must be a number of cores > 0, such as 2 or 1.5")
        _check(self.visible_cpus is None or (not isinstance(self.visible_cpus, bool)
                                             and isinstance(self.visible_cpus, int)
                                             and 0 < self.visible_cpus <= 65536),
               "conditions.visible_cpus: must be an integer > 0")
        _check(self.memory_limit is None or (isinstance(self.memory_limit, str)
                                             and quantity.is_positive_plain(self.memory_limit)),
               "conditions.memory_limit: must be a quantity such as 8Gi or 512Mi")
        _check(self.user is None or (isinstance(self.user, str) and 0 < len(self.user) <= 64
                                     and ":" not in self.user and self.user.strip() == self.user),
               "conditions.user: must be a user name or a numeric uid")
        _check(self.tz is None or (isinstance(self.tz, str) and 0 < len(self.tz) <= 64
                                   and self.tz.strip() == self.tz),
               "conditions.tz: must be a zone name such as UTC or Europe/Paris")
        _check(self.hash_seed is None or (isinstance(self.hash_seed, str) and (
            self.hash_seed == "random" or (self.hash_seed.isdigit() and self.hash_seed.isascii()
                                           and int(self.hash_seed) <= 4294967295))),
               "conditions.hash_seed: must be random or an integer 0 to 4294967295")
        _check(self.time_limit_s is None or (_number(self.time_limit_s)
                                             and self.time_limit_s > 0),
               "conditions.time_limit_s: must be a number of seconds > 0")

    def declared(self) -> dict[str, Any]:
        """The declared fields only."""
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True, **_KW_ONLY)
class AcquireRequest(_Model):
    """`POST /v1/sandboxes`. `request_id` is the idempotency key: a retry with the same key
    (and job) gets the same sandbox back while it is in flight or leased."""

    image: str
    job: str
    cpu: str = DEFAULT_CPU
    memory: str = DEFAULT_MEMORY
    workspace: str | None = None
    # "deny" | "allow" | {"allow": [entries]} (sandman/egress.py: CIDR:PORT or
    # svc/NAME.NAMESPACE:PORT), refused by the controller outside its ceiling.
    egress: str | dict[str, Any] = DEFAULT_EGRESS
    owner: Owner | None = None
    labels: dict[str, str] = field(default_factory=dict)
    timeout_s: float = DEFAULT_ACQUIRE_TIMEOUT_S
    warm_ok: bool = True
    wait: bool = True
    request_id: str | None = None
    # Seconds the sandbox lives after hand-out unless renewed (None: the controller's default;
    # its --min-lifetime/--max-lifetime bound it). The SDK renews while the handle is open.
    lifetime_s: float | None = None
    # The tenant namespace; None: the caller's ServiceAccount namespace (docs/controller.md).
    namespace: str | None = None
    # Declared run conditions: a pod that contradicts one is refused and replaced.
    conditions: Conditions | None = None
    # "grading": may go back to its warm pool after a checked restore (release with reuse).
    # Part of the warm-pool key: an agent never gets a pod a grading ran in, and vice versa.
    role: str = DEFAULT_ROLE
    # A grading acquire may get a pod an earlier grading ran in (restored and checked: release
    # with reuse) only when it says so; by default a grading gets a never-used pod.
    reused_ok: bool = False
    # Requests == limits on the sandbox container; None: no request (the node's default).
    ephemeral_storage: str | None = None
    gpu: int = 0  # refused (BadRequest) unless the chart allows this many per sandbox

    def __post_init__(self) -> None:
        _check(bool(self.image), "image: required")
        _check(isinstance(self.reused_ok, bool), "reused_ok: must be true or false")
        _check(not self.reused_ok or self.role == contract.ROLE_GRADING,
               "reused_ok: only a grading acquire (role=grading) can take a reused pod")
        _check(self.conditions is None or isinstance(self.conditions, Conditions),
               "conditions: must be an object of declared run conditions")
        _check(bool(self.job), "job: required (the controller paces, caps and drains by job)")
        _check_size(self.cpu, self.memory)
        _set(self, "egress", canonical_egress(self.egress, "egress"))
        _check_role(self.role)
        _check_extra(self.ephemeral_storage, self.gpu)
        _check_lifetime(self.lifetime_s)
        _check(not isinstance(self.timeout_s, bool) and isinstance(self.timeout_s, (int, float))
               and 0 < self.timeout_s <= MAX_ACQUIRE_TIMEOUT_S,
               f"timeout_s: must be > 0 and <= {MAX_ACQUIRE_TIMEOUT_S:g}")
        _check(self.request_id is None or 0 < len(self.request_id) <= MAX_REQUEST_ID_LEN,
               f"request_id: must be 1 to {MAX_REQUEST_ID_LEN} characters")

    @property
    def spec(self) -> Spec:
        return Spec(cpu=self.cpu, memory=self.memory, workspace=self.workspace,
                    egress=self.egress, role=self.role,
                    ephemeral_storage=self.ephemeral_storage, gpu=self.gpu)


# Sandboxes per group: each is one create through the pacer (or one warm pod); a wider group
# is several calls.
MAX_GROUP = 256


@dataclass(frozen=True, **_KW_ONLY)
class GroupRequest(AcquireRequest):
    """`POST /v1/groups`: an acquire's body and `count`: that many sandboxes of the spec, each
    paced, capped and served from the warm pool as an acquire is, answered once all are ready.
    All or nothing. `request_id`: a retry by the same caller gets the same group while it is in
    flight or leased. `timeout_s`: for the whole group."""

    count: int | None = None  # required (a default only because the fields before have one)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(not isinstance(self.count, bool) and isinstance(self.count, int)
               and 1 <= self.count <= MAX_GROUP, f"count: must be an integer 1 to {MAX_GROUP}")


@dataclass(frozen=True, **_KW_ONLY)
class RenewRequest(_Model):
    """`POST /v1/sandboxes/{id}/renew`: expires_at becomes now + `lifetime_s` (None: the
    lifetime the sandbox was acquired or last renewed with), bounded by the controller's max."""

    lifetime_s: float | None = None
    tokens: dict[str, str] | None = None  # {id: its execd token}: see MAX_TOKEN_LEN

    def __post_init__(self) -> None:
        _check_lifetime(self.lifetime_s)
        _check_tokens(self.tokens)


@dataclass(frozen=True, **_KW_ONLY)
class ShadowReport(_Model):
    """`POST /v1/sandboxes/{id}/shadow`: the caller graded this reused pod's verdict again on
    a never-used pod; `outcome` is one of contract.SHADOW_OUTCOMES."""

    outcome: str

    def __post_init__(self) -> None:
        _check(self.outcome in contract.SHADOW_OUTCOMES,
               f"outcome: one of {', '.join(contract.SHADOW_OUTCOMES)}")


# Children per fork: every one is a pod made through the pacer and holds a copy of the
# parent's changes; a search wider than this forks in several calls.
MAX_FORK = 64
# A sandbox's execd token as its holder has it: a controller that restarted since the hand-out
# learns it back (its SHA-256 is on the pod) from the first holder call that carries it, to
# fork, checkpoint, pause or watch the sandbox for idleness (docs/controller.md "Tokens after a
# restart"). Never an authorization: the caller's rights are checked as before.
MAX_TOKEN_LEN = 256


def _check_tokens(tokens: Any) -> None:
    _check(tokens is None or (
        isinstance(tokens, dict) and len(tokens) <= MAX_CHECKPOINT
        and all(isinstance(k, str) and 0 < len(k) <= 253 and isinstance(v, str)
                and 0 < len(v) <= MAX_TOKEN_LEN for k, v in tokens.items())),
        f"tokens: at most {MAX_CHECKPOINT} sandbox ids, each with its token "
        f"(1 to {MAX_TOKEN_LEN} characters)")


@dataclass(frozen=True, **_KW_ONLY)
class ForkRequest(_Model):
    """`POST /v1/sandboxes/{id}/fork`: `n` new sandboxes of the parent's spec, tenant and job,
    each holding the parent's filesystem changes, cwd and exported environment at the call.
    All or nothing. `request_id`: a retry by the same caller gets the same children while
    they are in flight or leased. `timeout_s`: for the whole fork (acquires and copies)."""

    n: int
    request_id: str | None = None
    timeout_s: float = DEFAULT_ACQUIRE_TIMEOUT_S
    tokens: dict[str, str] | None = None  # {id: its execd token}: see MAX_TOKEN_LEN

    def __post_init__(self) -> None:
        _check_tokens(self.tokens)
        _check(not isinstance(self.n, bool) and isinstance(self.n, int)
               and 1 <= self.n <= MAX_FORK, f"n: must be an integer 1 to {MAX_FORK}")
        _check(not isinstance(self.timeout_s, bool) and isinstance(self.timeout_s, (int, float))
               and 0 < self.timeout_s <= MAX_ACQUIRE_TIMEOUT_S,
               f"timeout_s: must be > 0 and <= {MAX_ACQUIRE_TIMEOUT_S:g}")
        _check(self.request_id is None or (isinstance(self.request_id, str)
                                           and 0 < len(self.request_id) <= MAX_REQUEST_ID_LEN),
               f"request_id: must be 1 to {MAX_REQUEST_ID_LEN} characters")


# Sandboxes per checkpoint: each is one artifact pushed and, on restore, one pod made and sent
# its state; a job wider than this is checkpointed by ids, in several calls.
MAX_CHECKPOINT = 256


def _check_timeout(timeout_s: Any) -> None:
    _check(not isinstance(timeout_s, bool) and isinstance(timeout_s, (int, float))
           and 0 < timeout_s <= MAX_ACQUIRE_TIMEOUT_S,
           f"timeout_s: must be > 0 and <= {MAX_ACQUIRE_TIMEOUT_S:g}")


@dataclass(frozen=True, **_KW_ONLY)
class CheckpointRequest(_Model):
    """`POST /v1/checkpoints`: the sandboxes `ids`, or every handed-out agent sandbox of `job`
    (of the caller's tenant, or `namespace`), one of the two. All or nothing: the answer's id
    names every one, or the call fails and no artifact of it is kept. A grading sandbox named
    in `ids` is refused (a job's are left out)."""

    job: str | None = None
    ids: list[str] | None = None
    namespace: str | None = None
    timeout_s: float = DEFAULT_ACQUIRE_TIMEOUT_S
    tokens: dict[str, str] | None = None  # {id: its execd token}: see MAX_TOKEN_LEN

    def __post_init__(self) -> None:
        _check_tokens(self.tokens)
        _check((self.job is None) != (self.ids is None), "job or ids: exactly one of the two")
        if self.job is not None:
            _check(isinstance(self.job, str) and bool(self.job), "job: must not be empty")
        if self.ids is not None:
            _check(isinstance(self.ids, list) and 0 < len(self.ids) <= MAX_CHECKPOINT
                   and all(isinstance(i, str) and 0 < len(i) <= 253 for i in self.ids)
                   and len(set(self.ids)) == len(self.ids),
                   f"ids: 1 to {MAX_CHECKPOINT} distinct sandbox ids")
        _check_timeout(self.timeout_s)


@dataclass(frozen=True, **_KW_ONLY)
class RestoreRequest(_Model):
    """`POST /v1/checkpoints/{id}/restore` (and the body of a pause): `timeout_s` for the
    whole call. `request_id`: a retry by the same caller gets the same sandboxes while they
    are in flight or leased."""

    timeout_s: float = DEFAULT_ACQUIRE_TIMEOUT_S
    request_id: str | None = None
    tokens: dict[str, str] | None = None  # a pause's: {id: its execd token} (MAX_TOKEN_LEN)

    def __post_init__(self) -> None:
        _check_timeout(self.timeout_s)
        _check_tokens(self.tokens)
        _check(self.request_id is None or (isinstance(self.request_id, str)
                                           and 0 < len(self.request_id) <= MAX_REQUEST_ID_LEN),
               f"request_id: must be 1 to {MAX_REQUEST_ID_LEN} characters")


@dataclass(frozen=True, **_KW_ONLY)
class PrewarmRequest(_Model):
    """`POST /v1/prewarm`: keep `count` never-used sandboxes of (image, spec) ready; they go
    after `idle_timeout_s` without an acquire (the controller's default when None)."""

    image: str
    count: int
    spec: Spec = field(default_factory=Spec)
    idle_timeout_s: float | None = None

    def __post_init__(self) -> None:
        _check(bool(self.image), "image: required")
        _check(not isinstance(self.count, bool) and isinstance(self.count, int)
               and self.count >= 0, "count: must be an integer >= 0")
        _check(self.idle_timeout_s is None or self.idle_timeout_s > 0,
               "idle_timeout_s: must be > 0")


# Pre-pull: images per request (and tracked at once by the controller). A task set of a few
# hundred images (the paper's runs drew on 21-306) fits in one or two requests.
MAX_PREPULL_IMAGES = 256
MAX_IMAGE_REF_LEN = 512
# `registry/repo@sha256:<64 hex>`: a digest pins what the nodes pull; a tag could move between
# the pre-pull and the run, and the run would pull anyway.
_DIGEST_REF = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]*@sha256:[0-9a-f]{64}")


def check_digest_ref(ref: Any, where: str = "image") -> None:
    """ValueError in one line unless `ref` is an image reference pinned by its digest."""
    _check(isinstance(ref, str), f"{where}: must be a string, not {type(ref).__name__}")
    _check(len(ref) <= MAX_IMAGE_REF_LEN, f"{where}: longer than {MAX_IMAGE_REF_LEN} characters")
    _check(_DIGEST_REF.fullmatch(ref) is not None,
           f"{where}: {ref[:100]!r} is not pinned by digest; write it as "
           "registry/repo@sha256:<64 lowercase hex> (a tag can move before the run)")


@dataclass(frozen=True, **_KW_ONLY)
class PrepullRequest(_Model):
    """`POST /v1/images`: pull each image onto every node of the sandbox node pool (admin)."""

    images: list[str]

    def __post_init__(self) -> None:
        _check(isinstance(self.images, list) and 0 < len(self.images) <= MAX_PREPULL_IMAGES,
               f"images: must be a list of 1 to {MAX_PREPULL_IMAGES} image references")
        for i, ref in enumerate(self.images):
            check_digest_ref(ref, f"images[{i}]")


# ---- answers
# Each answer's reader (`from_json`) checks the types written here and raises AnswerError on a
# missing or mistyped field; a field the server leaves null takes its default. The SDK reads
# the controller's answers with these (sandman/client/models.py adds only what it keeps).

class AnswerError(ValueError):
    """An answer without the form written here: not an object, a field missing or mistyped."""


_NUM = (int, float)


def _answer(data: Any, what: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise AnswerError(f"{what}: expected a JSON object, got {type(data).__name__}")
    return data


def _req(d: dict[str, Any], key: str, types: type | tuple[type, ...], what: str) -> Any:
    if key not in d:
        raise AnswerError(f"{what}: the answer has no {key!r}")
    v = d[key]
    allowed = types if isinstance(types, tuple) else (types,)
    if not isinstance(v, allowed) or (isinstance(v, bool) and bool not in allowed):
        raise AnswerError(f"{what}: {key!r} has type {type(v).__name__}")
    return v


def _opt(d: dict[str, Any], key: str, types: type | tuple[type, ...], what: str,
         default: Any = None) -> Any:
    return default if d.get(key) is None else _req(d, key, types, what)


@dataclass(frozen=True)
class Timings(_Model):
    queued_ms: float = 0.0  # in the pacing queue
    create_ms: float = 0.0  # the pod create call
    ready_ms: float = 0.0  # create -> execd answered /ready (the hand-out)
    # Last, so positional construction keeps its meaning.
    started_ms: float = 0.0  # create -> the controller saw the sandbox container running
    # The kubelet's pull of the image (its Pulled event on the pod); 0 when the node had the
    # image (pre-pulled), or the event had not reached the controller by the hand-out.
    pull_ms: float = 0.0

    @classmethod
    def from_json(cls, data: Any) -> Timings:
        if not isinstance(data, dict):
            return cls()
        what = "acquire timings"
        return cls(queued_ms=_opt(data, "queued_ms", _NUM, what, 0.0),
                   create_ms=_opt(data, "create_ms", _NUM, what, 0.0),
                   started_ms=_opt(data, "started_ms", _NUM, what, 0.0),
                   ready_ms=_opt(data, "ready_ms", _NUM, what, 0.0),
                   pull_ms=_opt(data, "pull_ms", _NUM, what, 0.0))


@dataclass(frozen=True)
class ConditionsCheck(_Model):
    """What the pod read for the declared conditions: `verified` maps each declared field
    that was read and matched to its reading; `unverified` names the declared fields that
    could not be read (never a refusal; `time_limit_s` is never read). A pod contradicting a
    field is never handed out (ConditionsRefused)."""

    verified: dict[str, Any] = field(default_factory=dict)
    unverified: list[str] = field(default_factory=list)

    @classmethod
    def from_json(cls, data: Any) -> ConditionsCheck:
        what = "acquire conditions"
        d = _answer(data, what)
        unverified = _opt(d, "unverified", list, what, [])
        if not all(isinstance(x, str) for x in unverified):
            raise AnswerError(f"{what}: unverified must be a list of names")
        return cls(verified=dict(_opt(d, "verified", dict, what, {})),
                   unverified=list(unverified))


# A subclass (the SDK's model, adding `raw`) reads itself with the same code.
_LeaseT = TypeVar("_LeaseT", bound="Lease")


@dataclass(frozen=True)
class Lease(_Model):
    """201 to an acquire. The only answer that carries the sandbox's execd token."""

    id: str
    pod: str
    address: str
    port: int
    token: str = field(repr=False)
    warm: bool = False
    timings: Timings = field(default_factory=Timings)
    expires_at: str | None = None  # RFC 3339 UTC; deleted after it unless renewed
    lifetime_s: float | None = None  # what a renew without lifetime_s extends by
    conditions: ConditionsCheck | None = None  # None: the acquire declared none
    # The reference the pod was made of: a tag resolved once per job to `repo@sha256:...`
    # (docs/controller.md "Image pinning"), and its digest. None: a controller without
    # pinning, or one told --image-pinning off and asked for a tag.
    image: str | None = None
    image_digest: str | None = None
    # Times the pod was given back for reuse before this hand-out (0: never used): a grading
    # on a reused pod may be shadowed on a never-used one.
    reuses: int = 0

    @classmethod
    def from_json(cls: type[_LeaseT], data: Any, **extra: Any) -> _LeaseT:
        """`extra`: fields a subclass adds (the SDK's `raw`)."""
        what = "acquire answer"
        d = _answer(data, what)
        port = _req(d, "port", int, what)
        if not 0 < port < 65536:
            raise AnswerError(f"{what}: port {port} out of range")
        token = _req(d, "token", str, what)
        if not token:
            raise AnswerError(f"{what}: empty token")
        conditions = d.get("conditions")
        return cls(id=_req(d, "id", str, what), pod=_req(d, "pod", str, what),
                   address=_req(d, "address", str, what), port=port, token=token,
                   warm=_opt(d, "warm", bool, what, False),
                   timings=Timings.from_json(d.get("timings")),
                   expires_at=_opt(d, "expires_at", str, what),
                   lifetime_s=_opt(d, "lifetime_s", _NUM, what),
                   conditions=None if conditions is None else ConditionsCheck.from_json(conditions),
                   image=_opt(d, "image", str, what),
                   image_digest=_opt(d, "image_digest", str, what),
                   reuses=_opt(d, "reuses", int, what, 0),
                   **extra)


@dataclass(frozen=True)
class Forked(_Model):
    """201 to a fork: each child as an acquire answers it (its token included), in order."""

    children: list[Lease]

    @classmethod
    def from_json(cls, data: Any) -> Forked:
        return cls(children=cls.read_children(data, Lease))

    @staticmethod
    def read_children(data: Any, lease: type[_LeaseT]) -> list[_LeaseT]:
        """The children, each read as `lease` (Lease, or the SDK's subclass adding `raw`)."""
        return _leases(data, "children", lease, "fork answer")


@dataclass(frozen=True)
class Group(_Model):
    """201 to a group acquire: each sandbox as an acquire answers it (its token included)."""

    sandboxes: list[Lease]

    @classmethod
    def from_json(cls, data: Any) -> Group:
        return cls(sandboxes=cls.read(data, Lease))

    @staticmethod
    def read(data: Any, lease: type[_LeaseT]) -> list[_LeaseT]:
        return _leases(data, "sandboxes", lease, "group answer")


def _leases(data: Any, key: str, lease: type[_LeaseT], what: str) -> list[_LeaseT]:
    return [lease.from_json(c) for c in _req(_answer(data, what), key, list, what)]


@dataclass(frozen=True)
class CheckpointedSandbox(_Model):
    """One sandbox of a checkpoint: its id then, its artifact's manifest digest, the bytes of
    its state."""

    id: str
    digest: str
    bytes: int


@dataclass(frozen=True)
class Checkpointed(_Model):
    """201 to a checkpoint (and 200 to a pause): `id` names the set (restore it by this id
    alone); `expires_at` (RFC 3339 UTC): deleted from the registry after it."""

    id: str
    sandboxes: list[CheckpointedSandbox]
    expires_at: str

    @classmethod
    def from_json(cls, data: Any) -> Checkpointed:
        what = "checkpoint answer"
        d = _answer(data, what)
        items = []
        for x in _req(d, "sandboxes", list, what):
            x = _answer(x, what)
            items.append(CheckpointedSandbox(id=_req(x, "id", str, what),
                                             digest=_req(x, "digest", str, what),
                                             bytes=_req(x, "bytes", int, what)))
        return cls(id=_req(d, "id", str, what), sandboxes=items,
                   expires_at=_req(d, "expires_at", str, what))


@dataclass(frozen=True)
class RestoredCheckpoint(_Model):
    """201 to a restore: each old sandbox id -> the new sandbox, as an acquire answers it."""

    sandboxes: dict[str, Lease]

    @staticmethod
    def read(data: Any, lease: type[_LeaseT]) -> dict[str, _LeaseT]:
        """The new sandboxes by old id, each read as `lease` (Lease, or the SDK's subclass)."""
        what = "restore answer"
        got = _req(_answer(data, what), "sandboxes", dict, what)
        return {str(k): lease.from_json(v) for k, v in got.items()}


# A subclass (the SDK's model, adding `raw`) reads itself with the same code.
_SandboxViewT = TypeVar("_SandboxViewT", bound="SandboxView")


@dataclass(frozen=True)
class SandboxView(_Model):
    """`GET /v1/sandboxes/{id}` and each item of the list: what the controller knows of a
    sandbox (never its token)."""

    id: str
    pod: str
    job: str
    state: str
    address: str | None
    port: int
    image: str
    cpu: str
    memory: str
    egress: str
    expires_at: str | None = None  # handed-out sandboxes only (warm ones never expire)
    lifetime_s: float | None = None
    tenant: str | None = None  # the tenant namespace (None: unscoped, e.g. the warm pool)
    # With egress deny: the allowlist (canonical entries); None: none. Last, so positional
    # use keeps its meaning; left out of the answer when None (older readers).
    egress_allow: list[str] | None = None
    # One line when the controller knows the sandbox cannot work: its pod's Node is not Ready
    # or deleted (naming the node, since when, and when the controller ends the lease); None
    # when it knows of nothing wrong. Left out when None.
    problem: str | None = None

    @classmethod
    def from_json(cls: type[_SandboxViewT], data: Any, **extra: Any) -> _SandboxViewT:
        what = "sandbox info"
        d = _answer(data, what)
        allow = _opt(d, "egress_allow", list, what)
        if allow is not None and not all(isinstance(x, str) for x in allow):
            raise AnswerError(f"{what}: egress_allow must be a list of entries")
        return cls(id=_req(d, "id", str, what), pod=_req(d, "pod", str, what),
                   job=_req(d, "job", str, what), state=_req(d, "state", str, what),
                   address=_opt(d, "address", str, what), port=_req(d, "port", int, what),
                   image=_req(d, "image", str, what), cpu=_req(d, "cpu", str, what),
                   memory=_req(d, "memory", str, what), egress=_req(d, "egress", str, what),
                   expires_at=_opt(d, "expires_at", str, what),
                   lifetime_s=_opt(d, "lifetime_s", _NUM, what),
                   tenant=_opt(d, "tenant", str, what), egress_allow=allow,
                   problem=_opt(d, "problem", str, what), **extra)


@dataclass(frozen=True)
class SandboxList(_Model):
    """`GET /v1/sandboxes[?job=]`."""

    items: list[SandboxView]


@dataclass(frozen=True)
class Released(_Model):
    """`DELETE /v1/sandboxes/{id}`: idempotent, `released` is false when already gone.
    `reused`: with `?reuse=true`, the pod was restored and went back to its warm pool (false:
    it was deleted: restore failed, reused --max-reuse times, or gone meanwhile). Also the
    answer to `POST /v1/sandboxes/{id}/retire`."""

    id: str
    released: bool
    reused: bool = False
    # Not released because it had ended under its holder: why (its pod deleted by another
    # party, failed, its node lost), to a caller that may see it; left out when None.
    lost: str | None = None


# A subclass (the SDK's model, adding `raw`) reads itself with the same code.
_PoolStatusT = TypeVar("_PoolStatusT", bound="PoolStatus")


@dataclass(frozen=True)
class PoolStatus(_Model):
    """`POST /v1/prewarm`: the warm pool of one (image, spec) after the call."""

    target: int
    warm: int
    building: int
    idle_timeout_s: float | None

    @classmethod
    def from_json(cls: type[_PoolStatusT], data: Any, **extra: Any) -> _PoolStatusT:
        what = "prewarm answer"
        d = _answer(data, what)
        return cls(target=_req(d, "target", int, what), warm=_req(d, "warm", int, what),
                   building=_req(d, "building", int, what),
                   idle_timeout_s=_opt(d, "idle_timeout_s", _NUM, what), **extra)


@dataclass(frozen=True)
class Drained(_Model):
    """`POST /v1/jobs/{job}/drain`: how many of the job's sandboxes are being deleted."""

    job: str
    deleting: int


_StatsT = TypeVar("_StatsT", bound="Stats")


@dataclass(frozen=True)
class Stats(_Model):
    """`GET /v1/stats`: the pacer and the pools, for dashboards and the load tests."""

    queue_depth: dict[str, int]  # per job
    creating: int
    live: int
    rate: float  # the pacer's current creates/s
    # "image|cpu|memory|workspace|egress[|role][|allow=entries]" -> warm/building/target
    warm: dict[str, dict[str, int]]
    jobs: dict[str, dict[str, int]]  # job -> count per entry state
    # Per tenant ('' unscoped): queued acquires by role, the oldest one's wait (s), its
    # creating and live pods. Last and defaulted, so positional use keeps its meaning.
    tenants: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def from_json(cls: type[_StatsT], data: Any, **extra: Any) -> _StatsT:
        what = "stats answer"
        d = _answer(data, what)
        return cls(queue_depth=_req(d, "queue_depth", dict, what),
                   creating=_req(d, "creating", int, what), live=_req(d, "live", int, what),
                   rate=float(_req(d, "rate", _NUM, what)), warm=_req(d, "warm", dict, what),
                   jobs=_req(d, "jobs", dict, what),
                   tenants=_opt(d, "tenants", dict, what) or {}, **extra)


@dataclass(frozen=True)
class ImageStatus(_Model):
    """One pre-pulled image: its nodes by outcome. `failures` maps a failed node to the
    kubelet's reason (at most MAX_IMAGE_FAILURES of them; `failed` counts them all)."""

    image: str
    pulled: int
    pending: int
    failed: int
    failures: dict[str, str] = field(default_factory=dict)


MAX_IMAGE_FAILURES = 20
_ImagesT = TypeVar("_ImagesT", bound="Images")


@dataclass(frozen=True)
class Images(_Model):
    """`GET /v1/images` and the answer to `POST /v1/images`: every image the controller
    pre-pulls, and how many nodes the sandbox node pool has now."""

    images: list[ImageStatus]
    nodes: int

    @classmethod
    def from_json(cls: type[_ImagesT], data: Any, **extra: Any) -> _ImagesT:
        what = "images answer"
        d = _answer(data, what)
        out = []
        for item in _req(d, "images", list, what):
            i = _answer(item, what)
            failures = _opt(i, "failures", dict, what, {})
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in failures.items()):
                raise AnswerError(f"{what}: failures must map node names to reasons")
            out.append(ImageStatus(image=_req(i, "image", str, what),
                                   pulled=_req(i, "pulled", int, what),
                                   pending=_req(i, "pending", int, what),
                                   failed=_req(i, "failed", int, what), failures=dict(failures)))
        return cls(images=out, nodes=_req(d, "nodes", int, what), **extra)


@dataclass(frozen=True)
class Error(_Model):
    type: str
    message: str
    events: list[str] = field(default_factory=list)
    checkpoint: str | None = None  # SandboxPaused only: the checkpoint to resume from

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        if d["checkpoint"] is None:
            del d["checkpoint"]
        return {"error": d}
