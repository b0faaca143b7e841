"""sandman/egress.py: the allowlist grammar every enforcer shares, attacked as a tenant would
(spellings that other parsers read differently, widened or hidden ranges, oversize lists)."""

from __future__ import annotations

import ipaddress
import subprocess
import sys
from pathlib import Path

import pytest

from sandman import egress
from sandman.egress import Ceiling, parse, parse_list, refusals, render

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("text,canonical", [
    ("10.1.2.0/24:443", "10.1.2.0/24:443/tcp"),
    ("10.1.2.3:443", "10.1.2.3/32:443/tcp"),
    ("10.1.2.3/32:53/udp", "10.1.2.3/32:53/udp"),
    ("0.0.0.0/0:443/tcp", "0.0.0.0/0:443/tcp"),
    ("[fd00:1::/64]:443", "[fd00:1::/64]:443/tcp"),
    ("[FD00:0001:0000::0001]:80", "[fd00:1::1/128]:80/tcp"),
    ("svc/pypi-mirror.infra:3141", "svc/pypi-mirror.infra:3141/tcp"),
    ("svc/dns.kube-system:53/udp", "svc/dns.kube-system:53/udp"),
    ("10.0.0.0/8:65535", "10.0.0.0/8:65535/tcp"),
])
def test_entries_parse_to_one_canonical_spelling(text, canonical):
    entry = parse(text)
    assert entry.text == canonical
    assert parse(canonical) == entry


@pytest.mark.parametrize("text,why", [
    ("", "empty"),
    ("10.0.0.0/8", "a port is required"),
    ("10.0.0.0/8:", "port must be"),
    ("10.0.0.0/8:0", "port must be"),
    ("10.0.0.0/8:65536", "port must be"),
    ("10.0.0.0/8:0443", "port must be"),  # another parser may read octal
    ("10.0.0.0/8:+443", "port must be"),
    ("10.0.0.0/8:4_43", "port must be"),
    ("10.0.0.0/8:\u0664\u0664\u0663", "port must be"),  # Arabic-Indic digits: int() reads 443
    ("10.0.0.0/8:*", "port must be"),  # a wildcard only in the ceiling
    ("10.0.0.0/8:1-65535", "port must be"),  # never a range
    ("10.0.0.0/8:80,443", "port must be"),
    ("10.0.0.0/8:443/TCP", "protocol"),
    ("10.0.0.0/8:443/sctp", "protocol"),
    ("10.0.0.0/8:443/", "protocol"),
    ("10.1.2.3/8:443", "host bits"),
    ("[fd00::1/64]:443", "host bits"),
    ("010.0.0.0/8:443", "leading zeros"),  # octal to inet_aton
    ("10.0.0.0/08:443", "not an IPv4"),
    ("10.0.0.0/33:443", "not a valid IPv4"),
    ("10.0.0.0/255.0.0.0:443", "no netmasks"),
    ("10.0.0.0/0.255.255.255:443", "no netmasks"),
    ("10.0.0.1-10.0.0.9:443", "not an IPv4"),  # never ranges of addresses
    ("10.0.0:443", "not an IPv4"),
    ("167772160:443", "not an IPv4"),  # inet_aton's integer form
    ("0x0a000000:443", "not an IPv4"),
    ("fd00::1:443", "in brackets"),
    ("fd00::/64:443", "in brackets"),
    ("[fd00::1]", "expected [IPv6]:PORT"),
    ("[fd00::1:443", "missing ']'"),
    ("[fe80::1%eth0]:443", "not an IPv6"),  # a zone picks the interface
    ("[::ffff:169.254.169.254]:80", "not an IPv6"),  # dotted tail
    ("[10.0.0.1]:443", "not an IPv6"),
    ("[::ffff:a9fe:a9fe]:80", "IPv4-mapped"),  # the metadata address, in IPv6 clothes
    ("[::ffff:0:0/96]:80", "IPv4-mapped"),
    ("[::ffff:a00:0/104]:443", "IPv4-mapped"),
    ("[fd00::/129]:443", "not a valid IPv6"),
    ("10.0.0.0/8 :443", "whitespace"),
    (" 10.0.0.0/8:443", "whitespace"),
    ("10.0.0.0/8:443\n", "whitespace"),
    ("10.0.0.0/8:443\t", "whitespace"),
    ("http://10.0.0.1:80", "unknown form"),
    ("tcp/10.0.0.1:80", "unknown form"),
    ("cidr/10.0.0.0/8:80", "unknown form"),
    ("example.com:443", "unknown form"),
    ("svc/pypi:3141", "svc/NAME.NAMESPACE"),
    ("svc/pypi.infra", "a port is required"),
    ("svc/pypi.infra.svc:3141", "not a namespace"),  # dotted: one name, one namespace
    ("svc/a.b.c:80", "not a namespace"),
    ("svc/pypi.infra.svc.cluster.local:3141", "not a namespace"),
    ("svc/1pypi.infra:3141", "not a Service name"),  # DNS-1035: starts with a letter
    ("svc/Pypi.infra:3141", "not a Service name"),
    ("svc/pypi-.infra:3141", "not a Service name"),
    ("svc/" + "a" * 64 + ".infra:80", "not a Service name"),
    ("svc/pypi.-infra:80", "not a namespace"),
    ("svc/*.infra:80", "not a Service name"),  # a wildcard only in the ceiling
    ("svc/pypi.*:80", "not a namespace"),
    ("svc/.infra:80", "not a Service name"),
    ("svc/pypi.infra:*", "port must be"),
    ("SVC/pypi.infra:80", "unknown form"),
    ("10.0.0.0/8:443" + "0" * 300, "longer than"),
])
def test_bad_entries_are_refused_in_one_line_that_quotes_them(text, why):
    with pytest.raises(ValueError) as e:
        parse(text)
    msg = str(e.value)
    assert why in msg
    assert "\n" not in msg
    assert msg.startswith("egress entry '") or msg.startswith('egress entry "')
    assert len(msg) < 300  # an oversize entry is quoted cut short


