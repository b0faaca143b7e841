"""Image pre-pull (docs/controller.md "Pre-pull"): the images of a task set, pinned by digest,
pulled onto every node of the sandbox node pool before a run, so the run's creates find them.

The paper's creates that pulled took 17.4 s at the median (p90 74.3 s) against 4.1 s with the
image on the node; before its largest spread step it pre-pulled the step's 1.21 GB image onto
the 229 nodes that lacked it.

How: one short-lived puller pod per (node, image), pinned with `nodeName` to a node the
sandboxes can land on (the pool's node label, the pod template's tolerations, schedulable and
Ready). The kubelet pulls the image before it creates the container; the container's command
is a path no image has (NO_ENTRYPOINT), so the image's own entrypoint never runs: the create
fails at exec, after the pull. The outcome is read from the container status: an `imageID` or a
running container means the node has the image; the kubelet's pull errors (ErrImagePull,
ImagePullBackOff, ...) mean it failed, with the kubelet's message as the reason. The pod is
then deleted.

Every puller's create takes a slot from the controller's one pacer, in the PREPULL role, which
is granted only when no grading or rollout create waits: a pre-pull never delays an acquire.
At most CONCURRENCY pullers run at once, spread over the nodes (image-major order, so the
concurrent pullers are on different nodes).

Pullers carry contract.LABEL_PREPULL and neither the sandbox nor the managed-by label: the
books, the sweep, the webhook and the sandbox policies never see them. What this controller no
longer tracks (a pod left by an earlier leader) is deleted by `sweep`; the chart's uninstall
cleanup deletes every one.

State lives in the leader's memory: a new leader starts from the chart's images
(--prepull-image) and pulls them again where they are missing; images posted to the old leader
are posted again by whoever needs them (the call is idempotent).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import time
from dataclasses import dataclass

from kubernetes import client

from controller import metrics
from controller.errors import BadRequest
from controller.kube import AMBIGUOUS_STATUSES, Kube, is_transport_error
from controller.pacer import ROLE_PREPULL, Pacer
from controller.settings import Settings
from sandman import api, contract

log = logging.getLogger("controller.prepull")

PREPULL_JOB = "sandman-prepull"  # the pacer's job key of every puller
# The puller's command: no image has it, so the container fails at exec, after the pull.
NO_ENTRYPOINT = "/.sandman-prepull/no-such-entrypoint"
# The kubelet's deadline for a puller (activeDeadlineSeconds). The paper's slowest pulls: the
# largest images' p90 153 s, 0.58% of all pulls over 120 s; 600 s leaves room for a node that
# pulls several images in a row (the kubelet serializes pulls by default).
PULLER_DEADLINE_S = 600
CONCURRENCY = 16  # pullers in flight at once, each on its own node while nodes suffice
POLL_S = 2.0  # a puller's status is read this often
RECONCILE_S = 30.0  # the pool's nodes are listed this often (new nodes get the images)
CREATE_ATTEMPTS = 5
REASON_CAP = 300  # characters of a failure reason kept
# Container waiting reasons that mean the kubelet could not pull the image.
PULL_FAILURES = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull",
                 "RegistryUnavailable", "SignatureValidationFailed")
PULLED, PENDING, FAILED = "pulled", "pending", "failed"
# Tiny and equal requests and limits: the container never runs a process of the image.
PULLER_RESOURCES = {"cpu": "10m", "memory": "32Mi"}


def puller_name(image: str, node: str) -> str:
    return "sandman-prepull-" + hashlib.sha256(f"{image}\n{node}".encode()).hexdigest()[:20]


def digest_label(image: str) -> str:
    return image.rpartition("@sha256:")[2][:contract.PREPULL_DIGEST_CHARS]


def _text(reason: object, message: object) -> str:
    out = ": ".join(str(x) for x in (reason, message) if x)
    return " ".join(out.split())[:REASON_CAP]


def outcome(pod: dict) -> tuple[str, str]:
    """(pulled | pending | failed, reason) of a puller pod, from its status."""
    st = pod.get("status") or {}
    statuses = st.get("containerStatuses") or []
    for c in statuses:
        waiting = (c.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in PULL_FAILURES:
            return FAILED, _text(waiting.get("reason"), waiting.get("message"))
    # An imageID or a running container: the kubelet had the image (kwok runs the container
    # without one). Every container, not the first listed: the kubelet lists them by name.
    if statuses and all(c.get("imageID") or (c.get("state") or {}).get("running") is not None
                        for c in statuses):
        return PULLED, ""
    if st.get("phase") == "Failed":  # refused by the kubelet, or past its deadline
        return FAILED, _text(st.get("reason"), st.get("message")) or "pod failed"
    return PENDING, ""


def adoptable(pod: dict, body: dict) -> bool:
    """A stored pod of a puller's name is ours (an ambiguous create's, an earlier leader's) only
    when it is a puller as `body` writes it: labelled, on the node, one container of the image
    running NO_ENTRYPOINT, the same runtime class, nothing else that runs. The names are
    predictable, so anyone who may create pods here can plant one first: a sibling container
    would report the node pulled (or run the image's entrypoint) on the controller's word."""
    spec, want = pod.get("spec") or {}, body["spec"]
    [ours] = want["containers"]
    got = spec.get("containers") or []
    return (contract.LABEL_PREPULL in ((pod.get("metadata") or {}).get("labels") or {})
            and spec.get("nodeName") == want["nodeName"]
            and not spec.get("initContainers") and not spec.get("ephemeralContainers")
            and spec.get("runtimeClassName") == want.get("runtimeClassName")
            and len(got) == 1
            and all(got[0].get(k) == ours.get(k) for k in ("name", "image", "command", "args")))


def tolerates(tolerations: list[dict], taint: dict) -> bool:
    """Kubernetes' toleration match, for the taints that keep sandboxes off a node."""
    for t in tolerations:
        if t.get("effect") and t.get("effect") != taint.get("effect"):
            continue
        if not t.get("key"):
            if t.get("operator") == "Exists":
                return True
            continue
        if t.get("key") != taint.get("key"):
            continue
        if t.get("operator") == "Exists" or t.get("value", "") == taint.get("value", ""):
            return True
    return False


def eligible(node: dict, tolerations: list[dict]) -> bool:
    """A node the sandboxes can land on: schedulable, Ready, its blocking taints tolerated."""
    spec = node.get("spec") or {}
    if spec.get("unschedulable"):
        return False
    ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                for c in (node.get("status") or {}).get("conditions") or [])
    return ready and all(tolerates(tolerations, t) for t in spec.get("taints") or []
                         if t.get("effect") in ("NoSchedule", "NoExecute"))


