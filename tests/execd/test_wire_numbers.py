"""Numbers on the wire are ASCII digits only: Python's `str.isdigit`, `int()` and regex `\\d`
accept superscripts, other scripts' digits, signs, underscores and Unicode spaces, so each
numeric value execd takes from the request line, a header or the query is checked by execd
itself. A hostile value is a 400 (a 413 when it is digits but over the cap), never a 500, and
never read as some other number."""

from __future__ import annotations

import base64
import json
import socket

import pytest

from .conftest import TOKEN
from .test_http import raw

BODY = json.dumps({"command": "echo ok"}).encode()


def post_exec(port: int, content_length: bytes, body: bytes = BODY,
              extra: bytes = b"") -> tuple[int, dict]:
    status, _, resp = raw(port, b"POST /exec HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                          + TOKEN.encode() + b"\r\nContent-Length: " + content_length
                          + b"\r\n" + extra + b"Connection: close\r\n\r\n" + body)
    return status, json.loads(resp) if resp else {}


N = str(len(BODY)).encode()
# Each would be a number to str.isdigit/int()/strip(); none is 1*DIGIT.
HOSTILE = [
    b"\xb2",                      # latin-1 superscript two: isdigit() but int() raises
    b"\xb9" + N,                  # superscript one in front
    "\u00b2".encode(),            # the same as UTF-8 bytes
    "\u0661\u0662".encode(),      # Arabic-Indic 12 (int() reads it)
    b"+" + N, b"-" + N, b"-0", b"-1",
    N[:1] + b"_" + N[1:],         # int() accepts underscores
    b"0x10", b"0o17", b"1e3", N + b".0", b"",
    N + b" " + N, N + b", " + N,
    b"\xa0" + N,                  # NBSP: str.strip() and int() drop it
    b"\x85" + N,                  # NEL, the same
    b"\x0b" + N, b"\x0c" + N, N + b"\x1c",
]


@pytest.mark.parametrize("value", HOSTILE, ids=lambda v: repr(v)[2:-1] or "empty")
def test_content_length_not_ascii_digits_is_400(execd, value):
    status, obj = post_exec(execd.port, value)
    assert status == 400, (value, status, obj)
    assert obj["error"] == "Content-Length must be ASCII digits"


@pytest.mark.parametrize("value", [b"9" * 30, b"9" * 5000, b"18446744073709551617"])
def test_huge_content_length_is_413(execd, value):
    status, obj = post_exec(execd.port, value, body=b"")
    assert status == 413, (status, obj)


@pytest.mark.parametrize("value", [b" " + N + b" ", b"\t" + N + b"\t", b"0" * 40 + N])
def test_content_length_with_optional_whitespace_or_leading_zeros_is_read(execd, value):
    # RFC 9110 field values shed SP/HTAB around them; leading zeros are still 1*DIGIT.
    status, obj = post_exec(execd.port, value)
    assert status == 200 and obj["output"] == "ok\n", (status, obj)


def test_two_different_content_lengths_are_400(execd):
    # Which one frames the body is ambiguous: the rest would be read as the next request.
    status, obj = post_exec(execd.port, b"2", extra=b"Content-Length: " + N + b"\r\n")
    assert status == 400 and "Content-Length" in obj["error"], (status, obj)
    status, obj = post_exec(execd.port, N, extra=b"Content-Length: " + N + b"\r\n")
    assert status == 200, (status, obj)


@pytest.mark.parametrize("version", [b"HTTP/1.\xb2", b"HTTP/+1.1", b"HTTP/1.+1", b"HTTP/1_1.1",
                                     b"HTTP/1. 1", b"HTTP/\xd9\xa1.\xd9\xa1",
                                     b"HTTP/1", b"HTTP/1.1.1",
                                     b"HTTP/1." + b"1" * 5000])
def test_request_line_version_not_ascii_digits_is_400(execd, version):
    status, _, body = raw(execd.port, b"GET /health " + version + b"\r\nHost: x\r\n\r\n")
    assert status == 400, (version[:20], status, body)
    assert "error" in json.loads(body)


@pytest.mark.parametrize("port", ["%D9%A8%D9%A0", "%EF%BC%98%EF%BC%90", "+80", "80%0A", " 80",
                                  "8_0", "%C2%B2"])
def test_egress_probe_port_not_ascii_digits_is_400(execd, port):
    # Arabic-Indic or fullwidth 80 would otherwise probe port 80.
    r = execd.get("/conditions?egress_probe=127.0.0.1:" + port)
    assert r.status_code == 400, (port, r.status_code, r.text)


@pytest.mark.parametrize("mode", ["0755\n", "\u0667\u0665\u0665", "07_55", " 755"])
def test_file_mode_string_not_ascii_octal_is_400(execd, tmp_path, mode):
    f = tmp_path / "m.txt"
    r = execd.post("/files/write", {"path": str(f), "data_b64": base64.b64encode(b"x").decode(),
                                    "mode": mode})
    assert r.status_code == 400, (mode, r.status_code, r.text)
    assert not f.exists()


def test_execd_still_serves_after_hostile_numbers(execd):
    for value in HOSTILE[:4]:
        post_exec(execd.port, value)
    with socket.create_connection(("127.0.0.1", execd.port), timeout=10):
        pass
    assert execd.exec("echo alive")["output"] == "alive\n"
