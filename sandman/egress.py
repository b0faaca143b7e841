"""Egress allowlist entries: the one parser every enforcer and the SDK share.

An entry is `CIDR:PORT/PROTO` (`10.1.2.0/24:443/tcp`, `[fd00:1::/64]:443/udp`, a bare address
is /32 or /128) or `svc/NAME.NAMESPACE:PORT/PROTO` (a cluster Service, resolved to its
ClusterIPs by netguard at apply time). The protocol may be left out on input (tcp); the
canonical text always writes it, because netguard reads `CIDR:PORT` without one as tcp AND udp.
A ceiling (the admin's bound, chart value sandbox.egressCeiling) uses the same grammar and may
also write `*` for the port or for a Service's name.

Never ranges (the metadata endpoints, link-local, the unspecified addresses, plus what a caller
adds: the API server's addresses, sandbox.egressNever): an entry lying entirely inside one is
refused; an entry that merely contains one is admitted and the range is carved out by both
enforcers (netguard REJECT rules before its allow rules; NetworkPolicy ipBlock.except). CIDRs
nest or are disjoint, so `carve_outs` is exactly the never ranges inside an entry.

Stdlib only and Python 3.9 syntax: the client distribution ships this module.
"""

from __future__ import annotations

import ipaddress

# Neither typing nor dataclasses at run time: netguard imports this module on a guarded pod's
# start, whose CPU is budgeted (bench-netguard), and those two cost ~9 ms there.
TYPE_CHECKING = False
if TYPE_CHECKING:
    import re
    from collections.abc import Iterable, Sequence
    from typing import Union

    Network = Union[ipaddress.IPv4Network, ipaddress.IPv6Network]

TCP = "tcp"
UDP = "udp"
PROTOCOLS = (TCP, UDP)
CIDR = "cidr"
SVC = "svc"
SVC_PREFIX = "svc/"
ANY = "*"  # a ceiling's port or Service name: any

MAX_ENTRIES = 32  # per request (sandbox): netguard renders a rule per entry and address
MAX_ANNOTATION_CHARS = 2048  # the rendered annotation value
MAX_CEILING_ENTRIES = 256
MAX_ENTRY_CHARS = 200  # longer than any valid entry (a svc entry is at most 141)
MAX_NEVER = 256

# Built-in never ranges, each with the reason a refusal names.
_BUILTIN_NEVER = (
    ("169.254.0.0/16", "link-local/metadata"),
    ("fe80::/10", "link-local"),
    ("fd00:ec2::254/128", "metadata"),
    ("100.100.100.200/32", "metadata"),
    ("0.0.0.0/32", "unspecified: this host"),
    ("::/128", "unspecified: this host"),
    # An IPv4-mapped address is never a packet's destination on the wire, and an entry inside
    # this range is refused when parsed (write the IPv4 form); a wider entry (::/0) gets it
    # carved out, as the tools that map it back to IPv4 would.
    ("::ffff:0:0/96", "IPv4-mapped"),
    # Prefixes whose addresses embed an IPv4 address that a translator or relay reaches: the
    # local-use NAT64 prefix (RFC 8215) places it where the operator's prefix length says, so
    # no image of a never range can be computed and the whole prefix is never; every 6to4
    # address (RFC 3056) carries one at bits 16-47 (2002:a9fe:a9fe::/48 is the metadata).
    ("64:ff9b:1::/48", "local-use NAT64: its IPv4 embedding is the operator's choice"),
    ("2002::/16", "6to4: every address embeds an IPv4 address"),
)
_NEVER_REASON = {ipaddress.ip_network(n): r for n, r in _BUILTIN_NEVER}
NEVER: tuple[Network, ...] = tuple(_NEVER_REASON)
_MAPPED = ipaddress.IPv6Network("::ffff:0:0/96")
# NAT64 (RFC 6052 well-known prefix): an IPv6-only cluster reaches IPv4 through 64:ff9b::/96,
# so each IPv4 never range is never in its NAT64 image either.
NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_CALLER_REASON = "the API server or sandbox.egressNever"

