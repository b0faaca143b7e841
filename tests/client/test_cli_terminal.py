"""The command-line client as people drive it, against a real execd (tests/client/conftest.py)
through a lease file that points at it: options anywhere and `--`, exit codes (the docs'
table against the CLI's constants), JSON errors, `--version`, completion, the interactive
`shell` on a real pseudo-terminal (stopped or killed while it opens its session: nothing left
in the sandbox), and control sequences from the sandbox kept off the operator's terminal."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import secrets
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from sandman.client import Sandbox, cli
from sandman.client import errors as E
from sandman.client.models import Lease
from sandman.execd_api import SESSION_OPEN

from .test_sdk_session import held_open, marked, wait_marked

REPO = Path(__file__).resolve().parents[2]
SID = "0123456789abcdef"
# An OSC 52 clipboard write, a title change and a screen clear: none may reach a terminal.
ATTACK = r"printf '\033]52;c;cm0gLXJmIH4K\007\033]0;pwned\007\033[2Jafter\n'"


def _env(execd, tmp_path: Path, port: int) -> dict[str, str]:
    """The CLI's environment, with a lease for SID at execd's token and `port` (execd's, or a
    proxy's in front of it)."""
    leases = tmp_path / "leases"
    os.environ[cli.ENV_LEASE_DIR] = str(leases)
    try:
        cli.save_lease(Lease.from_json({"id": SID, "pod": "sbx-cli", "address": execd.address,
                                        "port": port, "token": execd.token, "warm": False}))
    finally:
        del os.environ[cli.ENV_LEASE_DIR]
    home = tmp_path / "home"
    home.mkdir()
    e = {**os.environ, cli.ENV_LEASE_DIR: str(leases), "HOME": str(home),
         "SANDMAN_URL": "http://127.0.0.1:9"}
    e.pop("SANDMAN_TOKEN_FILE", None)
    return e


@pytest.fixture
def env(execd, tmp_path):
    return _env(execd, tmp_path, execd.port)


def sandman(env, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sandman.client", *argv], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)


def test_options_go_anywhere_before_the_command(env):
    r = sandman(env, "exec", SID, "--idle-timeout", "60", "--", "echo", "--idle-timeout")
    assert (r.returncode, r.stdout) == (0, "--idle-timeout\n"), r.stderr
    # Without `--` the command starts at the first word after the id that is no option.
    r = sandman(env, "exec", "--timeout", "30", SID, "-o", "json", "printf", "%s|", "-o", "x")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == '-o|x|{"exit_code": 0, "error": null, "timed_out": false}'
    r = sandman(env, "get", "x", "--url", "ftp://x")  # a global option after the command's
    assert r.returncode == cli.EXIT_CONFIG and "ftp://x" in r.stderr


def test_the_command_status_passes_through_and_a_timeout_is_124(env):
    assert sandman(env, "exec", SID, "--", "exit 7").returncode == 7
    r = sandman(env, "-o", "json", "exec", SID, "--timeout", "1", "--", "sleep 30")
    assert r.returncode == cli.EXIT_TIMEOUT == 124
    assert json.loads(r.stdout.splitlines()[-1])["timed_out"] is True  # after the output
    # The command's own 124 is the same status; -o json tells the two apart.
    r = sandman(env, "-o", "json", "exec", SID, "--", "exit 124")
    assert (r.returncode, json.loads(r.stdout)["timed_out"]) == (124, False)


def test_errors_under_json_are_one_object_with_their_code(env):
    r = sandman(env, "-o", "json", "exec", "nolease", "--", "true")
    assert r.returncode == cli.EXIT_NOT_FOUND
    assert json.loads(r.stdout) == {"error": {"type": "CliError", "message": json.loads(
        r.stdout)["error"]["message"], "exit_code": cli.EXIT_NOT_FOUND}}
    assert r.stderr.startswith("sandman: error: no lease for nolease")
    r = sandman(env, "exec", "--no-such-option", "-o", "json", SID, "--", "true")
    err = json.loads(r.stdout)["error"]
    assert r.returncode == err["exit_code"] == cli.EXIT_USAGE and err["type"] == "UsageError"
    r = sandman(env, "frob")
    assert r.returncode == cli.EXIT_USAGE and r.stdout == ""


def test_version(env):
    from sandman._version import __version__

    r = sandman(env, "--version")
    assert (r.returncode, r.stdout.strip()) == (0, f"sandman {__version__}")


def _complete(script: str, *words: str) -> list[str]:
    line = " ".join(words)
    prog = (f'{script}\nCOMP_WORDS=({line}); COMP_CWORD={len(words) - 1}\n'
            f'_sandman_complete; printf "%s\\n" "${{COMPREPLY[@]}}"\n')
    r = subprocess.run(["bash", "--norc", "--noprofile", "-c", prog], capture_output=True,
                       text=True, timeout=30, env={"HOME": "/nonexistent", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_completion_scripts_parse_and_complete(env):
    for shell in ("bash", "zsh"):
        r = sandman(env, "completion", shell)
        assert r.returncode == 0
        if shell == "bash":
            script = r.stdout
            n = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
            assert n.returncode == 0, n.stderr
    assert _complete(script, "sandman", "e") == ["exec"]
    assert set(_complete(script, "sandman", "")) >= {"exec", "shell", "cp", "acquire"}
    assert _complete(script, "sandman", "-o", "json", "exec", "x", "--idle") == ["--idle-timeout"]
    assert "--version" in _complete(script, "sandman", "--v")


def _pty_run(env, *argv: str, size: tuple[int, int] = (24, 80)) -> tuple[int, int]:
    pid, master = pty.fork()
    if pid == 0:  # the child: the CLI with the pty as its terminal
        os.chdir(REPO)
        os.execve(sys.executable, [sys.executable, "-m", "sandman.client", *argv], env)
    fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", size[0], size[1], 0, 0))
    return pid, master


def _read_until(master: int, pattern: bytes, timeout: float = 20) -> bytes:
    got = b""
    deadline = time.monotonic() + timeout
    while not re.search(pattern, got):
        left = deadline - time.monotonic()
        assert left > 0, f"{pattern!r} not seen: {got[-500:]!r}"
        if select.select([master], [], [], left)[0]:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                break
            if not chunk:
                break
            got += chunk
    return got


def _wait(pid: int, master: int, timeout: float = 20) -> int:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            raise AssertionError("the CLI did not exit")
        if select.select([master], [], [], 0.1)[0]:
            try:
                os.read(master, 4096)
            except OSError:
                pass


def test_exec_output_to_a_terminal_is_neutralised_unless_raw(env):
    pid, master = _pty_run(env, "exec", SID, "--", ATTACK)
    out = _read_until(master, rb"after")
    assert _wait(pid, master) == 0
    assert b"\x1b" not in out and b"\x07" not in out, out
    assert b"^[]52;c;" in out and b"^[]0;pwned^G" in out and b"^[[2J" in out
    pid, master = _pty_run(env, "exec", "--raw", SID, "--", ATTACK)
    out = _read_until(master, rb"after")
    assert _wait(pid, master) == 0
    assert b"\x1b]52;c;" in out  # asked for: as it came
    # Not a terminal: the bytes are data for a program, as they came.
    r = sandman(env, "exec", SID, "--", ATTACK)
    assert r.stdout.startswith("\x1b]52;c;")


def test_neutral_and_the_terminal_filter():
    assert cli.neutral("a\x1b[2Jb\tc\r\n\x9b\x7f") == "a^[[2Jb\tc\r\n\\x9b^?"
    f = cli.TerminalFilter()
    # Split anywhere: the state carries over.
    text = "\x1b[1;31mred\x1b[0m \x1b]52;c;abc\x07\x1b]0;t\x1b\\ok\x1b[8;1;1t\x1b=\x9d2;x\x9c!"
    out = "".join(f.feed(ch) for ch in text)
    assert out == "\x1b[1;31mred\x1b[0m ok\x1b=!"


def _stacks(pid: int, master: int) -> str:
    """The CLI's Python stacks (faulthandler on SIGABRT, into its terminal): where it is
    stuck, for a failure's message."""
    os.kill(pid, signal.SIGABRT)
    got, end = b"", time.monotonic() + 3
    while time.monotonic() < end and select.select([master], [], [], 0.2)[0]:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        got += chunk
    return got.decode(errors="replace")[-4000:]


def _sized(pid: int, master: int, rows: int, cols: int) -> None:
    """`stty size` in the sandbox says rows x cols within 10 s (asked again each second)."""
    deadline = time.monotonic() + 10
    while True:
        os.write(master, b"stty size\r")
        try:
            _read_until(master, rb"%d %d" % (rows, cols), timeout=1)
            return
        except AssertionError:
            if time.monotonic() >= deadline:
                raise AssertionError("the resize never arrived; the CLI's stacks:\n"
                                     + _stacks(pid, master)) from None


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def test_shell_is_a_terminal_in_the_sandbox(env):
    pid, master = _pty_run({**env, "PYTHONFAULTHANDLER": "1"}, "shell", SID, size=(30, 100))
    before = termios.tcgetattr(master)
    try:
        _read_until(master, rb"[$#] ")
        os.write(master, b"stty size; echo $((6*7))\r")
        _read_until(master, rb"30 100.*\r\n42")
        # A resize of the operator's terminal reaches the sandbox's. The kernel sends the
        # CLI a SIGWINCH for the new size, and a second one comes on top.
        fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        os.kill(pid, signal.SIGWINCH)
        _sized(pid, master, 40, 120)
        # The sandbox's title change and clipboard write stop at the CLI.
        os.write(master, (ATTACK.replace("after", "done") + "\r").encode())
        out = _read_until(master, rb"done\r\n")
        printed = out.rsplit(b"'\r\n", 1)[1]  # after the typed line's echo
        assert b"\x1b]" not in out and b"pwned" not in printed, out
        assert b"\x1b[2Jdone" in printed  # what programs draw with goes through
        os.write(master, b"exit 5\r")
        assert _wait(pid, master) == 5
    finally:
        _kill(pid)
    # The terminal is back in the mode it had (raw mode undone).
    assert termios.tcgetattr(master)[3] == before[3]


def test_shell_survives_a_burst_of_resizes(env):
    """A window dragged by its corner: SIGWINCH after SIGWINCH, each landing wherever the CLI
    is, in the handler of the one before too. The shell still answers and gets the last size.
    (A handler that took a lock, threading.Event.set's, deadlocked the CLI's main thread on a
    SIGWINCH that came while the previous one held it: output stopped for good.)"""
    pid, master = _pty_run({**env, "PYTHONFAULTHANDLER": "1"}, "shell", SID, size=(30, 100))
    try:
        _read_until(master, rb"[$#] ")
        end = time.monotonic() + 1.0
        for i in range(1_000_000):  # 1 s of them, as dense as they come
            if i % 64 == 0:
                if time.monotonic() > end:
                    break
                fcntl.ioctl(master, termios.TIOCSWINSZ,
                            struct.pack("HHHH", 31 + i // 64 % 2, 101, 0, 0))
            os.kill(pid, signal.SIGWINCH)
        fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 150, 0, 0))
        _sized(pid, master, 50, 150)
        os.write(master, b"exit 5\r")
        assert _wait(pid, master) == 5
    finally:
        _kill(pid)


def test_shell_gets_a_resize_made_while_the_session_opens(execd, proxy, tmp_path):
    """The operator resizes the window while `sandman shell` still waits for the session: the
    sandbox's terminal gets the new size (the old CLI read the size, then opened the session,
    and only then listened for SIGWINCH: a resize in between was lost for good)."""
    proxy.plan.append(("hold", SESSION_OPEN.path))
    pid, master = _pty_run({**_env(execd, tmp_path, proxy.port), "PYTHONFAULTHANDLER": "1"},
                           "shell", SID, size=(30, 100))
    try:
        assert proxy.holding.wait(20), "the CLI never opened the session"
        # The kernel sends the CLI its SIGWINCH for the new size.
        fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        proxy.release.set()
        _read_until(master, rb"[$#] ")
        _sized(pid, master, 40, 120)
        os.write(master, b"exit 5\r")
        assert _wait(pid, master) == 5
    finally:
        _kill(pid)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_stop_while_the_shell_opens_leaves_no_session(execd, proxy, tmp_path, sig):
    """The operator's SIGTERM, closed terminal (SIGHUP) or ^C lands while `sandman shell`
    waits for the open's answer (held back; execd has opened it, its program runs): once the
    CLI exits, execd lists no session of it and its program is gone. (The CLI died at once
    before its handlers were in place, or got the error out of the open with no session to
    close: the pty and its program stayed until the sandbox was reset.)"""
    marker = f"sm-open-42-{secrets.token_hex(6)}"
    with Sandbox.connect(execd.address, execd.port, execd.token) as sb:
        before = {x.id for x in sb.sessions()}
        proxy.plan.append(("hold", SESSION_OPEN.path))
        pid, master = _pty_run(_env(execd, tmp_path, proxy.port), "shell", SID, "--",
                               held_open(marker))
        try:
            assert proxy.holding.wait(20), "the CLI never opened the session"
            wait_marked(marker)
            os.kill(pid, sig)
            code = _wait(pid, master)
        finally:
            proxy.release.set()
            _kill(pid)
        assert {x.id for x in sb.sessions()} == before
        assert marked(marker) == []
        assert code == 128 + sig


def test_a_shell_killed_while_it_opens_leaves_its_session_for_a_bound(execd, proxy, tmp_path):
    """SIGKILL: the CLI closes nothing. Its open asked execd to close the session once no call
    names it for SHELL_ABANDON_AFTER_S (made 2 s here): it ends within that, program and all."""
    marker = f"sm-open-42-{secrets.token_hex(6)}"
    proxy.plan.append(("hold", SESSION_OPEN.path))
    pid, master = pty.fork()
    if pid == 0:
        os.chdir(REPO)
        os.execve(sys.executable, [
            sys.executable, "-c", "import sys; from sandman.client import cli; "
            "cli.SHELL_ABANDON_AFTER_S = 2.0; sys.exit(cli.main())",
            "shell", SID, "--", held_open(marker)], _env(execd, tmp_path, proxy.port))
    try:
        assert proxy.holding.wait(20), "the CLI never opened the session"
        wait_marked(marker)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    finally:
        proxy.release.set()
        _kill(pid)
    deadline = time.monotonic() + 30  # 2 s and execd's 0.5 s check, on a loaded machine
    while marked(marker):
        assert time.monotonic() < deadline, "the killed CLI's session is still running"
        time.sleep(0.1)
    with Sandbox.connect(execd.address, execd.port, execd.token) as sb:
        assert [x for x in sb.sessions() if "sm-open-" in x.command] == []
    assert proxy.requests_to(SESSION_OPEN.path)[0].json()["abandon_after"] == 2.0


def test_shell_restores_the_terminal_on_a_signal(env):
    pid, master = _pty_run(env, "shell", SID)
    try:
        _read_until(master, rb"[$#] ")
        raw = termios.tcgetattr(master)
        assert not raw[3] & termios.ICANON  # raw while the session runs
        os.kill(pid, signal.SIGTERM)
        assert _wait(pid, master) == 128 + signal.SIGTERM
        assert termios.tcgetattr(master)[3] & termios.ICANON
    finally:
        _kill(pid)


def test_shell_without_a_terminal_says_so_in_one_line(env):
    r = sandman(env, "shell", SID)
    assert r.returncode == cli.EXIT_USAGE and r.stderr.count("\n") == 1
    assert "must be a terminal" in r.stderr


# ---- the docs stay true


def _docs_exit_table() -> dict[int, str]:
    text = (REPO / "docs" / "sdk.md").read_text()
    section = text[text.index("## Command-line client"):]
    section = section[:section.index("\n## ", 1)]
    rows = re.findall(r"^\| (\d+) \| (.+?) \|$", section, re.M)
    assert rows, "no exit code table in docs/sdk.md's CLI section"
    return {int(code): what for code, what in rows}


def test_the_docs_exit_code_table_is_the_clis():
    table = _docs_exit_table()
    assert set(table) == set(cli.EXIT_TABLE)
    for code, what in table.items():
        # Each error type the row names maps to that code, and each type mapped is named.
        named = set(re.findall(r"`([A-Z][A-Za-z]+)`", what))
        mapped = {cls.__name__ for cls, c in cli.EXIT_CODES if c == code}
        assert named == mapped, (code, named, mapped)
        for name in named:
            assert cli.exit_code(getattr(E, name)("x") if name != "CommandTimeout"
                                 else E.CommandTimeout("x", None)) == code  # type: ignore
    assert cli.EXIT_NO_LEASE == cli.EXIT_NOT_FOUND


def test_the_docs_options_are_the_clis():
    text = (REPO / "docs" / "sdk.md").read_text()
    section = text[text.index("## Command-line client"):]
    section = section[:section.index("\n## ", 1)]
    named = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]+)", section))
    top, verbs = cli._words(cli.parser())
    known = set(top).union(*verbs.values())
    assert named <= known, named - known
    for opt in ("--raw", "--version", "--output"):
        assert opt in section, opt
    assert f"`SHELL_ABANDON_AFTER_S` ({cli.SHELL_ABANDON_AFTER_S:g} s)" in section
