"""execd's HTTP API as it goes over the wire: route paths, request bodies, answer models, and
the limits both sides need. Nothing else outside execd spells them.

Read by the SDK (`sandman.client` sends these bodies and reads these answers), the controller
(`controller/execd_client.py`: readiness, conditions, token rotation and restore) and the load
tests. execd itself imports nothing (its source is stdlib only and runs on the task image's
Python >= 3.8): it keeps its own table, and tests/client/test_execd_api.py holds that table and
its limits equal to this module, so a route added to execd and not here (or the other way)
fails a test. Stdlib only and Python >= 3.9: the client distribution (`sandman-client`,
client/pyproject.toml) ships it beside sandman/api.py, whose `Route` it shares.

The request models are plain dataclasses; `to_json()` leaves out the fields left at None, so
a body carries only what its caller gave (execd applies its own defaults). Checks of the
caller's arguments stay with the caller (the SDK raises its own BadRequest); execd checks
every body again. Each answer's `from_json` checks the fields written here and raises
`AnswerError` (sandman/api.py) on a missing or mistyped one; the SDK's models
(sandman/client/models.py) are these, raising its ProtocolError instead.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, TypeVar

from sandman import contract
from sandman.api import AnswerError, Route, _answer, _opt, _req

# ---- routes (`kind` is what the SDK's on_request hook and locust report)

HEALTH = Route("HEALTH", "GET", "/health")  # the process answers (no token)
# Ready to serve: forks a process and writes a file in the pod within 2 s (no token: the
# kubelet's readiness probe, and the controller's check before a hand-out).
READY = Route("READY", "GET", contract.EXECD_READY_PATH)
EXEC = Route("EXEC", "POST", "/exec")
EXEC_STREAM = Route("EXEC_STREAM", "POST", "/exec/stream")  # NDJSON: output lines, then result
FILE_READ = Route("FILE_READ", "GET", "/files")  # ?path=: the bytes, X-Content-SHA256
FILE_READ_JSON = Route("FILE_READ_JSON", "POST", "/files/read")  # {"data_b64", "size", "sha256"}
FILE_WRITE = Route("FILE_WRITE", "POST", "/files/write")
TREE_READ = Route("TREE_READ", "GET", "/files/tree")  # ?path=: a tar, then its SHA-256 (hex)
TREE_WRITE = Route("TREE_WRITE", "POST", "/files/tree/write")  # ?path=: a tar (SHA-256 header)
ENV = Route("ENV", "POST", "/env")
RESET = Route("RESET", "POST", "/reset")
STATE = Route("STATE", "GET", "/state")
CONDITIONS = Route("CONDITIONS", "GET", "/conditions")  # ?egress_probe=host:port (optional)
# When the holder last used execd (the controller's idle rule); reading it is not use.
ACTIVITY = Route("ACTIVITY", "GET", "/activity")
# Checked reuse of grading pods (docs/execd.md): record, compare, put back; the controller
# rotates the token (TOKEN) and restores before a pod goes back to its warm pool.
BASELINE = Route("BASELINE", "POST", "/baseline")
DIFF = Route("DIFF", "GET", "/diff")
RESTORE = Route("RESTORE", "POST", "/restore")
TOKEN = Route("TOKEN", "POST", "/token")
PROCESSES = Route("PROCESSES", "GET", "/processes")
PROCESS_SPAWN = Route("PROCESS_SPAWN", "POST", "/processes/spawn")
PROCESS_INFO = Route("PROCESS_INFO", "GET", "/processes/info")  # ?id=
PROCESS_OUTPUT = Route("PROCESS_OUTPUT", "GET", "/processes/output")  # ?id=&since=
PROCESS_SIGNAL = Route("PROCESS_SIGNAL", "POST", "/processes/signal")
PROCESS_WAIT = Route("PROCESS_WAIT", "POST", "/processes/wait")
SESSIONS = Route("SESSIONS", "GET", "/sessions")
SESSION_OPEN = Route("SESSION_OPEN", "POST", "/sessions/open")
SESSION_WRITE = Route("SESSION_WRITE", "POST", "/sessions/write")
SESSION_READ = Route("SESSION_READ", "GET", "/sessions/read")  # ?id=&since=&timeout=
SESSION_RESIZE = Route("SESSION_RESIZE", "POST", "/sessions/resize")
SESSION_SIGNAL = Route("SESSION_SIGNAL", "POST", "/sessions/signal")
SESSION_CLOSE = Route("SESSION_CLOSE", "POST", "/sessions/close")
# Snapshots (docs/execd.md, "Snapshots"): the holder's changes against the image, as a tar
# (first member a JSON manifest) then its SHA-256 like TREE_READ; applied in a fresh pod of the
# same image (the tar, its SHA-256 in TREE_SHA256_HEADER, like TREE_WRITE).
SNAPSHOT = Route("SNAPSHOT", "GET", "/snapshot")
SNAPSHOT_APPLY = Route("SNAPSHOT_APPLY", "POST", "/snapshot/apply")
ROUTES = (HEALTH, READY, EXEC, EXEC_STREAM, FILE_READ, FILE_READ_JSON, FILE_WRITE, TREE_READ,
          TREE_WRITE, ENV, RESET, STATE, CONDITIONS, ACTIVITY, BASELINE, DIFF, RESTORE, TOKEN, PROCESSES,
          PROCESS_SPAWN, PROCESS_INFO, PROCESS_OUTPUT, PROCESS_SIGNAL, PROCESS_WAIT, SESSIONS,
          SESSION_OPEN, SESSION_WRITE, SESSION_READ, SESSION_RESIZE, SESSION_SIGNAL,
          SESSION_CLOSE, SNAPSHOT, SNAPSHOT_APPLY)
PUBLIC_ROUTES = (HEALTH, READY)  # answered without the bearer token


# ---- limits (execd's names; tests/client/test_execd_api.py keeps them equal to execd's)

DEFAULT_TIMEOUT_S = 300.0  # a command's timeout when the body gives none (DEFAULT_TIMEOUT)
DEFAULT_MAX_OUTPUT = 100 << 10  # bytes of a command's output kept when the body gives none
MAX_OUTPUT_LIMIT = 64 << 20  # the most max_output may ask for
# Trees (docs/execd.md, "Trees"): one tar up (its SHA-256 in TREE_SHA256_HEADER) or down (the
# tar, then TREE_DIGEST_LEN hex digits of its SHA-256).
TREE_SHA256_HEADER = "X-Content-SHA256"
CONTENT_SHA256_HEADER = TREE_SHA256_HEADER  # GET /files: the SHA-256 of the bytes sent
# Traces (docs/metrics.md): execd reads a W3C traceparent into its log lines and answers
# every non-streamed request with `Server-Timing: execd;dur=<ms>`, its own time on it.
TRACEPARENT_HEADER = "traceparent"
SERVER_TIMING_HEADER = "Server-Timing"
SERVER_TIMING_NAME = "execd"
TREE_DIGEST_LEN = 64
TREE_MAX_BYTES = 1 << 30  # a whole archive, either way (execd's --max-tree-bytes)
TREE_META_MAX = 1 << 20  # a pax or GNU long-name header, read whole
TREE_NAME_MAX = 4096  # bytes of a member's name (PATH_MAX) or a symlink's target
TREE_DEPTH_MAX = 256  # components of a member's name
TREE_MTIME_MAX = 1 << 34  # an mtime's bound, either sign
BG_COMMAND_MAX = 64 << 10  # bytes of a spawned command
FRESH_COMMAND_MAX = 96 << 10  # bytes of a fresh command (one argument of bash -c)
BG_WAIT_MAX = 30.0  # one /processes/wait answers within this; the SDK asks again
PTY_WRITE_MAX = 64 << 10  # bytes of one /sessions/write: longer data goes in several
PTY_READ_WAIT_MAX = 30.0  # one /sessions/read waits at most this; the SDK asks again
PTY_SIZE_MAX = 4096  # a session's columns and rows
PTY_ABANDON_MAX = 86400.0  # a session's abandon_after (seconds) at most
SNAPSHOT_MAX_BYTES = 1 << 30  # content bytes of one snapshot (execd's --max-snapshot-bytes)
SNAPSHOT_MAX_ENTRIES = 200_000  # members of one snapshot (files, dirs, links), either way
SNAPSHOT_MANIFEST_MAX = 64 << 20  # bytes of its first member, the manifest
SNAPSHOT_MEMBER_MAX = 12288  # a member's headers at most (header, pax name and link target)
# A whole snapshot archive at execd's default caps: what a relay of one must accept.
SNAPSHOT_ARCHIVE_MAX = (SNAPSHOT_MAX_BYTES + SNAPSHOT_MANIFEST_MAX
                        + (SNAPSHOT_MAX_ENTRIES + 2) * SNAPSHOT_MEMBER_MAX)


# ---- request bodies

class _Body:
    # Every subclass is a dataclass: what fields() needs to see.
    __dataclass_fields__: ClassVar[dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        """The body as sent: the fields not left at None."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}


