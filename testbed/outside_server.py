"""A tiny server for the real node's fake outside (run inside the `sandman-outside` netns by
testbed.realnode.serve_outside). Stdlib only; exits by itself after its lifetime.

    outside_server.py tcp|udp|dns <ip> <port> <lifetime seconds> <records json>

Prints "listening" once bound, then "hit <peer ip>:<port> <detail>" for every request.
"""

import json
import selectors
import socket
import struct
import sys
import time


def dns_answer(query: bytes, records: dict) -> bytes:
    """A reply to a one-question DNS query: the A record from `records`, else NXDOMAIN."""
    qid, _flags, qd = struct.unpack("!HHH", query[:6])
    i, labels = 12, []
    while query[i]:
        labels.append(query[i + 1:i + 1 + query[i]].decode(errors="replace"))
        i += query[i] + 1
    qtype = struct.unpack("!H", query[i + 1:i + 3])[0]
    question = query[12:i + 5]
    name = ".".join(labels).lower()
    ip = records.get(name) or records.get(name + ".")
    if ip and qtype == 1:
        answer = (b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 5, 4) + socket.inet_aton(ip))
        return struct.pack("!HHHHHH", qid, 0x8180, 1, 1, 0, 0) + question + answer
    rcode = 0 if ip else 3  # NOERROR/no data for other types of a known name, else NXDOMAIN
    return struct.pack("!HHHHHH", qid, 0x8180 | rcode, 1, 0, 0, 0) + question


def main() -> int:
    kind, ip, port, lifetime, records = sys.argv[1], sys.argv[2], int(sys.argv[3]), \
        float(sys.argv[4]), json.loads(sys.argv[5])
    deadline = time.monotonic() + lifetime
    sel = selectors.DefaultSelector()
    socks = []
    if kind in ("udp", "dns"):
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        u.bind((ip, port))
        socks.append(("udp", u))
    if kind in ("tcp", "dns"):
        t = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        t.bind((ip, port))
        t.listen(64)
        socks.append(("tcp", t))
    for proto, s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, proto)
    print(f"listening {kind} {ip}:{port} for {lifetime:.0f}s", flush=True)
    while time.monotonic() < deadline:
        for key, _ in sel.select(timeout=min(1.0, max(0.0, deadline - time.monotonic()))):
            s = key.fileobj
            if key.data == "udp":
                data, peer = s.recvfrom(4096)
                reply = dns_answer(data, records) if kind == "dns" else data
                print(f"hit {peer[0]}:{peer[1]} udp {len(data)}B", flush=True)
                s.sendto(reply, peer)
            else:
                conn, peer = s.accept()
                conn.settimeout(2)
                with conn:
                    print(f"hit {peer[0]}:{peer[1]} tcp", flush=True)
                    try:
                        if kind == "dns":
                            n = struct.unpack("!H", conn.recv(2))[0]
                            reply = dns_answer(conn.recv(n), records)
                            conn.sendall(struct.pack("!H", len(reply)) + reply)
                        else:
                            conn.sendall(b"sandman-outside\n")
                    except OSError:
                        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