def test_non_strings_are_refused():
    for bad in (None, 443, b"10.0.0.0/8:443", ["10.0.0.0/8:443"]):
        with pytest.raises(ValueError, match="not a string"):
            parse(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a string"):
        parse_list(["10.0.0.0/8:443", 443])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="a list"):
        parse_list({"10.0.0.0/8:443": 1})  # type: ignore[arg-type]


def test_a_list_is_sorted_deduplicated_and_round_trips():
    entries = parse_list(["svc/b.ns:80", "10.0.0.1:80", "[fd00::/8]:53/udp", "10.0.0.1/32:80/tcp",
                          "9.0.0.0/8:80", "svc/a.ns:80", "10.0.0.1:80/udp"])
    text = render(entries)
    assert text == ("9.0.0.0/8:80/tcp,10.0.0.1/32:80/tcp,10.0.0.1/32:80/udp,[fd00::/8]:53/udp,"
                    "svc/a.ns:80/tcp,svc/b.ns:80/tcp")
    assert parse_list(text) == entries
    assert egress.is_canonical(text)
    # The same list in another order or spelling renders the same: a warm-pool key.
    assert render(parse_list(list(reversed(text.split(","))))) == text
    assert not egress.is_canonical("10.0.0.1:80")
    assert not egress.is_canonical("svc/b.ns:80/tcp,svc/a.ns:80/tcp")
    assert not egress.is_canonical("")
    assert not egress.is_canonical("10.0.0.1/32:80/tcp,10.0.0.1/32:80/tcp")


def test_empty_entries_in_a_list_are_refused():
    assert parse_list("") == ()
    assert parse_list([]) == ()
    for bad in ("10.0.0.0/8:443,", ",10.0.0.0/8:443", "10.0.0.0/8:443,,9.0.0.0/8:1"):
        with pytest.raises(ValueError, match="empty"):
            parse_list(bad)


