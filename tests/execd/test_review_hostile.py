"""Hostile review of the routes that came with background processes and trees, written as the
attackers: the last holder of a reused grading pod (another tenant, who held the token until the
controller rotated it) and the agent inside the sandbox. Each xfail(strict) test is a bypass that
works on the code as it stands; the fix flips it. Real execd, real bash, real sockets on
127.0.0.1."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
import socket
import time

import pytest

from execd.execd_daemon import background, trees

from .conftest import AUTH, wait_for
from .tartrees import pax, reg, sha, tar_of

DEEP = 1200  # directory levels: past Python's default recursion limit (1000)


def baseline_execd(execd_factory, tmp_path):
    """An execd as in a reused grading pod: a baseline of `etc` recorded at its start."""
    ws, etc, store = tmp_path / "ws", tmp_path / "etc", tmp_path / "store"
    ws.mkdir()
    etc.mkdir()
    (etc / "hosts").write_text("127.0.0.1 localhost\n")
    d = execd_factory("--workspace", str(ws), "--kill-grace", "0.5",
                      "--baseline-at-start", "on", "--baseline-store", str(store),
                      "--baseline-paths", str(etc), "--baseline-packages", str(etc / "none"),
                      "--baseline-localtime", str(etc / "localtime"))
    return d, etc


def start_slow_post(port: int, path: str, body: bytes, sent: int) -> socket.socket:
    """A request authenticated with the holder's token whose body stops after `sent` bytes."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: {AUTH['Authorization']}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    s.sendall(head + body[:sent])
    return s


def finish(s: socket.socket, rest: bytes) -> int:
    s.sendall(rest)
    data = b""
    while b"\r\n" not in data:
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
    s.close()
    return int(data.split(b" ", 2)[1]) if data else 0


def hand_over(d) -> dict:
    """What the controller does on release(reuse=True) (controller/warmpool.py `_restore`): a
    new token, /restore, /diff. Returns the new holder's headers."""
    token = "next-holder-" + secrets.token_hex(8)
    r = d.post("/token", {"token_sha256": hashlib.sha256(token.encode()).hexdigest()})
    assert r.status_code == 200, r.text
    auth = {"Authorization": f"Bearer {token}"}
    r = d.client.post("/restore", json={}, headers=auth)
    assert r.status_code == 200 and r.json()["restored"], r.text
    r = d.client.get("/diff", headers=auth)
    assert r.status_code == 200 and r.json()["clean"], r.text
    return auth


# ---------------------------------------------------------------- the last holder of a reused pod


@pytest.mark.parametrize(("route", "listing", "field"), [
    ("/processes/spawn", "/processes", "processes"),
    ("/sessions/open", "/sessions", "sessions"),
    ("/exec", None, None),
])
def test_last_holders_command_in_flight_runs_in_the_next_holders_pod(
        execd_factory, tmp_path, route, listing, field):
    d, etc = baseline_execd(execd_factory, tmp_path)
    marker = tmp_path / "ws" / "old-holder-was-here"
    body = json.dumps({"command": f"echo planted > {marker}; sleep 5"}).encode()
    s = start_slow_post(d.port, route, body, len(body) - 1)
    time.sleep(0.2)  # execd holds the request (authorized) and waits for its body
    auth = hand_over(d)
    code = finish(s, body[-1:])
    wait_for(marker.exists, 2)
    running = d.client.get(listing, headers=auth).json()[field] if listing else []
    # The next holder's pod must not run the last holder's command.
    assert code != 200 and running == [] and not marker.exists(), (code, running)


def test_last_holders_file_write_in_flight_lands_after_restore(execd_factory, tmp_path):
    d, etc = baseline_execd(execd_factory, tmp_path)
    target = etc / "conftest.py"  # inside the watched paths: a restore must take it away
    body = json.dumps({"path": str(target), "data_b64": base64.b64encode(
        b"def pytest_runtest_makereport(): pass\n").decode()}).encode()
    s = start_slow_post(d.port, "/files/write", body, len(body) - 1)
    time.sleep(0.2)
    auth = hand_over(d)
    code = finish(s, body[-1:])
    diff = d.client.get("/diff", headers=auth).json()
    assert code != 200 and not target.exists() and diff["clean"], (code, diff)


