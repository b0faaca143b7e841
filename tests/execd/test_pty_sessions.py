"""Interactive sessions (/sessions/*): a program on its own pty, written to and read from
across calls. A REPL round trip, the window size the child sees, a flood that must not grow
execd nor block the foreground shell, close and /reset killing trees (a child that ignores
SIGHUP), the live cap, hostile ids and unauthenticated calls. Real execd, real bash, real
sockets on 127.0.0.1."""

from __future__ import annotations

import base64
import os
import secrets
import time

import httpx
import pytest

from execd.execd_daemon import server, sessions

from .conftest import alive, descendants, wait_for

RING = sessions.PTY_RING


def open_session(execd, **kw) -> dict:
    r = execd.post("/sessions/open", kw)
    assert r.status_code == 200, r.text
    return r.json()


def write(execd, sid: str, data: bytes) -> dict:
    r = execd.post("/sessions/write", {"id": sid, "data_b64": base64.b64encode(data).decode()})
    assert r.status_code == 200, r.text
    return r.json()


def read(execd, sid: str, since: int = 0, timeout: float = 0) -> tuple[dict, bytes]:
    r = execd.get("/sessions/read", params={"id": sid, "since": str(since),
                                            "timeout": str(timeout)})
    assert r.status_code == 200, r.text
    obj = r.json()
    return obj, base64.b64decode(obj["data_b64"])


def expect(execd, sid: str, needle: bytes, since: int = 0, within: float = 15) -> tuple[int, bytes]:
    """Read from `since` until `needle` shows up: (the offset after it, what was read)."""
    got = b""
    deadline = time.monotonic() + within
    while needle not in got:
        left = deadline - time.monotonic()
        assert left > 0, f"{needle!r} not seen in {got[-500:]!r}"
        obj, data = read(execd, sid, since, timeout=min(left, 2))
        got += data
        since = obj["end"]
    return since, got


def error_of(r: httpx.Response, code: int) -> str:
    assert r.status_code == code, (r.status_code, r.text)
    msg = r.json()["error"]
    assert msg and "\n" not in msg
    return msg


def close(execd, sid: str) -> dict:
    r = execd.post("/sessions/close", {"id": sid})
    assert r.status_code == 200, r.text
    return r.json()


def test_python_repl_round_trip(execd, tmp_path):
    s = open_session(execd, command="python3 -i -q")
    assert s["id"].startswith("s") and s["running"] and (s["cols"], s["rows"]) == (80, 24)
    assert s["cwd"] == str(tmp_path / "ws")
    off, _ = expect(execd, s["id"], b">>> ")
    write(execd, s["id"], b"1+1\n")
    off, got = expect(execd, s["id"], b"2\r\n>>> ", off)
    assert b"\x1b" not in got  # TERM=dumb: no escape sequences in a plain REPL
    # A read with nothing new waits its timeout, then answers empty at the same offset.
    t0 = time.monotonic()
    obj, data = read(execd, s["id"], off, timeout=0.5)
    assert data == b"" and obj["end"] == off and time.monotonic() - t0 >= 0.4
    write(execd, s["id"], b"exit()\n")
    assert wait_for(lambda: not read(execd, s["id"], off)[0]["running"], 10)
    obj, _ = read(execd, s["id"], off)
    assert obj["exit_code"] == 0
    error_of(execd.post("/sessions/write", {"id": s["id"], "data_b64": "eA=="}), 409)
    close(execd, s["id"])


def test_default_is_an_interactive_bash_with_a_controlling_terminal(execd):
    s = open_session(execd)
    assert s["command"] == "bash -i"
    # The image's bashrc sets its own prompt; the echo of this line never shows the new one.
    write(execd, s["id"], b"PS1='PRO''MPT$ '\n")
    off, _ = expect(execd, s["id"], b"PROMPT$ ")
    write(execd, s["id"], b"tty; echo SM_$((6*7))\n")
    off, got = expect(execd, s["id"], b"SM_42", off)
    assert b"/dev/pts/" in got
    # ^C written to the terminal interrupts its foreground job, as a terminal's key does.
    write(execd, s["id"], b"echo zz-started; sleep 300; echo af''ter\n")
    off, _ = expect(execd, s["id"], b"zz-started\r\n", off)  # the output, not the echo
    time.sleep(0.2)
    write(execd, s["id"], b"\x03")
    write(execd, s["id"], b"echo done-$((1+1))\n")
    off, got = expect(execd, s["id"], b"done-2", off)
    assert b"after" not in got and b"\x1b" not in got
    close(execd, s["id"])


