"""The run record: the request types, the per-process `Run` written as
`<csv prefix>_sandman.json` for `loadtest/report.py`, and the thresholds that become the exit
code. No locust import (the listeners that call these live in loadtest/common.py).

Request types (the "Type" column of locust's stats):
  ACQUIRE, RELEASE     the controller API through the SDK (latency includes the pacing queue)
  EXEC, FILE_WRITE, FILE_READ   execd in a sandbox, through the SDK
  POD_CREATE, ADMISSION_REVIEW  the API server (dryRun=All) and the webhook, directly
  POD_READY            watch-derived: first seen by the watch -> Ready, per pod (reported apart
                       from the API call latency, as clusterloader2 does)
  LEAK                 one failure per pod of the run's job still present after the run
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandman import api, execd_api

# The SDK's on_request kinds (the routes of sandman/api.py and sandman/execd_api.py) are the types.
ACQUIRE, RELEASE = api.ACQUIRE.kind, api.RELEASE.kind
GROUP = api.GROUP.kind  # one call for --group-size sandboxes (acquire_burst)
EXEC, FILE_WRITE, FILE_READ = (execd_api.EXEC.kind, execd_api.FILE_WRITE.kind,
                               execd_api.FILE_READ.kind)
POD_CREATE, ADMISSION_REVIEW, POD_READY, LEAK = "POD_CREATE", "ADMISSION_REVIEW", "POD_READY", "LEAK"


# The process exit codes of a run: 0 every threshold held, 1 one failed (locust's own: 2 for
# its errors). COTENANT_STOP: the co-tenant stop rule stopped the run (loadtest/cotenant.py),
# apart from 1 so a wrapper can tell "the run harmed others" from "the run was slow".
EXIT_OK, EXIT_THRESHOLDS, COTENANT_STOP = 0, 1, 3


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
    held: dict[str, Any] = field(default_factory=dict)  # sandbox id -> its SDK Sandbox
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


def check_thresholds(stats, primary: list[str], max_p99_ms: float, max_error_rate: float,
                     max_leaked: int, leaked: list[str], audit: str,
                     exceptions: dict | None = None) -> list[tuple[str, bool]]:
    """`exceptions`: locust's runner.exceptions (a task that raised). Any one fails the run:
    a task that raises stopped doing what the run measures, whatever the request stats say."""
    out: list[tuple[str, bool]] = []
    total = stats.total
    if total.num_requests == 0:
        out.append(("requests made: 0", False))
    raised = list((exceptions or {}).values())
    n = sum(e["count"] for e in raised)
    first = f" (first: {raised[0]['msg'][:200]})" if raised else ""
    out.append((f"task exceptions {n} <= 0{first}", n == 0))
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
    o = environment.parsed_options
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
        "exceptions": [{"msg": e["msg"][:500], "count": e["count"]}
                       for e in (environment.runner.exceptions.values()
                                 if environment.runner else [])],
        "exit_code": environment.process_exit_code,
        "cotenant": RUN.extra.get("cotenant"),
        # A distributed run: per worker, its users' finished cycles and the acquire rows it sent.
        "workers": RUN.extra.get("workers"),
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc))