@dataclass
class _NodeState:
    state: str = PENDING
    reason: str = ""


class Prepuller:
    def __init__(self, kube: Kube, pacer: Pacer, settings: Settings, clock=time.monotonic):
        self.kube = kube
        self.pacer = pacer
        self.s = settings
        self.clock = clock
        self.images: collections.OrderedDict[str, dict[str, _NodeState]] = \
            collections.OrderedDict()
        self.pinned: set[str] = set()  # the chart's images: never forgotten
        self.nodes: list[str] = []
        self._listed = False  # self.nodes came from a list, not the empty start
        self._queue: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
        self._inflight: set[str] = set()  # puller names being created, watched or deleted
        self._wake = asyncio.Event()

    # ---- the API's side ------------------------------------------------------------------------
    async def post(self, images: list[str]) -> api.Images:
        """`POST /v1/images`: `add`, with the pool's nodes listed first if they never were
        (nothing tracked yet), so the answer counts every node pending."""
        if not self._listed:
            try:
                self.nodes = await self.pool_nodes()
                self._listed = True
            except Exception as ex:  # noqa: BLE001 - the next reconcile lists them
                log.warning("pre-pull: listing the pool's nodes failed: %s", ex)
        self.add(images)
        return self.status()

    def add(self, images: list[str], pinned: bool = False) -> None:
        """Track `images` (checked refs): new ones are pulled onto every node of the pool, a
        node that failed an image tries again. Over api.MAX_PREPULL_IMAGES, the oldest images
        not from the chart are forgotten (no longer pulled onto new nodes)."""
        fresh = [i for i in dict.fromkeys(images) if i not in self.images]
        if len(self.pinned | set(images)) > api.MAX_PREPULL_IMAGES:
            raise BadRequest(f"images: at most {api.MAX_PREPULL_IMAGES} tracked, the chart's "
                             f"included ({len(self.pinned)})")
        for image in dict.fromkeys(images):
            per = self.images.setdefault(image, {})
            self.images.move_to_end(image)
            # The pool's nodes as last listed: the answer already counts them pending, so a
            # caller polling for "nothing pending" never sees a new image as done.
            for node in self.nodes:
                if node not in per:
                    per[node] = _NodeState()
                    self._queue.put_nowait((image, node))
            for node, st in per.items():
                if st.state == FAILED:
                    per[node] = _NodeState()
                    self._queue.put_nowait((image, node))
            if pinned:
                self.pinned.add(image)
        while len(self.images) > api.MAX_PREPULL_IMAGES:
            old = next(i for i in self.images if i not in self.pinned)
            del self.images[old]
        if fresh:
            self._wake.set()  # the new images go to the nodes now, not at the next reconcile
        self._gauge()

    def status(self) -> api.Images:
        out = []
        for image, per in self.images.items():
            counts = collections.Counter(st.state for st in per.values())
            failures = {n: st.reason for n, st in sorted(per.items()) if st.state == FAILED}
            out.append(api.ImageStatus(
                image=image, pulled=counts[PULLED], pending=counts[PENDING],
                failed=counts[FAILED],
                failures=dict(list(failures.items())[:api.MAX_IMAGE_FAILURES])))
        return api.Images(images=out, nodes=len(self.nodes))

    def _gauge(self) -> None:
        metrics.PREPULL_PENDING.set(sum(1 for per in self.images.values()
                                        for st in per.values() if st.state == PENDING))

    def _record(self, image: str, node: str, state: str, reason: str = "") -> None:
        per = self.images.get(image)
        if per is not None and node in per:
            per[node] = _NodeState(state, reason)
        metrics.prepulled(state)
        if state == FAILED:
            log.warning("pre-pull of %s on %s failed: %s", image, node, reason)
        self._gauge()

    # ---- the loop --------------------------------------------------------------------------------
    async def run(self) -> None:
        """Reconcile every RECONCILE_S (or when images are added) with CONCURRENCY workers;
        cancelled with the controller."""
        workers = [asyncio.get_running_loop().create_task(self._worker(), name=f"prepull-{i}")
                   for i in range(CONCURRENCY)]
        try:
            while True:
                try:
                    await self.reconcile()
                    await self.sweep()
                except Exception as ex:  # noqa: BLE001 - the next pass tries again
                    log.warning("pre-pull reconcile failed: %s", ex)
                self._wake.clear()
                waiter = asyncio.ensure_future(self._wake.wait())
                try:
                    await asyncio.wait({waiter}, timeout=RECONCILE_S)
                finally:
                    waiter.cancel()
        finally:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)

    async def pool_nodes(self) -> list[str]:
        sel = self.s.node_pool_label or ""
        tolerations = self.s.pod_template.get("tolerations", [])
        return sorted(n["metadata"]["name"] for n in await self.kube.list_nodes(sel)
                      if eligible(n, tolerations))

    async def reconcile(self) -> None:
        if not self.images:
            return
        self.nodes = await self.pool_nodes()
        self._listed = True
        live = set(self.nodes)
        for per in self.images.values():
            for node in [n for n in per if n not in live]:
                del per[node]  # the node left the pool
        # Image-major: the workers take consecutive pairs, so concurrent pullers land on
        # distinct nodes.
        for image, per in self.images.items():
            for node in self.nodes:
                if node not in per:
                    per[node] = _NodeState()
                    self._queue.put_nowait((image, node))
        self._gauge()

    async def sweep(self) -> int:
        """Delete puller pods this controller does not track (an earlier leader's)."""
        n = 0
        for pod in await self.kube.list_pods(contract.LABEL_PREPULL):
            meta = pod.get("metadata") or {}
            if contract.LABEL_PREPULL not in (meta.get("labels") or {}):
                continue  # the selector says so; never trust it with a delete
            if meta.get("name") in self._inflight or meta.get("deletionTimestamp"):
                continue
            await self._delete(meta["name"], meta.get("uid"))
            n += 1
        return n

    async def _worker(self) -> None:
        while True:
            image, node = await self._queue.get()
            per = self.images.get(image)
            if per is None or node not in per or per[node].state != PENDING:
                continue  # forgotten, or the node left, meanwhile
            try:
                state, reason = await self.pull(image, node)
            except asyncio.CancelledError:
                raise
            except Exception as ex:  # noqa: BLE001 - one pair's failure, never the worker's
                state, reason = FAILED, _text(type(ex).__name__, ex)
            self._record(image, node, state, reason)

    # ---- one puller ------------------------------------------------------------------------------
    def body(self, image: str, node: str) -> dict:
        t = self.s.pod_template
        spec: dict = {
            "nodeName": node,
            "restartPolicy": "Never",
            "activeDeadlineSeconds": PULLER_DEADLINE_S,
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "terminationGracePeriodSeconds": 0,
            "securityContext": {"runAsNonRoot": True, "runAsUser": 65534, "runAsGroup": 65534,
                                "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{
                "name": "pull", "image": image, "imagePullPolicy": "IfNotPresent",
                "command": [NO_ENTRYPOINT],
                "resources": {"requests": dict(PULLER_RESOURCES),
                              "limits": dict(PULLER_RESOURCES)},
                "securityContext": {"allowPrivilegeEscalation": False,
                                    "readOnlyRootFilesystem": True, "privileged": False,
                                    "capabilities": {"drop": ["ALL"]}}}],
        }
        # What decides how and where the sandboxes' images are pulled: the pool's taints and
        # pull secrets, and the runtime class (its image store).
        for k in ("tolerations", "imagePullSecrets", "runtimeClassName"):
            if k in t:
                spec[k] = t[k]
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": puller_name(image, node), "namespace": self.s.namespace,
                             "labels": {contract.LABEL_PREPULL: digest_label(image)}},
                "spec": spec}

    async def pull(self, image: str, node: str) -> tuple[str, str]:
        """One puller: a pacer slot, the create, its outcome, its delete (always)."""
        name = puller_name(image, node)
        slot = await self.pacer.acquire(PREPULL_JOB, role=ROLE_PREPULL)
        self._inflight.add(name)
        uid = None
        try:
            uid, why = await self._create(image, node)
            if uid is None:
                return FAILED, why
            return await self._watch(name, uid)
        finally:
            slot.done_creating()
            try:
                # Only the pod this create stored (its uid): a pod of that name that is no
                # puller of ours is never touched; a create stored after it was given up on
                # is the sweep's (it carries the label).
                if uid is not None:
                    await asyncio.shield(self._delete(name, uid))
            finally:
                self._inflight.discard(name)
                slot.gone()

    async def _create(self, image: str, node: str) -> tuple[str | None, str]:
        """(uid, "") once stored, or (None, why)."""
        body = self.body(image, node)
        name = body["metadata"]["name"]
        backoff = 0.5
        for _ in range(CREATE_ATTEMPTS):
            try:
                return (await self.kube.create_pod(body))["metadata"]["uid"], ""
            except client.ApiException as ex:
                if ex.status == 409:  # ours from an ambiguous try, or an earlier leader's
                    try:
                        pod = await self.kube.read_pod(name)
                    except Exception as rex:  # noqa: BLE001
                        return None, _text("create conflict, unreadable", rex)
                    if adoptable(pod, body):
                        return pod["metadata"]["uid"], ""
                    return None, f"the pod name {name} is taken by a pod that is no puller"
                if ex.status != 429 and ex.status not in AMBIGUOUS_STATUSES:
                    return None, _text(f"create refused ({ex.status})", ex.reason)
                self.pacer.slow_down()
            except Exception as ex:  # noqa: BLE001
                if not is_transport_error(ex):
                    raise
            await asyncio.sleep(backoff)  # the same name again: a stored create answers 409
            backoff = min(backoff * 2, 5.0)
        return None, "create kept failing; gave up"

    async def _watch(self, name: str, uid: str) -> tuple[str, str]:
        deadline = self.clock() + PULLER_DEADLINE_S + 30
        while self.clock() < deadline:
            try:
                pod = await self.kube.read_pod(name)
            except client.ApiException as ex:
                if ex.status == 404:
                    return FAILED, "the puller pod was deleted before its outcome"
                pod = None
            except Exception as ex:  # noqa: BLE001
                if not is_transport_error(ex):
                    raise
                pod = None
            if pod is not None:
                if pod["metadata"].get("uid") != uid:
                    return FAILED, "the puller pod was replaced before its outcome"
                state, reason = outcome(pod)
                if state != PENDING:
                    return state, reason
            await asyncio.sleep(POLL_S)
        return FAILED, f"no outcome within {PULLER_DEADLINE_S + 30}s"

    async def _delete(self, name: str, uid: str | None) -> None:
        for _ in range(5):
            try:
                await self.kube.delete_pod(name, uid)
                return
            except client.ApiException as ex:
                if ex.status in (404, 409):  # gone, or another pod of that name now
                    return
            except Exception as ex:  # noqa: BLE001
                if not is_transport_error(ex):
                    raise
            await asyncio.sleep(1.0)
        log.warning("puller %s not deleted; the next sweep tries again", name)


def check_images(images: list[str], source: str) -> list[str]:
    """Refs checked as the API checks them; ValueError with one line naming `source`."""
    for i, ref in enumerate(images):
        api.check_digest_ref(ref, f"{source}[{i}]")
    if len(set(images)) > api.MAX_PREPULL_IMAGES:
        raise ValueError(f"{source}: at most {api.MAX_PREPULL_IMAGES} images")
    return list(dict.fromkeys(images))

