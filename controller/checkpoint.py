"""Checkpoints: handed-out sandboxes' state stored in the admin's OCI registry, restored later
into new sandboxes, all or nothing (docs/controller.md "Checkpoints").

Layout, in the repository `<prefix>/<tenant>` (`local` under --auth none):
- per sandbox, one artifact: its manifest (artifactType SANDBOX_ARTIFACT) names a config blob
  (the sandbox's id, tenant, job, image reference and digest, spec, labels, lifetime, created,
  bytes) and one layer, the snapshot tar execd gave (`GET /snapshot`), whose digest is the
  SHA-256 execd's trailer named;
- per set, one index (artifactType SET_ARTIFACT) naming each sandbox manifest by digest, with
  the tenant, created and expires times and, under a books key, an HMAC over all of them;
  tagged `ck-<created>-<nonce>` so the TTL sweep can find it.
The checkpoint's id is `<tenant>.<hex of the index's digest>`: restore reads everything by
digest from it, so a byte changed in the registry is refused before any pod is made.

The state is data: relayed, counted and hashed, never unpacked here. A restore makes its
pods through the normal acquire path, of the image the checkpoint recorded (by digest where
the pod had one), and each pod's execd refuses a snapshot of another image.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import IO, TYPE_CHECKING, Any

import httpx

from controller import auth as A
from controller import metrics, oci
from controller.books import State
from controller.errors import (
    AcquireError,
    BadRequest,
    CheckpointFailed,
    CheckpointGone,
    SandboxGone,
)
from controller.execd_client import (
    SNAPSHOT_ARCHIVE_MAX,
    ExecdClient,
    ExecdRefused,
    SnapshotBroken,
)
from controller.fork import APPLY_CONCURRENCY, _left, _Step, one_line, snapshots_on
from controller.pods import SandboxSpec, iso_utc
from sandman import api, contract

if TYPE_CHECKING:
    from controller.books import Entry
    from controller.core import Controller

log = logging.getLogger("controller.checkpoint")

SET_ARTIFACT = "application/vnd.sandman.checkpoint.v1"
SANDBOX_ARTIFACT = "application/vnd.sandman.checkpoint.sandbox.v1"
CONFIG_TYPE = "application/vnd.sandman.checkpoint.sandbox.v1+json"
LAYER_TYPE = "application/vnd.sandman.snapshot.v1.tar"
KEY = contract.DOMAIN + "/checkpoint."  # the index's and each entry's annotations
NO_TENANT = "local"  # the repository of an unscoped controller's (--auth none) checkpoints
TAG_PREFIX = "ck-"
INDEX_MAX = 1 << 20  # bytes of a set's index: 256 entries are ~80 KiB
MANIFEST_MAX = 64 << 10
CONFIG_MAX = 64 << 10
# Sandboxes captured (or downloaded) at once: each holds a snapshot on the controller's disk
# and one upload stream.
CAPTURE_CONCURRENCY = 4
REGISTRY_TIMEOUT_S = 120.0  # one registry request (a 16 MiB chunk on a slow link included)


def checkpoint_id(tenant: str, digest: str) -> str:
    return f"{tenant}.{digest.removeprefix('sha256:')}"


def parse_id(cid: str) -> tuple[str, str]:
    """(tenant repository name, index digest); CheckpointGone for anything else."""
    name, dot, hexd = cid.partition(".")
    digest = "sha256:" + hexd
    if not dot or not contract.is_dns_label(name) or not oci._DIGEST.fullmatch(digest):
        raise CheckpointGone(f"no checkpoint {cid[:100]!r} (an id is <tenant>.<64 hex>)")
    return name, digest


def proof(key: bytes, scope: str, tenant: str, digests: list[str], created: str,
          expires: str) -> str:
    """HMAC binding a set to its tenant and times: an index written by anyone but this
    controller's key holder, or moved into another tenant's repository, proves nothing."""
    msg = oci.dumps(["checkpoint", scope, tenant, digests, created, expires])
    return hmac.new(key, msg, "sha256").hexdigest()


@dataclass
class _Kept:
    """One sandbox of a checkpoint as read back and checked: its order's parts and state."""

    old_id: str
    spec: SandboxSpec
    job: str
    labels: dict
    lifetime: float | None
    layer: str
    size: int


