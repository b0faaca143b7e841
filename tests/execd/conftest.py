"""execd as a real subprocess on 127.0.0.1, a free port, real bash; nothing outlives a test.

Every execd gets a unique run id in its environment (inherited by its shell and by everything the
shell starts, unless a test clears the environment on purpose) and as its instance id (execd tags
each command's processes with it). The finalizer stops execd, then kills whatever still carries
the run id or descends from execd, so a failing test leaks no process.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
EXECD = REPO / "execd" / "execd.py"
TOKEN = "test-token-" + secrets.token_hex(8)
TOKEN_SHA256 = hashlib.sha256(TOKEN.encode()).hexdigest()
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def proc_env_has(pid: int, needle: bytes) -> bool:
    try:
        return needle in Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False


def proc_ppid(pid: int) -> int | None:
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
        return int(data[data.rfind(b")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def proc_state(pid: int) -> str | None:
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
        return data[data.rfind(b")") + 2:].split()[0].decode()
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    st = proc_state(pid)
    return st is not None and st != "Z"


def descendants(root: int) -> set[int]:
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            pp = proc_ppid(int(name))
            if pp is not None:
                kids.setdefault(pp, []).append(int(name))
    out: set[int] = set()
    stack = [root]
    while stack:
        for c in kids.get(stack.pop(), []):
            if c not in out:
                out.add(c)
                stack.append(c)
    return out


def run_pids(run_id: str) -> set[int]:
    needle = f"EXECD_TEST_RUN={run_id}".encode()
    me = os.getpid()
    return {int(n) for n in os.listdir("/proc")
            if n.isdigit() and int(n) != me and proc_env_has(int(n), needle)}


def wait_for(pred, timeout: float = 5.0, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() > deadline:
            return v
        time.sleep(interval)


class Execd:
    def __init__(self, proc: subprocess.Popen, port: int, run_id: str, log: Path):
        self.proc = proc
        self.port = port
        self.run_id = run_id
        self.log = log
        self.url = f"http://127.0.0.1:{port}"
        self.client = httpx.Client(base_url=self.url, headers=AUTH, timeout=60)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exec(self, command: str, **kw) -> dict:
        r = self.client.post("/exec", json={"command": command, **kw},
                             timeout=kw.get("timeout", 300) + 30)
        assert r.status_code == 200, r.text
        return r.json()

    def post(self, path: str, body=None, **kw) -> httpx.Response:
        return self.client.post(path, json=body, **kw)

    def get(self, path: str, **kw) -> httpx.Response:
        return self.client.get(path, **kw)

    def state(self) -> dict:
        r = self.get("/state")
        assert r.status_code == 200, r.text
        return r.json()

    def shell_pid(self) -> int:
        return self.state()["shell_pid"]

    def others(self) -> list[int]:
        """Live processes of this run other than execd and its current shell."""
        shell = self.shell_pid()
        pids = run_pids(self.run_id) | descendants(self.pid)
        return sorted(p for p in pids if p not in (self.pid, shell) and alive(p))

    def rss_hwm_kib(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
        raise AssertionError("no VmHWM")

    def reset_hwm(self) -> int:
        """Restart VmHWM from the RSS now (clear_refs 5) and return that RSS: the fixture runs
        execd.py as a script, whose compile peak (growing with the file) would otherwise hide
        or exceed what a flood costs. Peaks are then asserted as growth over rest."""
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")
        return self.rss_kib()

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def stop(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            try:  # the group: with an `unshare` prefix, execd itself must get the SIGTERM
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        # Whatever execd did not clean up: kill it, then report it.
        leftovers = run_pids(self.run_id) | descendants(self.pid)
        for p in leftovers:
            try:
                os.kill(p, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def start_execd(tmp_path: Path, *args: str, env: dict | None = None, token: bool = True,
                python: str = sys.executable, prefix: tuple[str, ...] = ()) -> Execd:
    run_id = secrets.token_hex(6)
    e = {k: v for k, v in os.environ.items() if k != "SANDMAN_TOKEN_SHA256"}
    # An empty HOME of its own: the machine's ~/.bashrc is not the image's (one that runs
    # `pyenv init` kept an interactive bash from ever printing its prompt).
    home = tmp_path / f"home-{run_id}"
    home.mkdir()
    e.update({"EXECD_TEST_RUN": run_id, "SANDMAN_EXECD_INSTANCE": run_id,
              "SANDMAN_NETGUARD_STATUS": str(tmp_path / "netguard.json"), "HOME": str(home)})
    if token:
        e["SANDMAN_TOKEN_SHA256"] = TOKEN_SHA256
    if env:
        e.update(env)
    log = tmp_path / f"execd-{run_id}.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([*prefix, python, str(EXECD), "--listen", "127.0.0.1:0", *args],
                                stdout=f, stderr=subprocess.STDOUT, env=e, cwd=tmp_path,
                                start_new_session=True)
    port = None
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        m = re.search(rb"listening on 127\.0\.0\.1:(\d+)", log.read_bytes())
        if m:
            port = int(m.group(1))
            break
        if proc.poll() is not None:
            break
        time.sleep(0.01)
    d = Execd(proc, port or 0, run_id, log)
    if port is None:
        d.stop()
        raise AssertionError(f"execd did not start: {log.read_text(errors='replace')}")
    return d


@pytest.fixture
def execd_factory(tmp_path):
    started: list[Execd] = []

    def start(*args: str, **kw) -> Execd:
        d = start_execd(tmp_path, *args, **kw)
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()
    # No process of any execd of this test may survive its finalizer.
    leaked = {p for d in started for p in run_pids(d.run_id) if alive(p)}
    assert not leaked, f"leaked processes: {leaked}"


@pytest.fixture
def execd(execd_factory, tmp_path) -> Execd:
    ws = tmp_path / "ws"
    ws.mkdir()
    return execd_factory("--workspace", str(ws), "--kill-grace", "0.5")
