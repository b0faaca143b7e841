"""The checkpoint store's registry calls (controller/checkpoint.py): blobs and manifests of one
OCI registry, by digest, over the ORAS project's client (oras: the distribution API, bearer
token and basic auth). Blocking: each call runs in a thread.

Every read is checked here against the digest it was asked by, and bounded: a registry (or
whoever wrote into it) can make a read fail, never make it return other bytes."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
from collections.abc import Callable
from typing import IO, Any

import requests

log = logging.getLogger(__name__)

INDEX = "application/vnd.oci.image.index.v1+json"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"
CHUNK = 16 << 20  # bytes per upload PATCH: ECR takes parts of 5 MiB or more but the last
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


class RegistryError(RuntimeError):
    """The registry refused, failed or did not answer: `status` 0 when it never answered."""

    def __init__(self, what: str, status: int = 0):
        super().__init__(what)
        self.status = status


class Tampered(RuntimeError):
    """The registry answered bytes that are not the ones the digest names, or too many."""


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def check_digest(d: Any) -> str:
    if not isinstance(d, str) or not _DIGEST.fullmatch(d):
        raise Tampered(f"{str(d)[:80]!r} is not sha256:<64 lowercase hex>")
    return d


def client(host: str, insecure: bool, creds: tuple[str, str] | None, timeout: float) -> Any:
    """An oras client of `host` whose every request has `timeout` and is sent once: oras
    sends no timeout (a registry that never answers would hang), and its own retries sleep
    3 to 83 s each while a caller waits. Blocking: use it in a thread."""
    import oras.provider

    reg = oras.provider.Registry(hostname=host, insecure=insecure)
    if creds is not None:
        reg.auth.set_basic_auth(*creds)
    plain = reg.session.request

    def bounded(*a: Any, **kw: Any) -> Any:
        kw.setdefault("timeout", timeout)
        return plain(*a, **kw)

    reg.session.request = bounded
    once = getattr(type(reg).do_request, "__wrapped__", type(reg).do_request)
    reg.do_request = lambda *a, **kw: once(reg, *a, **kw)
    return reg


Creds = tuple[str, str]


class AuthFile:
    """(user, password) for one registry host from a mounted dockerconfigjson, read again when
    the file changes: an ECR password is a 12-hour token, refreshed into the Secret by a
    CronJob, and the kubelet swaps a Secret volume's files in place (a `..data` link moved to a
    new directory). A read that fails after a good one keeps the last credentials (logged once
    per change); the first read's failure is the caller's, at start."""

    def __init__(self, path: str, host: str):
        self.path, self.host = path, host
        self._key: tuple[int, int, int] | None = None
        self._creds: Creds | None = None
        self._broken: tuple[int, int, int] | None = None
        self._lock = threading.Lock()
        got = self()
        if got is None:
            raise ValueError(f"{path}: no credentials for {host}")

    def _stat(self) -> tuple[int, int, int]:
        st = os.stat(self.path)  # follows the Secret volume's links, as a read does
        return st.st_ino, st.st_mtime_ns, st.st_size

    def __call__(self) -> Creds | None:
        from controller.images import _auth_for

        with self._lock:
            try:
                key = self._stat()
                if key == self._key or key == self._broken:
                    return self._creds
                with open(self.path, encoding="utf-8") as f:
                    creds = _auth_for(self.host, [json.load(f)])
                if creds is None:
                    raise ValueError(f"no credentials for {self.host}")
            except (OSError, ValueError) as e:  # JSONDecodeError is a ValueError
                if self._creds is None:
                    raise ValueError(f"{self.path}: {e}") from None
                if self._broken is None:
                    log.warning("checkpoint registry credentials %s unreadable (%s): "
                                "keeping the last ones read", self.path, e)
                try:
                    self._broken = self._stat()
                except OSError:
                    self._broken = None
                return self._creds
            if self._creds is not None and creds != self._creds:
                log.info("checkpoint registry credentials %s changed: using the new ones",
                         self.path)
            self._key, self._creds, self._broken = key, creds, None
            return creds


class Store:
    """One registry `host`; repositories are `prefix/<name>`. `creds`: (user, password), a
    source of them read at each call (AuthFile), or None (anonymous, or the registry's bearer
    token flow)."""

    def __init__(self, host: str, prefix: str, *, insecure: bool = False,
                 creds: Creds | Callable[[], Creds | None] | None = None,
                 timeout: float = 60.0):
        self.host, self.prefix = host, prefix.strip("/")
        self.insecure, self.creds, self.timeout = insecure, creds, timeout

    def repo(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _client(self) -> Any:
        """A fresh client per call (a requests Session is not shared across threads)."""
        creds = self.creds() if callable(self.creds) else self.creds
        return client(self.host, self.insecure, creds, self.timeout)

    def _url(self, repo: str, kind: str, ref: str) -> str:
        return f"{'http' if self.insecure else 'https'}://{self.host}/v2/{repo}/{kind}/{ref}"

    def _do(self, reg: Any, method: str, url: str, ok: tuple[int, ...], what: str,
            **kw: Any) -> requests.Response:
        try:
            r = reg.do_request(url, method, **kw)
        except Exception as e:  # noqa: BLE001 - transport, auth: the registry did not serve it
            raise RegistryError(f"{what}: {type(e).__name__}: {' '.join(str(e).split())[:200]}") \
                from None
        if r.status_code not in ok:
            raise RegistryError(f"{what}: the registry answered {r.status_code} "
                                f"{' '.join(r.text.split())[:200]}", r.status_code)
        return r

    # ---- writes

    def put_blob(self, repo: str, path: str, digest: str, size: int) -> None:
        """The file at `path` as blob `digest` (skipped when the repository has it)."""
        reg = self._client()
        layer = {"digest": digest, "size": size}
        container = reg.get_container(repo)
        try:
            r = reg.upload_blob(path, container, layer, do_chunked=True, chunk_size=CHUNK)
        except Exception as e:  # noqa: BLE001
            raise RegistryError(f"blob {digest} to {repo}: {type(e).__name__}: "
                                f"{' '.join(str(e).split())[:200]}") from None
        if r.status_code not in (200, 201, 202):
            raise RegistryError(f"blob {digest} to {repo}: the registry answered "
                                f"{r.status_code}", r.status_code)

    def put_manifest(self, repo: str, body: bytes, media_type: str,
                     tag: str | None = None) -> str:
        """`body` as a manifest, by its digest (and `tag`); returns the digest."""
        digest = sha256(body)
        self._do(self._client(), "PUT", self._url(repo, "manifests", tag or digest),
                 (200, 201, 202), f"manifest {digest} to {repo}", data=body,
                 headers={"Content-Type": media_type})
        return digest

    def put_bytes(self, repo: str, data: bytes) -> str:
        """A small blob in one upload (POST, then PUT with its digest); returns the digest."""
        digest = sha256(data)
        reg = self._client()
        what = f"blob {digest} to {repo}"
        r = self._do(reg, "POST", f"{'http' if self.insecure else 'https'}://{self.host}"
                     f"/v2/{repo}/blobs/uploads/", (202,), what)
        where = reg._get_location(r, reg.get_container(repo))
        if not where:
            raise RegistryError(f"{what}: the registry gave no upload location")
        sep = "&" if "?" in where else "?"
        self._do(reg, "PUT", f"{where}{sep}digest={digest}", (201, 202, 204), what, data=data,
                 headers={"Content-Type": "application/octet-stream",
                          "Content-Length": str(len(data))})
        return digest

    # ---- reads, each checked against its digest

    def manifest(self, repo: str, ref: str, media_type: str, cap: int,
                 digest: str | None = None) -> tuple[bytes, str]:
        """A manifest's bytes and digest. By digest (`ref` a digest, or `digest` given): the
        bytes must hash to it."""
        r = self._do(self._client(), "GET", self._url(repo, "manifests", ref), (200,),
                     f"manifest {ref} of {repo}", headers={"Accept": media_type}, stream=True)
        body = _bounded(r, cap, f"manifest {ref} of {repo}")
        got = sha256(body)
        want = digest or (ref if ref.startswith("sha256:") else None)
        if want is not None and got != want:
            raise Tampered(f"manifest {want} of {repo} hashes to {got}")
        return body, got

    def blob(self, repo: str, digest: str, cap: int) -> bytes:
        r = self._do(self._client(), "GET", self._url(repo, "blobs", digest), (200,),
                     f"blob {digest} of {repo}", stream=True)
        body = _bounded(r, cap, f"blob {digest} of {repo}")
        if sha256(body) != digest:
            raise Tampered(f"blob {digest} of {repo} hashes to {sha256(body)}")
        return body

    def blob_to(self, repo: str, digest: str, size: int, out: IO[bytes]) -> None:
        """Blob `digest` of `size` bytes written to `out`; Tampered when it is longer, shorter
        or other bytes (`out` then holds bytes nobody may use)."""
        what = f"blob {digest} of {repo}"
        r = self._do(self._client(), "GET", self._url(repo, "blobs", digest), (200,), what,
                     stream=True)
        h, n = hashlib.sha256(), 0
        with r:
            for chunk in r.iter_content(1 << 20):
                n += len(chunk)
                if n > size:
                    raise Tampered(f"{what} is longer than its recorded {size} bytes")
                h.update(chunk)
                out.write(chunk)
        if n != size or "sha256:" + h.hexdigest() != digest:
            raise Tampered(f"{what}: {n} bytes hashing to sha256:{h.hexdigest()}, not the "
                           f"recorded {size} bytes of {digest}")

    # ---- listing and deleting (the TTL sweep)

    def repositories(self) -> list[str]:
        """The repositories under the prefix (the registry's catalog)."""
        r = self._do(self._client(), "GET",
                     f"{'http' if self.insecure else 'https'}://{self.host}/v2/_catalog?n=10000",
                     (200,), "the catalog")
        names = (r.json() or {}).get("repositories") or []
        head = self.prefix + "/" if self.prefix else ""
        return [n for n in names if isinstance(n, str) and n.startswith(head)]

    def tags(self, repo: str) -> list[str]:
        r = self._do(self._client(), "GET",
                     f"{'http' if self.insecure else 'https'}://{self.host}/v2/{repo}/tags/list",
                     (200, 404), f"tags of {repo}")
        return [] if r.status_code == 404 else list((r.json() or {}).get("tags") or [])

    def delete(self, repo: str, kind: str, ref: str) -> bool:
        """DELETE a manifest (by tag or digest) or a blob: True when the registry removed it
        or never had it; False when it does not delete (405, 'unsupported')."""
        r = self._do(self._client(), "DELETE", self._url(repo, kind, ref),
                     (200, 202, 404, 405, 400), f"delete {kind} {ref} of {repo}")
        return r.status_code in (200, 202, 404)


def _bounded(r: requests.Response, cap: int, what: str) -> bytes:
    out = bytearray()
    with r:
        for chunk in r.iter_content(1 << 16):
            out += chunk
            if len(out) > cap:
                raise Tampered(f"{what} is over {cap} bytes")
    return bytes(out)


def json_of(raw: bytes) -> dict:
    """A manifest's or config's JSON object; ValueError for anything else."""
    doc = json.loads(raw)
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    return doc


def dumps(doc: Any) -> bytes:
    """The one serialization of what is pushed (its digest is of these bytes)."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
