"""Paused sandboxes: id -> (its job, so its tenant, and its checkpoint), until the checkpoint
expires (docs/controller.md "Idle pause", "Finding it again").

A pause (the API's, or the idle rule's) records the sandbox here before it is released, in
memory and in one ConfigMap of the sandbox namespace (`sandman-paused`, the controller's own:
a tenant has no write there). A new leader reads it back before it answers anything, so the
holder's next call about the old id still gets 410 naming the checkpoint after a restart or a
leader change, never a bare 404.

The record is data: every entry is checked when read (the id a pod name, the job scoped to a
tenant, the checkpoint one of that same tenant, a live expiry, at most VALUE_MAX bytes, and,
under a books key, an HMAC binding them to this namespace). An entry that fails any check is
refused, logged and deleted; it never decides an answer. Bounded: at most cap entries and
MAX_RECORDED_BYTES bytes, the oldest dropped first (logged).
"""

from __future__ import annotations

import datetime as dt
import hmac
import json
import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from controller import auth as A
from controller.checkpoint import NO_TENANT, parse_id
from controller.errors import CheckpointGone
from controller.fork import one_line
from sandman import contract

if TYPE_CHECKING:
    from controller.kube import Kube

log = logging.getLogger("controller.paused")

RECORD_NAME = "sandman-paused"  # the ConfigMap, in the sandbox namespace
PAUSED_MAX = 2000  # paused ids remembered, in memory and in the record
# The API server stores at most 1 MiB per object: room left for the metadata.
MAX_RECORDED_BYTES = 768 * 1024
VALUE_MAX = 1024  # bytes of one entry's value (a real one is ~300)
LOAD_ATTEMPTS = 10  # a new leader's reads of the record before it gives up starting


@dataclass(frozen=True)
class PausedSandbox:
    job: str  # the scoped job key: its tenant decides who may learn `checkpoint`
    checkpoint: str
    until: float  # wall clock: the checkpoint's expiry


class Unrecorded(Exception):
    """The record could not be written: the pause is not done (the sandbox stays leased)."""


def until_of(expires_at: str) -> float:
    """A checkpoint's expiry (RFC 3339, as api.Checkpointed says it) in epoch seconds: the
    record lasts as long as the checkpoint it names."""
    return dt.datetime.fromisoformat(expires_at.replace("Z", "+00:00")).timestamp()


def tenant_of(job: str, tenants: bool) -> str | None:
    return A.split_job(job)[0] if tenants else None


def entry_proof(key: bytes, scope: str, sid: str, p: PausedSandbox) -> str:
    """HMAC binding an entry to its namespace, id, job, checkpoint and expiry: an entry
    written by anyone but this controller's key holder, or moved to another id, proves
    nothing."""
    msg = json.dumps(["paused", scope, sid, p.job, p.checkpoint, int(p.until)]).encode()
    return hmac.new(key, msg, "sha256").hexdigest()


def encode(sid: str, p: PausedSandbox, key: bytes | None, scope: str) -> str:
    doc: dict = {"job": p.job, "checkpoint": p.checkpoint, "until": int(p.until)}
    if key is not None:
        doc["proof"] = entry_proof(key, scope, sid, p)
    return json.dumps(doc, separators=(",", ":"))


