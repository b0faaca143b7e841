"""Prometheus metrics. Every label value passes an allow-list (`bounded`, as in
webhook/metrics.py): a value outside it is counted as "other", so no job name, pod name or
error text can ever become a label and cardinality stays bounded. Record through the helpers
below, never through `.labels()` directly."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from sandman import api, buildinfo, contract

ACQUIRE_RESULTS = ("ok", "timeout", "failed", "queue_full")
WARM = ("true", "false")
CREATE_RESULTS = ("ok", "ok_after_conflict", "ok_after_error", "name_conflict", "refused",
                  "transport_error")
DELETE_RESULTS = ("ok", "gone", "retry")
# controller.books.State names (tests/controller/test_books.py checks the two agree).
STATES = ("QUEUED", "WITHDRAWN", "CREATING", "CREATING_ORPHANED", "CREATING_DRAINED", "STARTING",
          "STARTING_ORPHANED", "STARTING_DRAINED", "WARM", "PARKED", "CHECKING", "LEASED",
          "DELETING", "GONE", "FAILED")


def bounded(value: str, allowed: tuple[str, ...], other: str = "other") -> str:
    return value if value in allowed else other


ACQUIRES = Counter("sandman_controller_acquires_total", "Acquire requests by result",
                   ["result", "warm"])
ACQUIRE_SECONDS = Histogram("sandman_controller_acquire_seconds",
                            "Acquire latency, queue included", ["warm"],
                            buckets=(.005, .01, .02, .05, .1, .25, .5, 1, 2, 5, 10, 30, 60, 120,
                                     300, 600))
QUEUE_SECONDS = Histogram("sandman_controller_queue_seconds", "Time from enqueue to create slot",
                          buckets=(.001, .01, .1, .5, 1, 5, 10, 30, 60, 120, 300, 600))
CREATES = Counter("sandman_controller_creates_total", "Create calls by outcome", ["result"])
DELETES = Counter("sandman_controller_deletes_total", "Delete attempts by outcome", ["result"])
ILLEGAL_TRANSITIONS = Counter("sandman_controller_illegal_transitions_total",
                              "Entry state changes refused by the transition table (a bug)",
                              ["from_state", "to_state"])
API_BACKOFF = Counter("sandman_controller_api_backoff_total",
                      "API answers (429/5xx) that slowed the create bucket")
EXPIRED = Counter("sandman_controller_expired_total",
                  "Handed-out sandboxes deleted because their lifetime ran out; renewed: "
                  "whether any renew had come (true: the renewing caller went away)",
                  ["renewed"])
# Handed-out sandboxes that ended without their holder's release (controller/lost.py's
# LOST_REASONS, checked equal in tests/controller/test_lost.py).
LOST_REASONS = ("deleted", "evicted", "failed", "node_lost")
LEASES_LOST = Counter("sandman_controller_leases_lost_total",
                      "Handed-out sandboxes that ended without their holder's release, by "
                      "reason: deleted by another party, evicted, failed, node_lost",
                      ["reason"])
for _r in LOST_REASONS:
    LEASES_LOST.labels(_r)
RENEWS = Counter("sandman_controller_renews_total", "Renew requests by result", ["result"])
RENEW_RESULTS = ("ok", "gone", "refused", "failed")
# Pods with the controller's labels it did not make (logged once, never touched).
FOREIGN_REASONS = ("no_sandbox_label", "no_proof")
FOREIGN_PODS = Counter("sandman_controller_foreign_pods_total",
                       "Pods carrying the controller's labels that it did not create (ignored)",
                       ["reason"])
for _r in FOREIGN_REASONS:
    FOREIGN_PODS.labels(_r)
SWEPT = Counter("sandman_controller_swept_total", "Unowned pods deleted by the sweep")
PARKED = Counter("sandman_controller_parked_total",
                 "Pods whose caller left after the create, kept warm for reuse")
REUSES = Counter("sandman_controller_reuses_total",
                 "Grading pods restored, checked clean and returned to their warm pool")
RETIREMENTS = Counter("sandman_controller_retirements_total",
                      "Grading pods deleted instead of reused: caller (retire: the grading "
                      "contradicted an earlier one), max_reuse (reused --max-reuse times), "
                      "shadow (a never-used pod's verdict contradicted the reused pod's)",
                      ["reason"])
RETIRE_REASONS = ("caller", "max_reuse", "shadow")
# Shadow grading: a verdict on a reused grading pod graded again on a never-used pod, as the
# SDK reports it (outcome: sandman.contract.SHADOW_OUTCOMES). Any contradiction alerts.
SHADOW_GRADINGS = Counter("sandman_shadow_grading_total",
                          "Verdicts of reused grading pods graded again on a never-used pod, "
                          "by outcome: agree, or contradict (the reused pod was retired)",
                          ["outcome"])
for _o in contract.SHADOW_OUTCOMES:
    SHADOW_GRADINGS.labels(_o)
RESTORE_FAILURES = Counter("sandman_controller_restore_failures_total",
                           "Released grading pods deleted because execd could not restore "
                           "them or /diff was not clean afterwards")
# The warm pool (controller/warmpool.py, demand sizing in controller/demand.py). Lookups: an
# acquire that may take a warm pod, by role (sandman.contract.ROLES) and whether one was handed
# out. Idle: time pods spent WARM or PARKED, the cost a pool pays for its hits.
WARM_RESULTS = ("hit", "miss")
WARM_LOOKUPS = Counter("sandman_controller_warm_lookups_total",
                       "Acquires that may take a warm pod, by role and result (hit: handed "
                       "out from the pool, miss: created)", ["role", "result"])
WARM_IDLE_POD_SECONDS = Counter("sandman_controller_warm_idle_pod_seconds_total",
                                "Pod-seconds spent warm or parked, unused")
WARM_IDLE_CPU_SECONDS = Counter("sandman_controller_warm_idle_cpu_seconds_total",
                                "CPU-seconds (requested cores x seconds) of pods warm or "
                                "parked, unused")
# One metric per unit (pods, cores): a `resource` label mixing them made sum() meaningless.
WARM_BUDGET_USED_PODS = Gauge("sandman_controller_warm_budget_used_pods",
                              "Warm and building pool pods")
WARM_BUDGET_USED_CORES = Gauge("sandman_controller_warm_budget_used_cpu_cores",
                               "Requested CPU cores of the warm and building pool pods")
WARM_BUDGET_PODS = Gauge("sandman_controller_warm_budget_pods",
                         "The global warm budget in pods (--warm-budget-pods; 0: none)")
WARM_BUDGET_CORES = Gauge("sandman_controller_warm_budget_cpu_cores",
                          "The global warm budget in CPU cores (--warm-budget-cpu; 0: none)")
# By role only: tenants are namespaces, an unbounded label (/v1/stats has them per tenant).
# sum() is the whole queue.
QUEUED_ACQUIRES = Gauge("sandman_controller_queued_acquires",
                        "Acquires waiting for a create slot, by role (agent, grading)", ["role"])
LIVE = Gauge("sandman_controller_live_pods", "Pods the controller owns (any state)")
CREATING = Gauge("sandman_controller_creating_pods", "Creates in flight or pods not yet Ready")
# Declared run conditions (controller/conditions.py): field is api.CONDITION_FIELDS or "probe".
CONDITION_LABELS = ("egress", "cpu_quota", "visible_cpus", "memory_limit", "user", "tz",
                    "hash_seed", "time_limit_s", "egress_allow", "probe")
CONDITIONS_REFUSED = Counter("sandman_controller_conditions_refused_total",
                             "Pods refused at hand-out: a reading contradicted a declared "
                             "condition (probe: the pod did not answer the probe)", ["field"])
LEADER = Gauge("sandman_controller_leader", "1 when this replica holds the Lease")
# The pacing the leader applies, next to what it achieves (creates_total): the bucket's
# current rate (below the configured one while backing off from 429/5xx), and the configured
# limits, one metric each: they are in different units (creates/s, creates, pods).
CREATE_RATE = Gauge("sandman_controller_create_rate_per_second",
                    "The create bucket's current rate (creates/s), lowered while backing off")
MAX_CREATE_RATE = Gauge("sandman_controller_max_create_rate_per_second",
                        "Configured create rate (--rate, creates/s)")
MAX_CREATE_BURST = Gauge("sandman_controller_max_create_burst",
                         "Configured create burst (--burst, creates)")
MAX_CREATING = Gauge("sandman_controller_max_creating_pods",
                     "Configured cap on creates in flight and pods not yet Ready "
                     "(--max-creating)")
MAX_LIVE = Gauge("sandman_controller_max_live_pods",
                 "Configured cap on the pods the controller owns (--max-live)")
# A fork's end (controller/fork.py): ok; refused (a grading pod, a parent not handed out or
# whose token this replica does not hold); acquire (a child could not be had); snapshot (the
# parent's state could not be read, or its digest was wrong); apply (a child refused it);
# client_closed (the caller left; every child made was released).
FORK_RESULTS = ("ok", "refused", "acquire", "snapshot", "apply", "client_closed")
FORKS = Counter("sandman_controller_forks_total", "Forks by result", ["result"])
FORK_CHILDREN = Counter("sandman_controller_fork_children_total",
                        "Children handed out by forks that succeeded")
FORK_SECONDS = Histogram("sandman_controller_fork_seconds",
                         "Fork latency of the forks that succeeded (children acquired and the "
                         "parent's state applied to each)",
                         buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600))
FORK_SNAPSHOT_BYTES = Histogram("sandman_controller_fork_snapshot_bytes",
                                "Size of the parent's state each fork copied",
                                buckets=(1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 23, 1 << 26,
                                         1 << 28, 1 << 30, 1 << 32))
# A group acquire's end (controller/group.py): ok; refused (it can never fit under a cap, or a
# bad request); acquire (a member could not be had: timeout, queue full, a failed pod);
# client_closed (the caller left). Every failure released the members already handed out.
GROUP_RESULTS = ("ok", "refused", "acquire", "client_closed")
GROUPS = Counter("sandman_controller_groups_total", "Group acquires by result", ["result"])
GROUP_SANDBOXES = Counter("sandman_controller_group_sandboxes_total",
                          "Sandboxes handed out by group acquires that succeeded, by whether "
                          "the warm pool served them", ["warm"])
GROUP_SECONDS = Histogram("sandman_controller_group_seconds",
                          "Group acquire latency of the groups that succeeded (to the last "
                          "member ready)",
                          buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600))
# Checkpoints (controller/checkpoint.py), by how each call ended: ok; refused (a grading
# sandbox, one not handed out, checkpoints off, another tenant's id); snapshot (an execd could
# not give its state); registry (the registry refused or failed); tampered (an artifact not
# the bytes its digest names, or not a checkpoint of that tenant); size (over the bound);
# client_closed. A restore: the same but snapshot, and acquire / apply (a sandbox of it could
# not be had, or refused the state).
CHECKPOINT_RESULTS = ("ok", "refused", "snapshot", "registry", "tampered", "size",
                      "client_closed")
RESTORE_RESULTS = ("ok", "refused", "registry", "tampered", "size", "acquire", "apply",
                   "client_closed")
CHECKPOINTS = Counter("sandman_controller_checkpoints_total", "Checkpoints by result",
                      ["result"])
CHECKPOINT_BYTES = Histogram("sandman_controller_checkpoint_bytes",
                             "State bytes of each checkpoint that succeeded (all its sandboxes)",
                             buckets=(1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 23, 1 << 26,
                                      1 << 28, 1 << 30, 1 << 32, 1 << 34))
CHECKPOINT_SECONDS = Histogram("sandman_controller_checkpoint_seconds",
                               "Latency of the checkpoints that succeeded",
                               buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600))
RESTORES = Counter("sandman_controller_restores_total", "Checkpoint restores by result",
                   ["result"])
RESTORED_SANDBOXES = Counter("sandman_controller_restored_sandboxes_total",
                             "Sandboxes handed out by restores that succeeded")
RESTORE_SECONDS = Histogram("sandman_controller_restore_seconds",
                            "Latency of the restores that succeeded",
                            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600))
# A restore that succeeded, phase by phase (controller/checkpoint.py): read (the set's index
# and each sandbox's manifest), fetch (every state's bytes, checked), sandboxes (acquired and
# each given its state). They run one after the other, so they sum to restore_seconds.
RESTORE_PHASES = ("read", "fetch", "sandboxes")
RESTORE_PHASE_SECONDS = Histogram("sandman_controller_restore_phase_seconds",
                                  "Time of each phase of the restores that succeeded",
                                  ["phase"],
                                  buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120,
                                           300, 600))
CHECKPOINTS_EXPIRED = Counter("sandman_controller_checkpoints_expired_total",
                              "Checkpoints the TTL sweep deleted from the registry")
# The idle rule (controller/idle.py): ok paused (checkpointed, then released); failed its
# checkpoint failed (left leased, backed off); used the holder called execd during the
# checkpoint (left leased, the checkpoint expires unused).
IDLE_PAUSE_RESULTS = ("ok", "failed", "used")
IDLE_PAUSES = Counter("sandman_controller_idle_pauses_total",
                      "Sandboxes the idle rule paused or tried to, by result", ["result"])

# Capacity signals (controller/events.py). Create stored -> Ready and execd answering, by role
# (sandman.contract.ROLES). Buckets from the paper's figures: 2 s at 2 vCPU, 4.1 s p50 with the
# image present, 5-7 s for tiny pods, 17.4 s p50 / 74.3 s p90 when the node pulled, the
# unspread ramp's p99 of 50-100 s, the old fixed 120 s budget and the campaigns' 300 s.
CREATE_TO_READY_SECONDS = Histogram(
    "sandman_controller_create_to_ready_seconds",
    "Create stored to Ready (execd answering), by role", ["role"],
    buckets=(.5, 1, 2, 3, 4, 5, 7.5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 300, 600))
# The kubelet's Pulled message on sandman's pods. Buckets: a 43 MB image pulled in 0.17 s, the
# pooled pull median 13.5 s, the median of per-image medians 33.4 s, 0.58% of pulls over 120 s,
# the largest tercile's p90 153 s.
IMAGE_PULL_SECONDS = Histogram(
    "sandman_controller_image_pull_seconds",
    "Image pull time of sandman's pods, from the kubelet's Pulled events",
    buckets=(.25, .5, 1, 2, 5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 300, 600))
# FailedCreatePodSandBox events (how the network plugin reports an address it could not
# assign): on this controller's pods (matched by uid) or any other pod of the cluster.
FAILURE_SCOPES = ("sandman", "other")
POD_ADDRESS_FAILURES = Counter(
    "sandman_controller_pod_address_failures_total",
    "FailedCreatePodSandBox events by scope: sandman (this controller's pods), other (every "
    "other pod of the cluster)", ["scope"])
for _s in FAILURE_SCOPES:
    POD_ADDRESS_FAILURES.labels(_s)
# Image pre-pull (controller/prepull.py): one per (node, image) puller with an outcome, and
# the pairs still waiting for one (the progress; GET /v1/images has it per image).
PREPULL_RESULTS = ("pulled", "failed")
IMAGES_PREPULLED = Counter(
    "sandman_controller_images_prepulled_total",
    "Image pre-pulls onto a node by result: pulled (the node has the image), failed (the "
    "kubelet could not pull it, or no outcome by the puller's deadline)", ["result"])
for _r in PREPULL_RESULTS:
    IMAGES_PREPULLED.labels(_r)
PREPULL_PENDING = Gauge("sandman_controller_images_prepull_pending",
                        "(node, image) pre-pulls not finished yet")
# The HTTP API, per route (controller/routes.py RequestContext). `route` is the template the
# call matched (sandman.api.ROUTES), `unmatched` when none did: the raw path carries ids and
# anything a caller makes up, so it is never a label. `code` is the answer's status among those
# the API gives (sandman.api.ERRORS' and the framework's), else `other`.
ROUTE_TEMPLATES = tuple(dict.fromkeys(r.path for r in api.ROUTES)) + ("unmatched",)
METHODS = ("GET", "POST", "DELETE", "PUT", "PATCH", "HEAD", "OPTIONS")
CODES = tuple(str(c) for c in sorted({200, 201, 307, 404, 405, 500}
                                     | {e.status for e in api.ERRORS})) + ("other",)
HTTP_REQUESTS = Counter("sandman_controller_http_requests_total",
                        "API requests by route template, method and status code",
                        ["route", "method", "code"])
# From a /livez (~1 ms) to an acquire that waits out a cold pull (minutes).
HTTP_SECONDS = Histogram("sandman_controller_http_request_duration_seconds",
                         "API request latency (to the end of the answer) by route template and "
                         "method", ["route", "method"],
                         buckets=(.001, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60,
                                  120, 300, 600))
BUILD_INFO = buildinfo.register("controller")

# ---- deprecated names ------------------------------------------------------------------------
# The names before the metrics followed Prometheus' naming rules (one unit per metric, the unit
# in the name, no label in the name), still exported with the same values for one release so
# dashboards and alerts built on them keep working while they move; docs/metrics.md lists each
# with its replacement. Remove them in the release after next.
BUDGET_RESOURCES = ("pods", "cpu")
LIMITS = ("rate", "burst", "max_creating", "max_live")
_OLD = "Deprecated, removed in the next release: use "
DEPRECATED_WARM_BUDGET_USE = Gauge(
    "sandman_controller_warm_budget_use", _OLD + "sandman_controller_warm_budget_used_pods and "
    "sandman_controller_warm_budget_used_cpu_cores", ["resource"])
DEPRECATED_WARM_BUDGET = Gauge(
    "sandman_controller_warm_budget", _OLD + "sandman_controller_warm_budget_pods and "
    "sandman_controller_warm_budget_cpu_cores", ["resource"])
DEPRECATED_QUEUE_DEPTH = Gauge("sandman_controller_queue_depth",
                               _OLD + "sum(sandman_controller_queued_acquires)")
DEPRECATED_QUEUE_BY_ROLE = Gauge("sandman_controller_queue_depth_by_role",
                                 _OLD + "sandman_controller_queued_acquires", ["role"])
DEPRECATED_CREATE_RATE = Gauge("sandman_controller_create_rate",
                               _OLD + "sandman_controller_create_rate_per_second")
DEPRECATED_LIMIT = Gauge(
    "sandman_controller_limit", _OLD + "sandman_controller_max_create_rate_per_second, "
    "sandman_controller_max_create_burst, sandman_controller_max_creating_pods and "
    "sandman_controller_max_live_pods", ["limit"])
# Old name -> what replaces it (docs/metrics.md "Deprecated names" says the same).
DEPRECATED = {
    "sandman_controller_warm_budget_use": ("sandman_controller_warm_budget_used_pods",
                                           "sandman_controller_warm_budget_used_cpu_cores"),
    "sandman_controller_warm_budget": ("sandman_controller_warm_budget_pods",
                                       "sandman_controller_warm_budget_cpu_cores"),
    "sandman_controller_queue_depth": ("sandman_controller_queued_acquires",),
    "sandman_controller_queue_depth_by_role": ("sandman_controller_queued_acquires",),
    "sandman_controller_create_rate": ("sandman_controller_create_rate_per_second",),
    "sandman_controller_limit": ("sandman_controller_max_create_rate_per_second",
                                 "sandman_controller_max_create_burst",
                                 "sandman_controller_max_creating_pods",
                                 "sandman_controller_max_live_pods"),
}


def _warm(warm: bool) -> str:
    return "true" if warm is True else "false"


def acquired(result: str, warm: bool, seconds: float | None = None) -> None:
    ACQUIRES.labels(bounded(result, ACQUIRE_RESULTS), _warm(warm)).inc()
    if seconds is not None:
        ACQUIRE_SECONDS.labels(_warm(warm)).observe(seconds)


def created(result: str) -> None:
    CREATES.labels(bounded(result, CREATE_RESULTS)).inc()


def conditions_refused(field: str) -> None:
    CONDITIONS_REFUSED.labels(bounded(field, CONDITION_LABELS)).inc()


def deleted(result: str) -> None:
    DELETES.labels(bounded(result, DELETE_RESULTS)).inc()


def expired(renewed: bool) -> None:
    EXPIRED.labels(_warm(renewed)).inc()


def lease_lost(reason: str) -> None:
    LEASES_LOST.labels(bounded(reason, LOST_REASONS)).inc()


def renewed(result: str) -> None:
    RENEWS.labels(bounded(result, RENEW_RESULTS)).inc()


def retired(reason: str) -> None:
    RETIREMENTS.labels(bounded(reason, RETIRE_REASONS)).inc()


def shadowed(outcome: str) -> None:
    SHADOW_GRADINGS.labels(bounded(outcome, contract.SHADOW_OUTCOMES)).inc()


def forked(result: str, children: int = 0, seconds: float | None = None) -> None:
    FORKS.labels(bounded(result, FORK_RESULTS)).inc()
    if children:
        FORK_CHILDREN.inc(children)
    if seconds is not None:
        FORK_SECONDS.observe(seconds)


def grouped(result: str, leases: list[dict] | None = None,
            seconds: float | None = None) -> None:
    GROUPS.labels(bounded(result, GROUP_RESULTS)).inc()
    for lease in leases or ():
        GROUP_SANDBOXES.labels("true" if lease.get("warm") else "false").inc()
    if seconds is not None:
        GROUP_SECONDS.observe(seconds)


def idle_paused(result: str) -> None:
    IDLE_PAUSES.labels(bounded(result, IDLE_PAUSE_RESULTS)).inc()


def checkpointed(result: str, sandboxes: int = 0, seconds: float | None = None,
                 size: int | None = None) -> None:
    CHECKPOINTS.labels(bounded(result, CHECKPOINT_RESULTS)).inc()
    if seconds is not None:
        CHECKPOINT_SECONDS.observe(seconds)
    if size is not None:
        CHECKPOINT_BYTES.observe(size)


def restored(result: str, sandboxes: int = 0, seconds: float | None = None,
             phases: dict[str, float] | None = None) -> None:
    RESTORES.labels(bounded(result, RESTORE_RESULTS)).inc()
    if sandboxes:
        RESTORED_SANDBOXES.inc(sandboxes)
    if seconds is not None:
        RESTORE_SECONDS.observe(seconds)
    for phase, took in (phases or {}).items():
        RESTORE_PHASE_SECONDS.labels(phase).observe(took)  # keys: RESTORE_PHASES only


def warm_lookup(role: str, hit: bool) -> None:
    WARM_LOOKUPS.labels(bounded(role, contract.ROLES), "hit" if hit else "miss").inc()


def warm_idle(pod_seconds: float, cpu_seconds: float) -> None:
    WARM_IDLE_POD_SECONDS.inc(pod_seconds)
    WARM_IDLE_CPU_SECONDS.inc(cpu_seconds)


def warm_budget(pods: int, pods_budget: int, cpu: float, cpu_budget: float) -> None:
    WARM_BUDGET_USED_PODS.set(pods)
    WARM_BUDGET_USED_CORES.set(cpu)
    WARM_BUDGET_PODS.set(pods_budget)
    WARM_BUDGET_CORES.set(cpu_budget)
    DEPRECATED_WARM_BUDGET_USE.labels("pods").set(pods)
    DEPRECATED_WARM_BUDGET_USE.labels("cpu").set(cpu)
    DEPRECATED_WARM_BUDGET.labels("pods").set(pods_budget)
    DEPRECATED_WARM_BUDGET.labels("cpu").set(cpu_budget)


def queued(by_role: dict[str, int]) -> None:
    """The pacer's waiting acquires by role (controller.pacer.Pacer.queue_by_role)."""
    for role in contract.ROLES:
        QUEUED_ACQUIRES.labels(role).set(by_role.get(role, 0))
        DEPRECATED_QUEUE_BY_ROLE.labels(role).set(by_role.get(role, 0))
    DEPRECATED_QUEUE_DEPTH.set(sum(by_role.get(role, 0) for role in contract.ROLES))


