"""POST /exec/stream: the command's output as it is printed, then /exec's answer, on the same
persistent shell; `idle_timeout` (on /exec too); what a dropped or stalled client does and does
not kill. Real execd, real bash, real sockets on 127.0.0.1."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from .conftest import AUTH, alive, wait_for


def stream(execd, body: dict, timeout: float = 60) -> list[tuple[float, dict]]:
    """Every NDJSON line with the time it arrived, from the request's start."""
    t0 = time.monotonic()
    out = []
    with execd.client.stream("POST", "/exec/stream", json=body, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"] == "application/x-ndjson"
        for line in r.iter_lines():
            if line:
                out.append((time.monotonic() - t0, json.loads(line)))
    return out


def text_of(lines) -> str:
    return "".join(obj["output"] for _, obj in lines if "output" in obj)


def result_of(lines) -> dict:
    assert "result" in lines[-1][1], lines[-1]
    assert all("result" not in obj for _, obj in lines[:-1])
    return lines[-1][1]["result"]


def raw_stream(execd, body: dict) -> socket.socket:
    """A stream request on a bare socket, headers read: the test decides when it hangs up."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", execd.port), timeout=10)
    s.sendall(b"POST /exec/stream HTTP/1.1\r\nHost: x\r\nAuthorization: " +
              AUTH["Authorization"].encode() + b"\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = s.recv(4096)
        assert chunk, head
        head += chunk
    assert head.startswith(b"HTTP/1.1 200"), head
    return s


def test_output_arrives_while_the_command_runs(execd):
    lines = stream(execd, {"command": "echo one; sleep 0.8; echo two; sleep 0.8; echo three"})
    first = next(t for t, obj in lines if "output" in obj)
    end = lines[-1][0]
    assert end > 1.5
    assert first < 0.6, f"first output after {first:.2f}s: not streamed"
    assert text_of(lines) == "one\ntwo\nthree\n"
    r = result_of(lines)
    assert r["exit_code"] == 0 and r["error"] is None and r["output"] == "one\ntwo\nthree\n"


def test_same_shell_as_exec_and_the_real_exit_status(execd, tmp_path):
    stream(execd, {"command": "cd /tmp && export STREAMED=yes && f() { echo fn; }"})
    assert execd.exec("pwd; echo $STREAMED; f")["output"] == "/tmp\nyes\nfn\n"
    r = result_of(stream(execd, {"command": "echo out; exit_code() { return 7; }; exit_code"}))
    assert r["exit_code"] == 7 and r["output"] == "out\n"
    # An incomplete command is refused by the same check as /exec: nothing runs.
    r = result_of(stream(execd, {"command": f"touch {tmp_path}/ran; echo 'open"}))
    assert r["exit_code"] == 2 and r["error"]
    assert not (tmp_path / "ran").exists()


def test_utf8_split_across_reads_is_decoded_whole(execd):
    lines = stream(execd, {"command": r"printf 'caf\xc3'; sleep 0.4; printf '\xa9 \xe2\x82'; "
                                      r"sleep 0.4; printf '\xac\n'"})
    assert len([1 for _, o in lines if "output" in o]) >= 2
    assert text_of(lines) == "café €\n"
    assert result_of(lines)["output"] == "café €\n"


def test_idle_timeout_kills_a_silent_command_and_its_children(execd, tmp_path):
    pidf = tmp_path / "child.pid"
    t0 = time.monotonic()
    lines = stream(execd, {"command": f"echo start; (sleep 60 & echo $! > {pidf}; wait)",
                           "idle_timeout": 1, "timeout": 60})
    took = time.monotonic() - t0
    r = result_of(lines)
    assert r["exit_code"] == 124 and r["error"].startswith("timeout: no output for 1s")
    assert took < 10, f"idle timeout took {took:.1f}s"
    child = int(pidf.read_text())
    assert wait_for(lambda: not alive(child), 5), "the silent command's child survived"
    assert execd.exec("echo after")["output"] == "after\n"


def test_idle_timeout_spares_a_command_that_keeps_printing(execd):
    r = result_of(stream(execd, {"command": "for i in 1 2 3 4 5 6; do echo $i; sleep 0.3; done",
                                 "idle_timeout": 1}))
    assert r["exit_code"] == 0 and r["error"] is None


def test_idle_timeout_on_plain_exec(execd):
    r = execd.exec("sleep 30", idle_timeout=0.5, timeout=60)
    assert r["exit_code"] == 124 and "idle_timeout" in r["error"]
    assert r["duration_ms"] < 8000
    r = execd.exec("for i in 1 2 3 4; do echo $i; sleep 0.2; done", idle_timeout=0.6)
    assert r["exit_code"] == 0


def test_dropped_connection_kills_nothing(execd, tmp_path):
    done = tmp_path / "done"
    s = raw_stream(execd, {"command": f"echo go; sleep 1; echo finished > {done}"})
    s.recv(4096)
    s.close()
    assert wait_for(done.exists, 10), "the command died with its client"
    assert wait_for(lambda: not execd.state()["busy"], 10)
    assert execd.exec("echo next")["output"] == "next\n"


def test_kill_on_disconnect_ends_the_command_tree(execd, tmp_path):
    done, pidf = tmp_path / "done", tmp_path / "child.pid"
    s = raw_stream(execd, {"command": f"(sleep 60 & echo $! > {pidf}; wait) && touch {done}",
                           "kill_on_disconnect": True, "timeout": 120})
    assert wait_for(pidf.exists, 5) and pidf.read_text().strip()
    child = int(pidf.read_text())
    t0 = time.monotonic()
    s.close()
    assert wait_for(lambda: not alive(child), 10), "child outlived its client"
    assert time.monotonic() - t0 < 5
    assert wait_for(lambda: not execd.state()["busy"], 10)
    assert not done.exists()
    assert execd.exec("echo next")["output"] == "next\n"


@pytest.mark.slow
def test_busy_both_ways(execd):
    t = threading.Thread(target=lambda: stream(execd, {"command": "sleep 1.5"}))
    t.start()
    try:
        assert wait_for(lambda: execd.state()["busy"], 5)
        r = execd.post("/exec", {"command": "echo x"})
        assert r.status_code == 409 and r.json()["busy"] is True
        r = execd.post("/exec/stream", {"command": "echo x"})
        assert r.status_code == 409 and r.json()["busy"] is True
    finally:
        t.join(30)
    t = threading.Thread(target=lambda: execd.exec("sleep 1.5"))
    t.start()
    try:
        assert wait_for(lambda: execd.state()["busy"], 5)
        r = execd.post("/exec/stream", {"command": "echo x"})
        assert r.status_code == 409
    finally:
        t.join(30)


@pytest.mark.parametrize("body, fragment", [
    ({"command": "true", "idle_timeout": 0}, "idle_timeout"),
    ({"command": "true", "idle_timeout": True}, "idle_timeout"),
    ({"command": "true", "idle_timeout": "5"}, "idle_timeout"),
    ({"command": "true", "kill_on_disconnect": "yes"}, "kill_on_disconnect"),
    ({"command": "true", "request_id": "r1"}, "request_id"),
    ({"command": 5}, "command must be a string"),
    ({"command": "true", "timeout": -1}, "timeout"),
])
def test_bad_bodies_get_one_line_400(execd, body, fragment):
    r = execd.post("/exec/stream", body)
    assert r.status_code == 400 and fragment in r.json()["error"]
    assert "\n" not in r.json()["error"]


def test_stream_needs_the_token(execd):
    import httpx

    r = httpx.post(execd.url + "/exec/stream", json={"command": "echo pwned"}, timeout=10)
    assert r.status_code == 401


@pytest.mark.slow
def test_stalled_reader_bounds_rss_and_does_not_stop_the_timeout(execd):
    """A client that never reads while the command floods: execd's memory stays bounded,
    other clients are served, and the command still ends (its timeout, or its client gone)."""
    # Growth, not the absolute size: run as a script (as here), execd keeps what compiling its
    # source took, which grows with the file; a pod imports it with bytecode.
    before = execd.reset_hwm()  # growth from here, not the start's peak
    s = raw_stream(execd, {"command": "yes stalled", "timeout": 3})
    try:
        t0 = time.monotonic()
        for _ in range(5):
            assert execd.get("/health").status_code == 200
            time.sleep(0.5)
        assert wait_for(lambda: not execd.state()["busy"], 30), "the flood never ended"
        took = time.monotonic() - t0
        assert took < 25, f"ended after {took:.1f}s"
        grown = execd.rss_hwm_kib() - before
        assert grown < 8 * 1024, f"execd grew {grown} KiB"
    finally:
        s.close()
    assert execd.exec("echo after")["output"] == "after\n"


def test_large_output_streams_whole_and_the_answer_keeps_head_and_tail(execd):
    lines = stream(execd, {"command": "seq 1 200000", "max_output": 1000})
    want = "".join(f"{i}\n" for i in range(1, 200001))
    assert text_of(lines) == want
    r = result_of(lines)
    assert r["truncated"] is True and r["output"].endswith("200000\n")