@dataclass(frozen=True)
class ExecRequest(_Body):
    """`POST /exec`. One request_id covers every retry of a command: execd runs it at most
    once and answers a retry with the stored result."""

    command: str
    request_id: str | None = None
    timeout: float | None = None  # seconds (DEFAULT_TIMEOUT_S)
    idle_timeout: float | None = None  # the most seconds it may go without printing
    max_output: int | None = None  # bytes kept, head and tail (DEFAULT_MAX_OUTPUT)
    # A bash of its own instead of the shell: execd's start environment, `cwd` (absolute,
    # required), its whole process tree killed when it returns (docs/execd.md, "Fresh").
    fresh: bool | None = None
    cwd: str | None = None


@dataclass(frozen=True)
class StreamRequest(_Body):
    """`POST /exec/stream`: /exec's body without a request_id (a stream is never replayed).
    `kill_on_disconnect`: the caller hanging up kills the command (sent only when True)."""

    command: str
    timeout: float | None = None
    idle_timeout: float | None = None
    max_output: int | None = None
    kill_on_disconnect: bool | None = None


@dataclass(frozen=True)
class WriteRequest(_Body):
    """`POST /files/write`: the file replaced atomically; `if_sha256`: only if its current
    content has that SHA-256 (409 otherwise)."""

    path: str
    data_b64: str
    mode: int | str | None = None
    if_sha256: str | None = None


