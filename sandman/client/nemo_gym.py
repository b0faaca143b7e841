"""NeMo Gym over sandman: `SandmanProvider`, a sandbox provider of NeMo Gym's own
`SandboxProvider` protocol (nemo_gym.sandbox.providers.base), so NeMo Gym's `Sandbox` /
`AsyncSandbox` and the agents built on them (its mini-swe-agent sandbox environment) run in a
sandman sandbox.

    pip install 'sandman-client[nemo-gym]'   # NeMo Gym 0.4.x (Python >= 3.12)

The distribution registers it under NeMo Gym's `nemo_gym.sandbox_providers` entry points as
`sandman`, so a config names it as any built-in provider:

    sandbox:
      sandman:
        job: rollout-1          # every other key is optional

Where the controller is: $SANDMAN_URL, $SANDMAN_TOKEN_FILE, $SANDMAN_CA_FILE (as `Client()`),
or the keys `url`, `token_file`, `ca_file`. docs/sdk.md, "NeMo Gym", says what maps onto
execd. This is the only module of sandman.client that imports nemo_gym; nothing else imports
this one, so the core client keeps Python 3.9 while this module needs NeMo Gym's floor, 3.12.
"""

from __future__ import annotations

import asyncio
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

try:
    from nemo_gym.sandbox.providers.base import (
        SandboxCreateError,
        SandboxExecResult,
        SandboxHandle,
        SandboxSpec,
        SandboxStatus,
    )
except ImportError as e:  # one clear line instead of a missing-module trace
    raise ImportError(f"sandman.client.nemo_gym needs nemo-gym: pip install "
                      f"'sandman-client[nemo-gym]' (Python >= 3.12) ({e})") from e

from sandman import api, contract
from sandman.client._async.client import AsyncClient
from sandman.client._async.sandbox import AsyncSandbox
from sandman.client.errors import (
    CommandTimeout,
    ControllerError,
    FileNotFound,
    SandboxGone,
    SandmanError,
)

__all__ = ["PROVIDER_NAME", "SandmanProvider", "SandmanOptions"]

PROVIDER_NAME = "sandman"
# NeMo Gym's exec(timeout_s=None) means the provider's default; execd needs one: 7 days, as
# the other adapters'.
NO_TIMEOUT_S = 7 * 86400.0
DEFAULT_MAX_OUTPUT = 1 << 20  # execd keeps head and tail past it; as the other adapters
# A command that timed out has no exit status: coreutils' `timeout` convention, with
# error_type "timeout" (NeMo Gym's sentinel rule for a result that is not a process exit).
TIMEOUT_RETURN_CODE = 124
# execd could not read a command's exit status: NeMo Gym's apptainer provider's sentinel.
SANDBOX_RETURN_CODE = 125


@dataclass(frozen=True)
class SandmanOptions:
    """`SandboxSpec.provider_options` sandman reads; any other key is refused before a pod is
    made (NeMo Gym's rule for provider options)."""

    job: str | None = None
    egress: str | None = None
    namespace: str | None = None
    workspace: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    warm_ok: bool = True
    # A checkpoint of one sandbox (a pause's handle, or `checkpoint(ids=[one])`): the sandbox
    # is made anew from it (as OpenSandbox's snapshot_id), its image, size and labels the
    # checkpoint's.
    checkpoint: str | None = None

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any] | None) -> SandmanOptions:
        if options is None:
            return cls()
        unknown = set(options) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"sandman provider: unknown provider option(s) "
                             f"{', '.join(sorted(unknown))}; known: "
                             f"{', '.join(sorted(cls.__dataclass_fields__))}")
        for key, value in options.items():
            if key == "labels":
                ok, want = isinstance(value, Mapping) and all(
                    isinstance(k, str) and isinstance(v, str) for k, v in value.items()), \
                    "a mapping of strings"
            elif key == "warm_ok":
                ok, want = isinstance(value, bool), "true or false"
            else:
                ok, want = value is None or isinstance(value, str), "a string"
            if not ok:
                raise ValueError(f"sandman provider: provider option {key} must be {want}, "
                                 f"not {type(value).__name__}")
        return cls(**dict(options))


@dataclass
class _Live:
    """A handle's `raw`: the sandbox and what the spec asked of every command."""

    sandbox: AsyncSandbox
    workdir: str | None
    env: dict[str, str]
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # execd: one shell
    user: tuple[str, str] | None = None  # the sandbox's (uid, name), read once
    closed: bool = False


def _label(value: str) -> str:
    """A Kubernetes label value (63 characters, alphanumerics at both ends, `-_.` between)."""
    cleaned = "".join(c if c.isalnum() or c in "-_." else "-" for c in str(value))[:63]
    return cleaned.strip("-_.")


