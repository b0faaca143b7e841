"""What every locustfile installs: sandman's command-line options and the run's life cycle
(the pod watch and stats sampler on start; releases, leak audit, thresholds and the JSON
summary on stop). The pieces: loadtest/users.py (the SDK and its locust events),
loadtest/run.py (request types, the run record, thresholds), loadtest/watch.py (pod watch,
stats sampler), loadtest/audit.py (leak audit)."""

from __future__ import annotations

import json
import logging
import os
import secrets
import time

import gevent
import gevent.event
from locust import events
from locust.runners import MasterRunner, WorkerRunner

from loadtest import cotenant, users
from loadtest.audit import (
    IN_CLUSTER,
    core_api,
    default_kubeconfig,
    default_tenant,
    describe,
    job_label,
    leak_audit,
)
from loadtest.run import (
    COTENANT_STOP,
    EXIT_OK,
    EXIT_THRESHOLDS,
    LEAK,
    RUN,
    RequestFailed,
    check_thresholds,
    fire,
    write_summary,
)
from loadtest.watch import sample_stats, watch_pods
from sandman import contract
from sandman.client._core import ENV_URL

log = logging.getLogger("loadtest")

DEFAULT_IMAGE = "registry.invalid/loadtest/task:1"  # kwok never pulls it; a real cluster would


# ---- command line -------------------------------------------------------------------------

@events.init_command_line_parser.add_listener
def _args(parser) -> None:
    g = parser.add_argument_group("sandman")
    # The SDK's in-cluster names (docs/sdk.md): the users' Client also reads
    # $SANDMAN_TOKEN_FILE and $SANDMAN_CA_FILE, so a locust pod authenticates like a trainer.
    g.add_argument("--controller-url", default=os.environ.get(ENV_URL, "http://127.0.0.1:8080"),
                   help=f"default: ${ENV_URL}")
    g.add_argument("--kubeconfig", default=default_kubeconfig(),
                   help=f"a kubeconfig file, or `{IN_CLUSTER}` (the pod's ServiceAccount); "
                        "enables the POD_READY watch and the leak audit (default: $KUBECONFIG, "
                        f"else `{IN_CLUSTER}` inside a pod)")
    g.add_argument("--namespace", default="sandboxes", help="the controller's namespace")
    g.add_argument("--tenant", default=None,
                   help="the tenant the controller files the run's sandboxes under (their job "
                        "label is <tenant>.<job>); default: $SANDMAN_TENANT, else in a pod its "
                        "ServiceAccount's namespace, else none (a controller under --auth none)")
    g.add_argument("--job", default="", help="job name of the run (default: lt-<random>)")
    g.add_argument("--image", default=DEFAULT_IMAGE)
    g.add_argument("--cpu", default="100m")
    g.add_argument("--memory", default="128Mi")
    g.add_argument("--acquire-timeout-s", type=float, default=300.0)
    g.add_argument("--max-p99-ms", type=float, default=0.0,
                   help="fail the run when the primary request type's p99 is above (0: off)")
    g.add_argument("--max-error-rate", type=float, default=0.0,
                   help="fail the run when failures/requests is above this (0.0: any failure)")
    g.add_argument("--max-leaked", type=int, default=0,
                   help="fail the run when more pods of its job remain (-1: no audit)")
    g.add_argument("--leak-settle-s", type=float, default=60.0,
                   help="how long released pods may take to disappear before they count")
    g.add_argument("--sandman-json", default="",
                   help="the run summary (default: <--csv prefix>_sandman.json)")
    # The co-tenant stop rule (loadtest/cotenant.py, docs/loadtest.md): off unless a baseline
    # window is given, since it lists events and pods cluster-wide (RBAC a tenant may lack).
    c = parser.add_argument_group("co-tenant stop rule")
    c.add_argument("--cotenant-baseline-s", type=float, default=0.0,
                   help="measure other tenants' pod failures this long before the run, then "
                        "stop the run (exit 3) when they rise above the rule (0: no rule; "
                        "120 on a shared cluster)")
    c.add_argument("--cotenant-window-s", type=float, default=cotenant.StopRule.window_s,
                   help="the window the run's failure rate is measured over")
    c.add_argument("--cotenant-max-ratio", type=float, default=cotenant.StopRule.max_ratio,
                   help="stop above this many times the baseline rate ...")
    c.add_argument("--cotenant-min-excess", type=float, default=cotenant.StopRule.min_excess,
                   help="... and above the baseline plus this many failures a minute")
    c.add_argument("--cotenant-poll-s", type=float, default=cotenant.StopRule.poll_s,
                   help="how often the cluster's events and failed pods are listed")
    c.add_argument("--cotenant-exclude-namespace", action="append", default=[],
                   metavar="NS", help="another namespace of the run itself (--namespace is "
                                      "always excluded), e.g. the locust Job's")


def opts(env):
    return env.parsed_options


def is_worker(env) -> bool:
    return isinstance(env.runner, WorkerRunner)


def job_of(env) -> str:
    if not RUN.job:
        RUN.job = opts(env).job or f"lt-{secrets.token_hex(3)}"
    return RUN.job


