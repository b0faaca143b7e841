"""What a sandbox pod is to the controller: its spec (`SandboxSpec`, also the warm-pool key), an
acquire as the controller takes it (`AcquireOrder`), the slim copy the informer keeps of it (`slim_pod`), and every reading the books make of a pod.

Each reader must give the same answer on the slim copy as on the whole object
(tests/controller/test_slim_pod.py): anything new the books read from a pod is added to
`slim_pod` and to that test."""

from __future__ import annotations

import datetime as dt
import math
import time
from dataclasses import dataclass, field

from sandman import api, contract


@dataclass(frozen=True)
class SandboxSpec:
    """What a sandbox is made of; also the warm-pool key (hand-out needs an exact match)."""

    image: str
    cpu: str = api.DEFAULT_CPU
    memory: str = api.DEFAULT_MEMORY
    workspace: str | None = None
    egress: str = contract.EGRESS_DENY
    role: str = contract.ROLE_AGENT  # grading pods may go back to a pool (release with reuse)
    ephemeral_storage: str | None = None  # requests == limits; None: not requested
    gpu: int = 0  # of the policy's GPU resource (limits; the API server copies the request)
    # With egress deny: the allowlist's canonical entries (sandman/egress.py), written to the
    # pod's egress-allow annotation; () for none. Part of the key: lists never share a pod.
    egress_allow: tuple[str, ...] = ()

    @classmethod
    def of(cls, image: str, size: api.Spec | api.AcquireRequest) -> SandboxSpec:
        """The sandbox an acquire or a prewarm asks for (`size`: its cpu, memory, workspace,
        egress, role, ephemeral_storage and gpu)."""
        egress, allow = api.egress_parts(size.egress)
        return cls(image=image, cpu=size.cpu, memory=size.memory, workspace=size.workspace,
                   egress=egress, role=size.role, ephemeral_storage=size.ephemeral_storage,
                   gpu=size.gpu, egress_allow=allow)


@dataclass(frozen=True)
class AcquireOrder:
    """One acquire as the controller takes it, from the route through the books to the
    hand-out: the sandbox, the job it counts against (tenant-scoped), and the caller's options
    (sandman/api.py's AcquireRequest says what each means)."""

    spec: SandboxSpec
    job: str
    owner: dict | None = None  # the caller's pod, {"name", "uid"}: the sandbox's owner
    labels: dict = field(default_factory=dict)
    timeout_s: float = 300.0
    warm_ok: bool = True
    wait: bool = True
    request_id: str | None = None  # scoped to the caller: a retry finds the same sandbox
    lifetime_s: float | None = None
    conditions: dict | None = None  # declared run conditions (controller/conditions.py)
    reused_ok: bool = False

    @classmethod
    def of(cls, body: api.AcquireRequest, job: str, request_id: str | None) -> AcquireOrder:
        """The API's request, its job and request id already scoped (routes.py)."""
        return cls(SandboxSpec.of(body.image, body), job,
                   owner=body.owner.to_json() if body.owner else None, labels=body.labels,
                   timeout_s=body.timeout_s, warm_ok=body.warm_ok, wait=body.wait,
                   request_id=request_id, lifetime_s=body.lifetime_s,
                   conditions=body.conditions.declared() if body.conditions else None,
                   reused_ok=body.reused_ok)


LEASE_ANNOTATIONS = (contract.ANNOTATION_EXPIRES_AT, contract.ANNOTATION_LIFETIME)


