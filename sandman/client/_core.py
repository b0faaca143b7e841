"""The I/O-free half of the SDK, shared by the sync and async twins: the contract's request
models built with the SDK's errors, execd's request bodies, answer checks, the retry schedule,
the on_request report. The twins differ only in how they wait and send."""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import json
import logging
import os
import random
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Generator, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import httpx

from sandman import api, execd_api, tracing
from sandman._version import __version__
from sandman.client.errors import (
    BadRequest,
    ConfigurationError,
    IntegrityError,
    ProtocolError,
    SandmanError,
    controller_error,
    execd_error,
)
from sandman.client.models import ExecResult, FileContent, Owner, WriteResult
from sandman.contract import is_token_sha256

if TYPE_CHECKING:
    from sandman.api import Route

log = logging.getLogger("sandman.client")

USER_AGENT = f"sandman-client/{__version__}"

# execd's own default command timeout.
EXECD_DEFAULT_TIMEOUT_S = execd_api.DEFAULT_TIMEOUT_S
# How much longer than the command's timeout we wait for execd's answer: execd freezes and
# SIGKILLs the command at the timeout, then waits up to 2 s for the exit frame.
EXEC_ANSWER_GRACE_S = 15.0
# Acquire: the controller answers by timeout_s; the margin covers its queue bookkeeping.
ACQUIRE_ANSWER_GRACE_S = 30.0
# httpx writes a request's headers and body separately; with Nagle on, the body can wait for
# the server's delayed ACK (~40 ms; the webhook's TLS tests hit it). On loopback we measured no
# difference (exec p50 2.6 vs 2.4 ms, docs/sdk.md); it is kept for real pod networks.
SOCKET_OPTIONS = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]

_M = TypeVar("_M")
_T = TypeVar("_T")
if TYPE_CHECKING:
    from typing_extensions import ParamSpec  # type checkers only, never imported at run time

    _P = ParamSpec("_P")

# on_request(kind, name, elapsed_ms, response_length, exception): once per call, retries
# included. `kind` and `name` are the route's (api.Route); exception is None on success.
OnRequest = Callable[[str, str, float, int, "BaseException | None"], None]


def report(hook: OnRequest | None, route: Route, start: float, resp: httpx.Response | int | None,
           exc: BaseException | None) -> None:
    """One call to `on_request`; `resp` is the answer, or the bytes a stream read."""
    if hook is None:
        return
    size = resp if isinstance(resp, int) else len(resp.content) if resp is not None else 0
    try:
        hook(route.kind, route.path, (time.perf_counter() - start) * 1000.0, size, exc)
    except Exception:  # a broken hook must not break the call it reports
        log.exception("on_request hook failed for %s %s", route.kind, route.path)


class Call:
    """One logical call in flight (`call`): `done(resp)` reports its answer."""

    def __init__(self, hook: OnRequest | None, route: Route, span: Any) -> None:
        self.hook, self.route, self.span = hook, route, span
        self.start = time.perf_counter()

    def done(self, resp: httpx.Response) -> None:
        report(self.hook, self.route, self.start, resp, None)
        tracing.set_attributes(self.span, {"http.response.status_code": resp.status_code})
        tracing.record_execd(self.span, resp.headers)  # execd's own time, when it says it


@contextmanager
def call(hook: OnRequest | None, route: Route, service: str,
         sandbox_id: str | None) -> Iterator[Call]:
    """One logical call (its retries included): its client span ("sandman ACQUIRE", "execd
    EXEC") current while it is sent, so its traceparent is what the controller or execd sees
    (sandman/tracing.py), and one report to `on_request`: the answer (`done`) or the
    exception that left the block."""
    with tracing.span(f"{service} {route.kind}", "client", {
            "sandman.operation": route.kind, "http.request.method": route.method,
            "url.template": route.path, "sandman.sandbox_id": sandbox_id or None}) as s:
        c = Call(hook, route, s)
        try:
            yield c
        except Exception as e:
            report(hook, route, c.start, None, e)
            raise


@functools.cache
def tls_context() -> ssl.SSLContext:
    """httpx's default TLS context, built once for every client and sandbox of the process.
    Building one loads the whole CA bundle; each acquired sandbox paid that for its own
    connection pool before, although execd speaks plain HTTP and never uses it."""
    return httpx.create_ssl_context()


# ---- in-cluster configuration: Client() with no arguments (docs/sdk.md, "Before you start")

