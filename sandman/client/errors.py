"""Typed errors of the client SDK. Every error the SDK raises is a `SandmanError`.

Errors travel as types, not strings: a trainer catches `AcquireTimeout` or `CommandTimeout`,
never matches a message. The controller names its error in `{"error": {"type": ...}}`; execd
answers `{"error": message, "code": status, ...}` and is mapped by status and fields.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sandman import api
from sandman import execd_api as X

if TYPE_CHECKING:
    from sandman.client.models import ExecResult, ProcessStatus


class SandmanError(Exception):
    """Base of every SDK error. `status` is the HTTP status when a server answered."""

    def __init__(self, message: str, *, status: int | None = None,
                 type: str | None = None, events: list[str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.events = list(events or [])

    def __str__(self) -> str:
        s = self.message
        if self.status is not None:
            s = f"{s} (HTTP {self.status})"
        if self.events:
            s += "; events: " + " | ".join(self.events[-10:])
        return s


# ---- the controller (acquire / release)

class ControllerError(SandmanError):
    """The controller answered with an error this SDK has no narrower type for."""


class AcquireTimeout(ControllerError, TimeoutError):
    """No sandbox was ready within the acquire's `timeout_s` (504)."""


class QueueFull(ControllerError):
    """`wait=False` and the job or cluster is over its cap (429)."""


class BadRequest(SandmanError):
    """The request was refused as invalid (400/422), by the controller or by execd."""


class ImageChanged(BadRequest):
    """grade(): the grading pod's image digest is not the task's (pinned in `Task.image`, or
    recorded at its preflight or first grading): the tag moved. Refused, never a verdict."""


class BadOwner(BadRequest):
    """`owner=` names no pod in the sandbox namespace: an ownerReference cannot cross
    namespaces (the garbage collector would delete the sandbox at once). Rely on `lifetime_s`
    instead: the SDK renews while the handle is open, and a dead trainer's sandboxes expire."""


class PodFailed(ControllerError):
    """The pod failed or never became ready (502); `events` holds the pod's last events."""


class ConditionsRefused(PodFailed):
    """Every pod the controller tried contradicted a declared run condition (502): each was
    deleted. The message names the field, the declared value and what the pod read; the
    cluster cannot give what was declared (fix the declaration or the pods' size)."""


class ForkFailed(ControllerError):
    """fork(): the children were had but the parent's state did not reach every one (its
    execd could not give it, a child's execd refused it) (502). Every child was released;
    the parent is as it was."""


class CheckpointFailed(ControllerError):
    """checkpoint(), restore(), pause(): did not complete (the registry refused or failed, an
    artifact was changed in it, over the size bound, a sandbox's execd refused) (502).
    Nothing of it is left: no partial checkpoint, no restored sandbox."""


class CheckpointGone(ControllerError):
    """restore(), resume(): no such checkpoint in the caller's tenant, or past its TTL (404)."""


class ImageUnresolved(ControllerError):
    """The controller could not resolve the image's tag to a digest (502): no pod is made by
    tag, which would pin nothing for the job. Reference the image by digest, or see the
    controller's --image-pinning."""


class NotLeader(ControllerError):
    """A standby controller replica answered (503). Retried by the SDK; raised when the
    retries are used up."""


class Unauthenticated(ControllerError):
    """The controller refused the caller's identity (401): no token, or a token the API server
    did not accept for the controller's audience (expired, wrong audience, deleted
    ServiceAccount). Never retried."""


class Forbidden(ControllerError):
    """The caller's RBAC does not allow this in that tenant namespace (403): bind the
    `sandman-user` ClusterRole there (docs/sdk.md, "Before you start"). Never retried."""


class AuthUnavailable(ControllerError):
    """The controller could not ask the API server who the caller is or what it may do (503);
    it refuses rather than guesses. Retried by the SDK like NotLeader."""


class SandboxGone(SandmanError):
    """The sandbox does not exist any more: released (by this handle or by the controller),
    or deleted. Nothing sent to it can run."""


class SandboxPaused(SandboxGone):
    """The sandbox was paused (by a `pause()` whose answer this caller may not have kept,
    or by the controller's idle rule, --pause-idle-after): its state was checkpointed, then it
    was released (410), also when asked of a controller that restarted since.
    `handle` is the checkpoint's id: `client.resume(err.handle)` makes it anew with its
    state, until the checkpoint expires. A SandboxGone, so code that stops on one stops."""

    def __init__(self, message: str, *, handle: str, status: int | None = None,
                 type: str | None = None, events: list[str] | None = None) -> None:
        super().__init__(message, status=status, type=type, events=events)
        self.handle = handle


