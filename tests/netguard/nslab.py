"""A small network lab for netguard's real-kernel tests: namespaces, veths, servers, probes.

Topology (every address exists only inside the test's own namespaces):

    other (ngr-*)                pod (ngp-*)                     peer (ngq-*)
    10.251.2.2  ----veth----  10.251.2.1 | 10.251.1.1  ----veth----  10.251.1.2
    fd00:5a:2::2              fd00:5a:2::1 | fd00:5a:1::1            fd00:5a:1::2
                                                                     169.254.169.254 (metadata)
                                                                     fd00:ec2::254   (metadata)
                                                                     10.251.9.9 (a "remote" host)

The pod routes the metadata addresses and 10.251.9.0/24 to the peer, so every probe, blocked or
not, ends inside the lab. Sockets are opened inside a namespace by switching the calling thread
with setns(2) and back; a socket stays in the namespace it was created in.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import secrets
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)

POD_PEER_V4, PEER_V4 = "10.251.1.1", "10.251.1.2"
POD_OTHER_V4, OTHER_V4 = "10.251.2.1", "10.251.2.2"
POD_PEER_V6, PEER_V6 = "fd00:5a:1::1", "fd00:5a:1::2"
POD_OTHER_V6, OTHER_V6 = "fd00:5a:2::1", "fd00:5a:2::2"
REMOTE_V4 = "10.251.9.9"
METADATA_V4, METADATA_V6 = "169.254.169.254", "fd00:ec2::254"


def sh(*cmd: str, check: bool = True, timeout: float = 20, **kw) -> subprocess.CompletedProcess:
    p = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, **kw)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"setns: {os.strerror(e)}")


@contextlib.contextmanager
def inside(ns: str):
    """Run the block with the calling thread in network namespace `ns`."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        _setns(target)
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(own)
        os.close(target)


def sock(ns: str, family: int, kind: int, proto: int = 0) -> socket.socket:
    with inside(ns):
        return socket.socket(family, kind, proto)


def _fam(host: str) -> int:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


# ------------------------------------------------------------------ servers