def slim_pod(pod: dict) -> dict:
    """The fields the controller's books read, and nothing else.

    A kwok pod is ~6 KB of JSON and ~500 Python objects, mostly managedFields and the spec the
    controller wrote itself; a real one is larger. Kept whole, 600 of them made every full
    garbage collection pause the event loop for 140-220 ms, and the pacer lost those create
    slots; 12,000 cost ~110 KB each of RSS."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    st = pod.get("status") or {}
    c = (spec.get("containers") or [{}])[0]
    out_meta = {k: meta[k] for k in ("name", "uid", "resourceVersion", "labels",
                                     "creationTimestamp", "deletionTimestamp") if k in meta}
    lease = {k: v for k, v in (meta.get("annotations") or {}).items()
             if k in LEASE_ANNOTATIONS or k in (contract.ANNOTATION_PROOF,
                                                 contract.ANNOTATION_EGRESS_ALLOW,
                                                 # a restarted leader checks a holder's token
                                                 contract.ANNOTATION_TOKEN_SHA256)}
    if lease:
        out_meta["annotations"] = lease
    out_c = {k: c[k] for k in ("name", "image", "workingDir") if k in c}
    req = (c.get("resources") or {}).get("requests")
    if req:
        out_c["resources"] = {"requests": req}
    out_st = {k: st[k] for k in ("phase", "reason", "message", "podIP") if k in st}
    if st.get("conditions"):
        # DisruptionTarget keeps its reason and message: why kube is deleting the pod
        # (disruption(), the reason a lost lease reports).
        out_st["conditions"] = [
            {"type": x.get("type"), "status": x.get("status"),
             **({k: x[k] for k in ("reason", "message") if k in x}
                if x.get("type") == DISRUPTION_TARGET else {})}
            for x in st["conditions"]]
    for key in ("containerStatuses", "initContainerStatuses"):
        kept = []
        for x in st.get(key) or []:
            state = x.get("state") or {}
            if state.get("waiting"):
                kept.append({"name": x.get("name"), "state": {"waiting": state["waiting"]}})
            elif key == "containerStatuses" and state.get("running") is not None:
                kept.append({"name": x.get("name"), "state": {"running": {}}})  # started()
        if kept:
            out_st[key] = kept
    out_spec: dict = {"containers": [out_c]}
    if spec.get("nodeName"):
        out_spec["nodeName"] = spec["nodeName"]  # node_name(): a lost node's leases
    return {"metadata": out_meta, "spec": out_spec, "status": out_st}


# ---- readers: pods travel as plain JSON dicts (see kube.KubeClient) ------------------------
def meta(pod: dict) -> dict:
    return pod.get("metadata") or {}


def name(pod: dict) -> str:
    return meta(pod).get("name", "")


def uid(pod: dict) -> str | None:
    return meta(pod).get("uid")


def labels(pod: dict) -> dict:
    return meta(pod).get("labels") or {}


def iso_utc(epoch: float) -> str:
    """RFC 3339 UTC, whole seconds rounded up (an expiry is never earlier than promised)."""
    return dt.datetime.fromtimestamp(-(-epoch // 1), dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def lease_end(lifetime_s: float, now: float | None = None) -> float:
    """now + lifetime in whole seconds (what the annotation can say), rounded up."""
    return float(math.ceil((time.time() if now is None else now) + lifetime_s))


def expires_at(pod: dict) -> float | None:
    """The lease's end (epoch s) from the pod's annotation; None: none or unreadable."""
    text = (meta(pod).get("annotations") or {}).get(contract.ANNOTATION_EXPIRES_AT)
    if not isinstance(text, str):
        return None
    try:
        return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def lifetime(pod: dict) -> float | None:
    try:
        v = float((meta(pod).get("annotations") or {})[contract.ANNOTATION_LIFETIME])
    except (KeyError, TypeError, ValueError):
        return None
    return v if v > 0 else None


def lease_annotations(lifetime_s: float, expires: float) -> dict:
    return {contract.ANNOTATION_EXPIRES_AT: iso_utc(expires),
            contract.ANNOTATION_LIFETIME: f"{lifetime_s:g}"}


def deleting(pod: dict) -> bool:
    return bool(meta(pod).get("deletionTimestamp"))


def pod_ip(pod: dict) -> str | None:
    return (pod.get("status") or {}).get("podIP")


def node_name(pod: dict) -> str | None:
    """The node the scheduler bound the pod to (None: not bound yet)."""
    return (pod.get("spec") or {}).get("nodeName") or None


# The condition kube's own deleters (pod GC, the taint manager, the eviction API, the
# scheduler's preemption, the kubelet) set on a pod before they delete it.
DISRUPTION_TARGET = "DisruptionTarget"


def disruption(pod: dict) -> tuple[str, str] | None:
    """(reason, message) of the pod's DisruptionTarget condition, or None. Written by kube
    components through the pods/status API, never by the pod's own processes."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == DISRUPTION_TARGET and c.get("status") == "True":
            return str(c.get("reason") or ""), str(c.get("message") or "")
    return None


