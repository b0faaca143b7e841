"""Golden files and unit tests of the ruleset (no kernel needed).

Golden files: `render` output for a table of option sets, compared byte for byte. After an
intended change, regenerate with `NETGUARD_UPDATE_GOLDEN=1 pytest tests/netguard` and review
the diff: it is exactly the change to what the kernel will hold.
"""

from __future__ import annotations

import contextlib
import io
import ipaddress
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from netguard.cli import main
from netguard.config import IPV4, IPV6, Config, ConfigError, EgressAllow
from netguard.rules import (
    CHAIN_IN,
    CHAIN_OUT,
    LiveFilter,
    canonical_spec,
    chain_rules,
    diff_live,
    jump_rule,
    render,
    ruleset_sha256,
    transaction,
)
from sandman.contract import EXECD_PORT

TESTDATA = Path(__file__).parent / "testdata"
ROOT = Path(__file__).resolve().parents[2]
UPDATE = os.environ.get("NETGUARD_UPDATE_GOLDEN") == "1"

@pytest.fixture(autouse=True)
def _no_api_server_env(monkeypatch):
    """netguard reads the API server from the kubelet's env for an allowlist: none here, so the
    golden files do not depend on where the tests run."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)


# name -> `render` arguments. One case per behaviour a reviewer should be able to read.
GOLDEN_CASES = {
    "deny-default": [],
    "deny-dns": ["--allow-egress", "10.96.0.10:53"],
    "deny-allow-list": ["--allow-egress", "10.0.0.0/8", "--allow-egress", "10.96.0.10:53/udp",
                        "--allow-egress", "[fd00:10::/64]:443/tcp,fd00:20::/64"],
    "deny-ingress": ["--ingress-from", "10.244.0.0/16,fd00:244::/64",
                     "--ingress-from", "10.245.1.7"],
    "deny-ingress-port": ["--ingress-port", "8080", "--ingress-from", "10.1.2.3/16"],
    "allow": ["--egress", "allow"],
    "allow-ingress": ["--egress", "allow", "--ingress-from", "10.244.0.0/16"],
    "ipv4-only": ["--family", "ipv4", "--allow-egress", "10.96.0.10:53"],
    # What the webhook injects by default (no annotation; node IP from the downward API).
    "default-install": ["--egress", "allow", "--ingress-port", "9470",
                        "--ingress-from", "0.0.0.0/0", "--ingress-from", "10.0.0.1"],
    # /0 entries render with no -s/-d at all, as iptables-save prints them back.
    "deny-wildcards": ["--ingress-from", "0.0.0.0/0,::/0", "--allow-egress", "0.0.0.0/0:53",
                       "--allow-egress", "[::/0]:443/tcp"],
}


def render_cli(args: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["render", *args]) == 0
    return out.getvalue()


def _golden(name: str, text: str) -> None:
    path = TESTDATA / f"{name}.golden"
    if UPDATE:
        path.write_text(text)
    assert path.exists(), f"{path} missing: run with NETGUARD_UPDATE_GOLDEN=1 to create it"
    assert text == path.read_text(), (
        f"render output differs from {path.name}; if intended, regenerate with "
        f"NETGUARD_UPDATE_GOLDEN=1 and review the diff")


@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_golden(name):
    _golden(name, render_cli(GOLDEN_CASES[name]))


def test_golden_lockdown():
    cfg = Config.from_strings(allow_egress=["10.96.0.10:53"], ingress_from=["10.244.0.0/16"])
    _golden("lockdown", render(cfg.locked_down()))


# What the webhook's default arguments become in a pod whose netns has default routes via
# 10.244.0.1 and fd00:244::1 (`--ingress-from-gateway` resolves them at apply time, so the CLI
# `render` would show this machine's gateway: the golden is rendered from the Config).
GATEWAY_CONFIG = Config.from_strings(
    "allow", None, 9470, ["10.32.0.0/12", "10.0.0.1"], True).with_gateways(
    ["10.244.0.1", "fd00:244::1", "10.244.0.1"])


def test_golden_gateway():
    assert [str(g) for g in GATEWAY_CONFIG.ingress_gateways] == ["10.244.0.1/32",
                                                                 "fd00:244::1/128"]
    _golden("ingress-from-gateway", render(GATEWAY_CONFIG))


def test_gateways_need_the_flag_and_are_single_addresses():
    assert Config().with_gateways(["10.244.0.1"]).ingress_gateways == ()  # flag not set
    with pytest.raises(ConfigError, match="without --ingress-from-gateway"):
        Config(ingress_gateways=(ipaddress.ip_network("10.244.0.1/32"),))
    with pytest.raises(ConfigError, match="one address"):
        Config(ingress_from_gateway=True, ingress_gateways=(ipaddress.ip_network("10.0.0.0/8"),))
    # Found or not, the flag is recorded, and the gateways round-trip through the status.
    assert Config.from_dict(GATEWAY_CONFIG.to_dict()) == GATEWAY_CONFIG
    none_found = Config.from_strings(ingress_from_gateway=True).with_gateways([])
    assert Config.from_dict(none_found.to_dict()) == none_found
    assert render(none_found) == render(Config())  # nothing found admits nothing more


# What the webhook renders for an allowlisted pod (canonical entries, the admin's never CIDRs),
# with the Service resolved and the API server read as apply finds them in the pod.
ALLOWLIST_CONFIG = Config.from_strings(
    "deny", ["10.0.0.0/8:443/tcp", "[fd00:10::/64]:443/tcp", "svc/pypi-mirror.infra:3141/tcp"],
    None, ["10.244.0.0/16"], None, None, ["10.100.0.0/16"], ["10.96.0.1"],
).with_services({"svc/pypi-mirror.infra:3141/tcp": ["10.96.7.7", "fd00:96::7"]})


def test_golden_allowlist():
    _golden("allowlist", render(ALLOWLIST_CONFIG))


def test_no_stray_golden_files():
    names = {p.stem for p in TESTDATA.glob("*.golden")}
    assert names == set(GOLDEN_CASES) | {"lockdown", "ingress-from-gateway", "allowlist"}


def test_module_entry_point_renders_the_same():
    out = subprocess.run([sys.executable, "-m", "netguard", "render",
                          *GOLDEN_CASES["deny-dns"]], capture_output=True, text=True,
                         cwd=ROOT, timeout=30, check=True).stdout
    assert out == (TESTDATA / "deny-dns.golden").read_text()


# ------------------------------------------------------------------ invariants of the ruleset

ALL_CONFIGS = [Config.from_strings(*a) for a in [
    (None, None, None, None),
    ("deny", ["10.0.0.0/8", "[fd00::/8]:53"], 9470, ["10.1.0.0/16", "fd00:1::/64"]),
    ("allow", None, None, ["10.1.0.0/16"]),
]] + [Config().locked_down(), GATEWAY_CONFIG, ALLOWLIST_CONFIG]


@pytest.mark.parametrize("cfg", ALL_CONFIGS, ids=lambda c: c.egress + ("-lock" * c.lockdown))
@pytest.mark.parametrize("family", [IPV4, IPV6])
def test_ruleset_invariants(cfg, family):
    rules = chain_rules(cfg, family)
    for r in rules:
        assert r.chain in (CHAIN_OUT, CHAIN_IN)  # own chains only
        assert '--comment "sandman: ' in r.spec()  # a comment on every rule
        shlex.split(r.spec())  # well-quoted
    out = [r for r in rules if r.chain == CHAIN_OUT]
    inn = [r for r in rules if r.chain == CHAIN_IN]
    # Metadata is refused first, in every mode.
    assert all("instance metadata" in r.comment and r.target.startswith("REJECT")
               for r in out[:2])
    if cfg.egress == "deny":
        # The chain ends in an unconditional reject: nothing falls through to OUTPUT's policy.
        assert out[-1].match == "" and out[-1].target.startswith("REJECT")
    else:
        assert out[-1].target == "RETURN" and len(out) == 3
    assert inn[-1].match == "" and inn[-1].target == "DROP"
    assert inn[0].match == "-i lo" and inn[0].target == "ACCEPT"
    # Every inbound ACCEPT is loopback, replies, ND, or the ingress port from a listed source.
    for r in inn[:-1]:
        if r.target == "ACCEPT" and r.match.startswith("-s "):
            assert f"--dport {cfg.ingress_port}" in r.match


def test_transaction_is_one_commit_with_own_chains_and_first_place_jumps():
    text = transaction(Config(), IPV4)
    lines = text.splitlines()
    assert lines[0] == "*filter" and lines[-1] == "COMMIT"
    assert text.count("COMMIT") == 1
    assert lines[1:3] == [":SANDMAN-IN - [0:0]", ":SANDMAN-OUT - [0:0]"]
    assert [x for x in lines if x.startswith("-I ")] == [
        f"-I OUTPUT 1 {jump_rule('OUTPUT', CHAIN_OUT).spec()}",
        f"-I INPUT 1 {jump_rule('INPUT', CHAIN_IN).spec()}",
    ]
    # Built-in chains get nothing but the jump.
    assert all(x.split()[1] in (CHAIN_OUT, CHAIN_IN) for x in lines if x.startswith("-A "))
    assert [x for x in lines if x.startswith("-F")] == ["-F SANDMAN-IN", "-F SANDMAN-OUT"]
    assert not any(x.startswith(("-X", "-P", ":INPUT", ":OUTPUT")) for x in lines)


def _save(base_rules: dict[str, list[str]]) -> str:
    lines = ["*filter", ":INPUT ACCEPT [0:0]", ":OUTPUT ACCEPT [0:0]"]
    lines += [f":{c} - [0:0]" for c in base_rules if c not in ("INPUT", "OUTPUT")]
    for chain, specs in base_rules.items():
        lines += [f"-A {chain} {s}" for s in specs]
    return "\n".join(lines + ["COMMIT", ""])


def test_rerun_keeps_a_first_place_jump_and_replaces_the_chains():
    cfg = Config()
    jo, ji = jump_rule("OUTPUT", CHAIN_OUT).spec(), jump_rule("INPUT", CHAIN_IN).spec()
    live = LiveFilter.parse(_save({"OUTPUT": [jo, "-j ACCEPT"], "INPUT": [ji],
                                   CHAIN_OUT: ["-j ACCEPT"], CHAIN_IN: []}))
    text = transaction(cfg, IPV4, live)
    assert "-I " not in text and "-D " not in text  # jumps already right: untouched
    assert ":SANDMAN-OUT - [0:0]" in text  # the chain is emptied and refilled in this commit


def test_rerun_removes_duplicate_and_misplaced_jumps_in_the_same_commit():
    jo = jump_rule("OUTPUT", CHAIN_OUT).spec()
    old = '-m comment --comment "old" -j SANDMAN-OUT'
    live = LiveFilter.parse(_save({"OUTPUT": ["-j ACCEPT", jo, jo, old],
                                   "INPUT": [], CHAIN_OUT: [], CHAIN_IN: []}))
    lines = transaction(Config(), IPV4, live).splitlines()
    assert lines.count(f"-D OUTPUT {jo}") == 2 and f"-D OUTPUT {old}" in lines
    assert f"-I OUTPUT 1 {jo}" in lines
    assert f"-I INPUT 1 {jump_rule('INPUT', CHAIN_IN).spec()}" in lines
    # Deletes come before the chain rules and inserts, all inside the one COMMIT.
    assert lines.index(f"-D OUTPUT {jo}") < lines.index(f"-I OUTPUT 1 {jo}") < lines.index(
        "COMMIT")


def test_diff_live_accepts_exactly_the_ruleset():
    cfg = Config.from_strings(allow_egress=["10.0.0.10:53"])
    base = {"OUTPUT": [jump_rule("OUTPUT", CHAIN_OUT).spec()],
            "INPUT": [jump_rule("INPUT", CHAIN_IN).spec()]}
    own = {c: [r.spec() for r in chain_rules(cfg, IPV4) if r.chain == c]
           for c in (CHAIN_IN, CHAIN_OUT)}
    assert diff_live(cfg, IPV4, LiveFilter.parse(_save({**base, **own}))) == []
    # A missing deny, an extra jump, a misplaced jump and a missing chain are all reported.
    broken = dict(own, **{CHAIN_OUT: own[CHAIN_OUT][:-1]})
    assert any("SANDMAN-OUT differs" in p
               for p in diff_live(cfg, IPV4, LiveFilter.parse(_save({**base, **broken}))))
    two = {"OUTPUT": base["OUTPUT"] * 2, "INPUT": base["INPUT"]}
    assert any("2 jumps" in p for p in diff_live(cfg, IPV4, LiveFilter.parse(_save({**two,
                                                                                    **own}))))
    late = {"OUTPUT": ["-j ACCEPT"] + base["OUTPUT"], "INPUT": base["INPUT"]}
    assert any("not the first rule" in p
               for p in diff_live(cfg, IPV4, LiveFilter.parse(_save({**late, **own}))))
    assert any("missing" in p for p in diff_live(cfg, IPV4, LiveFilter.parse(_save(base))))


# The default install's SANDMAN-IN exactly as iptables-save (nft and legacy, 1.8.9) printed it
# back in a real netns: no `-s` for the /0 source.
_DEFAULT_INSTALL_IN_AS_SAVED = [
    '-i lo -m comment --comment "sandman: allow loopback" -j ACCEPT',
    '-m conntrack --ctstate RELATED,ESTABLISHED -m comment --comment '
    '"sandman: allow replies on established connections" -j ACCEPT',
    '-m conntrack --ctstate INVALID -m comment --comment "sandman: drop invalid" -j DROP',
    '-p tcp -m tcp --dport 9470 -m comment --comment "sandman: allow port 9470 from 0.0.0.0/0" '
    '-j ACCEPT',
    '-s 10.0.0.1/32 -p tcp -m tcp --dport 9470 -m comment '
    '--comment "sandman: allow port 9470 from 10.0.0.1/32" -j ACCEPT',
    '-m comment --comment "sandman: drop other new inbound" -j DROP',
]


def test_diff_live_accepts_the_default_install_as_iptables_save_prints_it():
    cfg = Config.from_strings("allow", None, 9470, ["0.0.0.0/0", "10.0.0.1"])
    chains = {"OUTPUT": [jump_rule("OUTPUT", CHAIN_OUT).spec()],
              "INPUT": [jump_rule("INPUT", CHAIN_IN).spec()],
              CHAIN_OUT: [r.spec() for r in chain_rules(cfg, IPV4) if r.chain == CHAIN_OUT],
              CHAIN_IN: _DEFAULT_INSTALL_IN_AS_SAVED}
    assert diff_live(cfg, IPV4, LiveFilter.parse(_save(chains))) == []


@pytest.mark.parametrize("rendered,saved", [
    ("-s 0.0.0.0/0 -p tcp", "-p tcp"),
    ("-d ::/0 -j ACCEPT", "-j ACCEPT"),
    ("-s 10.1.2.3/16 -j ACCEPT", "-s 10.1.0.0/16 -j ACCEPT"),
    ("-s 10.1.2.3 -j ACCEPT", "-s 10.1.2.3/32 -j ACCEPT"),
    ("-s ::ffff:a00:0/104 -j ACCEPT", "-s ::ffff:10.0.0.0/104 -j ACCEPT"),
    ("-s FD00::1 -j ACCEPT", "-s fd00::1/128 -j ACCEPT"),
    ("-d 10.0.0.0/255.255.0.0 -j ACCEPT", "-d 10.0.0.0/16 -j ACCEPT"),
])
def test_canonical_spec_equates_the_spellings_iptables_save_prints(rendered, saved):
    assert canonical_spec(rendered) == canonical_spec(saved)


@pytest.mark.parametrize("rendered,saved", [
    ("-s 0.0.0.0/0 -p tcp", "-s 0.0.0.0/1 -p tcp"),  # narrower than the wildcard
    ("-p tcp", "-s 10.0.0.0/8 -p tcp"),
    ("-s 10.1.0.0/16 -j ACCEPT", "-s 10.1.0.0/17 -j ACCEPT"),
    ("-s 10.1.0.0/16 -j ACCEPT", "! -s 10.1.0.0/16 -j ACCEPT"),
    ("-s 0.0.0.0/0 -j ACCEPT", "! -s 0.0.0.0/0 -j ACCEPT"),  # matches nothing at all
    ("-s 10.1.0.0/16 -j ACCEPT", "-d 10.1.0.0/16 -j ACCEPT"),
    ("-d 10.0.0.0/8 -j ACCEPT", "-d 10.0.0.0/255.0.255.0 -j ACCEPT"),  # non-contiguous mask
    ('-m comment --comment "sandman: a" -j ACCEPT', '-m comment --comment "sandman: b" -j ACCEPT'),
    ('-m comment --comment "-s 0.0.0.0/0" -j DROP', '-m comment --comment "" -j DROP'),
])
def test_canonical_spec_keeps_every_real_difference(rendered, saved):
    assert canonical_spec(rendered) != canonical_spec(saved)


def test_no_rendered_rule_carries_a_zero_length_prefix():
    """iptables-save never prints `-s 0.0.0.0/0` or `-d ::/0`; the render must not either."""
    for name, args in GOLDEN_CASES.items():
        text = render_cli(args)
        assert not re.search(r"-[sd] (0\.0\.0\.0|::)/0\b", text), name


def test_sha256_names_the_ruleset():
    a = Config.from_strings(allow_egress=["10.0.0.10:53"])
    assert ruleset_sha256(a) == ruleset_sha256(Config.from_strings(allow_egress=["10.0.0.10/32:53"]))
    assert ruleset_sha256(a) != ruleset_sha256(Config())
    assert re.fullmatch(r"[0-9a-f]{64}", ruleset_sha256(a))


@pytest.mark.parametrize("text,want", [
    ("10.0.0.10", ("10.0.0.10/32", None, None)),
    ("10.0.0.0/8", ("10.0.0.0/8", None, None)),
    ("10.1.2.3/16:443", ("10.1.0.0/16", 443, None)),
    ("10.0.0.10:53/udp", ("10.0.0.10/32", 53, "udp")),
    ("fd00::/64", ("fd00::/64", None, None)),
    ("[fd00::1]:53/tcp", ("fd00::1/128", 53, "tcp")),
    ("[fd00::/64]", ("fd00::/64", None, None)),
])
def test_allow_egress_parsing(text, want):
    a = EgressAllow.parse(text)
    assert (str(a.network), a.port, a.proto) == want
    assert EgressAllow.parse(str(a)) == a  # round-trips through the status file


@pytest.mark.parametrize("text", ["nope", "10.0.0.1:0", "10.0.0.1:70000", "10.0.0.1:53/icmp",
                                  "[fd00::1", "[fd00::1]53", "10.0.0.300/32"])
def test_allow_egress_rejects_bad_entries(text):
    with pytest.raises(ConfigError):
        EgressAllow.parse(text)


def test_bad_options_exit_non_zero_with_one_line(capsys):
    assert main(["render", "--egress", "allow", "--allow-egress", "10.0.0.0/8"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error" in err
    assert main(["render", "--ingress-from", "not-a-cidr"]) == 1


def test_config_round_trips_through_the_status_dict():
    cfg = Config.from_strings("deny", ["10.0.0.10:53", "[fd00::/8]:443/tcp"], 8080,
                              ["10.1.0.0/16"])
    assert Config.from_dict(cfg.to_dict()) == cfg
    assert Config().ingress_port == EXECD_PORT


def test_docs_table_lists_every_rule():
    """docs/netguard.md's rule table names every comment the ruleset uses."""
    doc = (ROOT / "docs" / "netguard.md").read_text()
    comments = set()
    for cfg in ALL_CONFIGS:
        for family in (IPV4, IPV6):
            for r in chain_rules(cfg, family):
                c = re.sub(r"^allow egress .*", "allow egress <entry>", r.comment)
                c = re.sub(r"^never egress \S+", "never egress <range>", c)
                c = re.sub(r"^allow port \d+ from gateway .*",
                           "allow port <port> from gateway <address>", c)
                comments.add(re.sub(r"^allow port \d+ from .*", "allow port <port> from <source>",
                                    c))
    comments |= {jump_rule("OUTPUT", CHAIN_OUT).comment, jump_rule("INPUT", CHAIN_IN).comment}
    missing = sorted(c for c in comments if f"sandman: {c}" not in doc)
    assert not missing, f"docs/netguard.md does not mention: {missing}"