@dataclass(frozen=True)
class ReadRequest(_Body):
    """`POST /files/read` (and `GET /files?path=` as a query)."""

    path: str


@dataclass(frozen=True)
class EnvRequest(_Body):
    """`POST /env`: export `set`, unset `unset`, in the shell and in shells started later."""

    set: dict[str, str] | None = None
    unset: list[str] | None = None


@dataclass(frozen=True)
class ResetRequest(_Body):
    """`POST /reset`: every process killed, a fresh shell; `workspace`: the workspace emptied."""

    workspace: bool = False


@dataclass(frozen=True)
class TokenRequest(_Body):
    """`POST /token` (authenticated with the current token): the next token's SHA-256."""

    token_sha256: str


@dataclass(frozen=True)
class Empty(_Body):
    """`POST /baseline`, `POST /restore`: an empty object."""


@dataclass(frozen=True)
class SpawnRequest(_Body):
    """`POST /processes/spawn`: `command` (bash -c) beside the shell."""

    command: str
    request_id: str
    cwd: str | None = None
    env: dict[str, str] | None = None


@dataclass(frozen=True)
class SessionOpenRequest(_Body):
    """`POST /sessions/open`: `command` (bash -c) on its own pty of cols x rows;
    `abandon_after`: execd closes it once no call has named it for that many seconds."""

    command: str
    request_id: str
    cwd: str | None = None
    env: dict[str, str] | None = None
    cols: int | None = None
    rows: int | None = None
    abandon_after: float | None = None


