"""Processes of the test bed and of everything started next to it: one way to start, watch and
stop a process, the ports of what it starts, one wait.

Every process runs in its own session (a Ctrl-C on the terminal reaches only the parent, which
stops its children in order) and is stopped by its pid: SIGTERM to its process group, then
SIGKILL to the group after a timeout. Its stdout and stderr go to one log file.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


ROOT = repo_root()


# Ports. A server the tests start binds port 0 itself and reports the port it got (a log line
# read by `reported_port`); a URL where nothing may answer holds its port (`refused_port`). No
# helper hands out a port it has closed: the kernel gives a closed port to the next bind(0) or
# connect() on the machine, and a tier running beside took one (tests/test_ports.py keeps the
# pattern out). The bed's own components (etcd, kube-apiserver, kubelet...) need their ports
# on their command lines: `reserve_port`.
def reported_port(proc: Proc, pattern: str | re.Pattern, deadline: float, seen: int = 0) -> int:
    """The port a process started on port 0 reports in its log: the first group of `pattern`
    in the log after byte `seen` (where the log ended before the start). RuntimeError with the
    log's tail if the process exits first or `deadline` (time.monotonic()) passes."""
    rx = re.compile(pattern) if isinstance(pattern, str) else pattern
    while True:
        try:
            m = rx.search(proc.log.read_bytes()[seen:].decode(errors="replace"))
        except OSError:
            m = None
        if m:
            return int(m.group(1))
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited {proc.exit_code()} before it reported its "
                               f"port: {proc.tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{proc.name} reported no port in time: {proc.tail()}")
        time.sleep(0.02)


@contextlib.contextmanager
def refused_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A port on `host` where a connection is refused, for as long as the block runs: bound,
    never listening, so nothing else can listen there meanwhile."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        yield s.getsockname()[1]


_RESERVED: dict[int, int] = {}  # port -> the fd whose lock holds it, for this process's life
_RESERVE_DIR = Path("/tmp/sandman-ports")


def reserve_port(host: str = "127.0.0.1") -> int:
    """A port for a bed component that takes its port on its command line (etcd, the API
    server, the kubelet, ...), which cannot bind 0 and report: below the kernel's ephemeral
    range (so no bind(0) or outgoing connection on the machine is given it), free on `host`
    now, and held for this process's life by a lock in /tmp/sandman-ports that every other
    bed's reserve_port respects (two beds start side by side in `make test`)."""
    lo = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    _RESERVE_DIR.mkdir(mode=0o1777, exist_ok=True)
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(max(1024, lo - 12000), lo)
        if port in _RESERVED:
            continue
        fd = os.open(_RESERVE_DIR / f"{port}.lock", os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            try:
                s.bind((host, port))
            except OSError:
                os.close(fd)
                continue
        _RESERVED[port] = fd
        return port
    raise RuntimeError(f"no free port below {lo} on {host} after 200 tries")


def wait_for(pred, timeout: float, what: str, interval: float = 0.05):
    """`pred()`'s first truthy value, polled every `interval` s; AssertionError naming `what`
    after `timeout` s (a test reads it as a failed expectation, a tool prints it)."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def parents() -> dict[int, int]:
    """pid -> parent pid of every process, from /proc."""
    out: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            data = Path(f"/proc/{name}/stat").read_bytes()
        except OSError:
            continue
        out[int(name)] = int(data[data.rfind(b")") + 2:].split()[1])
    return out


def _children(pid: int, parent: dict[int, int] | None) -> list[int]:
    if parent is not None:
        return [c for c, pp in parent.items() if pp == pid]
    out: list[int] = []
    try:  # every thread's children (a child belongs to the thread that forked it)
        for task in os.listdir(f"/proc/{pid}/task"):
            out += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    except OSError:
        pass
    return out


def descendants(pid: int, parent: dict[int, int] | None = None) -> list[int]:
    """Every live descendant of `pid`, also those that left its session. Read from
    /proc/<pid>/task/*/children, or from `parent` (see `parents()`) when given."""
    if parent is None and not Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists():
        parent = parents()  # a kernel without CONFIG_PROC_CHILDREN: one pass over /proc
    out: list[int] = []
    seen = {pid}
    stack = [pid]
    while stack:
        for c in _children(stack.pop(), parent):
            if c not in seen:
                seen.add(c)
                out.append(c)
                stack.append(c)
    return out


def pid_runs(pid: int, exe: str) -> bool:
    """True when `pid` is alive (not a zombie) and still runs `exe`: a recycled pid is never
    signalled."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state != "Z" and Path(cmdline).name == Path(exe).name


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes whose process group is `pgid`, from /proc."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fields = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(name))
    return out


@dataclass
class Proc:
    """One process: `start()` runs `cmd` in its own session with output to `log`.

    A Proc made with only a `pid` (no `start()`) is one that another process started (the test
    bed's `up` recorded it): `alive()` and `stop()` work on it by pid.
    """

    name: str
    cmd: list[str]
    log: Path
    cwd: Path | None = None  # default: the repository root
    env: dict[str, str] | None = None  # added to this process's environment
    proc: subprocess.Popen | None = None
    pid: int | None = None

    def start(self) -> Proc:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen(
                self.cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=self.cwd or ROOT, start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(self.env or {})})
        self.pid = self.proc.pid
        return self

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return self.pid is not None and pid_runs(self.pid, self.cmd[0])

    def exit_code(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def wait(self, timeout: float | None = None) -> int:
        """The exit code; subprocess.TimeoutExpired after `timeout` s."""
        return self.proc.wait(timeout)

    def tail(self, chars: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def send(self, sig: int) -> None:
        """`sig` to the process group (the process and whatever it started in its session)."""
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            pass

    def group_alive(self) -> bool:
        """Any live (not zombie) process left in this process's group: the leader exits
        first, its children may still be on their way out."""
        return self.alive() or (self.pid is not None and bool(group_members(self.pid)))

    def stop(self, timeout: float = 20.0, sig: int = signal.SIGTERM) -> None:
        """`sig` (SIGTERM) to the group, wait up to `timeout` s until every member has exited,
        then SIGKILL the group."""
        if self.pid is None or not self.group_alive():
            if self.proc is not None:
                self.proc.poll()
            return
        self.send(sig)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.group_alive():
            time.sleep(0.05)
        if self.group_alive():
            self.send(signal.SIGKILL)
            end = time.monotonic() + 5
            while time.monotonic() < end and self.group_alive():
                time.sleep(0.05)
        if self.proc is not None:
            self.proc.wait(timeout=1)

    def kill(self) -> None:
        """SIGKILL to the group at once: a crash, nothing in flight finishes."""
        self.stop(timeout=0, sig=signal.SIGKILL)
