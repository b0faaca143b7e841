"""The verdict's path takes nothing from the holder (docs/grading.md, "Where each step runs"):
every grading step runs in a process execd starts fresh for it, never in the holder's shell.

Capture, in the agent's sandbox: the agent leaves its shell and repository armed (a `git`
function, exported GIT_* variables, a fake git first on PATH, hooks, fsmonitor, filters,
textconv, an external diff, a config include) and the grader captures. None of the agent's
code may run (a marker file says it did), and the patch must be the working tree's change,
byte for byte.

Grade, in the grading pod: the code under test turns its JUnit report into a directory, a
FIFO or a symlink at exit, or leaves a process that rewrites it after pytest ends (each also
forcing exit status 0). Every such grading is failed: never passed, never no_verdict, never
an exception. The real execd of tests/client/conftest.py, one per test (shell state must not
leak between cases)."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path

import pytest

from sandman.client import Sandbox
from sandman.client import grading as G
from sandman.client.grading import Verdict
from testbed import taskimage

from .conftest import FAST_RETRY
from .test_grading_hostile import FAKE_JUNIT, _calc_prefix, _grade, _patch, _task

FIXED = taskimage.FILES["calc/__init__.py"].replace("a - b", "a + b")
REAL_GIT = shutil.which("git") or "/usr/bin/git"

# name -> shell lines run in the agent's shell after its fix ({repo}, {mark}, {other}: a clean
# repository at the base, {t}: a scratch directory). Each one, reached, touches {mark}.
ARM = "printf '#!/bin/sh\\ntouch {mark}\\n%s\\n' {body} > {t}/{name} && chmod +x {t}/{name}"


def _script(name: str, body: str) -> str:
    return ARM.format(mark="{mark}", t="{t}", name=name, body=_q(body))


def _q(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


CAPTURE_CASES: dict[str, str] = {
    "a git shell function": "git() {{ touch {mark}; }}",
    "an exported git function": "git() {{ touch {mark}; command git \"$@\"; }}; export -f git",
    "GIT_DIR to a clean clone": "export GIT_DIR={other}/.git",
    "GIT_WORK_TREE to a clean clone": "export GIT_WORK_TREE={other}",
    "GIT_INDEX_FILE": "export GIT_INDEX_FILE={t}/index",
    "GIT_CONFIG_COUNT (diff.noprefix)": (
        "export GIT_CONFIG_COUNT=1 GIT_CONFIG_KEY_0=diff.noprefix GIT_CONFIG_VALUE_0=true"),
    "GIT_CONFIG_COUNT (core.fsmonitor)": (
        _script("fsm", "exit 1") + " && export GIT_CONFIG_COUNT=1 "
        "GIT_CONFIG_KEY_0=core.fsmonitor GIT_CONFIG_VALUE_0={t}/fsm"),
    "a fake git first on PATH": (
        "mkdir -p {t}/bin && " + _script("bin/git", f'exec {REAL_GIT} "$@"')
        + " && export PATH={t}/bin:$PATH"),
    "a post-index-change hook": (
        _script("hook", "exit 0") + " && cp {t}/hook {repo}/.git/hooks/post-index-change"),
    "core.hooksPath": (
        "mkdir -p {t}/hooks && " + _script("hooks/post-index-change", "exit 0")
        + " && git -C {repo} config core.hooksPath {t}/hooks"),
    "core.fsmonitor": _script("fsm", "exit 1") + " && git -C {repo} config core.fsmonitor {t}/fsm",
    "a clean filter from .gitattributes": (
        _script("clean", "sed 's/a + b/a * b/'") + " && echo '*.py filter=evil' > {repo}/.gitattributes"
        " && git -C {repo} config filter.evil.clean {t}/clean"),
    "a clean filter from .git/info/attributes": (
        _script("clean", "sed 's/a + b/a * b/'") + " && mkdir -p {repo}/.git/info && "
        "echo '*.py filter=evil' > {repo}/.git/info/attributes && "
        "git -C {repo} config filter.evil.clean {t}/clean && "
        "git -C {repo} config filter.evil.required true"),
    "a textconv driver": (
        _script("tc", 'cat "$1"') + " && echo '*.py diff=tc' > {repo}/.gitattributes"
        " && git -C {repo} config diff.tc.textconv {t}/tc"),
    "an external diff": _script("ext", "exit 0") + " && git -C {repo} config diff.external {t}/ext",
    "a config [include] with fsmonitor": (
        _script("fsm", "exit 1") + " && printf '[core]\\n\\tfsmonitor = {t}/fsm\\n' > {t}/inc"
        " && git -C {repo} config include.path {t}/inc"),
    "text/eol conversion in .gitattributes": "printf '*.py text eol=crlf\\n' > {repo}/.gitattributes"
                                             " && git -C {repo} config core.autocrlf true",
}


@pytest.mark.parametrize("case", CAPTURE_CASES)
def test_capture_takes_nothing_from_the_agents_shell(case: str, fresh_execd, tmp_path) -> None:
    repo, other, t, mark = tmp_path / "agent", tmp_path / "other", tmp_path / "t", tmp_path / "mark"
    base = taskimage.make_repo(repo)
    taskimage.make_repo(other)
    t.mkdir()
    (repo / "calc/__init__.py").write_bytes(FIXED.encode())
    (repo / "calc/new.py").write_bytes(b"x = 1\r\n")
    arm = CAPTURE_CASES[case].format(repo=repo, other=other, t=t, mark=mark)
    sb = Sandbox.connect(fresh_execd.address, fresh_execd.port, fresh_execd.token,
                         retry=FAST_RETRY)
    try:
        r = sb.exec(f"cd {repo} && {arm}")
        assert r.exit_code == 0, r.output
        mark.unlink(missing_ok=True)
        patch, _ = G.capture_patch(sb, base, repo=str(repo))
    finally:
        sb.close()
    print(f"HOLDER {case!r}: marker {'written' if mark.exists() else 'absent'}, "
          f"{len(patch)} bytes")
    assert not mark.exists(), f"{case}: the agent's code ran during the capture"
    # Applied to a clean base, the patch gives the agent's working tree, byte for byte.
    clean = tmp_path / "clean"
    taskimage.make_repo(clean)
    subprocess.run([REAL_GIT, "-c", "core.hooksPath=/dev/null", "-C", str(clean), "apply",
                    "--binary", "-"], input=patch, check=True)
    for rel in ("calc/__init__.py", "calc/new.py"):
        assert (clean / rel).read_bytes() == (repo / rel).read_bytes(), (case, rel)


# ---- the report read

def _report_code(action: str) -> str:
    """calc/__init__.py's prefix: at exit (pytest has written its report), `action` on the
    report's path `r`, then exit status 0."""
    return (
        "import atexit, os, shlex\n"
        "def _turn():\n"
        "    for a in shlex.split(os.environ.get('PYTEST_ADDOPTS', '')):\n"
        "        if a.startswith('--junitxml='):\n"
        "            r = a.split('=', 1)[1]\n"
        + "".join(f"            {line}\n" for line in action.splitlines())
        + "    os._exit(0)\n"
        "atexit.register(_turn)\n")


