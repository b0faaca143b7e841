"""A job's task images, pinned: a tag reference is resolved to its digest once per job, and
every pod of the job (and the warm-pool key it is taken from) names `repo@sha256:...`.

Why: the grading verdict is an RL run's reward. A tag that moves mid-run (a rebuilt task
image, a security fix) would change the task under a running job; a warm pod made before the
move would still serve the old image, and a grading pod the new one.

`--image-pinning` (docs/controller.md "Image pinning"):
- `resolve` (default): a tag is resolved through the registry the first time a job names it;
  the job keeps that digest until it is drained, whatever the tag does, across a leader change
  or a restart: the pin is recorded in the job's ConfigMap before any pod is made of it and
  read back before anything is resolved for the job. A record that does not verify is refused
  (ImageUnresolved), never resolved anew. A tag that cannot be resolved (registry
  unreachable, credentials the controller does not have) is refused (ImageUnresolved, 502):
  a pod by tag would pin nothing.
- `require`: a tag is refused (BadRequest, 400), only digests are taken.
- `off`: references as given (beds whose images no registry serves); the job is not pinned.

The registry is asked with oras (the ORAS project's client: the distribution API, bearer
token auth). Credentials: the `kubernetes.io/dockerconfigjson` Secrets the pod template
names in `imagePullSecrets`, when the controller may read them; a node's own credentials
(credential providers, the node's config.json) are not the controller's to have: such a
registry answers 401 and the tag is refused.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from controller.errors import BadRequest, ImageUnresolved

log = logging.getLogger("controller.images")

RESOLVE, REQUIRE, OFF = "resolve", "require", "off"
MODES = (RESOLVE, REQUIRE, OFF)
SETTING = "--image-pinning (chart sandbox.imagePinning)"
RESOLVE_TIMEOUT_S = 20.0  # one resolution, every request in it (a thread; requests' timeout)
MAX_PINS = 100_000  # (job, reference) pairs remembered; the oldest are forgotten first
# A job's recorded pins, in bytes of keys and values: the API server stores at most 1 MiB per
# object; half of it leaves room for the metadata and for two first pins of one job written
# at once. One pin is ~400 bytes with a books key (~1,300 references per job).
MAX_RECORDED_BYTES = 512 * 1024
PIN_KEY_PREFIX = "pin."  # the record's keys; other keys of the object are not pins
DOCKER_HUB = "docker.io"
DOCKER_HUB_API = "registry-1.docker.io"
MANIFEST_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


@dataclass(frozen=True)
class Ref:
    """An image reference as the kubelet reads it: `name` as written (the pinned reference
    keeps it), the registry host, the repository path, a tag and/or a digest."""

    name: str
    host: str
    repository: str
    tag: str | None
    digest: str | None

    @property
    def pinned(self) -> bool:
        return self.digest is not None

    def at(self, digest: str) -> str:
        return f"{self.name}@{digest}"


def parse(ref: str) -> Ref:
    """Docker's normalization: no host -> docker.io (library/ for one path part); no tag and
    no digest -> latest."""
    name, _, digest = ref.partition("@")
    if digest and not _DIGEST.fullmatch(digest):
        raise BadRequest(f"image {ref[:200]!r}: digest must be sha256:<64 lowercase hex>")
    tag = None
    slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > slash:
        name, tag = name[:colon], name[colon + 1:]
    if not name or (tag is not None and not re.fullmatch(r"[\w][\w.-]{0,127}", tag)):
        raise BadRequest(f"image {ref[:200]!r} is not an image reference")
    first, _, rest = name.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        host, repo = first, rest
    else:
        host, repo = DOCKER_HUB, name
    if host == DOCKER_HUB and "/" not in repo:
        repo = "library/" + repo
    if not digest and tag is None:
        tag = "latest"
    return Ref(name, host, repo, tag, digest or None)


def digest_of(image: str) -> str | None:
    """`sha256:...` of a reference pinned by digest, else None."""
    _, _, d = image.partition("@")
    return d if _DIGEST.fullmatch(d) else None


def _auth_for(host: str, dockerconfigs: list[dict]) -> tuple[str, str] | None:
    """(user, password) for `host` from dockerconfigjson documents, as the kubelet matches
    them (the host, with or without a scheme and a path)."""
    want = {host, DOCKER_HUB_API} if host == DOCKER_HUB else {host}
    if host == DOCKER_HUB:
        want |= {"index.docker.io", "https://index.docker.io/v1/"}
    for doc in dockerconfigs:
        for key, entry in ((doc or {}).get("auths") or {}).items():
            k = re.sub(r"^https?://", "", key).split("/")[0]
            if key not in want and k not in want or not isinstance(entry, dict):
                continue
            if entry.get("username") and entry.get("password"):
                return entry["username"], entry["password"]
            if entry.get("auth"):
                user, _, pw = base64.b64decode(entry["auth"]).decode().partition(":")
                return user, pw
    return None


def fetch_digest(ref: Ref, insecure: bool, creds: tuple[str, str] | None,
                 timeout: float = RESOLVE_TIMEOUT_S) -> str:
    """The digest of `ref`'s manifest (an index for a multi-platform image: what the kubelet
    resolves the tag to), asked of its registry. Blocking: run it in a thread."""
    from controller import oci

    api_host = DOCKER_HUB_API if ref.host == DOCKER_HUB else ref.host
    # Every request bounded and sent once: the acquire's caller is waiting.
    reg = oci.client(api_host, insecure, creds, timeout)
    url = f"{reg.prefix}://{api_host}/v2/{ref.repository}/manifests/{ref.tag}"
    try:
        r = reg.do_request(url, "GET", headers={"Accept": ", ".join(MANIFEST_TYPES)})
    except Exception as e:  # noqa: BLE001 - transport, auth: all mean "not resolved"
        raise ImageUnresolved(f"{type(e).__name__}: {' '.join(str(e).split())[:200]}") from None
    if r.status_code != 200:
        raise ImageUnresolved(f"the registry answered {r.status_code} for the manifest")
    got = "sha256:" + hashlib.sha256(r.content).hexdigest()
    said = r.headers.get("Docker-Content-Digest")
    if said and said != got:
        raise ImageUnresolved(f"the registry said {said} but its manifest hashes to {got}")
    return got


class PinRecord(Protocol):
    """Where a job's pins outlive the leader (the job's ConfigMap, controller/create.py)."""

    def where(self, job: str) -> str:
        """The record's name, for errors."""
        ...

    async def read(self, job: str) -> dict[str, str]:
        """The record's entries ({} when there is none); raises when it cannot be read."""
        ...

    async def write(self, job: str, key: str, value: str) -> None:
        """Store one entry; returns once the API server has it."""
        ...