def test_resize_is_seen_by_the_child(execd):
    s = open_session(execd, command="bash --norc --noprofile -i", cols=100, rows=30,
                     env={"PS1": "P$ "})
    off, _ = expect(execd, s["id"], b"P$ ")
    write(execd, s["id"], b"stty size\n")
    off, _ = expect(execd, s["id"], b"30 100", off)
    r = execd.post("/sessions/resize", {"id": s["id"], "cols": 132, "rows": 43})
    assert r.status_code == 200 and (r.json()["cols"], r.json()["rows"]) == (132, 43)
    write(execd, s["id"], b"trap 'echo WINCH' WINCH; stty size\n")
    off, _ = expect(execd, s["id"], b"43 132", off)
    # A resize while the trap is set: the kernel sends SIGWINCH to the foreground job.
    execd.post("/sessions/resize", {"id": s["id"], "cols": 90, "rows": 20})
    write(execd, s["id"], b"stty size\n")
    expect(execd, s["id"], b"20 90", off)
    for bad in ({"cols": 0, "rows": 5}, {"cols": 5}, {"cols": True, "rows": 5},
                {"cols": 99999, "rows": 5}, {"cols": "80", "rows": 5}):
        error_of(execd.post("/sessions/resize", {"id": s["id"], **bad}), 400)
    close(execd, s["id"])


@pytest.mark.slow
def test_flood_keeps_execd_small_and_the_shell_free(execd):
    s0 = open_session(execd, command="true")  # the reader thread exists before the baseline
    time.sleep(0.3)
    close(execd, s0["id"])
    before = execd.reset_hwm()  # growth from here, not the start's peak
    floods = [open_session(execd, command="cat /dev/zero | od -v -An") for _ in range(3)]
    total = 0
    fg = 0
    while total < 100 << 20 or fg < 3:
        r = execd.exec("echo fg-ok", timeout=30)
        assert r["exit_code"] == 0 and r["output"] == "fg-ok\n"
        fg += 1
        total = min(read(execd, f["id"], 0)[0]["output_bytes"] for f in floods)
        time.sleep(0.05)
    grown = execd.rss_hwm_kib() - before
    # Three rings (256 KiB each) and one read buffer (1 MiB), plus slack; never the 300 MiB.
    assert grown < 16 << 10, f"execd grew {grown} KiB while 3 x 100 MiB were printed"
    obj, data = read(execd, floods[0]["id"], 0)
    assert len(data) == RING and obj["dropped"] == obj["start"] > 50 << 20
    assert obj["running"]
    for f in floods:
        close(execd, f["id"])
        assert not alive(f["pid"])


def test_close_kills_the_tree_even_what_ignores_sighup(execd):
    s = open_session(execd, command="trap '' HUP TERM; (trap '' HUP; sleep 301) & "
                                    "setsid sleep 302 & echo started; sleep 303")
    expect(execd, s["id"], b"started")
    time.sleep(0.2)
    kids = [p for p in descendants(execd.pid) if alive(p) and p != execd.shell_pid()]
    assert len(kids) >= 3
    out = close(execd, s["id"])
    assert out["closed"] and not out["running"]
    assert wait_for(lambda: not [p for p in kids if alive(p)], 5), "a child survived"
    assert "no session" in error_of(execd.get("/sessions/read", params={"id": s["id"]}), 404)
    assert execd.get("/sessions").json()["sessions"] == []