# Strict spellings before ipaddress sees them: no leading zeros (Python < 3.9.5 read
# "010.0.0.1" as 10.0.0.1 where other tools read octal), no netmask or hostmask forms, no
# IPv6 zone (%eth0) or dotted tail. ASCII classes: `\d` also matches other scripts' digits.
_V4 = r"(?:0|[1-9][0-9]{0,2})(?:\.(?:0|[1-9][0-9]{0,2})){3}"
_V4_CIDR = _V4 + r"(?:/(?:0|[1-9][0-9]?))?"
_V6_CIDR = r"[0-9A-Fa-f:]{2,39}(?:/(?:0|[1-9][0-9]{0,2}))?"
_BARE_V6 = r"[0-9A-Fa-f:/]+(?:/(?:tcp|udp))?"
_V4_START = r"[0-9]"
_PORT = r"[1-9][0-9]{0,4}"
_DNS_1035 = r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?"  # a Service name
_DNS_1123 = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"  # a namespace name
_SPACE = r"\s"


def _re(pattern: str) -> re.Pattern[str]:
    # `re` at the first use, not at import: netguard imports this module for any allowlist
    # and uses only the never ranges when the entries are CIDRs; re (with enum) is ~4 ms of
    # CPU there. re caches the compiled pattern.
    import re

    return re.compile(pattern)


class EgressEntry:
    """One parsed entry (immutable). `text` is its canonical spelling."""

    __slots__ = ("kind", "network", "name", "namespace", "port", "protocol")
    kind: str  # CIDR or SVC
    network: Network | None  # CIDR entries
    name: str | None  # SVC entries: the Service's name, or ANY in a ceiling
    namespace: str | None  # SVC entries
    port: int | None  # None: any port (ceilings only)
    protocol: str

    def __init__(self, kind: str, network: Network | None, name: str | None,
                 namespace: str | None, port: int | None, protocol: str) -> None:
        for k, v in zip(self.__slots__, (kind, network, name, namespace, port, protocol)):
            object.__setattr__(self, k, v)

    def __setattr__(self, key: str, value: object) -> None:
        raise AttributeError("EgressEntry is immutable")

    def _fields(self) -> tuple[object, ...]:
        return (self.kind, self.network, self.name, self.namespace, self.port, self.protocol)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EgressEntry) and self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    def __repr__(self) -> str:
        return f"EgressEntry({self.text!r})"

    @property
    def text(self) -> str:
        if self.kind == SVC:
            host = f"{SVC_PREFIX}{self.name}.{self.namespace}"
        else:
            assert self.network is not None
            host = f"[{self.network}]" if self.network.version == 6 else str(self.network)
        port = ANY if self.port is None else str(self.port)
        return f"{host}:{port}/{self.protocol}"

    def __str__(self) -> str:
        return self.text

    def sort_key(self) -> tuple[int, int, int, int, str, str, int, str]:
        port = -1 if self.port is None else self.port
        if self.network is not None:
            return (0, self.network.version, int(self.network.network_address),
                    self.network.prefixlen, "", "", port, self.protocol)
        return (1, 0, 0, 0, self.namespace or "", self.name or "", port, self.protocol)


def _quote(text: object) -> str:
    s = str(text)
    return repr(s if len(s) <= 80 else s[:77] + "...")


def _error(text: object, why: str) -> ValueError:
    return ValueError(f"egress entry {_quote(text)}: {why}")