@dataclass(frozen=True)
class SessionCloseRequest(_Body):
    """`POST /sessions/close`: the session's `id`, or `open_request_id`, the request_id of the
    open that started it (closes it if it opened, and refuses that open from then on)."""

    id: str | None = None
    open_request_id: str | None = None


@dataclass(frozen=True)
class SignalRequest(_Body):
    """`POST /processes/signal` and `POST /sessions/signal` (which takes a request_id)."""

    id: str
    signal: int | str
    request_id: str | None = None


@dataclass(frozen=True)
class WaitRequest(_Body):
    """`POST /processes/wait`: answers once it ended or after `timeout` (<= BG_WAIT_MAX)."""

    id: str
    timeout: float


@dataclass(frozen=True)
class SessionWriteRequest(_Body):
    """`POST /sessions/write`: at most PTY_WRITE_MAX bytes typed into the terminal."""

    id: str
    data_b64: str
    request_id: str


@dataclass(frozen=True)
class ResizeRequest(_Body):
    """`POST /sessions/resize`."""

    id: str
    cols: int
    rows: int


# Query strings of the GET routes: each name once.
PATH_PARAM = "path"  # FILE_READ, TREE_READ, TREE_WRITE
ID_PARAM = "id"  # PROCESS_INFO, PROCESS_OUTPUT, SESSION_READ
SINCE_PARAM = "since"  # PROCESS_OUTPUT, SESSION_READ: a byte offset
TIMEOUT_PARAM = "timeout"  # SESSION_READ: seconds, as a decimal
EGRESS_PROBE_PARAM = "egress_probe"  # CONDITIONS: host:port


# ---- answers

_NUM = (int, float)
# Each reader builds `cls`: a subclass (the SDK's model, raising its own error) reads itself.
_ExecResultT = TypeVar("_ExecResultT", bound="ExecResult")
_WriteResultT = TypeVar("_WriteResultT", bound="WriteResult")
_TreeResultT = TypeVar("_TreeResultT", bound="TreeResult")
_SnapshotAppliedT = TypeVar("_SnapshotAppliedT", bound="SnapshotApplied")
_HealthT = TypeVar("_HealthT", bound="Health")
_ResetResultT = TypeVar("_ResetResultT", bound="ResetResult")
_StateT = TypeVar("_StateT", bound="State")
_ConditionReadingsT = TypeVar("_ConditionReadingsT", bound="ConditionReadings")
_ProcessStatusT = TypeVar("_ProcessStatusT", bound="ProcessStatus")
_ProcessOutputT = TypeVar("_ProcessOutputT", bound="ProcessOutput")
_SessionStatusT = TypeVar("_SessionStatusT", bound="SessionStatus")
_SessionOutputT = TypeVar("_SessionOutputT", bound="SessionOutput")


@dataclass(frozen=True)
class ExecResult:
    """One command's outcome. `output` is stdout and stderr interleaved, at most `max_output`
    bytes (head and tail kept; `truncated` says so). `error` is execd's note (a timeout, a
    refused command, a restarted shell), None when the command simply ran."""

    exit_code: int
    output: str
    truncated: bool
    duration_ms: float
    error: str | None
    request_id: str
    timed_out: bool = False  # execd killed the command at its timeout (exit_code 124)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.error is None

    @classmethod
    def from_json(cls: type[_ExecResultT], data: Any, request_id: str) -> _ExecResultT:
        what = "exec answer"
        d = _answer(data, what)
        exit_code = _req(d, "exit_code", int, what)
        error = _opt(d, "error", str, what)
        flag = d.get("timed_out")
        if isinstance(flag, bool):
            timed_out = flag
        else:
            # execd reports its own timeout as exit 124 *and* an error that starts with
            # "timeout"; a command that exits 124 by itself has no such error.
            timed_out = exit_code == 124 and (error or "").startswith("timeout")
        return cls(exit_code=exit_code, output=_req(d, "output", str, what),
                   truncated=bool(_opt(d, "truncated", bool, what, False)),
                   duration_ms=float(_opt(d, "duration_ms", _NUM, what, 0.0)),
                   error=error, request_id=request_id, timed_out=timed_out)