def test_reset_kills_all_sessions_and_forgets_them(execd):
    a = open_session(execd, command="trap '' HUP; sleep 300")
    b = open_session(execd, command="bash --norc -i", env={"PS1": "B$ "})
    expect(execd, b["id"], b"B$ ")
    write(execd, b["id"], b"echo secret-of-b; sleep 304 &\n")
    expect(execd, b["id"], b"secret-of-b")
    time.sleep(0.2)
    pids = [p for p in descendants(execd.pid) if alive(p) and p != execd.shell_pid()]
    assert len(pids) >= 3
    r = execd.post("/reset", {})
    assert r.status_code == 200 and r.json()["ok"], r.text
    assert not [p for p in pids if alive(p)]
    assert execd.get("/sessions").json()["sessions"] == []
    for old in (a, b):
        error_of(execd.get("/sessions/read", params={"id": old["id"]}), 404)
    c = open_session(execd, command="true")
    assert int(c["id"][1:].split("-")[0]) > int(b["id"][1:].split("-")[0])  # never reused


def test_restore_kills_and_forgets_the_last_holders_sessions(execd_factory, tmp_path):
    ws, etc, store = tmp_path / "ws", tmp_path / "etc", tmp_path / "store"
    ws.mkdir()
    etc.mkdir()
    (etc / "hosts").write_text("127.0.0.1 localhost\n")
    d = execd_factory("--workspace", str(ws), "--kill-grace", "0.5",
                      "--baseline-at-start", "on", "--baseline-store", str(store),
                      "--baseline-paths", str(etc), "--baseline-packages", str(etc / "none"),
                      "--baseline-localtime", str(etc / "localtime"))
    s = open_session(d, command="echo last-holders-secret; trap '' HUP; sleep 310")
    expect(d, s["id"], b"secret")
    r = d.post("/restore", {})
    assert r.status_code == 200 and r.json()["restored"], r.text
    assert d.get("/sessions").json()["sessions"] == []
    error_of(d.get("/sessions/read", params={"id": s["id"]}), 404)
    assert not alive(s["pid"]) and d.others() == []
    t = open_session(d, command="echo next")
    expect(d, t["id"], b"next")
    close(d, t["id"])


def test_the_live_cap(execd):
    cap = sessions.PTY_MAX_LIVE
    items = [open_session(execd, command="sleep 300") for _ in range(cap)]
    msg = error_of(execd.post("/sessions/open", {"command": "sleep 1"}), 429)
    assert str(cap) in msg and "open" in msg
    close(execd, items[0]["id"])
    s = open_session(execd, command="true")
    assert execd.get("/sessions").json()["live"] <= cap
    for x in items[1:] + [s]:
        close(execd, x["id"])


def test_forged_foreign_and_path_like_ids(execd, execd_factory):
    other = execd_factory("--kill-grace", "0.5")
    theirs = open_session(other, command="sleep 300")
    mine = open_session(execd, command="sleep 300")
    assert "no session" in error_of(execd.get("/sessions/read", params={"id": theirs["id"]}),
                                    404)
    error_of(execd.get("/sessions/read", params={"id": "s1-" + secrets.token_hex(12)}), 404)
    for bad in ("../../etc/passwd", "s1-../x", mine["id"] + "/..", "", mine["id"].upper(),
                "s1-" + "0" * 23, mine["id"] + "\n", "p1-" + "0" * 24):
        assert "invalid session id" in error_of(
            execd.get("/sessions/read", params={"id": bad}), 400)
    extra = {"/sessions/write": {"data_b64": ""}, "/sessions/resize": {"cols": 5, "rows": 5}}
    for route in ("/sessions/write", "/sessions/resize", "/sessions/signal", "/sessions/close"):
        error_of(execd.post(route, {"id": theirs["id"], **extra.get(route, {})}), 404)
        error_of(execd.post(route, {"id": 7, **extra.get(route, {})}), 400)
    assert alive(theirs["pid"]) and alive(mine["pid"])
    close(execd, mine["id"])
    close(other, theirs["id"])


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"Authorization": "Basic eDp5"}])
def test_every_session_route_needs_the_token(execd, headers):
    s = open_session(execd, command="sleep 300")
    routes = [(m, path) for path, (m, _) in server.ROUTES.items()
              if path.startswith("/sessions")]
    assert len(routes) == 7
    for method, path in routes:
        r = httpx.request(method, execd.url + path, headers=headers, params={"id": s["id"]},
                          json={"command": "touch pwned", "id": s["id"], "signal": "KILL",
                                "data_b64": base64.b64encode(b"touch pwned\n").decode()})
        assert r.status_code == 401, (method, path, r.text)
    assert alive(s["pid"]) and not os.path.exists(execd.exec("pwd")["output"].strip()
                                                  + "/pwned")
    assert len(execd.get("/sessions").json()["sessions"]) == 1
    close(execd, s["id"])