def test_size_caps():
    many = [f"10.0.{i}.0/24:443" for i in range(egress.MAX_ENTRIES)]
    assert len(parse_list(many)) == egress.MAX_ENTRIES
    with pytest.raises(ValueError, match=f"at most {egress.MAX_ENTRIES}"):
        parse_list(many + ["10.1.0.0/24:443"])
    # Duplicates count before they are merged: the cap bounds the work, not the result.
    with pytest.raises(ValueError, match="entries"):
        parse_list(["10.0.0.0/8:443"] * (egress.MAX_ENTRIES + 1))
    # Within the count, long svc entries overflow the annotation's size.
    long = [f"svc/{'s' * 50}{i:02d}.{'n' * 60}:65535/udp" for i in range(egress.MAX_ENTRIES)]
    with pytest.raises(ValueError, match=f"longer than {egress.MAX_ANNOTATION_CHARS}"):
        parse_list(long)
    with pytest.raises(ValueError, match=f"longer than {egress.MAX_ANNOTATION_CHARS}"):
        parse_list("x" * (egress.MAX_ANNOTATION_CHARS + 1))
    with pytest.raises(ValueError, match="at most"):
        Ceiling.parse(["10.0.0.0/8:*"] * (egress.MAX_CEILING_ENTRIES + 1))
    with pytest.raises(ValueError, match="at most"):
        egress.parse_never(["10.0.0.0/8"] * (egress.MAX_NEVER + 1))


CEILING = Ceiling.parse(["10.0.0.0/8:*", "192.168.1.0/24:443", "[fd00::/8]:443",
                         "svc/*.infra:*", "svc/dns.kube-system:53/udp", "172.16.0.0/12:53/udp"])


@pytest.mark.parametrize("text,admitted", [
    ("10.0.0.0/8:22", True),
    ("10.9.9.9:80", True),
    ("192.168.1.0/24:443", True),
    ("192.168.1.128/25:443", True),
    ("192.168.1.0/24:80", False),  # another port
    ("192.168.1.0/24:443/udp", False),  # another protocol
    ("192.168.0.0/16:443", False),  # widened beyond the ceiling's CIDR
    ("0.0.0.0/0:443", False),
    ("11.0.0.0/8:443", False),
    ("172.16.0.0/12:53/udp", True),
    ("172.16.0.0/12:53", False),  # tcp when the ceiling says udp
    ("[fd00:1::/64]:443", True),
    ("[fc00::/7]:443", False),
    ("[fc00::1]:443", False),
    ("svc/pypi.infra:3141", True),
    ("svc/pypi.infra:3141/udp", False),  # `*` is any port, not any protocol
    ("svc/pypi.other:3141", False),  # outside the ceiling's namespace
    ("svc/dns.kube-system:53/udp", True),
    ("svc/kube-dns.kube-system:53/udp", False),
    ("svc/dns.kube-system:54/udp", False),
])
def test_the_ceiling_admits_only_what_it_covers(text, admitted):
    entry = parse(text)
    assert CEILING.admits(entry) is admitted
    assert (refusals([entry], CEILING) == []) is admitted


def test_a_ceiling_does_not_cross_families_or_kinds():
    # ::ffff:10.0.0.0/104 is not 10.0.0.0/8, and a CIDR never stands in for a svc.
    assert not Ceiling.parse(["[::/0]:*"]).admits(parse("10.0.0.1:80"))
    assert not Ceiling.parse(["0.0.0.0/0:*"]).admits(parse("[fd00::1]:80"))
    assert not Ceiling.parse(["0.0.0.0/0:*"]).admits(parse("svc/a.b:80"))
    assert not Ceiling.parse(["svc/*.b:*"]).admits(parse("10.0.0.1:80"))


def test_ceiling_wildcards_stay_in_the_ceiling():
    c = Ceiling.parse("10.0.0.0/8:*, svc/*.infra:*/udp")
    assert [e.text for e in c.entries] == ["10.0.0.0/8:*/tcp", "svc/*.infra:*/udp"]
    with pytest.raises(ValueError, match="not a Service name"):
        Ceiling.parse(["svc/pypi*.infra:80"])
    with pytest.raises(ValueError, match="not a namespace"):
        Ceiling.parse(["svc/*.*:80"])
    with pytest.raises(ValueError, match="port must be"):
        Ceiling.parse(["10.0.0.0/8:1-1024"])


def test_an_empty_ceiling_refuses_any_allowlist_in_one_line():
    entries = parse_list(["10.0.0.0/8:443", "svc/a.b:80"])
    out = refusals(entries, Ceiling())
    assert len(out) == 1 and "sandbox.egressCeiling is empty" in out[0]
    assert "'10.0.0.0/8:443/tcp'" in out[0]
    assert refusals((), Ceiling()) == []
    assert not Ceiling.parse([])


