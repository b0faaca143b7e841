"""`AsyncSandbox`: one sandbox's execd, over a keep-alive connection pool of its own.

`sandman/client/_async/sandbox.py` is the source of both twins: `tools/gen_sync.py` writes
`sandman/client/_sync/sandbox.py` from it (docs/sdk.md, "Two twins, one source")."""

from __future__ import annotations

import asyncio
import base64
import codecs
import dataclasses
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from typing import IO, TYPE_CHECKING, Any

import httpx

from sandman import execd_api as X
from sandman import tracing
from sandman.api import DEFAULT_ACQUIRE_TIMEOUT_S, Checkpointed, Route
from sandman.client import _core, _tree, editing
from sandman.client._core import OnRequest, RetryPolicy
from sandman.client.editing import EditResult
from sandman.client.errors import (
    BadRequest,
    CommandTimeout,
    ExpectTimeout,
    IntegrityError,
    ProcessTimeout,
    ProtocolError,
    SandboxGone,
    SandboxPaused,
    SandboxUnreachable,
    SandmanError,
    SessionNotFound,
    TreeError,
    Unauthorized,
    WriteConflict,
)
from sandman.client.models import (
    AcquireTimings,
    ConditionReadings,
    ConditionsCheck,
    ExecResult,
    FileContent,
    Health,
    Lease,
    ProcessOutput,
    ProcessStatus,
    ResetResult,
    SandboxInfo,
    SessionOutput,
    SessionStatus,
    State,
    TreeResult,
    WriteResult,
)

if TYPE_CHECKING:
    from .client import AsyncClient

log = logging.getLogger("sandman.client")

# execd's routes (sandman/execd_api.py); `kind` is what `on_request` reports.
HEALTH, EXEC, EXEC_STREAM = X.HEALTH, X.EXEC, X.EXEC_STREAM
FILE_READ, FILE_WRITE, TREE_WRITE, TREE_READ = (X.FILE_READ, X.FILE_WRITE, X.TREE_WRITE,
                                                X.TREE_READ)
ENV, RESET, STATE, CONDITIONS = X.ENV, X.RESET, X.STATE, X.CONDITIONS
PROCESSES, PROCESS_SPAWN, PROCESS_INFO = X.PROCESSES, X.PROCESS_SPAWN, X.PROCESS_INFO
PROCESS_OUTPUT, PROCESS_SIGNAL, PROCESS_WAIT = (X.PROCESS_OUTPUT, X.PROCESS_SIGNAL,
                                                X.PROCESS_WAIT)
SESSIONS, SESSION_OPEN, SESSION_WRITE = X.SESSIONS, X.SESSION_OPEN, X.SESSION_WRITE
SESSION_READ, SESSION_RESIZE = X.SESSION_READ, X.SESSION_RESIZE
SESSION_SIGNAL, SESSION_CLOSE = X.SESSION_SIGNAL, X.SESSION_CLOSE
# One /processes/wait answers within execd's BG_WAIT_MAX; wait() asks again.
PROCESS_WAIT_ROUND_S = X.BG_WAIT_MAX
# One /sessions/read waits at most execd's PTY_READ_WAIT_MAX; read() asks again.
SESSION_READ_ROUND_S = X.PTY_READ_WAIT_MAX
SESSION_WRITE_MAX = X.PTY_WRITE_MAX  # longer data goes in several writes
# An open stopped before its answer (a signal, a cancellation, no answer) is followed by one
# close by its request_id, waiting this long: the caller is on its way out.
SESSION_STOP_CLOSE_S = 5.0


async def _spooled(spool: IO[bytes], size: int) -> AsyncIterator[bytes]:
    """upload_tree's body: the spooled archive from its start."""
    spool.seek(0)
    left = size
    while left > 0:
        chunk = spool.read(min(left, _tree.COPY_CHUNK))
        if not chunk:
            raise TreeError("upload_tree: the spooled archive shrank while it was sent")
        left -= len(chunk)
        yield chunk


