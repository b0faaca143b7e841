"""SIGTERM (the kubelet stopping the pod, or a node drain) leaves nothing of the sandbox behind:
execd kills its shell and everything the agent started, background jobs, double-forked and
setsid'd children included, before it exits. Checked here before the fixture's own SIGKILL
sweep, which would otherwise hide a shutdown that leaves processes running."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import httpx

from .conftest import AUTH, alive, descendants, run_pids, wait_for
from .test_routes import kill_quietly


def start_ticks(pid: int) -> int | None:
    """The process's start time: a pid freed by the shutdown may be reused by someone else."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
        return int(data[data.rfind(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def session_of(pid: int) -> int | None:
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
        return int(data[data.rfind(b")") + 2:].split()[3])
    except (OSError, ValueError, IndexError):
        return None


def live_in_sessions(sessions: set[int]) -> set[int]:
    return {int(n) for n in os.listdir("/proc")
            if n.isdigit() and session_of(int(n)) in sessions and alive(int(n))}


def test_sigterm_leaves_no_process_of_the_sandbox(execd, tmp_path, request):
    f = tmp_path / "pids"
    execd.exec(f"sleep 1000 & echo $! >> {f}")
    execd.exec(f"setsid -f bash -c 'echo $$ >> {f}; exec sleep 1000'")
    execd.exec(f"env -i setsid -f /bin/sh -c 'echo $$ >> {f}; exec sleep 1000'")  # untagged
    execd.exec(f"(trap '' TERM HUP; echo $BASHPID >> {f}; exec sleep 1000) &")
    execd.exec("bash -c 'sleep 0.05 & exec sleep 1000' &")  # its zombie child is never reaped
    assert wait_for(lambda: f.exists() and len(f.read_text().split()) == 4, 5)
    started = [int(x) for x in f.read_text().split()]
    request.addfinalizer(lambda: [kill_quietly(p) for p in started])  # env -i drops the run id

    # A command still running when the signal comes.
    in_flight = threading.Thread(target=lambda: _exec_quietly(execd.url, "sleep 1000"),
                                 daemon=True)
    in_flight.start()
    # The four above, `exec sleep 1000` of the bash -c, and the command in flight.
    assert wait_for(lambda: len(execd.others()) >= 6, 5), execd.others()

    tree = descendants(execd.pid) | run_pids(execd.run_id) | set(started)
    tree.discard(execd.pid)
    assert set(started) <= tree and execd.shell_pid() in tree
    ticks = {p: start_ticks(p) for p in tree}
    sessions = {session_of(p) for p in tree} | {execd.pid}
    sessions.discard(os.getsid(0))
    sessions.discard(None)

    os.kill(execd.pid, signal.SIGTERM)
    execd.proc.wait(15)

    def left() -> set[int]:
        same = {p for p, t in ticks.items() if alive(p) and start_ticks(p) == t}
        return same | run_pids(execd.run_id) | live_in_sessions(sessions)

    wait_for(lambda: not left(), 5)
    assert left() == set(), {p: _cmdline(p) for p in left()}
    in_flight.join(5)


def _exec_quietly(url: str, command: str) -> None:
    try:
        httpx.post(url + "/exec", json={"command": command, "timeout": 1000}, headers=AUTH,
                   timeout=60)
    except httpx.HTTPError:
        pass  # execd went away mid-call: what the test does


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "?"


def test_a_call_killed_by_the_stop_never_reads_as_its_own_death(execd_factory, tmp_path):
    """A suite killed by the pod's stop (the kubelet's SIGTERM to execd) answered a bare exit
    137 and execd went on serving while it stopped: the grader read "no report" in a pod that
    was going away and graded failed, not no_verdict. A call answered during the stop now says
    so in its error; nothing else is served (503) or the connection just ends. Several times:
    whether the answer leaves before execd exits is a race."""
    def run(d, got: list, fresh: bool) -> None:
        body = {"command": "sleep 1000", "timeout": 1000}
        if fresh:
            body.update(fresh=True, cwd=str(tmp_path))
        try:
            got.append(httpx.post(d.url + "/exec", json=body, headers=AUTH, timeout=60))
        except httpx.HTTPError as e:
            got.append(e)

    for i in range(4):
        d = execd_factory()
        got: list = []
        t = threading.Thread(target=run, args=(d, got, i % 2 == 0), daemon=True)
        t.start()
        assert wait_for(lambda d=d: len(d.others()) >= 1, 5), d.others()  # the sleep runs
        os.kill(d.pid, signal.SIGTERM)
        t.join(30)
        d.proc.wait(15)
        (r,) = got
        if isinstance(r, httpx.Response):
            assert r.status_code != 200 or "execd is stopping" in (r.json()["error"] or ""), \
                (i, r.text)
