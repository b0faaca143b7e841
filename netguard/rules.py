"""The ruleset: a pure function of `Config` and the address family, in iptables-save's own form.

Every rule is written as `iptables-save` prints it back (same option order, `-m tcp` spelled
out, CIDRs normalised, no `-s`/`-d` at all for a /0, which iptables-save never prints), so the
golden files show what the kernel will hold. The read-back (`diff_live`) still compares
addresses as addresses, not strings: iptables-save's spelling of an IPv6 address is libc's
(`::ffff:10.0.0.0`) where Python's is `::ffff:a00:0`, and a kwok-only test bed once hid that a
literal string compare failed every default install. Every rule carries a comment naming its
purpose (`sandman: ...`), like istio-iptables and linkerd's proxy-init.
"""

from __future__ import annotations

import ipaddress

from netguard.config import IPV4, IPV6, METADATA, Config
from netguard.values import Frozen, Record

try:  # hashlib loads OpenSSL, ~5 ms of CPU at every guarded pod's start; sha256 alone is built in
    from _sha256 import sha256  # type: ignore[import-not-found]  # python <= 3.11, no stub
except ImportError:  # pragma: no cover - the image's python is 3.11
    try:
        from _sha2 import sha256  # type: ignore[import-not-found]  # python >= 3.12, no stub
    except ImportError:
        from hashlib import sha256

# netguard owns these chains and nothing else; built-in chains get one jump each.
CHAIN_OUT = "SANDMAN-OUT"
CHAIN_IN = "SANDMAN-IN"
OWN_CHAINS = (CHAIN_IN, CHAIN_OUT)  # iptables-save's (sorted) order
JUMPS = (("OUTPUT", CHAIN_OUT), ("INPUT", CHAIN_IN))

RESTORE_BIN = {IPV4: "iptables-restore", IPV6: "ip6tables-restore"}

# REJECT (not DROP) for egress: a denied `pip install` fails in milliseconds instead of hanging
# until its timeout, and a denied probe proves the rule is there (a DROP looks like packet loss).
_REJECT_OTHER = {
    IPV4: "REJECT --reject-with icmp-port-unreachable",
    IPV6: "REJECT --reject-with icmp6-port-unreachable",
}
_REJECT_TCP = "REJECT --reject-with tcp-reset"

# IPv6 needs neighbour discovery to reach anything at all, even allowed destinations and
# replies. conntrack does not track these messages, so they must pass before the INVALID drop.
_ND_OUT = ((133, "router solicitation"), (135, "neighbour solicitation"),
           (136, "neighbour advertisement"))
_ND_IN = ((134, "router advertisement"), (135, "neighbour solicitation"),
          (136, "neighbour advertisement"))


class Rule(Frozen):
    chain: str
    match: str  # iptables match options, in iptables-save order; "" for none
    comment: str  # the purpose; printed as "sandman: <comment>"
    target: str  # "-j" argument and its options
    FIELDS = ("chain", "match", "comment", "target")

    def spec(self) -> str:
        """The rule without `-A CHAIN`, exactly as iptables-save prints it."""
        if '"' in self.comment or "\\" in self.comment:
            raise ValueError(f"comment must not contain quotes or backslashes: {self.comment!r}")
        parts = [self.match] if self.match else []
        parts.append(f'-m comment --comment "sandman: {self.comment}"')
        parts.append(f"-j {self.target}")
        return " ".join(parts)

    def line(self) -> str:
        return f"-A {self.chain} {self.spec()}"


def _addr(opt: str, network: ipaddress.IPv4Network | ipaddress.IPv6Network) -> str:
    """`-s CIDR ` / `-d CIDR `, or nothing for a /0: it matches every address of the family,
    and iptables-save omits it (both backends), so a rule rendered with `-s 0.0.0.0/0` never
    reads back equal."""
    return "" if network.prefixlen == 0 else f"{opt} {network} "


