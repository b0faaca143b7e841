"""Image pre-pull (docs/controller.md "Pre-pull"): the images of a task set, pinned by digest,
pulled onto every node of the sandbox node pool before a run, so the run's creates find them.

The paper's creates that pulled took 17.4 s at the median (p90 74.3 s) against 4.1 s with the
image on the node; before its largest spread step it pre-pulled the step's 1.21 GB image onto
the 229 nodes that lacked it.

How: one short-lived puller pod per (node, image), pinned with `nodeName` to a node the
sandboxes can land on (the pool's node label, the pod template's tolerations, schedulable and
Ready). The kubelet pulls the image before it creates the container; the container's command
is a path no image has (a random name under NO_ENTRYPOINT_DIR), so the image's own entrypoint
never runs: the create fails at exec, after the pull. The outcome is read from the container
status: an `imageID` or a running container means the node has the image; the kubelet's pull
errors (ErrImagePull, ImagePullBackOff, ...) mean it failed, with the kubelet's message as the
reason. The pod is then deleted.

Every puller's create takes a slot from the controller's one pacer, in the PREPULL role, which
is granted only when no grading or rollout create waits: a pre-pull never delays an acquire.
At most CONCURRENCY pullers run at once, spread over the nodes (image-major order, so the
concurrent pullers are on different nodes).

Pullers carry contract.LABEL_PREPULL and neither the sandbox nor the managed-by label: the
books, the sweep, the webhook and the sandbox policies never see them. Anyone who may create pods
in the namespace can write that label, so it proves nothing: the outcome is read only from a pod
this controller's create stored (its uid), `stop` deletes exactly those, and `sweep` deletes an
untracked labelled pod (a pod left by an earlier leader) only when it is a puller as written,
one that runs no program, with the controller's proof under a books key. The chart's uninstall
cleanup deletes every labelled pod.

State lives in the leader's memory: a new leader starts from the chart's images
(--prepull-image) and pulls them again where they are missing; images posted to the old leader
are posted again by whoever needs them (the call is idempotent).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import logging
import secrets
import time
from dataclasses import dataclass

from kubernetes import client

from controller import metrics
from controller.create import proof
from controller.errors import BadRequest
from controller.kube import AMBIGUOUS_STATUSES, Kube, is_transport_error
from controller.pacer import ROLE_PREPULL, Pacer
from controller.settings import Settings
from sandman import api, contract

log = logging.getLogger("controller.prepull")

PREPULL_JOB = "sandman-prepull"  # the pacer's job key of every puller
# The puller's command is a random name in this directory: no image has it, so the container
# fails at exec, after the pull. A fixed path could be shipped by an image's author, whose own
# program would then run there, unguarded, on every node of the pool.
NO_ENTRYPOINT_DIR = "/.sandman-prepull"
# The kubelet's deadline for a puller (activeDeadlineSeconds). The paper's slowest pulls: the
# largest images' p90 153 s, 0.58% of all pulls over 120 s; 600 s leaves room for a node that
# pulls several images in a row (the kubelet serializes pulls by default).
PULLER_DEADLINE_S = 600
CONCURRENCY = 16  # pullers in flight at once, each on its own node while nodes suffice
POLL_S = 2.0  # a puller's status is read this often
RECONCILE_S = 30.0  # the pool's nodes are listed this often (new nodes get the images)
CREATE_ATTEMPTS = 5
REASON_CAP = 300  # characters of a failure reason kept
# A stop's bound for cancelling the pullers and deleting their pods (one delete each, tens of
# ms on a healthy API server); within the controller pod's default 30 s termination grace. What it
# leaves is the next leader's sweep.
STOP_S = 10.0
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
    """A stored pod of a puller's name is this create's own (an earlier try whose answer was
    lost) only when it is `body` as written: labelled, on the node, one container of the image
    running `body`'s command, the same runtime class, nothing else that runs. The command is
    drawn per body and known to nobody until a create stores it, so an earlier leader's puller,
    another release's or a tenant's copy of one is not adopted: the names are predictable, and
    a planted pod's status (kwok's, a sibling's) would be reported on the controller's word."""
    spec, want = pod.get("spec") or {}, body["spec"]
    [ours] = want["containers"]
    got = spec.get("containers") or []
    return (contract.LABEL_PREPULL in ((pod.get("metadata") or {}).get("labels") or {})
            and spec.get("nodeName") == want["nodeName"]
            and not spec.get("initContainers") and not spec.get("ephemeralContainers")
            and spec.get("runtimeClassName") == want.get("runtimeClassName")
            and len(got) == 1
            and all(got[0].get(k) == ours.get(k) for k in ("name", "image", "args", "command"))
            and _no_entrypoint(got[0].get("command")))


def sweepable(pod: dict, key: bytes | None, namespace: str) -> bool:
    """An untracked labelled pod the sweep may delete: a puller as written (one container
    running a path in NO_ENTRYPOINT_DIR, nothing else), so it runs no program, and under a books
    key the controller's proof (contract.ANNOTATION_PROOF of its name and nonce). The label is
    anyone's to write: a tenant's labelled pod that runs something is not the controller's."""
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    labels = meta.get("labels") or {}
    got = spec.get("containers") or []
    if not (contract.LABEL_PREPULL in labels and len(got) == 1
            and not spec.get("initContainers") and not spec.get("ephemeralContainers")
            and _no_entrypoint(got[0].get("command"))):
        return False
    if key is None:
        return True
    want = proof(key, namespace, meta.get("name", ""), labels.get(contract.LABEL_NONCE, ""))
    return hmac.compare_digest((meta.get("annotations") or {}).get(contract.ANNOTATION_PROOF)
                               or "", want)