class Server:
    """TCP echo and UDP echo on one port (all addresses of both families) in a namespace.
    Counts what arrives, so a test can say the far side never saw a blocked packet."""

    def __init__(self, ns: str, port: int, udp: bool = False):
        self.port, self.udp = port, udp
        self.accepted = 0
        self.datagrams = 0
        self._socks: list[socket.socket] = []
        self._conns: list[socket.socket] = []
        self._stop = threading.Event()
        for fam, addr in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
            s = sock(ns, fam, socket.SOCK_DGRAM if udp else socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if fam == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind((addr, port))
            if not udp:
                s.listen(64)
            s.settimeout(0.1)
            self._socks.append(s)
            threading.Thread(target=self._serve, args=(s,), daemon=True).start()

    def _serve(self, s: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                if self.udp:
                    data, peer = s.recvfrom(2048)
                    self.datagrams += 1
                    s.sendto(data, peer)
                    continue
                c, _ = s.accept()
            except (TimeoutError, OSError):
                continue
            self.accepted += 1
            self._conns.append(c)
            threading.Thread(target=self._echo, args=(c,), daemon=True).start()

    @staticmethod
    def _echo(c: socket.socket) -> None:
        with c:
            c.settimeout(60)  # a test may hold a connection open across several applies
            with contextlib.suppress(OSError):
                while data := c.recv(2048):
                    c.sendall(data)

    def close(self) -> None:
        self._stop.set()
        for s in self._socks + self._conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


# ------------------------------------------------------------------ probes


@dataclass
class Outcome:
    what: str  # "connected"/"reply" (got through) or "refused", "unreachable", "denied", "timeout"
    ms: float

    @property
    def through(self) -> bool:
        return self.what in ("connected", "reply")


_ERRNO = {errno.ECONNREFUSED: "refused", errno.EHOSTUNREACH: "unreachable",
          errno.ENETUNREACH: "unreachable", errno.EPERM: "denied", errno.EACCES: "denied"}


def tcp(ns: str, host: str, port: int, timeout: float = 1.0, src: str | None = None,
        payload: bytes | None = None) -> Outcome:
    """Connect (and optionally round-trip a payload: proves the reply got back out)."""
    s = sock(ns, _fam(host), socket.SOCK_STREAM)
    t0 = time.perf_counter()
    try:
        s.settimeout(timeout)
        if src:
            s.bind((src, 0))
        s.connect((host, port))
        if payload is not None:
            s.sendall(payload)
            got = b""
            while len(got) < len(payload):
                chunk = s.recv(2048)
                if not chunk:
                    break
                got += chunk
            if got != payload:
                return Outcome("no echo", _ms(t0))
        return Outcome("connected", _ms(t0))
    except TimeoutError:
        return Outcome("timeout", _ms(t0))
    except OSError as e:
        return Outcome(_ERRNO.get(e.errno, f"errno {e.errno}"), _ms(t0))
    finally:
        s.close()


def udp(ns: str, host: str, port: int, timeout: float = 1.0, payload: bytes = b"") -> Outcome:
    """A connected UDP query; an ICMP port-unreachable surfaces as ECONNREFUSED on recv."""
    s = sock(ns, _fam(host), socket.SOCK_DGRAM)
    t0 = time.perf_counter()
    try:
        s.settimeout(timeout)
        s.connect((host, port))
        s.send(payload or dns_query())
        s.recv(2048)
        return Outcome("reply", _ms(t0))
    except TimeoutError:
        return Outcome("timeout", _ms(t0))
    except OSError as e:
        return Outcome(_ERRNO.get(e.errno, f"errno {e.errno}"), _ms(t0))
    finally:
        s.close()


def dns_query(name: str = "pypi.org") -> bytes:
    """A real DNS A query, so the 'DNS' probe is what a resolver would send."""
    q = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
    return struct.pack("!HHHHHH", 0x5A5A, 0x0100, 1, 0, 0, 0) + q + struct.pack("!HH", 1, 1)


def icmp_echo(ns: str, host: str, timeout: float = 1.0) -> Outcome:
    """One ICMP (v4) echo over a raw socket: reply, unreachable, denied (EPERM) or timeout."""
    s = sock(ns, socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    ident = os.getpid() & 0xFFFF
    body = struct.pack("!BBHHH", 8, 0, 0, ident, 1) + b"netguard"
    csum = _checksum(body)
    pkt = body[:2] + struct.pack("!H", csum) + body[4:]
    t0 = time.perf_counter()
    try:
        s.settimeout(timeout)
        s.sendto(pkt, (host, 0))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            data, addr = s.recvfrom(2048)
            ihl = (data[0] & 0x0F) * 4
            icmp_type = data[ihl]
            if icmp_type == 0 and addr[0] == host:
                return Outcome("reply", _ms(t0))
            if icmp_type == 3:
                return Outcome("unreachable", _ms(t0))
        return Outcome("timeout", _ms(t0))
    except TimeoutError:
        return Outcome("timeout", _ms(t0))
    except OSError as e:
        return Outcome(_ERRNO.get(e.errno, f"errno {e.errno}"), _ms(t0))
    finally:
        s.close()


def _checksum(b: bytes) -> int:
    if len(b) % 2:
        b += b"\0"
    total = sum(struct.unpack(f"!{len(b) // 2}H", b))
    total = (total >> 16) + (total & 0xFFFF)
    total += total >> 16
    return ~total & 0xFFFF


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


# ------------------------------------------------------------------ the lab


@dataclass
class Lab:
    pod: str
    peer: str
    other: str
    tmp: Path
    servers: list[Server] = field(default_factory=list)

    @classmethod
    def create(cls, tmp: Path, ipv6: bool = True) -> Lab:
        sfx = secrets.token_hex(3)
        lab = cls(f"ngp-{sfx}", f"ngq-{sfx}", f"ngr-{sfx}", tmp)
        try:
            lab._build(sfx, ipv6)
        except BaseException:
            lab.destroy()
            raise
        return lab

    def _build(self, sfx: str, ipv6: bool) -> None:
        for ns in (self.pod, self.peer, self.other):
            sh("ip", "netns", "add", ns)
            self.ip(ns, "link", "set", "lo", "up")
        if not ipv6:
            # /proc/sys/net shows the namespace of the process that opens it.
            sh("ip", "netns", "exec", self.pod, "sh", "-c",
               "for c in all default lo; do echo 1 > /proc/sys/net/ipv6/conf/$c/disable_ipv6; "
               "done")
        for far, a, b, v4, v6 in ((self.peer, f"ngp{sfx}a", f"ngq{sfx}a", "1", "1"),
                                  (self.other, f"ngp{sfx}b", f"ngr{sfx}b", "2", "2")):
            sh("ip", "link", "add", a, "netns", self.pod, "type", "veth", "peer", "name", b,
               "netns", far)
            self.ip(self.pod, "addr", "add", f"10.251.{v4}.1/24", "dev", a)
            self.ip(far, "addr", "add", f"10.251.{v4}.2/24", "dev", b)
            if ipv6:
                self.ip(self.pod, "addr", "add", f"fd00:5a:{v6}::1/64", "dev", a, "nodad")
                self.ip(far, "addr", "add", f"fd00:5a:{v6}::2/64", "dev", b, "nodad")
            self.ip(self.pod, "link", "set", a, "up")
            self.ip(far, "link", "set", b, "up")
        peer_if = f"ngq{sfx}a"
        for addr in (f"{METADATA_V4}/32", f"{REMOTE_V4}/32"):
            self.ip(self.peer, "addr", "add", addr, "dev", peer_if)
        self.ip(self.pod, "route", "add", f"{METADATA_V4}/32", "via", PEER_V4)
        self.ip(self.pod, "route", "add", "10.251.9.0/24", "via", PEER_V4)
        if ipv6:
            self.ip(self.peer, "addr", "add", f"{METADATA_V6}/128", "dev", peer_if, "nodad")
            self.ip(self.pod, "-6", "route", "add", f"{METADATA_V6}/128", "via", PEER_V6)

    @staticmethod
    def ip(ns: str, *args: str) -> None:
        sh("ip", "-n", ns, *args)

    def serve(self, ns: str, port: int, udp: bool = False) -> Server:
        s = Server(ns, port, udp)
        self.servers.append(s)
        return s

    def destroy(self) -> None:
        for s in self.servers:
            s.close()
        for ns in (self.pod, self.peer, self.other):
            # Deleting a namespace destroys its veth ends, and so the pairs.
            sh("ip", "netns", "del", ns, check=False)

    # -------------------------------------------------------------- netguard in the pod

    @property
    def status_file(self) -> Path:
        return self.tmp / "run" / "netguard.json"

    def netguard(self, *args: str, env: dict[str, str] | None = None,
                 prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
        """`python -m netguard ARGS` inside the pod namespace (status file in tmp)."""
        extra = ("--status-file", str(self.status_file)) if args[0] in ("apply", "check") else ()
        cmd = [shutil.which("ip") or "ip", "netns", "exec", self.pod, *prefix, sys.executable, "-m", "netguard",
               *args, *extra]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT,
                              env=env)

    def apply(self, *args: str, **kw) -> subprocess.CompletedProcess:
        p = self.netguard("apply", *args, **kw)
        assert p.returncode == 0, f"apply failed ({p.returncode}): {p.stderr or p.stdout}"
        return p

    def save(self, family: int = 4, backend: str = "nft") -> str:
        """The pod's iptables-save, without timestamps or counters (comparable run to run)."""
        binary = f"{'ip6' if family == 6 else 'ip'}tables-{backend}-save"
        out = sh("ip", "netns", "exec", self.pod, binary).stdout
        out = "\n".join(x for x in out.splitlines() if not x.startswith("#"))
        return re.sub(r"\[\d+:\d+\]", "[0:0]", out)


def missing_prerequisites() -> list[str]:
    missing = []
    if os.geteuid() != 0:
        missing.append("root (euid 0)")
    for b in ("ip", "iptables-nft-restore", "iptables-nft-save", "ip6tables-nft-restore",
              "ip6tables-nft-save"):
        if shutil.which(b) is None:
            missing.append(b)
    return missing
