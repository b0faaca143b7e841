"""Hypothesis throws malformed requests at one execd for a bounded time: never a 5xx, never a
crash, no leaked process. File routes are confined to a temp root (--root), commands to harmless
ones (`echo` plus quoting noise), so the fuzz cannot touch the machine."""

from __future__ import annotations

import hashlib
import json
import os
import random
import socket
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import TOKEN
from .tartrees import HOSTILE, hostile_archive, reg, tar_of

# Whole archives for the tree route: a good one, cut ones, and every hostile case.
TARS = [tar_of(reg("a.txt"), reg("d/b.txt", b"b" * 700))]
TARS += [TARS[0][:n] for n in (100, 512, 1000, 1536)]
TARS += [hostile_archive(case, "/nonexistent-outside") for case, _, _, _ in HOSTILE[:12]]

PATHS = ["/health", "/exec", "/files/read", "/files", "/files/write", "/env", "/reset",
         "/state", "/conditions", "/", "/exec/", "/files?path=x", "/conditions?egress_probe=",
         "/conditions?egress_probe=127.0.0.1:1", "/%00", "/files?path=%2e%2e/%2e%2e/etc/passwd",
         "/processes", "/processes/spawn", "/processes/signal", "/processes/wait",
         "/processes/info?id=p1-000000000000000000000000", "/processes/output?id=../x&since=-1",
         "/processes/output?since=" + "9" * 80, "/files/tree?path=.", "/files/tree",
         "/files/tree?path=%2e%2e", "/files/tree/write?path=t", "/files/tree/write",
         "/files/tree/write?path=/dev/null", "/files/tree/write?path=t&path=../u",
         "/sessions", "/sessions/open", "/sessions/write", "/sessions/resize", "/sessions/signal",
         "/sessions/close", "/sessions/read?id=s1-000000000000000000000000&timeout=0.1",
         "/sessions/read?id=../x&since=-1&timeout=nan", "/sessions/read?timeout=" + "9" * 80]
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
                               "data_b64", "mode", "if_sha256", "set", "unset", "workspace",
                               "id", "signal", "env", "cwd", "cols", "rows"])


@st.composite
def body(draw):
    kind = draw(st.integers(0, 5))
    if kind == 5:
        return draw(st.sampled_from(TARS))
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
    if draw(st.booleans()):  # the tree route's digest: right, so the archive itself is parsed
        headers.append(b"X-Content-SHA256: " + hashlib.sha256(data).hexdigest().encode())
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
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:  # execd answered and closed before taking a large body (an archive)
            pass
        out = b""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:  # our unread bytes reset it after the answer
                break
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


# ---------------------------------------------------------------- request line and headers
# Byte-level: seeded random bytes and mutated valid requests (the test above builds requests
# from parts, so its request lines and headers are always well formed). Each case gets a fresh
# connection; each must be answered or closed within ANSWER_WITHIN.

WIRE_SEED = int(os.environ.get("SANDMAN_FUZZ_SEED", "1851"))
WIRE_CASES = 300
WIRE_BUDGET = 60.0  # seconds for all cases
ANSWER_WITHIN = 5.0  # execd's header, body and pre-auth limits are 1 s in this fixture

_AUTH = b"Authorization: Bearer " + TOKEN.encode() + b"\r\n"


def _req(line: bytes, body: bytes = b"", auth: bool = True) -> bytes:
    head = line + b"\r\nHost: x\r\n" + (_AUTH if auth else b"")
    if body:
        head += b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
    return head + b"\r\n" + body


# (request, whether its body may be mutated): an exec body stays intact, so no mutation can
# turn `echo` into a command that runs long.
WIRE_TEMPLATES = [
    (_req(b"GET /health HTTP/1.1", auth=False), True),
    (_req(b"GET /state HTTP/1.1"), True),
    (_req(b"POST /exec HTTP/1.1", b'{"command": "echo fuzz", "timeout": 5}'), False),
    (_req(b"POST /env HTTP/1.1", b'{"set": {"FUZZ": "1"}}'), True),
    (_req(b"POST /files/read HTTP/1.1", b'{"path": "a.txt"}'), True),
    (_req(b"GET /files?path=a.txt HTTP/1.1"), True),
    (_req(b"GET /conditions?egress_probe=127.0.0.1:9 HTTP/1.1"), True),
    (_req(b"GET /health HTTP/1.1", auth=False) * 2, True),  # pipelined
    (_req(b"GET /health HTTP/1.0", auth=False), True),
]
WIRE_TOKENS = [b"\r\n", b"\n", b"\r", b"\r\n\r\n", b"\0", b" ", b"\t", b":", b"\xb2", b"\xa0",
               b"\xff", b"\x85", "\u0661".encode(), b"%", b"%00", b"%ff", b"?", b"#", b"/..",
               b"HTTP/", b"HTTP/1.1", b"HTTP/0.9", b"HTTP/2.0", b"Content-Length: ",
               b"Content-Length: 5\r\n", b"Transfer-Encoding: chunked\r\n",
               b"Expect: 100-continue\r\n", b"Connection: keep-alive\r\n", b"Connection: close\r\n",
               b" folded\r\n", b"-1", b"+1", b"0x10", b"5_0", b"9" * 30, b"9" * 5000, b"x" * 300,
               _AUTH, b"GET", b"POST", b"get", b"X-A: b\r\n" * 120]
# Numbers that str.isdigit, int() or regex \d take, and plain ones around the limits.
WIRE_NUMBERS = [b"\xb2", b"\xb91", b"1\x1c", b"\xa01", b"\x0b1", "\u0661\u0662".encode(), b"+1",
                b"-1", b"1_0", b"0x10", b"1e3", b"1.0", b"", b" ", b"1, 1", b"9" * 30, b"9" * 5000,
                b"0" * 50 + b"1", b"0", b"1", b"17", b"4294967296", b"18446744073709551617"]


