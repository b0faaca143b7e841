"""The trainers' client SDK: acquire a sandbox from the controller, run commands and file
operations in it through its execd, release it. docs/sdk.md has the guide.

    from sandman.client import Client

    with Client() as client:  # in a pod: $SANDMAN_URL, $SANDMAN_TOKEN_FILE, $SANDMAN_CA_FILE
        with client.acquire(image="swebench/astropy-12907", job="grpo-7") as sb:
            r = sb.exec("cd /testbed && git status --short", timeout=60)
            src = sb.read("/testbed/setup.py")

`AsyncClient` and `AsyncSandbox` are the asyncio twins, method for method.
"""

from sandman._version import __version__
from sandman.api import Checkpointed
from sandman.client._async.client import AsyncClient, AsyncSandboxGroup
from sandman.client._async.sandbox import AsyncProcess, AsyncSandbox, AsyncSession
from sandman.client._core import RetryPolicy
from sandman.client._sync.client import Client, SandboxGroup
from sandman.client._sync.sandbox import Process, Sandbox, Session
from sandman.client.editing import (
    EditAmbiguous,
    EditConflict,
    EditError,
    EditNoMatch,
    EditRefused,
    EditResult,
)
from sandman.client.errors import (
    AcquireTimeout,
    AuthUnavailable,
    BadOwner,
    BadRequest,
    CheckpointFailed,
    CheckpointGone,
    CommandTimeout,
    ConditionsRefused,
    ConfigurationError,
    ControllerError,
    ControllerUnreachable,
    ExecdError,
    ExpectTimeout,
    FileNotFound,
    Forbidden,
    ForkFailed,
    ImageChanged,
    ImageUnresolved,
    IntegrityError,
    NotLeader,
    PodFailed,
    ProcessNotFound,
    ProcessTimeout,
    ProtocolError,
    QueueFull,
    SandboxBusy,
    SandboxGone,
    SandboxPaused,
    SandboxUnreachable,
    SandmanError,
    SessionEnded,
    SessionNotFound,
    TooManyProcesses,
    TooManySessions,
    TreeConflict,
    TreeError,
    TreeTooLarge,
    Unauthenticated,
    Unauthorized,
    UnsafeArchive,
    WriteConflict,
)
from sandman.client.models import (
    AcquireTimings,
    ConditionReadings,
    Conditions,
    ConditionsCheck,
    ExecResult,
    FileContent,
    Health,
    Images,
    Lease,
    Owner,
    PoolStatus,
    ProcessInfo,
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

__all__ = [
    "AcquireTimeout", "AcquireTimings", "AsyncClient", "AuthUnavailable", "Forbidden",
    "Unauthenticated", "AsyncSandbox", "AsyncSandboxGroup", "BadOwner", "BadRequest", "CheckpointFailed",
    "CheckpointGone", "Checkpointed", "Client",
    "CommandTimeout", "ConditionReadings", "Conditions", "ConditionsCheck", "ConditionsRefused", "ConfigurationError",
    "ControllerError",
    "ControllerUnreachable", "EditAmbiguous", "EditConflict", "EditError", "EditNoMatch",
    "EditRefused", "EditResult", "ExecResult",
    "ExecdError", "FileContent", "FileNotFound", "ForkFailed", "Health", "ImageChanged", "ImageUnresolved", "Images", "IntegrityError", "Lease",
    "NotLeader", "Owner", "PodFailed", "PoolStatus", "ProcessInfo", "ProtocolError", "QueueFull",
    "ResetResult", "RetryPolicy", "Sandbox", "SandboxBusy", "SandboxGroup", "SandboxGone", "SandboxInfo",
    "SandboxPaused", "SandboxUnreachable", "SandmanError", "State", "Unauthorized", "WriteConflict",
    "WriteResult", "__version__",
    # sb.spawn(): background processes
    "AsyncProcess", "Process", "ProcessNotFound", "ProcessOutput", "ProcessStatus",
    "ProcessTimeout", "TooManyProcesses",
    # sb.session(): interactive sessions on a pty
    "AsyncSession", "ExpectTimeout", "Session", "SessionEnded", "SessionNotFound",
    "SessionOutput", "SessionStatus", "TooManySessions",
    # sb.upload_tree() / sb.download_tree(): whole trees as one tar
    "TreeConflict", "TreeError", "TreeResult", "TreeTooLarge", "UnsafeArchive",
]
