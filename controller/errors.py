"""The acquire path's typed errors. `status` is the HTTP answer, `kind` the error type name the
API sends (`{"error": {"type": kind, ...}}`) and the SDK maps to its own exception; both come
from the wire contract, sandman/api.py."""

from __future__ import annotations

from sandman import api


class AcquireError(Exception):
    status, kind = api.INTERNAL_ERROR

    def __init__(self, message: str, events: list[str] | None = None):
        super().__init__(message)
        self.events = events or []


class FirstAttemptLeft(AcquireError):
    """Raised to retries waiting on an attempt whose caller disconnected: they start anew."""


class AcquireTimeout(AcquireError):
    status, kind = api.ACQUIRE_TIMEOUT


class QueueFullError(AcquireError):
    status, kind = api.QUEUE_FULL


class BadRequest(AcquireError):
    status, kind = api.BAD_REQUEST


class BadOwner(BadRequest):
    """owner= names no pod of the sandbox namespace (an ownerReference cannot cross one)."""

    status, kind = api.BAD_OWNER


class PodFailed(AcquireError):
    status, kind = api.POD_FAILED


class ConditionsRefused(PodFailed):
    """Every pod tried contradicted a declared run condition (each was deleted)."""

    status, kind = api.CONDITIONS_REFUSED


class SandboxGone(AcquireError):
    """The sandbox named is not handed out (released, drained, expired, or never was)."""

    status, kind = api.SANDBOX_GONE


class ForkFailed(AcquireError):
    """The parent's state did not reach every child of a fork (controller/fork.py)."""

    status, kind = api.FORK_FAILED


class ImageUnresolved(AcquireError):
    """A tag the registry did not resolve to a digest: no pod by tag (controller/images.py)."""

    status, kind = api.IMAGE_UNRESOLVED


class NotLeader(AcquireError):
    status, kind = api.NOT_LEADER


class Unauthenticated(AcquireError):
    """No token, or one the API server's TokenReview refused (controller/auth.py)."""

    status, kind = api.UNAUTHENTICATED


class Forbidden(AcquireError):
    """The caller's RBAC does not allow the verb in that tenant (SubjectAccessReview)."""

    status, kind = api.FORBIDDEN


class AuthUnavailable(AcquireError):
    """The API server did not answer the review: refused, never admitted (fail closed)."""

    status, kind = api.AUTH_UNAVAILABLE


class CheckpointFailed(AcquireError):
    """A checkpoint or a restore that did not complete; nothing of it is left
    (controller/checkpoint.py)."""

    status, kind = api.CHECKPOINT_FAILED


class CheckpointGone(AcquireError):
    """No such checkpoint in that tenant, or past its TTL."""

    status, kind = api.CHECKPOINT_GONE


class SandboxPaused(AcquireError):
    """The sandbox was paused (its holder's pause, or the idle rule): `checkpoint` is the id
    to resume it from (controller/paused.py). Sent only to callers of its tenant."""

    status, kind = api.SANDBOX_PAUSED

    def __init__(self, message: str, checkpoint: str):
        super().__init__(message)
        self.checkpoint = checkpoint
