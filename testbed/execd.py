"""execd (execd/execd.py) as a local process on a loopback address: the command line the test
bed uses for it, and a starter that waits for /health.

This is the host's Python running the repository's execd.py, not a pod; testbed/standin.py
lists what that leaves out.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import secrets
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from testbed.procs import ROOT, Proc, descendants, free_port

EXECD = ROOT / "execd" / "execd.py"


def execd_cmd(address: str, port: int, token_sha256: str, *extra: str) -> list[str]:
    """`python3 execd/execd.py --listen address:port --token-sha256 ...`; refuses any address
    outside 127.0.0.0/8 and ::1: nothing the test bed starts listens on a real network."""
    if not ipaddress.ip_address(address).is_loopback:
        raise ValueError(f"execd on {address}: the test bed serves loopback addresses only")
    host = f"[{address}]" if ":" in address else address
    return [sys.executable, str(EXECD), "--listen", f"{host}:{port}",
            "--token-sha256", token_sha256, *extra]


@dataclass
class Execd:
    proc: Proc
    port: int
    token: str
    workdir: Path
    address: str = "127.0.0.1"

    @property
    def log(self) -> Path:
        return self.proc.log

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.port}"

    def alive(self) -> bool:
        return self.proc.alive()

    def stop(self) -> None:
        """SIGTERM to execd (it ends its commands), then SIGKILL to anything it started that
        is still there, found from /proc: command groups leave execd's session."""
        kids = descendants(self.proc.pid) if self.proc.pid else []
        self.proc.stop(timeout=5)
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def start_execd(workdir: Path, *extra: str, address: str = "127.0.0.1",
                token: str | None = None, timeout: float = 15.0) -> Execd:
    """A real execd on `address` and a free port with `token` (default: a random one), its
    workspace and log in `workdir`; returns once /health answers 200."""
    workdir.mkdir(parents=True, exist_ok=True)
    token = token or secrets.token_urlsafe(24)
    digest = hashlib.sha256(token.encode()).hexdigest()
    last = ""
    for _ in range(3):  # a free port can be taken between probe and bind: bounded retries
        port = free_port(address)
        proc = Proc("execd", execd_cmd(address, port, digest, "--workspace", str(workdir),
                                       *extra), workdir / f"execd-{port}.log", cwd=workdir)
        ex = Execd(proc.start(), port, token, workdir, address)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.alive():
            try:
                if httpx.get(f"{ex.url}/health", timeout=1, trust_env=False).status_code == 200:
                    return ex
            except httpx.TransportError:
                time.sleep(0.05)
        last = proc.tail()
        ex.stop()
    raise RuntimeError(f"execd did not start: {last}")
