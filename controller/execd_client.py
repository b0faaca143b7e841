"""The controller's one client of execd, built on execd's wire (sandman/execd_api.py): readiness
before a hand-out (pipeline), the declared conditions (conditions), a reused grading pod's
token rotation and restore (warmpool), and a fork's copy of a sandbox's state (fork). No other
controller module spells an execd route or body (tests/client/test_execd_api.py holds it).

Each caller keeps its own client with its own timeout, as it kept its own httpx client: a
readiness poll, a conditions read and a restore wait for very different times."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from typing import IO, Any

import httpx

from controller import tracing
from sandman import execd_api as X
from sandman.api import Route

APPLY_CHUNK = 1 << 20  # bytes of a spooled snapshot read per send
# The most a fork spools: execd's own bound on a snapshot archive (content, manifest and every
# member's headers), so a snapshot execd sends at its caps is never refused here.
SNAPSHOT_ARCHIVE_MAX = X.SNAPSHOT_ARCHIVE_MAX


class SnapshotBroken(RuntimeError):
    """A snapshot that cannot be trusted: over its cap, cut short, or not the bytes its
    SHA-256 trailer names."""


class ExecdRefused(RuntimeError):
    """execd answered, but not 200: `status` and the start of the answer's `text`."""

    def __init__(self, route: Route, status: int, text: str):
        super().__init__(f"execd {route.path} answered {status}")
        self.route, self.status, self.text = route, status, text