# ---------------------------------------------------------------- the agent: deep trees


def test_reset_wipes_a_workspace_holding_a_deep_directory(execd_factory, tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    d = execd_factory("--workspace", str(ws))
    # DEEP levels in a few `mkdir -p`s of 400 levels each (well under PATH_MAX), not a fork
    # per level: a mkdir per level took 47 s of a loaded 2-core machine, the reset under 1 s.
    assert DEEP % 400 == 0
    r = d.exec(f"cd {ws} && p=$(printf 'd/%.0s' $(seq 400)) && for i in $(seq {DEEP // 400}); "
               f"do mkdir -p \"$p\" && cd \"$p\" || exit 1; done; echo agent > f", timeout=120)
    assert r["exit_code"] == 0, r
    r = d.post("/reset", {"workspace": True})
    assert r.status_code == 200 and os.listdir(ws) == [], (r.status_code, r.text[:200])


def test_reset_wipe_never_follows_the_agents_symlinks_out(execd_factory, tmp_path):
    ws, outside = tmp_path / "ws", tmp_path / "outside"
    ws.mkdir()
    outside.mkdir()
    (outside / "keep").write_text("trainer's\n")
    d = execd_factory("--workspace", str(ws))
    # Links to a directory outside, at the top and deep down (past the fds held open).
    r = d.exec(f"cd {ws} && ln -s {outside} top && for i in $(seq 80); do mkdir d && cd d "
               f"|| exit 1; done; ln -s {outside} deep && ln -s ../../.. up", timeout=60)
    assert r["exit_code"] == 0, r
    r = d.post("/reset", {"workspace": True})
    assert r.status_code == 200 and os.listdir(ws) == [], (r.status_code, r.text[:200])
    assert (outside / "keep").read_text() == "trainer's\n"


def test_refused_deep_archive_leaves_nothing(execd, tmp_path):
    target = tmp_path / "up"
    target.mkdir()
    data = tar_of(reg("/".join(["d"] * (DEEP + 300)) + "/f"))
    r = execd.client.post("/files/tree/write", params={"path": str(target)}, content=data,
                          headers={"X-Content-SHA256": "0" * 64})
    # Refused on its name (over execd.TREE_DEPTH_MAX components) before the digest is known.
    assert r.status_code == 422 and "deeper than" in r.text, (r.status_code, r.text[:200])
    assert os.listdir(target) == []


def test_archive_at_the_depth_cap_with_a_bad_digest_leaves_nothing(execd, tmp_path):
    target = tmp_path / "up"
    target.mkdir()
    deep = "/".join(["d"] * (trees.TREE_DEPTH_MAX - 1))
    data = tar_of(reg(deep + "/f"), reg(deep + "/g"), reg("top"))
    r = execd.client.post("/files/tree/write", params={"path": str(target)}, content=data,
                          headers={"X-Content-SHA256": "0" * 64})
    assert r.status_code == 400 and "SHA-256 mismatch" in r.text, (r.status_code, r.text[:200])
    assert os.listdir(target) == []


def test_a_deep_member_name_does_not_grow_execd(execd, tmp_path):
    rest = execd.reset_hwm()
    data = tar_of(reg("/".join(["d"] * 4000) + "/f"))
    assert len(data) < 32 << 10
    r = execd.client.post("/files/tree/write", params={"path": str(tmp_path / "up")},
                          content=data, headers={"X-Content-SHA256": sha(data)})
    growth = execd.rss_hwm_kib() - rest
    # docs/execd.md: a 1 GiB upload grew execd's RSS by under 32 MiB.
    assert growth < 32 << 10, (r.status_code, growth)
    assert r.status_code == 422 and "over 4096 bytes" in r.text, r.text[:200]


def test_absurd_pax_mtime_is_a_clear_refusal(execd, tmp_path):
    target = tmp_path / "up"
    data = tar_of(pax(reg("f"), {"mtime": "1e300"}))
    r = execd.client.post("/files/tree/write", params={"path": str(target)}, content=data,
                          headers={"X-Content-SHA256": sha(data)})
    assert r.status_code in (400, 422), (r.status_code, r.text)
    assert "mtime" in r.text and "\n" not in r.json()["error"], r.text
    assert not target.exists()


# ---------------------------------------------------------------- what held


def test_restore_kills_a_double_forked_setsid_escapee_without_the_tag(execd_factory, tmp_path):
    """Held: a spawned process that double-forks into a new session with a cleared environment
    (no tag, re-parented to execd) does not survive /restore, and the next holder cannot read
    the old one's output by its id."""
    d, _ = baseline_execd(execd_factory, tmp_path)
    pidfile = tmp_path / "ws" / "escapee.pid"
    r = d.post("/processes/spawn", {"command": f"(env -i setsid -f /bin/sh -c "
                                               f"'echo $$ > {pidfile}; exec sleep 300') ; "
                                               f"echo secret-output; sleep 300"})
    assert r.status_code == 200, r.text
    pid_id = r.json()["id"]
    assert wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), 10)
    escapee = int(pidfile.read_text())
    auth = hand_over(d)
    assert wait_for(lambda: not os.path.exists(f"/proc/{escapee}") or open(
        f"/proc/{escapee}/stat").read().split(") ")[1][0] == "Z", 5)
    r = d.client.get("/processes/output", params={"id": pid_id}, headers=auth)
    assert r.status_code == 404, r.text


