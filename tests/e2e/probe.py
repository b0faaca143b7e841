"""One network probe, run by the e2e tests inside a pod's network namespace (nsenter -n with
the host's python): stdlib only, every wait bounded, one JSON line on stdout.

    probe.py tcp  <ip> <port>      connect, read one line
    probe.py udp  <ip> <port>      send a datagram, wait for the echo
    probe.py icmp <ip>             one echo request (raw socket: the host's root)
    probe.py dns  <server> <name>  one A query over UDP

{"ok": true|false, "how": "connected|refused|timeout|unreachable|...", "detail": "..."}
The tests only ever give it addresses of the test bed: pods, the node, the fake outside.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import struct
import sys
import time

TIMEOUT = 3.0


def _err(e: OSError) -> str:
    if isinstance(e, socket.timeout) or e.errno in (errno.ETIMEDOUT, errno.EAGAIN):
        return "timeout"
    if e.errno == errno.ECONNREFUSED:
        return "refused"
    if e.errno == errno.ECONNRESET:
        return "reset"
    if e.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return "unreachable"
    if e.errno in (errno.EPERM, errno.EACCES):
        return "not-permitted"
    return f"errno-{e.errno}"


def tcp(ip: str, port: int) -> dict:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(TIMEOUT)
    try:
        s.connect((ip, port))
        try:
            data = s.recv(200)
        except OSError:
            data = b""
        return {"ok": True, "how": "connected", "detail": data.decode(errors="replace")[:100]}
    except OSError as e:
        return {"ok": False, "how": _err(e), "detail": str(e)}
    finally:
        s.close()


def udp(ip: str, port: int) -> dict:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(TIMEOUT)
    try:
        s.sendto(b"sandman-e2e-probe", (ip, port))
        data, _ = s.recvfrom(200)
        return {"ok": data == b"sandman-e2e-probe", "how": "echoed", "detail": data[:50].hex()}
    except OSError as e:
        return {"ok": False, "how": _err(e), "detail": str(e)}
    finally:
        s.close()


def _checksum(b: bytes) -> int:
    if len(b) % 2:
        b += b"\0"
    s = sum(struct.unpack(f"!{len(b) // 2}H", b))
    s = (s >> 16) + (s & 0xFFFF)
    s += s >> 16
    return ~s & 0xFFFF


def icmp(ip: str) -> dict:
    ident = os.getpid() & 0xFFFF
    hdr = struct.pack("!BBHHH", 8, 0, 0, ident, 1)
    payload = b"sandman-e2e"
    pkt = struct.pack("!BBHHH", 8, 0, _checksum(hdr + payload), ident, 1) + payload
    s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    s.settimeout(0.5)
    try:
        s.sendto(pkt, (ip, 0))
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            try:
                data, peer = s.recvfrom(1500)
            except TimeoutError:
                continue
            ihl = (data[0] & 0x0F) * 4
            typ, _code, _c, rid, _seq = struct.unpack("!BBHHH", data[ihl:ihl + 8])
            if peer[0] == ip and typ == 0 and rid == ident:
                return {"ok": True, "how": "echo-reply", "detail": peer[0]}
            if typ == 3:  # destination unreachable (a REJECT)
                return {"ok": False, "how": "unreachable", "detail": f"from {peer[0]}"}
        return {"ok": False, "how": "timeout", "detail": ""}
    except OSError as e:
        return {"ok": False, "how": _err(e), "detail": str(e)}
    finally:
        s.close()


def dns(server: str, name: str) -> dict:
    qid = os.getpid() & 0xFFFF
    q = struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0)
    q += b"".join(bytes([len(p)]) + p.encode() for p in name.rstrip(".").split(".")) + b"\0"
    q += struct.pack("!HH", 1, 1)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(TIMEOUT)
    try:
        s.sendto(q, (server, 53))
        data, _ = s.recvfrom(1500)
        rid, flags, _qd, an = struct.unpack("!HHHH", data[:8])
        rcode = flags & 0xF
        ip = socket.inet_ntoa(data[-4:]) if an and rcode == 0 else ""
        return {"ok": rid == qid and rcode == 0 and an > 0, "how": f"rcode-{rcode}",
                "detail": ip}
    except OSError as e:
        return {"ok": False, "how": _err(e), "detail": str(e)}
    finally:
        s.close()


def main(argv: list[str]) -> int:
    kind = argv[0]
    if kind == "tcp":
        out = tcp(argv[1], int(argv[2]))
    elif kind == "udp":
        out = udp(argv[1], int(argv[2]))
    elif kind == "icmp":
        out = icmp(argv[1])
    elif kind == "dns":
        out = dns(argv[1], argv[2])
    else:
        raise SystemExit(f"unknown probe {kind}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