def parse(text: str, *, ceiling: bool = False) -> EgressEntry:
    """One entry; ValueError with one line quoting it when it is not one. `ceiling`: `*` is
    accepted as the port and as a Service's name."""
    if not isinstance(text, str):
        raise _error(text, "not a string")
    if len(text) > MAX_ENTRY_CHARS:
        raise _error(text, f"longer than {MAX_ENTRY_CHARS} characters")
    if not text:
        raise _error(text, "empty")
    if _re(_SPACE).search(text):
        raise _error(text, "contains whitespace")
    if text.startswith(SVC_PREFIX):
        host, port_part = _split_port(text, text[len(SVC_PREFIX):])
        name, dot, namespace = host.partition(".")
        if not dot:
            raise _error(text, "expected svc/NAME.NAMESPACE:PORT")
        if not (_re(_DNS_1035).fullmatch(name) or (ceiling and name == ANY)):
            raise _error(text, f"{name!r} is not a Service name (a DNS-1035 label"
                         + (" or *" if ceiling else "") + ")")
        if not _re(_DNS_1123).fullmatch(namespace):
            raise _error(text, f"{namespace!r} is not a namespace name (a DNS-1123 label; "
                         "a Service is written svc/NAME.NAMESPACE)")
        port, proto = _port(text, port_part, ceiling)
        return EgressEntry(SVC, None, name, namespace, port, proto)
    if text.startswith("["):
        inner, sep, rest = text[1:].partition("]")
        if not sep:
            raise _error(text, "missing ']'")
        if not rest.startswith(":"):
            raise _error(text, "expected [IPv6]:PORT")
        if not _re(_V6_CIDR).fullmatch(inner):
            raise _error(text, "not an IPv6 address or CIDR in brackets")
        network = _network(text, inner, 6)
        port, proto = _port(text, rest[1:], ceiling)
    else:
        if text.count(":") > 1 and _re(_BARE_V6).fullmatch(text):
            raise _error(text, "an IPv6 address goes in brackets: [ADDRESS]:PORT")
        if not _re(_V4_START).match(text):
            raise _error(text, "unknown form (CIDR:PORT, [IPv6]:PORT or svc/NAME.NAMESPACE:PORT)")
        host, port_part = _split_port(text, text)
        if ":" in host:
            raise _error(text, "an IPv6 address goes in brackets: [ADDRESS]:PORT")
        if not _re(_V4_CIDR).fullmatch(host):
            raise _error(text, "not an IPv4 address or CIDR (no leading zeros, no netmasks)")
        network = _network(text, host, 4)
        port, proto = _port(text, port_part, ceiling)
    return EgressEntry(CIDR, network, None, None, port, proto)


def _split_port(text: str, host_port: str) -> tuple[str, str]:
    host, sep, port_part = host_port.rpartition(":")
    if not sep:
        raise _error(text, "a port is required (HOST:PORT)")
    return host, port_part


def _port(text: str, part: str, ceiling: bool) -> tuple[int | None, str]:
    port_s, slash, proto = part.partition("/")
    if not slash:
        proto = TCP
    elif proto not in PROTOCOLS:
        raise _error(text, f"protocol must be tcp or udp, not {proto!r}")
    if ceiling and port_s == ANY:
        return None, proto
    if not _re(_PORT).fullmatch(port_s) or int(port_s) > 65535:
        raise _error(text, "port must be 1-65535" + (" or *" if ceiling else ""))
    return int(port_s), proto


def _network(text: str, host: str, version: int) -> Network:
    try:
        net = ipaddress.ip_network(host, strict=True)
    except ValueError as e:
        if "host bits" in str(e):
            raise _error(text, "has host bits set (write the network address)") from None
        raise _error(text, f"not a valid IPv{version} address or CIDR") from None
    if net.version != version:
        raise _error(text, f"not a valid IPv{version} address or CIDR")
    if version == 6 and net.subnet_of(_MAPPED):  # type: ignore[arg-type]
        # No packet carries one (a dual-stack socket sends IPv4), Python 3.13 prints it in
        # another spelling, and Kubernetes' CEL cidr() refuses it: write the IPv4 form.
        raise _error(text, "an IPv4-mapped IPv6 address (write the IPv4 form)")
    return net


