"""POST /exec: persistence, refusal of incomplete input, strict frames, timeouts and the paper's
child-process scenarios (appendix G, tables A22, A25, A26, A27), floods, shell death, retries."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from execd.execd_daemon import shell

from .conftest import alive, proc_state, wait_for

MARKER_LEN = 17  # "@" + 16 hex digits


def read_pids(path: Path) -> list[int]:
    assert wait_for(lambda: path.exists() and path.read_text().strip(), 5), f"{path} empty"
    return [int(x) for x in path.read_text().split()]


# ---------------------------------------------------------------- persistence and busy


def test_state_persists_across_calls(execd, tmp_path):
    r = execd.exec(f"cd {tmp_path}; export FOO=bar; greet() {{ echo hello $1; }}; X=42")
    assert r["exit_code"] == 0 and r["error"] is None
    r = execd.exec("pwd; echo $FOO $X; greet you")
    assert r["output"] == f"{tmp_path}\nbar 42\nhello you\n"
    r = execd.exec("sleep 60 & echo started")
    assert r["output"] == "started\n"
    r = execd.exec("jobs -p | wc -l; kill %1; wait %1; echo $?")
    assert r["output"].split() == ["1", "143"]


def test_exit_codes_and_output_exact(execd):
    assert execd.exec("false")["exit_code"] == 1
    assert execd.exec("(exit 200)")["exit_code"] == 200
    r = execd.exec("printf 'a\\r\\nb'; printf 'err' >&2")
    assert r["output"] == "a\r\nberr" and r["exit_code"] == 0 and r["truncated"] is False
    assert isinstance(r["duration_ms"], float)


def test_command_stdin_is_not_the_protocol(execd):
    r = execd.exec("cat; read x; echo read=$?")
    assert r["output"] == "read=1\n"
    assert execd.exec("echo still")["output"] == "still\n"


def test_second_exec_while_busy_gets_409_at_once(execd):
    first = {}
    t = threading.Thread(target=lambda: first.update(execd.exec("sleep 1.5; echo done")))
    t.start()
    try:
        assert wait_for(lambda: execd.state()["busy"], 5)
        t0 = time.monotonic()
        r = execd.post("/exec", {"command": "echo second"})
        assert time.monotonic() - t0 < 0.5
        assert r.status_code == 409 and r.json()["error"] == "busy"
    finally:
        t.join(30)
    assert first["output"] == "done\n"


# ---------------------------------------------------------------- incomplete input (A26)


def _assert_refused(execd, command, fragment, tmp_path):
    execd.exec("KEEP=kept")
    t0 = time.monotonic()
    r = execd.exec(command, timeout=20)  # a regression then fails in 20 s, not 300
    elapsed = time.monotonic() - t0
    assert r["exit_code"] == 2, r
    assert fragment in r["error"], r["error"]
    assert elapsed < 2.0, f"refusal took {elapsed:.2f}s"
    assert r["output"] == ""
    assert not (tmp_path / "ws" / "ran").exists(), "part of the refused command ran"
    assert execd.exec("echo $KEEP")["output"] == "kept\n", "shell state lost"


def test_unterminated_heredoc_into_file(execd, tmp_path):
    _assert_refused(execd, "touch ran\ncat > out.py <<'EOF'\nprint(1)\n", "here-document",
                    tmp_path)
    assert not (tmp_path / "ws" / "out.py").exists()


def test_unterminated_heredoc_second_form(execd, tmp_path):
    _assert_refused(execd, "touch ran; cat <<EOF > out.txt\nsome text\nEO F", "here-document",
                    tmp_path)


def test_unbalanced_quote_nesting_in_search(execd, tmp_path):
    _assert_refused(execd, "touch ran\ngrep -rn \"def foo(self, x='a\" . | grep \"x'",
                    "unexpected EOF", tmp_path)


def test_open_python_c_program(execd, tmp_path):
    _assert_refused(execd, "touch ran\npython3 -c 'import sys\nprint(sys.argv)\n",
                    "unexpected EOF", tmp_path)


def test_unterminated_single_quote(execd, tmp_path):
    _assert_refused(execd, "touch ran; echo 'abc", "unexpected EOF", tmp_path)


def test_wrapper_escape_is_parsed_not_run(execd, tmp_path):
    # Wrapping in a function and eval-ing would run `touch ran` during the "check".
    _assert_refused(execd, "x; }; touch ran; f() {", "syntax error", tmp_path)


def test_check_runs_nothing_valid_command_runs_once(execd, tmp_path):
    r = execd.exec("echo x >> count; cat count | wc -l; exit_not_run=1")
    assert r["output"].strip() == "1"
    assert (tmp_path / "ws" / "count").read_text() == "x\n"


def test_extglob_enabled_in_the_same_command(execd):
    r = execd.exec("shopt -s extglob\nmkdir -p d && cd d && touch a b keep && echo !(keep)")
    assert r["exit_code"] == 0 and r["output"] == "a b\n"


def test_diagnosis_line_numbers_are_the_commands(execd):
    r = execd.exec("echo a\necho b\necho 'c")
    assert "line 3" in r["error"] and r["error"].startswith("bash: line"), r["error"]


# ---------------------------------------------------------------- frames (A25)


def test_parse_frame_every_split_point():
    marker = b"@0123456789abcdef"
    for status in (0, 1, 12, 127, 255):
        for kind in (b"S", b"E"):
            frame = marker + kind + str(status).encode() + b"\n"
            for cut in range(len(frame)):
                assert shell.parse_frame(bytearray(frame[:cut]), marker)[0] == "need"
            assert shell.parse_frame(bytearray(frame), marker) == ("ok", kind.decode(),
                                                                        status)


@pytest.mark.parametrize("bad", [b"S\n", b"S256\n", b"S007\n", b"S-1\n", b"S1x\n", b"X0\n",
                                 b"S1234", b"S1\nextra"])
def test_parse_frame_rejects(bad):
    marker = b"@0123456789abcdef"
    assert shell.parse_frame(bytearray(marker + bad), marker)[0] == "invalid"
    assert shell.parse_frame(bytearray(b"junk" + marker + b"S0\n"), marker)[0] == "invalid"
    assert shell.parse_frame(bytearray(b"@01234567"), b"@0123456789abcdef")[0] == "need"


def _broken_frame(writer: str) -> str:
    """A command whose frame the shell writes broken: commands run with the status channel
    closed, so the command replaces the shell's own frame writer for its call instead."""
    return f"__sm_fin() {{ {writer}; }}"


