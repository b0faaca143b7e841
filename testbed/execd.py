"""execd (execd/execd.py) as a local process on a loopback address: the command line the test
bed uses for it, and a starter that waits for /health.

This is the host's Python running the repository's execd.py, not a pod; testbed/standin.py
lists what that leaves out.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
import secrets
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from testbed.procs import ROOT, Proc, descendants, reported_port

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


# What execd prints once it listens (port 0 in --listen: the port the kernel gave it).
LISTENING = re.compile(r"^execd \S+ listening on \S+:(\d+) ", re.M)


def start_execd(workdir: Path, *extra: str, address: str = "127.0.0.1",
                token: str | None = None, timeout: float = 15.0, port: int = 0,
                cmd: list[str] | None = None, env: dict[str, str] | None = None,
                log: Path | None = None) -> Execd:
    """A real execd on `address` and the port it binds (port 0: the kernel's choice, read from
    its "listening on" line; nothing else can take it in between) with `token` (default: a
    random one), its workspace and log in `workdir`; returns once /health answers 200. `cmd`
    replaces the command line (another interpreter, a launcher: it must listen on
    `address`:`port` and print execd's line); `env` is added to its environment; `log`
    replaces workdir/execd-<port or random>.log. A fixed
    `port` in use is retried a few times (a previous holder's socket may still be closing)."""
    workdir.mkdir(parents=True, exist_ok=True)
    token = token or secrets.token_urlsafe(24)
    digest = hashlib.sha256(token.encode()).hexdigest()
    if cmd is None:
        cmd = execd_cmd(address, port, digest, "--workspace", str(workdir), *extra)
    log = log or workdir / f"execd-{port or secrets.token_hex(4)}.log"
    for attempt in range(5):
        seen = log.stat().st_size if log.exists() else 0
        proc = Proc("execd", cmd, log, cwd=workdir, env=env).start()
        deadline = time.monotonic() + timeout
        try:
            got = reported_port(proc, LISTENING, deadline, seen)
        except RuntimeError:
            in_use = "Address already in use" in log.read_bytes()[seen:].decode(errors="replace")
            Execd(proc, port, token, workdir, address).stop()
            if in_use and attempt < 4:
                time.sleep(0.2 * (attempt + 1))
                continue
            raise
        ex = Execd(proc, got, token, workdir, address)
        while True:
            try:
                if httpx.get(f"{ex.url}/health", timeout=1, trust_env=False).status_code == 200:
                    return ex
            except httpx.TransportError:
                pass
            if not proc.alive() or time.monotonic() > deadline:
                ex.stop()
                raise RuntimeError(f"execd did not answer /health: {proc.tail()}")
            time.sleep(0.02)
    raise AssertionError("unreachable")
