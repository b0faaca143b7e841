"""HTTP layer: token, keep-alive, TCP_NODELAY, bad input always a 4xx JSON error."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import httpx
import pytest

from execd.execd_daemon import base, server
from sandman import contract

from .conftest import EXECD, TOKEN, TOKEN_SHA256

ROUTES = [("POST", "/exec"), ("POST", "/files/read"), ("GET", "/files?path=/etc/hostname"),
          ("POST", "/files/write"), ("POST", "/env"), ("POST", "/reset"), ("GET", "/state"),
          ("GET", "/conditions")]


def raw(port: int, data: bytes, timeout: float = 10) -> tuple[int, dict, bytes]:
    """One raw request on a fresh connection; (status, headers, body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
        head, _, body = buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
        n = int(headers.get("content-length", "0"))
        while len(body) < n:
            chunk = s.recv(65536)
            if not chunk:
                break
            body += chunk
        return status, headers, body


def test_constants_match_contract():
    assert base.EXECD_PORT == contract.EXECD_PORT
    assert base.EXECD_PATH == contract.EXECD_PATH
    assert base.EXECD_TOKEN_ENV == contract.EXECD_TOKEN_ENV
    assert base.NETGUARD_STATUS_PATH == contract.NETGUARD_STATUS_PATH
    assert base.EXECD_READY_PATH == contract.EXECD_READY_PATH


def test_idle_timeout_at_least_120s_and_nodelay_set():
    assert server.Handler.timeout >= 120
    assert server.Handler.disable_nagle_algorithm is True
    assert server.Handler.protocol_version == "HTTP/1.1"


def test_health_needs_no_token(execd):
    r = httpx.get(execd.url + "/health")
    assert r.status_code == 200 and r.json() == {"ok": True, "version": base.VERSION}


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"Authorization": TOKEN},
                                     {"Authorization": f"Bearer {TOKEN_SHA256}"}])
def test_every_route_but_health_needs_the_token(execd, headers):
    for method, path in ROUTES:
        r = httpx.request(method, execd.url + path, headers=headers, json={"command": "touch x"})
        assert r.status_code == 401, (method, path)
        assert "error" in r.json()
    assert execd.others() == []


def test_refuses_to_start_without_token(tmp_path):
    env = {"PATH": "/usr/bin:/bin"}
    p = subprocess.run([sys.executable, str(EXECD), "--listen", "127.0.0.1:0"], env=env,
                       capture_output=True, timeout=20)
    assert p.returncode == 2 and b"refusing to start" in p.stderr
    p = subprocess.run([sys.executable, str(EXECD), "--listen", "127.0.0.1:0",
                        "--token-sha256", "not-a-hash"], env=env, capture_output=True,
                       timeout=20)
    assert p.returncode == 2


def test_insecure_no_token_serves_without_auth(execd_factory):
    d = execd_factory("--insecure-no-token", token=False)
    r = httpx.post(d.url + "/exec", json={"command": "echo open"})
    assert r.status_code == 200 and r.json()["output"] == "open\n"


def test_token_from_flag(execd_factory):
    d = execd_factory("--token-sha256", TOKEN_SHA256, token=False)
    assert d.exec("echo ok")["output"] == "ok\n"