def test_spawn_ids_with_the_right_shape_but_forged_bits_are_404(execd):
    """Held: an id of the right shape whose sequence number is live but whose random part is
    not is unknown."""
    r = execd.post("/processes/spawn", {"command": "sleep 30"})
    real = r.json()["id"]
    seq = real.split("-")[0]
    forged = f"{seq}-{'0' * 24}"
    assert execd.get("/processes/output", params={"id": forged}).status_code == 404
    assert execd.post("/processes/signal", {"id": forged, "signal": "KILL"}).status_code == 404
    assert background._BG_ID.fullmatch(real)


# ---------------------------------------------------------------- the agent: a hidden process

SYS_EXIT = {"x86_64": 60, "aarch64": 93}  # exit(2): this thread only, not the whole group
HIDDEN = """
import ctypes, os, sys, threading, time
open(sys.argv[1] + ".tmp", "w").write(str(os.getpid()))
os.rename(sys.argv[1] + ".tmp", sys.argv[1] + ".pid")  # whole when it appears: the test reads it
def beat():
    while True:
        with open(sys.argv[1], "a") as f:
            f.write("x")
        time.sleep(0.05)
threading.Thread(target=beat).start()
time.sleep(0.3)
ctypes.CDLL(None).syscall(int(sys.argv[2]), 0)  # the leader exits: /proc shows it as Z
"""


def _threads_alive(pid: int) -> bool:
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for t in tids:
        try:
            st = open(f"/proc/{pid}/task/{t}/stat").read()
        except OSError:
            continue
        if st[st.rfind(")") + 2] != "Z":
            return True
    return False


@pytest.mark.parametrize("how", ["restore", "reset"])
def test_a_process_hidden_behind_a_zombie_leader_dies(execd_factory, tmp_path, how):
    import platform
    import sys

    nr = SYS_EXIT.get(platform.machine())
    if nr is None:
        pytest.skip("exit(2)'s number is known here for x86_64 and aarch64 only")
    d, _ = baseline_execd(execd_factory, tmp_path)
    prog, beat = tmp_path / "hidden.py", tmp_path / "beat"
    prog.write_text(HIDDEN)
    r = d.post("/processes/spawn", {"command": f"exec {sys.executable} {prog} {beat} {nr}"})
    assert r.status_code == 200, r.text
    assert wait_for(lambda: os.path.exists(f"{beat}.pid"), 10)
    pid = int(open(f"{beat}.pid").read())
    try:
        assert wait_for(lambda: open(f"/proc/{pid}/stat").read().split(") ")[1][0] == "Z", 5)
        assert _threads_alive(pid)
        if how == "restore":
            r = d.post("/restore", {})
            assert r.status_code == 200, r.text
            restored = r.json()["restored"]
            clean = d.get("/diff").json()["clean"]
        else:
            r = d.post("/reset", {}, timeout=60)
            assert r.status_code == 200, r.text
            restored = clean = r.json()["ok"]
        # Either it is gone, or execd says the pod is not clean (and a restore retires it).
        gone = wait_for(lambda: not _threads_alive(pid), 3)
        assert gone or not (restored and clean), (restored, clean)
        assert gone, f"the hidden process still runs ({beat.stat().st_size} bytes written)"
    finally:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("how", [pytest.param("exec-timeout", marks=pytest.mark.slow),
                                 "spawn-kill", "session-close"])
