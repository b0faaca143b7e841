"""Self-verification after apply: the rules must be seen to work, not just to be present.

Loopback must still connect (execd and the tools inside the pod talk over it); the metadata
address and every `--verify-blocked` target must fail, and fail fast: a REJECT answers at once,
so a probe that merely times out means the guard is not what answered and counts as a failure.
"""

from __future__ import annotations

# The C module the `socket` module wraps: the wrapper imports enum and selectors, CPU on
# every guarded pod's start (see values.py); the calls here are the same.
import _socket as socket
import errno
import ipaddress
import time

from netguard.config import IPV4, IPV6, METADATA, ConfigError
from netguard.values import Record

TYPE_CHECKING = False  # typing's import is CPU on the guard's hot path
if TYPE_CHECKING:
    from collections.abc import Sequence

# errnos that mean "this connect was refused here": ECONNREFUSED is our tcp-reset REJECT;
# no route or an administrative refusal also keep the packet inside the pod.
BLOCKED_ERRNOS = {
    errno.ECONNREFUSED: "refused",
    errno.ENETUNREACH: "no route",
    errno.EHOSTUNREACH: "host unreachable",
    errno.EACCES: "denied",
    errno.EPERM: "denied",
    errno.EADDRNOTAVAIL: "no source address",  # e.g. IPv6 on but unaddressed: cannot leave
}
METADATA_PORT = 80


def _error(n: int | None) -> str:
    return f"error {errno.errorcode.get(n, n) if n is not None else n}"


class Probe(Record):
    target: str
    want: str  # "open" or "blocked"
    outcome: str  # "connected", "refused", "timeout", ...
    ms: float
    FIELDS = ("target", "want", "outcome", "ms")

    @property
    def ok(self) -> bool:
        return self.outcome == "connected" if self.want == "open" else (
            self.outcome in BLOCKED_ERRNOS.values())

    def to_dict(self) -> dict:
        return {"target": self.target, "want": self.want, "outcome": self.outcome,
                "ms": round(self.ms, 2), "ok": self.ok}


def parse_target(text: str) -> tuple[str, int]:
    """`HOST:PORT` or `[V6]:PORT`; HOST must be an IP literal (name lookups are blocked too)."""
    s = text.strip()
    if s.startswith("["):
        host, _, rest = s[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port = s.rpartition(":")
    try:
        ipaddress.ip_address(host)
        p = int(port)
        if not 1 <= p <= 65535:
            raise ValueError
    except ValueError:
        raise ConfigError(f"--verify-blocked {text!r}: expected IP:PORT or [IPv6]:PORT") from None
    return host, p


def _fmt(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def connect_probe(host: str, port: int, timeout: float, want: str = "blocked") -> Probe:
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    t0 = time.perf_counter()
    s = socket.socket(fam, socket.SOCK_STREAM)
    try:
        s.settimeout(timeout)
        s.connect((host, port))
        outcome = "connected"
    except TimeoutError:
        outcome = "timeout"
    except OSError as e:
        outcome = BLOCKED_ERRNOS.get(e.errno, _error(e.errno)) if e.errno else _error(e.errno)
    finally:
        s.close()
    return Probe(_fmt(host, port), want, outcome, (time.perf_counter() - t0) * 1000)


def loopback_probe(host: str, timeout: float) -> Probe:
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    t0 = time.perf_counter()
    srv = socket.socket(fam, socket.SOCK_STREAM)
    try:
        srv.bind((host, 0))
        srv.listen(1)
        port = srv.getsockname()[1]
        probe = connect_probe(host, port, timeout, want="open")
    except OSError as e:
        probe = Probe(_fmt(host, 0), "open", _error(e.errno), 0)
    finally:
        srv.close()
    probe.target = f"loopback {probe.target}"
    probe.ms = (time.perf_counter() - t0) * 1000
    return probe


MAX_NEVER_PROBES = 16  # each answers at once when the carve-out is there


def never_targets(config, families: tuple[str, ...]) -> list[tuple[str, int]]:
    """One TCP target in each never range carved out of a tcp allow entry, on that entry's
    port: without the carve-out the allow rule would accept it and the connect would leave
    (and time out or connect), so the probe fails. Ranges a TCP connect cannot show are
    skipped: the unspecified address (the kernel sends it to the pod itself) and IPv4-mapped
    IPv6 (sent as IPv4, past the ip6tables rule)."""
    out: list[tuple[str, int]] = []
    for family in families:
        for net in config.carve_outs(family):
            addr = net.network_address
            if addr.is_unspecified or (net.version == 6 and addr.ipv4_mapped is not None):
                continue
            host = addr + 1 if net.num_addresses > 2 else addr
            port = next((a.port or METADATA_PORT for a in config.allow_egress
                         if a.proto in (None, "tcp") and a.network.version == net.version
                         and net.subnet_of(a.network)
                         and net != a.network), None)
            if port is not None and len(out) < MAX_NEVER_PROBES:
                out.append((str(host), port))
    return out


def run(families: tuple[str, ...], blocked: list[tuple[str, int]], timeout: float,
        ipv6_loopback: bool, never: Sequence[tuple[str, int]] = ()) -> list[Probe]:
    probes = [loopback_probe("127.0.0.1", timeout)]
    if IPV6 in families and ipv6_loopback:
        probes.append(loopback_probe("::1", timeout))
    for family in families:
        md = str(ipaddress.ip_network(METADATA[family]).network_address)
        p = connect_probe(md, METADATA_PORT, timeout)
        p.target = f"metadata {p.target}"
        probes.append(p)
    for host, port in blocked:
        if (IPV4 if ":" not in host else IPV6) in families:
            probes.append(connect_probe(host, port, timeout))
        else:
            probes.append(Probe(_fmt(host, port), "blocked", "family not guarded", 0))
    for host, port in never:
        p = connect_probe(host, port, timeout)
        p.target = f"never {p.target}"
        probes.append(p)
    return probes