def _no_entrypoint(command: object) -> bool:
    """The puller's command: one path in NO_ENTRYPOINT_DIR (its name is drawn per puller)."""
    return (isinstance(command, list) and len(command) == 1 and isinstance(command[0], str)
            and command[0].startswith(NO_ENTRYPOINT_DIR + "/")
            and len(command[0]) == len(NO_ENTRYPOINT_DIR) + 1 + 32)


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
        self._mine: dict[str, str] = {}  # name -> uid of every pod a create stored, until deleted
        self._calls: set[asyncio.Future] = set()  # create calls (they outlive a cancelled puller)
        self._workers: list[asyncio.Task] = []
        self._run: asyncio.Task | None = None
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
        self._run = asyncio.current_task()
        try:  # an earlier leader's pullers first: their names are the ones the workers take
            await self.sweep()
        except Exception as ex:  # noqa: BLE001 - the next pass tries again
            log.warning("pre-pull sweep failed: %s", ex)
        workers = self._workers = [
            asyncio.get_running_loop().create_task(self._worker(), name=f"prepull-{i}")
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

    async def stop(self, timeout: float = STOP_S) -> None:
        """Cancel the pullers and delete every pod they created, by name and uid, within
        `timeout`: a create still in flight is waited for, so the pod it stores goes too. A
        stopped or deposed leader leaves none for the next one (docs/controller.md)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        tasks = [t for t in (self._run, *self._workers) if t is not None]
        for t in tasks:
            t.cancel()
        for waits in (tasks, self._calls):
            pending = [f for f in waits if not f.done()]
            if pending:
                await asyncio.wait(pending, timeout=max(0.0, deadline - loop.time()))
        deletes = [loop.create_task(self._delete(n, u)) for n, u in list(self._mine.items())]
        if deletes:
            _, late = await asyncio.wait(deletes, timeout=max(0.0, deadline - loop.time()))
            for t in late:
                t.cancel()
        if self._mine:
            log.warning("pre-pull stopped with %d puller(s) not deleted: %s; the next leader's "
                        "sweep deletes them", len(self._mine), ", ".join(sorted(self._mine)))

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
        """Delete puller pods this controller does not track (an earlier leader's): pullers as
        written only (`sweepable`)."""
        n = 0
        for pod in await self.kube.list_pods(contract.LABEL_PREPULL):
            meta = pod.get("metadata") or {}
            if not sweepable(pod, self.s.books_key, self.s.namespace):
                continue  # the label is anyone's; never trust it with a delete
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
                "command": [f"{NO_ENTRYPOINT_DIR}/{secrets.token_hex(16)}"],
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
        meta: dict = {"name": puller_name(image, node), "namespace": self.s.namespace,
                      "labels": {contract.LABEL_PREPULL: digest_label(image)}}
        if self.s.books_key is not None:  # the sweep's mark, as on the sandboxes (create.py)
            nonce = secrets.token_hex(8)
            meta["labels"][contract.LABEL_NONCE] = nonce
            meta["annotations"] = {contract.ANNOTATION_PROOF: proof(
                self.s.books_key, self.s.namespace, meta["name"], nonce)}
        return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}

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
                return await self._call_create(body), ""
            except client.ApiException as ex:
                if ex.status == 409:  # ours from an ambiguous try, or someone else's
                    try:
                        pod = await self.kube.read_pod(name)
                    except Exception as rex:  # noqa: BLE001
                        return None, _text("create conflict, unreadable", rex)
                    if adoptable(pod, body):
                        self._mine[name] = pod["metadata"]["uid"]
                        return pod["metadata"]["uid"], ""
                    if not (pod.get("metadata") or {}).get("deletionTimestamp"):
                        return None, (f"the pod name {name} is taken by a pod this controller "
                                      "did not create")
                    # Going (a swept leftover): its name is free again shortly.
                elif ex.status != 429 and ex.status not in AMBIGUOUS_STATUSES:
                    return None, _text(f"create refused ({ex.status})", ex.reason)
                else:
                    self.pacer.slow_down()
            except Exception as ex:  # noqa: BLE001
                if not is_transport_error(ex):
                    raise
            await asyncio.sleep(backoff)  # the same name again: a stored create answers 409
            backoff = min(backoff * 2, 5.0)
        return None, "create kept failing; gave up"

    async def _call_create(self, body: dict) -> str:
        """The create's uid. Its call runs on when the puller is cancelled (the client's
        thread does), so what it stores is recorded in `_mine` for `stop` to delete."""
        name = body["metadata"]["name"]
        call = asyncio.ensure_future(self.kube.create_pod(body))
        self._calls.add(call)

        def stored(f: asyncio.Future) -> None:
            self._calls.discard(f)
            if not f.cancelled() and f.exception() is None:
                self._mine[name] = f.result()["metadata"]["uid"]

        call.add_done_callback(stored)
        return (await asyncio.shield(call))["metadata"]["uid"]

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
                self._forget(name, uid)
                return
            except client.ApiException as ex:
                if ex.status in (404, 409):  # gone, or another pod of that name now
                    self._forget(name, uid)
                    return
            except Exception as ex:  # noqa: BLE001
                if not is_transport_error(ex):
                    raise
            await asyncio.sleep(1.0)
        log.warning("puller %s not deleted; the next sweep tries again", name)

    def _forget(self, name: str, uid: str | None) -> None:
        if uid is not None and self._mine.get(name) == uid:
            del self._mine[name]


def check_images(images: list[str], source: str) -> list[str]:
    """Refs checked as the API checks them; ValueError with one line naming `source`."""
    for i, ref in enumerate(images):
        api.check_digest_ref(ref, f"{source}[{i}]")
    if len(set(images)) > api.MAX_PREPULL_IMAGES:
        raise ValueError(f"{source}: at most {api.MAX_PREPULL_IMAGES} images")
    return list(dict.fromkeys(images))

