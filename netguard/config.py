"""netguard's options: what the ruleset is a pure function of.

Everything here is parsed and normalised once (CIDRs to their network address, families split)
so that `render` is byte-for-byte reproducible and its SHA-256 names the ruleset.
"""

from __future__ import annotations

import ipaddress

from netguard.values import Frozen
from sandman.contract import EXECD_PORT, KUBERNETES_SERVICE_HOST_ENV

TYPE_CHECKING = False  # typing's import is CPU on the guard's hot path
if TYPE_CHECKING:
    from typing import Any

IPV4 = "ipv4"
IPV6 = "ipv6"
FAMILIES = (IPV4, IPV6)

EGRESS_MODES = ("deny", "allow")

# Instance-metadata endpoints (AWS, GCP, Azure, OpenStack share the v4 one; AWS Nitro has the v6
# one). The seed paper's unguarded pods fetched node credentials here: blocked in every mode.
METADATA = {IPV4: "169.254.169.254/32", IPV6: "fd00:ec2::254/128"}


class ConfigError(ValueError):
    """A bad option value; reported in one line, exit non-zero."""


def family_of(net: ipaddress.IPv4Network | ipaddress.IPv6Network) -> str:
    return IPV4 if net.version == 4 else IPV6


def parse_network(text: str, option: str = "") -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    try:
        # strict=False: 10.1.2.3/16 means 10.1.0.0/16, which is what iptables-save prints back.
        return ipaddress.ip_network(text.strip(), strict=False)
    except ValueError as e:
        where = f"{option} " if option else ""
        raise ConfigError(f"{where}not a CIDR or address: {text!r} ({e})") from None


class EgressAllow(Frozen):
    """One `--allow-egress CIDR[:PORT[/tcp|udp]]` entry, or one address a
    `svc/NAME.NAMESPACE:PORT/PROTO` entry (`via`) resolved to."""

    network: ipaddress.IPv4Network | ipaddress.IPv6Network
    port: int | None
    proto: str | None  # None with a port: both tcp and udp (DNS needs both)
    via: str | None  # the Service entry this address was resolved from
    FIELDS = ("network", "port", "proto", "via")
    DEFAULTS = {"port": None, "proto": None, "via": None}

    @property
    def family(self) -> str:
        return family_of(self.network)

    def __str__(self) -> str:
        net = str(self.network)
        if self.port is None:
            return net
        host = f"[{net}]" if self.network.version == 6 else net
        return f"{host}:{self.port}" + (f"/{self.proto}" if self.proto else "")

    @classmethod
    def parse(cls, text: str) -> EgressAllow:
        """`10.0.0.10:53`, `10.0.0.0/8`, `10.0.0.10/32:53/udp`, `[fd00::/64]:53/tcp`, `fd00::/64`."""
        s = text.strip()
        if s.startswith("["):
            host, sep, rest = s[1:].partition("]")
            if not sep:
                raise ConfigError(f"--allow-egress {text!r}: missing ']'")
            if rest and not rest.startswith(":"):
                raise ConfigError(f"--allow-egress {text!r}: expected ':PORT' after ']'")
            port_part = rest[1:] if rest else None
        elif s.count(":") == 1:  # IPv4 with a port
            host, port_part = s.split(":")
        else:  # IPv4 without a port, or bare IPv6 (write [v6]:port for a port)
            host, port_part = s, None
        network = parse_network(host)
        if port_part is None:
            return cls(network)
        # By hand, not with `re`: netguard's start would pay its import (see values.py).
        port, slash, proto = port_part.partition("/")
        if (not (port.isascii() and port.isdigit() and len(port) <= 5
                 and 1 <= int(port) <= 65535) or (slash and proto not in ("tcp", "udp"))):
            raise ConfigError(f"--allow-egress {text!r}: port must be 1-65535, optionally /tcp|/udp")
        return cls(network, int(port), proto or None)