ENV_URL = "SANDMAN_URL"  # the controller, e.g. https://sandman-controller.sandman-system.svc:8080
ENV_TOKEN_FILE = "SANDMAN_TOKEN_FILE"  # a projected ServiceAccount token (audience sandman)
ENV_CA_FILE = "SANDMAN_CA_FILE"  # the CA bundle of the controller's serving certificate


# The chart's Service in its documented namespace (docs/install.md): https only.
EXAMPLE_URL = "https://sandman-controller.sandman-system.svc:8080"


def controller_url(url: str | None) -> str:
    """The controller's base URL, checked: http(s)://host[:port][/path], nothing else."""
    url = (url or os.environ.get(ENV_URL, "")).strip()
    if not url:
        raise ConfigurationError(f"no controller URL: pass Client(url) or set ${ENV_URL} (e.g. "
                                 f"{EXAMPLE_URL})")
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError) as e:
        raise ConfigurationError(f"controller URL {url!r} is not a URL: {e}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ConfigurationError(f"controller URL {url!r} must be https://host[:port] (or "
                                 f"http://), e.g. {EXAMPLE_URL}")
    return url.rstrip("/")


def check_plain_http(url: str, token: TokenSource, allow_insecure_http: bool) -> None:
    """The caller's bearer token (a ServiceAccount token: whoever reads it acts as the caller)
    never goes over plain http unless the caller says so."""
    if httpx.URL(url).scheme != "http" or not token.sends():
        return
    if not allow_insecure_http:
        raise ConfigurationError(f"controller URL {url!r} is plain http and a bearer token is "
                                 f"configured: it would travel unencrypted; use https (e.g. "
                                 f"{EXAMPLE_URL}) or pass allow_insecure_http=True")
    log.warning("sandman client: sending the bearer token to %s over plain http "
                "(allow_insecure_http=True): anyone on the path can act as this caller", url)


def configuration_error(e: BaseException) -> ConfigurationError | None:
    """A transport error that no retry can fix, as the caller's configuration error: the
    controller's certificate does not verify (wrong or missing CA), or the URL's protocol is
    not one httpx speaks."""
    if isinstance(e, httpx.UnsupportedProtocol):
        return ConfigurationError(f"the controller URL's protocol is not supported: {e}")
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, ssl.SSLCertVerificationError):
            return ConfigurationError(
                f"the controller's TLS certificate did not verify ({cur.verify_message or cur}): "
                f"pass ca_file= or set ${ENV_CA_FILE} to the chart's CA bundle (ConfigMap "
                f"sandman-ca)")
        cur = cur.__cause__ or cur.__context__
    return None


class TokenSource:
    """The bearer token: given, or read from a file that is read again whenever it changes
    (the kubelet rotates projected tokens by swapping the file under a symlink). Sends
    nothing when there is neither (a controller under --auth none)."""

    def __init__(self, token: str | None, token_file: str | None) -> None:
        self._token = token.strip() if token else None
        self.file = None if token else (token_file or os.environ.get(ENV_TOKEN_FILE) or None)
        self._seen: tuple[int, int, int] | None = None
        if self.file:
            self.header()  # a missing or empty file is one clear error at construction

    def header(self) -> dict[str, str]:
        if self.file:
            try:
                st = os.stat(self.file)
                key = (st.st_ino, st.st_mtime_ns, st.st_size)
                if key != self._seen:
                    with open(self.file, encoding="utf-8") as f:
                        tok = f.read().strip()
                    if not tok:
                        raise SandmanError(f"token file {self.file} is empty")
                    self._token, self._seen = tok, key
            except OSError as e:
                raise SandmanError(f"cannot read the token file {self.file} "
                                   f"(${ENV_TOKEN_FILE}): {e.strerror or e}") from None
        return {"Authorization": f"Bearer {self._token}"} if self._token else {}

    def sends(self) -> bool:
        """Whether calls carry a bearer token."""
        return bool(self._token or self.file)


def controller_tls(ca_file: str | None) -> ssl.SSLContext:
    """Verification for an https controller: the CA file given or in $SANDMAN_CA_FILE (the
    chart's CA bundle ConfigMap), else the system's CAs."""
    ca_file = ca_file or os.environ.get(ENV_CA_FILE) or None
    if not ca_file:
        return tls_context()
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as e:
        raise ConfigurationError(f"cannot load the CA file {ca_file} (${ENV_CA_FILE}): "
                                 f"{e}") from None


