"""What the locustfiles share: custom clients that fire `environment.events.request` with
sandman's own request types, the pod watch that reports create-to-Ready, the leak audit,
thresholds as the exit code, and the run's JSON summary for `loadtest/report.py`.

Request types (the "Type" column of locust's stats):
  ACQUIRE, RELEASE     the controller API (latency includes the pacing queue)
  EXEC, FILE_WRITE, FILE_READ   execd in a sandbox
  POD_CREATE, ADMISSION_REVIEW  the API server (dryRun=All) and the webhook, directly
  POD_READY            watch-derived: first seen by the watch -> Ready, per pod (reported apart
                       from the API call latency, as clusterloader2 does)
  LEAK                 one failure per pod of the run's job still present after the run
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gevent
import gevent.pool
import requests
from locust import events

from loadtest.audit import core_api, describe, leak_audit
from sandman import contract

log = logging.getLogger("loadtest")

ACQUIRE, RELEASE, EXEC = "ACQUIRE", "RELEASE", "EXEC"
FILE_WRITE, FILE_READ = "FILE_WRITE", "FILE_READ"
POD_CREATE, ADMISSION_REVIEW, POD_READY, LEAK = "POD_CREATE", "ADMISSION_REVIEW", "POD_READY", "LEAK"

DEFAULT_IMAGE = "registry.invalid/loadtest/task:1"  # kwok never pulls it; a real cluster would


class RequestFailed(Exception):
    """A failure as locust groups it: by type and status, never by a per-request name."""


@dataclass
class Run:
    """Per-process record of the run, written as `<csv prefix>_sandman.json`."""

    t0: float = field(default_factory=time.time)
    job: str = ""
    live: int = 0  # sandboxes acquired and not yet released
    done: int = 0  # users that finished their cycles
    acquires: list[list] = field(default_factory=list)  # [t_start, t_end, ok, warm, q, c, r]
    pods: dict[str, list] = field(default_factory=dict)  # name -> [first_seen, ready_seen]
    samples: list[list] = field(default_factory=list)  # [t, rate, queue, creating, live]
    leaked: list[str] = field(default_factory=list)
    audit: str = "not run"
    held: dict[str, Any] = field(default_factory=dict)  # sandbox id -> its ControllerClient
    plan: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    def rel(self, t: float | None = None) -> float:
        return round((time.time() if t is None else t) - self.t0, 3)


RUN = Run()


def fire(env, rtype: str, name: str, start: float, exc: Exception | None = None,
         length: int = 0, ms: float | None = None) -> None:
    env.events.request.fire(
        request_type=rtype, name=name, response_length=length, exception=exc, context={},
        response_time=(time.perf_counter() - start) * 1000 if ms is None else ms)


# ---- command line -------------------------------------------------------------------------

@events.init_command_line_parser.add_listener
def _args(parser) -> None:
    g = parser.add_argument_group("sandman")
    g.add_argument("--controller-url", default=os.environ.get("SANDMAN_CONTROLLER_URL",
                                                              "http://127.0.0.1:8080"))
    g.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG", ""),
                   help="enables the POD_READY watch and the leak audit")
    g.add_argument("--namespace", default="sandboxes", help="the controller's namespace")
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


def opts(env):
    return env.parsed_options


def job_of(env) -> str:
    if not RUN.job:
        RUN.job = opts(env).job or f"lt-{secrets.token_hex(3)}"
    return RUN.job


# ---- the controller API -------------------------------------------------------------------

class ControllerClient:
    """One user's connection to the controller; every call is one ACQUIRE or RELEASE."""

    def __init__(self, env, base_url: str):
        self.env, self.base = env, base_url.rstrip("/")
        self.http = requests.Session()

    def acquire(self, body: dict, timeout_s: float) -> dict | None:
        start, t = time.perf_counter(), time.time()
        exc: Exception | None = None
        lease = None
        try:
            r = self.http.post(self.base + "/v1/sandboxes", json=body, timeout=timeout_s + 30)
            if r.status_code == 201:
                lease = r.json()
            else:
                exc = RequestFailed(f"HTTP {r.status_code} {_error_type(r)}")
        except requests.RequestException as e:
            exc = RequestFailed(f"{type(e).__name__}")
        fire(self.env, ACQUIRE, "/v1/sandboxes", start, exc)
        tm = (lease or {}).get("timings") or {}
        RUN.acquires.append([RUN.rel(t), RUN.rel(), lease is not None,
                             bool((lease or {}).get("warm")), tm.get("queued_ms"),
                             tm.get("create_ms"), tm.get("ready_ms")])
        if lease:
            RUN.live += 1
            RUN.held[lease["id"]] = self
        return lease

    def release(self, sid: str) -> bool:
        """DELETE is idempotent: a connection error (a keep-alive connection the server closed
        while the sandbox was held) is retried, twice. A sandbox stays in `RUN.held` until a
        release succeeds, so the end of the run tries again."""
        if sid not in RUN.held:
            return False
        start = time.perf_counter()
        exc: Exception | None = None
        for attempt in range(3):
            exc = None
            try:
                r = self.http.delete(f"{self.base}/v1/sandboxes/{sid}", timeout=60)
                if r.status_code != 200:
                    exc = RequestFailed(f"HTTP {r.status_code} {_error_type(r)}")
                break
            except requests.ConnectionError as e:
                exc = RequestFailed(type(e).__name__)
                RUN.extra["release_retries"] = RUN.extra.get("release_retries", 0) + 1
                gevent.sleep(0.2 * (attempt + 1))
            except requests.RequestException as e:
                exc = RequestFailed(type(e).__name__)
                break
        fire(self.env, RELEASE, "/v1/sandboxes/{id}", start, exc)
        if exc is None and RUN.held.pop(sid, None) is not None:
            RUN.live -= 1
        return exc is None

    def release_later(self, sid: str) -> None:
        """From a user's on_stop: the release runs in its own greenlet, outside the runner's
        user group, so stopping or quitting the run cannot interrupt it half way."""
        _PENDING.append(gevent.spawn(self.release, sid))


