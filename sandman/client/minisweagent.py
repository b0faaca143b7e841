"""mini-swe-agent over a sandman sandbox: `SandmanEnvironment`, an environment of mini-swe-agent's
`Environment` protocol, so `DefaultAgent` and its run scripts execute each action in a sandman
sandbox instead of a Docker container or this machine.

    pip install 'sandman-client[mini-swe-agent]'   # mini-swe-agent 2.4.x (Python >= 3.10)

    from minisweagent.agents.default import DefaultAgent
    from sandman.client.minisweagent import SandmanEnvironment
    env = SandmanEnvironment(image="swebench/astropy-12907", job="grpo-7", cwd="/testbed")
    try:                                  # the constructor acquired the sandbox
        DefaultAgent(model, env, **agent_config).run(task)
    finally:
        env.cleanup()                     # releases it

or, in a mini-swe-agent YAML config, `environment: {environment_class:
sandman.client.minisweagent.SandmanEnvironment, image: ..., job: ...}`.

docs/sdk.md, "mini-swe-agent", says what maps onto execd and what differs. This is the only
module of sandman.client that imports minisweagent; nothing else imports this one, so the core
client keeps Python 3.9 while this module needs mini-swe-agent's own floor, Python 3.10.
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
from typing import Any

try:
    from minisweagent.exceptions import Submitted
    from minisweagent.utils.serialize import recursive_merge
    from pydantic import BaseModel, ConfigDict
except ImportError as e:  # one clear line instead of a missing-module trace
    raise ImportError(f"sandman.client.minisweagent needs mini-swe-agent: pip install "
                      f"'sandman-client[mini-swe-agent]' (Python >= 3.10) ({e})") from e

from sandman import api
from sandman.client import _core
from sandman.client._sync.client import Client
from sandman.client._sync.sandbox import Sandbox
from sandman.client.errors import CommandTimeout
from sandman.client.models import ExecResult

__all__ = ["SandmanEnvironment", "SandmanEnvironmentConfig"]

log = logging.getLogger("minisweagent.environment")

# mini-swe-agent's environments keep all output (its templates cut what the model sees);
# execd keeps at most max_output bytes, head and tail. 1 MiB as the SWE-ReX adapter.
DEFAULT_MAX_OUTPUT = 1 << 20
# The first line that ends a run, as every mini-swe-agent environment checks it.
_SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
# What the templates get as `system`, `release`, ...: the sandbox's, as platform.uname() names
# them (DockerEnvironment hands the host's, which is not where the commands run).
_UNAME_FIELDS = ("system", "node", "release", "version", "machine")


class SandmanEnvironmentConfig(BaseModel):
    """mini-swe-agent's fields (as `DockerEnvironmentConfig`: cwd, env, forward_env, timeout,
    interpreter) plus what `client.acquire()` takes and where the controller is (default from
    $SANDMAN_URL, $SANDMAN_TOKEN_FILE, $SANDMAN_CA_FILE)."""

    image: str = ""
    """The sandbox's image (required unless the environment is given a sandbox)."""
    job: str = ""
    """The training job the sandbox is acquired for (required as `image`)."""
    cwd: str = ""
    """Where each command starts; "" is the sandbox's workspace."""
    env: dict[str, str] = {}
    """Variables set for each command (over `forward_env`'s)."""
    forward_env: list[str] = []
    """Variables of this process passed to each command, those that are set."""
    timeout: int = 30
    """Seconds a command may run when execute() is given none; then its processes are killed."""
    interpreter: list[str] = ["bash", "-lc"]
    """What runs the command text (DockerEnvironment's default: a login bash)."""
    cpu: str = api.DEFAULT_CPU
    memory: str = api.DEFAULT_MEMORY
    egress: str | dict[str, list[str]] = api.DEFAULT_EGRESS
    """"none", "open", or an allowlist {"allow": [...]} (docs/sdk.md)."""
    workspace: str | None = None
    namespace: str | None = None
    labels: dict[str, str] | None = None
    lifetime_s: float | None = None
    acquire_timeout_s: float = 300.0
    url: str | None = None
    token_file: str | None = None
    ca_file: str | None = None
    max_output: int = DEFAULT_MAX_OUTPUT
    """Bytes of a command's output kept (head and tail), at most execd's 64 MiB."""

    model_config = ConfigDict(extra="forbid")