@pytest.mark.parametrize("text,reason", [
    ("169.254.169.254:80", "link-local/metadata"),
    ("169.254.0.0/16:80", "link-local/metadata"),
    ("169.254.170.2:80", "link-local/metadata"),  # ECS task credentials
    ("[fe80::1]:80", "link-local"),
    ("[fd00:ec2::254]:80", "metadata"),
    ("100.100.100.200:80", "metadata"),
    ("0.0.0.0:80", "unspecified"),  # connect(0.0.0.0) reaches the pod itself
    ("[::]:80", "unspecified"),
    ("[64:ff9b::a9fe:a9fe]:80", "through NAT64"),
    ("[64:ff9b::a9fe:0/112]:80", "through NAT64"),
    # The metadata address through a local-use NAT64 prefix (/96 or /48 embedding) and 6to4.
    ("[64:ff9b:1::a9fe:a9fe]:80", "local-use NAT64"),
    ("[64:ff9b:1:a9fe:a9:fe00::]:80", "local-use NAT64"),
    ("[2002:a9fe:a9fe::1]:80", "6to4"),
    ("[2002:a9fe:a9fe::/48]:80", "6to4"),
])
def test_never_ranges_are_refused_even_inside_the_ceiling(text, reason):
    ceiling = Ceiling.parse(["0.0.0.0/0:*", "[::/0]:*"])
    (msg,) = refusals([parse(text)], ceiling)
    assert msg.startswith(f"egress entry '{parse(text).text}' is never allowed (")
    assert reason in msg


def test_callers_never_ranges_refuse_containment_and_carve_out_overlap():
    ceiling = Ceiling.parse(["10.0.0.0/8:*"])
    never = egress.parse_never(["10.96.0.1", "10.100.0.0/16"])
    wide = parse("10.0.0.0/8:443")
    assert refusals([wide], ceiling, never) == []
    assert egress.carve_outs(wide, never) == (ipaddress.ip_network("10.96.0.1/32"),
                                              ipaddress.ip_network("10.100.0.0/16"))
    for inside in ("10.96.0.1:443", "10.100.3.0/24:443", "10.100.0.0/16:443"):
        (msg,) = refusals([parse(inside)], ceiling, never)
        assert "never allowed (the API server or sandbox.egressNever)" in msg
    assert egress.carve_outs(parse("10.1.0.0/16:443"), never) == ()
    assert egress.carve_outs(parse("svc/a.b:80"), never) == ()
    # The built-in ranges are carved out of a wide entry too, the NAT64 images of IPv6 ones.
    assert ipaddress.ip_network("169.254.0.0/16") in egress.carve_outs(parse("0.0.0.0/0:443"))
    v6 = egress.carve_outs(parse("[::/0]:443"), never)
    assert ipaddress.ip_network("64:ff9b::a60:1/128") in v6  # 10.96.0.1 through NAT64
    assert ipaddress.ip_network("fd00:ec2::254/128") in v6
    assert ipaddress.ip_network("64:ff9b:1::/48") in v6
    assert ipaddress.ip_network("2002::/16") in v6


def test_resolved_addresses_are_checked_against_the_never_ranges():
    never = egress.parse_never("10.96.0.1")
    assert egress.address_refusal("10.96.0.2", never) is None
    assert "API server" in (egress.address_refusal("10.96.0.1", never) or "")
    assert "link-local" in (egress.address_refusal("169.254.169.254") or "")
    assert "metadata" in (egress.address_refusal("fd00:ec2::254") or "")


@pytest.mark.parametrize("bad", ["10.0.0.1/8", "010.0.0.1", "10.0.0.0/255.0.0.0", "x",
                                 "fe80::1%eth0", "10.0.0.0/8:443"])
def test_bad_never_ranges_are_refused(bad):
    with pytest.raises(ValueError, match="egress never range"):
        egress.parse_never([bad])


def test_the_module_needs_nothing_beyond_the_standard_library():
    """The client distribution ships it: it imports with site-packages off the path."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from sandman import egress as e; "
            "print(e.render(e.parse_list('svc/a.b:1,[::1]:2,10.0.0.0/8:3')))")
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code, str(REPO)], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    assert out.strip() == "10.0.0.0/8:3/tcp,[::1/128]:2/tcp,svc/a.b:1/tcp"