# ---- distributed runs (--master / --worker; loadtest/job.py --workers N) ----------------------
# The users run on the workers, everything about the run as a whole on the master: the shape
# (which advances on live and finished counts), the pod watch, the stats sampler, the leak
# audit, the thresholds (over locust's aggregated stats) and the summary. A worker only
# releases what its own users hold, and reports its counts and acquire rows to the master.

COUNTS = "sandman_counts"
COUNTS_EVERY_S = 0.5
_WORKERS: dict[str, tuple[int, int]] = {}  # worker id -> its (live, done)
_SENT: list[int] = [0]  # acquire rows a worker has sent


def _on_counts(environment, msg, **kw) -> None:
    """Master: a worker's live and finished counts, and its new acquire rows."""
    _WORKERS[msg.node_id] = (int(msg.data["live"]), int(msg.data["done"]))
    RUN.live = sum(v[0] for v in _WORKERS.values())
    RUN.done = sum(v[1] for v in _WORKERS.values())
    RUN.acquires.extend(msg.data["acquires"])
    w = RUN.extra.setdefault("workers", {}).setdefault(msg.node_id, {"done": 0, "acquires": 0})
    w["done"] = _WORKERS[msg.node_id][1]
    w["acquires"] += len(msg.data["acquires"])


def _send_counts(environment) -> None:
    rows = RUN.acquires[_SENT[0]:]
    _SENT[0] += len(rows)
    environment.runner.send_message(COUNTS, {"live": RUN.live, "done": RUN.done,
                                             "acquires": rows})


def report_counts(environment, stop: gevent.event.Event, max_s: float = 86400) -> None:
    """Worker: send the counts every COUNTS_EVERY_S until the run stops (test_stop sends the
    last ones itself, before the master's quit can kill this greenlet)."""
    deadline = time.monotonic() + max_s
    while not stop.wait(COUNTS_EVERY_S) and time.monotonic() < deadline:
        _send_counts(environment)


@events.init.add_listener
def _on_init_distributed(environment, **kw) -> None:
    o = opts(environment)
    if isinstance(environment.runner, MasterRunner):
        environment.runner.register_message(COUNTS, _on_counts)
        # The workers take the master's options with each spawn: they label the run the same.
        o.job = job_of(environment)


def label_of(env) -> str:
    """The run's pods' job label (the watch and the audit select on it)."""
    o = opts(env)
    tenant = default_tenant(o.kubeconfig) if o.tenant is None else o.tenant
    return job_label(tenant, job_of(env))


# ---- lifecycle: watch + samples on start; release, audit, thresholds, summary on stop ---------

_STOP = gevent.event.Event()
_PRIMARY: list[str] = []


def install(primary: list[str], uses_controller: bool = True) -> None:
    """Called by each locustfile: its primary request types (what --max-p99-ms applies to)."""
    _PRIMARY[:] = primary
    RUN.extra["uses_controller"] = uses_controller


def _rule(o) -> cotenant.StopRule:
    return cotenant.StopRule(baseline_s=o.cotenant_baseline_s, window_s=o.cotenant_window_s,
                         max_ratio=o.cotenant_max_ratio, min_excess=o.cotenant_min_excess,
                         poll_s=o.cotenant_poll_s)


_GUARD: list[cotenant.Guard] = []


def _one_line(e: BaseException) -> str:
    if getattr(e, "status", None) and getattr(e, "reason", None):  # kubernetes ApiException
        return f"API server answered {e.status} {e.reason}"  # type: ignore[attr-defined]
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else repr(e)


@events.init.add_listener
def _on_init(environment, **kw) -> None:
    """The co-tenant baseline, measured before the run starts (locust starts after `init`)."""
    o = opts(environment)
    if not o or o.cotenant_baseline_s == 0 or is_worker(environment):
        return
    rule = _rule(o)
    try:
        rule.check()
        if not o.kubeconfig:
            raise ValueError("the co-tenant stop rule needs --kubeconfig (it lists events and "
                             "pods cluster-wide)")
        guard = cotenant.Guard(cotenant.ClusterReader(core_api(o.kubeconfig)).read,
                               {o.namespace, *o.cotenant_exclude_namespace}, rule)
        log.info("co-tenant baseline: other tenants' pod failures for %g s", rule.baseline_s)
        base = guard.measure_baseline(gevent.sleep)
    except Exception as e:  # noqa: BLE001 - one line, before any sandbox exists
        raise SystemExit(f"loadtest: co-tenant stop rule: {_one_line(e)}") from None
    RUN.extra["cotenant"] = {"baseline_per_min": round(base, 3),
                             "baseline_count": guard.baseline_count,
                             "baseline_s": rule.baseline_s, "window_s": rule.window_s,
                             "threshold_per_min": round(rule.threshold(base), 3),
                             "own_namespaces": sorted(guard.tally.own), "stopped": None}
    log.info("co-tenant baseline: %.1f failures/min (%d in %g s); the run stops above %.1f/min",
             base, guard.baseline_count, rule.baseline_s, rule.threshold(base))
    _GUARD[:] = [guard]