REWRITER = (
    "import os, sys, time\n"
    "pid, r, fake = int(sys.argv[1]), sys.argv[2], sys.argv[3]\n"
    "while os.path.exists('/proc/%d' % pid):\n"
    "    time.sleep(0.001)\n"
    "end = time.time() + 30\n"
    "while time.time() < end:\n"
    "    with open(r + '.tmp', 'w') as f:\n"
    "        f.write(fake)\n"
    "    os.replace(r + '.tmp', r)\n"
    "    time.sleep(0.002)\n")


def _leftover(env: str) -> str:
    """At import: a double-forked, new-session process that waits for the shell that ran the
    test command to end (the command returned) and then rewrites the report with a passing
    one for 30 s; `env` is its environment (`os.environ` keeps execd's tag, `{}` drops it).
    pytest itself exits 0 at exit, so a passing report would pass."""
    return (
        "import os, shlex, sys\n"
        "_pid = os.getppid()\n"
        "_r = [a.split('=', 1)[1] for a in shlex.split(os.environ.get('PYTEST_ADDOPTS', ''))"
        " if a.startswith('--junitxml=')][0]\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execve(sys.executable, [sys.executable, '-c', {REWRITER!r}, str(_pid), _r,"
        f" {FAKE_JUNIT!r}], {env})\n"
        "    os._exit(0)\n"
        "import atexit\n"
        "atexit.register(lambda: os._exit(0))\n")


REPORT_CASES: dict[str, str] = {
    "turned into a directory": "os.remove(r)\nos.mkdir(r)",
    "turned into a FIFO": "os.remove(r)\nos.mkfifo(r)",
    "turned into a symlink to a passing report": (
        f"open(r + '.fake', 'w').write({FAKE_JUNIT!r})\nos.remove(r)\nos.symlink(r + '.fake', r)"),
    # Unreadable by anyone, root included (a mode-0 file is not, to root): open() gives ENXIO.
    "turned into a socket": ("import socket\nos.remove(r)\n"
                             "socket.socket(socket.AF_UNIX).bind(r)"),
    "removed": "os.remove(r)",
}


@pytest.mark.parametrize("case", [*REPORT_CASES, "rewritten by a leftover process",
                                  "rewritten by a leftover process without execd's tag"])
def test_the_report_read_cannot_be_turned(case: str, make_controller, fresh_execd,
                                          tmp_path) -> None:
    if case in REPORT_CASES:
        code = _report_code(REPORT_CASES[case])
    else:
        code = _leftover("{}" if "without" in case else "dict(os.environ)")
    task = _task(tmp_path)
    # `&& true`: pytest is a child of the shell that runs the command, not that shell.
    task = dataclasses.replace(task, test_command=f"{task.test_command} && true")
    patch = _patch(tmp_path, _calc_prefix(code))
    r = _grade(make_controller(fresh_execd, Path(task.repo)).url, task, patch)
    print(f"HOLDER report {case!r}: {r.verdict} ({r.reason})")
    assert r.verdict is Verdict.FAILED, r
    assert r.attempts == 1, r

