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
