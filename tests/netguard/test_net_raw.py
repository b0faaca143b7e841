"""Why every container but the guard must drop NET_RAW (issue 13, item 6), on a real kernel.

containerd and CRI-O grant NET_RAW to every container by default. With it, an AF_PACKET socket
writes whole Ethernet frames onto the pod's interface: they never traverse the IP stack's
netfilter hooks, so netguard's `--egress deny` rules do not see them. Dropping the capability
(what the mutation does in every non-guard container; the check refuses pods that keep it)
turns the socket into EPERM. Shown here in the netns lab of test_netns.py: netguard applies
egress deny in the pod namespace, a UDP datagram to the peer is blocked, the same datagram in a
hand-built frame arrives, and with NET_RAW dropped (capsh, in a child) the socket is refused.
Every frame goes to the lab's own peer namespace (10.251.1.2).
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time

import pytest

from tests.netguard import nslab
from tests.netguard.nslab import PEER_V4, POD_PEER_V4

pytestmark = [pytest.mark.netns, pytest.mark.timeout(120)]

PORT = 8099
PAYLOAD = b"past-the-guard"

# Run as a child inside the pod namespace: one UDP datagram in a hand-built Ethernet frame.
SENDER = r"""
import errno, socket, struct, sys
ifname, src_mac, dst_mac, src_ip, dst_ip, port, payload = sys.argv[1:8]
try:
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
except PermissionError as e:
    print("EPERM" if e.errno == errno.EPERM else "errno %d" % e.errno)
    sys.exit(0)
s.bind((ifname, 0))
data = payload.encode()
udp = struct.pack("!HHHH", 40000, int(port), 8 + len(data), 0) + data  # checksum 0: none
ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0x4000, 64, 17, 0,
                 socket.inet_aton(src_ip), socket.inet_aton(dst_ip))
words = sum(struct.unpack("!10H", ip))
while words >> 16:
    words = (words & 0xFFFF) + (words >> 16)
ip = ip[:10] + struct.pack("!H", ~words & 0xFFFF) + ip[12:]
mac = lambda m: bytes.fromhex(m.replace(":", ""))
s.send(mac(dst_mac) + mac(src_mac) + b"\x08\x00" + ip + udp)
print("SENT")
"""


@pytest.fixture(scope="module", autouse=True)
def _prerequisites():
    missing = nslab.missing_prerequisites() + ([] if shutil.which("capsh") else ["capsh"])
    if missing:
        pytest.fail(f"NET_RAW netns test needs {', '.join(missing)}; install them and run as "
                    "root", pytrace=False)


@pytest.fixture
def lab(tmp_path):
    lab = nslab.Lab.create(tmp_path, ipv6=False)
    try:
        yield lab
    finally:
        lab.destroy()


def _link(ns: str) -> tuple[str, str]:
    """(name, MAC) of the namespace's veth toward the peer (the one holding its 10.251.1.x)."""
    addrs = json.loads(nslab.sh("ip", "-n", ns, "-j", "addr", "show").stdout)
    for link in addrs:
        if any(a.get("local") in (POD_PEER_V4, PEER_V4) for a in link.get("addr_info", [])):
            return link["ifname"], link["address"]
    raise AssertionError(f"no 10.251.1.x link in {ns}")


def _send_raw(lab, drop_net_raw: bool) -> str:
    ifname, src_mac = _link(lab.pod)
    _, dst_mac = _link(lab.peer)
    argv = [sys.executable, "-c", SENDER, ifname, src_mac, dst_mac, POD_PEER_V4, PEER_V4,
            str(PORT), PAYLOAD.decode()]
    if drop_net_raw:  # what `capabilities.drop: [NET_RAW]` gives the container's process
        argv = ["capsh", "--drop=cap_net_raw", "--", "-c", " ".join(
            "'" + a.replace("'", "'\\''") + "'" for a in argv)]
    p = subprocess.run(["ip", "netns", "exec", lab.pod, *argv], capture_output=True, text=True,
                       timeout=30)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


def _received(receiver: socket.socket, wait: float = 1.0) -> list[bytes]:
    got, deadline = [], time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            got.append(receiver.recv(2048))
        except (TimeoutError, BlockingIOError):
            pass
    return got


def test_net_raw_sends_past_egress_deny_and_dropping_it_refuses_the_socket(lab):
    receiver = nslab.sock(lab.peer, socket.AF_INET, socket.SOCK_DGRAM)
    try:
        receiver.bind((PEER_V4, PORT))
        receiver.settimeout(0.1)
        # Positive control before the guard: the frame reaches the peer.
        assert _send_raw(lab, drop_net_raw=False) == "SENT"
        assert PAYLOAD in _received(receiver)

        lab.apply("--egress", "deny")
        # The guard is in place: an ordinary datagram to the same port never arrives.
        out = nslab.udp(lab.pod, PEER_V4, PORT, timeout=0.5, payload=b"ordinary")
        assert not out.through, out
        assert _received(receiver, 0.3) == []
        # With NET_RAW (the runtime's default), the frame goes past the rules.
        assert _send_raw(lab, drop_net_raw=False) == "SENT"
        assert PAYLOAD in _received(receiver)
        # With NET_RAW dropped, as the mutation does in every non-guard container: EPERM.
        assert _send_raw(lab, drop_net_raw=True) == "EPERM"
        assert _received(receiver, 0.5) == []
    finally:
        receiver.close()
