"""Typed answers. The controller's are the wire's (`sandman/api.py`): one definition of each,
read by its own `from_json`; the SDK's subclasses add only `raw`, the whole answer (the token
left out), so a newer server's extra fields are not lost. execd's answers are execd's wire
(`sandman/execd_api.py`): the SDK's subclasses read them the same, raising ProtocolError."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from sandman import api, execd_api
from sandman.client.errors import ProtocolError

# The SDK's names of the wire's models it adds nothing to.
Owner = api.Owner  # the trainer's pod, owner of the sandbox: a request model
AcquireTimings = api.Timings
ConditionsCheck = api.ConditionsCheck


# ---- the controller

@contextlib.contextmanager
def _wire_answer() -> Iterator[None]:
    try:
        yield
    except api.AnswerError as e:
        raise ProtocolError(str(e)) from None


def _raw(data: Any) -> dict[str, Any]:
    return {k: v for k, v in data.items() if k != "token"} if isinstance(data, dict) else {}


@dataclass(frozen=True)
class Lease(api.Lease):
    """The controller's answer to an acquire. Holds the token: never printed (repr=False)."""

    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, data: Any) -> Lease:  # type: ignore[override]
        with _wire_answer():
            return super().from_json(data, raw=_raw(data))


@dataclass(frozen=True)
class SandboxInfo(api.SandboxView):
    """`client.get(id)` / `client.list()`: what the controller knows of a sandbox (no token)."""

    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, data: Any) -> SandboxInfo:  # type: ignore[override]
        with _wire_answer():
            return super().from_json(data, raw=_raw(data))


@dataclass(frozen=True)
class PoolStatus(api.PoolStatus):
    """`client.prewarm()`: the warm pool of one (image, size) after the call."""

    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, data: Any) -> PoolStatus:  # type: ignore[override]
        with _wire_answer():
            return super().from_json(data, raw=_raw(data))


@dataclass(frozen=True)
class Stats(api.Stats):
    """`client.stats()`: the controller's pacer and warm pools at the time of the call."""

    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, data: Any) -> Stats:  # type: ignore[override]
        with _wire_answer():
            return super().from_json(data, raw=_raw(data))


@dataclass(frozen=True)
class Images(api.Images):
    """`client.prepull()` and `client.images()`: each pre-pulled image's nodes by outcome."""

    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, data: Any) -> Images:  # type: ignore[override]
        with _wire_answer():
            return super().from_json(data, raw=_raw(data))


# ---- execd: the wire's models (sandman/execd_api.py), read with the SDK's error

FileContent = execd_api.FileContent  # built by the SDK from a checked read, never parsed
ProcessInfo = execd_api.ProcessInfo  # an item of State.processes


@dataclass(frozen=True)
class ExecResult(execd_api.ExecResult):
    __doc__ = execd_api.ExecResult.__doc__

    @classmethod
    def from_json(cls, data: Any, request_id: str) -> ExecResult:
        with _wire_answer():
            return super().from_json(data, request_id)


@dataclass(frozen=True)
class WriteResult(execd_api.WriteResult):
    __doc__ = execd_api.WriteResult.__doc__

    @classmethod
    def from_json(cls, data: Any, path: str) -> WriteResult:
        with _wire_answer():
            return super().from_json(data, path)


@dataclass(frozen=True)
class TreeResult(execd_api.TreeResult):
    __doc__ = execd_api.TreeResult.__doc__

    @classmethod
    def from_json(cls, data: Any, path: str) -> TreeResult:
        with _wire_answer():
            return super().from_json(data, path)


@dataclass(frozen=True)
class Health(execd_api.Health):
    __doc__ = execd_api.Health.__doc__

    @classmethod
    def from_json(cls, data: Any) -> Health:
        with _wire_answer():
            return super().from_json(data)


@dataclass(frozen=True)
class ResetResult(execd_api.ResetResult):
    __doc__ = execd_api.ResetResult.__doc__

    @classmethod
    def from_json(cls, data: Any) -> ResetResult:
        with _wire_answer():
            return super().from_json(data)


@dataclass(frozen=True)
class State(execd_api.State):
    __doc__ = execd_api.State.__doc__

    @classmethod
    def from_json(cls, data: Any) -> State:
        with _wire_answer():
            return super().from_json(data)


@dataclass(frozen=True)
class ConditionReadings(execd_api.ConditionReadings):
    __doc__ = execd_api.ConditionReadings.__doc__

    @classmethod
    def from_json(cls, data: Any) -> ConditionReadings:
        with _wire_answer():
            return super().from_json(data)


# The name before readings and declarations were told apart (api.Conditions is what an acquire
# declares); kept for existing callers.
Conditions = ConditionReadings


@dataclass(frozen=True)
class ProcessStatus(execd_api.ProcessStatus):
    __doc__ = execd_api.ProcessStatus.__doc__

    @classmethod
    def from_json(cls, data: Any) -> ProcessStatus:
        with _wire_answer():
            return super().from_json(data)


@dataclass(frozen=True)
class ProcessOutput(execd_api.ProcessOutput):
    __doc__ = execd_api.ProcessOutput.__doc__

    @classmethod
    def from_json(cls, data: Any) -> ProcessOutput:
        with _wire_answer():
            return super().from_json(data)


@dataclass(frozen=True)
class SessionStatus(execd_api.SessionStatus):
    __doc__ = execd_api.SessionStatus.__doc__

    @classmethod
    def from_json(cls, data: Any) -> SessionStatus:
        with _wire_answer():
            return super().from_json(data)


@dataclass(frozen=True)
class SessionOutput(execd_api.SessionOutput):
    __doc__ = execd_api.SessionOutput.__doc__

    @classmethod
    def from_json(cls, data: Any) -> SessionOutput:
        with _wire_answer():
            return super().from_json(data)
