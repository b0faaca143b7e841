"""POST /exec with "fresh": true: one command in a bash execd starts for it alone, never the
persistent shell. What the holder did to the shell (functions, exports, /env, cd) does not reach
it; execd's start environment does, without the shell-startup variables; cwd is the body's;
stdin is /dev/null; its own session; and when it returns (exit, timeout, client gone) nothing it
started is left, tagged or not."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from .conftest import TOKEN, alive, wait_for


def fresh(execd, command: str, cwd: str = "/", **kw) -> dict:
    return execd.exec(command, fresh=True, cwd=cwd, **kw)


def pids_running(tag: str) -> list[int]:
    """Live processes whose command line starts with `tag`."""
    out = []
    for n in os.listdir("/proc"):
        if not n.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{n}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if cmd.startswith(tag.encode()) and alive(int(n)):
            out.append(int(n))
    return out


def test_the_holders_shell_state_does_not_reach_it(execd, tmp_path):
    r = execd.exec(f"cd {tmp_path}; export AGENT_VAR=1 PATH=/nowhere:$PATH; "
                   "git() { echo agent-git; }; export -f git; umask 077; set -e")
    assert r["exit_code"] == 0, r
    assert execd.post("/env", {"set": {"HOLDER_VAR": "2"}}).status_code == 200
    r = fresh(execd, "echo ${AGENT_VAR-unset} ${HOLDER_VAR-unset} ${EXECD_TEST_RUN:+start}; "
                     "type -t git || echo no-function; echo $PATH; pwd; umask", cwd="/")
    out = r["output"].split("\n")
    assert r["exit_code"] == 0 and r["error"] is None, r
    assert out[0] == "unset unset start", out
    assert out[1] != "function", out
    assert "/nowhere" not in out[2], out
    assert out[3] == "/" and out[4] != "0077", out
    # The shell itself is as the holder left it.
    assert execd.exec("echo $AGENT_VAR; pwd")["output"] == f"1\n{tmp_path}\n"


def test_bash_env_of_execds_start_is_not_read(execd_factory, tmp_path):
    mark = tmp_path / "bash_env_ran"
    script = tmp_path / "rc.sh"
    script.write_text(f"touch {mark}\n")
    ex = execd_factory(env={"BASH_ENV": str(script), "ENV": str(script)})
    mark.unlink(missing_ok=True)
    r = fresh(ex, "echo ${BASH_ENV-unset} ${ENV-unset}; bash -c true")
    assert r["exit_code"] == 0 and r["output"] == "unset unset\n", r
    assert not mark.exists()


def test_cwd_stdin_and_session(execd, tmp_path):
    r = fresh(execd, "pwd; cat; read -r x; echo read=$?; "
                     "s=$(cut -d' ' -f6 /proc/$$/stat); p=$(cut -d' ' -f5 /proc/$$/stat); "
                     "[ \"$s\" = $$ ] && [ \"$p\" = $$ ] && echo own-session", cwd=str(tmp_path))
    assert r["output"] == f"{tmp_path}\nread=1\nown-session\n", r
    assert fresh(execd, "exit 7", cwd=str(tmp_path))["exit_code"] == 7


def test_bad_bodies_are_refused(execd, tmp_path):
    for body in ({"command": "true", "fresh": True},  # no cwd
                 {"command": "true", "fresh": True, "cwd": "relative"},
                 {"command": "true", "fresh": True, "cwd": str(tmp_path / "missing")},
                 {"command": "true", "fresh": "yes", "cwd": "/"},
                 {"command": "true", "cwd": "/"}):  # cwd is for fresh commands
        r = execd.post("/exec", body)
        assert r.status_code == 400, (body, r.text)
    r = execd.post("/exec/stream", {"command": "true", "fresh": True, "cwd": "/"})
    assert r.status_code == 400, r.text


def test_nothing_it_started_outlives_it(execd, tmp_path):
    """Background jobs, a new session, a double fork, and one that dropped execd's tag with
    `env -i`: all gone when the answer comes (killed before it is sent)."""
    tag = f"sleep 1{os.getpid() % 1000:03d}"
    r = fresh(execd, f"{tag}1 & setsid {tag}2 & ( ( {tag}3 & ) & ); "
                     f"env -i setsid {tag}4 & nohup {tag}5 >/dev/null 2>&1 & "
                     "sleep 0.2; echo started", cwd=str(tmp_path))
    assert r["output"] == "started\n" and r["exit_code"] == 0, r
    assert pids_running(tag) == []


def test_timeout_kills_the_tree(execd, tmp_path):
    tag = f"sleep 2{os.getpid() % 1000:03d}"
    r = fresh(execd, f"setsid {tag}1 & {tag}2", cwd=str(tmp_path), timeout=1)
    assert r["exit_code"] == 124 and r["error"].startswith("timeout"), r
    assert pids_running(tag) == []


def test_client_gone_kills_the_tree(execd, tmp_path):
    tag = f"sleep 3{os.getpid() % 1000:03d}"
    body = json.dumps({"command": f"setsid {tag}1 & {tag}2", "fresh": True,
                       "cwd": str(tmp_path)}).encode()
    s = socket.create_connection(("127.0.0.1", execd.port))
    s.sendall(b"POST /exec HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode()
              + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
              + body)
    assert wait_for(lambda: len(pids_running(tag)) == 2, 10)
    s.close()
    assert wait_for(lambda: pids_running(tag) == [], 10), pids_running(tag)
    # The call's tree is dead before execd has finished the call (its bash is killed last and
    # reaped): until then another call is refused busy, as any call beside a running one is.
    assert wait_for(lambda: execd.post("/exec", {"command": "echo ok", "fresh": True,
                                                 "cwd": "/"}).status_code != 409, 10)
    assert fresh(execd, "echo ok")["output"] == "ok\n"


def test_output_is_capped_like_exec(execd):
    r = fresh(execd, "head -c 100000 /dev/zero | tr '\\0' x", max_output=1000)
    assert r["truncated"] is True and "bytes omitted" in r["output"], r["output"][:200]