def _items(items: str | Sequence[str]) -> list[str]:
    if isinstance(items, str):
        if len(items) > MAX_ANNOTATION_CHARS:
            raise ValueError(f"egress allowlist longer than {MAX_ANNOTATION_CHARS} characters")
        return [p.strip() for p in items.split(",")] if items.strip() else []
    if not isinstance(items, (list, tuple)):
        raise ValueError("egress allowlist must be a list of entry strings")
    out: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise _error(item, "not a string")
        out.append(item)
    return out


def parse_list(items: str | Sequence[str]) -> tuple[EgressEntry, ...]:
    """A request's entries, canonical: sorted and deduplicated. A string is split on ','.
    ValueError (one line) on any bad entry, on more than MAX_ENTRIES entries, and when the
    rendered list exceeds MAX_ANNOTATION_CHARS."""
    raw = _items(items)
    if len(raw) > MAX_ENTRIES:
        raise ValueError(f"egress allowlist has {len(raw)} entries, at most {MAX_ENTRIES}")
    entries = _canonical(parse(x) for x in raw)
    render(entries)  # the size check
    return entries


def _canonical(entries: Iterable[EgressEntry]) -> tuple[EgressEntry, ...]:
    return tuple(sorted(set(entries), key=EgressEntry.sort_key))


def render(entries: Iterable[EgressEntry]) -> str:
    """The annotation value: canonical entries joined by ','."""
    text = ",".join(e.text for e in _canonical(entries))
    if len(text) > MAX_ANNOTATION_CHARS:
        raise ValueError(f"egress allowlist longer than {MAX_ANNOTATION_CHARS} characters")
    return text


def is_canonical(value: str) -> bool:
    """True when `value` is a valid annotation exactly as `render` writes it."""
    try:
        return render(parse_list(value)) == value and bool(value)
    except ValueError:
        return False


class Ceiling:
    """The admin's bound on every allowlist. Empty: no allowlist is admitted."""

    __slots__ = ("entries",)
    entries: tuple[EgressEntry, ...]

    def __init__(self, entries: Iterable[EgressEntry] = ()) -> None:
        self.entries = tuple(entries)

    def __repr__(self) -> str:
        return f"Ceiling({[e.text for e in self.entries]!r})"

    @classmethod
    def parse(cls, items: str | Sequence[str]) -> Ceiling:
        raw = [x.strip() for x in (items.split(",") if isinstance(items, str) else items)]
        raw = [x for x in raw if x]
        if len(raw) > MAX_CEILING_ENTRIES:
            raise ValueError(f"egress ceiling has {len(raw)} entries, at most "
                             f"{MAX_CEILING_ENTRIES}")
        return cls(_canonical(parse(x, ceiling=True) for x in raw))

    def admits(self, entry: EgressEntry) -> bool:
        return any(_covers(c, entry) for c in self.entries)

    def __bool__(self) -> bool:
        return bool(self.entries)


def _covers(c: EgressEntry, e: EgressEntry) -> bool:
    if c.kind != e.kind or c.protocol != e.protocol:
        return False
    if c.port is not None and c.port != e.port:
        return False
    if c.kind == SVC:
        return c.namespace == e.namespace and (c.name == ANY or c.name == e.name)
    assert c.network is not None and e.network is not None
    return c.network.version == e.network.version and e.network.subnet_of(c.network)  # type: ignore[arg-type]


def parse_never(items: str | Sequence[str]) -> tuple[Network, ...]:
    """Extra never CIDRs (sandbox.egressNever, the API server's addresses): strict networks,
    a bare address is /32 (/128). ValueError with one line on a bad one."""
    raw = [x.strip() for x in (items.split(",") if isinstance(items, str) else items)]
    raw = [x for x in raw if x]
    if len(raw) > MAX_NEVER:
        raise ValueError(f"egress never list has {len(raw)} entries, at most {MAX_NEVER}")
    out = []
    for x in raw:
        if not (_re(_V4_CIDR).fullmatch(x) or _re(_V6_CIDR).fullmatch(x)):
            raise ValueError(f"egress never range {_quote(x)}: not a CIDR or address")
        try:
            out.append(ipaddress.ip_network(x, strict=True))
        except ValueError:
            raise ValueError(f"egress never range {_quote(x)}: not a network address "
                             "(host bits set?)") from None
    return tuple(out)


