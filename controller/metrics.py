"""Prometheus metrics. Label values come from fixed sets (bounded cardinality): results below,
never job names or pod names."""

from prometheus_client import Counter, Gauge, Histogram

ACQUIRES = Counter("sandman_controller_acquires_total", "Acquire requests by result",
                   ["result", "warm"])  # result: ok|timeout|failed|queue_full; warm: true|false
ACQUIRE_SECONDS = Histogram("sandman_controller_acquire_seconds",
                            "Acquire latency, queue included", ["warm"],
                            buckets=(.005, .01, .02, .05, .1, .25, .5, 1, 2, 5, 10, 30, 60, 120,
                                     300, 600))
QUEUE_SECONDS = Histogram("sandman_controller_queue_seconds", "Time from enqueue to create slot",
                          buckets=(.001, .01, .1, .5, 1, 5, 10, 30, 60, 120, 300, 600))
CREATES = Counter("sandman_controller_creates_total", "Create calls by outcome",
                  ["result"])  # ok|ok_after_conflict|ok_after_error|name_conflict|refused|transport_error
DELETES = Counter("sandman_controller_deletes_total", "Delete attempts by outcome",
                  ["result"])  # ok|gone|retry
API_BACKOFF = Counter("sandman_controller_api_backoff_total",
                      "API answers (429/5xx) that slowed the create bucket")
SWEPT = Counter("sandman_controller_swept_total", "Unowned pods deleted by the sweep")
PARKED = Counter("sandman_controller_parked_total",
                 "Pods whose caller left after the create, kept warm for reuse")
QUEUE_DEPTH = Gauge("sandman_controller_queue_depth", "Acquires waiting for a create slot")
LIVE = Gauge("sandman_controller_live_pods", "Pods the controller owns (any state)")
CREATING = Gauge("sandman_controller_creating_pods", "Creates in flight or pods not yet Ready")
LEADER = Gauge("sandman_controller_leader", "1 when this replica holds the Lease")