def illegal_transition(frm: str, to: str) -> None:
    ILLEGAL_TRANSITIONS.labels(bounded(frm, STATES), bounded(to, STATES)).inc()


def pacing(limits, rate: float) -> None:
    """`limits` is a controller.pacer.Limits (not imported: the pacer imports nothing of this)."""
    CREATE_RATE.set(rate)
    MAX_CREATE_RATE.set(limits.rate)
    MAX_CREATE_BURST.set(limits.burst)
    MAX_CREATING.set(limits.max_creating)
    MAX_LIVE.set(limits.max_live)
    DEPRECATED_CREATE_RATE.set(rate)
    for name in LIMITS:
        DEPRECATED_LIMIT.labels(name).set(getattr(limits, name))


def foreign(reason: str) -> None:
    FOREIGN_PODS.labels(bounded(reason, FOREIGN_REASONS)).inc()


def create_to_ready(role: str, seconds: float) -> None:
    CREATE_TO_READY_SECONDS.labels(bounded(role, contract.ROLES, contract.ROLE_AGENT)).observe(
        seconds)


def pod_address_failures(scope: str, n: int = 1) -> None:
    POD_ADDRESS_FAILURES.labels(bounded(scope, FAILURE_SCOPES)).inc(n)


def prepulled(result: str) -> None:
    IMAGES_PREPULLED.labels(bounded(result, PREPULL_RESULTS, "failed")).inc()


def http_request(route: str | None, method: str, code: int, seconds: float) -> None:
    """One API call: `route` the matched route's template (None: no route matched)."""
    r = bounded(route or "unmatched", ROUTE_TEMPLATES, "unmatched")
    m = bounded(method, METHODS)
    HTTP_REQUESTS.labels(r, m, bounded(str(code), CODES)).inc()
    HTTP_SECONDS.labels(r, m).observe(seconds)
