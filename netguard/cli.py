"""`python3 -m netguard apply|render|check`: the one entry point.

Exit codes: 0 success; 1 the guard is not (verifiably) in place, or an option value is bad, with
one line on stderr saying why; 2 argparse usage errors. An init container that exits non-zero
keeps the pod from starting: the sandbox never runs unguarded.
"""

from __future__ import annotations

import os
import sys
import time

from netguard import jsontext, netinfo, verify, xtables
from netguard.config import FAMILIES, IPV4, IPV6, Config, ConfigError
from netguard.rules import LiveFilter, diff_live, render, ruleset_sha256, transaction
from sandman.contract import (
    KUBERNETES_SERVICE_HOST_ENV,
    NETGUARD_APPLY_OPTIONS,
    NETGUARD_BACKENDS,
    NETGUARD_RULESET_OPTIONS,
)

STATUS_VERSION = 1

TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse
    from typing import Any


class GuardError(RuntimeError):
    """The guard could not be installed or proven; the message is the one line printed."""


def utc_now(suffix: str = "+00:00") -> str:
    """Now in UTC to the millisecond, as datetime's isoformat(timespec="milliseconds") spells
    it (`suffix` "Z" for the log lines); `datetime` itself is CPU on the hot path."""
    ms = int(time.time() * 1000)  # one reading for both parts: no second from another instant
    return (time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms // 1000))
            + f".{ms % 1000:03d}{suffix}")


def say(args: argparse.Namespace, text: str, level: str = "INFO", stream=None) -> None:
    """One line of what netguard did, as text or (`--log-format json`) as one JSON object with
    the fields of the server's JSON logs (sandman/logs.py): time, level, logger, message.
    Not through sandman.logs: importing `logging` is CPU on the guard's hot path (every
    sandbox start pays it under its own quota)."""
    if getattr(args, "log_format", "text") == "json":
        text = jsontext.dumps({"time": utc_now("Z"), "level": level, "logger": "netguard",
                               "message": text})
    print(text, file=stream or sys.stdout)


def _config(args: argparse.Namespace, gateways: list[str] | None = None) -> Config:
    """The Config of the command line; with --ingress-from-gateway, the gateways given, or
    (None) those of this netns's routing table."""
    # The API server is read only for an allowlist: a guard without one renders as before.
    api = os.environ.get(KUBERNETES_SERVICE_HOST_ENV, "").strip() if args.allow_egress else ""
    config = Config.from_strings(args.egress, args.allow_egress, args.ingress_port,
                                 args.ingress_from, args.ingress_from_gateway, None,
                                 args.never_egress, [api] if api else None)
    if config.allow_services:
        from netguard import resolve  # sockets and threads for DNS: only with svc/ entries

        config = config.with_services(resolve.services(config.allow_services))
    if config.ingress_from_gateway and gateways is None:
        gateways = netinfo.gateways()
    return config.with_gateways(gateways or [])


def _given(args: argparse.Namespace) -> bool:
    return any(getattr(args, dest) is not None for dest, *_ in NETGUARD_RULESET_OPTIONS.values())


def build_parser():
    """The whole command line, with argparse (netguard/args.py): help, render, check, and any
    apply command line the fast reader leaves to it."""
    from netguard.args import build_parser as build

    return build(__doc__.splitlines()[0])


# The apply command line of an injected guard, read without argparse: its import (with re,
# gettext and locale) is CPU on every guarded pod's start, under the pod's own quota. The
# options are sandman.contract's table, which argparse's parser is built from too. Whatever
# this reader cannot take exactly as argparse would (help, an abbreviation, a bad or missing
# value, `--`, a value that starts with '-') goes to argparse, which answers it;
# tests/netguard/test_hot_path.py holds the two readers equal.
APPLY_DEFAULTS = {"cmd": "apply",
                  **{dest: default for dest, _, _, default in NETGUARD_APPLY_OPTIONS.values()}}