def is_ready(pod: dict | None) -> bool:
    if not pod:
        return False
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


def started(pod: dict | None) -> bool:
    """The sandbox container (the pod's first) is running: every init container, the guard
    included, has completed, so execd may be listening before the kubelet's next probe."""
    if not pod:
        return False
    name = ((pod.get("spec") or {}).get("containers") or [{}])[0].get("name")
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs.get("name") == name and (cs.get("state") or {}).get("running") is not None:
            return True
    return False


def annotation(pod: dict, key: str) -> str | None:
    return (meta(pod).get("annotations") or {}).get(key)


def age(pod: dict, now: float) -> float:
    """Seconds since the pod's creationTimestamp (0 when it has none)."""
    created = meta(pod).get("creationTimestamp")
    if not created:
        return 0.0
    return now - dt.datetime.fromisoformat(created.replace("Z", "+00:00")).timestamp()


# Waiting reasons a container never recovers from (an image pull back-off may).
FATAL_WAITING = {"InvalidImageName", "ErrImageNeverPull", "CreateContainerConfigError",
                 "CreateContainerError"}


def failure(pod: dict) -> str | None:
    """Why a starting pod will never become Ready, or None while it still may."""
    if deleting(pod):
        return "was deleted while starting"
    st = pod.get("status") or {}
    phase = st.get("phase")
    if phase in ("Failed", "Succeeded"):
        return (f"ended while starting (phase {phase}: {st.get('reason') or ''} "
                f"{st.get('message') or ''})").strip()
    for cs in (st.get("containerStatuses") or []) + (st.get("initContainerStatuses") or []):
        w = (cs.get("state") or {}).get("waiting") or {}
        if w.get("reason") in FATAL_WAITING:
            return f"container {cs.get('name')} cannot start: {w['reason']}: {w.get('message', '')}"
    return None


# Resources a sandbox container names besides its GPU resource (the admission rules refuse any
# other, so the one domain-qualified name left in its requests is the GPU count).
_CORE_RESOURCES = ("cpu", "memory", "ephemeral-storage")


def _gpu_count(requests: dict) -> int:
    for k, v in requests.items():
        if k not in _CORE_RESOURCES and "/" in k:
            try:
                return int(str(v))
            except ValueError:
                return 0
    return 0


def spec_of(pod: dict) -> SandboxSpec:
    c = ((pod.get("spec") or {}).get("containers") or [{}])[0]
    req = (c.get("resources") or {}).get("requests") or {}
    storage = req.get("ephemeral-storage")
    # Written canonical by the controller (create.py); the webhook refuses any other spelling.
    allow = annotation(pod, contract.ANNOTATION_EGRESS_ALLOW)
    return SandboxSpec(image=c.get("image", ""), cpu=str(req.get("cpu", api.DEFAULT_CPU)),
                       memory=str(req.get("memory", api.DEFAULT_MEMORY)),
                       workspace=c.get("workingDir"),
                       egress=labels(pod).get(contract.LABEL_EGRESS, contract.EGRESS_DENY),
                       role=labels(pod).get(contract.LABEL_ROLE, contract.ROLE_AGENT),
                       ephemeral_storage=None if storage is None else str(storage),
                       gpu=_gpu_count(req),
                       egress_allow=tuple(allow.split(",")) if allow else ())
