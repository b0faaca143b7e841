"""SWE-ReX over a sandman sandbox: `SandmanRuntime` (SWE-ReX's `AbstractRuntime`) and
`SandmanDeployment` (its `AbstractDeployment`), so SWE-agent and other SWE-ReX users run their
commands in a sandman sandbox instead of a Docker/Modal/Fargate container.

    pip install 'sandman-client[swerex]'   # swe-rex is an optional extra (Python >= 3.10)

    from sandman.client.swerex import SandmanDeploymentConfig
    deployment = SandmanDeploymentConfig(image="swebench/astropy-12907", job="grpo-7") \
        .get_deployment()
    await deployment.start()            # acquires the sandbox through the controller
    rt = deployment.runtime
    await rt.create_session(CreateBashSessionRequest())
    obs = await rt.run_in_session(BashAction(command="git status", check="raise"))
    await deployment.stop()             # releases it

docs/sdk.md, "SWE-agent / SWE-ReX", says what maps 1:1 onto execd and what cannot. This is
the only module of sandman.client that imports swerex; nothing else imports this one, so the
core client keeps Python 3.9 while this module needs swe-rex's own floor, Python 3.10.

SWE-agent runs every runtime call under its own `asyncio.run()`, so nothing here may belong to
one event loop: the runtime holds the *sync* `Sandbox` (its connection pool and its renewer
thread outlive any loop) and runs each blocking call in a worker thread.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import re
import secrets
import shlex
import stat
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any, Literal, TypeVar

try:
    from pydantic import BaseModel, ConfigDict
    from swerex.deployment.abstract import AbstractDeployment
    from swerex.deployment.hooks.abstract import CombinedDeploymentHook, DeploymentHook
    from swerex.exceptions import (
        BashIncorrectSyntaxError,
        CommandTimeoutError,
        DeploymentNotStartedError,
        NonZeroExitCodeError,
        SessionDoesNotExistError,
        SessionExistsError,
        SwerexException,
    )
    from swerex.runtime.abstract import (
        AbstractRuntime,
        BashAction,
        BashInterruptAction,
        BashObservation,
        CloseBashSessionResponse,
        CloseResponse,
        Command,
        CommandResponse,
        CreateBashSessionRequest,
        CreateBashSessionResponse,
        IsAliveResponse,
        ReadFileRequest,
        ReadFileResponse,
        UploadRequest,
        UploadResponse,
        WriteFileRequest,
        WriteFileResponse,
    )
except ImportError as e:  # one clear line instead of a missing-module trace
    raise ImportError(f"sandman.client.swerex needs swe-rex: pip install "
                      f"'sandman-client[swerex]' (Python >= 3.10) ({e})") from e

from sandman import api
from sandman.client import _core
from sandman.client._sync.client import Client
from sandman.client._sync.sandbox import Sandbox, Session
from sandman.client.errors import (
    CommandTimeout,
    ExpectTimeout,
    FileNotFound,
    SandmanError,
    SessionNotFound,
)
from sandman.client.models import ExecResult

__all__ = ["SandmanDeployment", "SandmanDeploymentConfig", "SandmanRuntime",
           "SessionLimitError", "UnsupportedActionError"]

log = logging.getLogger("sandman.client.swerex")
T = TypeVar("T")

# SWE-ReX's `timeout=None` means "no timeout"; execd needs one: its maximum, 7 days.
NO_TIMEOUT_S = 7 * 86400.0
# SWE-ReX keeps all output; execd keeps at most max_output bytes (head and tail). 1 MiB here
# (execd's default is 100 KiB); `SandmanRuntime(max_output=...)` up to execd's 64 MiB.
DEFAULT_MAX_OUTPUT = 1 << 20
# What execd answers when its syntax check refused a command (docs/execd.md): exit code 2
# and bash's own diagnostic, which fix_diag() starts with "bash: line N:".
_SYNTAX_EXIT = 2
_SYNTAX_PREFIXES = ("bash: line ", "bash: ", "the syntax check failed")
# Interactive actions run in a bash on a pty (an execd session) with LocalRuntime's prompt, so
# an `expect` list ends at the prompt as it does there.
_PS1 = "SHELLPS1PREFIX"
_ANSI = re.compile(r"\x1B[@-_][0-?]*[ -/]*[@-~]")
_PTY_START_S = 30.0  # the pty's bash prints its first prompt within this


class SessionLimitError(SwerexException, RuntimeError):
    """A second concurrent named session: execd has exactly one persistent shell."""


class UnsupportedActionError(SwerexException, NotImplementedError):
    """`expect` on a non-interactive action: execd runs such a command to completion with
    stdin /dev/null (interactive actions have a terminal: an execd session)."""


def _strip_control_chars(s: str) -> str:
    """LocalRuntime's: ANSI escapes out, CRLF to LF."""
    return _ANSI.sub("", s).replace("\r\n", "\n")