def test_each_kill_reaches_a_process_hidden_behind_a_zombie_leader(execd, tmp_path, how):
    """The other kills: a timed-out call's processes, a spawn's tree, a session's tree. The
    hidden process is a child of the call's shell or of the spawn's or session's bash."""
    import platform
    import sys

    nr = SYS_EXIT.get(platform.machine())
    if nr is None:
        pytest.skip("exit(2)'s number is known here for x86_64 and aarch64 only")
    prog, beat = tmp_path / "hidden.py", tmp_path / "beat"
    prog.write_text(HIDDEN)
    cmd = f"{sys.executable} {prog} {beat} {nr}; true"  # `; true`: bash forks, no exec
    pid = None
    try:
        if how == "exec-timeout":
            r = execd.exec(cmd, timeout=3)
            assert r["exit_code"] == 124, r
            pid = int(open(f"{beat}.pid").read())
        else:
            route = "/processes" if how == "spawn-kill" else "/sessions"
            r = execd.post(route + ("/spawn" if how == "spawn-kill" else "/open"),
                           {"command": cmd})
            assert r.status_code == 200, r.text
            handle = r.json()["id"]
            assert wait_for(lambda: os.path.exists(f"{beat}.pid"), 10)
            pid = int(open(f"{beat}.pid").read())
            assert wait_for(lambda: open(f"/proc/{pid}/stat").read().split(") ")[1][0] == "Z",
                            5)
            # execd lists it as running, not as a zombie.
            states = {p["pid"]: p["state"] for p in execd.state()["processes"]}
            assert states.get(pid) not in (None, "Z"), states
            if how == "spawn-kill":
                r = execd.post("/processes/signal", {"id": handle, "signal": "KILL"})
            else:
                r = execd.post("/sessions/close", {"id": handle})
            assert r.status_code == 200, r.text
        gone = wait_for(lambda: not _threads_alive(pid), 3)
        assert gone, f"the hidden process still runs ({beat.stat().st_size} bytes written)"
    finally:
        if pid is not None:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass


# ---------------------------------------------------------------- the agent: execd's memory

SCRAPE = r"""
import re, sys
pid, found = int(sys.argv[1]), set()
with open("/proc/%d/maps" % pid) as f:
    maps = f.read().splitlines()
with open("/proc/%d/mem" % pid, "rb", 0) as m:
    for line in maps:
        addr, perms = line.split()[:2]
        if "r" not in perms or "[vvar]" in line or "[vsyscall]" in line:
            continue
        a, b = (int(x, 16) for x in addr.split("-"))
        try:
            m.seek(a)
            found.update(re.findall(rb"Bearer ([!-~]{8,200})", m.read(b - a)))
        except (OSError, OverflowError):
            continue
print(b" ".join(sorted(found)).decode("ascii", "replace"))
"""


def test_the_agent_cannot_read_the_token_out_of_execds_memory(execd_factory, tmp_path):
    import shutil
    import sys

    from .conftest import TOKEN

    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) is needed to drop CAP_SYS_PTRACE as a pod does")
    # The container's capability set, without CAP_SYS_PTRACE (not in a pod's defaults), for
    # execd and so for everything it starts.
    d = execd_factory(prefix=(setpriv, "--bounding-set=-sys_ptrace", "--inh-caps=-sys_ptrace"))
    prog = tmp_path / "scrape.py"
    prog.write_text(SCRAPE)
    d.exec("true")  # a request: its Authorization header passes through execd's memory
    r = d.exec(f"{sys.executable} {prog} {d.pid} 2>&1", timeout=120)
    assert TOKEN not in r["output"], r["output"][:300]