@dataclass(frozen=True)
class FileContent:
    """A whole file, byte-exact: `sha256` was checked against `data` before this existed."""

    path: str
    data: bytes = field(repr=False)
    sha256: str

    @property
    def size(self) -> int:
        return len(self.data)


@dataclass(frozen=True)
class WriteResult:
    path: str
    size: int
    sha256: str

    @classmethod
    def from_json(cls: type[_WriteResultT], data: Any, path: str) -> _WriteResultT:
        what = "write answer"
        d = _answer(data, what)
        return cls(path=_opt(d, "path", str, what, path),
                   size=_req(d, "size", int, what), sha256=_req(d, "sha256", str, what))


@dataclass(frozen=True)
class TreeResult:
    """A tree moved by upload_tree / download_tree: what the archive held and its SHA-256
    (checked by the receiver). `path`: the target directory (execd's real path on upload)."""

    path: str
    files: int
    dirs: int
    symlinks: int
    hardlinks: int
    bytes: int  # the archive's size
    sha256: str

    @classmethod
    def from_json(cls: type[_TreeResultT], data: Any, path: str) -> _TreeResultT:
        what = "tree answer"
        d = _answer(data, what)
        return cls(path=_opt(d, "path", str, what, path),
                   files=_req(d, "files", int, what),
                   dirs=_req(d, "dirs", int, what), symlinks=_req(d, "symlinks", int, what),
                   hardlinks=_req(d, "hardlinks", int, what), bytes=_req(d, "bytes", int, what),
                   sha256=_req(d, "sha256", str, what))


@dataclass(frozen=True)
class SnapshotApplied:
    """`POST /snapshot/apply`: the snapshot is in place. `files`: entries written (files,
    dirs, symlinks, hard links); `deleted`: image paths removed; `bytes`: the archive's size;
    `cwd`: the shell's working directory now (the snapshot's)."""

    files: int
    deleted: int
    bytes: int
    cwd: str
    sha256: str | None = None
    env: int | None = None  # exported variables set from the snapshot

    @classmethod
    def from_json(cls: type[_SnapshotAppliedT], data: Any) -> _SnapshotAppliedT:
        what = "snapshot apply answer"
        d = _answer(data, what)
        return cls(files=_req(d, "files", int, what), deleted=_req(d, "deleted", int, what),
                   bytes=_req(d, "bytes", int, what), cwd=_req(d, "cwd", str, what),
                   sha256=_opt(d, "sha256", str, what), env=_opt(d, "env", int, what))


@dataclass(frozen=True)
class Health:
    """`GET /health` and `GET /ready` (503 when not ready): `ok` only when it says true."""

    ok: bool
    version: str | None

    @classmethod
    def from_json(cls: type[_HealthT], data: Any) -> _HealthT:
        d = _answer(data, "health answer")
        return cls(ok=d.get("ok") is True,
                   version=_opt(d, "version", str, "health answer"))


@dataclass(frozen=True)
class Activity:
    """`GET /activity`: `busy` requests of the holder in flight; `idle_s` seconds since the
    last one ended (0 while one runs)."""

    idle_s: float
    busy: int

    @classmethod
    def from_json(cls, data: Any) -> Activity:
        what = "activity answer"
        d = _answer(data, what)
        idle, busy = d.get("idle_s"), _req(d, "busy", int, what)
        if isinstance(idle, bool) or not isinstance(idle, (int, float)) or idle < 0 or busy < 0:
            raise AnswerError(f"{what}: idle_s and busy must be non-negative numbers")
        return cls(idle_s=float(idle), busy=busy)