# ------------------------------------------------------------------ properties

_nets = st.one_of(
    st.builds(lambda a, p: ipaddress.ip_network(f"{ipaddress.IPv4Address(a)}/{p}", strict=False),
              st.integers(0, 2**32 - 1), st.integers(0, 32)),
    st.builds(lambda a, p: ipaddress.ip_network(f"{ipaddress.IPv6Address(a)}/{p}", strict=False),
              st.integers(0, 2**128 - 1), st.integers(0, 128)),
)
_allows = st.builds(lambda n, port, proto: EgressAllow(n, port, proto if port else None),
                    _nets, st.one_of(st.none(), st.integers(1, 65535)),
                    st.sampled_from([None, "tcp", "udp"]))


@settings(max_examples=200, deadline=None)
@given(allows=st.lists(_allows, max_size=5), sources=st.lists(_nets, max_size=4),
       port=st.integers(1, 65535))
@pytest.mark.slow
def test_any_options_render_a_guarded_ruleset(allows, sources, port):
    try:
        cfg = Config(allow_egress=tuple(allows), ingress_port=port, ingress_from=tuple(sources))
    except ConfigError as e:  # an entry inside a never range (fe80::/64, ::/128): refused
        assert "inside never range" in str(e)
        assume(False)
    assert Config.from_dict(cfg.to_dict()) == cfg  # the status file round-trips
    for family in (IPV4, IPV6):
        rules = chain_rules(cfg, family)
        out = [r for r in rules if r.chain == CHAIN_OUT]
        inn = [r for r in rules if r.chain == CHAIN_IN]
        assert "instance metadata" in out[0].comment and out[-1].match == ""
        assert out[-1].target.startswith("REJECT") and inn[-1].target == "DROP"
        text = transaction(cfg, family)
        assert text.count("COMMIT") == 1 and all(
            '--comment "sandman: ' in x for x in text.splitlines() if x.startswith(("-A", "-I")))