class Checkpoints:
    def __init__(self, ctl: Controller):
        self.c = ctl
        s = ctl.s
        self.store: oci.Store | None = None
        if s.checkpoint_registry:
            host, _, prefix = s.checkpoint_registry.partition("/")
            self.store = oci.Store(host, prefix, insecure=s.checkpoint_insecure,
                                   creds=s.checkpoint_credentials, timeout=REGISTRY_TIMEOUT_S)
        self.execd = ExecdClient(s.execd_port, s.health_timeout, trust_env=False)

    async def close(self) -> None:
        await self.execd.aclose()

    def _on(self) -> oci.Store:
        if self.store is None:
            raise BadRequest("checkpoints are off on this controller: the admin names a "
                             "registry for them (--checkpoint-registry, chart "
                             "controller.checkpoints.registry)")
        return self.store

    def _tenant(self, e: Entry) -> str:
        tenant = A.split_job(e.job)[0] if self.c.s.tenants else None
        return tenant or NO_TENANT

    # ---- which sandboxes

    def of_job(self, job_key: str) -> list[Entry]:
        """A job's handed-out agent sandboxes (its grading pods are never checkpointed)."""
        got = [e for e in list(self.c.books.entries.values())
               if e.job == job_key and e.stage is State.LEASED
               and e.spec.role != contract.ROLE_GRADING]
        if not got:
            raise SandboxGone(f"job {A.split_job(job_key)[1][:100]!r} has no handed-out agent "
                              "sandbox to checkpoint")
        if len(got) > api.MAX_CHECKPOINT:
            raise BadRequest(f"job has {len(got)} handed-out sandboxes, more than one checkpoint "
                             f"holds ({api.MAX_CHECKPOINT}): checkpoint it by ids")
        return got

    def leased(self, sid: str) -> Entry:
        e = self.c.books.entries.get(sid)
        if e is None or e.stage is not State.LEASED:
            raise SandboxGone(f"no handed-out sandbox {sid} (released, drained or expired)")
        if e.spec.role == contract.ROLE_GRADING:
            raise BadRequest(f"sandbox {sid} has role {contract.ROLE_GRADING}: grading "
                             "sandboxes are never checkpointed (their state is a grading's)")
        return e

    # ---- capture

    async def checkpoint(self, entries: list[Entry], timeout_s: float) -> api.Checkpointed:
        """Every sandbox's state pushed, then the set's index; CheckpointFailed (nothing kept
        but layer blobs the registry's own GC reclaims) when any step fails."""
        t0 = time.monotonic()
        try:
            store = self._on()
            snapshots_on(self.c.s, "a checkpoint")
            tenants = {self._tenant(e) for e in entries}
            if len(tenants) != 1:
                raise BadRequest("a checkpoint's sandboxes are of one tenant")
            for e in entries:
                if not e.token or not e.ip:
                    raise CheckpointFailed(
                        f"checkpoint of {e.id}: this controller does not hold the sandbox's "
                        "token (it was handed out before the controller restarted)")
        except AcquireError:
            metrics.checkpointed("refused")
            raise
        tenant = tenants.pop()
        repo = store.repo(tenant)
        now = time.time()
        created, expires = iso_utc(now), iso_utc(now + self.c.s.checkpoint_ttl)
        deadline = t0 + timeout_s
        gate = asyncio.Semaphore(CAPTURE_CONCURRENCY)
        budget = [self.c.s.checkpoint_max_bytes]
        pushed: list[str] = []  # manifests and config blobs, deleted if the set fails
        tasks = [asyncio.ensure_future(self._capture(e, store, repo, tenant, created, gate,
                                                     budget, pushed, deadline))
                 for e in entries]
        ok = False
        try:
            results = await _all(tasks, "checkpoint")
            digests = [r[1] for r in results]
            annotations = {KEY + "tenant": tenant, KEY + "created": created,
                           KEY + "expires": expires}
            if self.c.s.books_key is not None:
                annotations[KEY + "proof"] = proof(self.c.s.books_key, self.c.s.namespace,
                                                   tenant, digests, created, expires)
            index = {"schemaVersion": 2, "mediaType": oci.INDEX, "artifactType": SET_ARTIFACT,
                     "manifests": [{"mediaType": oci.MANIFEST, "digest": d, "size": n,
                                    "annotations": {KEY + "sandbox": sid}}
                                   for sid, d, n, _ in results],
                     "annotations": annotations}
            tag = f"{TAG_PREFIX}{int(now)}-{secrets.token_hex(6)}"
            digest = await self._reg("the set's index", store.put_manifest, repo,
                                     oci.dumps(index), oci.INDEX, tag)
            ok = True
        except _Step as ex:
            metrics.checkpointed(ex.result)
            raise ex.error from None
        except asyncio.CancelledError:
            metrics.checkpointed("client_closed")
            raise
        finally:
            if not ok:
                for t in tasks:
                    t.cancel()
                undo = self.c._spawn(self._unpush(store, repo, pushed), "checkpoint-undo")
                try:
                    await asyncio.shield(undo)
                except asyncio.CancelledError:
                    pass
        total = sum(r[3] for r in results)
        metrics.checkpointed("ok", len(results), time.monotonic() - t0, total)
        cid = checkpoint_id(tenant, digest)
        log.info("checkpoint %s: %s (%d bytes of state), expires %s", cid,
                 ", ".join(r[0] for r in results), total, expires)
        return api.Checkpointed(cid, [api.CheckpointedSandbox(sid, d, size)
                                      for sid, d, _, size in results], expires)

    async def _capture(self, e: Entry, store: oci.Store, repo: str, tenant: str,
                       created: str, gate: asyncio.Semaphore, budget: list[int],
                       pushed: list[str], deadline: float) -> tuple[str, str, int, int]:
        """(sandbox id, manifest digest, manifest size, state bytes)."""
        async with gate:
            # At most what the set's bound has left: an over-large state stops streaming there.
            cap = min(SNAPSHOT_ARCHIVE_MAX, max(budget[0], 0))
            with tempfile.NamedTemporaryFile(prefix="sandman-checkpoint-") as f:
                try:
                    assert e.ip and e.token  # checked before any capture started
                    size, sha = await self.execd.snapshot(e.ip, e.token, f, cap, _left(deadline))
                except ExecdRefused as ex:
                    raise _Step("snapshot", CheckpointFailed(
                        f"checkpoint of {e.id}: its execd answered {ex.status} to "
                        f"{ex.route.path}: {one_line(ex.text)}")) from None
                except SnapshotBroken as ex:
                    if cap < SNAPSHOT_ARCHIVE_MAX and f"{cap}-byte cap" in str(ex):
                        raise _Step("size", self._over(e.id)) from None
                    raise _Step("snapshot", CheckpointFailed(
                        f"checkpoint of {e.id}: reading its state failed: {one_line(ex)}")) \
                        from None
                except httpx.HTTPError as ex:
                    raise _Step("snapshot", CheckpointFailed(
                        f"checkpoint of {e.id}: reading its state failed: "
                        f"{type(ex).__name__} {one_line(ex)}")) from None
                budget[0] -= size
                if budget[0] < 0:
                    raise _Step("size", self._over(e.id))
                f.flush()
                layer = "sha256:" + sha
                await self._reg(f"{e.id}'s state", store.put_blob, repo, f.name, layer, size)
        config = oci.dumps({
            "sandbox": e.id, "tenant": tenant, "job": e.job, "image": e.spec.image,
            "image_digest": e.spec.image.partition("@")[2] or None,
            "spec": {"cpu": e.spec.cpu, "memory": e.spec.memory, "workspace": e.spec.workspace,
                     "egress": e.spec.egress, "egress_allow": list(e.spec.egress_allow),
                     "role": e.spec.role, "ephemeral_storage": e.spec.ephemeral_storage,
                     "gpu": e.spec.gpu},
            "labels": dict(e.labels), "lifetime_s": e.lifetime, "created": created,
            "bytes": size})
        cfg = await self._reg(f"{e.id}'s config", store.put_bytes, repo, config)
        pushed.append(cfg)
        manifest = oci.dumps({
            "schemaVersion": 2, "mediaType": oci.MANIFEST, "artifactType": SANDBOX_ARTIFACT,
            "config": {"mediaType": CONFIG_TYPE, "digest": cfg, "size": len(config)},
            "layers": [{"mediaType": LAYER_TYPE, "digest": layer, "size": size}],
            "annotations": {KEY + "sandbox": e.id, KEY + "created": created}})
        md = await self._reg(f"{e.id}'s manifest", store.put_manifest, repo, manifest,
                             oci.MANIFEST)
        pushed.append(md)
        return e.id, md, len(manifest), size

    def _over(self, sid: str) -> CheckpointFailed:
        return CheckpointFailed(f"checkpoint of {sid}: the set's state is over the "
                                f"{self.c.s.checkpoint_max_bytes}-byte bound "
                                "(--checkpoint-max-bytes)")

    async def _reg(self, what: str, fn, *args: Any) -> Any:
        try:
            return await asyncio.to_thread(fn, *args)
        except oci.RegistryError as ex:
            raise _Step("registry", CheckpointFailed(
                f"checkpoint registry: {what}: {one_line(ex)}")) from None
        except oci.Tampered as ex:
            raise _Step("tampered", CheckpointFailed(
                f"checkpoint refused: {what} is not what was stored ({one_line(ex)}); no "
                "sandbox was made of it")) from None

    async def _unpush(self, store: oci.Store, repo: str, pushed: list[str]) -> None:
        for d in pushed:
            for kind in ("manifests", "blobs"):
                try:
                    await asyncio.to_thread(store.delete, repo, kind, d)
                except oci.RegistryError as ex:
                    log.warning("checkpoint undo: %s %s of %s: %s", kind, d, repo, ex)

    # ---- restore

    async def restore(self, cid: str, tenant: str | None, timeout_s: float,
                      request_id: str | None) -> dict[str, dict]:
        """Every sandbox of the checkpoint made anew with its state: {old id: acquire
        answer}. Everything is read and checked against its digest before any pod is made;
        on any failure every sandbox already made is released. `request_id` (caller-scoped)
        keys the whole call (controller/requests.py): a retry gets the same sandboxes."""
        return await self.c.requests.once(
            "restore", tenant or "", request_id, cid,
            lambda: self._restore(cid, tenant, timeout_s),
            lambda got: all(self.c.leased(v["id"]) for v in got.values()))

    async def _restore(self, cid: str, tenant: str | None, timeout_s: float) -> dict[str, dict]:
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        spools: list[IO[bytes]] = []
        got: list[dict | None] = []
        kids: list[asyncio.Future] = []
        phases: dict[str, float] = {}  # metrics.RESTORE_PHASES, seconds
        ok = False
        try:
            store = self._on()
            snapshots_on(self.c.s, "a restore")
            name, digest = parse_id(cid)
            if name != (tenant or NO_TENANT):
                raise CheckpointGone(f"no checkpoint {cid} in this tenant")
            repo = store.repo(name)
            kept = await self._read(store, repo, name, cid, digest)
            phases["read"] = time.monotonic() - t0
            gate = asyncio.Semaphore(CAPTURE_CONCURRENCY)
            spools = [tempfile.TemporaryFile(prefix="sandman-restore-") for _ in kept]

            async def fetch(k: _Kept, out: IO[bytes]) -> None:
                async with gate:
                    await self._reg(f"sandbox {k.old_id}'s state", store.blob_to, repo,
                                    k.layer, k.size, out)
            await _all([asyncio.ensure_future(fetch(k, s)) for k, s in zip(kept, spools, strict=True)],
                       "restore")
            phases["fetch"] = time.monotonic() - t0 - phases["read"]
            # Only now, every byte checked, are pods made.
            got = [None] * len(kept)
            apply_gate = asyncio.Semaphore(APPLY_CONCURRENCY)
            loop = asyncio.get_running_loop()
            for i, (k, spool) in enumerate(zip(kept, spools, strict=True)):
                snap = loop.create_future()
                snap.set_result((k.size, k.layer.removeprefix("sha256:")))
                parent = SimpleNamespace(id=k.old_id, spec=k.spec, job=k.job, owner=None,
                                         labels=k.labels, lifetime=k.lifetime, conditions=None)
                kids.append(asyncio.ensure_future(self.c.forker._child(
                    parent, i, len(kept), got, snap, spool, apply_gate, deadline,
                    what="restore")))
            await _all(kids, "restore")
            ok = True
        except _Step as ex:
            metrics.restored(ex.result)
            err = ex.error
            raise (CheckpointFailed(str(err), err.events) if ex.result == "apply" else err) \
                from None
        except AcquireError:
            metrics.restored("refused")
            raise
        except asyncio.CancelledError:
            metrics.restored("client_closed")
            raise
        finally:
            if not ok:
                undo = self.c._spawn(self._unrestore(cid, kids, got, spools), "restore-undo")
                try:
                    await asyncio.shield(undo)
                except asyncio.CancelledError:
                    pass
        for s in spools:
            s.close()
        out = {k.old_id: lease for k, lease in zip(kept, got, strict=True) if lease is not None}
        took = time.monotonic() - t0
        phases["sandboxes"] = took - phases["read"] - phases["fetch"]
        metrics.restored("ok", len(out), took, phases)
        log.info("checkpoint %s restored: %s", cid,
                 ", ".join(f"{a} -> {b['id']}" for a, b in out.items()))
        return out

    async def _unrestore(self, cid: str, kids: list[asyncio.Future], got: list[dict | None],
                         spools: list[IO[bytes]]) -> None:
        for t in kids:
            t.cancel()
        await asyncio.gather(*kids, return_exceptions=True)
        for s in spools:
            s.close()
        released = [ch["id"] for ch in got if ch is not None]
        for sid in released:
            await self.c.release(sid)
        if released:
            log.info("restore of %s failed: released %s", cid, ", ".join(released))

    async def _read(self, store: oci.Store, repo: str, tenant: str, cid: str,
                    digest: str) -> list[_Kept]:
        """The set's index and each sandbox's manifest and config, each checked against its
        digest, its tenant, its expiry and (under a books key) its proof."""
        try:
            raw, _ = await asyncio.to_thread(store.manifest, repo, digest, oci.INDEX,
                                             INDEX_MAX)
        except oci.RegistryError as ex:
            if ex.status == 404:
                raise CheckpointGone(f"no checkpoint {cid} (never made, or past its TTL)") \
                    from None
            raise _Step("registry", CheckpointFailed(
                f"checkpoint registry: {cid}'s index: {one_line(ex)}")) from None
        except oci.Tampered as ex:
            raise _Step("tampered", CheckpointFailed(
                f"restore of {cid} refused: its index is not what was stored "
                f"({one_line(ex)}); no sandbox was made")) from None
        idx = _json(raw, cid, "index")
        ann = idx.get("annotations") or {}
        entries = idx.get("manifests")
        if (idx.get("artifactType") != SET_ARTIFACT or ann.get(KEY + "tenant") != tenant
                or not isinstance(entries, list) or not 0 < len(entries) <= api.MAX_CHECKPOINT):
            raise _refused(cid, "its index is not a checkpoint of this tenant")
        digests = [oci.check_digest((m or {}).get("digest")) for m in entries]
        created, expires = ann.get(KEY + "created"), ann.get(KEY + "expires")
        if not isinstance(expires, str) or expires <= iso_utc(time.time()):
            raise CheckpointGone(f"checkpoint {cid} expired at {str(expires)[:40]}")
        key = self.c.s.books_key
        if key is not None:
            want = proof(key, self.c.s.namespace, tenant, digests, str(created), expires)
            if not hmac.compare_digest(str(ann.get(KEY + "proof", "")), want):
                raise _refused(cid, "its index's proof does not verify under the books key")
        kept = await asyncio.gather(*(self._read_one(store, repo, tenant, cid, m, d)
                                      for m, d in zip(entries, digests, strict=True)))
        if len({k.old_id for k in kept}) != len(kept):
            raise _refused(cid, "it names a sandbox twice")
        total = sum(k.size for k in kept)
        if total > self.c.s.checkpoint_max_bytes:
            raise _Step("size", CheckpointFailed(
                f"restore of {cid}: {total} bytes of state, over this controller's "
                f"{self.c.s.checkpoint_max_bytes}-byte bound"))
        return kept

    async def _read_one(self, store: oci.Store, repo: str, tenant: str, cid: str,
                        entry: dict, digest: str) -> _Kept:
        raw, _ = await self._reg("a sandbox's manifest", store.manifest, repo, digest,
                                 oci.MANIFEST, MANIFEST_MAX)
        m = _json(raw, cid, "manifest")
        layers = m.get("layers")
        cfgd = (m.get("config") or {}).get("digest")
        if (m.get("artifactType") != SANDBOX_ARTIFACT or not isinstance(layers, list)
                or len(layers) != 1 or (layers[0] or {}).get("mediaType") != LAYER_TYPE):
            raise _refused(cid, f"manifest {digest} is not a sandbox's checkpoint")
        layer = oci.check_digest(layers[0].get("digest"))
        size = layers[0].get("size")
        if not isinstance(size, int) or not 0 <= size <= SNAPSHOT_ARCHIVE_MAX:
            raise _refused(cid, f"manifest {digest} names a state of {str(size)[:20]} bytes")
        cfg = _json(await self._reg("a sandbox's config", store.blob, repo,
                                    oci.check_digest(cfgd), CONFIG_MAX), cid, "config")
        old = cfg.get("sandbox")
        job = cfg.get("job")
        if (not isinstance(old, str) or old != (entry.get("annotations") or {}).get(
                KEY + "sandbox") or cfg.get("tenant") != tenant or not isinstance(job, str)
                or (A.split_job(job)[0] or NO_TENANT) != tenant or cfg.get("bytes") != size):
            raise _refused(cid, f"manifest {digest}'s config does not match its index")
        sp = cfg.get("spec") or {}
        try:
            if sp.get("role") != contract.ROLE_AGENT:
                raise ValueError("only agent sandboxes are restored")
            egress: Any = ({"allow": sp["egress_allow"]} if sp.get("egress_allow")
                           else sp.get("egress"))
            size_of = api.Spec(cpu=sp["cpu"], memory=sp["memory"], workspace=sp.get("workspace"),
                               egress=egress, role=sp["role"],
                               ephemeral_storage=sp.get("ephemeral_storage"),
                               gpu=sp.get("gpu", 0))
            image = cfg.get("image")
            if not isinstance(image, str):
                raise ValueError("no image reference")
            api.AcquireRequest(image=image, job=job)  # the image reference's own checks
            if cfg.get("image_digest") != (image.partition("@")[2] or None):
                raise ValueError("its image digest is not its reference's")
            labels = cfg.get("labels") or {}
            lifetime = cfg.get("lifetime_s")
            if not isinstance(labels, dict) or not (lifetime is None
                                                    or isinstance(lifetime, (int, float))):
                raise ValueError("labels or lifetime_s of the wrong type")
        except (KeyError, TypeError, ValueError) as ex:
            raise _refused(cid, f"sandbox {str(old)[:80]}: {one_line(ex, 200)}") from None
        return _Kept(old, SandboxSpec.of(image, size_of), job, dict(labels),
                     None if lifetime is None else float(lifetime), layer, size)

    # ---- the TTL sweep

    async def loop(self) -> None:
        if self.store is None:
            return
        while True:
            await asyncio.sleep(self.c.s.checkpoint_sweep_interval)
            try:
                await self.sweep()
            except Exception as ex:  # noqa: BLE001 - the next sweep tries again
                log.warning("checkpoint sweep: %s", one_line(ex))

    async def sweep(self) -> int:
        """Sets past their TTL deleted: the index (tag and digest), its sandboxes' manifests,
        and the blobs no live set of the repository still names. Returns the sets deleted."""
        store = self._on()
        swept: set[str] = set()
        for repo in await asyncio.to_thread(store.repositories):
            tenant = repo.removeprefix(f"{store.prefix}/") if store.prefix else repo
            swept |= {checkpoint_id(tenant, d) for d in await asyncio.to_thread(
                _sweep_repo, store, repo, iso_utc(time.time()))}
        if swept:
            metrics.CHECKPOINTS_EXPIRED.inc(len(swept))
        # A paused sandbox's record goes with its checkpoint (or its TTL).
        paused = self.c.paused
        await paused.unrecord(paused.expired() + [sid for sid, p in list(paused.items.items())
                                                  if p.checkpoint in swept])
        return len(swept)


