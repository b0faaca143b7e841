"""The leak audit and the API client, without locust: importing locust monkey-patches the whole
process with gevent, which a pytest process or the demo must never get."""

from __future__ import annotations

import json
import time

from sandman import contract


def core_api(kubeconfig: str):
    from kubernetes import client, config

    cfg = client.Configuration()
    config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
    cfg.connection_pool_maxsize = 4
    return client.CoreV1Api(client.ApiClient(cfg))


def leak_audit(core, ns: str, job: str, settle_s: float) -> list[str]:
    """Pods labelled with the run's job still present after `settle_s` (released pods are
    deleted by the controller; anything left is a leak), polled every 0.5 s."""
    deadline = time.monotonic() + settle_s
    while True:
        items = json.loads(core.list_namespaced_pod(
            ns, label_selector=f"{contract.LABEL_JOB}={job}", _preload_content=False).data)
        names = sorted(p["metadata"]["name"] for p in items["items"])
        if not names or time.monotonic() >= deadline:
            return names
        time.sleep(0.5)


def describe(core, ns: str, names: list[str], limit: int = 20) -> dict[str, dict]:
    """What a leaked pod looked like when the audit gave up: enough to tell the controller's
    owners which state it was stuck in."""
    out: dict[str, dict] = {}
    for name in names[:limit]:
        try:
            p = json.loads(core.read_namespaced_pod(name, ns, _preload_content=False).data)
        except Exception as e:  # noqa: BLE001 - gone meanwhile, or the API failed
            out[name] = {"error": str(e)[:200]}
            continue
        md = p["metadata"]
        out[name] = {"labels": md.get("labels", {}), "deleting": bool(md.get("deletionTimestamp")),
                     "owners": [o.get("name") for o in md.get("ownerReferences", [])],
                     "phase": (p.get("status") or {}).get("phase"), "created": md.get(
                         "creationTimestamp")}
    return out