class SandmanProvider:
    """One sandman sandbox per NeMo Gym sandbox: acquired in `create()` from `spec.image`,
    released in `close()`. Each `exec` is one execd /exec in a child of the sandbox's shell,
    so no `cd` or `export` reaches the next command, as with a container runtime's exec;
    commands on one sandbox run one at a time (execd has one shell)."""

    name = PROVIDER_NAME

    def __init__(self, *, job: str = "nemo-gym", url: str | None = None,
                 token_file: str | None = None, ca_file: str | None = None,
                 namespace: str | None = None, egress: str = api.DEFAULT_EGRESS,
                 cpu: str | float = api.DEFAULT_CPU, memory: str = api.DEFAULT_MEMORY,
                 acquire_timeout_s: float = api.DEFAULT_ACQUIRE_TIMEOUT_S,
                 lifetime_s: float | None = None, max_output: int = DEFAULT_MAX_OUTPUT,
                 client: AsyncClient | None = None) -> None:
        self._job, self._namespace, self._egress = job, namespace, egress
        self._cpu, self._memory = cpu, memory
        self._url, self._token_file, self._ca_file = url, token_file, ca_file
        self._acquire_timeout_s = float(acquire_timeout_s)
        self._lifetime_s = None if lifetime_s is None else float(lifetime_s)
        self._max_output = int(max_output)
        self._client = client
        self._own_client = client is None

    def _connected(self) -> AsyncClient:
        if self._client is None:
            self._client = AsyncClient(self._url, token_file=self._token_file,
                                       ca_file=self._ca_file)
        return self._client

    # ---- lifecycle

    @staticmethod
    def _refuse(spec: SandboxSpec, opts: SandmanOptions) -> None:
        """What no sandbox can be, refused in one line before any call."""
        if spec.entrypoint:
            raise SandboxCreateError("sandman provider: a spec's entrypoint is not supported "
                                     "(the pod's process is execd; run the command with exec)")
        if spec.resources.gpu:  # the controller refuses GPUs; say so before asking it
            raise SandboxCreateError("sandman provider: GPU sandboxes are not supported")
        if not spec.image and not opts.checkpoint:
            raise SandboxCreateError("sandman provider: the spec names no image (sandman runs "
                                     "prebuilt images)")

    def _acquire_args(self, spec: SandboxSpec, opts: SandmanOptions) -> dict[str, Any]:
        """The acquire's arguments."""
        res = spec.resources
        labels = {k: _label(v) for k, v in {**spec.metadata, **opts.labels}.items()}
        return dict(
            job=opts.job or self._job,
            cpu=res.cpu if res.cpu is not None else self._cpu,
            memory=f"{res.memory_mib}Mi" if res.memory_mib is not None else self._memory,
            ephemeral_storage=f"{res.disk_gib}Gi" if res.disk_gib is not None else None,
            egress=opts.egress or self._egress, workspace=opts.workspace,
            namespace=opts.namespace or self._namespace,
            labels={k: v for k, v in labels.items() if v},
            timeout_s=float(spec.ready_timeout_s or self._acquire_timeout_s),
            lifetime_s=float(spec.ttl_s) if spec.ttl_s else self._lifetime_s,
            warm_ok=opts.warm_ok)

    async def create(self, spec: SandboxSpec) -> SandboxHandle:
        """A ready sandbox (the controller hands it out once execd answers), its workdir made.
        Every failure to have one is SandboxCreateError, in one line, nothing left leased."""
        try:
            opts = SandmanOptions.from_mapping(spec.provider_options)
        except (TypeError, ValueError) as e:
            raise SandboxCreateError(str(e).splitlines()[0]) from None
        self._refuse(spec, opts)
        timeout_s = float(spec.ready_timeout_s or self._acquire_timeout_s)
        try:
            if opts.checkpoint:
                sb = await self._connected().resume(opts.checkpoint, timeout_s=timeout_s)
            else:
                args = self._acquire_args(spec, opts)
                sb = await self._connected().acquire(spec.image or "", **args)
        except SandmanError as e:
            raise SandboxCreateError(f"sandman provider: {str(e).splitlines()[0]}") from e
        live = _Live(sb, spec.workdir, dict(spec.env))
        if spec.workdir:
            try:
                r = await sb.exec(f"mkdir -p -- {shlex.quote(spec.workdir)}", timeout=60)
                if r.exit_code != 0:
                    raise SandboxCreateError(f"sandman provider: mkdir {spec.workdir}: "
                                             f"{r.output.strip()}")
            except BaseException as e:
                await sb.release()  # nothing left leased, whatever failed
                if isinstance(e, SandmanError):
                    raise SandboxCreateError(f"sandman provider: {str(e).splitlines()[0]}") \
                        from e
                raise
        return SandboxHandle(sandbox_id=sb.id or "", provider_name=self.name, raw=live)

    async def status(self, handle: SandboxHandle) -> SandboxStatus:
        live = self._raw(handle)
        if live.closed:
            return SandboxStatus.STOPPED
        try:
            info = await self._connected().get(handle.sandbox_id)
        except SandboxGone:
            return SandboxStatus.STOPPED
        except ControllerError:
            return SandboxStatus.UNKNOWN
        return SandboxStatus.RUNNING if info.state == contract.STATE_LEASED else SandboxStatus.UNKNOWN

    async def close(self, handle: SandboxHandle) -> None:
        """Releases the sandbox; safe to call again and from cleanup paths."""
        live = self._raw(handle)
        live.closed = True
        await live.sandbox.release()

    async def aclose(self) -> None:
        if self._own_client and self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    @staticmethod
    def _raw(handle: SandboxHandle) -> _Live:
        if not isinstance(handle.raw, _Live):
            raise ValueError(f"sandman provider: handle {handle.sandbox_id} is not sandman's")
        return handle.raw

    # ---- commands

    async def _sandbox_user(self, live: _Live) -> tuple[str, str]:
        if live.user is None:
            r = await live.sandbox.exec("id -u; id -un", timeout=30)
            words = r.output.split()
            if r.exit_code != 0 or len(words) != 2:
                raise RuntimeError(f"sandman provider: `id` in the sandbox failed: {r.output!r}")
            live.user = (words[0], words[1])
        return live.user

    async def _argv(self, live: _Live, command: str, env: dict[str, str],
                    user: str | int | None) -> list[str]:
        argv = ["bash", "-c", command]
        if env:
            argv = ["env", *(f"{k}={v}" for k, v in env.items()), *argv]
        if user is not None:
            uid, name = await self._sandbox_user(live)
            if str(user) not in (uid, name):
                if uid != "0":
                    raise ValueError(f"sandman provider: commands run as the sandbox's user "
                                     f"{name}, which cannot become {user!r}")
                argv = ["runuser", "-u", str(user), "--", *argv]  # root becomes the user
        return argv

    async def exec(self, handle: SandboxHandle, command: str, *, cwd: str | None = None,
                   env: dict[str, str] | None = None, timeout_s: int | float | None = None,
                   user: str | int | None = None) -> SandboxExecResult:
        """`bash -c command` in a child of the sandbox's shell, in `cwd` (else the spec's
        workdir, else the shell's), with the spec's and this call's variables, as `user`.
        stdout carries stdout and stderr in the order printed (execd's one stream); stderr
        is None. A timeout kills the command's processes and answers return code 124 with
        error_type "timeout"."""
        live = self._raw(handle)
        script = shlex.join(await self._argv(live, command, {**live.env, **(env or {})}, user))
        workdir = cwd or live.workdir
        if workdir:  # a missing directory runs nothing
            script = f"cd -- {shlex.quote(workdir)} && {script}"
        # The outer 2>/dev/null is the shell's own: its "Killed" notice after a timeout.
        script = f"{{ ( {script} ) 2>&1; }} 2>/dev/null"
        limit = float(timeout_s) if timeout_s else NO_TIMEOUT_S
        async with live.lock:
            try:
                r = await live.sandbox.exec(script, timeout=limit, max_output=self._max_output)
            except CommandTimeout as e:
                return SandboxExecResult(stdout=None, stderr=str(e).splitlines()[0],
                                         return_code=TIMEOUT_RETURN_CODE, error_type="timeout")
        if r.exit_code < 0:
            return SandboxExecResult(stdout=r.output or None, stderr=r.error or "unknown",
                                     return_code=SANDBOX_RETURN_CODE, error_type="sandbox")
        return SandboxExecResult(stdout=r.output, stderr=None, return_code=r.exit_code)

    # ---- files

    async def upload_file(self, handle: SandboxHandle, source_path: Path,
                          target_path: str) -> None:
        data = Path(source_path).read_bytes()
        sb = self._raw(handle).sandbox
        try:
            await sb.write(target_path, data)
        except FileNotFound:  # execd writes into existing directories only
            parent = str(PurePosixPath(target_path).parent)
            r = await sb.exec(f"mkdir -p -- {shlex.quote(parent)}", timeout=60)
            if r.exit_code != 0:
                raise RuntimeError(f"sandman provider: mkdir {parent}: {r.output}") from None
            await sb.write(target_path, data)

    async def download_file(self, handle: SandboxHandle, source_path: str,
                            target_path: Path) -> None:
        data = await self._raw(handle).sandbox.read(source_path)
        target = Path(target_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