def pin_key(image: str) -> str:
    """A record key for a reference as asked (a ConfigMap key cannot hold `/`, `:` or `@`)."""
    return PIN_KEY_PREFIX + hashlib.sha256(image.encode()).hexdigest()[:40]


def pin_proof(key: bytes, scope: str, job: str, image: str, pinned: str) -> str:
    """HMAC-SHA256 binding a pin to its namespace and job: a copy from another job's record
    proves nothing for this one."""
    msg = json.dumps(["pin", scope, job, image, pinned]).encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


class Pins:
    """Each job's pinned references: (job, reference as asked) -> `name@sha256:...`, resolved
    once (concurrent first acquires share the one resolution) and kept until the job is
    drained. With a `record`, a pin is written there before it is used and read from there
    before a tag is resolved, so a new leader keeps the job's digests (docs/controller.md
    "Image pinning"); memory is only the cache of it."""

    def __init__(self, mode: str = RESOLVE, insecure: tuple[str, ...] = (),
                 credentials=None, timeout: float = RESOLVE_TIMEOUT_S,
                 record: PinRecord | None = None, proof_key: bytes | None = None,
                 scope: str = "") -> None:
        if mode not in MODES:
            raise ValueError(f"image pinning must be one of {', '.join(MODES)}")
        self.mode = mode
        self.insecure = frozenset(insecure)
        # async () -> list of dockerconfigjson documents (the template's pull secrets)
        self.credentials = credentials
        self.timeout = timeout
        self.record = record
        self.proof_key = proof_key  # the books key: a record entry must carry its HMAC
        self.scope = scope  # the sandbox namespace, bound into each proof
        self._pins: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._inflight: dict[tuple[str, str], asyncio.Future] = {}

    def pinned(self, job: str, image: str) -> str | None:
        return self._pins.get((job, image))

    def forget(self, job: str) -> None:
        for k in [k for k in self._pins if k[0] == job]:
            del self._pins[k]

    def _remember(self, key: tuple[str, str], image: str) -> None:
        self._pins[key] = image
        self._pins.move_to_end(key)
        while len(self._pins) > MAX_PINS:
            self._pins.popitem(last=False)

    async def pin(self, job: str | None, image: str) -> str:
        """The reference pods of `job` are made of. `job` None: a prewarm, resolved now (its
        pool is keyed by the digest it got; a job whose tag resolved elsewhere never takes
        from it)."""
        ref = parse(image)
        if ref.pinned or self.mode == OFF:
            return image
        if self.mode == REQUIRE:
            raise BadRequest(f"image {image[:200]!r} is a tag: this controller requires "
                             f"digests ({SETTING} require); write it as repo@sha256:<64 hex>")
        if job is None:
            return ref.at(await self._resolve(ref))
        key = (job, image)
        got = self._pins.get(key)
        if got is not None:
            return got
        fut = self._inflight.get(key)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._inflight[key] = fut
            try:
                got = await self._recorded_or_resolved(job, image, ref)
            except BaseException as e:
                fut.set_exception(e)
                fut.exception()  # read: nobody else may be waiting
                raise
            finally:
                self._inflight.pop(key, None)
            self._remember(key, got)
            fut.set_result(got)
            return got
        return await asyncio.shield(fut)

    async def _recorded_or_resolved(self, job: str, image: str, ref: Ref) -> str:
        """The job's recorded pin, else the tag resolved now and recorded before it is used
        (a crash after the record and before the create leaves a pin nobody used; the other
        order could leave a pod by a digest nobody recorded)."""
        if self.record is None:
            return ref.at(await self._resolve(ref))
        k = pin_key(image)
        try:
            data = await self.record.read(job)
        except Exception as e:  # noqa: BLE001 - unreadable: resolving anew could move the job
            raise ImageUnresolved(self._unrecorded(job, image, "could not be read", e)) \
                from None
        raw = data.get(k)
        if raw is not None:
            return self._verified(job, image, ref, raw)
        got = ref.at(await self._resolve(ref))
        doc = {"image": image, "pinned": got}
        if self.proof_key is not None:
            doc["proof"] = pin_proof(self.proof_key, self.scope, job, image, got)
        value = json.dumps(doc, separators=(",", ":"))
        used = sum(len(a) + len(b) for a, b in data.items() if a.startswith(PIN_KEY_PREFIX))
        if used + len(k) + len(value) > MAX_RECORDED_BYTES:
            raise BadRequest(
                f"job {job[:100]!r} has recorded {used} bytes of image pins in "
                f"{self.record.where(job)}, the most one job may ({MAX_RECORDED_BYTES}): "
                f"{image[:200]!r} is not pinned; name it by digest or drain the job")
        try:
            await self.record.write(job, k, value)
        except Exception as e:  # noqa: BLE001 - unrecorded: no pod may be made of it
            raise ImageUnresolved(self._unrecorded(job, image, "could not be written", e)) \
                from None
        return got

    def _verified(self, job: str, image: str, ref: Ref, raw: str) -> str:
        """A recorded pin, checked; anything else is refused (fail closed: resolving anew is
        what a record that cannot be trusted must never lead to)."""
        def bad(why: str) -> ImageUnresolved:
            log.error("image pinning: job %s, %s: record %s refused: %s", job, image,
                      self.record.where(job) if self.record else "", why)
            return ImageUnresolved(
                f"image {image[:200]!r} of job {job[:100]!r}: its pin recorded in "
                f"{self.record.where(job) if self.record else 'the record'} is not valid "
                f"({why}); refused, not resolved anew: drain the job to pin it again")
        try:
            doc = json.loads(raw)
        except ValueError:
            raise bad("not JSON") from None
        if not isinstance(doc, dict) or doc.get("image") != image:
            raise bad("it is not this reference's")
        pinned = doc.get("pinned")
        if (not isinstance(pinned, str) or pinned.partition("@")[0] != ref.name
                or not _DIGEST.fullmatch(pinned.partition("@")[2])):
            raise bad(f"not {ref.name[:100]}@sha256:<64 lowercase hex>")
        if self.proof_key is not None:
            want = pin_proof(self.proof_key, self.scope, job, image, pinned)
            said = doc.get("proof")
            if not isinstance(said, str) or not hmac.compare_digest(said, want):
                raise bad("its proof does not verify under the books key")
        log.info("image pinning: %s of job %s kept at %s (recorded)", image, job, pinned)
        return pinned

    def _unrecorded(self, job: str, image: str, what: str, e: BaseException) -> str:
        where = self.record.where(job) if self.record else "the record"
        return (f"image {image[:200]!r} of job {job[:100]!r}: the job's pins ({where}) {what} "
                f"({type(e).__name__}: {' '.join(str(e).split())[:200]}); refused, not "
                f"resolved without a record")

    async def _resolve(self, ref: Ref) -> str:
        creds = None
        if self.credentials is not None:
            try:
                creds = _auth_for(ref.host, await self.credentials())
            except Exception as e:  # noqa: BLE001 - unreadable secrets: ask anonymously
                log.warning("image pinning: pull secrets unreadable (%s); asking %s "
                            "without credentials", e, ref.host)
        try:
            digest = await asyncio.wait_for(asyncio.to_thread(
                fetch_digest, ref, ref.host in self.insecure, creds, self.timeout),
                self.timeout + 5)
        except TimeoutError:
            raise ImageUnresolved(self._why(ref, f"no answer within {self.timeout:g}s")) \
                from None
        except ImageUnresolved as e:
            raise ImageUnresolved(self._why(ref, str(e))) from None
        log.info("image pinning: %s:%s resolved to %s", ref.name, ref.tag, digest)
        return digest

    @staticmethod
    def _why(ref: Ref, what: str) -> str:
        return (f"image {ref.name}:{ref.tag}: the tag could not be resolved to a digest "
                f"({what}); a pod by tag would pin nothing: reference it by digest "
                f"(repo@sha256:...), or see {SETTING}")


def dockerconfigs(secrets: list[dict]) -> list[dict]:
    """The dockerconfigjson documents of pull Secrets (as the API server returns them)."""
    out = []
    for s in secrets:
        data = (s or {}).get("data") or {}
        raw = data.get(".dockerconfigjson") or data.get(".dockercfg")
        if not raw:
            continue
        doc = json.loads(base64.b64decode(raw))
        out.append(doc if ".dockerconfigjson" in data else {"auths": doc})
    return out
