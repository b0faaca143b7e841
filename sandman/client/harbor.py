"""Harbor over a sandman sandbox: `SandmanEnvironment`, an environment of Harbor's
`BaseEnvironment` interface, so `harbor run` / `harbor trial start` (terminal-bench and any
Harbor task) run the agent and the verifier in a sandman sandbox instead of a Docker container.

    pip install 'sandman-client[harbor]'   # Harbor 0.25.x (Python >= 3.12)

    harbor trial start -p path/to/task -a oracle \\
        -e sandman.client.harbor:SandmanEnvironment --environment-kwarg job=tbench-1

Where the controller is: $SANDMAN_URL, $SANDMAN_TOKEN_FILE, $SANDMAN_CA_FILE (as `Client()`),
or `--environment-kwarg url=...`. docs/sdk.md, "Harbor", says what maps onto execd and which
of Harbor's features are Docker's alone. This is the only module of sandman.client that
imports harbor; nothing else imports this one, so the core client keeps Python 3.9 while this
module needs Harbor's own floor, Python 3.12.
"""

from __future__ import annotations

import asyncio
import shlex
from pathlib import Path, PurePosixPath
from typing import Any

try:
    from harbor.environments.base import BaseEnvironment, ExecResult
    from harbor.environments.capabilities import (
        EnvironmentCapabilities,
        EnvironmentResourceCapabilities,
    )
    from harbor.environments.definition import COMPOSE_FILE_NAME
    from harbor.models.task.config import NetworkMode, TaskOS
    from harbor.models.trial.paths import TrialPaths
except ImportError as e:  # one clear line instead of a missing-module trace
    raise ImportError(f"sandman.client.harbor needs harbor: pip install "
                      f"'sandman-client[harbor]' (Python >= 3.12) ({e})") from e

from sandman import api, contract
from sandman.client._async.client import AsyncClient
from sandman.client._async.sandbox import AsyncSandbox
from sandman.client.errors import CommandTimeout, FileNotFound

__all__ = ["SandmanEnvironment"]

# Harbor's exec(timeout_sec=None) means no limit (Docker's `docker exec` has none; the trial
# bounds each phase itself); execd needs one: 7 days, as the SWE-ReX adapter's.
NO_TIMEOUT_S = 7 * 86400.0
# Harbor keeps all output; execd keeps at most max_output bytes (head and tail). 1 MiB, as the
# other adapters; `--environment-kwarg max_output=...` up to execd's 64 MiB.
DEFAULT_MAX_OUTPUT = 1 << 20
ENVIRONMENT_TYPE = "sandman"


