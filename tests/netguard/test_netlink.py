"""netguard.netlink (the stdlib rtnetlink reader) against `ip -j` in a namespace this test made:
a veth with IPv4 and IPv6 addresses, a default route per family and a multipath one."""

from __future__ import annotations

import json
import socket

import pytest

from netguard import netinfo, netlink
from tests.netguard import nslab

pytestmark = [pytest.mark.netns, pytest.mark.timeout(120)]


@pytest.fixture
def lab(tmp_path):
    missing = nslab.missing_prerequisites()
    if missing:
        pytest.fail(f"needs {', '.join(missing)} and root", pytrace=False)
    lab = nslab.Lab.create(tmp_path)
    try:
        yield lab
    finally:
        lab.destroy()


def ip_json(ns: str, *args: str):
    return json.loads(nslab.sh("ip", "-n", ns, "-j", *args).stdout)


def test_links_and_addresses_match_ip_addr(lab):
    with nslab.inside(lab.pod):
        reader = netlink.Reader()
    with reader:
        links = {(link.index, link.name) for link in reader.links()}
        addrs = {(a.index, socket.AF_INET6 if a.family == socket.AF_INET6 else socket.AF_INET,
                  a.address, a.prefixlen, a.scope) for a in reader.addrs()}
    want_links, want_addrs = set(), set()
    scopes = {"global": 0, "link": 253, "host": 254}
    for link in ip_json(lab.pod, "addr"):
        want_links.add((link["ifindex"], link["ifname"]))
        for a in link["addr_info"]:
            fam = socket.AF_INET6 if a["family"] == "inet6" else socket.AF_INET
            want_addrs.add((link["ifindex"], fam, a["local"], a["prefixlen"], scopes[a["scope"]]))
    assert links == want_links
    assert addrs == want_addrs
    # The lab's own addresses are there, both families, so the comparison is not vacuous.
    assert {"10.251.1.1", "fd00:5a:1::1", "127.0.0.1", "::1"} <= {a[2] for a in addrs}


def test_default_gateways_match_ip_route(lab):
    lab.ip(lab.pod, "route", "add", "default", "via", "10.251.1.2")
    lab.ip(lab.pod, "-6", "route", "add", "default", "nexthop", "via", "fd00:5a:1::2",
           "nexthop", "via", "fd00:5a:2::2")
    want = []
    for fam in ("-4", "-6"):
        for r in ip_json(lab.pod, fam, "route", "show", "default"):
            hops = [r["gateway"]] if "gateway" in r else []
            hops += [h["gateway"] for h in r.get("nexthops", [])]
            want += [h for h in hops if h not in want]
    with nslab.inside(lab.pod):
        reader = netlink.Reader()
    with reader:
        got = netinfo.default_gateways(reader)
    assert got == want == ["10.251.1.2", "fd00:5a:1::2", "fd00:5a:2::2"]