def check(sid: object, raw: object, now: float, *, tenants: bool, key: bytes | None,
          scope: str) -> PausedSandbox:
    """One recorded entry, checked; ValueError (one line) for anything else."""
    if not isinstance(sid, str) or not contract.is_dns_label(sid):
        raise ValueError("its key is not a sandbox id")
    if not isinstance(raw, str) or len(raw.encode()) > VALUE_MAX:
        raise ValueError(f"its value is not text of at most {VALUE_MAX} bytes")
    try:
        doc = json.loads(raw)
    except ValueError:
        raise ValueError("its value is not JSON") from None
    if not isinstance(doc, dict) or set(doc) - {"job", "checkpoint", "until", "proof"}:
        raise ValueError("its value is not a paused sandbox's")
    job, cid, until = doc.get("job"), doc.get("checkpoint"), doc.get("until")
    if not isinstance(job, str) or not contract.is_label_value(job, allow_empty=False):
        raise ValueError("its job is not a job key")
    tenant = tenant_of(job, tenants)
    if tenants and tenant is None:
        raise ValueError("its job names no tenant")
    if not isinstance(cid, str):
        raise ValueError("its checkpoint is not a checkpoint id")
    try:
        name, _ = parse_id(cid)
    except CheckpointGone:
        raise ValueError("its checkpoint is not a checkpoint id") from None
    if name != (tenant or NO_TENANT):
        raise ValueError("its checkpoint is not of its job's tenant")
    if (isinstance(until, bool) or not isinstance(until, (int, float))
            or not math.isfinite(until)):
        raise ValueError("its expiry is not a time")
    if until <= now:
        raise ValueError("its checkpoint has expired")
    p = PausedSandbox(job, cid, float(until))
    if key is not None:
        said = doc.get("proof")
        if not isinstance(said, str) or not hmac.compare_digest(
                said, entry_proof(key, scope, sid, p)):
            raise ValueError("its proof does not verify under the books key")
    return p


def parse(data: dict, now: float, *, tenants: bool, key: bytes | None, scope: str,
          cap: int = PAUSED_MAX) -> tuple[list[tuple[str, PausedSandbox]], dict[str, str]]:
    """The record's entries that check, oldest first and at most `cap` (the newest kept), and
    {key: why} of those refused (expired ones included)."""
    kept: list[tuple[str, PausedSandbox]] = []
    refused: dict[str, str] = {}
    for sid, raw in (data or {}).items():
        try:
            kept.append((sid, check(sid, raw, now, tenants=tenants, key=key, scope=scope)))
        except ValueError as ex:
            refused[str(sid)] = str(ex)
    kept.sort(key=lambda kv: kv[1].until)
    for sid, _ in kept[:max(0, len(kept) - cap)]:
        refused[sid] = f"over the record's bound ({cap} entries)"
    return kept[max(0, len(kept) - cap):], refused