@dataclass(frozen=True)
class ResetResult:
    """`ok`: every process of the sandbox but the new shell is gone; `left` lists the pids
    that would not die."""

    ok: bool
    left: list[int]
    shell_pid: int | None
    workspace_wiped: int | None
    duration_ms: float
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls: type[_ResetResultT], data: Any) -> _ResetResultT:
        what = "reset answer"
        d = _answer(data, what)
        return cls(ok=_req(d, "ok", bool, what),
                   left=list(_opt(d, "left", list, what, [])),
                   shell_pid=_opt(d, "shell_pid", int, what),
                   workspace_wiped=_opt(d, "workspace_wiped", int, what),
                   duration_ms=float(_opt(d, "duration_ms", _NUM, what, 0.0)), raw=d)


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    ppid: int | None
    state: str | None
    cmd: str | None
    shell: bool


@dataclass(frozen=True)
class State:
    """execd's view of the sandbox: its shell, its cwd, whether a command runs, and every
    process it can see."""

    version: str | None
    pid: int | None
    shell_pid: int | None
    cwd: str | None
    busy: bool
    processes: list[ProcessInfo]
    guard: dict[str, Any] | None
    uptime_s: float | None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls: type[_StateT], data: Any) -> _StateT:
        what = "state answer"
        d = _answer(data, what)
        procs = []
        for p in _opt(d, "processes", list, what, []):
            if isinstance(p, dict) and isinstance(p.get("pid"), int):
                procs.append(ProcessInfo(pid=p["pid"], ppid=p.get("ppid"), state=p.get("state"),
                                         cmd=p.get("cmd"), shell=p.get("shell") is True))
        return cls(version=_opt(d, "version", str, what),
                   pid=_opt(d, "pid", int, what),
                   shell_pid=_opt(d, "shell_pid", int, what), cwd=_opt(d, "cwd", str, what),
                   busy=bool(_opt(d, "busy", bool, what, False)), processes=procs,
                   guard=_opt(d, "guard", dict, what),
                   uptime_s=_opt(d, "uptime_s", _NUM, what), raw=d)


def _strings(d: dict[str, Any], key: str, what: str) -> list[str] | None:
    v = _opt(d, key, list, what)
    if v is not None and not all(isinstance(x, str) for x in v):
        raise AnswerError(f"{what}: {key} must be a list of strings")
    return v if v is None else list(v)