def test_frame_forced_empty_status_restarts_shell(execd):
    execd.exec("KEEP=1")
    old = execd.shell_pid()
    r = execd.exec(_broken_frame("builtin printf '%s\\n' \"$__sm_m\" >&62; sleep 5"))
    assert "invalid frame" in r["error"] and "state lost" in r["error"]
    assert r["exit_code"] == -1
    assert execd.shell_pid() != old
    assert execd.exec("echo ${KEEP:-gone}")["output"] == "gone\n"
    assert execd.exec("false")["exit_code"] == 1


def test_frame_forged_out_of_range_status(execd):
    r = execd.exec(_broken_frame("builtin printf '%sS999\\n' \"$__sm_m\" >&62; sleep 5"))
    assert "invalid frame" in r["error"] and r["exit_code"] == -1


def test_frame_shell_dies_after_marker_before_status(execd):
    r = execd.exec(_broken_frame("builtin printf '%s' \"$__sm_m\" >&62; kill -9 $$"))
    assert r["exit_code"] == 137
    assert "incomplete frame" in r["error"] and "shell exited" in r["error"]
    assert execd.exec("echo next")["output"] == "next\n"


def test_frame_shell_dies_after_partial_status(execd):
    r = execd.exec(_broken_frame("builtin printf '%sS12' \"$__sm_m\" >&62; exit 1"))
    assert r["exit_code"] == 1
    assert "incomplete frame" in r["error"] and "shell exited" in r["error"]


