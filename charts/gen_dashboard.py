"""Write charts/sandman/files/dashboard.json, the Grafana dashboard the chart ships in a
ConfigMap for Grafana's dashboard sidecar (templates/dashboard-configmap.yaml,
`grafanaDashboard.enabled`).

Generated, not hand-edited: panels are laid out on the grid here, and every query uses only
metrics the components export (tests/charts/test_monitoring.py parses each query and checks
its names against the registries; docs/metrics.md lists them). The file is committed so the
chart needs no Python; the test fails when it is stale. Regenerate with
`.venv/bin/python charts/gen_dashboard.py` (or `make chart-golden`).
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "charts" / "sandman" / "files" / "dashboard.json"
UID = "sandman-overview"
DS = {"type": "prometheus", "uid": "${datasource}"}
NS = 'namespace="$namespace"'
RI = "[$__rate_interval]"
OK, WARM, DENIED = 'result="ok"', 'warm="true"', 'decision="denied"'


def sel(*matchers: str) -> str:
    return "{" + ",".join((NS,) + matchers) + "}"


def target(expr: str, legend: str = "", ref: str = "A", **kw) -> dict:
    t = {"datasource": DS, "expr": expr, "legendFormat": legend or "__auto", "refId": ref}
    t.update(kw)
    return t


def quantiles(metric: str, by: str, legend: str) -> list[dict]:
    """p50 and p99 of a histogram, per `by` label(s)."""
    group = f"le, {by}" if by else "le"
    return [target(f"histogram_quantile({q}, sum by ({group}) "
                   f"(rate({metric}_bucket{sel()}{RI})))", f"p{int(q * 100)} {legend}".strip(),
                   ref)
            for q, ref in ((0.5, "A"), (0.99, "B"))]


class Layout:
    def __init__(self) -> None:
        self.panels: list[dict] = []
        self.y = 0
        self.x = 0
        self.next_id = 1

    def row(self, title: str) -> None:
        if self.x:
            self.y += 8
            self.x = 0
        self.panels.append({"type": "row", "title": title, "id": self._id(), "collapsed": False,
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}, "panels": []})
        self.y += 1

    def panel(self, title: str, description: str, targets: list[dict], kind: str = "timeseries",
              unit: str = "short", w: int = 12, h: int = 8, **extra) -> None:
        if self.x + w > 24:
            self.y += h
            self.x = 0
        p = {"type": kind, "title": title, "description": description, "id": self._id(),
             "datasource": DS, "targets": targets,
             "gridPos": {"h": h, "w": w, "x": self.x, "y": self.y},
             "fieldConfig": {"defaults": {"unit": unit}, "overrides": []}}
        if kind == "timeseries":
            p["options"] = {"legend": {"displayMode": "table", "placement": "right",
                                       "calcs": ["max", "lastNotNull"]},
                            "tooltip": {"mode": "multi", "sort": "desc"}}
        p.update(extra)
        self.panels.append(p)
        self.x += w
        if self.x >= 24:
            self.x = 0
            self.y += h

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1


def thresholds(*steps: tuple[str, float | None]) -> dict:
    return {"mode": "absolute",
            "steps": [{"color": color, "value": value} for color, value in steps]}


def dashboard() -> dict:
    L = Layout()
    acq = "sandman_controller_acquires_total"

    L.row("Acquires (the trainers' view)")
    L.panel("Acquires/s by result",
            "Acquire requests per second by result (ok, timeout, failed, queue_full). "
            "Anything but ok during a burst: see the queue and the creates below.",
            [target(f"sum by (result) (rate({acq}{sel()}{RI}))", "{{result}}")], unit="reqps")
    L.panel("Acquire latency (queue included)",
            "p50/p99 acquire latency by warm (true: handed out from the warm pool).",
            quantiles("sandman_controller_acquire_seconds", "warm", "warm={{warm}}"), unit="s")
    L.panel("Queue depth",
            "Acquires waiting for a create slot (leader only), by role. Growing for minutes: "
            "the caps or the rate are too low, or pods are not becoming Ready.",
            [target(f"sum by (role) (sandman_controller_queued_acquires{sel()})",
                    "{{role}}")])
    L.panel("Queue wait",
            "Time from enqueue to a create slot (the pacing wait), p50/p99.",
            quantiles("sandman_controller_queue_seconds", "", ""), unit="s")
    L.panel("Warm hits",
            "Share of successful acquires served from the warm pool (no create on their "
            "path).",
            [target(f'sum(rate({acq}{sel(OK, WARM)}{RI})) / '
                    f'sum(rate({acq}{sel(OK)}{RI}))', "warm share")], unit="percentunit")
    L.panel("Renews/s by result",
            "Lifetime renews from the SDK while a sandbox is open.",
            [target(f"sum by (result) (rate(sandman_controller_renews_total{sel()}{RI}))",
                    "{{result}}")], unit="reqps")

    L.row("Creates and pods (the cluster's view)")
    L.panel("Creates/s vs pacing limit",
            "Pod creates per second by outcome, against the create bucket's current rate "
            "(lowered by back-off after 429/5xx) and the configured controller.rate.",
            [target(f"sum by (result) (rate(sandman_controller_creates_total{sel()}{RI}))",
                    "{{result}}"),
             target(f"max(sandman_controller_create_rate_per_second{sel()})", "current limit",
                    "B"),
             target(f"max(sandman_controller_max_create_rate_per_second{sel()})",
                    "configured rate", "C")], unit="reqps")
    L.panel("Live and creating pods",
            "Pods the controller owns (any state) and creates in flight + pods not yet Ready, "
            "against controller.maxCreating.",
            [target(f"sum(sandman_controller_live_pods{sel()})", "live"),
             target(f"sum(sandman_controller_creating_pods{sel()})", "creating", "B"),
             target(f"max(sandman_controller_max_creating_pods{sel()})", "max creating",
                    "C")])
    L.panel("API back-off and deletes",
            "API answers (429/5xx) that halved the create rate, and pod deletes by outcome.",
            [target(f"sum(rate(sandman_controller_api_backoff_total{sel()}{RI}))", "back-off"),
             target(f"sum by (result) (rate(sandman_controller_deletes_total{sel()}{RI}))",
                    "delete {{result}}", "B")], unit="reqps")
    L.panel("Expired, swept and parked",
            "Per 5 min: handed-out sandboxes deleted when their lifetime ran out "
            "(renewed=true: a renewing trainer went away), ownerless pods the sweep deleted, "
            "and pods kept warm because their caller left after the create.",
            [target(f"sum by (renewed) (increase(sandman_controller_expired_total{sel()}[5m]))",
                    "expired renewed={{renewed}}"),
             target(f"sum(increase(sandman_controller_swept_total{sel()}[5m]))", "swept", "B"),
             target(f"sum(increase(sandman_controller_parked_total{sel()}[5m]))", "parked",
                    "C")])

    L.row("Capacity (the nodes' view)")
    L.panel("Create to Ready",
            "p50/p99 from a create stored to its pod Ready and execd answering, by role. "
            "About 5 s with the image on the node; pulls and address failures make the tail.",
            quantiles("sandman_controller_create_to_ready_seconds", "role", "{{role}}"),
            unit="s", w=8)
    L.panel("Image pulls",
            "p50/p99 image pull time of sandbox pods, from the kubelet's Pulled events.",
            quantiles("sandman_controller_image_pull_seconds", "", ""), unit="s", w=8)
    L.panel("Pod-address failures/min by scope",
            "FailedCreatePodSandBox events a minute: sandman (sandbox pods) and other (every "
            "other tenant's pods, cluster-wide). A rise of other while sandman bursts is harm "
            "to the co-tenants: slow the creates.",
            [target("sum by (scope) (rate(sandman_controller_pod_address_failures_total"
                    f"{sel()}{RI})) * 60", "{{scope}}")], w=8)
    L.panel("Image pre-pull",
            "(node, image) pre-pulls still pending, and outcomes a minute: pulled (the node has "
            "the image) or failed (GET /v1/images names the nodes and the kubelet's reasons).",
            [target(f"sum(sandman_controller_images_prepull_pending{sel()})", "pending"),
             target("sum by (result) (rate(sandman_controller_images_prepulled_total"
                    f"{sel()}{RI})) * 60", "{{result}}/min", "B")], w=24)

    L.row("Grading pods (conditions and checked reuse)")
    L.panel("Pods refused by declared conditions",
            "Per 5 min, by field: pods deleted at hand-out because a reading contradicted a "
            "declared run condition (probe: the pod did not answer). Steady refusals of one "
            "field: the node pool cannot meet what the trainers declare.",
            [target("sum by (field) (increase(sandman_controller_conditions_refused_total"
                    f"{sel()}[5m]))", "{{field}}")])
    L.panel("Reuse and retirements",
            "Per 5 min: grading pods restored, found clean and parked again; pods deleted "
            "instead (retired by the caller, or reused --max-reuse times); restores that "
            "failed or left /diff unclean (those pods are deleted too).",
            [target(f"sum(increase(sandman_controller_reuses_total{sel()}[5m]))", "reused"),
             target("sum by (reason) (increase(sandman_controller_retirements_total"
                    f"{sel()}[5m]))", "retired {{reason}}", "B"),
             target(f"sum(increase(sandman_controller_restore_failures_total{sel()}[5m]))",
                    "restore failed", "C")])

    L.row("Controller API")
    L.panel("API requests/s by route and status",
            "Calls to the controller's API by route template and HTTP status (unmatched: no "
            "route; 5xx: see the controller log, each line carries the call's request_id).",
            [target(f"sum by (route, code) "
                    f"(rate(sandman_controller_http_requests_total{sel()}{RI}))",
                    "{{route}} {{code}}")], unit="reqps")
    L.panel("API latency by route",
            "p50/p99 of each route's calls to the end of the answer (an acquire includes its "
            "queue and pod start; a get or list should stay in milliseconds).",
            quantiles("sandman_controller_http_request_duration_seconds", "route",
                      "{{route}}"), unit="s")

    L.row("Webhook")
    L.panel("Admission decisions/s",
            "Admission requests by operation and decision. error: webhook logs.",
            [target(f"sum by (operation, decision) "
                    f"(rate(sandman_webhook_requests_total{sel()}{RI}))",
                    "{{operation}} {{decision}}")], unit="reqps")
    L.panel("Denied by rule",
            "Denials by the rule that refused (a rise of one rule: a client builds bad "
            "sandboxes), over the last hour.",
            [target(f'topk(10, sum by (reason) (increase(sandman_webhook_requests_total'
                    f'{sel(DENIED)}[1h])))', "{{reason}}")])
    L.panel("Handler latency",
            "Time in the admission handler, p50/p99 by operation (a few ms is healthy; "
            "> 100 ms: CPU throttling).",
            quantiles("sandman_webhook_handler_seconds", "operation", "{{operation}}"),
            unit="s")
    L.panel("Connections and certificate reloads",
            "New client connections/s (each a TLS handshake: a fast rise means clients are "
            "not keeping connections) and certificate reloads by result.",
            [target(f"sum(rate(sandman_webhook_connections_total{sel()}{RI}))", "connections"),
             target(f"sum by (result) "
                    f"(rate(sandman_webhook_certificate_reloads_total{sel()}{RI}))",
                    "reload {{result}}", "B")], unit="reqps")

    L.row("Health")
    L.panel("Webhook certificate expires in",
            "Time until the serving certificate in use expires (smallest over replicas). "
            "Below 14 days the renewal CronJob is failing (alert SandmanCertificateExpiring).",
            [target(f"min(sandman_webhook_certificate_expiry_timestamp_seconds{sel()}) - time()",
                    "expires in")], kind="stat", unit="s", w=6,
            fieldConfig={"defaults": {"unit": "s", "thresholds": thresholds(
                ("red", None), ("orange", 14 * 86400), ("green", 30 * 86400))},
                "overrides": []})
    L.panel("Leaders",
            "Controller replicas holding the Lease: exactly 1 is healthy.",
            [target(f"sum(sandman_controller_leader{sel()})", "leaders")], kind="stat", w=6,
            fieldConfig={"defaults": {"unit": "short", "thresholds": thresholds(
                ("red", None), ("green", 1), ("red", 2))}, "overrides": []})
    L.panel("Leader by pod",
            "Which controller pod held the Lease over time.",
            [target(f"sum by (pod) (sandman_controller_leader{sel()})", "{{pod}}")])
    L.panel("Illegal state transitions",
            "Entry state changes the controller's transition table refused (always a bug: "
            "file an issue with the controller log), per hour.",
            [target(f"sum by (from_state, to_state) "
                    f"(increase(sandman_controller_illegal_transitions_total{sel()}[1h]))",
                    "{{from_state}} -> {{to_state}}")])
    L.panel("Builds",
            "sandman_build_info: the version and revision each pod runs.",
            [target(f"sum by (component, version, revision, pod) (sandman_build_info{sel()})",
                    "", format="table", instant=True)], kind="table")

    return {
        "uid": UID, "title": "sandman", "tags": ["sandman"], "timezone": "utc",
        "schemaVersion": 39, "version": 1, "editable": True, "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "description": "sandman during a burst: acquires, pacing, pods, webhook, health "
                       "(docs/metrics.md lists every metric; docs/operations.md the alerts).",
        "annotations": {"list": []},
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource",
             "query": "prometheus", "current": {}, "hide": 0},
            {"name": "namespace", "label": "Namespace", "type": "query", "datasource": DS,
             "query": {"query": "label_values(sandman_build_info, namespace)",
                       "refId": "namespace"},
             "definition": "label_values(sandman_build_info, namespace)",
             "refresh": 2, "current": {}, "hide": 0, "includeAll": False, "multi": False},
        ]},
        "panels": L.panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=1, sort_keys=True) + "\n"


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(render())
    print(f"wrote {OUT.relative_to(ROOT)}")