@dataclass(frozen=True)
class ConditionReadings:
    """The run conditions a verdict may depend on, as the sandbox itself reads them (cgroup
    CPU quota and memory limit, visible CPUs, user, time zone, hash seed), and an optional
    outbound-connection probe. None means execd could not read that condition."""

    cpu_quota_us: int | None
    cpu_period_us: int | None
    cpu_unlimited: bool | None
    visible_cpus: list[int] | None
    visible_cpu_count: int | None
    memory_limit_bytes: int | None
    memory_unlimited: bool | None
    uid: int | None
    gid: int | None
    user: str | None
    tz_env: str | None
    localtime: str | None
    pythonhashseed: str | None
    hostname: str | None
    egress: dict[str, Any] | None
    cpu_cores: float | None = None  # effective quota in cores (the smallest up the cgroup tree)
    cpuset_cpus: list[int] | None = None
    tz: str | None = None  # the zone programs use: TZ, else /etc/localtime
    netguard_mode: str | None = None  # "deny" | "allow" from a successful netguard status
    # The egress allowlist that status records as applied (as netguard wrote it).
    netguard_allow_egress: list[str] | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def cpus(self) -> float | None:
        """The CPU limit in cores (quota / period), None when unlimited or unknown."""
        if self.cpu_cores is not None:
            return self.cpu_cores
        if self.cpu_quota_us is None or not self.cpu_period_us:
            return None
        return self.cpu_quota_us / self.cpu_period_us

    @classmethod
    def from_json(cls: type[_ConditionReadingsT], data: Any) -> _ConditionReadingsT:
        what = "conditions answer"
        d = _answer(data, what)
        return cls(
            cpu_quota_us=_opt(d, "cpu_quota_us", int, what),
            cpu_period_us=_opt(d, "cpu_period_us", int, what),
            cpu_unlimited=_opt(d, "cpu_unlimited", bool, what),
            visible_cpus=_opt(d, "visible_cpus", list, what),
            visible_cpu_count=_opt(d, "visible_cpu_count", int, what),
            memory_limit_bytes=_opt(d, "memory_limit_bytes", int, what),
            memory_unlimited=_opt(d, "memory_unlimited", bool, what),
            uid=_opt(d, "uid", int, what), gid=_opt(d, "gid", int, what),
            user=_opt(d, "user", str, what), tz_env=_opt(d, "tz_env", str, what),
            localtime=_opt(d, "localtime", str, what),
            pythonhashseed=_opt(d, "pythonhashseed", str, what),
            hostname=_opt(d, "hostname", str, what), egress=_opt(d, "egress", dict, what),
            cpu_cores=_opt(d, "cpu_cores", _NUM, what),
            cpuset_cpus=_opt(d, "cpuset_cpus", list, what), tz=_opt(d, "tz", str, what),
            netguard_mode=_opt(d, "netguard_mode", str, what),
            netguard_allow_egress=_strings(d, "netguard_allow_egress", what), raw=d)


@dataclass(frozen=True)
class ProcessStatus:
    """A spawned process as execd knows it. `exit_code` is None while `running`; a process
    killed by a signal has `signal` set and exit_code 128 + signal. `output_bytes`: all it has
    printed so far (the offset its next byte will have); `output_open`: something (it or a
    child) still holds its output pipe."""

    id: str
    pid: int
    command: str
    cwd: str
    running: bool
    exit_code: int | None
    signal: int | None
    started_at: float  # Unix time
    output_bytes: int
    output_open: bool
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls: type[_ProcessStatusT], data: Any) -> _ProcessStatusT:
        what = "process answer"
        d = _answer(data, what)
        return cls(id=_req(d, "id", str, what), pid=_req(d, "pid", int, what),
                   command=_req(d, "command", str, what), cwd=_opt(d, "cwd", str, what, ""),
                   running=_req(d, "running", bool, what),
                   exit_code=_opt(d, "exit_code", int, what),
                   signal=_opt(d, "signal", int, what),
                   started_at=float(_opt(d, "started_at", _NUM, what, 0.0)),
                   output_bytes=_req(d, "output_bytes", int, what),
                   output_open=bool(_opt(d, "output_open", bool, what, False)), raw=d)


@dataclass(frozen=True)
class ProcessOutput:
    """Output bytes `data` = the process's stdout and stderr (interleaved) from byte offset
    `start` to `end`. execd keeps the newest 1 MiB of each process: when the bytes asked for
    (`since`) are older, `start` is where the kept bytes begin and `dropped` = start - since
    counts the bytes lost in between; never a silently shifted offset. Read on with
    `output(since=end)`."""

    data: bytes = field(repr=False)
    start: int
    end: int
    dropped: int
    running: bool
    exit_code: int | None
    output_open: bool

    @property
    def text(self) -> str:
        """`data` decoded as UTF-8 (invalid bytes replaced; a character cut at `start` or
        `end` shows as a replacement character)."""
        return self.data.decode("utf-8", "replace")

    @classmethod
    def from_json(cls: type[_ProcessOutputT], data: Any) -> _ProcessOutputT:
        what = "process output answer"
        d = _answer(data, what)
        try:
            raw = base64.b64decode(_req(d, "data_b64", str, what), validate=True)
        except (binascii.Error, ValueError) as e:
            if isinstance(e, AnswerError):
                raise
            raise AnswerError(f"{what}: data_b64 is not base64") from None
        start, end = _req(d, "start", int, what), _req(d, "end", int, what)
        if end - start != len(raw):
            raise AnswerError(f"{what}: {len(raw)} bytes for offsets {start}..{end}")
        return cls(data=raw, start=start, end=end,
                   dropped=_req(d, "dropped", int, what),
                   running=_req(d, "running", bool, what),
                   exit_code=_opt(d, "exit_code", int, what),
                   output_open=bool(_opt(d, "output_open", bool, what, False)))


