"""The acquire path's typed errors. `status` is the HTTP answer, `kind` the error type name the
API sends (`{"error": {"type": kind, ...}}`) and the SDK maps to its own exception."""

from __future__ import annotations


class AcquireError(Exception):
    status = 500
    kind = "InternalError"

    def __init__(self, message: str, events: list[str] | None = None):
        super().__init__(message)
        self.events = events or []


class FirstAttemptLeft(AcquireError):
    """Raised to retries waiting on an attempt whose caller disconnected: they start anew."""


class AcquireTimeout(AcquireError):
    status, kind = 504, "AcquireTimeout"


class QueueFullError(AcquireError):
    status, kind = 429, "QueueFull"


class BadRequest(AcquireError):
    status, kind = 400, "BadRequest"


class PodFailed(AcquireError):
    status, kind = 502, "PodFailed"


class NotLeader(AcquireError):
    status, kind = 503, "NotLeader"