class ExecdClient:
    """execd at `port` on any pod's address, over one connection pool. `trust_env`: httpx's
    (proxy variables, netrc); the restore's client never trusted them."""

    def __init__(self, port: int, timeout: float, *, trust_env: bool = True):
        self.port = port
        self.timeout = timeout
        self._http = httpx.AsyncClient(timeout=timeout, trust_env=trust_env)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> ExecdClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    def url(self, ip: str, route: Route) -> str:
        host = f"[{ip}]" if ":" in ip else ip
        return f"http://{host}:{self.port}{route.path}"

    async def _call(self, ip: str, route: Route, *, token: str | None = None,
                    body: Any = None, params: dict[str, str] | None = None,
                    timeout: Any = httpx.USE_CLIENT_DEFAULT) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        with tracing.child(f"execd {route.kind}", {"server.address": ip,
                                                   "url.template": route.path}, "client") as s:
            r = await self._http.request(
                route.method, self.url(ip, route),
                json=None if body is None else body.to_json(), params=params,
                headers=tracing.inject(headers), timeout=timeout)
            tracing.set_attributes(s, {"http.response.status_code": r.status_code})
            tracing.record_execd(s, r.headers)
            return r

    async def _ok(self, ip: str, route: Route, **kw: Any) -> Any:
        """The JSON of a 200 answer; ExecdRefused for any other status."""
        r = await self._call(ip, route, **kw)
        if r.status_code != 200:
            raise ExecdRefused(route, r.status_code, r.text[:200])
        return r.json()

    # ---- the calls

    async def ready(self, ip: str, token: str | None = None,
                    connect: float | None = None) -> bool:
        """`/ready` answered ok (it forks a process and writes a file in the pod within 2 s);
        False for anything else, a failure to connect included. With `token`, execd checks it
        (401 otherwise): the answer is the pod's own execd's, not another's at a reused IP.
        `connect`: a shorter connect timeout than the client's."""
        timeout = (httpx.Timeout(self.timeout, connect=connect) if connect is not None
                   else httpx.USE_CLIENT_DEFAULT)
        try:
            r = await self._call(ip, X.READY, token=token, timeout=timeout)
            return r.status_code == 200 and X.Health.from_json(r.json()).ok
        except Exception:  # noqa: BLE001 - not answering yet
            return False

    async def set_env(self, ip: str, token: str, body: X.EnvRequest) -> None:
        await self._ok(ip, X.ENV, token=token, body=body)

    async def conditions(self, ip: str, token: str,
                         egress_probe: str | None = None) -> dict[str, Any]:
        """The answer as execd wrote it (controller/conditions.py reads each field leniently:
        an unreadable one is unverified, never a failed read)."""
        params = {X.EGRESS_PROBE_PARAM: egress_probe} if egress_probe else None
        data = await self._ok(ip, X.CONDITIONS, token=token, params=params)
        if not isinstance(data, dict):
            raise RuntimeError(f"execd {X.CONDITIONS.path} answered no object")
        return data

    async def activity(self, ip: str, token: str) -> X.Activity:
        """When the holder last used the sandbox (this read is not use)."""
        return X.Activity.from_json(await self._ok(ip, X.ACTIVITY, token=token))

    async def rotate_token(self, ip: str, token: str, token_sha256: str) -> None:
        """The next holder's token (its SHA-256), authorized with the current `token`."""
        await self._ok(ip, X.TOKEN, token=token, body=X.TokenRequest(token_sha256=token_sha256))

    async def restore(self, ip: str, token: str) -> X.Restored:
        return X.Restored.from_json(await self._ok(ip, X.RESTORE, token=token, body=X.Empty()))

    async def diff(self, ip: str, token: str) -> X.Diff:
        return X.Diff.from_json(await self._ok(ip, X.DIFF, token=token))

    # ---- a sandbox's state (controller/fork.py): a tar, never parsed here

    async def snapshot(self, ip: str, token: str, out: IO[bytes], cap: int,
                       timeout: float) -> tuple[int, str]:
        """The sandbox's state (`/snapshot`) written to `out` as it arrives: (size, SHA-256
        hex). The answer's last TREE_DIGEST_LEN bytes are execd's SHA-256 of the rest: checked
        here, and SnapshotBroken when it differs, the stream ends short or passes `cap`. The
        bytes are opaque: no member name is read."""
        sha = hashlib.sha256()
        tail, size = b"", 0
        keep = X.TREE_DIGEST_LEN
        headers = tracing.inject({"Authorization": f"Bearer {token}"})
        async with self._http.stream(X.SNAPSHOT.method, self.url(ip, X.SNAPSHOT),
                                     headers=headers, timeout=timeout) as r:
            if r.status_code != 200:
                await r.aread()
                raise ExecdRefused(X.SNAPSHOT, r.status_code, r.text[:200])
            async for chunk in r.aiter_bytes():
                buf = tail + chunk
                if len(buf) <= keep:
                    tail = buf
                    continue
                data, tail = buf[:-keep], buf[-keep:]
                size += len(data)
                if size > cap:
                    raise SnapshotBroken(f"the snapshot is over the {cap}-byte cap")
                sha.update(data)
                out.write(data)
        if len(tail) != keep or tail.decode("latin-1").lower() != sha.hexdigest():
            raise SnapshotBroken(f"the snapshot's SHA-256 is {sha.hexdigest()}, execd's "
                                 f"trailer says {tail[:keep].decode('latin-1')!r}")
        return size, sha.hexdigest()

    async def apply_snapshot(self, ip: str, token: str, spool: IO[bytes], size: int,
                             sha256: str, timeout: float) -> X.SnapshotApplied:
        """`spool`'s first `size` bytes to `/snapshot/apply` with their SHA-256. Several
        applies may read one spool at once: each seeks to its own offset before every read,
        and nothing awaits between the seek and the read."""
        async def body() -> AsyncIterator[bytes]:
            pos = 0
            while pos < size:
                spool.seek(pos)
                chunk = spool.read(min(size - pos, APPLY_CHUNK))
                if not chunk:
                    raise SnapshotBroken("the spooled snapshot shrank while it was sent")
                pos += len(chunk)
                yield chunk

        headers = tracing.inject({"Authorization": f"Bearer {token}",
                                  X.TREE_SHA256_HEADER: sha256, "Content-Length": str(size)})
        r = await self._http.request(X.SNAPSHOT_APPLY.method, self.url(ip, X.SNAPSHOT_APPLY),
                                     content=body(), headers=headers, timeout=timeout)
        if r.status_code != 200:
            raise ExecdRefused(X.SNAPSHOT_APPLY, r.status_code, r.text[:200])
        return X.SnapshotApplied.from_json(r.json())