class Config(Frozen):
    """The ruleset's inputs. `render(Config)` is deterministic."""

    egress: str
    allow_egress: tuple[EgressAllow, ...]
    # `--allow-egress svc/NAME.NAMESPACE:PORT/PROTO` entries (sandman/egress.py's canonical
    # text), and the addresses they resolved to at apply time (resolve.py), held here like the
    # gateways so the ruleset stays a pure function of the Config.
    allow_services: tuple[str, ...]
    service_addresses: tuple[EgressAllow, ...]
    # Never reached even inside an allow entry: `--never-egress` (the admin's
    # sandbox.egressNever) and the API server (KUBERNETES_SERVICE_HOST), besides
    # sandman/egress.py's built-in NEVER.
    never_egress: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]
    api_server: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]
    ingress_port: int
    ingress_from: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]
    # --ingress-from-gateway: admit the pod's default gateway(s), resolved at apply time in
    # the pod's netns (netinfo.read) and then held here as /32 (/128) networks, so the ruleset
    # stays a pure function of the Config and the status file records what was admitted.
    ingress_from_gateway: bool
    ingress_gateways: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]
    lockdown: bool  # rendered after a failed apply; not compared
    FIELDS = ("egress", "allow_egress", "allow_services", "service_addresses", "never_egress",
              "api_server", "ingress_port", "ingress_from", "ingress_from_gateway",
              "ingress_gateways", "lockdown")
    DEFAULTS = {"egress": "deny", "allow_egress": (), "allow_services": (),
                "service_addresses": (), "never_egress": (), "api_server": (),
                "ingress_port": EXECD_PORT, "ingress_from": (), "ingress_from_gateway": False,
                "ingress_gateways": (), "lockdown": False}
    UNCOMPARED = ("lockdown",)

    def __post_init__(self) -> None:
        if self.egress not in EGRESS_MODES:
            raise ConfigError(f"--egress must be one of {EGRESS_MODES}, not {self.egress!r}")
        if not 1 <= self.ingress_port <= 65535:
            raise ConfigError(f"--ingress-port must be 1-65535, not {self.ingress_port}")
        if self.egress == "allow" and (self.allow_egress or self.allow_services):
            raise ConfigError("--allow-egress only makes sense with --egress deny")
        if self.egress == "allow" and self.never_egress:
            raise ConfigError("--never-egress only makes sense with --egress deny")
        if self.allow_egress or self.allow_services:
            self._check_never()
        if self.ingress_gateways and not self.ingress_from_gateway:
            raise ConfigError("gateway addresses without --ingress-from-gateway")
        for gw in self.ingress_gateways:
            if gw.prefixlen != gw.max_prefixlen:
                raise ConfigError(f"a gateway is one address, not {gw}")

    def _check_never(self) -> None:
        """Fail closed on an allow entry or a resolved address inside a never range (the
        webhook refuses such entries first; this holds for a hand-written guard too)."""
        from sandman import egress  # only with allow entries: off a plain guard's start

        if len(self.allow_services) > egress.MAX_ENTRIES:
            raise ConfigError(f"more than {egress.MAX_ENTRIES} svc/ entries in --allow-egress")
        never = egress.never_ranges(self.never_egress + self.api_server)
        for a in self.allow_egress:
            hit = next((n for n in never if n.version == a.network.version
                        and a.network.subnet_of(n)), None)  # type: ignore[arg-type]
            if hit is not None:
                raise ConfigError(f"--allow-egress {str(a)!r} lies inside never range {hit} "
                                  f"({_never_reason(hit, self)})")
        for a in self.service_addresses:
            if a.via not in self.allow_services:
                raise ConfigError(f"address {a.network} resolved for an unlisted entry {a.via!r}")
            if a.network.prefixlen != a.network.max_prefixlen:
                raise ConfigError(f"a resolved Service address is one address, not {a.network}")
            why = egress.address_refusal(str(a.network.network_address),
                                         self.never_egress + self.api_server)
            if why:
                raise ConfigError(f"--allow-egress {a.via!r} refused: {why}")

    def carve_outs(self, family: str) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network,
                                               ...]:
        """The never ranges strictly inside an allow entry of `family`: rejected before the
        allow rules (sandman/egress.py: a range inside an entry is carved out of it)."""
        if not self.allow_egress:
            return ()
        from sandman import egress

        version = 4 if family == IPV4 else 6
        never = [n for n in egress.never_ranges(self.never_egress + self.api_server)
                 if n.version == version]
        out = {n for a in self.allow_egress if a.network.version == version for n in never
               if n != a.network and n.subnet_of(a.network)}  # type: ignore[arg-type]
        return tuple(sorted(out, key=lambda n: (int(n.network_address), n.prefixlen)))

    @classmethod
    def from_strings(
        cls,
        egress: str | None = None,
        allow_egress: list[str] | None = None,
        ingress_port: int | None = None,
        ingress_from: list[str] | None = None,
        ingress_from_gateway: bool | None = None,
        ingress_gateways: list[str] | None = None,
        never_egress: list[str] | None = None,
        api_server: list[str] | None = None,
    ) -> Config:
        """Build from CLI-style strings; list items may also be comma-separated."""
        entries = _split(allow_egress)
        services = [x for x in entries if x.startswith(SVC_PREFIX)]
        return cls(
            egress=egress or "deny",
            allow_egress=tuple(EgressAllow.parse(x) for x in entries
                               if not x.startswith(SVC_PREFIX)),
            allow_services=_services(services),
            never_egress=tuple(parse_network(x, "--never-egress") for x in _split(never_egress)),
            api_server=tuple(_address(x) for x in _split(api_server)),
            ingress_port=EXECD_PORT if ingress_port is None else int(ingress_port),
            ingress_from=tuple(parse_network(x) for x in _split(ingress_from)),
            ingress_from_gateway=bool(ingress_from_gateway),
            ingress_gateways=tuple(parse_network(x) for x in _split(ingress_gateways)),
        )

    def to_dict(self) -> dict:
        """The options as strings, stored in the status file so `check` can re-render. The
        allowlist keys appear only when used: a guard without them records what it did before."""
        d: dict[str, Any] = {
            "egress": self.egress,
            "allow_egress": [str(a) for a in self.allow_egress],
            "ingress_port": self.ingress_port,
            "ingress_from": [str(n) for n in self.ingress_from],
            "ingress_from_gateway": self.ingress_from_gateway,
            "ingress_gateways": [str(n) for n in self.ingress_gateways],
        }
        if self.allow_services:
            d["allow_egress"] += list(self.allow_services)
            d["service_addresses"] = [[a.via, str(a.network)] for a in self.service_addresses]
        if self.never_egress:
            d["never_egress"] = [str(n) for n in self.never_egress]
        if self.api_server:
            d["api_server"] = [str(n.network_address) for n in self.api_server]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Config:
        config = cls.from_strings(
            d.get("egress"), d.get("allow_egress"), d.get("ingress_port"), d.get("ingress_from"),
            d.get("ingress_from_gateway"), d.get("ingress_gateways"), d.get("never_egress"),
            d.get("api_server"),
        )
        if d.get("service_addresses"):  # the recorded ones, not what the resolver says now
            config = config.with_services(_recorded(d["service_addresses"]))
        return config

    def with_services(self, resolved: dict[str, list[str]]) -> Config:
        """This Config with the addresses each svc/ entry resolved to (entry text -> IPs):
        one allow per address, sorted; an entry without addresses fails closed."""
        out: list[EgressAllow] = []
        for text in self.allow_services:
            addrs = resolved.get(text) or []
            if not addrs and resolved:
                raise ConfigError(f"--allow-egress {text!r}: the Service resolved to no address")
            port, proto = _svc_port(text)
            nets = sorted({parse_network(x) for x in addrs},
                          key=lambda n: (n.version, int(n.network_address)))
            out += [EgressAllow(n, port, proto, text) for n in nets]
        return self.replace(service_addresses=tuple(out))

    def with_gateways(self, gateways: list[str]) -> Config:
        """This Config with the gateways found in the pod's netns (only if the flag is set):
        each one address, deduplicated, in the order the routing table listed them."""
        if not self.ingress_from_gateway:
            return self
        nets: list = []
        for gw in gateways:
            net = parse_network(gw)
            net = ipaddress.ip_network(f"{net.network_address}/{net.max_prefixlen}")
            if net not in nets:
                nets.append(net)
        return self.replace(ingress_gateways=tuple(nets))

    def locked_down(self) -> Config:
        """The fail-closed ruleset: egress denied, no allow entries, no inbound sources."""
        return Config(egress="deny", ingress_port=self.ingress_port, lockdown=True)