# ---------------------------------------------------------------- the agent: a later call's status

LEFTOVER = r"""
import os, re, signal, sys, time
time.sleep(0.2)  # the call that started this job has answered
shell = os.getppid()
if sys.argv[1] == "inherited":
    req, st = 63, 62  # bash's request pipe and the status pipe, as every command gets them
else:  # closed in the job: a pipe is opened again through /proc, as anyone of the uid can
    req = os.open("/proc/%d/fd/63" % shell, os.O_RDONLY)
    st = os.open("/proc/%d/fd/62" % shell, os.O_WRONLY)
os.kill(shell, signal.SIGSTOP)  # bash stops competing for its request pipe
buf = b""
for _ in range(1000):
    buf += os.read(req, 1 << 16)
    m = re.search(rb"m=(@[0-9a-f]{16});", buf)
    if m:
        os.write(st, m.group(1) + b"S0\n")
        break
os.kill(shell, signal.SIGCONT)
"""


@pytest.mark.parametrize("how", ["inherited", "reopened"])
@pytest.mark.slow
def test_a_leftover_job_cannot_answer_a_later_calls_status(execd_factory, tmp_path, how):
    import sys

    d = execd_factory()
    prog = tmp_path / "leftover.py"
    prog.write_text(LEFTOVER)
    closed = "" if how == "inherited" else " 60<&- 61>&- 62>&- 63<&-"
    r = d.exec(f"{sys.executable} {prog} {how} >/dev/null 2>&1{closed} &")  # the agent's turn
    assert r["exit_code"] == 0, r
    time.sleep(0.6)
    # The trainer's reward command, a failing test run: its status must be its own.
    r = d.exec("echo ran; false", timeout=10)
    assert r["exit_code"] == 1 and r["output"] == "ran\n", r


PROBE_FDS = r"""
import json, os, stat, sys, time
time.sleep(0.2)
shell = os.getppid()
out = {"fds": {}, "opened": []}
for name in os.listdir("/proc/%d/fd" % shell):
    path = "/proc/%d/fd/%s" % (shell, name)
    try:
        out["fds"][name] = os.readlink(path)
    except OSError:
        continue
    for flags in (os.O_RDONLY, os.O_WRONLY):
        try:
            fd = os.open(path, flags | os.O_NONBLOCK)
        except OSError:
            continue
        out["opened"].append([name, flags, os.readlink("/proc/self/fd/%d" % fd)])
        os.close(fd)
out["mine"] = {}
for n in os.listdir("/proc/self/fd"):
    try:
        out["mine"][n] = os.readlink("/proc/self/fd/" + n)
    except OSError:  # the listing's own fd, closed by now
        pass
with open(sys.argv[1] + ".tmp", "w") as f:
    json.dump(out, f)
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
"""


def test_a_leftover_job_can_open_no_channel_of_the_shell_but_its_output(execd_factory, tmp_path):
    """The class of the test above: whatever fd the shell holds (requests, status frames,
    syntax-check diagnostics, saved copies), a job of the agent neither inherits it nor opens
    it again through /proc; only the output pipe, which a job's output reaches anyway."""
    import json
    import sys

    d = execd_factory()
    prog, got = tmp_path / "probe.py", tmp_path / "probe.json"
    prog.write_text(PROBE_FDS)
    r = d.exec(f"{sys.executable} {prog} {got} &")
    assert r["exit_code"] == 0, r
    assert wait_for(got.exists, 10)
    found = json.loads(got.read_text())
    output = found["fds"]["1"]
    assert output.startswith("pipe:"), found
    opened = [o for o in found["opened"] if o[2].startswith(("pipe:", "socket:"))]
    assert [o for o in opened if o[2] != output] == [], found
    channels = {v for k, v in found["fds"].items() if v.startswith(("pipe:", "socket:"))}
    inherited = {k: v for k, v in found["mine"].items() if v in channels - {output}}
    assert inherited == {}, found
    assert d.exec("echo ran; false", timeout=10)["exit_code"] == 1