class Acquiring(Generic[_T]):
    """What `AsyncClient.acquire(...)` returns: `await` it for the sandbox, or `async with` it
    for the sandbox released on exit (as httpx's and aiohttp's requests are both). The acquire
    starts at the first await or enter, and only once."""

    __slots__ = ("_start", "_sandbox")

    def __init__(self, start: Callable[[], Coroutine[Any, Any, _T]]) -> None:
        self._start: Callable[[], Coroutine[Any, Any, _T]] | None = start
        self._sandbox: Any = None

    def _begin(self) -> Coroutine[Any, Any, _T]:
        if self._start is None:
            raise RuntimeError("this acquire() was already awaited: call acquire() again")
        start, self._start = self._start, None
        return start()

    def __await__(self) -> Generator[Any, None, _T]:
        return self._begin().__await__()

    async def __aenter__(self) -> _T:
        self._sandbox = await self._begin()
        return await self._sandbox.__aenter__()  # type: ignore[no-any-return]

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        await self._sandbox.__aexit__(exc_type, exc, tb)


def acquiring(fn: Callable[_P, Coroutine[Any, Any, _T]]) -> Callable[_P, Acquiring[_T]]:
    """`async def acquire` made an `Acquiring` (the sync twin drops this decorator)."""
    @functools.wraps(fn)
    def call(*args: _P.args, **kwargs: _P.kwargs) -> Acquiring[_T]:
        return Acquiring(lambda: fn(*args, **kwargs))
    return call


# asyncio: aclose() waits this long for the acquires and releases of cancelled callers.
CLOSE_WAIT_S = 60.0
# asyncio: acquires and releases running on after their caller was cancelled, referenced
# here until they finish (the event loop keeps only weak references to tasks).
_BACKGROUND: set[asyncio.Task[Any]] = set()


def keep(task: asyncio.Task[Any]) -> asyncio.Task[Any]:
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)
    return task


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries of calls that are safe to repeat: execd calls (commands carry one
    request_id for all their attempts, so execd runs a command at most once), controller
    reads and releases, and acquires (one request_id for all attempts: the controller answers
    a repeat with the sandbox of the first).

    `attempts` counts every try, the first included. `budget_s` bounds the time spent in
    retries on top of one attempt's own timeout."""

    attempts: int = 5
    backoff_s: float = 0.1
    backoff_max_s: float = 2.0
    budget_s: float = 30.0
    connect_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("attempts must be >= 1")
        if self.backoff_s < 0 or self.backoff_max_s < 0 or self.budget_s < 0:
            raise ValueError("backoff and budget must be >= 0")


class Attempts:
    """The retry schedule of one logical call: exponential backoff with equal jitter (each wait
    uniform in [cap/2, cap]), bounded in count and in wall-clock time."""

    def __init__(self, policy: RetryPolicy, call_timeout_s: float) -> None:
        self.policy = policy
        self.n = 0
        self.deadline = time.monotonic() + call_timeout_s + policy.budget_s

    def start(self) -> None:
        self.n += 1

    def delay(self) -> float | None:
        """Seconds to wait before the next attempt, or None when no attempt is left."""
        if self.n >= self.policy.attempts:
            return None
        cap = min(self.policy.backoff_max_s, self.policy.backoff_s * (2 ** (self.n - 1)))
        d = random.uniform(cap / 2, cap) if cap > 0 else 0.0
        if time.monotonic() + d >= self.deadline:
            return None
        return d

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())


# Transport errors after which a request may or may not have reached the server. Every call
# the SDK retries is one execd or the controller deduplicates (request_id) or that changes
# nothing.
RETRYABLE = (httpx.TransportError,)


def new_request_id() -> str:
    return uuid.uuid4().hex


