"""One pod create, never duplicated: the pod body (`build_pod`, the same pod function as the
webhook), the job's owner ConfigMap, and the create call whose ambiguous answers (5xx, timeout,
reset) are resolved by reading back by name and nonce. Retries reuse the same name and nonce, so
a create stored late answers 409 and is adopted; a 409 with a foreign nonce means another
tenant's pod holds the name: it is never touched, and a new name is drawn."""

from __future__ import annotations

import asyncio
import copy
import hashlib
import hmac
import json
import logging
import re
import secrets
from typing import Any

from kubernetes import client

from controller import metrics
from controller import pods as P
from controller.auth import split_job
from controller.books import Books, Entry
from controller.images import digest_of
from controller.kube import AMBIGUOUS_STATUSES, Kube, is_transport_error
from controller.pacer import Pacer
from controller.settings import Settings
from sandman import contract
from sandman.podspec import gpu_tolerations, make_sandbox

log = logging.getLogger("controller")


def tenant_of(settings: Settings, job: str) -> str | None:
    """The tenant of a job key (--auth kubernetes); None when unscoped."""
    return split_job(job)[0] if settings.tenants else None


def tenant_labels(settings: Settings, job: str) -> dict[str, str]:
    """The tenant label of a job key's pods (--auth kubernetes), for selectors and humans."""
    tenant = tenant_of(settings, job)
    return {contract.LABEL_TENANT: tenant} if tenant else {}


def job_object_name(job: str) -> str:
    safe = re.sub(r"[^a-z0-9-]", "-", job.lower()).strip("-")[:40] or "job"
    return f"sandman-job-{safe}-{hashlib.sha256(job.encode()).hexdigest()[:8]}"


def new_name(job: str) -> str:
    safe = re.sub(r"[^a-z0-9-]", "-", job.lower()).strip("-")[:30] or "sbx"
    return f"sbx-{safe}-{secrets.token_hex(5)}"


def token_pair() -> tuple[str, str]:
    token = secrets.token_urlsafe(32)
    return token, hashlib.sha256(token.encode()).hexdigest()


def proof(key: bytes, namespace: str, name: str, nonce: str) -> str:
    """The controller's mark on a pod it creates (contract.ANNOTATION_PROOF). Binds the name and
    the nonce, so a copy of a real pod's mark proves nothing about another pod."""
    msg = "\n".join((namespace, name, nonce)).encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def _reason(ex: client.ApiException) -> str:
    try:
        return json.loads(ex.body).get("message", ex.reason)  # type: ignore[arg-type]  # None: caught
    except Exception:  # noqa: BLE001
        return str(ex.reason)