@pytest.mark.parametrize("read_size", [1, 5, MARKER_LEN, MARKER_LEN + 1, MARKER_LEN + 2])
def test_frame_split_across_reads(execd_factory, read_size):
    d = execd_factory("--status-read-size", str(read_size))
    for cmd, code in (("false", 1), ("(exit 127)", 127), ("true", 0), ("(exit 12)", 12)):
        r = d.exec(cmd)
        assert r["exit_code"] == code and r["error"] is None, (cmd, r)


def test_frame_4053_bytes_then_failing_command_around_4k_reads(execd_factory):
    # The paper's untampered case: output ending near a 4,096-byte read boundary.
    d = execd_factory("--status-read-size", str(MARKER_LEN))
    for n in list(range(4040, 4100, 3)) + [4053, 8192 - MARKER_LEN, 65536]:
        r = d.exec(f"head -c {n} /dev/zero | tr '\\0' a; false")
        assert r["exit_code"] == 1 and r["error"] is None, (n, r)
        assert r["output"] == "a" * n


# ---------------------------------------------------------------- timeouts and children (A22)


def test_timeout_returns_124_output_so_far_shell_survives(execd):
    execd.exec("KEEP=1")
    t0 = time.monotonic()
    r = execd.exec("echo before; sleep 100", timeout=1)
    assert time.monotonic() - t0 < 5
    assert r["exit_code"] == 124 and r["output"].startswith("before\n")
    assert "timeout" in r["error"]
    assert execd.exec("echo $KEEP")["output"] == "1\n"


def test_timeout_builtin_loop_is_broken_shell_kept(execd):
    execd.exec("KEEP=1")
    shell = execd.shell_pid()
    r = execd.exec("while :; do :; done", timeout=1)
    assert r["exit_code"] == 124 and "restarted" not in r["error"], r
    assert execd.exec("echo $KEEP")["output"] == "1\n"
    assert execd.shell_pid() == shell
    assert execd.others() == []


def test_timeout_of_a_shell_that_ignores_the_skip_restarts_it(execd):
    # A command that takes the skip's signal away (sabotage, docs/execd.md "Limits"): the
    # shell is stopped, killed and replaced, and the answer says the state was lost.
    r = execd.exec("trap '' RTMIN+8; while :; do :; done", timeout=1)
    assert r["exit_code"] == 124 and "restarted" in r["error"] and "state lost" in r["error"]
    assert execd.exec("echo ok")["output"] == "ok\n"
    assert execd.others() == []


def _no_survivors(execd, pids):
    assert wait_for(lambda: not [p for p in pids if alive(p)], 5), [p for p in pids if alive(p)]


def test_child_timeout_plain_background(execd, tmp_path):
    f = tmp_path / "pids"
    r = execd.exec(f"sleep 100 & echo $! > {f}; sleep 100", timeout=1)
    assert r["exit_code"] == 124
    _no_survivors(execd, read_pids(f))
    assert execd.others() == []


def test_child_timeout_background_ignores_sigterm(execd, tmp_path):
    f = tmp_path / "pids"
    r = execd.exec(f"(trap '' TERM; echo $BASHPID > {f}; exec sleep 100) & sleep 100", timeout=1)
    assert r["exit_code"] == 124
    _no_survivors(execd, read_pids(f))
    assert execd.others() == []


def test_child_timeout_foreground_ignores_sigterm(execd, tmp_path):
    f = tmp_path / "pids"
    r = execd.exec(f"bash -c 'trap \"\" TERM; echo $$ > {f}; while :; do sleep 0.1; done'",
                   timeout=1)
    assert r["exit_code"] == 124
    _no_survivors(execd, read_pids(f))
    assert execd.others() == []


def test_child_shell_killed_two_children(execd, tmp_path):
    f = tmp_path / "pids"
    r = execd.exec(f"sleep 100 & echo $! >> {f}; sleep 100 & echo $! >> {f}; kill -9 $$")
    assert r["exit_code"] == 137 and "shell exited" in r["error"]
    pids = read_pids(f)
    assert len(pids) == 2
    _no_survivors(execd, pids)
    assert execd.others() == []


def test_child_shell_exits_one_child(execd, tmp_path):
    f = tmp_path / "pids"
    r = execd.exec(f"sleep 100 & echo $! > {f}; exit 4")
    assert r["exit_code"] == 4 and "shell exited" in r["error"]
    _no_survivors(execd, read_pids(f))
    assert execd.others() == []


