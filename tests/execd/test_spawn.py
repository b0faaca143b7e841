"""Background processes (/processes/*): spawn, poll, output ring, wait, signal, list; what
/reset kills; hostile ids, unauthenticated calls, the live cap; a flood that must not grow
execd's memory nor block the foreground shell. Real execd, real bash, real sockets on
127.0.0.1."""

from __future__ import annotations

import base64
import os
import secrets
import shlex
import time

import httpx
import pytest

from execd.execd_daemon import background, server

from .conftest import alive, descendants, wait_for

RING = background.BG_RING


def spawn(execd, command: str, **kw) -> dict:
    r = execd.post("/processes/spawn", {"command": command, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def info(execd, pid_id: str) -> dict:
    r = execd.get("/processes/info", params={"id": pid_id})
    assert r.status_code == 200, r.text
    return r.json()


def output(execd, pid_id: str, since: int = 0) -> tuple[dict, bytes]:
    r = execd.get("/processes/output", params={"id": pid_id, "since": str(since)})
    assert r.status_code == 200, r.text
    obj = r.json()
    return obj, base64.b64decode(obj["data_b64"])


def wait(execd, pid_id: str, timeout: float = 20) -> dict:
    r = execd.post("/processes/wait", {"id": pid_id, "timeout": timeout}, timeout=timeout + 30)
    assert r.status_code == 200, r.text
    return r.json()


def drained(execd, pid_id: str) -> tuple[dict, bytes]:
    """The output of an ended process once execd's reader has drained its pipe: an exit status
    can come before the last bytes are read (`output_open` says when they all are)."""
    assert wait_for(lambda: not info(execd, pid_id)["output_open"], 10)
    return output(execd, pid_id)


def error_of(r: httpx.Response, code: int) -> str:
    assert r.status_code == code, (r.status_code, r.text)
    msg = r.json()["error"]
    assert msg and "\n" not in msg
    return msg


def test_spawn_poll_output_wait(execd, tmp_path):
    p = spawn(execd, "echo out; echo err >&2; sleep 0.3; echo $PWD; exit 3")
    assert p["running"] and p["exit_code"] is None and p["id"].startswith("p")
    assert p["cwd"] == str(tmp_path / "ws")  # the shell's cwd
    done = wait(execd, p["id"])
    assert done["exit_code"] == 3 and not done["running"] and done["signal"] is None
    obj, data = drained(execd, p["id"])
    assert data == f"out\nerr\n{tmp_path / 'ws'}\n".encode()
    assert (obj["start"], obj["end"], obj["dropped"]) == (0, len(data), 0)
    # Read on from an offset: exactly the rest.
    obj, rest = output(execd, p["id"], since=4)
    assert rest == data[4:] and obj["start"] == 4
    listed = execd.get("/processes").json()
    assert [x["id"] for x in listed["processes"]] == [p["id"]]
    assert listed["live"] == 0 and listed["max_live"] == background.BG_MAX_LIVE


def test_cwd_env_and_the_shells_directory(execd, tmp_path):
    (tmp_path / "ws" / "sub").mkdir()
    execd.exec("cd sub && export SM_SHELL_ONLY=1")
    p = spawn(execd, 'echo "$PWD ${SM_X} ${SM_SHELL_ONLY:-unset}"', env={"SM_X": "x y"})
    wait(execd, p["id"])
    assert drained(execd, p["id"])[1] == f"{tmp_path / 'ws' / 'sub'} x y unset\n".encode()
    p = spawn(execd, "pwd", cwd="..")
    wait(execd, p["id"])
    assert drained(execd, p["id"])[1] == f"{tmp_path / 'ws'}\n".encode()


def test_exit_is_reaped_and_the_status_stays(execd):
    p = spawn(execd, "exit 5")
    assert wait(execd, p["id"])["exit_code"] == 5
    assert wait_for(lambda: not os.path.exists(f"/proc/{p['pid']}"), 5), "a zombie was left"
    time.sleep(0.6)  # past a reap-loop round
    assert info(execd, p["id"])["exit_code"] == 5


def test_output_since_after_the_ring_wrapped(execd):
    # 3 MiB of numbered 16-byte lines: every offset's byte is known.
    n = 3 * RING // 16
    script = ("import sys\nw = sys.stdout.buffer\n"
              f"for i in range({n}): w.write(b'%015d\\n' % i)\n")
    p = spawn(execd, f"python3 -c {shlex.quote(script)}")
    assert wait(execd, p["id"], 60)["exit_code"] == 0
    assert wait_for(lambda: not info(execd, p["id"])["output_open"], 10)
    want = b"".join(b"%015d\n" % i for i in range(n))
    total = len(want)
    assert info(execd, p["id"])["output_bytes"] == total
    obj, data = output(execd, p["id"], since=0)
    # What is kept, and the offset it starts at: never bytes labelled with a wrong offset.
    assert obj["start"] == total - RING and obj["dropped"] == total - RING
    assert obj["end"] == total and data == want[total - RING:]
    mid = total - RING // 2
    obj, data = output(execd, p["id"], since=mid)
    assert obj["start"] == mid and obj["dropped"] == 0 and data == want[mid:]
    obj, data = output(execd, p["id"], since=total)
    assert data == b"" and obj["start"] == obj["end"] == total
    assert "past the end" in error_of(
        execd.get("/processes/output", params={"id": p["id"], "since": str(total + 1)}), 400)


def test_flood_keeps_execd_small_and_the_shell_free(execd):
    spawn(execd, "true")  # the reader thread exists before the baseline
    time.sleep(0.3)
    before = execd.reset_hwm()  # growth from here, not the start's peak
    others = [spawn(execd, "cat /dev/zero") for _ in range(3)]
    flood = spawn(execd, "cat /dev/zero")
    fg = []
    while info(execd, flood["id"])["output_bytes"] < 200 << 20 or len(fg) < 3:
        r = execd.exec("echo fg-ok", timeout=30)
        assert r["exit_code"] == 0 and r["output"] == "fg-ok\n"
        fg.append(r["duration_ms"])
        time.sleep(0.05)
    assert info(execd, flood["id"])["running"], "the flood must still run: the test saw it all"
    grown = execd.rss_hwm_kib() - before
    # Four rings (1 MiB each) and a read (1 MiB) each, plus allocator slack; never the 800 MiB.
    assert grown < 24 << 10, f"execd grew {grown} KiB while 4 x 200 MiB were printed"
    obj, data = output(execd, flood["id"])
    assert len(data) == RING and set(data) == {0} and obj["dropped"] > 100 << 20
    r = execd.post("/processes/signal", {"id": flood["id"], "signal": "KILL"})
    assert r.status_code == 200
    assert wait(execd, flood["id"])["signal"] == 9
    for o in others:
        assert execd.post("/processes/signal", {"id": o["id"], "signal": "KILL"}).is_success


def test_signal_reaches_the_process_and_its_tree(execd):
    p = spawn(execd, "trap 'echo got-term; exit 7' TERM; echo ready; "
                     "while :; do sleep 0.05; done")
    assert wait_for(lambda: b"ready" in output(execd, p["id"])[1], 10)
    r = execd.post("/processes/signal", {"id": p["id"], "signal": "SIGTERM"})
    assert r.status_code == 200, r.text
    assert wait(execd, p["id"])["exit_code"] == 7
    assert b"got-term" in drained(execd, p["id"])[1]
    # A tree: plain children, a child in its own session (setsid), a grandchild.
    tree = spawn(execd, "sleep 300 & setsid sleep 301 & (sleep 302 &) ; echo started; wait")
    assert wait_for(lambda: b"started" in output(execd, tree["id"])[1], 10)
    time.sleep(0.2)
    kids = [p for p in descendants(execd.pid) if alive(p) and p != execd.shell_pid()]
    assert len(kids) >= 4
    r = execd.post("/processes/signal", {"id": tree["id"], "signal": 9})
    assert r.status_code == 200 and r.json()["signalled"] >= 4
    assert wait(execd, tree["id"])["exit_code"] == 137
    assert wait_for(lambda: not [p for p in kids if alive(p)], 5), "a child survived"


def test_signal_refuses_what_is_not_a_signal(execd):
    p = spawn(execd, "sleep 300")
    for bad in ("NOPE", "", 0, 65, -9, True, None, [9], "9; rm -rf /"):
        r = execd.post("/processes/signal", {"id": p["id"], "signal": bad})
        error_of(r, 400)
    assert info(execd, p["id"])["running"]


def test_reset_kills_them_all_as_trees_and_forgets_them(execd):
    a = spawn(execd, "sleep 300 & setsid sh -c 'sleep 303' & wait")
    b = spawn(execd, "trap '' TERM HUP; sleep 304")
    time.sleep(0.3)
    pids = [p for p in descendants(execd.pid) if alive(p) and p != execd.shell_pid()]
    assert len(pids) >= 5
    r = execd.post("/reset", {})
    assert r.status_code == 200 and r.json()["ok"], r.text
    assert not [p for p in pids if alive(p)]
    assert execd.get("/processes").json()["processes"] == []
    for old in (a, b):
        assert "no process" in error_of(execd.get("/processes/info", params={"id": old["id"]}),
                                        404)
    c = spawn(execd, "true")
    assert c["id"] not in (a["id"], b["id"])
    assert int(c["id"][1:].split("-")[0]) > int(b["id"][1:].split("-")[0])  # never reused


def test_foreground_timeout_never_kills_a_spawned_process(execd):
    p = spawn(execd, "sleep 300")
    r = execd.exec("sleep 30", timeout=0.5)
    assert r["exit_code"] == 124
    assert info(execd, p["id"])["running"] and alive(p["pid"])


def test_forged_foreign_and_path_like_ids(execd, execd_factory):
    other = execd_factory("--kill-grace", "0.5")
    theirs = spawn(other, "sleep 300")
    mine = spawn(execd, "sleep 300")
    for route in ("/processes/info", "/processes/output"):
        assert "no process" in error_of(execd.get(route, params={"id": theirs["id"]}), 404)
        forged = "p1-" + secrets.token_hex(12)
        error_of(execd.get(route, params={"id": forged}), 404)
        for bad in ("../../etc/passwd", "p1-../x", "/processes", mine["id"] + "/..", "",
                    mine["id"].upper(), "p1-" + "0" * 23, mine["id"] + "\n"):
            assert "invalid process id" in error_of(execd.get(route, params={"id": bad}), 400)
    for route in ("/processes/signal", "/processes/wait"):
        error_of(execd.post(route, {"id": theirs["id"]}), 404)
        error_of(execd.post(route, {"id": 7}), 400)
    assert alive(theirs["pid"]) and alive(mine["pid"])


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"Authorization": "Basic eDp5"}])
def test_every_process_route_needs_the_token(execd, headers):
    p = spawn(execd, "sleep 300")
    routes = [(m, path) for path, (m, _) in server.ROUTES.items()
              if path.startswith("/processes")]
    assert len(routes) == 6
    for method, path in routes:
        r = httpx.request(method, execd.url + path, headers=headers,
                          params={"id": p["id"]},
                          json={"command": "touch pwned", "id": p["id"], "signal": "KILL"})
        assert r.status_code == 401, (method, path, r.text)
    assert alive(p["pid"]) and not os.path.exists(execd.exec("pwd")["output"].strip()
                                                  + "/pwned")
    assert len(execd.get("/processes").json()["processes"]) == 1