def fast_apply_args(argv: list[str]):
    """The Namespace argparse would give for an `apply` command line, or None: then argparse
    must read it."""
    if not argv or argv[0] != "apply":
        return None
    ns: dict[str, Any] = {k: list(v) if isinstance(v, tuple) else v
                          for k, v in APPLY_DEFAULTS.items()}
    i = 1
    while i < len(argv):
        tok = argv[i]
        i += 1
        name, eq, value = tok.partition("=")
        spec: tuple[str, str, Any, Any] | None = NETGUARD_APPLY_OPTIONS.get(name)
        if spec is None:
            return None
        dest, kind, extra, _ = spec
        if kind in ("const", "false"):
            if eq:
                return None
            ns[dest] = extra if kind == "const" else False
            continue
        if not eq:
            if i >= len(argv):
                return None
            value = argv[i]
            i += 1
        if value.startswith("-"):  # argparse's own rules for these (`--x=--` is [] there)
            return None
        if kind == "append":
            ns[dest] = (ns[dest] or []) + [value]
            continue
        try:
            converted = (int(value) if kind == "int" else float(value) if kind == "float"
                         else value)
        except ValueError:
            return None
        if extra is not None and converted not in extra:
            return None
        ns[dest] = converted
    from types import SimpleNamespace

    return SimpleNamespace(**ns)


# ---------------------------------------------------------------- detection


_LEGACY_TABLES = {IPV4: "/proc/net/ip_tables_names", IPV6: "/proc/net/ip6_tables_names"}


def legacy_tables_here(family: str) -> bool:
    """Does x_tables (iptables-legacy) hold any table of `family` in this netns? The kernel
    lists them in /proc/net/ip{,6}_tables_names, per netns (what iptables-nft reads for its
    "legacy tables present" warning); none there means no legacy rule, so auto detection does
    not run that save (two processes fewer on every start). Unreadable for another reason:
    assume there are."""
    try:
        with open(_LEGACY_TABLES[family]) as f:
            return bool(f.read().strip())
    except FileNotFoundError:
        return False  # x_tables is not loaded: no legacy table in any netns
    except OSError:
        return True


def detect_start(backend: str, families: tuple[str, ...] = FAMILIES) -> dict:
    """Start reading each candidate backend's tables, in parallel subprocesses. With `auto`, a
    legacy family the kernel lists no table for is known empty without its save."""
    candidates = NETGUARD_BACKENDS if backend == "auto" else (backend,)
    state: dict = {"backend": backend, "families": families, "tools": {}, "procs": {},
                   "errors": {}, "empty": set()}
    for b in candidates:
        for f in families:
            try:
                t = xtables.find_tools(b, f)
                if backend == "auto" and b == "legacy" and not legacy_tables_here(f):
                    state["empty"].add((b, f))  # its dump would be empty: nothing to read
                else:
                    state["procs"][(b, f)] = xtables.start_save(t)
                state["tools"][(b, f)] = t
            except (xtables.XtablesError, OSError) as e:
                state["errors"][(b, f)] = str(e)
    return state


def detect_finish(state: dict):
    """Pick the backend; returns (backend, {family: Tools}, {family: LiveFilter},
    {family: why it is unusable}). A family's problem only matters if it needs a ruleset."""
    fams, tools, errors = state["families"], state["tools"], state["errors"]
    dumps: dict[tuple[str, str], str] = {key: "" for key in state["empty"]}
    for key, proc in state["procs"].items():
        try:
            dumps[key] = xtables.finish_save(tools[key], proc)
        except xtables.XtablesError as e:
            errors[key] = str(e)
    if state["backend"] == "auto":
        # istio-iptables' rule: join the backend that already has rules here, else nft.
        with_rules = [b for b in NETGUARD_BACKENDS
                      if any(xtables.has_rules(dumps.get((b, f), "")) for f in fams)]
        chosen = "legacy" if with_rules == ["legacy"] else "nft"
    else:
        chosen = state["backend"]
    found = {f: tools[(chosen, f)] for f in fams if (chosen, f) in dumps}
    live = {f: LiveFilter.parse(dumps[(chosen, f)]) for f in found}
    missing = {f: errors.get((chosen, f), "unknown error") for f in fams if f not in found}
    return chosen, found, live, missing


def detect(backend: str, families: tuple[str, ...] = FAMILIES):
    return detect_finish(detect_start(backend, families))


# ---------------------------------------------------------------- apply


def _lock_env(status_file: str) -> dict[str, str]:
    """Legacy iptables locks /run/xtables.lock. With a read-only root and no writable /run,
    put the lock beside the status file (a pod-private emptyDir: the lock only serialises
    writers of this netns, and netguard is the only one)."""
    env = dict(os.environ, LC_ALL="C")
    if "XTABLES_LOCKFILE" not in env and not os.access("/run", os.W_OK):
        d = os.path.dirname(status_file) if status_file else ""
        try:
            os.makedirs(d, exist_ok=True)
        except OSError:
            pass  # then the restore fails on the lock, and says so
        if d and os.access(d, os.W_OK):
            env["XTABLES_LOCKFILE"] = os.path.join(d, "xtables.lock")
    return env


