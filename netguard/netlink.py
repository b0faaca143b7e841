"""A minimal rtnetlink reader (stdlib only): the links, addresses and routes of this netns.

Three dumps (RTM_GETLINK, RTM_GETADDR, RTM_GETROUTE) over one AF_NETLINK socket, parsed just far
enough for netinfo. It replaces pyroute2 on netguard's hot path: importing pyroute2 cost ~110 ms
of CPU in every guarded pod's start, this module about 1 ms. Layouts are the kernel's uapi
(linux/netlink.h, linux/rtnetlink.h, linux/if_link.h, linux/if_addr.h).
"""

from __future__ import annotations

# The C module the `socket` module wraps: the wrapper imports enum and selectors, CPU on
# every guarded pod's start (see values.py); the calls here are the same.
import _socket as socket
import os
import struct

from netguard.values import Record

NETLINK_ROUTE = 0
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
RTM_NEWLINK, RTM_GETLINK = 16, 18
RTM_NEWADDR, RTM_GETADDR = 20, 22
RTM_NEWROUTE, RTM_GETROUTE = 24, 26
IFLA_IFNAME = 3
IFA_ADDRESS, IFA_LOCAL = 1, 2
RTA_GATEWAY, RTA_MULTIPATH, RTA_TABLE = 5, 9, 15

_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_IFINFOMSG = struct.Struct("=BxHiII")  # family, type, index, flags, change
_IFADDRMSG = struct.Struct("=BBBBI")  # family, prefixlen, flags, scope, index
_RTMSG = struct.Struct("=BBBBBBBBI")  # family, dst_len, src_len, tos, table, proto, scope, type, flags
_RTATTR = struct.Struct("=HH")  # len, type
_RTNEXTHOP = struct.Struct("=HBBi")  # len, flags, hops, ifindex


class NetlinkError(OSError):
    pass


class Link(Record):
    index: int
    name: str
    FIELDS = ("index", "name")


class Addr(Record):
    family: int
    index: int
    prefixlen: int
    scope: int
    address: str  # IFA_LOCAL when present (the interface's own address), else IFA_ADDRESS
    FIELDS = ("family", "index", "prefixlen", "scope", "address")


class Route(Record):
    family: int
    dst_len: int
    table: int
    type: int
    gateways: list[str]  # RTA_GATEWAY, then multipath hops'
    FIELDS = ("family", "dst_len", "table", "type", "gateways")
    FACTORIES = {"gateways": list}


def _align(n: int) -> int:
    return (n + 3) & ~3


def _attrs(data: bytes, offset: int, end: int) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    while offset + _RTATTR.size <= end:
        length, kind = _RTATTR.unpack_from(data, offset)
        if length < _RTATTR.size:
            break
        out.setdefault(kind & 0x3FFF, data[offset + _RTATTR.size: offset + length])
        offset += _align(length)
    return out


def _ip(family: int, raw: bytes | None) -> str | None:
    if raw is None:
        return None
    try:
        return socket.inet_ntop(family, raw)
    except (ValueError, OSError):
        return None


def _dump(sock: socket.socket, kind: int, body: bytes, seq: int):
    """Yield (type, payload bytes, payload offset, message end) for each message of a dump."""
    sock.send(_NLMSGHDR.pack(_NLMSGHDR.size + len(body), kind, NLM_F_REQUEST | NLM_F_DUMP,
                             seq, 0) + body)
    while True:
        data = sock.recv(1 << 20)
        offset = 0
        while offset + _NLMSGHDR.size <= len(data):
            length, mtype, _flags, mseq, _pid = _NLMSGHDR.unpack_from(data, offset)
            if length < _NLMSGHDR.size:
                raise NetlinkError("malformed netlink message")
            start, end = offset + _NLMSGHDR.size, offset + length
            offset += _align(length)
            if mseq != seq:
                continue
            if mtype == NLMSG_DONE:
                return
            if mtype == NLMSG_ERROR:
                (errno,) = struct.unpack_from("=i", data, start)
                if errno:
                    raise NetlinkError(-errno, os.strerror(-errno))
                continue
            yield mtype, data, start, end


class Reader:
    """One NETLINK_ROUTE socket; a context manager like pyroute2's IPRoute."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_ROUTE)
        self._sock.bind((0, 0))
        self._seq = 0

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._sock.close()

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def links(self) -> list[Link]:
        out = []
        body = _IFINFOMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0)
        for mtype, data, start, end in _dump(self._sock, RTM_GETLINK, body, self._next()):
            if mtype != RTM_NEWLINK:
                continue
            _fam, _type, index, _flags, _change = _IFINFOMSG.unpack_from(data, start)
            attrs = _attrs(data, start + _IFINFOMSG.size, end)
            name = attrs.get(IFLA_IFNAME, b"").split(b"\0", 1)[0].decode(errors="replace")
            out.append(Link(index, name))
        return out

    def addrs(self) -> list[Addr]:
        out = []
        body = _IFADDRMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0)
        for mtype, data, start, end in _dump(self._sock, RTM_GETADDR, body, self._next()):
            if mtype != RTM_NEWADDR:
                continue
            family, prefixlen, _flags, scope, index = _IFADDRMSG.unpack_from(data, start)
            attrs = _attrs(data, start + _IFADDRMSG.size, end)
            address = _ip(family, attrs.get(IFA_LOCAL) or attrs.get(IFA_ADDRESS))
            if address is not None:
                out.append(Addr(family, index, prefixlen, scope, address))
        return out

    def routes(self, family: int) -> list[Route]:
        out = []
        body = _RTMSG.pack(family, 0, 0, 0, 0, 0, 0, 0, 0)
        for mtype, data, start, end in _dump(self._sock, RTM_GETROUTE, body, self._next()):
            if mtype != RTM_NEWROUTE:
                continue
            fam, dst_len, _src, _tos, table, _proto, _scope, rtype, _fl = _RTMSG.unpack_from(
                data, start)
            attrs = _attrs(data, start + _RTMSG.size, end)
            if RTA_TABLE in attrs:
                (table,) = struct.unpack_from("=I", attrs[RTA_TABLE])
            hops = [_ip(fam, attrs.get(RTA_GATEWAY))]
            mp = attrs.get(RTA_MULTIPATH, b"")
            off = 0
            while off + _RTNEXTHOP.size <= len(mp):
                length = _RTNEXTHOP.unpack_from(mp, off)[0]
                if length < _RTNEXTHOP.size:
                    break
                sub = _attrs(mp, off + _RTNEXTHOP.size, off + length)
                hops.append(_ip(fam, sub.get(RTA_GATEWAY)))
                off += _align(length)
            out.append(Route(fam, dst_len, table, rtype, [h for h in hops if h]))
        return out