# --- the read-back's word splitter -----------------------------------------------------------

_ALPHABET = ' \t\r\n\x0b\x0c\x85\xa0"\'\\#ab-/:.()é'


@settings(max_examples=3000, deadline=None, derandomize=True)
@given(st.text(alphabet=_ALPHABET, max_size=40))
@pytest.mark.slow
def test_split_words_is_shlex_split_word_for_word(line):
    """The read-back compares what iptables-save printed with what netguard meant: a splitter
    that read a line differently from shlex could make two different rules look alike. On any
    line, it returns what shlex.split returns, or raises what shlex raises."""
    from netguard.rules import split_words

    try:
        want = shlex.split(line)
    except ValueError as e:
        with pytest.raises(ValueError, match=str(e)):
            split_words(line)
        return
    assert split_words(line) == want


def test_split_words_on_what_iptables_save_prints():
    from netguard.rules import split_words

    for line in ['-A SANDMAN-OUT -m comment --comment "sandman: egress denied (tcp reset)" '
                 '-p tcp -j REJECT --reject-with tcp-reset',
                 '-A OUTPUT -j SANDMAN-OUT', '-A X -m comment --comment "a \\"quoted\\" one"',
                 '-A X -m comment --comment ""', '-A X -m comment --comment "unterminated']:
        try:
            want = shlex.split(line)
        except ValueError:
            with pytest.raises(ValueError):
                split_words(line)
            continue
        assert split_words(line) == want