@pytest.mark.parametrize("body", [
    {"command": ""}, {"command": 5}, {"command": "x\0y"}, {"cols": 0}, {"rows": 5000},
    {"env": {"A B": "x"}}, {"env": {"__SANDMAN_CALL": "x"}}, {"env": []}, {"cwd": "/nonexistent"},
    {"shell": "zsh"}, {"abandon_after": 0}, {"abandon_after": -1}, {"abandon_after": True},
    {"abandon_after": "5"}, {"abandon_after": sessions.PTY_ABANDON_MAX + 1},
])
def test_bad_opens_get_one_line_errors(execd, body):
    error_of(execd.post("/sessions/open", body), 400)
    assert execd.get("/sessions").json()["sessions"] == []


def test_bad_writes_reads_and_signals(execd):
    s = open_session(execd, command="sleep 300")
    for bad in ({"data_b64": "!!"}, {"data_b64": 5}, {"data": "x"},
                {"data_b64": "A" * (sessions.PTY_WRITE_MAX * 2)}):
        error_of(execd.post("/sessions/write", {"id": s["id"], **bad}), 400)
    for params in ({"since": "-1"}, {"since": "1"}, {"timeout": "nan"}, {"timeout": "-1"},
                   {"timeout": "1e9"}):
        error_of(execd.get("/sessions/read", params={"id": s["id"], **params}), 400)
    for bad in ("NOPE", "", 0, 65, True, [9]):
        error_of(execd.post("/sessions/signal", {"id": s["id"], "signal": bad}), 400)
    assert alive(s["pid"])
    r = execd.post("/sessions/signal", {"id": s["id"], "signal": "TERM"})
    assert r.status_code == 200 and r.json()["signalled"] == 1
    assert wait_for(lambda: not alive(s["pid"]), 5)
    close(execd, s["id"])


@pytest.mark.slow
def test_a_program_that_never_reads_its_input(execd):
    s = open_session(execd, command="stty -icanon; sleep 300")
    time.sleep(0.3)
    t0 = time.monotonic()
    r = execd.post("/sessions/write", {"id": s["id"], "data_b64": base64.b64encode(
        b"x" * sessions.PTY_WRITE_MAX).decode()}, timeout=60)
    msg = error_of(r, 409)
    assert "does not read" in msg and r.json()["written"] < sessions.PTY_WRITE_MAX
    assert time.monotonic() - t0 < sessions.PTY_WRITE_WAIT + 5
    assert execd.exec("echo ok")["output"] == "ok\n"  # the write blocked nothing else
    close(execd, s["id"])


def test_retried_open_write_and_signal_act_once(execd):
    """An SDK retry after a lost answer carries the same request_id: one session, the keys
    typed once, the signal sent once."""
    body = {"command": "bash --norc -i", "env": {"PS1": "R$ "}, "request_id": "open-1"}
    first = open_session(execd, **body)
    again = open_session(execd, **body)
    assert again["id"] == first["id"] and len(execd.get("/sessions").json()["sessions"]) == 1
    off, _ = expect(execd, first["id"], b"R$ ")
    keys = {"id": first["id"], "data_b64": base64.b64encode(b"echo N$((n=n+1))\n").decode(),
            "request_id": "w-1"}
    for _ in range(3):
        r = execd.post("/sessions/write", keys)
        assert r.status_code == 200 and r.json()["written"] == 17, r.text
    write(execd, first["id"], b"echo END\n")
    _, got = expect(execd, first["id"], b"END\r\n", off)
    assert got.count(b"N1") == 1 and b"N2" not in got
    sig = open_session(execd, command="python3 -c \"import signal, time; signal.signal("
                                       "signal.SIGUSR1, lambda *a: print('GOT', flush=True)); "
                                       "print('READY', flush=True); time.sleep(300)\"")
    off, _ = expect(execd, sig["id"], b"READY")
    for _ in range(2):
        r = execd.post("/sessions/signal", {"id": sig["id"], "signal": "USR1",
                                            "request_id": "sig-1"})
        assert r.status_code == 200 and r.json()["signalled"] == 1
        time.sleep(0.3)  # apart: a second delivery would print a second line
    _, got = expect(execd, sig["id"], b"GOT", off)
    time.sleep(0.3)
    got += read(execd, sig["id"], off + len(got))[1]
    assert got.count(b"GOT") == 1, got
    close(execd, sig["id"])
    error_of(execd.post("/sessions/open", {"command": "true", "request_id": ""}), 400)
    close(execd, first["id"])