def jump_rule(base: str, chain: str) -> Rule:
    what = "egress" if chain == CHAIN_OUT else "ingress"
    return Rule(base, "", f"netguard {what} guard, first rule of {base}", chain)


def chain_rules(config: Config, family: str) -> list[Rule]:
    """The contents of SANDMAN-OUT then SANDMAN-IN for one family, in order."""
    out, inn = CHAIN_OUT, CHAIN_IN
    md = METADATA[family]
    icmp6 = "-p ipv6-icmp -m icmp6 --icmpv6-type"
    rules: list[Rule] = [
        # First, so no later allow (not even --allow-egress 169.254.0.0/16) can open it.
        Rule(out, f"-d {md} -p tcp", "block instance metadata (tcp reset)", _REJECT_TCP),
        Rule(out, f"-d {md}", "block instance metadata", _REJECT_OTHER[family]),
    ]
    if config.egress == "allow":
        rules.append(Rule(out, "", "egress mode allow: everything else may leave", "RETURN"))
    else:
        rules += [
            Rule(out, "-o lo", "allow loopback", "ACCEPT"),
            Rule(out, "-m conntrack --ctstate RELATED,ESTABLISHED",
                 "allow replies on established connections", "ACCEPT"),
        ]
        if family == IPV6:
            rules += [Rule(out, f"{icmp6} {t}", f"allow ipv6 {name}", "ACCEPT")
                      for t, name in _ND_OUT]
        rules.append(Rule(out, "-m conntrack --ctstate INVALID", "drop invalid", "DROP"))
        # Never ranges inside an allow entry (the API server inside 10.0.0.0/8, link-local
        # inside 0.0.0.0/0): rejected before any allow rule can accept them.
        for net in config.carve_outs(family):
            rules += [
                Rule(out, f"-d {net} -p tcp", f"never egress {net} (tcp reset)", _REJECT_TCP),
                Rule(out, f"-d {net}", f"never egress {net}", _REJECT_OTHER[family]),
            ]
        for a in config.allow_egress + config.service_addresses:
            if a.family != family:
                continue
            dest = _addr("-d", a.network)
            what = f"allow egress {a.via} at {a}" if a.via else f"allow egress {a}"
            if a.port is None:
                rules.append(Rule(out, dest.strip(), what, "ACCEPT"))
                continue
            for proto in (a.proto,) if a.proto else ("tcp", "udp"):
                rules.append(Rule(out, f"{dest}-p {proto} -m {proto} --dport {a.port}",
                                  what, "ACCEPT"))
        lock = " (lockdown after a failed apply)" if config.lockdown else ""
        rules += [
            Rule(out, "-p tcp", f"egress denied (tcp reset){lock}", _REJECT_TCP),
            Rule(out, "", f"egress denied{lock}", _REJECT_OTHER[family]),
        ]

    rules += [
        Rule(inn, "-i lo", "allow loopback", "ACCEPT"),
        Rule(inn, "-m conntrack --ctstate RELATED,ESTABLISHED",
             "allow replies on established connections", "ACCEPT"),
    ]
    if family == IPV6:
        rules += [Rule(inn, f"{icmp6} {t}", f"allow ipv6 {name}", "ACCEPT") for t, name in _ND_IN]
    rules.append(Rule(inn, "-m conntrack --ctstate INVALID", "drop invalid", "DROP"))
    port = config.ingress_port
    for src in config.ingress_from:
        if (src.version == 4) == (family == IPV4):
            rules.append(Rule(inn, f"{_addr('-s', src)}-p tcp -m tcp --dport {port}",
                              f"allow port {port} from {src}", "ACCEPT"))
    # The pod's default gateway is the host side of its link (a bridge CNI's bridge address):
    # the kubelet's probes come from there, not from status.hostIP (docs/netguard.md).
    for gw in config.ingress_gateways:
        if (gw.version == 4) == (family == IPV4):
            rules.append(Rule(inn, f"-s {gw} -p tcp -m tcp --dport {port}",
                              f"allow port {port} from gateway {gw}", "ACCEPT"))
    rules.append(Rule(inn, "", "drop other new inbound", "DROP"))
    return rules