# ------------------------------------------------------------------ allowlists (sandman/egress.py)


def _out_comments(cfg: Config, family: str) -> list[str]:
    return [r.comment for r in chain_rules(cfg, family) if r.chain == CHAIN_OUT]


def test_never_ranges_are_carved_out_before_any_allow_rule():
    wide = Config.from_strings(allow_egress=["0.0.0.0/0:443/tcp", "[::/0]:443/tcp"])
    for cfg, family in ((ALLOWLIST_CONFIG, IPV4), (wide, IPV4), (wide, IPV6)):
        comments = _out_comments(cfg, family)
        nevers = [i for i, c in enumerate(comments) if c.startswith("never egress")]
        allows = [i for i, c in enumerate(comments) if c.startswith("allow egress")]
        assert nevers and allows and max(nevers) < min(allows), comments
    v4 = _out_comments(ALLOWLIST_CONFIG, IPV4)
    # The API server and the admin's range inside 10.0.0.0/8; nothing outside any entry.
    assert [c for c in v4 if c.startswith("never egress") and "tcp reset" not in c] == [
        "never egress 10.96.0.1/32", "never egress 10.100.0.0/16"]
    assert "allow egress svc/pypi-mirror.infra:3141/tcp at 10.96.7.7/32:3141/tcp" in v4
    v6 = _out_comments(ALLOWLIST_CONFIG, IPV6)
    assert "allow egress svc/pypi-mirror.infra:3141/tcp at [fd00:96::7/128]:3141/tcp" in v6
    assert not any(c.startswith("never egress") for c in _out_comments(
        Config.from_strings(allow_egress=["10.96.0.10:53"], api_server=["10.96.0.1"]), IPV4))
    # A wide entry gets the built-in ranges carved out of it (the NAT64 images in IPv6).
    assert ipaddress.ip_network("169.254.0.0/16") in wide.carve_outs(IPV4)
    assert ipaddress.ip_network("64:ff9b::a9fe:0/112") in wide.carve_outs(IPV6)


