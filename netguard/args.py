"""netguard's command line as argparse reads it: `--help`, `render`, `check`, and any `apply`
command line netguard.cli's fast reader leaves to it (an injected guard's never does, so the
guard's start does not import argparse)."""

from __future__ import annotations

import argparse
import os

from netguard.config import FAMILIES
from sandman.contract import (
    NETGUARD_APPLY_OPTIONS,
    NETGUARD_FLAG_ALLOW_EGRESS,
    NETGUARD_FLAG_EGRESS,
    NETGUARD_FLAG_INGRESS_FROM,
    NETGUARD_FLAG_INGRESS_FROM_GATEWAY,
    NETGUARD_FLAG_INGRESS_PORT,
    NETGUARD_FLAG_INSTALL_EXECD,
    NETGUARD_FLAG_NEVER_EGRESS,
    NETGUARD_RULESET_OPTIONS,
    netguard_argparse_kwargs,
)

# The help of each option in sandman.contract's table (which says what each option is); the
# metavar where argparse's own (the dest in capitals) would say less.
HELP = {
    NETGUARD_FLAG_EGRESS: (None, "deny (default): only loopback, replies and --allow-egress leave"),
    NETGUARD_FLAG_ALLOW_EGRESS: (
        "CIDR[:PORT[/tcp|udp]]",
        "allowed destination in deny mode (repeatable, or comma-separated); "
        "IPv6 with a port as [CIDR]:PORT; a port without /proto means tcp+udp;"
        " svc/NAME.NAMESPACE:PORT[/tcp|udp]: a Service's addresses, resolved "
        "through this pod's DNS at apply time (fails closed if none)"),
    NETGUARD_FLAG_NEVER_EGRESS: (
        "CIDR",
        "never reached even inside an --allow-egress entry (repeatable or "
        "comma-separated), besides the metadata and link-local ranges and the "
        "API server (KUBERNETES_SERVICE_HOST)"),
    NETGUARD_FLAG_INGRESS_PORT: (None, "the port inbound callers may reach (default: execd's)"),
    NETGUARD_FLAG_INGRESS_FROM: (
        "CIDR",
        "sources allowed to reach --ingress-port (repeatable or comma-separated);"
        " none: loopback only"),
    NETGUARD_FLAG_INGRESS_FROM_GATEWAY: (
        None,
        "also admit the pod's default gateway(s) (/32, /128) to --ingress-port, "
        "read from this netns's routing table: on a bridge CNI the kubelet's "
        "probes come from there; none found admits nothing more"),
    "--log-format": (None, "json: each line one object (time, level, logger, message)"),
    "--backend": (None, "iptables backend; auto: whichever has rules in this netns, else nft"),
    "--no-verify": (None, "skip the read-back and the probes (not for production)"),
    "--verify-blocked": ("IP:PORT", "a TCP target that must be refused after apply (repeatable)"),
    "--verify-timeout": (None, "seconds a probe may take; a blocked probe must fail faster"),
    "--status-file": (None, "where to write the status JSON ('' for none)"),
    NETGUARD_FLAG_INSTALL_EXECD: (
        "DIR",
        "once the guard is in place, install execd into DIR (execd/install.py):"
        " a sandbox's one injected init container does both"),
}


def _add(p, flag: str, **override) -> None:
    """`flag` as sandman.contract's table defines it, with its HELP unless `override`s."""
    kw = netguard_argparse_kwargs(flag)
    metavar, kw["help"] = HELP[flag]
    if metavar is not None:
        kw["metavar"] = metavar
    p.add_argument(flag, **{**kw, **override})


def _ruleset_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("ruleset")
    for flag in NETGUARD_RULESET_OPTIONS:
        _add(g, flag)


class _Formatter(argparse.HelpFormatter):
    """argparse's own, sized without shutil: argparse builds a formatter for every
    add_argument, and its default width imports shutil (with fnmatch, bz2 and lzma), CPU on
    the guard's hot path under the sandbox's quota. The width is what shutil would find."""

    def __init__(self, prog: str, **kw) -> None:
        if kw.get("width") is None:
            try:
                columns = int(os.environ["COLUMNS"])
            except (KeyError, ValueError):
                columns = 0
            if columns <= 0:
                try:
                    columns = os.get_terminal_size(1).columns
                except (ValueError, OSError):
                    columns = 80
            kw["width"] = columns - 2
        super().__init__(prog, **kw)


def build_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="netguard", description=description,
                                formatter_class=_Formatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    log = argparse.ArgumentParser(add_help=False, formatter_class=_Formatter)
    _add(log, "--log-format")

    a = sub.add_parser("apply", parents=[log], formatter_class=_Formatter, help="install the rules in this netns, verify them, write status")
    _ruleset_args(a)
    for flag in NETGUARD_APPLY_OPTIONS:
        if flag != "--log-format" and flag not in NETGUARD_RULESET_OPTIONS:
            _add(a, flag)

    r = sub.add_parser("render", parents=[log], formatter_class=_Formatter, help="print the restore input, touching nothing")
    _ruleset_args(r)
    r.add_argument("--family", choices=FAMILIES + ("all",), default="all")
    r.add_argument("--live", action="store_true",
                   help="render what apply would send here (reads, never writes, the kernel)")
    _add(r, "--backend", help=None)

    c = sub.add_parser("check", parents=[log], formatter_class=_Formatter, help="do the live rules match the ruleset? exit 0/1")
    _ruleset_args(c)
    _add(c, "--backend", help=None)
    _add(c, "--status-file",
         help="options and families come from here unless given on the command line")
    return p