def test_the_live_cap(execd):
    cap = background.BG_MAX_LIVE
    procs = [spawn(execd, "sleep 300") for _ in range(cap)]
    msg = error_of(execd.post("/processes/spawn", {"command": "sleep 1"}), 429)
    assert str(cap) in msg and "live" in msg
    # An ended one frees its place; its status is still there.
    execd.post("/processes/signal", {"id": procs[0]["id"], "signal": "KILL"})
    assert wait(execd, procs[0]["id"])["signal"] == 9
    assert wait_for(lambda: not info(execd, procs[0]["id"])["output_open"], 5)
    spawn(execd, "true")
    assert execd.get("/processes").json()["live"] <= cap


def test_a_child_holding_the_pipe_keeps_its_place(execd):
    # The leader exits, its child still writes: the pipe and its place stay until the child
    # ends, and the child's output still arrives.
    p = spawn(execd, "(sleep 0.5; echo late) & exit 0")
    assert wait(execd, p["id"])["exit_code"] == 0
    assert info(execd, p["id"])["output_open"]
    assert wait_for(lambda: output(execd, p["id"])[1] == b"late\n", 10)
    assert wait_for(lambda: not info(execd, p["id"])["output_open"], 5)


def test_a_retried_spawn_starts_once(execd):
    a = spawn(execd, "sleep 300", request_id="r-1")
    b = spawn(execd, "sleep 300", request_id="r-1")
    assert a["id"] == b["id"] and a["pid"] == b["pid"]
    assert len(execd.get("/processes").json()["processes"]) == 1