def execd_url(address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address and not address.startswith("[") else address
    return f"http://{host}:{port}"


def timeout(policy: RetryPolicy, read_s: float) -> httpx.Timeout:
    return httpx.Timeout(connect=policy.connect_timeout_s, read=read_s, write=read_s,
                         pool=policy.connect_timeout_s)


def limits() -> httpx.Limits:
    # One sandbox runs one command at a time; a few connections cover files read in parallel.
    # execd keeps idle connections 180 s; expire ours first so we never reuse a closed one.
    return httpx.Limits(max_connections=8, max_keepalive_connections=4, keepalive_expiry=120)


def decode_json(resp: httpx.Response, what: str) -> Any:
    try:
        return json.loads(resp.content)
    except ValueError:
        raise ProtocolError(f"{what}: answer is not JSON (HTTP {resp.status_code}, "
                            f"{resp.headers.get('content-type', 'no content type')})",
                            status=resp.status_code) from None


def raise_for_controller(resp: httpx.Response) -> None:
    if resp.status_code < 400:
        return
    try:
        body = json.loads(resp.content)
    except ValueError:
        body = None
    raise controller_error(resp.status_code, body)


def raise_for_execd(resp: httpx.Response, route: str) -> None:
    if resp.status_code < 400:
        return
    try:
        body = json.loads(resp.content)
    except ValueError:
        body = None
    raise execd_error(resp.status_code, body, route=route)


# ---- requests

def request(cls: type[_M], **fields: Any) -> _M:
    """A request model of the contract (sandman/api.py); its own checks refuse bad arguments
    before anything is sent."""
    try:
        return cls(**fields)
    except ValueError as e:
        raise BadRequest(str(e)) from None


def owner_of(owner: Owner | Mapping[str, str] | None) -> Owner | None:
    if owner is None or isinstance(owner, Owner):
        return owner
    return Owner(name=str(owner["name"]), uid=str(owner["uid"]))


def egress_of(egress: str | Mapping[str, Sequence[str]]) -> str | dict[str, Any]:
    """`egress` as the wire takes it; api.canonical_egress checks it."""
    if isinstance(egress, Mapping):
        return {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in egress.items()}
    return egress


def conditions_of(c: api.Conditions | Mapping[str, Any] | None) -> api.Conditions | None:
    if c is None or isinstance(c, api.Conditions):
        return c
    if not isinstance(c, Mapping):
        raise BadRequest("conditions: must be sandman.api.Conditions or a mapping")
    unknown = sorted(set(c) - set(api.CONDITION_FIELDS))
    if unknown:
        raise BadRequest(f"conditions: unknown field(s) {', '.join(unknown)} (known: "
                         f"{', '.join(api.CONDITION_FIELDS)})")
    try:
        return api.Conditions(**dict(c))
    except ValueError as e:
        raise BadRequest(str(e)) from None


def _seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise BadRequest(f"{name} must be a number of seconds > 0, not {value!r}")
    return float(value)


def exec_body(command: str, timeout_s: float | None, max_output: int | None,
              request_id: str | None, idle_timeout_s: float | None = None,
              fresh: bool = False, cwd: str | None = None) -> execd_api.ExecRequest:
    if not isinstance(command, str):
        raise BadRequest("command must be a str")
    if not isinstance(fresh, bool):
        raise BadRequest("fresh must be True or False")
    if fresh and (not isinstance(cwd, str) or not cwd.startswith("/")):
        raise BadRequest("exec(fresh=True) needs cwd: an absolute path")
    if not fresh and cwd is not None:
        raise BadRequest("cwd is for exec(fresh=True); the shell's cwd is its own")
    return execd_api.ExecRequest(
        command=command, request_id=request_id,
        timeout=None if timeout_s is None else _seconds("timeout", timeout_s),
        idle_timeout=None if idle_timeout_s is None else _seconds("idle_timeout",
                                                                   idle_timeout_s),
        max_output=max_output, fresh=True if fresh else None, cwd=cwd)


def stream_body(command: str, timeout_s: float | None, idle_timeout_s: float | None,
                max_output: int | None, kill_on_disconnect: bool) -> execd_api.StreamRequest:
    """/exec/stream's body: /exec's without a request_id (a stream is never replayed)."""
    e = exec_body(command, timeout_s, max_output, None, idle_timeout_s)
    if not isinstance(kill_on_disconnect, bool):
        raise BadRequest("kill_on_disconnect must be True or False")
    return execd_api.StreamRequest(command=e.command, timeout=e.timeout,
                                   idle_timeout=e.idle_timeout, max_output=e.max_output,
                                   kill_on_disconnect=True if kill_on_disconnect else None)


def stream_line(line: str, route: str) -> str | ExecResult:
    """One line of execd's /exec/stream answer: an output chunk, or the final ExecResult; an
    error line raises the typed error."""
    try:
        obj = json.loads(line)
    except ValueError:
        raise ProtocolError(f"{route}: a stream line is not JSON: {line[:80]!r}") from None
    if isinstance(obj, dict):
        text = obj.get("output")
        if isinstance(text, str):
            return text
        if "result" in obj:
            return ExecResult.from_json(obj["result"], "")
        code = obj.get("code")
        if isinstance(obj.get("error"), str) and isinstance(code, int) and code >= 400:
            raise execd_error(code, obj, route=route)
    raise ProtocolError(f"{route}: unexpected stream line {line[:80]!r}")


def spawn_body(command: str, cwd: str | None, env: Mapping[str, str] | None,
               request_id: str) -> execd_api.SpawnRequest:
    """/processes/spawn's body (and /sessions/open's but for the size); execd checks the
    rest (variable names, the cwd)."""
    if not isinstance(command, str) or not command.strip():
        raise BadRequest("command must be a non-empty str")
    if cwd is not None and not isinstance(cwd, str):
        raise BadRequest("cwd must be a str")
    if env is not None and (not isinstance(env, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise BadRequest("env must map str names to str values")
    return execd_api.SpawnRequest(command=command, request_id=request_id, cwd=cwd,
                                  env=None if env is None else dict(env))


def process_id(pid_id: str) -> str:
    if not isinstance(pid_id, str) or not pid_id:
        raise BadRequest(f"a process id is a non-empty str, not {pid_id!r}")
    return pid_id


def seconds_or_zero(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise BadRequest(f"{name} must be a number of seconds >= 0, not {value!r}")
    return float(value)


def exec_read_timeout(timeout_s: float | None) -> float:
    return (EXECD_DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s) + EXEC_ANSWER_GRACE_S


def to_bytes(data: bytes | bytearray | memoryview | str) -> bytes:
    if isinstance(data, str):
        return data.encode("utf-8")
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    raise BadRequest(f"data must be bytes or str, not {type(data).__name__}")


def write_body(path: str, data: bytes, mode: int | str | None,
               if_sha256: str | None) -> execd_api.WriteRequest:
    if if_sha256 is not None and not is_token_sha256(if_sha256.lower()):  # same syntax
        raise BadRequest("if_sha256 must be a SHA-256 hex digest")
    return execd_api.WriteRequest(path=path, data_b64=base64.b64encode(data).decode("ascii"),
                                  mode=mode,
                                  if_sha256=None if if_sha256 is None else if_sha256.lower())


# ---- answer checks (fail closed)

def check_read(path: str, resp: httpx.Response) -> FileContent:
    """The bytes of `GET /files`, only if their length and SHA-256 match what execd sent."""
    want = (resp.headers.get(execd_api.CONTENT_SHA256_HEADER) or "").strip().lower()
    if not is_token_sha256(want):
        raise IntegrityError(f"read {path}: execd sent no valid X-Content-SHA256; refusing "
                             "bytes that cannot be checked")
    data = resp.content
    length = resp.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) != len(data)):
        raise IntegrityError(f"read {path}: got {len(data)} bytes, Content-Length {length}")
    got = hashlib.sha256(data).hexdigest()
    if got != want:
        raise IntegrityError(f"read {path}: SHA-256 of the {len(data)} bytes received is "
                             f"{got}, execd sent {want}")
    return FileContent(path=path, data=data, sha256=got)


def check_write(path: str, data: bytes, result: WriteResult) -> WriteResult:
    """execd's answer must describe exactly the bytes we sent."""
    want = hashlib.sha256(data).hexdigest()
    if result.size != len(data) or result.sha256.lower() != want:
        raise IntegrityError(f"write {path}: execd stored {result.size} bytes with SHA-256 "
                             f"{result.sha256}; sent {len(data)} bytes with SHA-256 {want}")
    return result


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def release_in_background(sandbox: Any, client: Any, what: str, logger: logging.Logger,
                          thread: str) -> None:
    """A framework's object dropped without its own cleanup (the frameworks' runners never
    call it): the sandbox released, and the client the object made closed, from a daemon
    thread, never raising; where that fails the lease's lifetime ends it."""
    def run() -> None:
        try:
            sandbox.release()
            if client is not None:
                client.close()
        except Exception as e:
            logger.warning("releasing sandbox %s of a dropped %s failed: %s (its lifetime "
                           "ends the lease)", sandbox.id, what, e)

    try:
        threading.Thread(target=run, name=thread, daemon=True).start()
    except Exception:  # interpreter shutdown: the lifetime ends the lease instead
        pass