@pytest.mark.parametrize("allow,never,api,why", [
    (["169.254.169.254/32:80"], None, None, "link-local/metadata"),
    (["169.254.0.0/16"], None, None, "link-local/metadata"),
    (["[fe80::1]:80"], None, None, "link-local"),
    (["10.96.0.1:443"], None, ["10.96.0.1"], "the API server"),
    (["10.100.3.0/24:443/tcp"], ["10.100.0.0/16"], None, "--never-egress"),
    (["[64:ff9b::a9fe:a9fe]:80"], None, None, "NAT64"),
])
def test_an_allow_entry_inside_a_never_range_is_refused(allow, never, api, why):
    with pytest.raises(ConfigError, match="inside never range") as e:
        Config.from_strings(allow_egress=allow, never_egress=never, api_server=api)
    assert why in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("addresses,why", [
    (["10.96.0.1"], "API server"),  # a Service that is the API server's ClusterIP
    (["10.96.7.7", "169.254.169.254"], "link-local/metadata"),  # one bad address is enough
    (["10.100.0.5"], "API server or sandbox.egressNever"),
    (["fd00:ec2::254"], "metadata"),
])
def test_a_service_resolving_into_a_never_range_is_refused(addresses, why):
    cfg = Config.from_strings(allow_egress=["svc/a.b:80"], never_egress=["10.100.0.0/16"],
                              api_server=["10.96.0.1"])
    with pytest.raises(ConfigError, match="refused: address") as e:
        cfg.with_services({"svc/a.b:80/tcp": addresses})
    assert why in str(e.value)