def test_keep_alive_one_connection_many_calls(execd):
    with socket.create_connection(("127.0.0.1", execd.port), timeout=10) as s:
        f = s.makefile("rb")
        body = json.dumps({"command": "echo hi"}).encode()
        req = (b"POST /exec HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode()
               + b"\r\nContent-Type: application/json\r\nContent-Length: "
               + str(len(body)).encode() + b"\r\n\r\n" + body)
        times = []
        for _ in range(50):
            t0 = time.perf_counter()
            s.sendall(req)
            status = f.readline()
            assert b" 200 " in status
            n = 0
            while True:
                line = f.readline()
                if line.lower().startswith(b"content-length:"):
                    n = int(line.split(b":")[1])
                if line == b"\r\n":
                    break
            assert json.loads(f.read(n))["output"] == "hi\n"
            times.append(time.perf_counter() - t0)
        times.sort()
        # Without TCP_NODELAY each call stalls ~40 ms on delayed ACKs.
        assert times[len(times) // 2] < 0.02, times


def test_malformed_json_and_wrong_types_are_400(execd):
    cases = [
        ("/exec", b"{not json"),
        ("/exec", b"[1, 2]"),
        ("/exec", b"\xff\xfe"),
        ("/exec", json.dumps({"command": 5}).encode()),
        ("/exec", json.dumps({"command": "true", "timeout": "5"}).encode()),
        ("/exec", json.dumps({"command": "true", "timeout": -1}).encode()),
        ("/exec", json.dumps({"command": "true", "timeout": True}).encode()),
        ("/exec", json.dumps({"command": "true", "max_output": 1.5}).encode()),
        ("/exec", json.dumps({"command": "true", "request_id": 7}).encode()),
        ("/exec", json.dumps({"command": "echo \u0000"}).encode()),
        ("/exec", b'{"command": "\\ud800"}'),
        ("/files/read", json.dumps({"path": 3}).encode()),
        ("/files/write", json.dumps({"path": "/tmp/x", "data_b64": "%%%"}).encode()),
        ("/files/write", json.dumps({"path": "/tmp/x", "data_b64": "", "mode": "rwx"}).encode()),
        ("/env", json.dumps({"set": ["A"]}).encode()),
        ("/env", json.dumps({"set": {"1BAD": "x"}}).encode()),
        ("/env", json.dumps({"set": {"A": 1}}).encode()),
        ("/reset", json.dumps({"workspace": "yes"}).encode()),
    ]
    for path, body in cases:
        r = execd.client.post(path, content=body)
        assert r.status_code == 400, (path, body, r.status_code, r.text)
        assert "error" in r.json() and "Traceback" not in r.text
    assert execd.exec("echo alive")["output"] == "alive\n"


def test_unknown_route_and_wrong_method(execd):
    r = execd.get("/nope")
    assert r.status_code == 404 and "error" in r.json()
    r = execd.get("/exec")
    assert r.status_code == 405 and "error" in r.json()
    r = execd.client.put("/state")
    assert r.status_code == 405


def test_huge_body_refused_with_413(execd_factory):
    d = execd_factory("--max-body", "1000")
    status, _, body = raw(d.port, b"POST /exec HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                          + TOKEN.encode() + b"\r\nContent-Length: 10000000\r\n\r\n")
    assert status == 413 and "error" in json.loads(body)
    assert d.exec("echo ok")["output"] == "ok\n"


def test_slow_client_gets_408_and_execd_keeps_serving(execd_factory):
    d = execd_factory("--body-timeout", "1")
    with socket.create_connection(("127.0.0.1", d.port), timeout=10) as s:
        s.sendall(b"POST /exec HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode()
                  + b"\r\nContent-Length: 100\r\n\r\n{\"comm")
        t0 = time.monotonic()
        assert d.exec("echo meanwhile")["output"] == "meanwhile\n"
        data = s.recv(65536)
        assert b" 408 " in data.split(b"\r\n")[0]
        assert time.monotonic() - t0 < 5


def test_garbage_request_line_and_headers_get_json_errors(execd):
    for req in (b"GARBAGE\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n",
                b"GET /health HTTP/1.1\r\n" + b"X: y\r\n" * 150 + b"\r\n",
                b"POST /exec HTTP/1.1\r\nContent-Length: abc\r\nAuthorization: Bearer "
                + TOKEN.encode() + b"\r\n\r\n",
                b"POST /exec HTTP/1.1\r\nTransfer-Encoding: chunked\r\nAuthorization: Bearer "
                + TOKEN.encode() + b"\r\n\r\n5\r\nhello\r\n0\r\n\r\n"):
        status, headers, body = raw(execd.port, req)
        assert 400 <= status < 500, (req[:40], status)
        assert "error" in json.loads(body)
    assert execd.exec("echo alive")["output"] == "alive\n"


def _python38() -> str | None:
    import glob
    import shutil
    for exe in [*glob.glob("/root/.pyenv/versions/3.8*/bin/python3.8"), shutil.which("python3.8")]:
        if exe and subprocess.run([exe, "-c", "pass"], capture_output=True).returncode == 0:
            return exe
    return None


@pytest.mark.skipif(_python38() is None, reason="no python3.8 on this machine")
def test_runs_on_python38(execd_factory, tmp_path):
    # Task images may ship an old interpreter; vermin checks syntax, this checks behaviour.
    d = execd_factory("--kill-grace", "0.2", python=_python38())
    rest = d.reset_hwm()
    assert d.exec("echo hi; X=1")["output"] == "hi\n"
    assert d.exec("echo 'open")["exit_code"] == 2
    r = d.exec("sleep 30 & sleep 30", timeout=0.5)
    assert r["exit_code"] == 124 and d.others() == []
    assert d.exec("kill -9 $$")["exit_code"] == 137
    f = tmp_path / "crlf.txt"
    f.write_bytes(b"a\r\nb")
    j = d.post("/files/read", {"path": str(f)}).json()
    assert j["size"] == 4 and j["data_b64"] == "YQ0KYg=="
    assert d.rss_hwm_kib() - rest < 8 * 1024
