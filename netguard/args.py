"""netguard's command line as argparse reads it: `--help`, `render`, `check`, and any `apply`
command line netguard.cli's fast reader leaves to it (an injected guard's never does, so the
guard's start does not import argparse)."""

from __future__ import annotations

import argparse
import os

from netguard import verify, xtables
from netguard.config import FAMILIES
from sandman.contract import NETGUARD_STATUS_PATH


def _ruleset_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("ruleset")
    g.add_argument("--egress", choices=("deny", "allow"), default=None,
                   help="deny (default): only loopback, replies and --allow-egress leave")
    g.add_argument("--allow-egress", action="append", metavar="CIDR[:PORT[/tcp|udp]]",
                   help="allowed destination in deny mode (repeatable, or comma-separated); "
                        "IPv6 with a port as [CIDR]:PORT; a port without /proto means tcp+udp;"
                        " svc/NAME.NAMESPACE:PORT[/tcp|udp]: a Service's addresses, resolved "
                        "through this pod's DNS at apply time (fails closed if none)")
    g.add_argument("--never-egress", action="append", metavar="CIDR",
                   help="never reached even inside an --allow-egress entry (repeatable or "
                        "comma-separated), besides the metadata and link-local ranges and the "
                        "API server (KUBERNETES_SERVICE_HOST)")
    g.add_argument("--ingress-port", type=int, default=None,
                   help="the port inbound callers may reach (default: execd's)")
    g.add_argument("--ingress-from", action="append", metavar="CIDR",
                   help="sources allowed to reach --ingress-port (repeatable or comma-separated);"
                        " none: loopback only")
    g.add_argument("--ingress-from-gateway", action="store_const", const=True, default=None,
                   help="also admit the pod's default gateway(s) (/32, /128) to --ingress-port, "
                        "read from this netns's routing table: on a bridge CNI the kubelet's "
                        "probes come from there; none found admits nothing more")


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
    log.add_argument("--log-format", choices=("text", "json"), default="text",
                     help="json: each line one object (time, level, logger, message)")

    a = sub.add_parser("apply", parents=[log], formatter_class=_Formatter, help="install the rules in this netns, verify them, write status")
    _ruleset_args(a)
    a.add_argument("--backend", choices=("auto",) + xtables.BACKENDS, default="auto",
                   help="iptables backend; auto: whichever has rules in this netns, else nft")
    a.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip the read-back and the probes (not for production)")
    a.add_argument("--verify-blocked", action="append", default=[], metavar="IP:PORT",
                   help="a TCP target that must be refused after apply (repeatable)")
    a.add_argument("--verify-timeout", type=float, default=verify.DEFAULT_TIMEOUT,
                   help="seconds a probe may take; a blocked probe must fail faster")
    a.add_argument("--status-file", default=NETGUARD_STATUS_PATH,
                   help="where to write the status JSON ('' for none)")
    a.add_argument("--install-execd", metavar="DIR", default=None,
                   help="once the guard is in place, install execd into DIR (execd/install.py):"
                        " a sandbox's one injected init container does both")

    r = sub.add_parser("render", parents=[log], formatter_class=_Formatter, help="print the restore input, touching nothing")
    _ruleset_args(r)
    r.add_argument("--family", choices=FAMILIES + ("all",), default="all")
    r.add_argument("--live", action="store_true",
                   help="render what apply would send here (reads, never writes, the kernel)")
    r.add_argument("--backend", choices=("auto",) + xtables.BACKENDS, default="auto")

    c = sub.add_parser("check", parents=[log], formatter_class=_Formatter, help="do the live rules match the ruleset? exit 0/1")
    _ruleset_args(c)
    c.add_argument("--backend", choices=("auto",) + xtables.BACKENDS, default="auto")
    c.add_argument("--status-file", default=NETGUARD_STATUS_PATH,
                   help="options and families come from here unless given on the command line")
    return p


