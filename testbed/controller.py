"""The controller (`python -m controller serve`) as a local process on 127.0.0.1 against the
test bed (or any kubeconfig).

    ctl = ControllerProc(namespace, kubeconfig, log, ["--rate", "20"]).start()
    httpx.post(ctl.url + api.ACQUIRE.path, json=...)   # paths: sandman/api.py
    ctl.kill()   # SIGKILL: a crash        ctl.stop()   # SIGTERM: a clean shutdown

`--ready-check pod` by default: kwok pods run nothing, so `execd` needs a real execd at the pod
IP (testbed/standin.py). `--auth none` by default, said on the command line (the controller's
own default is `kubernetes`): tests where authentication is the point pass `auth="kubernetes"`
(tests/controller/test_auth.py), and a chart's rendered args carry their own `--auth`.

TLS: `tls=DIR` (tls.crt, tls.key, ca.crt, e.g. from `local_tls_dir()`: names 127.0.0.1 and
localhost) serves https and `url` says so; `verify()` is what a client checks it with. Without
it, `--auth kubernetes` gets `--insecure-http`, said on the command line (the controller
refuses plain http with authentication otherwise).
"""

from __future__ import annotations

import ssl
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from sandman import api
from testbed.procs import Proc, reported_port

# What the controller prints once it listens (sandman's `controller serve`, either log format).
_SERVING = r"controller: serving https?://[^\s\"]+:(\d+)"


@dataclass
class ControllerProc:
    namespace: str | None  # None: `flags` carry --namespace (a chart's rendered args)
    kubeconfig: Path
    log: Path
    flags: list[str] = field(default_factory=list)  # last on the command line: they override
    port: int = 0  # 0: the port the controller binds at the first start; kept across restarts
    ready_check: str | None = "pod"  # None: the controller's own default (execd) or `flags`
    auth: str | None = "none"  # None: the controller's own default (kubernetes) or `flags`
    # off: the bed's task images are in no registry (kwok pulls nothing); None: the
    # controller's own default (resolve) or `flags`
    image_pinning: str | None = "off"
    cwd: Path | None = None  # the tree whose controller/ runs (default: this repository)
    tls: Path | None = None  # a directory of tls.crt, tls.key, ca.crt: serve https
    proc: Proc | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def verify(self) -> ssl.SSLContext | bool:
        """What a client verifies this controller with (its CA when serving https)."""
        return ssl.create_default_context(cafile=str(self.tls / "ca.crt")) if self.tls else True

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "controller", "serve", "--kubeconfig", str(self.kubeconfig),
               "--listen", f"127.0.0.1:{self.port}"]
        if self.namespace is not None:
            cmd += ["--namespace", self.namespace]
        if self.ready_check is not None:
            cmd += ["--ready-check", self.ready_check]
        if self.auth is not None:
            cmd += ["--auth", self.auth]
        if self.image_pinning is not None:
            cmd += ["--image-pinning", self.image_pinning]
        if self.tls:
            cmd += ["--tls-cert-file", str(self.tls / "tls.crt"),
                    "--tls-key-file", str(self.tls / "tls.key"),
                    "--tls-ca-file", str(self.tls / "ca.crt")]
        elif self.auth == "kubernetes":
            cmd += ["--insecure-http"]
        return cmd + list(self.flags)

    def start(self, wait_ready: bool = True, timeout: float = 30,
              role: str | None = "leader") -> ControllerProc:
        """Start (or restart, on the same port and log) the process; with `wait_ready`,
        return once /readyz answers 200 with `role` (see wait_ready). The first start binds
        port 0 (or the port `flags`' --listen gives) and reads the port the controller
        printed: no port is probed and closed first, which another process could take."""
        for attempt in range(5):
            seen = self.log.stat().st_size if self.log.exists() else 0
            self.proc = Proc("controller", self.command(), self.log, cwd=self.cwd).start()
            try:
                self.port = reported_port(self.proc, _SERVING, time.monotonic() + timeout, seen)
                break
            except RuntimeError:
                self.proc.stop(timeout=5)
                # A restart on its port: what took the port since (an outgoing connection's
                # local port) may let it go; bounded retries.
                new = self.log.read_bytes()[seen:].decode(errors="replace")
                if "Address already in use" not in new or attempt == 4:
                    raise
                time.sleep(0.25 * (attempt + 1))
        if wait_ready:
            self.wait_ready(timeout, role)
        return self

    def wait_ready(self, timeout: float = 30, role: str | None = "leader") -> None:
        """Until /readyz answers 200 with `role` ("leader", "standby"; None: either). A standby
        is Ready too (it forwards to the leader), so callers that mean "this one leads and its
        books are built" wait for the role: a restarted controller is a Ready standby until
        the killed one's lease lapses."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.proc.alive():
                raise RuntimeError(f"controller exited {self.proc.exit_code()}: {self.tail()}")
            try:
                r = httpx.get(self.url + api.READYZ.path, timeout=1, verify=self.verify())
                if r.status_code == 200 and role in (None, r.json().get("role")):
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"controller not ready ({role or 'any role'}) after {timeout:g}s: "
                           f"{self.tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()

    def tail(self, chars: int = 2000) -> str:
        return self.proc.tail(chars) if self.proc else ""

    def kill(self) -> None:
        """SIGKILL: a crash, nothing in flight finishes."""
        if self.proc:
            self.proc.kill()

    def stop(self, timeout: float = 15) -> None:
        """SIGTERM (it releases its Lease), SIGKILL after `timeout` s."""
        if self.proc:
            self.proc.stop(timeout)


_LOCAL_TLS: Path | None = None
_LOCAL_TLS_DIR: tempfile.TemporaryDirectory | None = None  # removed at exit


def local_tls_dir() -> Path:
    """A CA and a serving pair for 127.0.0.1 and localhost (tls.crt, tls.key, ca.crt), made
    once per process in a temporary directory (removed at exit)."""
    global _LOCAL_TLS, _LOCAL_TLS_DIR
    if _LOCAL_TLS is None:
        from webhook.certs import self_signed_dir

        _LOCAL_TLS_DIR = tempfile.TemporaryDirectory(prefix="sandman-ctl-tls-")
        _LOCAL_TLS = Path(self_signed_dir(_LOCAL_TLS_DIR.name, ["localhost"], ["127.0.0.1"]))
    return _LOCAL_TLS


def start_controller(namespace: str, kubeconfig: Path, log: Path, flags: list[str] = (),
                     ready_check: str = "pod", timeout: float = 30) -> ControllerProc:
    """A ready controller for `namespace` on the port it bound (port 0)."""
    return ControllerProc(namespace, kubeconfig, log, list(flags),
                          ready_check=ready_check).start(timeout=timeout)