class SandmanEnvironment:
    """Acquires a sandbox in the constructor (as DockerEnvironment starts its container there),
    runs each action in it, and releases it in `cleanup()` (also on `with` exit and, logged,
    when dropped without either). `sandbox=` runs on a sandbox acquired elsewhere, which
    cleanup() then leaves held; `client=` shares one `Client` between environments."""

    def __init__(self, *, config_class: type = SandmanEnvironmentConfig,
                 logger: logging.Logger | None = None, sandbox: Sandbox | None = None,
                 client: Client | None = None, **kwargs: Any) -> None:
        self.config = config_class(**kwargs)
        self.logger = logger or log
        self._client = client
        self._own_client = client is None and sandbox is None
        self._own_sandbox = sandbox is None
        self._uname: dict[str, str] | None = None
        self.sandbox: Sandbox | None = sandbox
        if sandbox is None:
            self.sandbox = self._acquire()
            self.logger.info("sandman sandbox %s (pod %s) acquired for %s", self.sandbox.id,
                             self.sandbox.pod, self.config.image)

    def _acquire(self) -> Sandbox:
        c = self.config
        if not c.image or not c.job:
            raise ValueError("SandmanEnvironment needs `image` and `job` to acquire a sandbox "
                             "(or `sandbox=` one acquired elsewhere)")
        if self._client is None:
            self._client = Client(c.url, token_file=c.token_file, ca_file=c.ca_file)
        try:
            return self._client.acquire(c.image, job=c.job, cpu=c.cpu, memory=c.memory,
                                        egress=c.egress, workspace=c.workspace,
                                        labels=c.labels, timeout_s=c.acquire_timeout_s,
                                        lifetime_s=c.lifetime_s, namespace=c.namespace)
        except BaseException:
            self._close_client()
            raise

    # ---- the Environment protocol

    def _script(self, command: str, cwd: str) -> str:
        """The shell text execd runs: the interpreter in a `( ... )` child of the persistent
        shell, so no action's cd or export reaches the next, as each `docker exec` starts
        anew; the command is one quoted argument, so a syntax error is the interpreter's
        (exit 2, its message in the output) as under Docker."""
        c = self.config
        env = {k: v for k in c.forward_env if (v := os.environ.get(k)) is not None}
        env.update(c.env)
        argv = " ".join(shlex.quote(a) for a in [*c.interpreter, command])
        if env:
            argv = "env " + " ".join(shlex.quote(f"{k}={v}") for k, v in env.items()) + " " + argv
        if cwd:  # a missing directory runs nothing, as `docker exec -w` refuses it
            argv = f"cd -- {shlex.quote(cwd)} && {argv}"
        # The outer 2>/dev/null is the shell's own: its "Killed" notice when a timeout killed
        # the child would otherwise print this wrapper into the output.
        return f"{{ ( {argv} ) 2>&1; }} 2>/dev/null"

    def execute(self, action: dict[str, Any], cwd: str = "", *,
                timeout: int | None = None) -> dict[str, Any]:
        """Run `action["command"]`; `{"output", "returncode", "exception_info"}` as mini-swe-agent's
        environments answer (a timeout: returncode -1 and subprocess's TimeoutExpired message,
        the output printed until then). Raises `Submitted` when the output's first line is
        the submit marker and the command succeeded."""
        command = action.get("command", "")
        limit = timeout or self.config.timeout
        try:
            if self.sandbox is None:
                raise RuntimeError("the environment was cleaned up: its sandbox is released")
            r = self.sandbox.exec(self._script(command, cwd or self.config.cwd), timeout=limit,
                                  max_output=self.config.max_output)
            output = self._answer(r)
        except CommandTimeout as e:
            expired = subprocess.TimeoutExpired(command, limit, output=e.result.output)
            output = self._failure(expired, e.result.output)
        except Exception as e:
            output = self._failure(e, "")
        self._check_finished(output)
        return output

    @staticmethod
    def _answer(r: ExecResult) -> dict[str, Any]:
        if r.exit_code < 0:  # execd could not read the status: no code to report
            return {"output": r.output, "returncode": -1,
                    "exception_info": f"An error occurred while executing the command: "
                                      f"{r.error or 'exit status unknown'}",
                    "extra": {"exception_type": "ExitStatusUnknown",
                              "exception": str(r.error or "")}}
        return {"output": r.output, "returncode": r.exit_code, "exception_info": ""}

    @staticmethod
    def _failure(e: BaseException, raw_output: str) -> dict[str, Any]:
        return {"output": raw_output, "returncode": -1,
                "exception_info": f"An error occurred while executing the command: {e}",
                "extra": {"exception_type": type(e).__name__, "exception": str(e)}}

    def _check_finished(self, output: dict[str, Any]) -> None:
        """Raises Submitted if the output indicates task completion (mini-swe-agent's rule)."""
        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == _SUBMIT and output["returncode"] == 0:
            submission = "".join(lines[1:])
            raise Submitted({"role": "exit", "content": submission,
                             "extra": {"exit_status": "Submitted", "submission": submission}})

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        """The config, the sandbox's uname (platform.uname()'s names), then `kwargs`."""
        return recursive_merge(self.config.model_dump(), self._sandbox_uname(), kwargs)

    def _sandbox_uname(self) -> dict[str, str]:
        if self._uname is None:
            if self.sandbox is None:
                return {}
            r = self.sandbox.exec("uname -s; uname -n; uname -r; uname -v; uname -m",
                                  timeout=30)
            lines = r.output.splitlines()
            if r.exit_code != 0 or len(lines) != len(_UNAME_FIELDS):
                raise RuntimeError(f"uname in sandbox {self.sandbox.id} failed: {r.output!r}")
            self._uname = dict(zip(_UNAME_FIELDS, lines))
        return self._uname

    def serialize(self) -> dict[str, Any]:
        sb = self.sandbox
        return {"info": {"config": {
            "environment": self.config.model_dump(mode="json"),
            "environment_type": f"{self.__class__.__module__}.{self.__class__.__name__}",
            "sandman": {"sandbox": sb.id if sb is not None else None,
                        "pod": sb.pod if sb is not None else None}}}}

    # ---- lifecycle

    def cleanup(self) -> None:
        """Releases the sandbox this environment acquired (idempotent) and closes the client
        it made; a sandbox given to it stays held."""
        sb, self.sandbox = self.sandbox, None
        try:
            if sb is not None and self._own_sandbox:
                sb.release()
        finally:
            self._close_client()

    def _close_client(self) -> None:
        if self._own_client and self._client is not None:
            client, self._client = self._client, None
            client.close()

    def __enter__(self) -> SandmanEnvironment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    def __del__(self) -> None:
        # mini-swe-agent's runners drop environments without a call (DockerEnvironment stops
        # its container in __del__). The sandbox's renewer thread would keep a forgotten lease
        # alive for the whole process: release it, from a thread, since a finalizer must not
        # block on the network.
        sb = getattr(self, "sandbox", None)
        if sb is None or not getattr(self, "_own_sandbox", False):
            return
        self.sandbox = None
        client = self._client if getattr(self, "_own_client", False) else None
        try:
            self.logger.warning("SandmanEnvironment dropped without cleanup(): releasing "
                                "sandbox %s", sb.id)
        except Exception:  # interpreter shutdown: logging may be gone
            pass
        _core.release_in_background(sb, client, "environment", log,
                                    "sandman-minisweagent-release")