def test_service_entries_are_canonical_and_bounded():
    cfg = Config.from_strings(allow_egress=["svc/b.ns:80", "svc/a.ns:53/udp,svc/b.ns:80/tcp"])
    assert cfg.allow_services == ("svc/a.ns:53/udp", "svc/b.ns:80/tcp")
    for bad in ("svc/a:80", "svc/a.b", "svc/a.b.c:80", "svc/*.b:80", "svc/a.b:0", "svc/A.b:80"):
        with pytest.raises(ConfigError, match="--allow-egress: egress entry"):
            Config.from_strings(allow_egress=[bad])
    with pytest.raises(ConfigError, match="more than 32"):
        Config.from_strings(allow_egress=[f"svc/s{i}.ns:80" for i in range(33)])
    with pytest.raises(ConfigError, match="only makes sense with --egress deny"):
        Config.from_strings("allow", ["svc/a.b:80"])
    with pytest.raises(ConfigError, match="only makes sense with --egress deny"):
        Config.from_strings("allow", None, never_egress=["10.0.0.0/8"])
    with pytest.raises(ConfigError, match="one address"):
        Config.from_strings(allow_egress=["10.0.0.0/8:1"], api_server=["10.96.0.0/12"])
    with pytest.raises(ConfigError, match="--never-egress not a CIDR"):
        Config.from_strings(never_egress=["nope"])
    # The resolved addresses round-trip through the status file as recorded, not re-resolved.
    assert Config.from_dict(ALLOWLIST_CONFIG.to_dict()) == ALLOWLIST_CONFIG
    # A guard without an allowlist records exactly the options it recorded before.
    assert set(Config().to_dict()) == {"egress", "allow_egress", "ingress_port", "ingress_from",
                                       "ingress_from_gateway", "ingress_gateways"}


