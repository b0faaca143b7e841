"""The I/O-free half of the SDK, shared by the sync and async twins: request bodies, answer
checks, the retry schedule. The twins differ only in how they wait and send."""

from __future__ import annotations

import base64
import hashlib
import json
import random
import re
import socket
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from sandman import __version__
from sandman.client.errors import (
    BadRequest,
    IntegrityError,
    ProtocolError,
    controller_error,
    execd_error,
)
from sandman.client.models import FileContent, Owner, WriteResult

USER_AGENT = f"sandman-client/{__version__}"

# execd's own default command timeout (DEFAULT_TIMEOUT in execd.py).
EXECD_DEFAULT_TIMEOUT_S = 300.0
# How much longer than the command's timeout we wait for execd's answer: execd sends SIGTERM at
# the timeout, SIGKILL after its --kill-grace (2 s), then waits up to 2 s for the exit frame.
EXEC_ANSWER_GRACE_S = 15.0
# Acquire: the controller answers by timeout_s; the margin covers its queue bookkeeping.
ACQUIRE_ANSWER_GRACE_S = 30.0
# httpx writes a request's headers and body separately; with Nagle on, the body can wait for
# the server's delayed ACK (~40 ms; the webhook's TLS tests hit it). On loopback we measured no
# difference (exec p50 2.6 vs 2.4 ms, docs/sdk.md); it is kept for real pod networks.
SOCKET_OPTIONS = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]

_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


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
    """The retry schedule of one logical call: full-jitter exponential backoff, bounded in
    count and in wall-clock time."""

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

def acquire_body(*, image: str, cpu: str | int | float, memory: str, workspace: str | None,
                 egress: str, job: str, owner: Owner | Mapping[str, str] | None,
                 labels: Mapping[str, str] | None, timeout_s: float, warm_ok: bool,
                 wait: bool) -> dict[str, Any]:
    if not image:
        raise BadRequest("image is required")
    if not job:
        raise BadRequest("job is required: the controller paces, caps and drains by job")
    if egress not in ("deny", "allow"):
        raise BadRequest(f"egress must be 'deny' or 'allow', not {egress!r}")
    if isinstance(owner, Owner):
        owner_json: dict[str, str] | None = owner.to_json()
    elif owner is not None:
        owner_json = {"name": str(owner["name"]), "uid": str(owner["uid"])}
    else:
        owner_json = None
    return {"image": image, "cpu": str(cpu), "memory": str(memory), "workspace": workspace,
            "egress": egress, "job": job, "owner": owner_json, "labels": dict(labels or {}),
            "timeout_s": timeout_s, "warm_ok": bool(warm_ok), "wait": bool(wait),
            # One id for every attempt: a retry whose first answer was lost gets the same
            # sandbox back from the controller instead of a second one.
            "request_id": new_request_id()}


def prewarm_body(*, image: str, count: int, cpu: str | int | float, memory: str,
                 workspace: str | None, egress: str,
                 idle_timeout_s: float | None) -> dict[str, Any]:
    if not image:
        raise BadRequest("image is required")
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise BadRequest("count must be an integer >= 0")
    if egress not in ("deny", "allow"):
        raise BadRequest(f"egress must be 'deny' or 'allow', not {egress!r}")
    body: dict[str, Any] = {"image": image, "count": count,
                            "spec": {"cpu": str(cpu), "memory": str(memory),
                                     "workspace": workspace, "egress": egress}}
    if idle_timeout_s is not None:
        body["idle_timeout_s"] = idle_timeout_s
    return body


def exec_body(command: str, timeout_s: float | None, max_output: int | None,
              request_id: str) -> dict[str, Any]:
    if not isinstance(command, str):
        raise BadRequest("command must be a str")
    body: dict[str, Any] = {"command": command, "request_id": request_id}
    if timeout_s is not None:
        if not timeout_s > 0:
            raise BadRequest("timeout must be > 0 seconds")
        body["timeout"] = timeout_s
    if max_output is not None:
        body["max_output"] = max_output
    return body


def exec_read_timeout(timeout_s: float | None) -> float:
    return (EXECD_DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s) + EXEC_ANSWER_GRACE_S


def to_bytes(data: bytes | bytearray | memoryview | str) -> bytes:
    if isinstance(data, str):
        return data.encode("utf-8")
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    raise BadRequest(f"data must be bytes or str, not {type(data).__name__}")


def write_body(path: str, data: bytes, mode: int | str | None,
               if_sha256: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"path": path, "data_b64": base64.b64encode(data).decode("ascii")}
    if mode is not None:
        body["mode"] = mode
    if if_sha256 is not None:
        if not _SHA256_HEX.match(if_sha256.lower()):
            raise BadRequest("if_sha256 must be a SHA-256 hex digest")
        body["if_sha256"] = if_sha256.lower()
    return body


# ---- answer checks (fail closed)

def check_read(path: str, resp: httpx.Response) -> FileContent:
    """The bytes of `GET /files`, only if their length and SHA-256 match what execd sent."""
    want = (resp.headers.get("x-content-sha256") or "").strip().lower()
    if not _SHA256_HEX.match(want):
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
