"""netguard's options: what the ruleset is a pure function of.

Everything here is parsed and normalised once (CIDRs to their network address, families split)
so that `render` is byte-for-byte reproducible and its SHA-256 names the ruleset.
"""

from __future__ import annotations

import ipaddress
import re

from netguard.values import Frozen
from sandman.contract import EXECD_PORT

IPV4 = "ipv4"
IPV6 = "ipv6"
FAMILIES = (IPV4, IPV6)

EGRESS_MODES = ("deny", "allow")

# Instance-metadata endpoints (AWS, GCP, Azure, OpenStack share the v4 one; AWS Nitro has the v6
# one). The seed paper's unguarded pods fetched node credentials here: blocked in every mode.
METADATA = {IPV4: "169.254.169.254/32", IPV6: "fd00:ec2::254/128"}

_PORT_PROTO = re.compile(r"^(?P<port>\d{1,5})(?:/(?P<proto>tcp|udp))?$")


class ConfigError(ValueError):
    """A bad option value; reported in one line, exit non-zero."""


def family_of(net: ipaddress.IPv4Network | ipaddress.IPv6Network) -> str:
    return IPV4 if net.version == 4 else IPV6


def parse_network(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    try:
        # strict=False: 10.1.2.3/16 means 10.1.0.0/16, which is what iptables-save prints back.
        return ipaddress.ip_network(text.strip(), strict=False)
    except ValueError as e:
        raise ConfigError(f"not a CIDR or address: {text!r} ({e})") from None


class EgressAllow(Frozen):
    """One `--allow-egress CIDR[:PORT[/tcp|udp]]` entry."""

    network: ipaddress.IPv4Network | ipaddress.IPv6Network
    port: int | None
    proto: str | None  # None with a port: both tcp and udp (DNS needs both)
    FIELDS = ("network", "port", "proto")
    DEFAULTS = {"port": None, "proto": None}

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
        m = _PORT_PROTO.match(port_part)
        if not m or not 1 <= int(m["port"]) <= 65535:
            raise ConfigError(f"--allow-egress {text!r}: port must be 1-65535, optionally /tcp|/udp")
        return cls(network, int(m["port"]), m["proto"])


class Config(Frozen):
    """The ruleset's inputs. `render(Config)` is deterministic."""

    egress: str
    allow_egress: tuple[EgressAllow, ...]
    ingress_port: int
    ingress_from: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]
    # --ingress-from-gateway: admit the pod's default gateway(s), resolved at apply time in
    # the pod's netns (netinfo.read) and then held here as /32 (/128) networks, so the ruleset
    # stays a pure function of the Config and the status file records what was admitted.
    ingress_from_gateway: bool
    ingress_gateways: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]
    lockdown: bool  # rendered after a failed apply; not compared
    FIELDS = ("egress", "allow_egress", "ingress_port", "ingress_from", "ingress_from_gateway",
              "ingress_gateways", "lockdown")
    DEFAULTS = {"egress": "deny", "allow_egress": (), "ingress_port": EXECD_PORT,
                "ingress_from": (), "ingress_from_gateway": False, "ingress_gateways": (),
                "lockdown": False}
    UNCOMPARED = ("lockdown",)

    def __post_init__(self) -> None:
        if self.egress not in EGRESS_MODES:
            raise ConfigError(f"--egress must be one of {EGRESS_MODES}, not {self.egress!r}")
        if not 1 <= self.ingress_port <= 65535:
            raise ConfigError(f"--ingress-port must be 1-65535, not {self.ingress_port}")
        if self.egress == "allow" and self.allow_egress:
            raise ConfigError("--allow-egress only makes sense with --egress deny")
        if self.ingress_gateways and not self.ingress_from_gateway:
            raise ConfigError("gateway addresses without --ingress-from-gateway")
        for gw in self.ingress_gateways:
            if gw.prefixlen != gw.max_prefixlen:
                raise ConfigError(f"a gateway is one address, not {gw}")

    @classmethod
    def from_strings(
        cls,
        egress: str | None = None,
        allow_egress: list[str] | None = None,
        ingress_port: int | None = None,
        ingress_from: list[str] | None = None,
        ingress_from_gateway: bool | None = None,
        ingress_gateways: list[str] | None = None,
    ) -> Config:
        """Build from CLI-style strings; list items may also be comma-separated."""
        return cls(
            egress=egress or "deny",
            allow_egress=tuple(EgressAllow.parse(x) for x in _split(allow_egress)),
            ingress_port=EXECD_PORT if ingress_port is None else int(ingress_port),
            ingress_from=tuple(parse_network(x) for x in _split(ingress_from)),
            ingress_from_gateway=bool(ingress_from_gateway),
            ingress_gateways=tuple(parse_network(x) for x in _split(ingress_gateways)),
        )

    def to_dict(self) -> dict:
        """The options as strings, stored in the status file so `check` can re-render."""
        return {
            "egress": self.egress,
            "allow_egress": [str(a) for a in self.allow_egress],
            "ingress_port": self.ingress_port,
            "ingress_from": [str(n) for n in self.ingress_from],
            "ingress_from_gateway": self.ingress_from_gateway,
            "ingress_gateways": [str(n) for n in self.ingress_gateways],
        }

    @classmethod
    def from_dict(cls, d: dict) -> Config:
        return cls.from_strings(
            d.get("egress"), d.get("allow_egress"), d.get("ingress_port"), d.get("ingress_from"),
            d.get("ingress_from_gateway"), d.get("ingress_gateways"),
        )

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


def _split(items: list[str] | None) -> list[str]:
    out: list[str] = []
    for item in items or ():
        out.extend(p for p in (x.strip() for x in item.split(",")) if p)
    return out