def test_child_shell_killed_child_holds_output_pipe(execd, tmp_path):
    f = tmp_path / "pids"
    t0 = time.monotonic()
    r = execd.exec(f"(echo $BASHPID > {f}; sleep 100; echo late) & sleep 0.2; kill -9 $$",
                   timeout=60)
    assert time.monotonic() - t0 < 5, "shell death noticed only at the timeout"
    assert r["exit_code"] == 137 and "shell exited" in r["error"]
    _no_survivors(execd, read_pids(f))
    assert execd.others() == []


def test_child_normal_background_left_on_purpose_until_reset(execd, tmp_path):
    f = tmp_path / "pids"
    r = execd.exec(f"sleep 100 & echo $! >> {f}; sleep 100 & echo $! >> {f}")
    assert r["exit_code"] == 0
    pids = read_pids(f)
    assert all(alive(p) for p in pids), "background children must survive the answer"
    assert execd.post("/reset", {}).status_code == 200
    _no_survivors(execd, pids)
    assert execd.others() == []


def test_child_timeout_own_session(execd, tmp_path):
    f = tmp_path / "pids"
    r = execd.exec(f"setsid -f bash -c 'echo $$ > {f}; exec sleep 100'; sleep 100", timeout=1)
    assert r["exit_code"] == 124
    _no_survivors(execd, read_pids(f))
    assert execd.others() == []


def test_timeout_spares_earlier_background_jobs(execd, tmp_path):
    f = tmp_path / "pids"
    execd.exec(f"sleep 100 & echo $! > {f}")
    keep = read_pids(f)
    r = execd.exec("sleep 100", timeout=1)
    assert r["exit_code"] == 124
    assert all(alive(p) for p in keep)



def test_timeout_with_sigterm_ignoring_child_next_command_runs_state_kept(execd):
    # Issue 15: bash's "Killed" notice for the timed-out job landed in the next command's syntax
    # check, which refused it (exit 2, not run).
    assert execd.exec("export V=42")["exit_code"] == 0
    r = execd.exec('(trap "" TERM; sleep 1000) & sleep 1000', timeout=1)
    assert r["exit_code"] == 124
    r = execd.exec("echo $V")
    assert r["exit_code"] == 0 and r["error"] is None, r
    assert r["output"].endswith("42\n"), r
    r = execd.exec("echo $V")
    assert (r["exit_code"], r["output"], r["error"]) == (0, "42\n", None)
    assert execd.others() == []


def test_job_notice_told_apart_from_parse_diagnostics(execd, tmp_path):
    # The fallback for a notice that slips past the flush (a job killed between flush and
    # check): real notices from bash for jobs killed by signals, real diagnostics from the check.
    # As in execd: the job is killed from outside while bash waits for its next line.
    notes, pidf = tmp_path / "notes", tmp_path / "pid"
    sigs = (signal.SIGTERM, signal.SIGHUP, signal.SIGSEGV, signal.SIGUSR1)

    def default_signals():
        # A signal ignored by whatever started pytest (nohup ignores SIGHUP) stays ignored in
        # bash and its jobs, which then never die of it; execd's own shells get these reset
        # (posix_spawn setsigdef).
        for s in sigs:
            signal.signal(s, signal.SIG_DFL)

    sh = subprocess.Popen(["bash"], stdin=subprocess.PIPE, preexec_fn=default_signals)
    try:
        for sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGHUP, signal.SIGSEGV, signal.SIGUSR1):
            pidf.unlink(missing_ok=True)
            sh.stdin.write(f"(trap '' INT; sleep 100) & echo $! > {pidf}\n".encode())
            sh.stdin.flush()
            pid = read_pids(pidf)[0]
            os.kill(pid, sig)
            # Bounded, and generous: a 4-worker check tier on 2 cores once took over 5 s here.
            assert wait_for(lambda p=pid: not alive(p), 30), (sig, pid, proc_state(pid))
            time.sleep(0.1)
            sh.stdin.write(f"{{ builtin eval : ; }} 2>>{notes}\n".encode())
            sh.stdin.flush()
        sh.stdin.close()
        sh.wait(10)
    finally:
        sh.kill()
    found = [ln for ln in notes.read_text().splitlines() if ln.strip()]
    assert len(found) >= 3, found  # bash reports no notice for some (SIGTERM here)
    for ln in found:
        assert shell.job_notices_only(shell.fix_diag(ln, 0)), ln
    diags = []
    for bad in ("echo 'open", "cat <<EOF\nx", "if true; then", "echo )", "f() {", "x=$((1+"):
        r = execd.exec(bad)
        assert r["exit_code"] == 2, (bad, r)
        diags.append(r["error"])
        assert not shell.job_notices_only(r["error"]), r["error"]
    assert not shell.job_notices_only(found[0] + "\n" + diags[0])


