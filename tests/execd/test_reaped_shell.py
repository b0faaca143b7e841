"""A shell execd has reaped is gone, and so is its pid: the kernel hands the number to the next
process (pid_max is 32768 on many machines: it wraps within minutes under load). Every signal
execd sends to a shell or its process group is sent only while the shell is unreaped; here a
stranger holds the reaped shell's number, as the next process would, and must not be touched
by the kill path's freeze, skip, thaw, kill or resume."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from execd.execd_daemon import procs, shell


class _Daemon:
    """The one part of execd a Shell's signals read: its reaper."""

    def __init__(self) -> None:
        self.reaper = procs.Reaper()


def _state(pid: int) -> str:
    data = Path(f"/proc/{pid}/stat").read_bytes()
    return data[data.rfind(b")") + 2:].split()[0].decode()


@pytest.fixture
def stranger():
    """A process group leader of someone else's, holding the number a reaped shell had."""
    p = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        yield p
    finally:
        p.kill()
        p.wait(5)


def _reaped_shell_with_the_strangers_pid(pid: int) -> shell.Shell:
    sh = shell.Shell(_Daemon())
    sh.pid = pid
    sh.d.reaper.watched[pid] = 0  # reaped, exit status 0: the number is free for anyone
    return sh


@pytest.mark.parametrize("step", ["freeze", "abort", "kill", "thaw"])
def test_a_reaped_shells_number_reaches_no_stranger(stranger, step):
    sh = _reaped_shell_with_the_strangers_pid(stranger.pid)
    if step == "freeze":
        sh.freeze(lambda: ())
    elif step == "abort":
        sh.abort()
    elif step == "kill":
        sh.kill()
    else:
        subprocess.run(["kill", "-STOP", str(stranger.pid)], check=True)  # stopped by its owner
        sh.thaw(set())
    time.sleep(0.2)  # a signal is delivered at once; give the state time to show in /proc
    assert stranger.poll() is None, f"the stranger was killed ({stranger.returncode})"
    want = "T" if step == "thaw" else "S"
    assert _state(stranger.pid) == want, f"{step}: the stranger is now {_state(stranger.pid)!r}"


def test_an_unreaped_shells_group_is_still_frozen_and_thawed(stranger):
    """The guard keeps the kill path working while the shell lives (the control)."""
    sh = shell.Shell(_Daemon())
    sh.pid = stranger.pid
    sh.d.reaper.watched[stranger.pid] = None  # running
    held = sh.freeze(lambda: ())
    time.sleep(0.2)
    assert _state(stranger.pid) == "T"
    sh.thaw(held)
    time.sleep(0.2)
    assert _state(stranger.pid) == "S"