def _first_match(text: str, patterns: list[str]) -> int:
    """The pattern pexpect would report: the one matching earliest, the first listed on a
    tie."""
    best, where = 0, None
    for i, p in enumerate(patterns):
        m = re.search(p, text)
        if m is not None and (where is None or m.start() < where):
            best, where = i, m.start()
    return best


async def _in_thread(fn: Callable[..., T], *args: Any, _pool: Executor | None = None,
                     **kw: Any) -> T:
    """fn in a worker thread; the loop stays free while execd works."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_pool, functools.partial(fn, *args, **kw))


def _is_syntax_refusal(r: ExecResult) -> bool:
    return (r.exit_code == _SYNTAX_EXIT and bool(r.error)
            and str(r.error).startswith(_SYNTAX_PREFIXES) and not r.output)


class SandmanRuntime(AbstractRuntime):
    """SWE-ReX's runtime interface over one sandman sandbox (its execd).

    `sandbox` is a sync `sandman.client.Sandbox` (acquired, or `Sandbox.connect(...)`).
    `release_on_close=True` releases it in `close()` (what `SandmanDeployment` does through
    stop()). Calls on one runtime are serialized: execd runs one command at a time, and
    SWE-ReX's local runtime never answers "busy" either."""

    def __init__(self, sandbox: Sandbox, *, max_output: int = DEFAULT_MAX_OUTPUT,
                 reset_on_create: bool = True, release_on_close: bool = False,
                 logger: logging.Logger | None = None, **kwargs: Any) -> None:
        if kwargs:
            raise TypeError(f"SandmanRuntime: unknown arguments {sorted(kwargs)}")
        self.sandbox = sandbox
        self.logger = logger or log
        self._max_output = int(max_output)
        self._reset_on_create = reset_on_create
        self._release_on_close = release_on_close
        self._session: str | None = None  # the one named session mapped onto execd's shell
        self._pty: Session | None = None  # the terminal of a running interactive program
        self._lock = threading.Lock()  # one execd call at a time, held in the worker thread
        self._running = 0  # commands in flight (read by interrupt without the lock)
        # Its own threads, not the loop's default executor: asyncio.run() (once per call in
        # SWE-agent) makes and joins a new default executor each time, a thread per call.
        # 4: the serialized command plus is_alive and an interrupt beside it.
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    @classmethod
    def connect(cls, address: str, port: int, token: str, **kwargs: Any) -> SandmanRuntime:
        """A runtime on a running execd with no controller (tests, debugging)."""
        sb_kw = {k: kwargs.pop(k) for k in ("retry", "on_request", "file_timeout_s")
                 if k in kwargs}
        return cls(Sandbox.connect(address, port, token, **sb_kw), **kwargs)

    @property
    def sessions(self) -> list[str]:
        return [] if self._session is None else [self._session]

    # ---- blocking halves, run in a worker thread under the lock

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=4,
                                                thread_name_prefix="sandman-swerex")
            pool = self._pool
        return await _in_thread(fn, *args, _pool=pool)

    def _exec(self, command: str, timeout: float | None) -> ExecResult:
        with self._lock:
            self._running += 1
            try:
                return self.sandbox.exec(
                    command, timeout=NO_TIMEOUT_S if timeout is None else timeout,
                    max_output=self._max_output)
            finally:
                self._running -= 1

    def _locked(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        with self._lock:
            return fn(*args, **kw)

    # ---- AbstractRuntime

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        """execd's /health (no lock: it answers while a command runs)."""
        try:
            fut = self._run(self.sandbox.health)
            health = await (asyncio.wait_for(fut, timeout) if timeout else fut)
        except (TimeoutError, SandmanError) as e:
            return IsAliveResponse(is_alive=False, message=f"{type(e).__name__}: {e}")
        if not health.ok:
            return IsAliveResponse(is_alive=False, message="execd /health answered not ok")
        return IsAliveResponse(is_alive=True)

    async def create_session(self, request: CreateBashSessionRequest) -> CreateBashSessionResponse:
        """A fresh shell (execd /reset: every process of the sandbox killed, as a new pexpect
        bash would start without them), then `source` each startup file."""
        if not isinstance(request, CreateBashSessionRequest):
            raise ValueError(f"unknown session type: {request!r}")
        if request.session == self._session:
            raise SessionExistsError(f"session {request.session} already exists")
        if self._session is not None:
            raise SessionLimitError(
                f"session {self._session!r} is open and execd has one shell: close it before "
                f"creating {request.session!r}")
        self._session = request.session
        try:
            if self._reset_on_create:
                await self._run(self._locked, self.sandbox.reset)
                self._pty = None  # the reset killed it
            output = ""
            if request.startup_source:
                cmd = " ; ".join(f"source {shlex.quote(p)}" for p in request.startup_source)
                try:
                    r = await self._run(self._exec, cmd, request.startup_timeout)
                except CommandTimeout as e:
                    raise CommandTimeoutError(
                        f"timeout after {request.startup_timeout} seconds while sourcing "
                        f"{request.startup_source}") from e
                output = r.output
        except BaseException:
            self._session = None
            raise
        return CreateBashSessionResponse(output=output)

    async def run_in_session(self, action: Any) -> BashObservation:
        if action.session != self._session:
            raise SessionDoesNotExistError(f"session {action.session!r} does not exist")
        if isinstance(action, BashInterruptAction):
            return await self._interrupt(action)
        if not isinstance(action, BashAction):
            raise ValueError(f"unknown action: {action!r}")
        if action.is_interactive_command or action.is_interactive_quit:
            return await self._run(self._locked, self._interactive, action)
        if action.expect:
            raise UnsupportedActionError(
                "`expect` on a non-interactive action: execd runs each command to completion "
                "with stdin /dev/null; use is_interactive_command (docs/sdk.md, SWE-ReX)")
        try:
            r = await self._run(self._exec, action.command, action.timeout)
        except CommandTimeout as e:
            raise CommandTimeoutError(
                f"timeout after {action.timeout} seconds while running command "
                f"{action.command!r}") from e
        if _is_syntax_refusal(r):
            # SWE-ReX checks with `bash -n` before running; execd's own check ran nothing.
            raise BashIncorrectSyntaxError(
                f"Error (exit code {r.exit_code}) while checking bash command \n"
                f"{action.command!r}\n---- Stderr ----\n{r.error}\n---- Stdout ----\n",
                extra_info={"bash_stdout": "", "bash_stderr": str(r.error)})
        exit_code: int | None = r.exit_code if r.exit_code >= 0 else None
        if action.check == "raise" and exit_code != 0:
            msg = (f"Command {action.command!r} failed with exit code {exit_code}. "
                   f"Here is the output:\n{r.output!r}")
            if action.error_msg:
                msg = f"{action.error_msg}: {msg}"
            raise NonZeroExitCodeError(msg)
        if action.check == "ignore":
            exit_code = None
        return BashObservation(output=r.output, exit_code=exit_code,
                               failure_reason=r.error or "")

    # ---- interactive programs: a bash on a pty (an execd session), as LocalRuntime's pexpect

    def _expect(self, pty: Session, patterns: list[str], timeout: float | None) -> tuple[str,
                                                                                         int]:
        """(the text before the match, the index of the pattern that matched)."""
        rx = "|".join(f"(?:{p})" for p in patterns)
        got = pty.expect(rx, timeout=NO_TIMEOUT_S if timeout is None else timeout)
        i = _first_match(got, patterns)
        m = re.search(patterns[i], got)
        return got[:m.start()] if m is not None else got, i

    def _interactive(self, action: BashAction) -> BashObservation:
        """LocalRuntime's _run_interactive: send the line, wait for one of `expect` or the
        prompt. The first interactive command starts the pty's bash (in the shell's cwd); the
        quit closes it, with whatever still runs in it."""
        if self._pty is None:
            if action.is_interactive_quit:
                raise SwerexException("is_interactive_quit without an interactive program "
                                      "running (start one with is_interactive_command)")
            # No echo of what is typed, as pexpect.spawn(echo=False) in LocalRuntime.
            pty = self.sandbox.session("stty -echo; exec bash --norc --noprofile",
                                       env={"PS1": _PS1, "PS2": "", "PS0": ""})
            try:
                pty.expect(re.escape(_PS1), timeout=_PTY_START_S)
            except BaseException:
                pty.close()
                raise
            self._pty = pty
        pty = self._pty
        patterns = list(action.expect) + [re.escape(_PS1)]
        try:
            pty.write(action.command + "\n")
            before, i = self._expect(pty, patterns, action.timeout)
        except ExpectTimeout as e:
            raise CommandTimeoutError(f"timeout after {action.timeout} seconds while running "
                                      f"command {action.command!r}") from e
        except SessionNotFound:
            self._pty = None
            raise
        output = _strip_control_chars(before)
        matched = (list(action.expect) + [_PS1])[i]
        if action.is_interactive_quit:
            self._pty = None
            pty.close()
        else:
            # The terminal echoes the line typed (LocalRuntime strips it the same way).
            output = output.lstrip().removeprefix(action.command).strip()
        return BashObservation(output=output, exit_code=0, expect_string=matched)

    def _interrupt_pty(self, action: BashInterruptAction) -> BashObservation:
        """LocalRuntime's interrupt: ^C up to n_retry times until `expect` or the prompt,
        then what follows for 0.5 s."""
        pty = self._pty
        assert pty is not None
        patterns = list(action.expect) + [re.escape(_PS1)]
        for _ in range(action.n_retry):
            pty.write(b"\x03")
            try:
                before, i = self._expect(pty, patterns, action.timeout)
            except ExpectTimeout:
                time.sleep(0.2)
                continue
            output = _strip_control_chars(before)
            time.sleep(0.5)
            output += _strip_control_chars(pty.read(timeout=0.1).text)
            return BashObservation(output=output.strip(), exit_code=0,
                                   expect_string=(list(action.expect) + [_PS1])[i])
        # As LocalRuntime falls back to ^Z and kill -9: the program and its tree go.
        self._pty = None
        pty.close()
        return BashObservation(output="", exit_code=0, failure_reason=(
            "the interactive program did not stop at ^C: its terminal was closed and its "
            "processes killed"))

    async def _interrupt(self, action: BashInterruptAction) -> BashObservation:
        """With an interactive program running: ^C on its terminal, as LocalRuntime. Else
        nothing to interrupt between calls: execd already killed a timed-out command's
        whole tree. A command still in flight (another task of this runtime) cannot get a
        Ctrl-C through execd: /reset kills it, and the shell's state goes with it."""
        if self._pty is not None:
            return await self._run(self._locked, self._interrupt_pty, action)
        if action.expect:
            raise UnsupportedActionError("`expect` without an interactive program running")
        if self._running == 0:
            return BashObservation(output="", exit_code=0)
        await self._run(self.sandbox.reset)  # not under the lock: the command holds it
        self._pty = None
        return BashObservation(output="", exit_code=0, failure_reason=(
            "the running command was stopped by resetting the sandbox's shell: its cwd, "
            "variables and background jobs were lost"))

    async def close_session(self, request: Any) -> CloseBashSessionResponse:
        if request.session != self._session:
            raise SessionDoesNotExistError(f"session {request.session!r} does not exist")
        self._session = None
        await self._close_pty()
        return CloseBashSessionResponse()

    async def _close_pty(self) -> None:
        pty, self._pty = self._pty, None
        if pty is not None:
            try:
                await self._run(self._locked, pty.close)
            except SandmanError as e:
                self.logger.warning("closing the interactive terminal failed: %s", e)

    async def execute(self, command: Command) -> CommandResponse:
        """`subprocess.run()` semantics in a child process of execd's shell: the session's
        cwd and variables are neither used nor changed (a `( ... )` subshell), `env` replaces
        the environment, `cwd` applies to this command only, stdout and stderr come apart
        unless `merge_output_streams`."""
        script, sep = _execute_script(command)
        try:
            r = await self._run(self._exec, script, command.timeout)
        except CommandTimeout as e:
            raise CommandTimeoutError(
                f"Timeout ({command.timeout}s) exceeded while running command") from e
        if _is_syntax_refusal(r):  # only a bug of _execute_script can get here
            raise SwerexException(f"execd refused the wrapped command: {r.error}")
        if sep is None:
            resp = CommandResponse(stdout=r.output, stderr="", exit_code=r.exit_code)
        else:
            out, found, err = r.output.partition(sep)
            if not found:  # fail closed: never guess which bytes were stderr
                why = (f"output over {self._max_output} bytes was truncated by execd (raise "
                       f"max_output)" if r.truncated else
                       f"exit {r.exit_code}, {r.error or 'no stderr capture (mktemp failed?)'}")
                raise SwerexException(f"execute: stdout and stderr cannot be told apart: {why}")
            resp = CommandResponse(stdout=out, stderr=err, exit_code=r.exit_code)
        if command.check and resp.exit_code != 0:
            msg = (f"Command {command.command!r} failed with exit code {resp.exit_code}. "
                   f"Stdout:\n{resp.stdout!r}\nStderr:\n{resp.stderr!r}")
            if command.error_msg:
                msg = f"{command.error_msg}: {msg}"
            raise NonZeroExitCodeError(msg)
        return resp

    async def read_file(self, request: ReadFileRequest) -> ReadFileResponse:
        """The file's bytes (length and SHA-256 checked), decoded as `Path.read_text` would,
        except that line endings are kept as they are (no universal-newline translation)."""
        data = await self._run(self._locked, self.sandbox.read, request.path)
        return ReadFileResponse(content=data.decode(request.encoding or "utf-8",
                                                    request.errors or "strict"))

    async def write_file(self, request: WriteFileRequest) -> WriteFileResponse:
        """UTF-8, atomic replace; missing parent directories are created, as SWE-ReX does."""
        await self._run(self._locked, self._write, request.path, request.content, None)
        return WriteFileResponse()

    def _write(self, path: str, data: Any, mode: int | None) -> None:
        try:
            self.sandbox.write(path, data, mode=mode)
        except FileNotFound:
            parent = str(PurePosixPath(path).parent)
            r = self.sandbox.exec(f"mkdir -p -- {shlex.quote(parent)}", timeout=60)
            if r.exit_code != 0:
                raise
            self.sandbox.write(path, data, mode=mode)

    async def upload(self, request: UploadRequest) -> UploadResponse:
        """A local file or directory tree into the sandbox (as SWE-ReX's server does: missing
        parents created, a directory merged into an existing target, a file replacing the
        target), byte-exact, file modes kept (SWE-ReX's zip transfer drops them)."""
        await self._run(self._locked, self._upload, request.source_path, request.target_path)
        return UploadResponse()

    def _upload(self, source_path: str, target_path: str) -> None:
        source = Path(source_path).resolve()
        target = PurePosixPath(target_path)
        if source.is_file():
            self._write(str(target), source.read_bytes(), stat.S_IMODE(source.stat().st_mode))
            return
        if not source.is_dir():
            raise ValueError(f"Source path {source} is not a file or directory")
        dirs: list[str] = [str(target)]
        files: list[tuple[Path, PurePosixPath]] = []
        for root, dirnames, filenames in os.walk(source):
            rel = Path(root).relative_to(source)
            for d in sorted(dirnames):
                dirs.append(str(target / rel.as_posix() / d))
            for f in sorted(filenames):
                files.append((Path(root) / f, target / rel.as_posix() / f))
        r = self.sandbox.exec("mkdir -p -- " + " ".join(shlex.quote(d) for d in dirs),
                              timeout=120)
        if r.exit_code != 0:
            raise SwerexException(f"upload: mkdir in the sandbox failed: {r.output.strip()}")
        for local, remote in files:
            self.sandbox.write(str(remote), local.read_bytes(),
                               mode=stat.S_IMODE(local.stat().st_mode))

    async def close(self) -> CloseResponse:
        """Closes the session; releases the sandbox if this runtime owns it."""
        self._session = None
        try:
            await self._close_pty()
            if self._release_on_close:
                await self._run(self.sandbox.release)
        finally:
            with self._pool_lock:
                pool, self._pool = self._pool, None
            if pool is not None:
                pool.shutdown(wait=False)
        return CloseResponse()


def _execute_script(command: Command) -> tuple[str, str | None]:
    """The bash text that runs `command` like subprocess.run() would, and the separator put
    between stdout and stderr (None when merged). Everything runs in a `( ... )` subshell."""
    if isinstance(command.command, list):
        argv = " ".join(shlex.quote(a) for a in command.command)
    elif command.shell:
        argv = f"/bin/sh -c {shlex.quote(command.command)}"
    else:  # subprocess.run("ls -l") without shell runs a program named "ls -l"
        argv = shlex.quote(command.command)
    if command.shell and isinstance(command.command, list):
        # subprocess: the first item is the shell script, the rest its $0, $1, ...
        argv = "/bin/sh -c " + " ".join(shlex.quote(a) for a in command.command)
    if command.env is not None:
        argv = "exec env -i " + " ".join(
            shlex.quote(f"{k}={v}") for k, v in command.env.items()) + " " + argv
    if command.cwd is not None:  # subprocess raises for a bad cwd; here: exit 1 and cd's message
        argv = f"cd -- {shlex.quote(command.cwd)} && {argv}"
    if command.merge_output_streams:
        return f"( {argv} ) 2>&1", None
    # stderr goes to a temp file and follows stdout after a random separator.
    sep = f"\n__sandman_stderr_{secrets.token_hex(8)}__\n"
    lines = ["(", "__sm_e=$(mktemp) || exit 125",
             f"( {argv} ) 2>\"$__sm_e\"; __sm_rc=$?",
             f"printf %s {shlex.quote(sep)}; cat -- \"$__sm_e\"; rm -f -- \"$__sm_e\"",
             "exit $__sm_rc", ")"]
    return "\n".join(lines), sep


# ---------------------------------------------------------------- the deployment


class SandmanDeploymentConfig(BaseModel):
    """`SandmanDeployment`'s configuration: what `client.acquire()` takes, plus where the
    controller is (default from $SANDMAN_URL, $SANDMAN_TOKEN_FILE, $SANDMAN_CA_FILE)."""

    image: str
    job: str
    cpu: str = api.DEFAULT_CPU
    memory: str = api.DEFAULT_MEMORY
    egress: str | dict[str, list[str]] = api.DEFAULT_EGRESS  # {"allow": [...]}: an allowlist
    workspace: str | None = None
    namespace: str | None = None
    labels: dict[str, str] | None = None
    lifetime_s: float | None = None
    acquire_timeout_s: float = 300.0
    url: str | None = None
    token_file: str | None = None
    ca_file: str | None = None
    max_output: int = DEFAULT_MAX_OUTPUT
    type: Literal["sandman"] = "sandman"
    """Discriminator, as SWE-ReX's own deployment configs have."""

    model_config = ConfigDict(extra="forbid")

    def get_deployment(self) -> SandmanDeployment:
        return SandmanDeployment.from_config(self)


class SandmanDeployment(AbstractDeployment):
    """start(): acquire a sandbox from the controller (image and size from the config);
    runtime: a `SandmanRuntime` on it; stop(): release it. `client=` shares one sandman
    `Client` between deployments (then stop() does not close it)."""

    def __init__(self, *, logger: logging.Logger | None = None,
                 client: Client | None = None, **kwargs: Any) -> None:
        self._config = SandmanDeploymentConfig(**kwargs)
        self.logger = logger or log
        self._client = client
        self._own_client = client is None
        self._runtime: SandmanRuntime | None = None
        self._hooks = CombinedDeploymentHook()

    @classmethod
    def from_config(cls, config: SandmanDeploymentConfig, **kwargs: Any) -> SandmanDeployment:
        return cls(**config.model_dump(exclude={"type"}), **kwargs)

    def add_hook(self, hook: DeploymentHook) -> None:
        self._hooks.add_hook(hook)

    @property
    def sandbox(self) -> Sandbox:
        return self.runtime.sandbox

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        if self._runtime is None:
            return IsAliveResponse(is_alive=False, message="Runtime is None.")
        return await self._runtime.is_alive(timeout=timeout)

    async def start(self, *args: Any, **kwargs: Any) -> None:
        if self._runtime is not None:
            return
        c = self._config
        self._hooks.on_custom_step("Acquiring a sandman sandbox")
        sandbox = await _in_thread(self._acquire)
        self._runtime = SandmanRuntime(sandbox, max_output=c.max_output, release_on_close=True,
                                       logger=self.logger)
        self.logger.info("sandman sandbox %s (pod %s) acquired for %s", sandbox.id,
                         sandbox.pod, c.image)

    def _acquire(self) -> Sandbox:
        c = self._config
        if self._client is None:
            self._client = Client(c.url, token_file=c.token_file, ca_file=c.ca_file)
        return self._client.acquire(c.image, job=c.job, cpu=c.cpu, memory=c.memory,
                                    egress=c.egress, workspace=c.workspace, labels=c.labels,
                                    timeout_s=c.acquire_timeout_s, lifetime_s=c.lifetime_s,
                                    namespace=c.namespace)

    async def stop(self, *args: Any, **kwargs: Any) -> None:
        """Releases the sandbox (idempotent); closes the client if this deployment made it."""
        rt, self._runtime = self._runtime, None
        try:
            if rt is not None:
                await rt.close()
        finally:
            if self._own_client and self._client is not None:
                client, self._client = self._client, None
                await _in_thread(client.close)

    @property
    def runtime(self) -> SandmanRuntime:
        if self._runtime is None:
            # swe-rex declares this __init__ without annotations.
            raise DeploymentNotStartedError()  # type: ignore[no-untyped-call]
        return self._runtime

    def __del__(self) -> None:
        # AbstractDeployment.__del__ runs stop() on whatever loop it finds (or none). The
        # sandbox's renewer thread would keep a forgotten lease alive for the whole process,
        # so a deployment dropped without stop() releases it, from a thread: a finalizer must
        # not block on the network.
        rt = getattr(self, "_runtime", None)
        if rt is None:
            return
        self._runtime = None
        client = self._client if getattr(self, "_own_client", False) else None
        try:
            self.logger.warning("SandmanDeployment dropped without stop(): releasing sandbox %s",
                                rt.sandbox.id)
        except Exception:  # interpreter shutdown: logging may be gone
            pass
        _core.release_in_background(rt.sandbox, client, "deployment", log,
                                    "sandman-swerex-release")