def _error_type(r) -> str:
    try:
        return str(r.json()["error"]["type"])
    except (ValueError, KeyError, TypeError):
        return "no sandman error body"


_PENDING: list = []


def release_all(timeout_s: float = 120.0) -> None:
    """Releases started by stopped users finish; whatever is still held is released again,
    50 at a time."""
    gevent.joinall(_PENDING, timeout=timeout_s)
    pool = gevent.pool.Pool(50)
    for sid, cl in list(RUN.held.items()):
        pool.spawn(cl.release, sid)
    pool.join(timeout=timeout_s)


def acquire_body(env, job: str) -> dict:
    o = opts(env)
    return {"image": o.image, "cpu": o.cpu, "memory": o.memory, "job": job,
            "timeout_s": o.acquire_timeout_s}


# ---- execd ----------------------------------------------------------------------------------

class ExecdClient:
    """One sandbox's execd; EXEC, FILE_WRITE and FILE_READ events."""

    def __init__(self, env, address: str, port: int, token: str):
        if not address.startswith("127.") and address != "::1":
            # kwok pod IPs are loopback here; a real cluster's are reached from inside it.
            log.debug("execd at %s", address)
        host = f"[{address}]" if ":" in address else address
        self.env, self.base = env, f"http://{host}:{port}"
        self.http = requests.Session()
        self.http.headers["Authorization"] = f"Bearer {token}"

    def _call(self, rtype: str, name: str, method: str, path: str, **kw) -> Any:
        start = time.perf_counter()
        exc = None
        out = None
        try:
            r = self.http.request(method, self.base + path, timeout=60, **kw)
            if r.status_code != 200:
                exc = RequestFailed(f"HTTP {r.status_code}")
            else:
                out = r
        except requests.RequestException as e:
            exc = RequestFailed(type(e).__name__)
        fire(self.env, rtype, name, start, exc, len(out.content) if out is not None else 0)
        return out

    def exec(self, command: str, name: str = "/exec") -> dict | None:
        r = self._call(EXEC, name, "POST", "/exec",
                       json={"command": command, "request_id": secrets.token_hex(8),
                             "timeout": 30})
        return r.json() if r is not None else None

    def write(self, path: str, data: bytes) -> bool:
        import base64

        return self._call(FILE_WRITE, "/files/write", "POST", "/files/write",
                          json={"path": path, "data_b64": base64.b64encode(data).decode()}) \
            is not None

    def read(self, path: str) -> bytes | None:
        r = self._call(FILE_READ, "/files", "GET", "/files", params={"path": path})
        return r.content if r is not None else None