class AsyncSandbox:
    """A sandbox: run commands in its one persistent shell, read and write its files.

    Get one from `AsyncClient.acquire()` (leaving `async with sandbox:` releases it) or attach
    to a running execd with `AsyncSandbox.connect(address, port, token)`. The token is sent as
    a bearer header and is never logged or shown by repr(). `on_request`: see AsyncClient."""

    def __init__(self, address: str, port: int, token: str, *, id: str | None = None,
                 pod: str | None = None, job: str | None = None, warm: bool = False,
                 timings: AcquireTimings | None = None, retry: RetryPolicy | None = None,
                 file_timeout_s: float = 120.0,
                 transport: httpx.AsyncBaseTransport | None = None,
                 on_request: OnRequest | None = None,
                 conditions_check: ConditionsCheck | None = None,
                 _client: AsyncClient | None = None) -> None:
        self.id = id
        # The controller's check of the declared conditions at hand-out (None: none declared).
        self.conditions_check = conditions_check
        self.pod = pod
        self.job = job
        self.address = address
        self.port = port
        self.warm = warm
        self.reuses = 0  # times the pod was reused before this hand-out (the acquire says)
        self.timings = timings or AcquireTimings()
        self.url = _core.execd_url(address, port)
        self._token = token  # for lease() only; never in repr() or logs
        self._retry = retry or RetryPolicy()
        self._file_timeout_s = file_timeout_s
        self._client = _client
        self._on_request = on_request
        self._lock = threading.Lock()  # _closed and _released; held for no I/O
        if True:  # ASYNC
            self._release_task: asyncio.Task[bool] | None = None
        if True:  # ASYNC
            self._renew_stop = asyncio.Event()
            self._renewer: asyncio.Task[None] | None = None
        else:
            self._renew_stop = threading.Event()
            self._renewer: threading.Thread | None = None
        self.expires_at: str | None = None  # RFC 3339 UTC; None: no lifetime (or not known)
        self.lifetime_s: float | None = None
        # What the pod runs, by digest (the controller resolved a tag once for the job);
        # None: a controller that does not say.
        self.image: str | None = None
        self.image_digest: str | None = None
        self._closed = False  # no execd call is sent any more
        self._released = False  # the controller confirmed the release (or there is none)
        self.reused: bool | None = None  # after release(reuse=True): back in a warm pool?
        self._gone = False  # the controller said the sandbox no longer exists
        if transport is None:
            transport = httpx.AsyncHTTPTransport(socket_options=_core.SOCKET_OPTIONS,
                                                 limits=_core.limits(),
                                                 verify=_core.tls_context())
        # trust_env=False: a trainer's HTTP(S)_PROXY must never carry the token to a proxy.
        self._http = httpx.AsyncClient(
            base_url=self.url, transport=transport, trust_env=False, follow_redirects=False,
            headers={"Authorization": f"Bearer {token}", "User-Agent": _core.USER_AGENT})

    @classmethod
    def connect(cls, address: str | Lease, port: int | None = None, token: str | None = None,
                **kw: Any) -> AsyncSandbox:
        """A handle on a running execd with no controller behind it: release() only closes
        the connections. `address` may be an acquire's answer (`Lease`: its address, port,
        token, id and pod), so a restarted trainer that kept it finds the sandbox again, with
        its spawned processes (`process(id)`)."""
        if isinstance(address, Lease):
            kw.setdefault("id", address.id or None)
            kw.setdefault("pod", address.pod or None)
            return cls(address.address, address.port, address.token, **kw)
        if port is None or token is None:
            raise SandmanError("connect: give address, port and token, or an acquire's Lease")
        return cls(address, port, token, **kw)

    def lease(self) -> Lease:
        """What `connect()` needs to reach this sandbox again from another process (a trainer
        restarted after a crash): address, port, token, id, pod, lifetime. It holds the
        execd token: keep `lease().to_json()` as a secret; `Lease.from_json()` reads it back.
        Its spawned processes are found again with `process(id)`."""
        return Lease(id=self.id or "", pod=self.pod or "", address=self.address, port=self.port,
                     token=self._token, warm=self.warm, timings=self.timings,
                     expires_at=self.expires_at, lifetime_s=self.lifetime_s,
                     conditions=self.conditions_check, image=self.image,
                     image_digest=self.image_digest)

    def __repr__(self) -> str:
        state = "released" if self._closed else "live"
        return (f"AsyncSandbox(id={self.id!r}, pod={self.pod!r}, address={self.address!r}, "
                f"port={self.port}, {state})")

    # ---- lifecycle

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            await self.release()
            return
        try:
            await self.release()
        except Exception as e:  # never hide the caller's own error behind ours
            log.warning("sandbox %s: release failed while leaving on %s: %s (the client "
                        "retries it when closed)", self.id, exc_type.__name__, e)

    @property
    def released(self) -> bool:
        return self._released

    async def release(self, reuse: bool = False) -> bool:
        """Give the sandbox back. Idempotent; True when this call released it. No execd call
        is sent after the first release(), even if the controller's answer was lost: a
        failed release raises and stays with the client, which retries it at aclose().

        `reuse=True` (grading sandboxes): the controller restores the pod and returns it to
        its warm pool; `self.reused` says whether it did (False: deleted instead).

        With asyncio, the release runs to its end even if the caller is cancelled (shielded):
        cleanup must survive a second cancellation."""
        with self._lock:
            self._closed = True
            if self._released:
                return False
        self._renew_stop.set()
        if True:  # ASYNC
            task = self._release_task
            first = task is None or (task.done() and (task.cancelled()
                                                      or task.exception() is not None))
            if first:
                task = self._release_task = _core.keep(
                    asyncio.ensure_future(self._do_release(reuse)))
            assert task is not None
            released = await asyncio.shield(task)
            return released if first else False
        else:
            return self._do_release(reuse)

    async def retire(self) -> bool:
        """Delete the sandbox because its grading contradicted an earlier one: it is never
        reused. Idempotent like release(); True when this call released it."""
        with self._lock:
            self._closed = True
            if self._released:
                return False
        self._renew_stop.set()
        return await self._do_release(False, retire=True)

    async def report_shadow(self, outcome: str) -> bool:
        """This reused grading pod's verdict was graded again on a never-used pod: `outcome`
        "agree" (released for reuse) or "contradict" (retired, never reused). The controller
        counts it. Ends the holding like release(); True when this call released it."""
        with self._lock:
            self._closed = True
            if self._released:
                return False
        self._renew_stop.set()
        return await self._do_release(False, shadow=outcome)

    async def _do_release(self, reuse: bool = False, retire: bool = False,
                          shadow: str | None = None) -> bool:
        try:
            released = True
            if self._client is not None and self.id is not None:
                if shadow is not None:
                    released, self.reused = await self._client.report_shadow(self.id, shadow)
                elif retire:
                    released = await self._client.retire(self.id)
                else:
                    released, self.reused = await self._client._let_go(self.id, reuse)
        finally:
            await self._http.aclose()
        with self._lock:
            self._released = True
        return released

    async def aclose(self) -> None:
        """Close the connections without releasing (the sandbox stays the caller's, and
        expires after its lifetime: renewing stops here)."""
        self._renew_stop.set()
        await self._http.aclose()

    async def detach(self) -> Lease:
        """Let the sandbox outlive this handle and its client: closes the connections, stops
        renewing, and the client no longer releases it at its close. Returns its `lease()`,
        which holds execd's token (keep it private): `connect(lease)` finds the sandbox
        again. It then ends at its lifetime, or at a release by id (`sandman
        acquire` in the command-line client is built on this)."""
        if self._client is None:
            raise SandmanError("detach: only a sandbox acquired through a client is held by one")
        lease = self.lease()
        with self._lock:
            self._closed = True
        self._client._forget(self.id)
        await self.aclose()
        return lease

    async def fork(self, n: int, *, timeout_s: float = DEFAULT_ACQUIRE_TIMEOUT_S,
                   renew: bool = True) -> list[AsyncSandbox]:
        """`n` new sandboxes of this one's spec, tenant and job, each holding this one's
        state now: its filesystem changes against the image, its shell's cwd and exported
        environment. Running processes and sessions are not carried. The children are
        independent (a write in one is seen in no other, nor here), held by the same client
        and released like acquired sandboxes. All or nothing: on any failure no child is
        left and one error says why (ForkFailed, or the acquire's error such as QueueFull or
        AcquireTimeout); a grading sandbox is never forked (BadRequest)."""
        if self._client is None or self.id is None:
            raise SandmanError("fork: this handle has no controller behind it")
        if self._closed:
            raise SandboxGone(f"sandbox {self.id} was released; fork not sent")
        return await self._client.fork(self.id, n, timeout_s=timeout_s, renew=renew,
                                       job=self.job)

    async def pause(self, *,
                    timeout_s: float = DEFAULT_ACQUIRE_TIMEOUT_S) -> Checkpointed:
        """A checkpoint of this sandbox, then its release: returns the handle
        `client.resume()` makes it anew from (until the handle's `expires_at`). This handle
        is done afterwards. A grading sandbox is never paused (BadRequest); on failure
        (CheckpointFailed) the sandbox is not released."""
        if self._client is None or self.id is None:
            raise SandmanError("pause: this handle has no controller behind it")
        if self._closed:
            raise SandboxGone(f"sandbox {self.id} was released; pause not sent")
        handle = await self._client._pause(self.id, timeout_s)
        with self._lock:
            self._closed = True
            self._released = True
        self._renew_stop.set()
        return handle

    # ---- the lifetime: renewed in the background while the handle is open

    async def renew(self, lifetime_s: float | None = None) -> str | None:
        """Push the sandbox's expiry to now + `lifetime_s` (None: its current lifetime);
        returns the new expires_at. The client does this by itself while the handle is open;
        call it to change the lifetime. SandboxGone once it was released or expired."""
        if self._client is None or self.id is None:
            raise SandmanError("renew: this handle has no controller behind it")
        info = await self._client.renew(self.id, lifetime_s)
        self.expires_at, self.lifetime_s = info.expires_at, info.lifetime_s or self.lifetime_s
        return self.expires_at

    def _start_renewing(self, lifetime_s: float | None, expires_at: str | None) -> None:
        """From the client's acquire: renew every lifetime/3 until release() or aclose()."""
        self.expires_at, self.lifetime_s = expires_at, lifetime_s
        if not lifetime_s or self._client is None or self.id is None:
            return
        if True:  # ASYNC
            self._renewer = _core.keep(asyncio.ensure_future(self._renew_loop()))
        else:
            self._renewer = threading.Thread(target=self._renew_loop, daemon=True,
                                             name=f"sandman-renew-{self.id}")
            self._renewer.start()

    async def _pause(self, seconds: float) -> bool:
        """Wait up to `seconds`; True when renewing was stopped meanwhile."""
        if True:  # ASYNC
            try:
                await asyncio.wait_for(self._renew_stop.wait(), seconds)
            except TimeoutError:
                return False
            return True
        else:
            return self._renew_stop.wait(seconds)

    async def _renew_loop(self) -> None:
        """A renew at each third of the lifetime, so two in a row may fail before it runs
        out. A failed renew is logged and retried sooner, until the lease has run out; it
        never raises into the caller's work (its next execd call says SandboxGone)."""
        lifetime = float(self.lifetime_s or 0)
        deadline = time.monotonic() + lifetime
        wait = lifetime / 3
        while not await self._pause(wait):
            try:
                await self.renew()
            except SandmanError as e:
                if self._renew_stop.is_set():
                    return  # released or closed meanwhile: nothing to say
                left = deadline - time.monotonic()
                if isinstance(e, SandboxGone) or left <= 0:
                    log.error("sandbox %s: renew failed (%s: %s); it is gone or expired, "
                              "renewing stops", self.id, type(e).__name__, e)
                    return
                wait = max(0.5, min(lifetime / 3, left / 4))  # bounded: ~4 tries are left
                log.warning("sandbox %s: renew failed (%s: %s); retrying in %.1fs, %.0fs "
                            "before it expires", self.id, type(e).__name__, e, wait, left)
                continue
            except Exception:  # noqa: BLE001 - a bug here must not end the caller's work
                log.exception("sandbox %s: renew crashed; renewing stops", self.id)
                return
            lifetime = float(self.lifetime_s or lifetime)
            deadline = time.monotonic() + lifetime
            wait = lifetime / 3

    # ---- execd calls

    async def health(self) -> Health:
        resp = await self._call(HEALTH, read_s=10.0)
        return Health.from_json(_core.decode_json(resp, "health"))

    async def exec(self, command: str, timeout: float | None = None, *,
                   max_output: int | None = None, request_id: str | None = None,
                   idle_timeout: float | None = None, fresh: bool = False,
                   cwd: str | None = None) -> ExecResult:
        """Run `command` in the sandbox's shell (bash; cwd, variables and functions persist
        between calls) and wait for it. `timeout` in seconds (execd's default: 300);
        `idle_timeout`: the most seconds it may go without printing. Raises CommandTimeout
        when execd killed it for either.

        `fresh=True`: not in the shell but in a bash execd starts for this command alone,
        with execd's start environment (nothing exported or /env-set since), in `cwd` (an
        absolute path, required); every process it started is killed when it returns. What
        a grader runs, so the holder's shell cannot reach it.

        One request_id covers every retry of this call: execd runs the command at most once
        and answers a retry with the stored result."""
        rid = request_id or _core.new_request_id()
        body = _core.exec_body(command, timeout, max_output, rid, idle_timeout, fresh, cwd)
        resp = await self._call(EXEC, json=body.to_json(),
                                read_s=_core.exec_read_timeout(timeout), request_id=rid)
        result = ExecResult.from_json(_core.decode_json(resp, "exec"), rid)
        if result.timed_out:
            raise CommandTimeout(f"command timed out after {timeout or 'the default'} s "
                                 f"(request {rid}): {result.error}", result)
        return result

    async def stream(self, command: str, timeout: float | None = None, *,
                     idle_timeout: float | None = None, max_output: int | None = None,
                     kill_on_disconnect: bool = False) -> AsyncIterator[str | ExecResult]:
        """Run `command` as exec() does, in the same shell, and yield its output as execd
        reads it (str chunks, UTF-8 decoded whole across reads), then, last, its ExecResult
        (whose `output` keeps `max_output` bytes, head and tail, as exec()'s).

        `timeout` and `idle_timeout` (no output for that many seconds) end the command and
        its processes, and raise CommandTimeout after the last chunk. Leaving the loop early
        hangs up: the command runs on, unless `kill_on_disconnect=True` asked execd to kill
        it then. A stream is never retried once sent (its output would repeat); a cut one
        raises SandboxUnreachable and the command may still be running."""
        body = _core.stream_body(command, timeout, idle_timeout, max_output,
                                 kill_on_disconnect)
        route, path = EXEC_STREAM, EXEC_STREAM.path
        start = time.perf_counter()
        size = 0
        result: ExecResult | None = None
        try:
            if self._closed or self._gone:
                raise SandboxGone(f"sandbox {self.id or self.url} was released or is gone; "
                                  f"{path} not sent")
            attempts = _core.Attempts(self._retry, _core.exec_read_timeout(timeout))
            tmo = _core.timeout(self._retry, _core.exec_read_timeout(timeout))
            while True:
                attempts.start()
                try:
                    async with self._http.stream(route.method, path, json=body.to_json(),
                                                  headers=tracing.inject({}),
                                                  timeout=tmo) as resp:
                        if resp.status_code != 200:
                            await resp.aread()
                            size += len(resp.content)
                            try:
                                _core.raise_for_execd(resp, path)
                            except Unauthorized:
                                await self._check_gone(path)
                                raise
                            raise ProtocolError(f"{path}: HTTP {resp.status_code} is not a "
                                                "stream", status=resp.status_code)
                        async for line in resp.aiter_lines():
                            size += len(line) + 1
                            if not line:
                                continue
                            item = _core.stream_line(line, path)
                            if isinstance(item, str):
                                yield item
                            else:
                                result = item
                    break
                except httpx.ConnectError as e:
                    # Nothing was sent: the one failure a stream may retry.
                    delay = attempts.delay()
                    if delay is None:
                        await self._unreachable(path, e, attempts.n)
                        raise
                    await asyncio.sleep(delay)
                except httpx.TransportError as e:
                    says = _says(await self._check_gone(path))
                    raise SandboxUnreachable(
                        f"sandbox {self.id or self.url}: {path} cut after {size} bytes "
                        f"({type(e).__name__}: {e}); the command may still be running"
                        f"{says}") from e
            if result is None:
                raise ProtocolError(f"{path}: the stream ended without a result")
        except GeneratorExit:
            _core.report(self._on_request, route, start, size, None)  # the caller hung up
            raise
        except BaseException as e:
            _core.report(self._on_request, route, start, size, e)
            raise
        _core.report(self._on_request, route, start, size, None)
        if result.timed_out:
            raise CommandTimeout(f"command timed out after {timeout or 'the default'} s "
                                 f"(stream): {result.error}", result)
        yield result

    async def read_file(self, path: str) -> FileContent:
        """The whole file, byte-exact; its SHA-256 was checked against execd's (fail closed:
        IntegrityError, never unchecked bytes)."""
        resp = await self._call(FILE_READ, params={X.PATH_PARAM: path},
                                read_s=self._file_timeout_s, retry_409=True)
        return _core.check_read(path, resp)

    async def read(self, path: str) -> bytes:
        content = await self.read_file(path)
        return content.data

    async def write(self, path: str, data: bytes | str, *, mode: int | str | None = None,
                    if_sha256: str | None = None) -> WriteResult:
        """Replace the file atomically with `data` (str is written as UTF-8). `if_sha256`:
        only if the file's current content has that SHA-256 (WriteConflict otherwise; pass
        `FileContent.sha256` from a read to make a read-modify-write safe)."""
        raw = _core.to_bytes(data)
        body = _core.write_body(path, raw, mode, if_sha256)
        attempts: list[int] = []
        try:
            resp = await self._call(FILE_WRITE, json=body.to_json(), read_s=self._file_timeout_s,
                                    attempts_out=attempts)
        except WriteConflict as e:
            # A retry after a lost answer finds our own bytes already there: that is success.
            if attempts and attempts[0] > 1 and e.current_sha256 == _core.sha256_hex(raw):
                log.info("sandbox %s: write %s found its own bytes after a retry", self.id,
                         path)
                return WriteResult(path=path, size=len(raw), sha256=e.current_sha256)
            raise
        result = WriteResult.from_json(_core.decode_json(resp, "write"), path)
        return _core.check_write(path, raw, result)

    async def edit(self, path: str, old: str, new: str) -> EditResult:
        """Replace the one occurrence of `old` with `new` in the file, changing no other byte
        (docs/grading.md, "The byte-safe editor"). Reads byte-exact with the SHA-256 check,
        writes with `if_sha256` of that read (EditConflict if the file changed meanwhile) and
        keeps the file's mode. Refuses, with a message telling to use the shell, what it
        cannot write back unchanged: not UTF-8, mixed line endings, a bare CR (EditRefused);
        `old` found 0 times (EditNoMatch) or more than once (EditAmbiguous)."""
        content = await self.read_file(path)
        data, line = editing.plan_edit(content.data, old, new, path)
        if data == content.data:
            return EditResult(path, line, content.sha256, content.sha256, len(data))
        try:
            w = await self.write(path, data, if_sha256=content.sha256)
        except WriteConflict as e:
            raise editing.EditConflict(
                f"edit {path}: the file changed since it was read (now sha256 "
                f"{e.current_sha256}); nothing was written, read it again and redo the edit",
                path=path, current_sha256=e.current_sha256) from e
        return EditResult(path, line, content.sha256, w.sha256, w.size)

    async def env(self, set: dict[str, str] | None = None,
                  unset: list[str] | None = None) -> dict[str, str]:
        """Export `set` and unset `unset` in the shell (and in shells started later); returns
        the shell's whole environment after the change."""
        body = X.EnvRequest(set=dict(set or {}), unset=list(unset or []))
        resp = await self._call(ENV, json=body.to_json(), read_s=60.0)
        data = _core.decode_json(resp, "env")
        env = data.get("env") if isinstance(data, dict) else None
        return dict(env) if isinstance(env, dict) else {}

    async def reset(self, workspace: bool = False) -> ResetResult:
        """Kill every process of the sandbox and start a fresh shell; `workspace=True` also
        empties the workspace directory."""
        resp = await self._call(RESET, json=X.ResetRequest(workspace=bool(workspace)).to_json(),
                                read_s=90.0)
        return ResetResult.from_json(_core.decode_json(resp, "reset"))

    async def state(self) -> State:
        resp = await self._call(STATE, read_s=30.0)
        return State.from_json(_core.decode_json(resp, "state"))

    async def conditions(self, egress_probe: str | None = None) -> ConditionReadings:
        """The run conditions as the sandbox reads them; `egress_probe="host:port"` also tries
        one outbound connection (to check the egress guard)."""
        params = {X.EGRESS_PROBE_PARAM: egress_probe} if egress_probe else None
        resp = await self._call(CONDITIONS, params=params, read_s=30.0)
        return ConditionReadings.from_json(_core.decode_json(resp, "conditions"))

    # ---- background processes

    async def spawn(self, command: str, cwd: str | None = None,
                    env: dict[str, str] | None = None) -> AsyncProcess:
        """Start `command` (bash -c) beside the shell and return at once with its handle. Its
        cwd is `cwd` (relative: to the shell's) or the shell's current one; its environment
        is execd's (with `env()`'s changes) plus `env`. Its output goes to its own pipe,
        never the shell's: execd keeps the newest 1 MiB. Sent with one request_id for all
        retries: a lost answer never starts it twice. TooManyProcesses at 16 live."""
        rid = _core.new_request_id()
        body = _core.spawn_body(command, cwd, env, rid)
        resp = await self._call(PROCESS_SPAWN, json=body.to_json(), read_s=30.0,
                                request_id=rid)
        return AsyncProcess(self, ProcessStatus.from_json(_core.decode_json(resp, "spawn")))

    async def processes(self) -> list[AsyncProcess]:
        """Every process spawned since the last reset, oldest first, running or ended."""
        resp = await self._call(PROCESSES, read_s=30.0)
        data = _core.decode_json(resp, "processes")
        items = data.get("processes") if isinstance(data, dict) else None
        if not isinstance(items, list):
            raise ProtocolError("processes: the answer has no list 'processes'")
        return [AsyncProcess(self, ProcessStatus.from_json(p)) for p in items]

    async def process(self, id: str) -> AsyncProcess:
        """The handle of a spawned process by its id (from `Process.id` or `processes()`),
        from any handle on the same sandbox; ProcessNotFound if it is not this sandbox's or
        a reset ended it."""
        return AsyncProcess(self, await self._process_status(id))

    async def _process_status(self, id: str) -> ProcessStatus:
        resp = await self._call(PROCESS_INFO, params={X.ID_PARAM: _core.process_id(id)},
                                read_s=30.0)
        return ProcessStatus.from_json(_core.decode_json(resp, "process"))

    # ---- interactive sessions

    async def session(self, command: str = "bash", cwd: str | None = None,
                      env: dict[str, str] | None = None, cols: int = 80,
                      rows: int = 24, abandon_after: float | None = None) -> AsyncSession:
        """Start `command` (bash -c) on its own pseudo-terminal of `cols` x `rows`, in its own
        session with that terminal as its controlling one, and return its handle: write to
        it, read or expect its output, resize it, signal it, close it. TERM is "dumb" unless
        `env` names one. cwd and env as for `spawn()`. Sent with one request_id for all
        retries: a lost answer never opens it twice. TooManySessions at 8 open.
        `abandon_after` (seconds): execd closes the session once no call has named it for
        that long (None: it stays until closed or the sandbox is reset). An open stopped
        before its answer (an exception, a signal, a cancellation) closes what it opened."""
        for name, v in (("cols", cols), ("rows", rows)):
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= X.PTY_SIZE_MAX:
                raise BadRequest(f"{name} must be an int in 1..{X.PTY_SIZE_MAX}, not {v!r}")
        if abandon_after is not None and (
                isinstance(abandon_after, bool) or not isinstance(abandon_after, (int, float))
                or not 0 < abandon_after <= X.PTY_ABANDON_MAX):
            raise BadRequest(f"abandon_after must be seconds in (0, {X.PTY_ABANDON_MAX:g}], "
                             f"not {abandon_after!r}")
        rid = _core.new_request_id()
        spawn = _core.spawn_body(command, cwd, env, rid)
        body = X.SessionOpenRequest(command=spawn.command, request_id=rid, cwd=spawn.cwd,
                                    env=spawn.env, cols=cols, rows=rows,
                                    abandon_after=abandon_after)
        try:
            resp = await self._call(SESSION_OPEN, json=body.to_json(), read_s=30.0,
                                    request_id=rid)
            return AsyncSession(self, SessionStatus.from_json(_core.decode_json(resp, "session")))
        except BaseException as e:
            # The session may be open with nobody holding its id: close it by the open's
            # request_id (which also refuses the open, should it reach execd only now). An
            # error status execd answered opened nothing.
            if not (isinstance(e, SandmanError) and (e.status or 0) >= 400):
                await self._close_opening(rid)
            raise

    async def _close_opening(self, rid: str) -> None:
        try:
            await self._call(SESSION_CLOSE, read_s=SESSION_STOP_CLOSE_S,
                             retry=dataclasses.replace(self._retry, attempts=1),
                             json=X.SessionCloseRequest(open_request_id=rid).to_json())
        except Exception as e:  # noqa: BLE001 - the open's own error is the one to report
            log.warning("sandbox %s: the session of an open stopped before its answer was not "
                        "closed (%s); execd ends it with the sandbox, or past abandon_after",
                        self.id, e)

    async def sessions(self) -> list[AsyncSession]:
        """Every session open or ended since the last reset (not closed), oldest first."""
        resp = await self._call(SESSIONS, read_s=30.0)
        data = _core.decode_json(resp, "sessions")
        items = data.get("sessions") if isinstance(data, dict) else None
        if not isinstance(items, list):
            raise ProtocolError("sessions: the answer has no list 'sessions'")
        return [AsyncSession(self, SessionStatus.from_json(p)) for p in items]

    # ---- trees (docs/sdk.md, "Trees")

    async def upload_tree(self, local_dir: str | os.PathLike[str], remote_dir: str) -> TreeResult:
        """Copy the local directory `local_dir` into `remote_dir` in the sandbox (made if
        missing; what it holds stays unless the archive replaces it) as one streamed tar:
        regular files, directories and symlinks, file modes (setuid/setgid stripped), mtimes;
        byte-exact. execd checks every member and the archive's SHA-256 before anything is
        visible: UnsafeArchive (a member that could land outside), TreeConflict, TreeTooLarge
        (over execd's --max-tree-bytes, 1 GiB by default), IntegrityError. The tar is spooled
        to a local temporary file first (memory stays bounded)."""
        route, path = TREE_WRITE, TREE_WRITE.path
        start = time.perf_counter()
        resp: httpx.Response | None = None
        try:
            with tempfile.TemporaryFile() as spool:
                if True:  # ASYNC
                    size, digest = await asyncio.to_thread(_tree.pack, os.fspath(local_dir),
                                                           spool)
                else:
                    size, digest = _tree.pack(os.fspath(local_dir), spool)
                headers = {X.TREE_SHA256_HEADER: digest, "Content-Length": str(size),
                           "Content-Type": "application/x-tar"}
                tracing.inject(headers)
                attempts = _core.Attempts(self._retry, self._file_timeout_s)
                tmo = _core.timeout(self._retry, self._file_timeout_s)
                while True:
                    if self._closed or self._gone:
                        raise SandboxGone(f"sandbox {self.id or self.url} was released or is "
                                          f"gone; {path} not sent")
                    attempts.start()
                    try:
                        # The same archive again is harmless: execd stages it whole each time.
                        resp = await self._http.post(path, params={X.PATH_PARAM: remote_dir},
                                                     content=_spooled(spool, size),
                                                     headers=headers, timeout=tmo)
                        break
                    except _core.RETRYABLE as e:
                        delay = attempts.delay()
                        if delay is None:
                            await self._unreachable(path, e, attempts.n)
                            raise
                        await asyncio.sleep(delay)
            _core.raise_for_execd(resp, path)
            result = TreeResult.from_json(_core.decode_json(resp, "upload_tree"), remote_dir)
            if result.sha256 != digest or result.bytes != size:
                raise IntegrityError(f"upload_tree {remote_dir}: execd extracted {result.bytes} "
                                     f"bytes with SHA-256 {result.sha256}; sent {size} bytes "
                                     f"with SHA-256 {digest}")
        except BaseException as e:
            _core.report(self._on_request, route, start, resp, e)
            raise
        _core.report(self._on_request, route, start, resp, None)
        return result

    async def download_tree(self, remote_dir: str, local_dir: str | os.PathLike[str], *,
                            max_bytes: int = X.TREE_MAX_BYTES) -> TreeResult:
        """Copy the sandbox's directory `remote_dir` into `local_dir` (made if missing; what it
        holds stays unless the archive replaces it) as one streamed tar, as upload_tree does
        the other way. The sandbox is not trusted: the archive is spooled to a local temporary
        file and its SHA-256 checked (IntegrityError), then every member is checked before
        anything is moved into local_dir (UnsafeArchive: a `..` or absolute name, a symlink
        leading out or written through, a hard link to outside, a device, a FIFO, a setuid
        or setgid bit; TreeConflict). `max_bytes` caps the archive (TreeTooLarge)."""
        route, path = TREE_READ, TREE_READ.path
        start = time.perf_counter()
        got = 0
        try:
            with tempfile.TemporaryFile() as spool:
                attempts = _core.Attempts(self._retry, self._file_timeout_s)
                tmo = _core.timeout(self._retry, self._file_timeout_s)
                while True:
                    if self._closed or self._gone:
                        raise SandboxGone(f"sandbox {self.id or self.url} was released or is "
                                          f"gone; {path} not sent")
                    attempts.start()
                    spool.seek(0)
                    spool.truncate()
                    body = _tree.Withheld(spool, max_bytes)
                    try:
                        async with self._http.stream(route.method, path,
                                                     params={X.PATH_PARAM: remote_dir},
                                                     headers=tracing.inject({}),
                                                     timeout=tmo) as resp:
                            if resp.status_code != 200:
                                await resp.aread()
                                _core.raise_for_execd(resp, path)
                            async for chunk in resp.aiter_bytes():
                                got += len(chunk)
                                body.feed(chunk)
                        break
                    except _core.RETRYABLE as e:  # a read sends nothing: try it whole again
                        delay = attempts.delay()
                        if delay is None:
                            await self._unreachable(path, e, attempts.n)
                            raise
                        await asyncio.sleep(delay)
                if not body.digest_ok():
                    raise IntegrityError(f"download_tree {remote_dir}: the archive's SHA-256 "
                                         f"is {body.sha.hexdigest()}, execd's trailer says "
                                         f"{body.tail.decode('latin-1')!r}; nothing was written")
                spool.seek(0)
                if True:  # ASYNC
                    stats = await asyncio.to_thread(_tree.unpack, spool, os.fspath(local_dir))
                else:
                    stats = _tree.unpack(spool, os.fspath(local_dir))
        except BaseException as e:
            _core.report(self._on_request, route, start, got, e)
            raise
        _core.report(self._on_request, route, start, got, None)
        return TreeResult(path=os.fspath(local_dir), bytes=body.size,
                          sha256=body.sha.hexdigest(), **stats)

    # ---- transport

    async def _call(self, route: Route, *, read_s: float, json: Any = None,
                    params: dict[str, str] | None = None, request_id: str | None = None,
                    retry_409: bool = False, attempts_out: list[int] | None = None,
                    retry: RetryPolicy | None = None) -> httpx.Response:
        """One logical call: bounded retries on transport errors (`retry`, the sandbox's
        policy by default), then the typed error; reported once to `on_request`."""
        with _core.call(self._on_request, route, "execd", self.id) as call:
            resp = await self._attempts(route, read_s=read_s, json=json, params=params,
                                        request_id=request_id, retry_409=retry_409,
                                        attempts_out=attempts_out, retry=retry or self._retry)
            call.done(resp)
            return resp

    async def _attempts(self, route: Route, *, read_s: float, json: Any,
                        params: dict[str, str] | None, request_id: str | None,
                        retry_409: bool, attempts_out: list[int] | None,
                        retry: RetryPolicy) -> httpx.Response:
        method, path = route.method, route.path
        if self._closed:
            raise SandboxGone(f"sandbox {self.id or self.url} was released; {path} not sent")
        if self._gone:
            raise SandboxGone(f"sandbox {self.id} no longer exists; {path} not sent")
        attempts = _core.Attempts(retry, read_s)
        tmo = _core.timeout(retry, read_s)
        while True:
            attempts.start()
            if attempts_out is not None:
                attempts_out[:] = [attempts.n]
            why: str
            try:
                resp = await self._http.request(method, path, json=json, params=params,
                                                headers=tracing.inject({}), timeout=tmo)
            except _core.RETRYABLE as e:
                err: BaseException = e
                why = f"{type(e).__name__}: {e}"
            else:
                if not (retry_409 and resp.status_code == 409):
                    break
                err, why = SandmanError("file changed while it was read"), "409 file changed"
            delay = attempts.delay()
            if delay is None:
                if isinstance(err, httpx.TransportError):
                    await self._unreachable(path, err, attempts.n)
                break  # the last 409 answer goes to raise_for_execd
            log.info("sandbox %s: %s %s attempt %d failed (%s); retrying in %.2fs%s",
                     self.id, method, path, attempts.n, why, delay,
                     f" with the same request_id {request_id}" if request_id else "")
            await asyncio.sleep(delay)
        try:
            _core.raise_for_execd(resp, path)
        except Unauthorized:
            await self._check_gone(path)
            raise
        return resp

    async def _unreachable(self, route: str, err: BaseException, n: int) -> None:
        says = _says(await self._check_gone(route))
        raise SandboxUnreachable(f"sandbox {self.id or self.url}: {route} got no answer after "
                                 f"{n} attempts: {type(err).__name__}: {err}{says}") from err

    async def _check_gone(self, route: str) -> SandboxInfo | None:
        """execd did not answer, or answered as someone else's (a reused pod address): ask the
        controller whether the sandbox still exists. Its view when it does (its `problem`
        says why execd cannot be reached, when the controller knows: a node down)."""
        if self._client is None or self.id is None:
            return None
        try:
            return await self._client.get(self.id)
        except SandboxPaused as e:
            # The controller's idle rule paused it: the caller resumes from e.handle.
            self._gone = True
            self._client._forget(self.id)
            raise SandboxPaused(f"sandbox {self.id} was paused ({route}): {e.message}",
                                handle=e.handle, status=e.status, type=e.type) from e
        except SandboxGone as e:
            self._gone = True
            self._client._forget(self.id)
            # The controller's "sandbox ID is gone: <why>" (a lost sandbox) reads as one line.
            why = e.message.replace(f"sandbox {self.id} is gone: ", "", 1)
            raise SandboxGone(f"sandbox {self.id} no longer exists ({route}): {why}",
                              status=e.status, type=e.type) from e
        except SandmanError as e:
            log.info("sandbox %s: controller check failed: %s", self.id, e)
        return None