def write_status(path: str, status: dict) -> None:
    if not path:
        return
    d = os.path.dirname(path) or "."
    os.makedirs(d, exist_ok=True)
    # A fresh name in the same directory (tempfile and its imports would cost the start more).
    tmp = os.path.join(d, f".netguard-{os.getpid()}-{os.urandom(6).hex()}")
    data = memoryview((jsontext.dumps(status, indent=2) + "\n").encode())  # ASCII: escaped
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:  # bytes straight to the descriptor: no text layer to set up for one write
            while data:
                data = data[os.write(fd, data):]
        finally:
            os.close(fd)
        os.chmod(tmp, 0o644)  # the sandbox container (any uid) reads it; nobody else writes
        os.replace(tmp, path)  # readers see the old or the new file, never half of one
    except BaseException:
        os.unlink(tmp)
        raise


def _cpu_ms() -> dict[str, float]:
    """CPU (user + sys) so far: this process's, and its finished children's (the iptables-*
    runs), so a start's cost can be told apart from the tools' (bench/netguard.py)."""
    import resource

    def ms(who: int) -> float:
        r = resource.getrusage(who)
        return round((r.ru_utime + r.ru_stime) * 1000, 2)

    return {"self": ms(resource.RUSAGE_SELF), "children": ms(resource.RUSAGE_CHILDREN)}


