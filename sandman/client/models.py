"""Typed answers. The controller's are the wire's (`sandman/api.py`): one definition of each,
read by its own `from_json`; the SDK's subclasses add only `raw`, the whole answer (the token
left out), so a newer server's extra fields are not lost. execd's answers are defined here;
each `from_json` checks the fields the SDK relies on and keeps the rest in `raw` where it can."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from sandman import api
from sandman.client.errors import ProtocolError

# The SDK's names of the wire's models it adds nothing to.
Owner = api.Owner  # the trainer's pod, owner of the sandbox: a request model
AcquireTimings = api.Timings
ConditionsCheck = api.ConditionsCheck


def _obj(data: Any, what: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ProtocolError(f"{what}: expected a JSON object, got {type(data).__name__}")
    return data


def _req(data: dict[str, Any], key: str, types: type | tuple[type, ...], what: str) -> Any:
    if key not in data:
        raise ProtocolError(f"{what}: the answer has no {key!r}")
    v = data[key]
    if not isinstance(v, types) or (isinstance(v, bool) and bool not in _tuple(types)):
        raise ProtocolError(f"{what}: {key!r} has type {type(v).__name__}")
    return v


def _opt(data: dict[str, Any], key: str, types: type | tuple[type, ...], what: str,
         default: Any = None) -> Any:
    if data.get(key) is None:
        return default
    return _req(data, key, types, what)


def _tuple(t: type | tuple[type, ...]) -> tuple[type, ...]:
    return t if isinstance(t, tuple) else (t,)


_NUM = (int, float)


# ---- the controller

@contextlib.contextmanager
def _controller_answer() -> Iterator[None]:
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
        with _controller_answer():
            return super().from_json(data, raw=_raw(data))


@dataclass(frozen=True)
class SandboxInfo(api.SandboxView):
    """`client.get(id)` / `client.list()`: what the controller knows of a sandbox (no token)."""

    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, data: Any) -> SandboxInfo:  # type: ignore[override]
        with _controller_answer():
            return super().from_json(data, raw=_raw(data))


@dataclass(frozen=True)
class PoolStatus(api.PoolStatus):
    """`client.prewarm()`: the warm pool of one (image, size) after the call."""

    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, data: Any) -> PoolStatus:  # type: ignore[override]
        with _controller_answer():
            return super().from_json(data, raw=_raw(data))


@dataclass(frozen=True)
class Stats(api.Stats):
    """`client.stats()`: the controller's pacer and warm pools at the time of the call."""

    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, data: Any) -> Stats:  # type: ignore[override]
        with _controller_answer():
            return super().from_json(data, raw=_raw(data))


@dataclass(frozen=True)
class Images(api.Images):
    """`client.prepull()` and `client.images()`: each pre-pulled image's nodes by outcome."""

    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, data: Any) -> Images:  # type: ignore[override]
        with _controller_answer():
            return super().from_json(data, raw=_raw(data))


# ---- execd

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
    def from_json(cls, data: Any, request_id: str) -> ExecResult:
        what = "exec answer"
        d = _obj(data, what)
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
    def from_json(cls, data: Any, path: str) -> WriteResult:
        what = "write answer"
        d = _obj(data, what)
        return cls(path=_opt(d, "path", str, what, path), size=_req(d, "size", int, what),
                   sha256=_req(d, "sha256", str, what))


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
    def from_json(cls, data: Any, path: str) -> TreeResult:
        what = "tree answer"
        d = _obj(data, what)
        return cls(path=_opt(d, "path", str, what, path), files=_req(d, "files", int, what),
                   dirs=_req(d, "dirs", int, what), symlinks=_req(d, "symlinks", int, what),
                   hardlinks=_req(d, "hardlinks", int, what), bytes=_req(d, "bytes", int, what),
                   sha256=_req(d, "sha256", str, what))