@pytest.mark.parametrize("body", [
    {}, {"command": ""}, {"command": 5}, {"command": "echo \0"}, {"command": "x" * (65 << 10)},
    {"command": "true", "env": {"A B": "1"}}, {"command": "true", "env": {"__SANDMAN_CALL": "x"}},
    {"command": "true", "env": {"A": 1}}, {"command": "true", "env": []},
    {"command": "true", "cwd": "/nonexistent/dir"}, {"command": "true", "cwd": 3},
    {"command": "true", "pty": True}, {"command": "true", "request_id": ""},
])
def test_bad_spawns_get_one_line_errors(execd, body):
    error_of(execd.post("/processes/spawn", body), 400)
    assert execd.get("/processes").json()["processes"] == []


def test_bad_since_and_wait_timeout(execd):
    p = spawn(execd, "true")
    for since in ("-1", "1e3", "abc", "¹"):
        error_of(execd.get("/processes/output", params={"id": p["id"], "since": since}), 400)
    for tmo in (-1, "5", True, 1e9):
        error_of(execd.post("/processes/wait", {"id": p["id"], "timeout": tmo}), 400)


def test_wait_returns_at_its_timeout_while_it_runs(execd):
    p = spawn(execd, "sleep 300")
    t0 = time.monotonic()
    r = wait(execd, p["id"], timeout=0.3)
    assert r["running"] and r["exit_code"] is None
    assert time.monotonic() - t0 < 10  # a hang check, not a speed target