def _number(name: str, value: Any) -> float:
    """A kwarg from Harbor's command line arrives as text: a clear line when it is no number."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"sandman environment: {name} must be a number of seconds or bytes, "
                         f"not {value!r}") from None


class SandmanEnvironment(BaseEnvironment):
    """One sandman sandbox per Harbor environment: acquired in `start()` from the task's
    `docker_image` (or `image=`), released in `stop()`. Each `exec` is one execd /exec in a
    child of the sandbox's shell, so commands start anew as `docker exec` does; commands on
    one environment run one at a time (execd has one shell)."""

    def __init__(self, environment_dir: Path, environment_name: str, session_id: str,
                 trial_paths: TrialPaths, task_env_config: Any, *args: Any,
                 image: str | None = None, job: str = "harbor", url: str | None = None,
                 token_file: str | None = None, ca_file: str | None = None,
                 namespace: str | None = None, workspace: str | None = None,
                 lifetime_s: float | str | None = None,
                 acquire_timeout_s: float | str = 300.0,
                 max_output: int | str = DEFAULT_MAX_OUTPUT,
                 client: AsyncClient | None = None, **kwargs: Any) -> None:
        # Set before the base's __init__: it calls _validate_definition().
        self._image = image or None
        self._job = job
        self._url, self._token_file, self._ca_file = url, token_file, ca_file
        self._namespace, self._workspace = namespace, workspace
        self._lifetime_s = None if lifetime_s is None else _number("lifetime_s", lifetime_s)
        self._acquire_timeout_s = _number("acquire_timeout_s", acquire_timeout_s)
        self._max_output = int(_number("max_output", max_output))
        self._client = client
        self._own_client = client is None
        self.sandbox: AsyncSandbox | None = None
        self._user: tuple[str, str] | None = None  # the sandbox's (uid, name)
        self._exec_lock = asyncio.Lock()
        super().__init__(environment_dir, environment_name, session_id, trial_paths,
                         task_env_config, *args, **kwargs)

    @staticmethod
    def type() -> str:
        return ENVIRONMENT_TYPE

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        # No-network is sandman's default egress (deny); allowlists are CIDR:PORT entries,
        # which Harbor's host allowlists are not, so Harbor refuses those tasks before start.
        return EnvironmentCapabilities(disable_internet=True)

    @classmethod
    def resource_capabilities(cls) -> EnvironmentResourceCapabilities:
        # A sandbox's requests equal its limits.
        return EnvironmentResourceCapabilities(cpu_limit=True, cpu_request=True,
                                               memory_limit=True, memory_request=True,
                                               fractional_cpus=True)

    @property
    def image(self) -> str:
        return self._image or self.task_env_config.docker_image or ""

    def _validate_definition(self) -> None:
        if (self.environment_dir / COMPOSE_FILE_NAME).exists():
            raise ValueError(f"sandman environment: {self.environment_name} is a Docker Compose "
                             f"task ({COMPOSE_FILE_NAME}); a sandbox is one container")
        if not self.image:
            raise ValueError(f"sandman environment: {self.environment_name} names no image: "
                             f"sandman runs prebuilt images, it builds no Dockerfile; set "
                             f"[environment].docker_image in task.toml or pass "
                             f"--environment-kwarg image=REF")

    # ---- lifecycle

    def _egress(self) -> str:
        mode = self.network_policy.network_mode
        if mode == NetworkMode.NO_NETWORK:
            return contract.EGRESS_DENY
        if mode == NetworkMode.PUBLIC:
            return contract.EGRESS_ALLOW
        raise ValueError(f"sandman environment: network mode {mode.value!r} is not supported")

    async def start(self, force_build: bool) -> None:
        if force_build:
            self.logger.debug("sandman builds no images: force_build has no effect")
        if self.sandbox is not None:
            raise RuntimeError("sandman environment: already started")
        if self._client is None:
            self._client = AsyncClient(self._url, token_file=self._token_file,
                                       ca_file=self._ca_file)
        cpus, memory_mb = self._effective_cpus, self._effective_memory_mb
        storage_mb = self._effective_storage_mb
        self.sandbox = await self._client.acquire(
            self.image, job=self._job,
            cpu=cpus if cpus is not None else api.DEFAULT_CPU,
            memory=f"{memory_mb}Mi" if memory_mb is not None else api.DEFAULT_MEMORY,
            ephemeral_storage=f"{storage_mb}Mi" if storage_mb is not None else None,
            egress=self._egress(), workspace=self._workspace, namespace=self._namespace,
            labels={"harbor-session": _label(self.session_id)},
            timeout_s=self._acquire_timeout_s, lifetime_s=self._lifetime_s)
        self.logger.info(f"sandman sandbox {self.sandbox.id} (pod {self.sandbox.pod}) "
                         f"acquired for {self.image}")
        await self.ensure_dirs(self._mount_targets(writable_only=True))
        await self._upload_environment_dir_after_start()

    async def stop(self, delete: bool) -> None:
        """Releases the sandbox (whatever `delete` says: a released sandbox is gone, as an
        E2B or Modal sandbox is) and closes the client this environment made."""
        sb, self.sandbox = self.sandbox, None
        try:
            if sb is not None:
                await sb.release()
        finally:
            if self._own_client and self._client is not None:
                client, self._client = self._client, None
                await client.aclose()

    def _live(self) -> AsyncSandbox:
        if self.sandbox is None:
            raise RuntimeError("sandman environment: not started, or stopped (no sandbox)")
        return self.sandbox

    # ---- commands

    async def _sandbox_user(self) -> tuple[str, str]:
        if self._user is None:
            r = await self._live().exec("id -u; id -un", timeout=30)
            lines = r.output.split()
            if r.exit_code != 0 or len(lines) != 2:
                raise RuntimeError(f"sandman environment: `id` in the sandbox failed: "
                                   f"{r.output!r}")
            self._user = (lines[0], lines[1])
        return self._user

    async def _argv(self, command: str, env: dict[str, str] | None,
                    user: str | int | None) -> list[str]:
        argv = ["bash", "-c", command]
        if env:
            argv = ["env", *(f"{k}={v}" for k, v in env.items()), *argv]
        if user is not None:
            uid, name = await self._sandbox_user()
            if str(user) not in (uid, name):
                if uid != "0":
                    raise ValueError(f"sandman environment: commands run as the sandbox's user "
                                     f"{name}, which cannot become {user!r}")
                # root becomes the task's user as `docker exec -u` does (util-linux's runuser)
                argv = ["runuser", "-u", str(user), "--", *argv]
        return argv

    async def exec(self, command: str, cwd: str | None = None,
                   env: dict[str, str] | None = None, timeout_sec: int | None = None,
                   user: str | int | None = None) -> ExecResult:
        """`bash -c command` in a child of the sandbox's shell (no cd or export reaches the
        next command, as with `docker exec`), in `cwd` or the task's workdir (else the
        shell's, the sandbox's workspace), with Harbor's merged variables, as `user`. stdout
        carries stdout and stderr in the order printed; stderr is None. A timeout kills the
        command's processes and raises RuntimeError, as Harbor's Docker environment does."""
        script = shlex.join(await self._argv(command, self._merge_env(env),
                                             self._resolve_user(user)))
        workdir = cwd or self.task_env_config.workdir
        if workdir:  # a missing directory runs nothing, as `docker exec -w` refuses it
            script = f"cd -- {shlex.quote(workdir)} && {script}"
        # The outer 2>/dev/null is the shell's own: its "Killed" notice when a timeout killed
        # the child would otherwise print this wrapper into the output.
        script = f"{{ ( {script} ) 2>&1; }} 2>/dev/null"
        limit = float(timeout_sec) if timeout_sec else NO_TIMEOUT_S
        async with self._exec_lock:  # execd runs one command at a time in its shell
            try:
                r = await self._live().exec(script, timeout=limit, max_output=self._max_output)
            except CommandTimeout as e:
                raise RuntimeError(f"Command timed out after {timeout_sec} seconds") from e
        if r.exit_code < 0:
            raise RuntimeError(f"sandman environment: execd could not read the command's exit "
                               f"status: {r.error or 'unknown'}")
        return ExecResult(stdout=r.output or None, stderr=None, return_code=r.exit_code)

    # ---- files

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        data = Path(source_path).read_bytes()
        sb = self._live()
        try:
            await sb.write(target_path, data)
        except FileNotFound:  # execd writes into existing directories only, `docker cp` makes
            parent = str(PurePosixPath(target_path).parent)
            r = await sb.exec(f"mkdir -p -- {shlex.quote(parent)}", timeout=60)
            if r.exit_code != 0:
                raise RuntimeError(f"sandman environment: mkdir {parent}: {r.output}") from None
            await sb.write(target_path, data)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        await self._live().upload_tree(source_dir, target_dir)

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        data = await self._live().read(source_path)
        target = Path(target_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        Path(target_dir).mkdir(parents=True, exist_ok=True)
        await self._live().download_tree(source_dir, target_dir)

    def _validate_windows_support(self) -> None:
        if self.task_env_config.os == TaskOS.WINDOWS:
            raise ValueError("sandman environment: sandboxes are Linux pods; a Windows task "
                             "cannot run on one")


def _label(value: str) -> str:
    """A Kubernetes label value from Harbor's session id (63 characters, alphanumerics at
    both ends, `-_.` between)."""
    cleaned = "".join(c if c.isalnum() or c in "-_." else "-" for c in value)[-63:]
    return cleaned.strip("-_.") or "harbor"