def _kids(execd) -> list[int]:
    return [p for p in descendants(execd.pid) if alive(p) and p != execd.shell_pid()]


def test_a_close_by_the_opens_request_id_ends_it_and_refuses_that_open_later(execd):
    """A caller stopped while its open's answer was on its way (`sandman shell` on a SIGTERM)
    knows only the request_id it sent: a close naming it kills the session's tree, and that
    open arriving only afterwards (a retry, a slow network) starts nothing."""
    s = open_session(execd, command="sleep 305 & sleep 306", request_id="stopped-1")
    assert wait_for(lambda: len(_kids(execd)) >= 2, 5)
    kids = _kids(execd)
    out = execd.post("/sessions/close", {"open_request_id": "stopped-1"}).json()
    assert out["closed"] is True and out["id"] == s["id"]
    assert wait_for(lambda: not [p for p in kids if alive(p)], 5), "a child survived"
    assert execd.get("/sessions").json()["sessions"] == []
    assert "closed before it opened" in error_of(execd.post(
        "/sessions/open", {"command": "sleep 307", "request_id": "stopped-1"}), 409)
    # The close came first: the open is refused when it comes.
    r = execd.post("/sessions/close", {"open_request_id": "late-1"})
    assert r.status_code == 200 and r.json() == {"closed": False, "open_request_id": "late-1"}
    error_of(execd.post("/sessions/open", {"command": "sleep 308", "request_id": "late-1"}),
             409)
    assert execd.get("/sessions").json()["sessions"] == [] and _kids(execd) == []
    for bad in ({"open_request_id": ""}, {"open_request_id": 5}, {"open_request_id": "x" * 257},
                {"id": s["id"], "open_request_id": "x"}, {"id": s["id"], "force": True}):
        error_of(execd.post("/sessions/close", bad), 400)


def test_a_session_no_call_names_for_abandon_after_is_closed(execd):
    """A client killed before the open's answer came (a SIGKILLed `sandman shell`), or since:
    nobody knows the id, nobody closes it. With abandon_after, execd closes it once no call
    named it that long; one that is read (a waiting read counts throughout) stays."""
    kept = open_session(execd, command="sleep 309", abandon_after=4)
    left = open_session(execd, command="sleep 310 & sleep 311", abandon_after=1)
    assert (kept["abandon_after"], left["abandon_after"]) == (4, 1)
    assert wait_for(lambda: len(_kids(execd)) >= 3, 5)
    kids = [p for p in _kids(execd) if p != kept["pid"]]
    t0 = time.monotonic()
    listed = {left["id"]}
    # Bounded: 1 s and the 0.5 s check, with room for a loaded machine; and past kept's 4 s.
    while left["id"] in listed or time.monotonic() - t0 < 6:
        assert time.monotonic() - t0 < 30, "the abandoned session is still open"
        read(execd, kept["id"], timeout=1)
        listed = {x["id"] for x in execd.get("/sessions").json()["sessions"]}
    assert not [p for p in kids if alive(p)], "a child of the abandoned session survived"
    assert listed == {kept["id"]} and alive(kept["pid"])
    error_of(execd.get("/sessions/read", params={"id": left["id"]}), 404)
    close(execd, kept["id"])
