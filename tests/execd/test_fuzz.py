"""Hypothesis throws malformed requests at one execd for a bounded time: never a 5xx, never a
crash, no leaked process. File routes are confined to a temp root (--root), commands to harmless
ones (`echo` plus quoting noise), so the fuzz cannot touch the machine."""

from __future__ import annotations

import json
import socket
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import TOKEN

PATHS = ["/health", "/exec", "/files/read", "/files", "/files/write", "/env", "/reset",
         "/state", "/conditions", "/", "/exec/", "/files?path=x", "/conditions?egress_probe=",
         "/conditions?egress_probe=127.0.0.1:1", "/%00", "/files?path=%2e%2e/%2e%2e/etc/passwd"]
METHODS = ["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH", "BREW", "get", ""]

# No letters that could spell a real program, no `$` or backticks: nothing here can run long.
noise = st.text(alphabet="xq '\"(){}[];<>|&\\\n\t#=!*~%", max_size=40)
command = st.one_of(noise, noise.map(lambda s: "echo " + s))
json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                        st.floats(allow_nan=True), st.text(max_size=20))
json_value = st.recursive(json_scalar, lambda c: st.one_of(st.lists(c, max_size=3),
                                                           st.dictionaries(st.text(max_size=8),
                                                                           c, max_size=3)),
                          max_leaves=6)
field_names = st.sampled_from(["command", "timeout", "max_output", "request_id", "path",
                               "data_b64", "mode", "if_sha256", "set", "unset", "workspace"])


@st.composite
def body(draw):
    kind = draw(st.integers(0, 4))
    if kind == 0:
        return draw(st.binary(max_size=200))
    if kind == 1:
        return json.dumps(draw(json_value)).encode()
    obj = draw(st.dictionaries(field_names, json_value, max_size=5))
    if kind >= 3:
        obj["command"] = draw(command)
        obj["timeout"] = draw(st.sampled_from([0.5, 1, "1", -1, None, 1e308]))
    if kind == 4:
        obj["path"] = draw(st.sampled_from(["a.txt", "../x", "/", "/dev/zero", "sub/../b",
                                            "", "\u00e9", "x" * 300]))
        obj["data_b64"] = draw(st.sampled_from(["", "eA==", "===", "x", None]))
    return json.dumps(obj).encode()


@st.composite
def request(draw):
    method = draw(st.sampled_from(METHODS))
    path = draw(st.one_of(st.sampled_from(PATHS), st.text(max_size=30).map(lambda s: "/" + s)))
    data = draw(body())
    headers = []
    if draw(st.booleans()):
        headers.append(b"Authorization: Bearer " + TOKEN.encode())
    elif draw(st.booleans()):
        headers.append(b"Authorization: " + draw(st.binary(max_size=20)).replace(b"\r", b"")
                       .replace(b"\n", b""))
    cl = draw(st.sampled_from(["right", "none", "short", "junk"]))
    if cl == "right":
        headers.append(b"Content-Length: %d" % len(data))
    elif cl == "short":
        headers.append(b"Content-Length: %d" % max(0, len(data) - 1))
    elif cl == "junk":
        headers.append(b"Content-Length: " + draw(st.sampled_from([b"-1", b"abc", b"1e3", b""])))
    headers.append(b"Connection: close")
    line = method.encode() + b" " + path.encode("utf-8", "surrogateescape") + b" HTTP/1.1"
    return line + b"\r\n" + b"\r\n".join(headers) + b"\r\n\r\n" + data


def send(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        out = b""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
        return out


@pytest.fixture
def fuzz_execd(execd_factory, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    return execd_factory("--root", str(root), "--workspace", str(root), "--kill-grace", "0.2",
                         "--body-timeout", "2")


def test_fuzz_malformed_requests_never_5xx(fuzz_execd):
    d = fuzz_execd
    t_end = time.monotonic() + 25

    @settings(max_examples=250, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(request())
    def one(data):
        if time.monotonic() > t_end:
            return  # bounded in time as well as in count
        resp = send(d.port, data)
        assert d.proc.poll() is None, "execd died"
        if not resp:
            return  # a connection closed without an answer (e.g. half a body) is allowed
        status_line = resp.split(b"\r\n", 1)[0]
        assert status_line.startswith(b"HTTP/1.1 "), resp[:200]
        code = int(status_line.split()[1])
        assert code < 500, resp[:500]
        assert b"Traceback" not in resp

    one()
    assert d.proc.poll() is None
    assert d.exec("echo alive")["output"] == "alive\n"
    d.post("/reset", {})
    assert d.others() == []
