"""Finding and running iptables-save / iptables-restore for the nft or legacy backend.

Backend choice follows istio-iptables: use whichever backend already holds rules in this network
namespace (kube-proxy, a CNI, an earlier netguard); if neither does, nft. Two backends holding
rules for one netns would fight, so joining the one in use matters more than preferring either.
"""

from __future__ import annotations

import os

from netguard import proc
from netguard.config import IPV4, IPV6
from netguard.values import Frozen

_PREFIX = {IPV4: "iptables", IPV6: "ip6tables"}

# Legacy iptables-restore serialises writers with a lock file (default /run/xtables.lock). Wait
# for it rather than fail when another writer holds it; nft ignores the lock and the flag.
WAIT_SECONDS = 5
# Restore and save touch only this netns's tables and take milliseconds; a hang means trouble.
EXEC_TIMEOUT = 30


class XtablesError(RuntimeError):
    """A missing binary or a failed save/restore; reported in one line, exit non-zero."""


class Tools(Frozen):
    """The save and restore binaries of one backend for one family."""

    backend: str
    family: str
    save: str
    restore: str
    FIELDS = ("backend", "family", "save", "restore")


def _flavour(path: str) -> str | None:
    """'nft' or 'legacy' for an unsuffixed iptables-* binary, from its --version."""
    try:
        _, out, _ = proc.run([path, "--version"], timeout=EXEC_TIMEOUT)
    except (OSError, proc.Timeout):
        return None
    return "nft" if "nf_tables" in out else "legacy"


def _which(name: str) -> str | None:
    """shutil.which for a bare name (shutil, with its compression imports, costs every pod's
    start more CPU than the lookup)."""
    for d in os.environ.get("PATH", os.defpath).split(os.pathsep):
        path = os.path.join(d or ".", name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def find_tools(backend: str, family: str) -> Tools:
    """Resolve `<prefix>-<backend>-save/restore` on PATH, else the unsuffixed pair if it is
    that backend. Raises XtablesError naming what is missing."""
    prefix = _PREFIX[family]
    found = {}
    for verb in ("restore", "save"):
        path = _which(f"{prefix}-{backend}-{verb}")
        if path is None:
            plain = _which(f"{prefix}-{verb}")
            if plain is not None and _flavour(plain) == backend:
                path = plain
        if path is None:
            raise XtablesError(f"{prefix}-{verb} for the {backend} backend not found on PATH "
                               f"(looked for {prefix}-{backend}-{verb} and {prefix}-{verb})")
        found[verb] = path
    return Tools(backend, family, found["save"], found["restore"])


def _env() -> dict[str, str]:
    return dict(os.environ, LC_ALL="C")


def start_save(tools: Tools, table: str | None = None) -> proc.Child:
    """Start `iptables-save [-t TABLE]` without waiting (detection runs these in parallel)."""
    cmd = [tools.save] + (["-t", table] if table else [])
    return proc.Child(cmd, _env())


def finish_save(tools: Tools, child: proc.Child) -> str:
    try:
        out, err = child.communicate(timeout=EXEC_TIMEOUT)
    except proc.Timeout:
        raise XtablesError(f"{tools.save} did not finish in {EXEC_TIMEOUT} s") from None
    if child.returncode != 0:
        raise XtablesError(f"{tools.save} failed (exit {child.returncode}): {_first_line(err)}")
    return out


def save(tools: Tools, table: str | None = "filter") -> str:
    return finish_save(tools, start_save(tools, table))


def restore(tools: Tools, text: str, env: dict[str, str] | None = None) -> None:
    """Apply one transaction with `--noflush`: all of it, or (on any error) none of it."""
    cmd = [tools.restore, "--noflush", f"--wait={WAIT_SECONDS}"]
    try:
        code, out, err = proc.run(cmd, text, EXEC_TIMEOUT, env or _env())
    except proc.Timeout:
        raise XtablesError(f"{tools.restore} did not finish in {EXEC_TIMEOUT} s") from None
    except OSError as e:
        raise XtablesError(f"cannot run {tools.restore}: {e}") from None
    if code != 0:
        raise XtablesError(f"{tools.restore} failed (exit {code}): {_first_line(err or out)}")


def has_rules(save_output: str) -> bool:
    """True when a save dump holds at least one rule (istio counts lines; rules are sharper)."""
    return any(line.startswith("-A ") for line in save_output.splitlines())


def _first_line(text: str) -> str:
    lines = [x.strip() for x in (text or "").splitlines() if x.strip()]
    return lines[0] if lines else "(no message)"