class LiveFilter(Record):
    """The filter table as iptables-save printed it: chain -> rule specs (without `-A CHAIN`)."""

    chains: dict[str, list[str]]
    FIELDS = ("chains",)

    @classmethod
    def parse(cls, save_output: str) -> LiveFilter:
        chains: dict[str, list[str]] = {}
        in_filter = False
        for raw in save_output.splitlines():
            line = raw.strip()
            if line.startswith("*"):
                in_filter = line == "*filter"
            elif not in_filter or not line or line.startswith("#"):
                continue
            elif line == "COMMIT":
                in_filter = False
            elif line.startswith(":"):
                chains.setdefault(line[1:].split()[0], [])
            elif line.startswith("-A "):
                chain, _, spec = line[3:].partition(" ")
                chains.setdefault(chain, []).append(spec)
        return cls(chains)

    def jumps_to(self, base: str, chain: str) -> list[str]:
        """Rules of `base` that jump or go to `chain`."""
        out = []
        for spec in self.chains.get(base, []):
            try:
                toks = split_words(spec)
            except ValueError:
                continue
            if any(t in ("-j", "-g") and n == chain for t, n in zip(toks, toks[1:], strict=False)):
                out.append(spec)
        return out


def transaction(config: Config, family: str, live: LiveFilter | None = None) -> str:
    """The complete `iptables-restore --noflush` input for one family: one atomic commit.

    Declaring an own chain (`:SANDMAN-OUT - [0:0]`) creates it, and `-F` empties it, inside
    the same commit that refills it: a re-run never has a moment with the deny missing.
    Without `live`, the input for a fresh network namespace (what the golden files hold). With
    it, stale or duplicate jumps are deleted and the one jump re-inserted as the first rule,
    unless it already is exactly that.
    """
    lines = ["*filter"] + [f":{c} - [0:0]" for c in OWN_CHAINS]
    # The declaration already empties an existing chain under --noflush; the explicit flush says
    # so and keeps it true on iptables versions whose nft restore did not.
    lines += [f"-F {c}" for c in OWN_CHAINS]
    inserts: list[str] = []
    for base, chain in JUMPS:
        jump = jump_rule(base, chain).spec()
        existing = live.jumps_to(base, chain) if live else []
        if live and existing == [jump] and live.chains.get(base, [])[:1] == [jump]:
            continue  # already exactly one jump, in first place
        lines += [f"-D {base} {spec}" for spec in existing]
        inserts.append(f"-I {base} 1 {jump}")
    lines += [r.line() for r in chain_rules(config, family)]
    lines += inserts
    lines.append("COMMIT")
    return "\n".join(lines) + "\n"


def render(config: Config, families: tuple[str, ...] = (IPV4, IPV6)) -> str:
    """What `python3 -m netguard render` prints: each family's fresh transaction."""
    parts = []
    for family in families:
        parts.append(f"# {family}: {RESTORE_BIN[family]} --noflush\n")
        parts.append(transaction(config, family))
    return "".join(parts)


def ruleset_sha256(config: Config) -> str:
    """Names the ruleset: SHA-256 of `render` for both families (independent of the machine)."""
    return sha256(render(config).encode()).hexdigest()


_SHLEX_ONLY = frozenset("\\'")  # escapes and single quotes: left to shlex itself
_SPACES = str.maketrans("\t\r\n", "   ")  # shlex's whitespace, all as " "