def test_the_api_server_is_read_from_the_env_only_for_an_allowlist(monkeypatch):
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    assert render_cli([]) == (TESTDATA / "deny-default.golden").read_text()
    out = render_cli(["--allow-egress", "10.0.0.0/8:443/tcp", "--family", "ipv4"])
    assert '"sandman: never egress 10.96.0.1/32"' in out
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.0/12")
    assert main(["render", "--allow-egress", "10.0.0.0/8:443/tcp"]) == 1  # one address only


def test_cluster_domain_comes_from_the_search_list(tmp_path):
    from netguard import resolve

    conf = tmp_path / "resolv.conf"
    conf.write_text("nameserver 10.96.0.10\nsearch ns1.svc.corp.example svc.corp.example "
                    "corp.example\noptions ndots:5\n")
    assert resolve.cluster_domain(str(conf)) == "corp.example"
    conf.write_text("nameserver 10.96.0.10\nsearch example.com\n")
    with pytest.raises(ConfigError, match="no svc.<cluster domain>"):
        resolve.cluster_domain(str(conf))
    with pytest.raises(ConfigError, match="cannot read"):
        resolve.cluster_domain(str(tmp_path / "absent"))


def test_self_verify_probes_one_address_of_each_carve_out_on_a_tcp_entrys_port():
    from netguard.verify import never_targets

    cfg = Config.from_strings(allow_egress=["10.0.0.0/8:443/tcp", "0.0.0.0/0:53/udp",
                                            "[::/0]:8443"], never_egress=["10.100.0.0/16"],
                              api_server=["10.96.0.1"])
    got = never_targets(cfg, (IPV4, IPV6))
    # udp-only 0.0.0.0/0 shows nothing over TCP; 0.0.0.0 and ::ffff:0:0/96 a connect cannot show.
    assert ("10.96.0.1", 443) in got and ("10.100.0.1", 443) in got
    assert all(h != "0.0.0.0" and not h.startswith("169.254.") for h, _ in got)
    assert ("fe80::1", 8443) in got and ("fd00:ec2::254", 8443) in got
    assert not any(h.startswith("::ffff:") or h == "::" for h, _ in got)
    assert never_targets(cfg, (IPV4,)) == [t for t in got if ":" not in t[0]]
