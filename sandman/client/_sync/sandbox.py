"""`Sandbox`: one sandbox's execd, over a keep-alive connection pool of its own.
Mirrored by `sandman/client/_async/sandbox.py`; change both together."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import httpx

from sandman.client import _core
from sandman.client._core import RetryPolicy
from sandman.client.errors import (
    CommandTimeout,
    SandboxGone,
    SandboxUnreachable,
    SandmanError,
    Unauthorized,
    WriteConflict,
)
from sandman.client.models import (
    AcquireTimings,
    Conditions,
    ExecResult,
    FileContent,
    Health,
    ResetResult,
    State,
    WriteResult,
)

if TYPE_CHECKING:
    from sandman.client._sync.client import Client

log = logging.getLogger("sandman.client")


class Sandbox:
    """A sandbox: run commands in its one persistent shell, read and write its files.

    Get one from `Client.acquire()` (leaving `with sandbox:` releases it) or attach to a
    running execd with `Sandbox.connect(address, port, token)`. The token is sent as a bearer
    header and is never logged or shown by repr()."""

    def __init__(self, address: str, port: int, token: str, *, id: str | None = None,
                 pod: str | None = None, job: str | None = None, warm: bool = False,
                 timings: AcquireTimings | None = None, retry: RetryPolicy | None = None,
                 file_timeout_s: float = 120.0, transport: httpx.BaseTransport | None = None,
                 _client: Client | None = None) -> None:
        self.id = id
        self.pod = pod
        self.job = job
        self.address = address
        self.port = port
        self.warm = warm
        self.timings = timings or AcquireTimings()
        self.url = _core.execd_url(address, port)
        self._retry = retry or RetryPolicy()
        self._file_timeout_s = file_timeout_s
        self._client = _client
        self._lock = threading.Lock()
        self._closed = False  # no execd call is sent any more
        self._released = False  # the controller confirmed the release (or there is none)
        self._gone = False  # the controller said the sandbox no longer exists
        if transport is None:
            transport = httpx.HTTPTransport(socket_options=_core.SOCKET_OPTIONS,
                                            limits=_core.limits())
        # trust_env=False: a trainer's HTTP(S)_PROXY must never carry the token to a proxy.
        self._http = httpx.Client(
            base_url=self.url, transport=transport, trust_env=False, follow_redirects=False,
            headers={"Authorization": f"Bearer {token}", "User-Agent": _core.USER_AGENT})

    @classmethod
    def connect(cls, address: str, port: int, token: str, **kw: Any) -> Sandbox:
        """A handle on a running execd with no controller behind it: release() only closes
        the connections."""
        return cls(address, port, token, **kw)

    def __repr__(self) -> str:
        state = "released" if self._closed else "live"
        return (f"Sandbox(id={self.id!r}, pod={self.pod!r}, address={self.address!r}, "
                f"port={self.port}, {state})")

    # ---- lifecycle

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.release()
            return
        try:
            self.release()
        except Exception as e:  # never hide the caller's own error behind ours
            log.warning("sandbox %s: release failed while leaving on %s: %s (the client "
                        "retries it when closed)", self.id, exc_type.__name__, e)

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> bool:
        """Give the sandbox back. Idempotent; True when this call released it. No execd call
        is sent after the first release(), even if the controller's answer was lost: a
        failed release raises and stays with the client, which retries it at close()."""
        with self._lock:
            self._closed = True
            if self._released:
                return False
        try:
            released = True
            if self._client is not None and self.id is not None:
                released = self._client.release(self.id)
        finally:
            self._http.close()
        self._released = True
        return released

    def close(self) -> None:
        """Close the connections without releasing (the sandbox stays the caller's)."""
        self._http.close()

    # ---- execd calls

    def health(self) -> Health:
        resp = self._call("GET", "/health", read_s=10.0)
        return Health.from_json(_core.decode_json(resp, "health"))

    def exec(self, command: str, timeout: float | None = None, *,
             max_output: int | None = None, request_id: str | None = None) -> ExecResult:
        """Run `command` in the sandbox's shell (bash; cwd, variables and functions persist
        between calls) and wait for it. `timeout` in seconds (execd's default: 300). Raises
        CommandTimeout when execd killed it for running too long.

        One request_id covers every retry of this call: execd runs the command at most once
        and answers a retry with the stored result."""
        rid = request_id or _core.new_request_id()
        body = _core.exec_body(command, timeout, max_output, rid)
        resp = self._call("POST", "/exec", json=body, read_s=_core.exec_read_timeout(timeout),
                          request_id=rid)
        result = ExecResult.from_json(_core.decode_json(resp, "exec"), rid)
        if result.timed_out:
            raise CommandTimeout(f"command timed out after {timeout or 'the default'} s "
                                 f"(request {rid}): {result.error}", result)
        return result

    def read_file(self, path: str) -> FileContent:
        """The whole file, byte-exact; its SHA-256 was checked against execd's (fail closed:
        IntegrityError, never unchecked bytes)."""
        resp = self._call("GET", "/files", params={"path": path}, read_s=self._file_timeout_s,
                          retry_409=True)
        return _core.check_read(path, resp)

    def read(self, path: str) -> bytes:
        return self.read_file(path).data

    def write(self, path: str, data: bytes | str, *, mode: int | str | None = None,
              if_sha256: str | None = None) -> WriteResult:
        """Replace the file atomically with `data` (str is written as UTF-8). `if_sha256`:
        only if the file's current content has that SHA-256 (WriteConflict otherwise; pass
        `FileContent.sha256` from a read to make a read-modify-write safe)."""
        raw = _core.to_bytes(data)
        body = _core.write_body(path, raw, mode, if_sha256)
        attempts: list[int] = []
        try:
            resp = self._call("POST", "/files/write", json=body, read_s=self._file_timeout_s,
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

    def env(self, set: dict[str, str] | None = None,
            unset: list[str] | None = None) -> dict[str, str]:
        """Export `set` and unset `unset` in the shell (and in shells started later); returns
        the shell's whole environment after the change."""
        body = {"set": dict(set or {}), "unset": list(unset or [])}
        resp = self._call("POST", "/env", json=body, read_s=60.0)
        data = _core.decode_json(resp, "env")
        env = data.get("env") if isinstance(data, dict) else None
        return dict(env) if isinstance(env, dict) else {}

    def reset(self, workspace: bool = False) -> ResetResult:
        """Kill every process of the sandbox and start a fresh shell; `workspace=True` also
        empties the workspace directory."""
        resp = self._call("POST", "/reset", json={"workspace": bool(workspace)}, read_s=90.0)
        return ResetResult.from_json(_core.decode_json(resp, "reset"))

    def state(self) -> State:
        resp = self._call("GET", "/state", read_s=30.0)
        return State.from_json(_core.decode_json(resp, "state"))

    def conditions(self, egress_probe: str | None = None) -> Conditions:
        """The run conditions as the sandbox reads them; `egress_probe="host:port"` also tries
        one outbound connection (to check the egress guard)."""
        params = {"egress_probe": egress_probe} if egress_probe else None
        resp = self._call("GET", "/conditions", params=params, read_s=30.0)
        return Conditions.from_json(_core.decode_json(resp, "conditions"))

    # ---- transport

    def _call(self, method: str, route: str, *, read_s: float, json: Any = None,
              params: dict[str, str] | None = None, request_id: str | None = None,
              retry_409: bool = False, attempts_out: list[int] | None = None) -> httpx.Response:
        """One logical call: bounded retries on transport errors, then the typed error."""
        if self._closed:
            raise SandboxGone(f"sandbox {self.id or self.url} was released; {route} not sent")
        if self._gone:
            raise SandboxGone(f"sandbox {self.id} no longer exists; {route} not sent")
        attempts = _core.Attempts(self._retry, read_s)
        tmo = _core.timeout(self._retry, read_s)
        while True:
            attempts.start()
            if attempts_out is not None:
                attempts_out[:] = [attempts.n]
            why: str
            try:
                resp = self._http.request(method, route, json=json, params=params, timeout=tmo)
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
                    self._unreachable(route, err, attempts.n)
                break  # the last 409 answer goes to raise_for_execd
            log.info("sandbox %s: %s %s attempt %d failed (%s); retrying in %.2fs%s",
                     self.id, method, route, attempts.n, why, delay,
                     f" with the same request_id {request_id}" if request_id else "")
            time.sleep(delay)
        try:
            _core.raise_for_execd(resp, route)
        except Unauthorized:
            self._check_gone(route)
            raise
        return resp

    def _unreachable(self, route: str, err: BaseException, n: int) -> None:
        self._check_gone(route)
        raise SandboxUnreachable(f"sandbox {self.id or self.url}: {route} got no answer after "
                                 f"{n} attempts: {type(err).__name__}: {err}") from err

    def _check_gone(self, route: str) -> None:
        """execd did not answer, or answered as someone else's (a reused pod address): ask the
        controller whether the sandbox still exists."""
        if self._client is None or self.id is None:
            return
        try:
            self._client.get(self.id)
        except SandboxGone as e:
            self._gone = True
            self._client._forget(self.id)
            raise SandboxGone(f"sandbox {self.id} no longer exists ({route}): {e.message}",
                              status=e.status, type=e.type) from e
        except SandmanError as e:
            log.info("sandbox %s: controller check failed: %s", self.id, e)