def cmd_apply(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    timings: dict[str, float] = {}

    def lap(name: str, t0: float) -> float:
        now = time.perf_counter()
        timings[name] = round((now - t0) * 1000, 2)
        return now

    config = _config(args, gateways=[])  # the gateways come with the netns read below
    blocked = [verify.parse_target(x) for x in args.verify_blocked]
    status: dict[str, Any] = {
        "version": STATUS_VERSION, "ok": False, "mode": config.egress,
        "ruleset_sha256": None, "options": config.to_dict(),
        "families": [], "backend": None, "verified": False, "probes": [], "pod_ips": [],
        "error": None,
    }
    env = _lock_env(args.status_file)
    applied: list[str] = []
    found: dict[str, xtables.Tools] = {}
    try:
        t = time.perf_counter()
        # The save processes run while netlink reads the addresses.
        pending = detect_start(args.backend)
        info = netinfo.read()
        chosen, found, live, missing = detect_finish(pending)
        t = lap("detect", t)
        config = config.with_gateways(info.gateways)
        status.update(backend=chosen, families=list(info.families), pod_ips=info.pod_ips,
                      options=config.to_dict(), ruleset_sha256=ruleset_sha256(config))
        for family in info.families:
            if family in missing:
                raise GuardError(f"cannot guard {family}: {missing[family]}")
        for family in info.families:
            xtables.restore(found[family], transaction(config, family, live[family]), env)
            applied.append(family)
        t = lap("apply", t)
        if args.verify:
            # Read back: the kernel holds exactly the ruleset (saves run in parallel).
            procs = {f: xtables.start_save(found[f], "filter") for f in info.families}
            problems = []
            for f, proc in procs.items():
                problems += diff_live(config, f, LiveFilter.parse(
                    xtables.finish_save(found[f], proc)))
            if problems:
                raise GuardError("read-back differs from the ruleset: " + "; ".join(problems))
            t = lap("readback", t)
            probes = verify.run(info.families, blocked, args.verify_timeout,
                                info.has_ipv6_loopback,
                                verify.never_targets(config, info.families))
            status["probes"] = [p.to_dict() for p in probes]
            t = lap("verify", t)
            bad = [p for p in probes if not p.ok]
            if bad:
                raise GuardError("self-verify failed: " + "; ".join(
                    f"{p.target} should be {p.want} but was {p.outcome} after {p.ms:.0f} ms"
                    for p in bad))
            status["verified"] = True
        status["ok"] = True
    except Exception as e:  # fail closed on anything, expected or not
        msg = str(e) if isinstance(e, GuardError | xtables.XtablesError | ConfigError) else (
            f"unexpected {type(e).__name__}: {e}")
        if applied:
            msg += _lock_down(config, applied, found, env)
        status["error"] = msg
        if status["ruleset_sha256"] is None:  # failed before the gateways were read
            status["ruleset_sha256"] = ruleset_sha256(config)
        raise GuardError(msg) from None
    finally:
        timings["total"] = round((time.perf_counter() - t_start) * 1000, 2)
        status["timings_ms"] = timings
        status["cpu_ms"] = _cpu_ms()
        status["time"] = utc_now()
        try:
            write_status(args.status_file, status)
        except OSError as e:
            if status["ok"]:
                raise GuardError(f"cannot write status file {args.status_file}: {e}") from None
    if args.install_execd:
        # After the guard: a failure here still exits non-zero, so the sandbox never starts.
        from execd.install import install

        try:
            install(args.install_execd)
        except OSError as e:
            raise GuardError(f"guard in place, but execd cannot be installed into "
                             f"{args.install_execd}: {e}") from None
    if config.ingress_from_gateway:
        say(args, "netguard: gateway admitted to port "
            f"{config.ingress_port}: {', '.join(map(str, config.ingress_gateways)) or 'none found (no default route)'}")
    say(args, f"netguard: egress {config.egress}, {'+'.join(status['families'])} via "
        f"{status['backend']}, ruleset {status['ruleset_sha256'][:12]}, "
        f"{'verified' if status['verified'] else 'NOT verified (--no-verify)'} "
        f"in {timings['total']:.0f} ms"
        + (f", execd installed in {args.install_execd}" if args.install_execd else ""))
    return 0


def _lock_down(config: Config, applied: list[str], found, env) -> str:
    """After a failure, replace each family already applied with the lockdown ruleset (egress
    denied, no allow entries, loopback-only ingress) so no allow rule outlives a failed apply."""
    notes = []
    for family in applied:
        try:
            live = LiveFilter.parse(xtables.save(found[family]))
            xtables.restore(found[family], transaction(config.locked_down(), family, live), env)
            notes.append(f"{family} locked down")
        except (xtables.XtablesError, OSError) as e:
            notes.append(f"{family} lockdown FAILED: {e}")
    return " (" + ", ".join(notes) + ")"


# ---------------------------------------------------------------- render / check


def cmd_render(args: argparse.Namespace) -> int:
    config = _config(args)
    fams = FAMILIES if args.family == "all" else (args.family,)
    if not args.live:
        sys.stdout.write(render(config, fams))
        return 0
    chosen, found, live, missing = detect(args.backend, fams)
    for family in fams:
        if family in missing:
            raise GuardError(missing[family])
        sys.stdout.write(f"# {family}: {found[family].restore} --noflush ({chosen})\n")
        sys.stdout.write(transaction(config, family, live[family]))
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    status = None
    if args.status_file and os.path.exists(args.status_file):
        import json

        with open(args.status_file) as f:
            status = json.load(f)
    if _given(args) or not status or "options" not in status:
        config = _config(args)
    else:
        config = Config.from_dict(status["options"])
    if status and status.get("families"):
        fams = tuple(f for f in status["families"] if f in FAMILIES)
    else:
        fams = (IPV4, IPV6) if netinfo.ipv6_enabled() else (IPV4,)
    backend = args.backend
    if backend == "auto" and status and status.get("backend") in NETGUARD_BACKENDS:
        backend = status["backend"]
    chosen, found, live, missing = detect(backend, fams)
    problems = [f"{f}: {missing[f]}" for f in fams if f in missing]
    for family in fams:
        if family in live:
            problems += diff_live(config, family, live[family])
    sha = ruleset_sha256(config)[:12]
    if problems:
        for p in problems:
            say(args, f"netguard check: {p}", "ERROR")
        say(args, f"netguard check: MISMATCH with ruleset {sha} ({chosen})", "ERROR")
        return 1
    say(args, f"netguard check: {'+'.join(fams)} match ruleset {sha} ({chosen})")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = fast_apply_args(argv) or build_parser().parse_args(argv)
    handler = {"apply": cmd_apply, "render": cmd_render, "check": cmd_check}[args.cmd]
    try:
        return handler(args)
    except (GuardError, ConfigError, xtables.XtablesError) as e:
        msg = f"error: {e}"
    except Exception as e:  # anything unexpected still fails closed, in one line
        msg = f"unexpected {type(e).__name__}: {e}"
    say(args, f"netguard {args.cmd}: " + " | ".join(msg.splitlines()), "ERROR", sys.stderr)
    return 1