class ControllerUnreachable(SandmanError, ConnectionError):
    """No answer from the controller after the retries (transport errors)."""


class ConfigurationError(SandmanError, ValueError):
    """The client's own configuration cannot work: a controller URL that is not http(s)://host,
    a CA file that does not load, a controller certificate that does not verify against it, a
    bearer token about to go over plain http. Raised at construction or at the first call and
    never retried: no retry can fix it."""


# ---- execd (commands and files)

class ExecdError(SandmanError):
    """execd answered with an error this SDK has no narrower type for."""


class Unauthorized(ExecdError):
    """execd refused the bearer token (401). Never retried: a wrong token stays wrong."""


class SandboxBusy(ExecdError):
    """Another command is running in this sandbox's shell (409); commands run one at a time."""


class CommandTimeout(SandmanError, TimeoutError):
    """The command ran past its timeout and execd killed it (exit status 124, with execd's
    timeout error). `result` holds what it printed; the shell may have been restarted."""

    def __init__(self, message: str, result: ExecResult) -> None:
        super().__init__(message)
        self.result = result


class FileNotFound(ExecdError, FileNotFoundError):
    """The path does not exist in the sandbox (404 on a file route)."""


class WriteConflict(ExecdError):
    """`if_sha256` did not match the file's current content (409); `current_sha256` is what
    the file holds now (None: it does not exist). Nothing was written."""

    def __init__(self, message: str, *, current_sha256: str | None, status: int = 409) -> None:
        super().__init__(message, status=status)
        self.current_sha256 = current_sha256


class ProcessNotFound(ExecdError, LookupError):
    """No spawned process with that id in this sandbox (404 on a /processes route): a reset
    ended it, or the id is another sandbox's."""


class TooManyProcesses(ExecdError):
    """execd refused a spawn (429): 16 background processes are live, or 1024 were spawned
    since the last reset."""


class SessionNotFound(ExecdError, LookupError):
    """No interactive session with that id in this sandbox (404 on a /sessions route): it
    was closed, a reset ended it, or the id is another sandbox's."""


class TooManySessions(ExecdError):
    """execd refused a session (429): 8 are open."""


class SessionEnded(ExecdError):
    """The session's program is gone, so nothing reads what is written to it (409 on a
    write or resize), or it did not read a write within execd's 10 s."""


class ExpectTimeout(SandmanError, TimeoutError):
    """`Session.expect()` did not see its pattern in time; `output` is what was read."""

    def __init__(self, message: str, output: str) -> None:
        super().__init__(message)
        self.output = output


class ProcessTimeout(SandmanError, TimeoutError):
    """`Process.wait(timeout=...)` ran out with the process still running (nothing was
    killed); `process_status` is its last known state."""

    def __init__(self, message: str, process_status: ProcessStatus) -> None:
        super().__init__(message)
        self.process_status = process_status


class IntegrityError(SandmanError):
    """Bytes received or stored do not match their SHA-256 or length. The SDK fails closed:
    the data is never returned."""


class TreeError(SandmanError):
    """upload_tree / download_tree could not move the tree (a local file it cannot read or
    send, a disk error); base of the narrower tree errors. The target was left as it was."""


class UnsafeArchive(TreeError):
    """A tree's archive holds a member that could land outside the target or is refused: a
    `..` or absolute name, a symlink leading out or written through, a hard link to outside,
    a device, a FIFO, a setuid or setgid bit, or a truncated archive (execd's 422 on upload;
    the SDK's own check on download). Nothing was written."""


class TreeConflict(TreeError):
    """The target has a directory where the archive has a file or symlink, or a file or
    symlink where it has a directory (409); nothing was written."""


class TreeTooLarge(TreeError):
    """The tree's archive is over the cap (execd's --max-tree-bytes on upload, 413; the SDK's
    `max_bytes` on download); nothing was written."""


class SandboxUnreachable(SandmanError, ConnectionError):
    """No answer from execd after the retries (transport errors), and the controller did not
    say the sandbox is gone."""


class ProtocolError(SandmanError):
    """A server answered something this SDK cannot parse (missing field, not JSON)."""