@dataclass(frozen=True)
class Health:
    ok: bool
    version: str | None

    @classmethod
    def from_json(cls, data: Any) -> Health:
        d = _obj(data, "health answer")
        return cls(ok=d.get("ok") is True, version=_opt(d, "version", str, "health answer"))


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
    def from_json(cls, data: Any) -> ResetResult:
        what = "reset answer"
        d = _obj(data, what)
        return cls(ok=_req(d, "ok", bool, what), left=list(_opt(d, "left", list, what, [])),
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
    def from_json(cls, data: Any) -> State:
        what = "state answer"
        d = _obj(data, what)
        procs = []
        for p in _opt(d, "processes", list, what, []):
            if isinstance(p, dict) and isinstance(p.get("pid"), int):
                procs.append(ProcessInfo(pid=p["pid"], ppid=p.get("ppid"), state=p.get("state"),
                                         cmd=p.get("cmd"), shell=p.get("shell") is True))
        return cls(version=_opt(d, "version", str, what), pid=_opt(d, "pid", int, what),
                   shell_pid=_opt(d, "shell_pid", int, what), cwd=_opt(d, "cwd", str, what),
                   busy=bool(_opt(d, "busy", bool, what, False)), processes=procs,
                   guard=_opt(d, "guard", dict, what),
                   uptime_s=_opt(d, "uptime_s", _NUM, what), raw=d)


@dataclass(frozen=True)
class Conditions:
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
    def from_json(cls, data: Any) -> Conditions:
        what = "conditions answer"
        d = _obj(data, what)
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


def _strings(d: dict[str, Any], key: str, what: str) -> list[str] | None:
    v = _opt(d, key, list, what)
    if v is not None and not all(isinstance(x, str) for x in v):
        raise ProtocolError(f"{what}: {key} must be a list of strings")
    return v if v is None else list(v)


# ---- background processes (sb.spawn)

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
    def from_json(cls, data: Any) -> ProcessStatus:
        what = "process answer"
        d = _obj(data, what)
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
    def from_json(cls, data: Any) -> ProcessOutput:
        import base64
        import binascii

        what = "process output answer"
        d = _obj(data, what)
        try:
            raw = base64.b64decode(_req(d, "data_b64", str, what), validate=True)
        except (binascii.Error, ValueError):
            raise ProtocolError(f"{what}: data_b64 is not base64") from None
        start, end = _req(d, "start", int, what), _req(d, "end", int, what)
        if end - start != len(raw):
            raise ProtocolError(f"{what}: {len(raw)} bytes for offsets {start}..{end}")
        return cls(data=raw, start=start, end=end, dropped=_req(d, "dropped", int, what),
                   running=_req(d, "running", bool, what),
                   exit_code=_opt(d, "exit_code", int, what),
                   output_open=bool(_opt(d, "output_open", bool, what, False)))


# ---- interactive sessions (sb.session)

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
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, data: Any) -> SessionStatus:
        what = "session answer"
        d = _obj(data, what)
        return cls(id=_req(d, "id", str, what), pid=_req(d, "pid", int, what),
                   command=_req(d, "command", str, what), cwd=_opt(d, "cwd", str, what, ""),
                   cols=_req(d, "cols", int, what), rows=_req(d, "rows", int, what),
                   running=_req(d, "running", bool, what),
                   exit_code=_opt(d, "exit_code", int, what),
                   signal=_opt(d, "signal", int, what),
                   started_at=float(_opt(d, "started_at", _NUM, what, 0.0)),
                   output_bytes=_req(d, "output_bytes", int, what),
                   output_open=bool(_opt(d, "output_open", bool, what, False)), raw=d)


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
    def from_json(cls, data: Any) -> SessionOutput:
        o = ProcessOutput.from_json(data)
        return cls(data=o.data, start=o.start, end=o.end, dropped=o.dropped, running=o.running,
                   exit_code=o.exit_code, output_open=o.output_open)