class Creator:
    def __init__(self, kube: Kube, books: Books, pacer: Pacer, settings: Settings):
        self.kube = kube
        self.books = books
        self.pacer = pacer
        self.s = settings
        self.job_owner_uid: dict[str, str] = {}

    def build_pod(self, e: Entry, token_sha: str) -> dict:
        t = self.s.pod_template  # checked at startup: none of its keys is sandman's own
        labels = {
            **t.get("labels", {}),
            contract.LABEL_SANDBOX: contract.SANDBOX_TRUE,
            contract.LABEL_JOB: e.job,
            contract.LABEL_NONCE: e.nonce,
            contract.LABEL_EGRESS: e.spec.egress,
            contract.LABEL_MANAGED_BY: contract.MANAGED_BY_CONTROLLER,
            **tenant_labels(self.s, e.job),
        }
        if e.warm_build:
            labels[contract.LABEL_STATE] = contract.STATE_WARM
        if e.spec.role != contract.ROLE_AGENT:  # agent pods stay as they were (no label)
            labels[contract.LABEL_ROLE] = e.spec.role
        size = {"cpu": e.spec.cpu, "memory": e.spec.memory}
        if e.spec.ephemeral_storage is not None:
            size["ephemeral-storage"] = e.spec.ephemeral_storage
        container: dict[str, Any] = {"name": "sandbox", "image": e.spec.image,
                     "resources": {"requests": dict(size), "limits": dict(size)}}
        if digest_of(e.spec.image) is not None:
            # A digest names one image: a node that has it needs no pull. A tag reaches a pod
            # only under --image-pinning off (the kubelet's default policy, unpinned).
            container["imagePullPolicy"] = "IfNotPresent"
        if e.spec.gpu:
            # An extended resource is set in limits only: the API server copies the request.
            container["resources"]["limits"][self.s.policy.gpu_resource] = str(e.spec.gpu)
        if e.spec.workspace:
            container["workingDir"] = e.spec.workspace
        if e.spec.role == contract.ROLE_GRADING:
            # Only grading pods pay for execd's baseline (a copy of what restore writes back).
            container["env"] = [{"name": contract.EXECD_BASELINE_ENV, "value": "on"},
                                {"name": contract.EXECD_BASELINE_SCOPE_ENV,
                                 "value": self.s.baseline_scope}]
        elif self.s.snapshot_base:
            # Agent pods may be forked: execd records at start what its snapshot is taken
            # against (the image's files). Grading pods are never forked.
            container["env"] = [{"name": contract.EXECD_SNAPSHOT_ENV, "value": "on"}]
        spec: dict = {
            "containers": [container],
            # A sandbox whose daemon died has lost its state: surface it, don't restart it.
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 5,
            # Soft spread: crowded nodes failed address assignment 31-55% of the time (paper).
            "topologySpreadConstraints": [{
                "maxSkew": 2, "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": {
                    contract.LABEL_MANAGED_BY: contract.MANAGED_BY_CONTROLLER}}}],
        }
        if self.s.node_pool_label:
            k, v = self.s.node_pool_label.split("=", 1)
            spec["nodeSelector"] = {k: v}
        # A shared pool's rules (taints, classes, pull secrets): the pod template.
        for k in ("tolerations", "affinity", "priorityClassName", "runtimeClassName",
                  "imagePullSecrets"):
            if k in t:
                spec[k] = copy.deepcopy(t[k])
        if e.spec.gpu:  # only GPU sandboxes reach the GPU nodes' taints (admission checks it)
            spec["tolerations"] = spec.get("tolerations", []) + gpu_tolerations(self.s.policy)
        meta: dict[str, Any] = {"name": e.name, "namespace": self.s.namespace, "labels": labels,
                "annotations": {**t.get("annotations", {}),
                                contract.ANNOTATION_TOKEN_SHA256: token_sha}}
        if e.spec.egress_allow:  # canonical already (sandman/api.py); the label says deny
            meta["annotations"][contract.ANNOTATION_EGRESS_ALLOW] = ",".join(e.spec.egress_allow)
        if self.s.books_key is not None:
            meta["annotations"][contract.ANNOTATION_PROOF] = proof(
                self.s.books_key, self.s.namespace, e.name, e.nonce)
        if e.owner:
            meta["ownerReferences"] = [{"apiVersion": "v1", "kind": "Pod",
                                        "name": e.owner["name"], "uid": e.owner["uid"]}]
        elif e.owner_ref is not None:
            meta["ownerReferences"] = [e.owner_ref]
        return make_sandbox({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec},
                            self.s.policy)

    # ---- the job's owner ConfigMap -----------------------------------------------------------
    async def owner_ref(self, job: str) -> dict:
        """The per-job ConfigMap that owns the job's pods, so the GC removes them at job end."""
        name = job_object_name(job)
        uid = self.job_owner_uid.get(job)
        if uid is None:
            body = {"metadata": {"name": name, "labels": {
                contract.LABEL_MANAGED_BY: contract.MANAGED_BY_CONTROLLER,
                contract.LABEL_JOB: job}}}
            try:
                cm = await self.kube.create_config_map(body)
            except client.ApiException as ex:
                if ex.status != 409:
                    raise
                cm = await self.kube.read_config_map(name)
            uid = cm["metadata"]["uid"]
            self.job_owner_uid[job] = uid
        return {"apiVersion": "v1", "kind": "ConfigMap", "name": name, "uid": uid}

    # ---- the job's image pins (controller/images.py PinRecord) ------------------------------
    def where(self, job: str) -> str:
        return f"ConfigMap {self.s.namespace}/{job_object_name(job)}"

    async def read(self, job: str) -> dict[str, str]:
        """The job ConfigMap's data: its pins outlive the leader that resolved them."""
        try:
            cm = await self.kube.read_config_map(job_object_name(job))
        except client.ApiException as ex:
            if ex.status == 404:
                return {}
            raise
        return dict(cm.get("data") or {})

    async def write(self, job: str, key: str, value: str) -> None:
        """One pin into the job's ConfigMap (made here when the job has none yet: a pin is
        recorded before the job's first pod exists). The pins go with the ConfigMap: a drain
        deletes it, so nothing of the job is left behind."""
        for _ in range(2):
            name = (await self.owner_ref(job))["name"]
            try:
                await self.kube.patch_config_map(name, {"data": {key: value}})
                return
            except client.ApiException as ex:
                if ex.status != 404:
                    raise
                self.job_owner_uid.pop(job, None)  # deleted under us: made again, once
        raise RuntimeError(f"{self.where(job)} was deleted while a pin was written")

    async def delete_job_object(self, job: str) -> None:
        self.job_owner_uid.pop(job, None)
        for _ in range(10):
            try:
                await self.kube.delete_config_map(job_object_name(job))
                return
            except client.ApiException as ex:
                if ex.status == 404:
                    return
            except Exception:  # noqa: BLE001
                pass
            await asyncio.sleep(1)
        # Left behind: the next acquire of this job name would keep the job's old pins.
        log.warning("the ConfigMap of job %s could not be deleted; its pods' owner and image "
                    "pins remain until a drain succeeds", job)

    # ---- the create --------------------------------------------------------------------------
    async def create(self, e: Entry, token_sha: str) -> bool:
        """Create the pod; True when it is stored and ours (`e.uid` set). False: not stored,
        `e.error` says why."""
        e.owner_ref = None if e.owner else await self.owner_ref(e.job)
        body = self.build_pod(e, token_sha)
        backoff = 0.2
        for _attempt in range(8):
            try:
                pod = await self.kube.create_pod(body)
                e.uid = P.uid(pod)
                metrics.created("ok")
                return True
            except client.ApiException as ex:
                if ex.status == 409:
                    mine = await self._read_back(e)
                    if mine:
                        metrics.created("ok_after_conflict")
                        return True
                    if mine is False:  # another tenant's pod holds the name: new name, new create
                        metrics.created("name_conflict")
                        self.books.rename(e, new_name(e.job))
                        body = self.build_pod(e, token_sha)
                        continue
                elif ex.status == 429 or ex.status in AMBIGUOUS_STATUSES:
                    self.pacer.slow_down()
                    metrics.API_BACKOFF.inc()
                    if ex.status in AMBIGUOUS_STATUSES:
                        mine = await self._read_back(e)
                        if mine:
                            metrics.created("ok_after_error")
                            return True
                else:
                    e.error = f"{ex.status} {_reason(ex)}"
                    metrics.created("refused")
                    return False
            except Exception as ex:  # noqa: BLE001
                if not is_transport_error(ex):
                    raise
                metrics.created("transport_error")
                self.pacer.slow_down()
                mine = await self._read_back(e)
                if mine:
                    return True
            # Not stored (or unknown): retry with the SAME name and nonce, so a create that was
            # stored late answers 409 with our nonce and is adopted, never duplicated.
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)
        e.error = "create kept failing; gave up"
        # It may still be stored late: the informer deletes it on sight, the sweep backs it up.
        self.books.retired.add(e.name)
        return False

    async def _read_back(self, e: Entry) -> bool | None:
        """True: the pod with our name carries our nonce (ours). False: absent or foreign.
        None: could not tell (the read failed too)."""
        for _ in range(5):
            try:
                pod = await self.kube.read_pod(e.name)
            except client.ApiException as ex:
                if ex.status == 404:
                    return False
                await asyncio.sleep(0.2)
                continue
            except Exception:  # noqa: BLE001
                await asyncio.sleep(0.2)
                continue
            if P.labels(pod).get(contract.LABEL_NONCE) == e.nonce:
                e.uid = P.uid(pod)
                return True
            return False
        return None