def never_ranges(extra: Iterable[Network] = ()) -> tuple[Network, ...]:
    """NEVER, the caller's ranges, and the NAT64 image of every IPv4 one; deduplicated."""
    return tuple(_never(extra))


def never_reasons(extra: Iterable[Network] = ()) -> dict[Network, str]:
    """never_ranges(extra), each with the reason a refusal names."""
    return _never(extra)


# netguard asks for the same ranges for every rule it renders, on every guarded pod's start:
# computed once per distinct `extra` (a handful per process; bounded all the same).
_NEVER_MEMO: dict[tuple[Network, ...], dict[Network, str]] = {}


def _never(extra: Iterable[Network]) -> dict[Network, str]:
    key = tuple(extra)
    memo = _NEVER_MEMO.get(key)
    if memo is None:
        memo = dict(_NEVER_REASON)
        for n in key:
            memo.setdefault(n, _CALLER_REASON)
        for n, why in list(memo.items()):
            if n.version == 4:
                memo.setdefault(nat64(n), f"{why}, through NAT64")
        if len(_NEVER_MEMO) >= 64:
            _NEVER_MEMO.clear()
        _NEVER_MEMO[key] = memo
    return dict(memo)


def nat64(net: ipaddress.IPv4Network) -> ipaddress.IPv6Network:
    """The image of an IPv4 network in the well-known NAT64 prefix (RFC 6052)."""
    addr = ipaddress.IPv6Address(int(NAT64.network_address) | int(net.network_address))
    return ipaddress.IPv6Network((addr, 96 + net.prefixlen))


def _inside(entry: EgressEntry, nets: dict[Network, str]) -> str | None:
    e = entry.network
    assert e is not None
    for n, why in nets.items():
        if n.version == e.version and e.subnet_of(n):  # type: ignore[arg-type]
            return why
    return None


def carve_outs(entry: EgressEntry, never: Iterable[Network] = ()) -> tuple[Network, ...]:
    """The never ranges (never_ranges(never)) strictly inside a CIDR entry's network, to be
    excepted from it; () for a Service entry (netguard checks its resolved addresses)."""
    e = entry.network
    if e is None:
        return ()
    return tuple(sorted(
        (n for n in never_ranges(never)
         if n.version == e.version and n != e and n.subnet_of(e)),  # type: ignore[arg-type]
        key=lambda n: (int(n.network_address), n.prefixlen)))


def address_refusal(address: str, never: Iterable[Network] = ()) -> str | None:
    """Why one resolved address may not be allowed (it lies in a never range), or None."""
    ip = ipaddress.ip_address(address)
    for n, why in _never(never).items():
        if ip in n:
            return f"address {address} is never allowed ({why})"
    return None


def refusals(entries: Iterable[EgressEntry], ceiling: Ceiling,
             never: Iterable[Network] = ()) -> list[str]:
    """Why each entry is refused, one line each; [] when all are admitted. An empty ceiling
    refuses any entry, in one line."""
    entries = list(entries)
    if entries and not ceiling:
        return [f"egress allowlists are off in this cluster (sandbox.egressCeiling is empty): "
                f"{_quote(entries[0].text)} refused"]
    nets = _never(never)
    out = []
    for e in entries:
        why = _inside(e, nets) if e.network is not None else None
        if why is not None:
            out.append(f"egress entry {_quote(e.text)} is never allowed ({why})")
        elif not ceiling.admits(e):
            out.append(f"egress entry {_quote(e.text)} is outside the cluster's ceiling "
                       "(sandbox.egressCeiling)")
    return out
