"""Clean-up that no owner task does: the books rebuilt from labels after a (re)start, the
periodic sweep of the controller's pods that nothing owns, and a job's drain."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from controller import metrics
from controller import pods as P
from controller.books import DRAINED, ENDING, POOL_JOB, Books, State
from controller.create import Creator, proof
from controller.kube import Kube
from controller.pacer import Pacer
from controller.pipeline import Pipeline
from controller.settings import Settings
from sandman import contract

log = logging.getLogger("controller")
S = State
# A drain waits this long for the job's ConfigMap delete before it answers; an API server
# that holds the delete longer must not hold the drain (the delete goes on in the background).
DRAIN_DELETE_WAIT_S = 3.0
FOREIGN_REMEMBERED = 10_000  # uids of ignored pods kept so each is logged and counted once


class Sweeper:
    def __init__(self, kube: Kube, books: Books, pacer: Pacer, pipeline: Pipeline,
                 creator: Creator, settings: Settings, spawn: Callable):
        self.kube = kube
        self.books = books
        self.pacer = pacer
        self.pipeline = pipeline
        self.creator = creator
        self.s = settings
        self.spawn = spawn
        self.foreign_seen: OrderedDict[str, None] = OrderedDict()

    # ---- whose pod is it -----------------------------------------------------------------------
    def why_foreign(self, pod: dict) -> str | None:
        """None when the pod is the controller's own: a sandbox (so the webhook and the policy
        judged it) with the controller's labels and, under a books key, a valid proof. Anyone
        who may create pods can write labels; only the key's holder can write the proof."""
        labels = P.labels(pod)
        if labels.get(contract.LABEL_SANDBOX) != contract.SANDBOX_TRUE:
            return "no_sandbox_label"
        key = self.s.books_key
        if key is not None:
            want = proof(key, self.s.namespace, P.name(pod), labels.get(contract.LABEL_NONCE, ""))
            if not hmac.compare_digest(P.annotation(pod, contract.ANNOTATION_PROOF) or "", want):
                return "no_proof"
        return None

    def mine(self, pod: dict) -> bool:
        """True for the controller's own pod; a foreign one is logged and counted once, and
        left alone: it is not the controller's to adopt, count or delete."""
        why = self.why_foreign(pod)
        if why is None:
            return True
        uid = P.uid(pod) or P.name(pod)
        if uid not in self.foreign_seen:
            self.foreign_seen[uid] = None
            while len(self.foreign_seen) > FOREIGN_REMEMBERED:
                self.foreign_seen.popitem(last=False)
            metrics.foreign(why)
            log.warning("ignoring pod %s: it carries the controller's labels but the controller "
                        "did not create it (%s)", P.name(pod), why)
        return False

    def rebuild(self, pods: list[dict]) -> None:
        """Books from labels after a (re)start: no pod is forgotten.

        leased -> a live sandbox (its caller holds the token); warm -> deleted (its token died
        with the old process); no state or deleting -> the old owner's create or delete, redone.
        """
        for pod in pods:
            name = P.name(pod)
            self.books.pods[name] = pod
            if name in self.books.entries or not self.mine(pod):
                continue
            if (P.labels(pod).get(contract.LABEL_STATE) == contract.STATE_LEASED
                    and not P.deleting(pod)):
                job = P.labels(pod).get(contract.LABEL_JOB, POOL_JOB)
                self.books.found(pod, self.pacer.adopt(job), S.LEASED)
            else:
                self.pipeline.adopt_for_delete(pod, "rebuilt without an owner (restart)")
        metrics.LIVE.set(self.pacer.live)

    async def loop(self) -> None:
        while True:
            await asyncio.sleep(self.s.sweep_interval)
            try:
                await self.sweep()
            except Exception as ex:  # noqa: BLE001
                log.warning("sweep failed: %s", ex)

    async def sweep(self) -> int:
        """Delete the controller's pods that nothing owns (the paper had no such sweep)."""
        sel = f"{contract.LABEL_MANAGED_BY}={contract.MANAGED_BY_CONTROLLER}"
        pods = await self.kube.list_pods_slim(sel)
        seen = set()
        n = 0
        now = time.time()
        for pod in pods:
            name = P.name(pod)
            seen.add(name)
            e = self.books.entries.get(name)
            if e is not None and e.uid in (None, P.uid(pod)):
                continue
            if P.deleting(pod) or P.age(pod, now) < self.s.sweep_grace or not self.mine(pod):
                continue
            self.pipeline.adopt_for_delete(pod, "swept: no owner")
            metrics.SWEPT.inc()
            n += 1
        for e in list(self.books.entries.values()):
            if e.stage is S.DELETING and e.name not in seen and e.uid is not None:
                self.books.gone(e)
        return n

    def expire(self, now: float | None = None) -> int:
        """Delete every handed-out sandbox whose lifetime ran out (no renew came): a trainer
        killed with SIGKILL leaks its sandboxes for at most their lifetime. Warm and parked
        pods never expire (nobody holds them; the pool's idle timeout bounds them). Runs once
        a second over the books alone: no API call until something expires."""
        now = time.time() if now is None else now
        n = 0
        for e in list(self.books.entries.values()):
            if e.stage is not S.LEASED or e.expires_at is None or e.expires_at > now:
                continue
            why = (f"lifetime {e.lifetime or 0:g}s ran out "
                   f"({'no renew since the last one' if e.renewed else 'never renewed'})")
            self.pipeline.delete(e, f"expired: {why}")
            metrics.expired(e.renewed)
            pod = self.books.pods.get(e.name) or {"metadata": {"name": e.name, "uid": e.uid}}
            self.spawn(self.kube.pod_event(pod, "SandboxExpired",
                                           f"sandman deleted the sandbox: {why}"),
                       f"event-{e.name}")
            n += 1
        return n

    async def drain(self, job: str) -> int:
        """Every pod of the job goes (queued creates are withdrawn, creates in flight are
        deleted once they settle), and the job's owner ConfigMap with them, before the answer
        when the API server deletes it within DRAIN_DELETE_WAIT_S: it holds the job's image
        pins, which an acquire of the same name after the drain must not find."""
        n = 0
        for e in list(self.books.entries.values()):
            if (e.job != job or e.stage in ENDING or e.stage in DRAINED
                    or e.stage is S.WITHDRAWN):
                continue
            n += 1
            self.pipeline.unwant(e, "job drained")
        gone = self.spawn(self.creator.delete_job_object(job), f"drain-{job}")
        try:
            await asyncio.wait_for(asyncio.shield(gone), DRAIN_DELETE_WAIT_S)
        except TimeoutError:
            log.warning("drain of job %s answers before its ConfigMap is deleted (the delete "
                        "goes on): an acquire of that job name meanwhile keeps its old image "
                        "pins", job)
        return n