@pytest.mark.parametrize("start", [
    "env -i setsid -f bash -c 'echo $$ > {f}; exec sleep 1000';",
    "(env -i setsid bash -c 'echo $$ > {f}; exec sleep 1000' &);",
    "env -i setsid bash -c 'echo $$ > {f}; exec sleep 1000' &",
])
def test_child_timeout_env_cleared_own_session_orphaned(execd, tmp_path, start):
    # Issue 15: no tag, own session, parent gone (re-parented to execd): the timeout kills it.
    f = tmp_path / "pids"
    r = execd.exec(start.format(f=f) + " sleep 1000", timeout=1)
    assert r["exit_code"] == 124
    pids = read_pids(f)
    assert len(pids) == 1
    _no_survivors(execd, pids)
    assert execd.others() == []


def test_timeout_spares_earlier_env_cleared_jobs(execd, tmp_path):
    # Documented behaviour kept: what an earlier call left running on purpose survives a later
    # call's timeout, even with the tag dropped and re-parented to execd.
    f = tmp_path / "pids"
    execd.exec(f"env -i setsid -f bash -c 'echo $$ > {f}; exec sleep 1000'")
    keep = read_pids(f)
    assert wait_for(lambda: keep and all(alive(p) for p in keep))
    time.sleep(0.05)  # start times are 10 ms ticks: one in the call's first tick counts as its
    r = execd.exec("(env -i setsid -f sleep 1000); sleep 1000", timeout=1)
    assert r["exit_code"] == 124
    assert all(alive(p) for p in keep)
    assert wait_for(lambda: [p for p in execd.others() if p not in keep] == [], 5)

# ---------------------------------------------------------------- output cap and floods (A27)


def test_output_cap_keeps_head_and_tail(execd):
    r = execd.exec("seq 1 100000", max_output=1000)
    assert r["truncated"] is True and r["exit_code"] == 0
    out = r["output"]
    assert out.startswith("1\n2\n3\n") and out.endswith("99999\n100000\n")
    assert "bytes omitted" in out
    assert len(out.encode()) < 1000 + 100
    small = execd.exec("echo hi", max_output=1000)
    assert small["truncated"] is False and small["output"] == "hi\n"


def test_flood_1gib_rss_bounded(execd):
    rest = execd.reset_hwm()
    t0 = time.monotonic()
    r = execd.exec("head -c 1073741824 /dev/zero; echo; echo end", timeout=120)
    took = time.monotonic() - t0
    assert r["exit_code"] == 0 and r["truncated"] is True
    assert r["output"].endswith("end\n")
    hwm = execd.rss_hwm_kib()
    assert hwm - rest < 8 * 1024, f"execd peak RSS {hwm} KiB, {rest} KiB at rest"
    assert took < 60


def test_endless_flood_until_timeout_rss_bounded(execd):
    rest = execd.reset_hwm()
    r = execd.exec("yes flood", timeout=2)
    assert r["exit_code"] == 124 and r["truncated"] is True
    assert r["output"].startswith("flood\n")
    assert execd.rss_hwm_kib() - rest < 8 * 1024
    assert execd.exec("echo after")["output"] == "after\n"


# ---------------------------------------------------------------- shell death