# Every error type the controller sends (sandman/api.py), mapped; a test keeps it complete.
_CONTROLLER_TYPES: dict[str, type[SandmanError]] = {
    api.ACQUIRE_TIMEOUT.type: AcquireTimeout,
    api.QUEUE_FULL.type: QueueFull,
    api.BAD_REQUEST.type: BadRequest,
    api.BAD_OWNER.type: BadOwner,
    api.POD_FAILED.type: PodFailed,
    api.CONDITIONS_REFUSED.type: ConditionsRefused,
    api.NOT_LEADER.type: NotLeader,
    # /readyz only (a replica still syncing): retryable like NotLeader, on another replica.
    api.NOT_READY.type: NotLeader,
    api.SANDBOX_GONE.type: SandboxGone,
    api.UNAUTHENTICATED.type: Unauthenticated,
    api.FORBIDDEN.type: Forbidden,
    api.AUTH_UNAVAILABLE.type: AuthUnavailable,
    api.IMAGE_UNRESOLVED.type: ImageUnresolved,
    api.FORK_FAILED.type: ForkFailed,
    api.CHECKPOINT_FAILED.type: CheckpointFailed,
    api.CHECKPOINT_GONE.type: CheckpointGone,
    api.SANDBOX_PAUSED.type: SandboxPaused,
    # No narrower type: a fault to report, and an answer sent only to a caller that had left.
    api.INTERNAL_ERROR.type: ControllerError,
    api.CLIENT_CLOSED.type: ControllerError,
}

# Only for answers without the documented body (a proxy's error page, say).
_CONTROLLER_STATUS: dict[int, type[SandmanError]] = {
    e.status: _CONTROLLER_TYPES[e.type]
    for e in (api.BAD_REQUEST, api.INVALID_BODY, api.SANDBOX_GONE, api.QUEUE_FULL,
              api.POD_FAILED, api.NOT_LEADER, api.ACQUIRE_TIMEOUT, api.UNAUTHENTICATED,
              api.FORBIDDEN)
}


def controller_error(status: int, body: Any) -> SandmanError:
    """The typed error for a controller error answer. The `type` field decides; the status
    only when the body is not the documented shape (a proxy's HTML page, say)."""
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        typ = err.get("type") if isinstance(err.get("type"), str) else None
        msg = err.get("message") if isinstance(err.get("message"), str) else ""
        raw_events = err.get("events")
        events = [str(e) for e in raw_events] if isinstance(raw_events, list) else []
        cls = _CONTROLLER_TYPES.get(typ or "")
        if cls is None:
            cls = ControllerError
        if cls is SandboxPaused:
            handle = err.get("checkpoint")
            if not isinstance(handle, str) or not handle:
                return ProtocolError(f"controller answered {typ} without its checkpoint",
                                     status=status, type=typ)
            return SandboxPaused(msg or f"controller error {typ}", handle=handle,
                                 status=status, type=typ, events=events)
        return cls(msg or f"controller error {typ}", status=status, type=typ, events=events)
    cls = _CONTROLLER_STATUS.get(status, ControllerError)
    return cls(f"controller answered HTTP {status} without an error body", status=status)


# Routes whose 409 means another command holds the shell.
_BUSY_ROUTES = tuple(r.path for r in (X.EXEC, X.EXEC_STREAM, X.ENV, X.RESET, X.SESSION_OPEN))


def execd_error(status: int, body: Any, *, route: str) -> SandmanError:
    """The typed error for an execd error answer (`{"error": msg, "code": status, ...}`)."""
    msg = ""
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        msg = body["error"]
    msg = msg or f"execd answered HTTP {status}"
    msg = f"{route}: {msg}"
    if status == 401:
        return Unauthorized(msg, status=status)
    if route.startswith(X.TREE_READ.path):  # and its write
        tree = {409: TreeConflict, 413: TreeTooLarge, 422: UnsafeArchive}.get(status)
        if tree is not None:
            return tree(msg, status=status)
        if status == 400 and isinstance(body, dict) and "sha256" in body:
            return IntegrityError(msg, status=status)  # the archive's digest did not match
    if status == 404 and route.startswith(X.FILE_READ.path):  # /files...
        return FileNotFound(msg, status=status)
    if status == 409 and route == X.FILE_WRITE.path:
        cur = body.get("sha256") if isinstance(body, dict) else None
        return WriteConflict(msg, current_sha256=cur if isinstance(cur, str) else None)
    if route.startswith(X.PROCESSES.path):
        if status == 404:
            return ProcessNotFound(msg, status=status)
        if status == 429:
            return TooManyProcesses(msg, status=status)
    if route.startswith(X.SESSIONS.path):
        cls = {404: SessionNotFound, 409: SessionEnded, 429: TooManySessions}.get(status)
        if cls is not None and not (status == 409 and route == X.SESSION_OPEN.path):
            return cls(msg, status=status)
    if status == 409 and route in _BUSY_ROUTES:
        return SandboxBusy(msg, status=status)
    if status in (400, 413, 422):
        return BadRequest(msg, status=status)
    return ExecdError(msg, status=status)