def _says(info: SandboxInfo | None) -> str:
    """The controller's reason a sandbox cannot be reached, for a SandboxUnreachable."""
    return f"; the controller says: {info.problem}" if info is not None and info.problem else ""


class AsyncProcess:
    """A process started by `AsyncSandbox.spawn()`. Holds only its id: any handle on the
    sandbox finds it again (`sb.process(id)`), and every method asks execd."""

    def __init__(self, sandbox: AsyncSandbox, status: ProcessStatus) -> None:
        self.sandbox = sandbox
        self.id = status.id
        self.pid = status.pid
        self.command = status.command
        self.last = status  # the last status execd sent

    def __repr__(self) -> str:
        state = "running" if self.last.running else f"exit {self.last.exit_code}"
        return f"AsyncProcess(id={self.id!r}, pid={self.pid}, {state})"

    async def status(self) -> ProcessStatus:
        self.last = await self.sandbox._process_status(self.id)
        return self.last

    async def poll(self) -> int | None:
        """None while it runs, else its exit status (128 + N when signal N killed it)."""
        return (await self.status()).exit_code

    async def output(self, since: int = 0) -> ProcessOutput:
        """Its output from byte offset `since` on (stdout and stderr as printed). execd keeps
        the newest 1 MiB: if `since` is older, the answer starts at the oldest byte kept and
        `dropped` says how many were lost. Read on with `since=answer.end`."""
        if isinstance(since, bool) or not isinstance(since, int) or since < 0:
            raise BadRequest(f"since must be a byte offset (an int >= 0), not {since!r}")
        resp = await self.sandbox._call(PROCESS_OUTPUT, read_s=60.0,
                                        params={X.ID_PARAM: self.id, X.SINCE_PARAM: str(since)})
        return ProcessOutput.from_json(_core.decode_json(resp, "process output"))

    async def signal(self, sig: int | str = "TERM") -> ProcessStatus:
        """Send `sig` (a number, or a name: "TERM", "SIGKILL"...) to the process and its
        descendants, and to whatever still carries its tag (children re-parented to execd)."""
        if isinstance(sig, bool) or not isinstance(sig, (int, str)):
            raise BadRequest(f"sig must be a signal number or name, not {sig!r}")
        resp = await self.sandbox._call(
            PROCESS_SIGNAL, json=X.SignalRequest(id=self.id, signal=sig).to_json(), read_s=30.0)
        self.last = ProcessStatus.from_json(_core.decode_json(resp, "process signal"))
        return self.last

    async def wait(self, timeout: float | None = None) -> int:
        """Its exit status once it ended. `timeout` (seconds; None: as long as it runs):
        ProcessTimeout when it is still running then (it is not killed)."""
        if timeout is not None:
            _core.seconds_or_zero("timeout", timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = PROCESS_WAIT_ROUND_S if deadline is None else max(
                0.0, deadline - time.monotonic())
            step = min(left, PROCESS_WAIT_ROUND_S)
            resp = await self.sandbox._call(
                PROCESS_WAIT, json=X.WaitRequest(id=self.id, timeout=step).to_json(),
                read_s=step + 30.0)
            self.last = ProcessStatus.from_json(_core.decode_json(resp, "process wait"))
            if self.last.exit_code is not None:
                return self.last.exit_code
            if deadline is not None and time.monotonic() >= deadline:
                raise ProcessTimeout(f"process {self.id} ({self.command[:80]!r}) still runs "
                                     f"after {timeout} s", self.last)


class AsyncSession:
    """An interactive session opened by `AsyncSandbox.session()`: a program on its own pty.
    Holds its id and a read cursor (`offset`, the end of what `read()` or `expect()` has
    returned); every method asks execd. A context manager that closes it."""

    def __init__(self, sandbox: AsyncSandbox, status: SessionStatus) -> None:
        self.sandbox = sandbox
        self.id = status.id
        self.pid = status.pid
        self.command = status.command
        self.last = status  # the last status execd sent
        self.offset = 0
        self._pending = ""  # read by expect() past its match: the next expect() sees it first

    def __repr__(self) -> str:
        state = "running" if self.last.running else f"exit {self.last.exit_code}"
        return f"AsyncSession(id={self.id!r}, pid={self.pid}, {state})"

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        await self.close()

    async def write(self, data: bytes | str) -> int:
        """Send `data` to the terminal as typed keys (str as UTF-8; "\\x03" is ^C). Each piece
        of up to 64 KiB carries its own request_id, so a retry never types it twice.
        SessionEnded if the program is gone or does not read it within execd's 10 s."""
        raw = _core.to_bytes(data)
        done = 0
        for i in range(0, len(raw), SESSION_WRITE_MAX):
            piece = raw[i:i + SESSION_WRITE_MAX]
            rid = _core.new_request_id()
            resp = await self.sandbox._call(
                SESSION_WRITE, read_s=30.0, request_id=rid,
                json=X.SessionWriteRequest(id=self.id, data_b64=base64.b64encode(piece).decode(),
                                           request_id=rid).to_json())
            answer = _core.decode_json(resp, "session write")
            self.last = SessionStatus.from_json(answer)
            done += int(answer.get("written", len(piece)))
        return done

    async def read(self, timeout: float = 0.0, since: int | None = None) -> SessionOutput:
        """The output from byte offset `since` (default: the cursor, where the last read or
        expect ended) on, waiting up to `timeout` seconds for some when there is none yet;
        an empty answer after that. Moves the cursor to the answer's end. execd keeps the
        newest 256 KiB: `dropped` counts bytes lost before `start`."""
        _core.seconds_or_zero("timeout", timeout)
        if since is not None and (isinstance(since, bool) or not isinstance(since, int)
                                  or since < 0):
            raise BadRequest(f"since must be a byte offset (an int >= 0), not {since!r}")
        frm = self.offset if since is None else since
        deadline = time.monotonic() + timeout
        while True:
            step = min(max(0.0, deadline - time.monotonic()), SESSION_READ_ROUND_S)
            resp = await self.sandbox._call(
                SESSION_READ, read_s=step + 30.0,
                params={X.ID_PARAM: self.id, X.SINCE_PARAM: str(frm),
                        X.TIMEOUT_PARAM: f"{step:.3f}"})
            out = SessionOutput.from_json(_core.decode_json(resp, "session read"))
            if out.data or not out.output_open or time.monotonic() >= deadline:
                break
        self.offset = out.end
        self._pending = ""
        return out

    async def expect(self, pattern: str, timeout: float = 30.0) -> str:
        """Read from the cursor until the regex `pattern` matches what was read; return the
        text up to and including the match (the rest stays for the next expect). ExpectTimeout
        (with `output`, what was read) after `timeout` seconds or when the program ended
        without printing it."""
        _core.seconds_or_zero("timeout", timeout)
        try:
            rx = re.compile(pattern)
        except (re.error, TypeError) as e:
            raise BadRequest(f"pattern is not a regex: {e}") from None
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        text = self._pending
        deadline = time.monotonic() + timeout
        while True:
            m = rx.search(text)
            if m is not None:
                self._pending = text[m.end():]
                return text[:m.end()]
            left = deadline - time.monotonic()
            if left <= 0:
                break
            step = min(left, SESSION_READ_ROUND_S)
            resp = await self.sandbox._call(
                SESSION_READ, read_s=step + 30.0,
                params={X.ID_PARAM: self.id, X.SINCE_PARAM: str(self.offset),
                        X.TIMEOUT_PARAM: f"{step:.3f}"})
            out = SessionOutput.from_json(_core.decode_json(resp, "session read"))
            self.offset = out.end
            text += decoder.decode(out.data)
            if not out.data and not out.output_open:
                break
        self._pending = ""
        raise ExpectTimeout(f"session {self.id}: {pattern!r} not seen within {timeout} s "
                            f"(last output: {text[-200:]!r})", text)

    async def resize(self, cols: int, rows: int) -> SessionStatus:
        """Set the terminal's size; the kernel sends SIGWINCH to its foreground job."""
        for name, v in (("cols", cols), ("rows", rows)):
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= X.PTY_SIZE_MAX:
                raise BadRequest(f"{name} must be an int in 1..{X.PTY_SIZE_MAX}, not {v!r}")
        resp = await self.sandbox._call(
            SESSION_RESIZE, read_s=30.0,
            json=X.ResizeRequest(id=self.id, cols=cols, rows=rows).to_json())
        self.last = SessionStatus.from_json(_core.decode_json(resp, "session resize"))
        return self.last

    async def signal(self, sig: int | str = "INT") -> SessionStatus:
        """Send `sig` to the terminal's foreground process group (as a terminal's keys send
        ^C), or to the session's program when there is none."""
        if isinstance(sig, bool) or not isinstance(sig, (int, str)):
            raise BadRequest(f"sig must be a signal number or name, not {sig!r}")
        rid = _core.new_request_id()
        resp = await self.sandbox._call(
            SESSION_SIGNAL, read_s=30.0, request_id=rid,
            json=X.SignalRequest(id=self.id, signal=sig, request_id=rid).to_json())
        self.last = SessionStatus.from_json(_core.decode_json(resp, "session signal"))
        return self.last

    async def status(self) -> SessionStatus:
        for s in await self.sandbox.sessions():
            if s.id == self.id:
                self.last = s.last
                return self.last
        raise SessionNotFound(f"{SESSIONS.path}: no session {self.id} in this sandbox",
                              status=404)

    async def close(self) -> SessionStatus:
        """Kill the program and all its descendants (SIGKILL, even what ignores SIGHUP), reap
        them and forget the id. Closing a closed session does nothing."""
        attempts = [0]
        try:
            resp = await self.sandbox._call(SESSION_CLOSE, read_s=30.0,
                                            json=X.SessionCloseRequest(id=self.id).to_json(),
                                            attempts_out=attempts)
        except SessionNotFound:
            if attempts[0] <= 1 and self.last.raw.get("closed") is not True:
                raise
            return self.last  # a retry of a close that happened, or closed before
        self.last = SessionStatus.from_json(_core.decode_json(resp, "session close"))
        return self.last