def test_shell_exit_reports_real_status_and_fresh_shell(execd):
    execd.exec("KEEP=1")
    r = execd.exec("exit 3")
    assert r["exit_code"] == 3 and "shell exited" in r["error"] and "state lost" in r["error"]
    r = execd.exec("echo ${KEEP:-fresh}")
    assert r["output"] == "fresh\n" and r["exit_code"] == 0


def test_shell_kill_9(execd):
    r = execd.exec("kill -9 $$")
    assert r["exit_code"] == 137 and "shell exited" in r["error"]
    assert execd.exec("echo ok")["output"] == "ok\n"


def test_shell_killed_between_calls_is_reported(execd):
    pid = execd.shell_pid()
    import os
    import signal
    os.kill(pid, signal.SIGKILL)
    assert wait_for(lambda: not alive(pid), 5)
    r = execd.exec("echo ok")
    assert r["output"] == "ok\n" and r["exit_code"] == 0
    assert "had exited" in (r["error"] or "")


# ---------------------------------------------------------------- idempotent retries


def test_request_id_retry_returns_stored_response(execd, tmp_path):
    cmd = "echo run >> runs; wc -l < runs"
    a = execd.exec(cmd, request_id="r-1")
    b = execd.exec(cmd, request_id="r-1")
    assert a == b
    assert (tmp_path / "ws" / "runs").read_text() == "run\n"
    c = execd.exec(cmd, request_id="r-2")
    assert c["output"].strip() == "2"


def test_request_id_retry_while_running_waits(execd, tmp_path):
    cmd = "sleep 1; echo run >> runs; echo done"
    results = []
    threads = [threading.Thread(target=lambda: results.append(execd_exec(execd, cmd)))
               for _ in range(2)]
    threads[0].start()
    assert wait_for(lambda: execd.state()["busy"], 5)
    threads[1].start()
    for t in threads:
        t.join(30)
    assert len(results) == 2 and results[0] == results[1]
    assert results[0]["output"] == "done\n"
    assert (tmp_path / "ws" / "runs").read_text() == "run\n"


def execd_exec(execd, cmd):
    import httpx

    from .conftest import AUTH
    with httpx.Client(base_url=execd.url, headers=AUTH, timeout=30) as c:
        return c.post("/exec", json={"command": cmd, "request_id": "same"}).json()


def test_forked_check_fallback_for_old_bash(execd_factory, tmp_path):
    # bash < 4.4 lacks `local -`; execd then parses in a subshell. Same verdicts.
    d = execd_factory(env={"SANDMAN_EXECD_FORK_CHECK": "1"})
    d.exec("KEEP=1")
    for cmd, frag in (("touch ran\ncat <<EOF\nx", "here-document"), ("echo 'a", "unexpected EOF"),
                      ("x; }; touch ran; f() {", "syntax error")):
        r = d.exec(cmd)
        assert r["exit_code"] == 2 and frag in r["error"], r
        assert r["error"].startswith("bash: line 1") or "line 2" in r["error"]
    assert not (tmp_path / "ran").exists()
    assert "( builtin eval" in d.exec("declare -f __sm_chk1")["output"]  # the fallback ran
    r = d.exec("echo $KEEP; (exit 3)")
    assert r["output"] == "1\n" and r["exit_code"] == 3


def test_redirected_shell_stdout_keeps_frames_working(execd):
    # Frames travel apart from the output, so `exec >file` cannot hide the exit status.
    r = execd.exec("exec 3>&1 >/dev/null 2>&1; echo hidden; false")
    assert r["exit_code"] == 1 and r["output"] == ""
    assert execd.exec("(exit 7)")["exit_code"] == 7
    assert execd.exec("exec >&3 2>&1; echo back")["output"] == "back\n"


def test_set_e_failure_exits_the_shell_and_says_so(execd):
    execd.exec("set -e")
    r = execd.exec("false")
    assert r["exit_code"] == 1 and "shell exited" in r["error"]
    assert execd.exec("false; echo survives")["output"] == "survives\n"


def test_non_utf8_output_is_replaced_not_fatal(execd):
    r = execd.exec("printf 'a\\xffb\\n'")
    assert r["output"] == "a\ufffdb\n" and r["exit_code"] == 0
