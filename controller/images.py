"""A job's task images, pinned: a tag reference is resolved to its digest once per job, and
every pod of the job (and the warm-pool key it is taken from) names `repo@sha256:...`.

Why: the grading verdict is an RL run's reward. A tag that moves mid-run (a rebuilt task
image, a security fix) would change the task under a running job; a warm pod made before the
move would still serve the old image, and a grading pod the new one.

`--image-pinning` (docs/controller.md "Image pinning"):
- `resolve` (default): a tag is resolved through the registry the first time a job names it;
  the job keeps that digest until it is drained, whatever the tag does. A tag that cannot be
  resolved (registry unreachable, credentials the controller does not have) is refused
  (ImageUnresolved, 502): a pod by tag would pin nothing.
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
import json
import logging
import re
from collections import OrderedDict
from dataclasses import dataclass

from controller.errors import BadRequest, ImageUnresolved

log = logging.getLogger("controller.images")

RESOLVE, REQUIRE, OFF = "resolve", "require", "off"
MODES = (RESOLVE, REQUIRE, OFF)
SETTING = "--image-pinning (chart sandbox.imagePinning)"
RESOLVE_TIMEOUT_S = 20.0  # one resolution, every request in it (a thread; requests' timeout)
MAX_PINS = 100_000  # (job, reference) pairs remembered; the oldest are forgotten first
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
    import oras.provider

    api_host = DOCKER_HUB_API if ref.host == DOCKER_HUB else ref.host
    reg = oras.provider.Registry(hostname=api_host, insecure=insecure)
    if creds is not None:
        reg.auth.set_basic_auth(*creds)
    plain = reg.session.request

    def bounded(*a, **kw):  # oras sends no timeout: a registry that never answers would hang
        kw.setdefault("timeout", timeout)
        return plain(*a, **kw)

    reg.session.request = bounded  # type: ignore[method-assign]
    url = f"{reg.prefix}://{api_host}/v2/{ref.repository}/manifests/{ref.tag}"
    # Once, not oras' own five tries with sleeps: the acquire's caller is waiting.
    once = getattr(type(reg).do_request, "__wrapped__", type(reg).do_request)
    try:
        r = once(reg, url, "GET", headers={"Accept": ", ".join(MANIFEST_TYPES)})
    except Exception as e:  # noqa: BLE001 - transport, auth: all mean "not resolved"
        raise ImageUnresolved(f"{type(e).__name__}: {' '.join(str(e).split())[:200]}") from None
    if r.status_code != 200:
        raise ImageUnresolved(f"the registry answered {r.status_code} for the manifest")
    got = "sha256:" + hashlib.sha256(r.content).hexdigest()
    said = r.headers.get("Docker-Content-Digest")
    if said and said != got:
        raise ImageUnresolved(f"the registry said {said} but its manifest hashes to {got}")
    return got


class Pins:
    """Each job's pinned references: (job, reference as asked) -> `name@sha256:...`, resolved
    once (concurrent first acquires share the one resolution) and kept until the job is
    drained. Leader memory: a new leader resolves again (docs/controller.md "Image pinning")."""

    def __init__(self, mode: str = RESOLVE, insecure: tuple[str, ...] = (),
                 credentials=None, timeout: float = RESOLVE_TIMEOUT_S) -> None:
        if mode not in MODES:
            raise ValueError(f"image pinning must be one of {', '.join(MODES)}")
        self.mode = mode
        self.insecure = frozenset(insecure)
        # async () -> list of dockerconfigjson documents (the template's pull secrets)
        self.credentials = credentials
        self.timeout = timeout
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
                got = ref.at(await self._resolve(ref))
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