def test_ended_outputs_beyond_the_budget_are_dropped_oldest_first(execd):
    budget, ring = background.BG_OUTPUT_BUDGET, RING
    ids = []
    for _ in range(budget // ring + 4):
        p = spawn(execd, f"head -c {ring} /dev/urandom")
        assert wait(execd, p["id"])["exit_code"] == 0
        assert wait_for(lambda i=p["id"]: not info(execd, i)["output_open"], 10)
        ids.append(p["id"])
    kept = []
    for i in ids:
        obj, data = output(execd, i)
        assert obj["end"] == ring and obj["start"] + len(data) == ring
        assert obj["dropped"] == obj["start"]  # said, never hidden
        kept.append(len(data))
    assert sum(kept) <= budget
    assert kept[0] == 0 and kept[-1] == ring  # the oldest went first


def test_reset_kills_an_escapee_without_the_tag(execd):
    # Drops the environment (and so the tag), leaves the session, double-forks: execd is
    # still its ancestor (subreaper), so /reset finds it; signal() cannot (docs/execd.md).
    p = spawn(execd, "env -i setsid sh -c 'sleep 307 & exec sleep 308' & sleep 0.2; echo ok")
    assert wait(execd, p["id"])["exit_code"] == 0
    gone = [q for q in descendants(execd.pid) if alive(q) and q != execd.shell_pid()]
    assert len(gone) >= 2
    assert execd.post("/reset", {}).json()["ok"]
    assert not [q for q in gone if alive(q)]


def test_stdin_is_empty_and_the_token_hash_is_not_passed(execd):
    p = spawn(execd, 'read -r x; echo "rc=$?"; env')
    wait(execd, p["id"])
    out = drained(execd, p["id"])[1]
    assert out.startswith(b"rc=1\n")
    assert b"SANDMAN_TOKEN_SHA256" not in out and b"__SANDMAN_CALL=" in out


def test_restore_kills_and_forgets_the_last_holders_processes(execd_factory, tmp_path):
    """A reused grading pod: the next holder must not see the last one's commands or output,
    nor find its processes running."""
    ws, etc, store = tmp_path / "ws", tmp_path / "etc", tmp_path / "store"
    ws.mkdir()
    etc.mkdir()
    (etc / "hosts").write_text("127.0.0.1 localhost\n")
    d = execd_factory("--workspace", str(ws), "--kill-grace", "0.5",
                      "--baseline-at-start", "on", "--baseline-store", str(store),
                      "--baseline-paths", str(etc), "--baseline-packages", str(etc / "none"),
                      "--baseline-localtime", str(etc / "localtime"))
    p = spawn(d, "echo last-holders-secret; setsid sleep 309 & sleep 310")
    assert wait_for(lambda: b"secret" in output(d, p["id"])[1], 10)
    r = d.post("/restore", {})
    assert r.status_code == 200 and r.json()["restored"], r.text
    assert d.get("/processes").json()["processes"] == []
    error_of(d.get("/processes/output", params={"id": p["id"]}), 404)
    assert not alive(p["pid"])
    assert d.others() == []
    q = spawn(d, "echo next")  # spawns work again after it
    assert wait(d, q["id"])["exit_code"] == 0


@pytest.mark.slow
def test_one_byte_writes_do_not_multiply_the_ring(execd):
    """Each read of a process writing one byte at a time may bring one byte: kept as one object
    per read, a 1 MiB ring grew execd by ~5 MiB."""
    spawn(execd, "true")
    time.sleep(0.3)
    before = execd.reset_hwm()  # the peak from here on, not the start's compile
    script = "import os\nfor _ in range(1500000): os.write(1, b'x')\n"
    ps = [spawn(execd, f"python3 -c {shlex.quote(script)}") for _ in range(2)]
    for p in ps:
        assert wait(execd, p["id"], 60)["exit_code"] == 0
        assert drained(execd, p["id"])[0]["output_bytes"] == 1500000
    grown = execd.rss_hwm_kib() - before
    assert grown < 6 << 10, f"execd grew {grown} KiB for two 1 MiB rings"
    for p in ps:
        obj, data = output(execd, p["id"])
        assert data == b"x" * RING and obj["start"] == 1500000 - RING


def test_a_killed_tree_acts_on_none_of_its_members_deaths(execd, tmp_path):
    """SIGKILL to a spawn: the leader must not outlive its children long enough to act on
    their deaths (`wait -n` wakes on the first; `:>` needs no fork). Killed one by one, a child
    killed before the leader let it write `acted` (and a plain `wait` exit 0, not 137): the
    whole tree is stopped first."""
    for i in range(12):
        acted = tmp_path / f"acted-{i}"
        p = spawn(execd, "for i in $(seq 24); do sleep 300 & done; echo forked; "
                         f"wait -n; : > {acted}; wait")
        assert wait_for(lambda p=p: b"forked" in output(execd, p["id"])[1], 10)
        r = execd.post("/processes/signal", {"id": p["id"], "signal": "KILL"})
        assert r.status_code == 200 and r.json()["signalled"] >= 25, r.text
        assert wait(execd, p["id"])["exit_code"] == 137
        assert not acted.exists(), f"round {i}: the leader acted on a child's death"