@dataclass(frozen=True)
class SessionStatus:
    """An interactive session as execd knows it: a program on its own pty. `exit_code` is
    None while `running`; `output_bytes` is the offset its next output byte will have;
    `output_open`: something still holds the terminal (it reads and writes until then)."""

    id: str
    pid: int
    command: str
    cwd: str
    cols: int
    rows: int
    running: bool
    exit_code: int | None
    signal: int | None
    started_at: float  # Unix time
    output_bytes: int
    output_open: bool
    abandon_after: float | None = None  # seconds without a call, then execd closes it
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls: type[_SessionStatusT], data: Any) -> _SessionStatusT:
        what = "session answer"
        d = _answer(data, what)
        return cls(id=_req(d, "id", str, what), pid=_req(d, "pid", int, what),
                   command=_req(d, "command", str, what), cwd=_opt(d, "cwd", str, what, ""),
                   cols=_req(d, "cols", int, what), rows=_req(d, "rows", int, what),
                   running=_req(d, "running", bool, what),
                   exit_code=_opt(d, "exit_code", int, what),
                   signal=_opt(d, "signal", int, what),
                   started_at=float(_opt(d, "started_at", _NUM, what, 0.0)),
                   output_bytes=_req(d, "output_bytes", int, what),
                   output_open=bool(_opt(d, "output_open", bool, what, False)),
                   abandon_after=_opt(d, "abandon_after", _NUM, what), raw=d)


@dataclass(frozen=True)
class SessionOutput:
    """What a session's terminal printed from byte offset `start` to `end` (`data`, as the
    terminal wrote it: \\r\\n line ends, echoed input). execd keeps the newest 256 KiB: when
    the bytes asked for are older, `start` is where the kept bytes begin and `dropped` counts
    the bytes lost. Read on with `read(since=end)`."""

    data: bytes = field(repr=False)
    start: int
    end: int
    dropped: int
    running: bool
    exit_code: int | None
    output_open: bool

    @property
    def text(self) -> str:
        """`data` decoded as UTF-8 (invalid bytes replaced)."""
        return self.data.decode("utf-8", "replace")

    @classmethod
    def from_json(cls: type[_SessionOutputT], data: Any) -> _SessionOutputT:
        o = ProcessOutput.from_json(data)
        return cls(data=o.data, start=o.start, end=o.end,
                   dropped=o.dropped, running=o.running, exit_code=o.exit_code,
                   output_open=o.output_open)


@dataclass(frozen=True)
class Restored:
    """`POST /restore`: `restored` only when it says true; `left` is what it could not put
    back (execd's form, shown as is)."""

    restored: bool
    left: Any = None

    @classmethod
    def from_json(cls, data: Any) -> Restored:
        d = _answer(data, "restore answer")
        return cls(restored=d.get("restored") is True, left=d.get("left"))


@dataclass(frozen=True)
class Diff:
    """`GET /diff`: `clean` only when it says true; `changes` as execd lists them."""

    clean: bool
    changes: Any = None

    @classmethod
    def from_json(cls, data: Any) -> Diff:
        d = _answer(data, "diff answer")
        return cls(clean=d.get("clean") is True, changes=d.get("changes"))
