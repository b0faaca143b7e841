"""/env, /reset, /state, /conditions."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import time

import pytest

from .conftest import alive, wait_for


def test_env_set_unset_returns_new_env_and_survives_restart(execd):
    execd.exec("export GONE=1")
    r = execd.post("/env", {"set": {"PYTHONHASHSEED": "0", "WITH_SPACE": "a b'c\"$x"},
                            "unset": ["GONE"]})
    assert r.status_code == 200, r.text
    env = r.json()["env"]
    assert env["PYTHONHASHSEED"] == "0" and env["WITH_SPACE"] == "a b'c\"$x"
    assert "GONE" not in env and "__SANDMAN_CALL" not in env
    assert execd.exec("echo \"$WITH_SPACE\"")["output"] == "a b'c\"$x\n"
    execd.exec("exit 1")  # a new shell keeps what /env set
    assert execd.exec("echo $PYTHONHASHSEED")["output"] == "0\n"
    assert execd.get("/conditions").json()["pythonhashseed"] == "0"


def kill_quietly(pid: int) -> None:
    try:  # only our `sleep`s: a pid freed by the reset may already belong to someone else
        if b"sleep" in open(f"/proc/{pid}/cmdline", "rb").read():
            os.kill(pid, signal.SIGKILL)
    except (OSError, ProcessLookupError):
        pass


def test_reset_kills_everything_but_execd(execd, tmp_path, request):
    f = tmp_path / "pids"
    execd.exec(f"sleep 100 & echo $! >> {f}")
    execd.exec(f"setsid -f bash -c 'echo $$ >> {f}; exec sleep 100'")
    execd.exec(f"env -i setsid -f /bin/sh -c 'echo $$ >> {f}; exec sleep 100'")  # untagged
    execd.exec(f"(trap '' TERM HUP; echo $BASHPID >> {f}; exec sleep 100) &")
    # A zombie: its parent never reaps it.
    execd.exec("bash -c 'sleep 0.05 & exec sleep 100' &")
    assert wait_for(lambda: f.exists() and len(f.read_text().split()) == 4, 5)
    pids = [int(x) for x in f.read_text().split()]
    request.addfinalizer(lambda: [kill_quietly(p) for p in pids])  # env -i escapes the run id
    execd.exec("X=1; cd /")
    old = execd.shell_pid()
    r = execd.post("/reset", {})
    assert r.status_code == 200, r.text
    assert r.json()["ok"] is True and r.json()["workspace_wiped"] is None
    assert not [p for p in pids if alive(p)]
    st = execd.state()
    assert st["shell_pid"] != old
    assert [p["pid"] for p in st["processes"]] == [st["shell_pid"]]
    assert execd.exec("echo ${X:-reset}")["output"] == "reset\n"
    assert execd.others() == []


def test_reset_while_a_command_runs(execd):
    import threading
    out = {}
    t = threading.Thread(target=lambda: out.update(execd.exec("sleep 100", timeout=60)))
    t.start()
    assert wait_for(lambda: execd.state()["busy"], 5)
    r = execd.post("/reset", {})
    t.join(30)
    assert r.status_code == 200 and r.json()["ok"] is True
    assert "reset" in out["error"]
    assert execd.exec("echo ok")["output"] == "ok\n"


def test_reset_wipes_workspace_only_when_asked(execd, tmp_path):
    ws = tmp_path / "ws"
    (ws / "keep.txt").write_text("x")
    execd.post("/reset", {})
    assert (ws / "keep.txt").exists()
    (ws / "sub").mkdir()
    r = execd.post("/reset", {"workspace": True})
    assert r.status_code == 200 and r.json()["workspace_wiped"] == 2
    assert ws.exists() and list(ws.iterdir()) == []


def test_state_reports_shell_cwd_processes_guard(execd, tmp_path):
    execd.exec(f"cd {tmp_path}; sleep 100 &")
    # The background job is a forked bash until it has exec'd sleep: a busy machine shows it
    # between the two, so the state is read again until it names sleep (bounded).
    deadline = time.monotonic() + 10
    while True:
        st = execd.state()
        cmds = [p["cmd"] for p in st["processes"]]
        if "sleep 100" in cmds or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert st["cwd"] == str(tmp_path) and st["busy"] is False
    assert st["reaper"] in ("subreaper", "pid1")
    assert "sleep 100" in cmds and any(p["shell"] for p in st["processes"])
    assert st["guard"] is None and st["uptime_s"] >= 0
    (tmp_path / "netguard.json").write_text(json.dumps({"applied": True, "rules": 3}))
    assert execd.state()["guard"] == {"applied": True, "rules": 3}
    (tmp_path / "netguard.json").write_text("{broken")
    assert "error" in execd.state()["guard"]


def test_conditions_fields(execd):
    c = execd.get("/conditions").json()
    for key in ("cpu_quota_us", "cpu_period_us", "visible_cpus", "memory_limit_bytes", "uid",
                "gid", "user", "tz_env", "localtime", "pythonhashseed", "hostname", "egress"):
        assert key in c
    assert c["uid"] == os.getuid() and c["gid"] == os.getgid()
    assert c["visible_cpus"] == sorted(os.sched_getaffinity(0))
    assert c["hostname"] == socket.gethostname()
    assert c["egress"] is None
    assert c["pythonhashseed"] == os.environ.get("PYTHONHASHSEED")


def test_conditions_egress_probe(execd):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    try:
        c = execd.get("/conditions", params={"egress_probe": f"127.0.0.1:{port}"}).json()
        assert c["egress"]["open"] is True
    finally:
        srv.close()
    c = execd.get("/conditions", params={"egress_probe": f"127.0.0.1:{port}"}).json()
    assert c["egress"]["open"] is False and c["egress"]["error"]
    r = execd.get("/conditions", params={"egress_probe": "no-port"})
    assert r.status_code == 400


@pytest.mark.netns
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                    reason="needs root and unshare for a private PID namespace")
def test_reset_as_pid1_reaps_orphans_and_leaves_only_execd(execd_factory, tmp_path):
    # As in a pod: execd is PID 1 of its PID namespace, so every orphan is re-parented to it.
    d = execd_factory(prefix=("unshare", "--pid", "--fork", "--mount-proc",
                              "--kill-child=SIGTERM"))
    st = d.state()
    assert st["pid"] == 1 and st["reaper"] == "pid1"
    d.exec("setsid -f sleep 100; env -i setsid -f /bin/sleep 101; (sleep 102 &) ; "
           "bash -c 'sleep 0.05 & exec sleep 103' &")
    want = {"sleep 100", "/bin/sleep 101", "sleep 102", "sleep 103"}
    assert wait_for(lambda: want <= {p["cmd"] for p in d.state()["processes"]}, 5)
    r = d.post("/reset", {})
    assert r.status_code == 200 and r.json()["ok"] is True
    st = d.state()
    assert [p["pid"] for p in st["processes"]] == [st["shell_pid"]]


def test_starts_and_runs_without_ctypes(tmp_path):
    """Debian's python3-minimal, a common task-image base, has no ctypes: execd must still
    start (found on the real node: `import ctypes` at the top crashed every such sandbox)."""
    import hashlib
    import sys

    import httpx

    from testbed.execd import EXECD, execd_cmd, start_execd

    token = "t" * 32
    cmd = execd_cmd("127.0.0.1", 0, hashlib.sha256(token.encode()).hexdigest(),
                    "--workspace", str(tmp_path))
    # The same command, with `import ctypes` failing as it does where the module is absent.
    boot = ("import runpy, sys; sys.modules['ctypes'] = None; sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    ex = start_execd(tmp_path, token=token,
                     cmd=[sys.executable, "-c", boot, str(EXECD), *cmd[2:]])
    try:
        r = httpx.post(ex.url + "/exec", json={"command": "echo fine"}, timeout=10,
                       headers={"Authorization": f"Bearer {token}"}, trust_env=False)
        assert r.status_code == 200 and r.json()["output"].strip() == "fine", r.text
    finally:
        ex.stop()
