"""What the run watches besides its own calls: the pod watch that reports create-to-Ready
(POD_READY) and the controller's stats, sampled once a second. The leak audit, which must run
without locust too, is loadtest/audit.py."""

from __future__ import annotations

import logging
import time

import gevent
import gevent.event
import httpx

from loadtest.run import POD_READY, RUN, fire
from sandman import api, contract
from sandman.client._core import TokenSource, controller_tls

log = logging.getLogger("loadtest")


def _ready(pod: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def watch_pods(env, core, ns: str, label: str, stop: gevent.event.Event,
               max_s: float = 7200) -> None:
    """Every pod whose job label is `label` (audit.job_label: the run's job, tenant-scoped):
    first seen -> Ready, one POD_READY event each. Pods first seen already Ready (a warm
    hand-out relabelled to the job) are not counted."""
    from kubernetes import watch

    deadline = time.monotonic() + max_s
    selector = f"{contract.LABEL_JOB}={label}"
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
    """The controller's stats once a second: current pacing rate, queue, creating, live.
    Not a locust request: the sampler's own calls stay out of the run's stats."""
    deadline = time.monotonic() + max_s
    url = base_url.rstrip("/") + api.STATS.path
    token = TokenSource(None, None)  # $SANDMAN_TOKEN_FILE, like the SDK (stats: admin rights)
    # https: verified with $SANDMAN_CA_FILE, like the SDK.
    verify = controller_tls(None) if url.startswith("https:") else True
    with httpx.Client(timeout=5, trust_env=False, verify=verify) as http:
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                st = http.get(url, headers=token.header()).json()
                RUN.samples.append([RUN.rel(), st.get("rate"), st.get("queue_depth"),
                                    st.get("creating"), st.get("live")])
            except (httpx.HTTPError, ValueError):
                pass
            stop.wait(every_s)