class Paused:
    """The paused sandboxes, the oldest first. Without a `kube` (the idle rule's unit tests),
    memory only."""

    def __init__(self, cap: int = PAUSED_MAX, kube: Kube | None = None, *,
                 tenants: bool = False, key: bytes | None = None, scope: str = "",
                 max_bytes: int = MAX_RECORDED_BYTES):
        self.cap = cap
        self.max_bytes = max_bytes
        self.kube = kube
        self.tenants = tenants
        self.key = key
        self.scope = scope
        self.items: OrderedDict[str, PausedSandbox] = OrderedDict()
        self._sizes: dict[str, int] = {}  # bytes each entry takes in the record

    def where(self) -> str:
        return f"ConfigMap {self.scope}/{RECORD_NAME}"

    def get(self, sid: str, now: float | None = None) -> PausedSandbox | None:
        p = self.items.get(sid)
        if p is not None and p.until <= (time.time() if now is None else now):
            self._forget(sid)
            return None
        return p

    def _forget(self, sid: str) -> None:
        self.items.pop(sid, None)
        self._sizes.pop(sid, None)

    def _put(self, sid: str, p: PausedSandbox) -> list[str]:
        """In memory; returns the ids dropped for the bound (the oldest first)."""
        self._forget(sid)
        self.items[sid] = p
        self._sizes[sid] = len(sid) + len(encode(sid, p, self.key, self.scope))
        dropped: list[str] = []
        while len(self.items) > self.cap or (len(self.items) > 1 and sum(
                self._sizes.values()) > self.max_bytes):
            old, gone = self.items.popitem(last=False)
            self._sizes.pop(old, None)
            dropped.append(old)
            log.warning("paused sandbox %s (job %s, checkpoint %s) forgotten: the record "
                        "holds at most %d paused sandboxes and %d bytes; its checkpoint stays "
                        "until its TTL", old, gone.job, gone.checkpoint, self.cap,
                        self.max_bytes)
        return dropped

    def add(self, sid: str, p: PausedSandbox) -> None:
        """Memory only (the record is written by `record`)."""
        self._put(sid, p)

    def expired(self, now: float | None = None) -> list[str]:
        """Ids whose checkpoint's TTL passed, forgotten."""
        now = time.time() if now is None else now
        gone = [sid for sid, p in self.items.items() if p.until <= now]
        for sid in gone:
            self._forget(sid)
        return gone

    async def record(self, sid: str, p: PausedSandbox) -> None:
        """Remembered, in memory and (with a kube) in the record, before the pause is done;
        Unrecorded when the record could not be written (then not remembered either)."""
        dropped = self._put(sid, p) + self.expired()
        if self.kube is None:
            return
        value = encode(sid, p, self.key, self.scope)
        try:
            await self._patch({sid: value, **{d: None for d in dropped if d != sid}},
                              create_with={sid: value})
        except Exception as ex:  # noqa: BLE001 - any failure: the pause is not done
            self._forget(sid)
            raise Unrecorded(f"sandbox {sid}'s pause could not be recorded in "
                             f"{self.where()} ({type(ex).__name__}: {one_line(ex, 200)})") \
                from None

    async def unrecord(self, sids: list[str]) -> None:
        """Entries deleted from the record (forgotten in memory first); best effort: a
        stale entry is refused when read (expired) and deleted then."""
        for sid in sids:
            self._forget(sid)
        if self.kube is None or not sids:
            return
        try:
            await self._patch({sid: None for sid in sids})
        except Exception as ex:  # noqa: BLE001 - logged; the next load deletes them
            log.warning("paused record: %d entries not deleted from %s: %s", len(sids),
                        self.where(), one_line(ex))

    async def _patch(self, data: dict, create_with: dict | None = None) -> None:
        from kubernetes import client

        assert self.kube is not None
        for _ in range(2):
            try:
                await self.kube.patch_config_map(RECORD_NAME, {"data": data})
                return
            except client.ApiException as ex:
                if ex.status != 404:
                    raise
            if create_with is None:
                return  # nothing recorded: nothing to delete
            try:
                await self.kube.create_config_map({"metadata": {
                    "name": RECORD_NAME,
                    "labels": {contract.LABEL_MANAGED_BY: contract.MANAGED_BY_CONTROLLER}},
                    "data": create_with})
                return
            except client.ApiException as ex:
                if ex.status != 409:  # made meanwhile: patch it
                    raise
        raise RuntimeError(f"{self.where()} was deleted while it was written")

    async def load(self, now: float | None = None) -> int:
        """The record read into memory (a new leader, before it answers); entries that do
        not check are refused, logged and deleted. Raises when it cannot be read."""
        from kubernetes import client

        if self.kube is None:
            return 0
        try:
            cm = await self.kube.read_config_map(RECORD_NAME)
        except client.ApiException as ex:
            if ex.status != 404:
                raise
            return 0
        kept, refused = parse(cm.get("data") or {}, time.time() if now is None else now,
                              tenants=self.tenants, key=self.key, scope=self.scope,
                              cap=self.cap)
        for sid, why in refused.items():
            log.warning("paused record: entry %r of %s refused: %s", sid[:100], self.where(),
                        why)
        self.items.clear()
        self._sizes.clear()
        dropped = [d for sid, p in kept for d in self._put(sid, p)]
        if refused or dropped:
            await self.unrecord([k for k in [*refused, *dropped] if k not in self.items])
        log.info("paused record: %d paused sandboxes read from %s", len(kept), self.where())
        return len(kept)
