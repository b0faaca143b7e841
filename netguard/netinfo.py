"""What the pod's network namespace holds: its addresses, and so which families need rules."""

from __future__ import annotations

# The C module the `socket` module wraps: the wrapper imports enum and selectors, CPU on
# every guarded pod's start (see values.py); the calls here are the same.
import _socket as socket

from netguard import netlink
from netguard.config import IPV4, IPV6
from netguard.values import Record

_DISABLE_IPV6 = "/proc/sys/net/ipv6/conf/all/disable_ipv6"


class NetInfo(Record):
    families: tuple[str, ...]  # the families that get a ruleset; always ipv4
    pod_ips: list[str]  # global addresses on non-loopback links
    ipv6_enabled: bool
    has_ipv6_loopback: bool
    gateways: list[str]  # default routes' next hops, v4 first
    FIELDS = ("families", "pod_ips", "ipv6_enabled", "has_ipv6_loopback", "gateways")
    DEFAULTS = {"ipv6_enabled": False, "has_ipv6_loopback": False}
    FACTORIES = {"pod_ips": list, "gateways": list}


def ipv6_enabled() -> bool:
    """IPv6 is enabled when the kernel has it and this netns has not switched it off."""
    try:
        with open(_DISABLE_IPV6) as f:
            return f.read().strip() == "0"
    except OSError:
        return False  # no IPv6 in this kernel at all


def read() -> NetInfo:
    """Read links, addresses and default routes over netlink (netguard.netlink, stdlib).

    IPv4 always gets a ruleset. IPv6 gets one when any IPv6 address exists or IPv6 is enabled
    (an address can appear later, e.g. from a router advertisement): a family left unguarded is
    an open door, so doubt resolves to guarding it.
    """
    pod_ips: list[str] = []
    any_v6 = False
    v6_loopback = False
    with netlink.Reader() as nl:
        names = {link.index: link.name for link in nl.links()}
        for a in nl.addrs():
            if a.family == socket.AF_INET6:
                any_v6 = True
                v6_loopback = v6_loopback or a.address == "::1"
            if names.get(a.index) != "lo" and a.scope == 0:  # global scope
                pod_ips.append(a.address)
        gateways = default_gateways(nl)
    enabled = ipv6_enabled()
    families = (IPV4, IPV6) if (any_v6 or enabled) else (IPV4,)
    # IPv4 first: the pod IP most callers use.
    pod_ips.sort(key=lambda ip: ":" in ip)
    return NetInfo(families, pod_ips, enabled, v6_loopback, gateways)


def gateways() -> list[str]:
    """`default_gateways` of this netns, on its own (render and check)."""
    with netlink.Reader() as nl:
        return default_gateways(nl)


_MAIN_TABLE = 254
_RTN_UNICAST = 1


def default_gateways(nl: netlink.Reader) -> list[str]:
    """The next hops of the main table's default routes (IPv4, then IPv6; multipath next hops
    included), as the pod's own netns holds them. On a bridge CNI this is the bridge's address
    on the node, where the kubelet's probes come from. None found (a pod without a default
    route) is not an error: nothing more is admitted."""
    out: list[str] = []
    for fam in (socket.AF_INET, socket.AF_INET6):
        try:
            routes = nl.routes(fam)
        except OSError:  # e.g. no IPv6 in this kernel: no v6 gateway
            if fam == socket.AF_INET:
                raise
            continue
        for r in routes:
            if r.dst_len != 0 or r.table != _MAIN_TABLE or r.type != _RTN_UNICAST:
                continue
            out += [h for h in r.gateways if h not in out]
    return out