SVC_PREFIX = "svc/"  # sandman/egress.py's, spelled here: no import for a plain guard


def _services(texts: list[str]) -> tuple[str, ...]:
    """svc/ entries in sandman/egress.py's canonical text, sorted and deduplicated."""
    if not texts:
        return ()
    from sandman import egress

    out = set()
    for text in texts:
        try:
            out.add(egress.parse(text).text)
        except ValueError as e:
            raise ConfigError(f"--allow-egress: {e}") from None
    return tuple(sorted(out))


def _svc_port(text: str) -> tuple[int, str]:
    port, _, proto = text.rpartition(":")[2].partition("/")
    return int(port), proto


def _address(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    net = parse_network(text, KUBERNETES_SERVICE_HOST_ENV)
    if net.prefixlen != net.max_prefixlen:
        raise ConfigError(f"{KUBERNETES_SERVICE_HOST_ENV} must be one address, not {text!r}")
    return net


def _recorded(pairs: list) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for via, addr in pairs:
        out.setdefault(via, []).append(addr)
    return out


def _never_reason(net, config: Config) -> str:
    from sandman import egress

    if net in config.api_server:
        return "the API server"
    if net in config.never_egress:
        return "--never-egress"
    return egress.never_reasons().get(net, "a never range, through NAT64")


def _split(items: list[str] | None) -> list[str]:
    out: list[str] = []
    for item in items or ():
        out.extend(p for p in (x.strip() for x in item.split(",")) if p)
    return out
