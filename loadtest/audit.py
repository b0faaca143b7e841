"""The leak audit and the API client, without locust: importing locust monkey-patches the whole
process with gevent, which a pytest process or the demo must never get."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping

from sandman import contract

# `--kubeconfig in-cluster`: the pod's ServiceAccount (its token and the cluster CA, mounted
# by the kubelet) and $KUBERNETES_SERVICE_HOST/PORT, as every in-cluster client does.
IN_CLUSTER = "in-cluster"
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def default_tenant(kubeconfig: str, environ: Mapping[str, str] = os.environ,
                   sa_dir: str = SA_DIR) -> str:
    """The tenant the controller files this run's sandboxes under: $SANDMAN_TENANT, else, in a
    pod, its ServiceAccount's namespace (a caller's tenant by default, docs/controller.md
    "Authentication and tenants"), else "" (a controller under --auth none: unscoped jobs)."""
    if "SANDMAN_TENANT" in environ:
        return environ["SANDMAN_TENANT"]
    if kubeconfig == IN_CLUSTER:
        try:
            with open(f"{sa_dir}/namespace") as f:
                return f.read().strip()
        except OSError:
            return ""
    return ""


def job_label(tenant: str, job: str) -> str:
    """The pods' job label value: the controller's job key `<tenant>.<job>`, or `job` alone
    when unscoped. The pod watch and the leak audit select on it: with the bare job name they
    would match nothing on an authenticating controller and the audit would pass vacuously."""
    return f"{tenant}.{job}" if tenant else job


def default_kubeconfig(environ: Mapping[str, str] = os.environ, sa_dir: str = SA_DIR) -> str:
    """$KUBECONFIG, else `in-cluster` inside a pod with a ServiceAccount token, else "" (no
    pod watch, no leak audit)."""
    if environ.get("KUBECONFIG"):
        return environ["KUBECONFIG"]
    if environ.get("KUBERNETES_SERVICE_HOST") and os.path.exists(f"{sa_dir}/token"):
        return IN_CLUSTER
    return ""


def core_api(kubeconfig: str, *, sa_dir: str = SA_DIR,
             environ: Mapping[str, str] = os.environ):
    """A CoreV1Api from a kubeconfig file, or from the pod's ServiceAccount when `kubeconfig`
    is `in-cluster` (`sa_dir` and `environ` are where a pod has them)."""
    from kubernetes import client, config
    from kubernetes.config.incluster_config import InClusterConfigLoader

    cfg = client.Configuration()
    if kubeconfig == IN_CLUSTER:
        try:
            InClusterConfigLoader(token_filename=f"{sa_dir}/token",
                                  cert_filename=f"{sa_dir}/ca.crt",
                                  environ=environ).load_and_set(cfg)
        except config.ConfigException as e:
            raise RuntimeError(f"in-cluster config: {e}") from None
    else:
        config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
    cfg.connection_pool_maxsize = 4
    return client.CoreV1Api(client.ApiClient(cfg))


def leak_audit(core, ns: str, label: str, settle_s: float) -> list[str]:
    """Pods whose job label is `label` (job_label()) still present after `settle_s` (released
    pods are deleted by the controller; anything left is a leak), polled every 0.5 s."""
    deadline = time.monotonic() + settle_s
    while True:
        items = json.loads(core.list_namespaced_pod(
            ns, label_selector=f"{contract.LABEL_JOB}={label}", _preload_content=False).data)
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