def _mutate(rng: random.Random, data: bytes, body_ok: bool) -> bytes:
    cut = len(data) if body_ok else data.index(b"\r\n\r\n") + 4
    buf, tail = bytearray(data[:cut]), data[cut:]
    for _ in range(rng.randint(1, 4)):
        op = rng.choice([0, 0, 1, 1, 2, 3, 4, 5, 6, 6, 7])
        i = rng.randrange(len(buf) + 1)
        if op == 0 and buf:  # one byte replaced
            buf[min(i, len(buf) - 1)] = rng.randrange(256)
        elif op == 1:
            buf[i:i] = rng.choice(WIRE_TOKENS)
        elif op == 2:  # a range deleted
            del buf[i:i + rng.randint(1, 16)]
        elif op == 3:  # a range repeated
            j = min(len(buf), i + rng.randint(1, 40))
            buf[j:j] = buf[i:j]
        elif op == 4:  # a header's value replaced
            lines = bytes(buf).split(b"\r\n")
            k = rng.randrange(len(lines))
            name = lines[k].partition(b":")[0]
            lines[k] = name + b": " + rng.choice(WIRE_TOKENS).strip(b"\r\n")
            buf = bytearray(b"\r\n".join(lines))
        elif op == 5:  # truncated
            del buf[i:]
        elif op == 6:  # a Content-Length added, or its value replaced, with a hostile number
            lines = bytes(buf).split(b"\r\n")
            num = rng.choice(WIRE_NUMBERS)
            ks = [k for k, ln in enumerate(lines) if ln.lower().startswith(b"content-length:")]
            if ks and rng.random() < 0.8:
                lines[rng.choice(ks)] = b"Content-Length: " + num
            else:
                lines.insert(min(1, len(lines)), b"Content-Length: " + num)
            buf = bytearray(b"\r\n".join(lines))
        else:  # the request line's version replaced
            line, sep, rest = bytes(buf).partition(b"\r\n")
            words = line.split(b" ")
            words[-1] = b"HTTP/" + rng.choice(WIRE_NUMBERS) + rng.choice([b".", b""]) \
                + rng.choice(WIRE_NUMBERS)
            buf = bytearray(b" ".join(words) + sep + rest)
    return bytes(buf) + tail


def _wire_case(rng: random.Random) -> bytes:
    if rng.random() < 0.2:
        return bytes(rng.randrange(256) for _ in range(rng.randint(1, 300)))
    data, body_ok = rng.choice(WIRE_TEMPLATES)
    return _mutate(rng, data, body_ok)


def _responses(buf: bytes) -> tuple[list[int], bytes]:
    """The status codes of the complete responses at the start of buf, and what is left."""
    codes = []
    while buf:
        head, sep, rest = buf.partition(b"\r\n\r\n")
        if not sep:
            break
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        assert parts[0] == b"HTTP/1.1" and len(parts) >= 2 and parts[1].isdigit(), head[:200]
        n = 0
        for ln in lines[1:]:
            k, _, v = ln.partition(b":")
            if k.lower() == b"content-length":
                n = int(v)
        if len(rest) < n:
            break
        codes.append(int(parts[1]))
        buf = rest[n:]
    return codes, buf


def _send_wire(port: int, data: bytes, half_close: bool) -> tuple[list[int], bytes, bool]:
    """(status codes, leftover bytes, closed by execd) within ANSWER_WITHIN."""
    deadline = time.monotonic() + ANSWER_WITHIN
    out = b""
    with socket.create_connection(("127.0.0.1", port), timeout=ANSWER_WITHIN) as s:
        try:
            s.sendall(data)
            if half_close:
                s.shutdown(socket.SHUT_WR)
        except OSError:  # execd answered and closed before taking it all
            pass
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return _responses(out) + (False,)
            s.settimeout(left)
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                continue
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                return _responses(out) + (True,)
            out += chunk
            codes, _ = _responses(out)
            if codes and not half_close:
                return codes, b"", False  # answered; keep-alive may hold the connection open


@pytest.fixture
def wire_execd(execd_factory, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / "a.txt").write_text("a")
    return execd_factory("--root", str(root), "--workspace", str(root), "--kill-grace", "0.2",
                         "--header-timeout", "1", "--body-timeout", "1", "--preauth-idle", "1")


@pytest.mark.slow
def test_fuzz_request_line_and_headers_bytes(wire_execd):
    d = wire_execd
    rng = random.Random(WIRE_SEED)
    t_end = time.monotonic() + WIRE_BUDGET
    done = 0
    for case in range(WIRE_CASES):
        if time.monotonic() > t_end:
            break
        data = _wire_case(rng)
        half_close = rng.random() < 0.95
        where = f"seed {WIRE_SEED} case {case}: {data[:300]!r}"
        codes, left, closed = _send_wire(d.port, data, half_close)
        assert d.proc.poll() is None, f"execd died on {where}"
        assert all(c < 500 for c in codes), f"{codes} on {where}"
        if half_close:
            # Everything sent was read: execd must have answered it all and closed.
            assert closed, f"no close within {ANSWER_WITHIN}s ({codes}) on {where}"
            assert not left or left.startswith(b"HTTP/1.1 "), f"{left[:200]!r} on {where}"
        else:
            assert codes or closed, f"no answer or close within {ANSWER_WITHIN}s on {where}"
        done += 1
    assert done >= 50, f"only {done} cases in {WIRE_BUDGET}s"
    log = d.log.read_text(errors="replace")
    assert "internal error" not in log and "Traceback" not in log, log[-2000:]
    assert d.exec("echo alive")["output"] == "alive\n"
    assert d.others() == []