def split_words(line: str) -> list[str]:
    """shlex.split(line), on the read-back's hot path: iptables-save quotes a comment with
    double quotes, and escapes a quote or backslash inside it. A line with neither a backslash
    nor a single quote and with balanced double quotes is split here, on shlex's own whitespace
    (space, tab, CR, LF; tests/netguard/test_render.py checks it word for word against shlex on
    random lines); any other goes to shlex, whose character loop was ~a third of netguard's
    own CPU after its imports."""
    if not _SHLEX_ONLY.isdisjoint(line) or line.count('"') % 2:
        import shlex

        return shlex.split(line)
    # Balanced double quotes and no escapes: the odd pieces between quotes are quoted text,
    # the even ones split on whitespace; what no whitespace separates is one word. (Not `re`:
    # netguard's start would pay its import, see values.py.)
    words: list[str] = []
    glued = False  # the next text joins the last word
    for i, piece in enumerate(line.split('"')):
        if i % 2:
            if glued:
                words[-1] += piece
            else:
                words.append(piece)
            glued = True
            continue
        for j, part in enumerate(piece.translate(_SPACES).split(" ")):
            if j:
                glued = False
            if part:
                if glued:
                    words[-1] += part
                else:
                    words.append(part)
                glued = True
    return words


_ADDR_OPTS = frozenset(("-s", "-d"))  # iptables-save prints only the short forms


def canonical_spec(spec: str) -> tuple[str, ...]:
    """A rule spec as tokens with every `-s`/`-d` address in one spelling, so the read-back
    compares what a rule matches, not how a tool spells it: `-s 0.0.0.0/0` and `-d ::/0`
    vanish (iptables-save omits them), host bits are cleared, a bare address gets its /32 or
    /128, IPv6 is spelled by Python (glibc prints embedded IPv4 as dotted quads). Only
    equivalent spellings meet: another network, a negation (`! -s`), a non-contiguous mask or
    anything unparsable stays as it is and so still differs, and the apply fails closed."""
    try:
        toks = split_words(spec)
    except ValueError:
        return (spec,)
    out: list[str] = []
    i = 0
    while i < len(toks):
        tok = toks[i]
        if tok == "--comment" and i + 1 < len(toks):  # a comment is text, never an address
            out += toks[i:i + 2]
            i += 2
            continue
        if tok in _ADDR_OPTS and i + 1 < len(toks):
            try:
                net = ipaddress.ip_network(toks[i + 1], strict=False)
            except ValueError:
                net = None
            if net is not None:
                negated = bool(out) and out[-1] == "!"
                if net.prefixlen != 0 or negated:
                    out += [tok, str(net)]
                i += 2
                continue
        out.append(tok)
        i += 1
    return tuple(out)


def diff_live(config: Config, family: str, live: LiveFilter) -> list[str]:
    """Differences between the live filter table and the ruleset; [] when they match.

    Rules are compared token by token with addresses canonicalised on both sides
    (`canonical_spec`); everything else (order, matches, targets, comments) must be equal."""
    problems = []
    want = chain_rules(config, family)
    for chain in OWN_CHAINS:
        expected = [r.spec() for r in want if r.chain == chain]
        got = live.chains.get(chain)
        if got is None:
            problems.append(f"{family}: chain {chain} is missing")
        elif got != expected and (  # same text: iptables-save prints our spelling back
                [canonical_spec(g) for g in got] != [canonical_spec(e) for e in expected]):
            problems.append(f"{family}: chain {chain} differs: "
                            f"{len(got)} live rules, {len(expected)} expected; first difference: "
                            f"{_first_difference(got, expected)}")
    for base, chain in JUMPS:
        jump = jump_rule(base, chain).spec()
        jumps = live.jumps_to(base, chain)
        if jumps != [jump]:
            problems.append(f"{family}: {base} has {len(jumps)} jumps to {chain}, expected 1")
        elif live.chains.get(base, [])[:1] != [jump]:
            problems.append(f"{family}: the jump to {chain} is not the first rule of {base}")
    return problems


def _first_difference(got: list[str], expected: list[str]) -> str:
    for i, (g, e) in enumerate(zip(got, expected, strict=False)):
        if canonical_spec(g) != canonical_spec(e):
            return f"rule {i + 1}: live {g!r}, expected {e!r}"
    i = min(len(got), len(expected))
    return f"rule {i + 1}: " + (f"extra live {got[i]!r}" if len(got) > i else
                                f"missing {expected[i]!r}")