def watch_cotenants(environment, guard: cotenant.Guard, stop: gevent.event.Event,
                    max_s: float = 86400) -> None:
    """Poll until the run ends; stop it when the rule fires, or when the guard has been blind
    (every read failing) for a whole window: an unwatched run is not allowed to go on."""
    rule = guard.rule
    state = RUN.extra["cotenant"]
    deadline = time.monotonic() + max_s
    while not stop.wait(rule.poll_s) and time.monotonic() < deadline:
        try:
            v = guard.poll()
        except Exception as e:  # noqa: BLE001 - a failed read, retried until blind too long
            log.warning("co-tenant guard: read failed: %s", _one_line(e))
            if guard.blind_s() < rule.window_s:
                continue
            line = (f"co-tenant stop rule: could not read the cluster for {guard.blind_s():.0f} s "
                    f"(> {rule.window_s:g} s window); stopping unwatched")
        else:
            state["last_per_min"] = round(v.per_min, 3)
            state["peak_per_min"] = max(state.get("peak_per_min", 0.0), round(v.per_min, 3))
            if not v.fired:
                continue
            line = v.line(rule, guard.baseline_per_min or 0.0)
        state["stopped"] = line
        state["stopped_at_s"] = RUN.rel()
        log.error("%s: stopping the run", line)
        if environment.runner is not None:
            environment.runner.quit()
        return


@events.test_start.add_listener
def _on_start(environment, **kw) -> None:
    o = opts(environment)
    RUN.t0 = time.time()  # the shape's clock starts here too
    job_of(environment)  # the run's job name is fixed at start
    if is_worker(environment):
        _STOP.clear()
        gevent.spawn(report_counts, environment, _STOP)
        return
    RUN.extra.update({"controller_url": o.controller_url, "namespace": o.namespace})
    if o.kubeconfig and RUN.extra.get("uses_controller"):
        try:
            core = core_api(o.kubeconfig)
            gevent.spawn(watch_pods, environment, core, o.namespace, label_of(environment),
                         _STOP)
            RUN.extra["watching"] = label_of(environment)
        except Exception as e:  # noqa: BLE001
            log.warning("no pod watch: %s", e)
    if RUN.extra.get("uses_controller"):
        gevent.spawn(sample_stats, o.controller_url, _STOP)
    if _GUARD:
        gevent.spawn(watch_cotenants, environment, _GUARD[0], _STOP)


@events.test_stop.add_listener
def _on_stop(environment, **kw) -> None:
    o = opts(environment)
    users.release_all()
    if is_worker(environment):
        _STOP.set()
        _send_counts(environment)  # the master audits and judges
        return
    if RUN.extra.get("uses_controller") and o.max_leaked >= 0:
        if not o.kubeconfig:
            RUN.audit = "skipped: no --kubeconfig"
        else:
            try:
                core = core_api(o.kubeconfig)
                label = label_of(environment)
                RUN.leaked = leak_audit(core, o.namespace, label, o.leak_settle_s)
                RUN.audit = f"{len(RUN.leaked)} pod(s) of job {label} left"
                cold = [a for a in RUN.acquires if a[2] and not a[3]]
                if "watching" in RUN.extra and cold and not RUN.pods:
                    # Sandboxes were created for the run but no pod carried the label the
                    # audit selects on: it would pass whatever was left (wrong --tenant).
                    RUN.audit = (f"failed: {len(cold)} sandbox(es) created, but the pod watch "
                                 f"saw no pod labelled {contract.LABEL_JOB}={label}; "
                                 "set --tenant")
                    RUN.leaked = ["<audit selects no pod of the run>"]
                if RUN.leaked:
                    RUN.extra["leaked_detail"] = describe(core, o.namespace, RUN.leaked)
                    log.warning("leaked: %s", json.dumps(RUN.extra["leaked_detail"]))
            except Exception as e:  # noqa: BLE001 - an audit that cannot run fails the run
                RUN.audit = f"failed: {e}"
                RUN.leaked = ["<audit failed>"]
            for name in RUN.leaked:
                fire(environment, LEAK, name, time.perf_counter(),
                     RequestFailed("pod still present after the run"))
    gevent.sleep(1.5)  # the watch's last Ready events
    _STOP.set()


@events.quitting.add_listener
def _on_quit(environment, **kw) -> None:
    o = opts(environment)
    if is_worker(environment):
        return  # the verdict is the master's, over the stats of every worker
    verdicts = check_thresholds(environment.stats, _PRIMARY, o.max_p99_ms, o.max_error_rate,
                                o.max_leaked, RUN.leaked, RUN.audit,
                                environment.runner.exceptions if environment.runner else None)
    stopped = (RUN.extra.get("cotenant") or {}).get("stopped")
    if stopped:
        verdicts.append((stopped, False))
    bad = [v for v in verdicts if not v[1]]
    for text, ok in verdicts:
        log.info("threshold %s: %s", "ok  " if ok else "FAIL", text)
    environment.process_exit_code = (COTENANT_STOP if stopped else EXIT_THRESHOLDS if bad
                                     else EXIT_OK)
    write_summary(environment, verdicts)