def _sweep_repo(store: oci.Store, repo: str, now: str) -> list[str]:
    """One repository's expired sets deleted (blocking; the sweep's thread): their index
    digests."""
    live_blobs: set[str] = set()
    dead: list[tuple[str, str, list[str], set[str]]] = []
    for tag in store.tags(repo):
        if not tag.startswith(TAG_PREFIX):
            continue
        try:
            raw, digest = store.manifest(repo, tag, oci.INDEX, INDEX_MAX)
            idx = oci.json_of(raw)
            expires = str((idx.get("annotations") or {}).get(KEY + "expires", ""))
            kids = [oci.check_digest(m.get("digest")) for m in idx.get("manifests") or []]
            blobs: set[str] = set()
            for d in kids:
                m = oci.json_of(store.manifest(repo, d, oci.MANIFEST, MANIFEST_MAX, d)[0])
                blobs |= {oci.check_digest(x.get("digest"))
                          for x in [m.get("config") or {}, *(m.get("layers") or [])]}
        except (oci.RegistryError, oci.Tampered, ValueError, AttributeError) as ex:
            log.warning("checkpoint sweep: %s:%s unreadable, left: %s", repo, tag, one_line(ex))
            continue
        if expires and expires <= now:
            dead.append((tag, digest, kids, blobs))
        else:
            live_blobs |= blobs
    for tag, digest, kids, blobs in dead:
        store.delete(repo, "manifests", tag)
        store.delete(repo, "manifests", digest)
        for d in kids:
            store.delete(repo, "manifests", d)
        for b in blobs - live_blobs:
            store.delete(repo, "blobs", b)
        log.info("checkpoint sweep: %s@%s expired, deleted", repo, digest)
    return [digest for _, digest, _, _ in dead]


def _json(raw: bytes, cid: str, what: str) -> dict:
    try:
        return oci.json_of(raw)
    except ValueError:
        raise _refused(cid, f"its {what} is not a JSON object") from None


def _refused(cid: str, why: str) -> _Step:
    return _Step("tampered", CheckpointFailed(f"restore of {cid} refused: {why}; no sandbox "
                                              "was made"))


async def _all(tasks: Sequence[asyncio.Future], what: str) -> list:
    """Every task's result, or the first failure (a _Step; anything else worded as internal)
    once the others are cancelled."""
    if not tasks:
        return []
    done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    bad = [t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None]
    if bad:
        for t in tasks:
            t.cancel()
        ex = bad[0].exception()
        if isinstance(ex, _Step):
            raise ex
        if isinstance(ex, AcquireError):
            raise _Step("refused", ex)
        raise _Step("other", CheckpointFailed(f"{what}: internal error: {one_line(ex)}"))
    return [t.result() for t in tasks]