# ---- the pod watch (POD_READY) and controller stats -------------------------------------------

def _ready(pod: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def watch_pods(env, core, ns: str, job: str, stop: gevent.event.Event,
               max_s: float = 7200) -> None:
    """Every pod of the job: first seen -> Ready, one POD_READY event each. Pods first seen
    already Ready (a warm hand-out relabelled to the job) are not counted."""
    from kubernetes import watch

    deadline = time.monotonic() + max_s
    selector = f"{contract.LABEL_JOB}={job}"
    rv = None
    while not stop.is_set() and time.monotonic() < deadline:
        try:
            w = watch.Watch()
            kw = {"resource_version": rv} if rv else {}
            for ev in w.stream(core.list_namespaced_pod, ns, label_selector=selector,
                               timeout_seconds=5, _request_timeout=15, deserialize=False,
                               **kw):
                pod = ev["object"]
                md = pod.get("metadata") or {}
                rv = md.get("resourceVersion") or rv
                name = md.get("name")
                if not name or ev["type"] == "DELETED":
                    continue
                now = time.time()
                rec = RUN.pods.get(name)
                if rec is None:
                    rec = RUN.pods[name] = [RUN.rel(now), None]
                    if _ready(pod):
                        rec[1] = "warm"
                        continue
                if rec[1] is None and _ready(pod):
                    rec[1] = RUN.rel(now)
                    fire(env, POD_READY, "pod first seen -> Ready", 0,
                         ms=(rec[1] - rec[0]) * 1000)
                if stop.is_set():
                    w.stop()
                    break
        except Exception as e:  # noqa: BLE001 - a watch error restarts the watch, bounded
            rv = None  # relist: pods already seen keep their first-seen time
            log.debug("pod watch restarts: %s", e)
            gevent.sleep(0.5)


def sample_stats(base_url: str, stop: gevent.event.Event, every_s: float = 1.0,
                 max_s: float = 7200) -> None:
    """The controller's /v1/stats once a second: current pacing rate, queue, creating, live."""
    deadline = time.monotonic() + max_s
    s = requests.Session()
    while not stop.is_set() and time.monotonic() < deadline:
        try:
            st = s.get(base_url.rstrip("/") + "/v1/stats", timeout=5).json()
            RUN.samples.append([RUN.rel(), st.get("rate"), st.get("queue_depth"),
                                st.get("creating"), st.get("live")])
        except (requests.RequestException, ValueError):
            pass
        stop.wait(every_s)


# ---- leak audit -----------------------------------------------------------------------------

# ---- lifecycle: watch + samples on start; release, audit, thresholds, summary on stop ---------

_STOP = gevent.event.Event()
_PRIMARY: list[str] = []


def install(primary: list[str], uses_controller: bool = True) -> None:
    """Called by each locustfile: its primary request types (what --max-p99-ms applies to)."""
    _PRIMARY[:] = primary
    RUN.extra["uses_controller"] = uses_controller


@events.test_start.add_listener
def _on_start(environment, **kw) -> None:
    o = opts(environment)
    RUN.t0 = time.time()  # the shape's clock starts here too
    job = job_of(environment)
    RUN.extra.update({"controller_url": o.controller_url, "namespace": o.namespace})
    if o.kubeconfig and RUN.extra.get("uses_controller"):
        try:
            core = core_api(o.kubeconfig)
            gevent.spawn(watch_pods, environment, core, o.namespace, job, _STOP)
        except Exception as e:  # noqa: BLE001
            log.warning("no pod watch: %s", e)
    if RUN.extra.get("uses_controller"):
        gevent.spawn(sample_stats, o.controller_url, _STOP)


@events.test_stop.add_listener
def _on_stop(environment, **kw) -> None:
    o = opts(environment)
    release_all()
    if RUN.extra.get("uses_controller") and o.max_leaked >= 0:
        if not o.kubeconfig:
            RUN.audit = "skipped: no --kubeconfig"
        else:
            try:
                core = core_api(o.kubeconfig)
                RUN.leaked = leak_audit(core, o.namespace, job_of(environment), o.leak_settle_s)
                RUN.audit = f"{len(RUN.leaked)} pod(s) of job {RUN.job} left"
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
    verdicts = check_thresholds(environment.stats, _PRIMARY, o.max_p99_ms, o.max_error_rate,
                                o.max_leaked, RUN.leaked, RUN.audit)
    bad = [v for v in verdicts if not v[1]]
    for text, ok in verdicts:
        log.info("threshold %s: %s", "ok  " if ok else "FAIL", text)
    environment.process_exit_code = 1 if bad else 0
    write_summary(environment, verdicts)


def check_thresholds(stats, primary: list[str], max_p99_ms: float, max_error_rate: float,
                     max_leaked: int, leaked: list[str], audit: str) -> list[tuple[str, bool]]:
    out: list[tuple[str, bool]] = []
    total = stats.total
    if total.num_requests == 0:
        out.append(("requests made: 0", False))
    rate = total.fail_ratio
    out.append((f"error rate {rate:.4f} <= {max_error_rate:g} "
                f"({total.num_failures} of {total.num_requests})", rate <= max_error_rate))
    if max_p99_ms > 0:
        for (name, method), e in stats.entries.items():
            if method in primary and e.num_requests:
                p99 = e.get_response_time_percentile(0.99)
                out.append((f"{method} {name} p99 {p99:.0f} ms <= {max_p99_ms:g}",
                            p99 <= max_p99_ms))
    if max_leaked >= 0 and audit != "not run":
        ok = len(leaked) <= max_leaked and not audit.startswith(("failed", "skipped"))
        out.append((f"leaked pods {len(leaked)} <= {max_leaked} ({audit}) "
                    f"{' '.join(leaked[:10])}".rstrip(), ok))
    return out


def write_summary(environment, verdicts) -> None:
    o = opts(environment)
    path = o.sandman_json or (f"{o.csv_prefix}_sandman.json" if o.csv_prefix else "")
    if not path:
        return
    st = {}
    for (name, method), e in environment.stats.entries.items():
        st[f"{method} {name}"] = {
            "type": method, "name": name, "requests": e.num_requests, "failures": e.num_failures,
            "p50_ms": e.get_response_time_percentile(0.5) if e.num_requests else None,
            "p99_ms": e.get_response_time_percentile(0.99) if e.num_requests else None}
    plan = RUN.plan
    doc = {
        "job": RUN.job, "started": RUN.t0, "duration_s": RUN.rel(),
        "shape": RUN.extra.get("shape"), "locustfile": RUN.extra.get("locustfile"),
        "pacing": RUN.extra.get("pacing"),
        "stages": [vars(r) for r in plan.results] if plan else [],
        "stop_reason": plan.stop_reason if plan else "",
        "acquires": RUN.acquires, "pods": RUN.pods, "samples": RUN.samples,
        "leaked": RUN.leaked, "leaked_detail": RUN.extra.get("leaked_detail", {}),
        "audit": RUN.audit, "stats": st,
        "thresholds": [{"check": t, "ok": ok} for t, ok in verdicts],
        "exit_code": environment.process_exit_code,
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc))
