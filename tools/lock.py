"""The server's lock files: every transitive PyPI package at one version, hash-checked.

pyproject.toml (and client/pyproject.toml) declare ranges; what machines install is
- requirements-dev.lock: the server, the client, their build backend and every extra of both
  (dev, the client's adapters; `make deps`, so CI);
- requirements.lock: the server, the client and their build backend (images/Dockerfile),
both `uv pip compile --universal --generate-hashes` for Python 3.11 (the server's floor and
the image's interpreter), installed with `pip install --require-hashes --no-deps`;
- requirements-frameworks.lock: the client, its build backend and the client's extras that
need a newer Python than 3.11 (Harbor: 3.12), for Python 3.12: the venv the framework tests
drive (.venv-frameworks, tools/frameworks_venv.py; `make deps`). The runtime
lock is resolved under the dev lock's pins, so both name the same version of every package they
share. Our own two distributions are not in them: they are installed from the tree.

Each lock's header records the SHA-256 of the requirement set it was generated from; `check`
(tests/test_lock.py, offline) fails when a pyproject's declared set changed since, or when a
pin no longer satisfies a declared range.

    python3 tools/lock.py            # regenerate all three (needs PyPI), after editing a pyproject
    python3 tools/lock.py --upgrade  # the same, every package at its newest allowed version
    python3 tools/lock.py check      # are they current? (exit 1 with the reason)

A regeneration keeps every version the current lock pins that still satisfies the declared
set (uv prefers the pins of an existing output file): a pyproject edit moves only what it has
to, and upgrades are their own, reviewed step (`--upgrade`).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVER = ROOT / "pyproject.toml"
CLIENT = ROOT / "client" / "pyproject.toml"
RUNTIME_LOCK = ROOT / "requirements.lock"
DEV_LOCK = ROOT / "requirements-dev.lock"
FRAMEWORKS_LOCK = ROOT / "requirements-frameworks.lock"
PYTHON = "3.11"
FRAMEWORKS_PYTHON = "3.12"
OURS = {"sandman", "sandman-client"}
# Frameworks locked without their dependencies: the frameworks venv uses only a part of them
# that needs none, and their full sets cannot share one venv with the others'. nemo-gym: its
# sandbox provider API (nemo_gym.sandbox) is standard library only, and its pins
# (openai<=2.7.2) contradict Harbor's (litellm: openai>=2.20).
NO_DEPS = {"nemo-gym"}
HEADER = "# input-sha256: "


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _name(req: str) -> str:
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    if not m:
        raise ValueError(f"cannot read a package name in requirement {req!r}")
    return canonical(m.group(1))


def _newer_python_only(extra: list[str]) -> bool:
    """An extra none of whose requirements installs on PYTHON (each is marked for a newer one):
    it has no place in the 3.11 locks, only in the frameworks lock."""
    from packaging.requirements import Requirement

    env = {"python_version": PYTHON, "python_full_version": f"{PYTHON}.0"}
    return all(Requirement(r).marker is not None and not Requirement(r).marker.evaluate(env)
               for r in extra)


def declared(dev: bool) -> list[str]:
    """The third-party requirements the lock must satisfy, sorted: the server's dependencies
    (without our own distributions), the client's, what builds both (setuptools: they are
    installed without build isolation), and with `dev` every extra of both (dev included)
    but those for a newer Python only (the frameworks lock's)."""
    server_toml = tomllib.loads(SERVER.read_text())
    client_toml = tomllib.loads(CLIENT.read_text())
    server, client = server_toml["project"], client_toml["project"]
    reqs = list(server["dependencies"]) + list(client["dependencies"])
    reqs += server_toml["build-system"]["requires"] + client_toml["build-system"]["requires"]
    if dev:
        # The dev venv has every extra of both: the tests of an adapter (the client's extras,
        # e.g. swerex) and of the load tests need their packages.
        for project in (server, client):
            for extra in project.get("optional-dependencies", {}).values():
                if not _newer_python_only(extra):
                    reqs += extra
    return sorted({r.strip() for r in reqs if _name(r) not in OURS})


def declared_frameworks() -> list[str]:
    """The frameworks lock's set: the client's dependencies and build backend, and its
    extras for a newer Python than PYTHON."""
    client_toml = tomllib.loads(CLIENT.read_text())
    client = client_toml["project"]
    reqs = list(client["dependencies"]) + client_toml["build-system"]["requires"]
    for extra in client.get("optional-dependencies", {}).values():
        if _newer_python_only(extra):
            reqs += extra
    return sorted({r.strip() for r in reqs if _name(r) not in OURS})


def input_digest(reqs: list[str]) -> str:
    return hashlib.sha256(("\n".join(reqs) + "\n").encode()).hexdigest()


ENTRY = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)(?: ; ([^\\\n]+?))?\s*\\?$", re.M)


def entries(lock: Path) -> list[tuple[str, str, str | None]]:
    """(name, version, marker or None) of every entry of a lock. A universal lock can pin one
    package twice, under exclusive markers (numpy: one version below Python 3.12, one above)."""
    return [(canonical(m.group(1)), m.group(2), m.group(3)) for m in ENTRY.finditer(
        lock.read_text())]


def pins(lock: Path) -> dict[str, set[str]]:
    """name -> every version a lock pins it at."""
    out: dict[str, set[str]] = {}
    for name, version, _ in entries(lock):
        out.setdefault(name, set()).add(version)
    return out


def problems(lock: Path, dev: bool, reqs: list[str] | None = None) -> list[str]:
    """Why `lock` is not the current lock of the declared set ([] when it is): `reqs`, else
    declared(dev)."""
    from packaging.requirements import Requirement

    if not lock.exists():
        return [f"{lock.name} is missing"]
    text = lock.read_text()
    reqs = declared(dev) if reqs is None else reqs
    recorded = next((ln[len(HEADER):].strip() for ln in text.splitlines()
                     if ln.startswith(HEADER)), None)
    out = []
    if recorded != input_digest(reqs):
        out.append(f"{lock.name} was generated from other requirements than the pyprojects "
                   f"declare now")
    pinned = pins(lock)
    for r in reqs:
        req = Requirement(r)
        versions = pinned.get(canonical(req.name))
        if not versions:
            out.append(f"{lock.name} has no pin for {req.name}")
        for version in sorted(versions or ()):
            if not req.specifier.contains(version, prereleases=True):
                out.append(f"{lock.name} pins {req.name}=={version}, outside {r!r}")
    entries = re.split(r"\n(?=[A-Za-z0-9])", text)
    unhashed = [e.split("==")[0] for e in entries if "==" in e and "--hash=sha256:" not in e]
    if unhashed:
        out.append(f"{lock.name}: entries without a hash: {', '.join(unhashed)}")
    return out


def _uv() -> str:
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    if not uv:
        raise SystemExit("lock: `uv` not found (it is in the dev extra: make deps)")
    return uv


def _resolve(reqs: list[str], out: Path, constraints: Path | None, upgrade: bool,
             python: str, no_deps: bool = False) -> str:
    """uv's hash-checked pins of `reqs` (with `no_deps`, of those packages alone)."""
    with tempfile.TemporaryDirectory(prefix="sandman-lock-") as tmp:
        src = Path(tmp) / "requirements.in"
        src.write_text("\n".join(reqs) + "\n")
        if out.exists() and not upgrade:  # its pins become uv's preferences
            shutil.copyfile(out, Path(tmp) / "out.txt")
        cmd = [_uv(), "pip", "compile", "--quiet", "--universal", "--generate-hashes",
               "--python-version", python, "--no-header", "--no-annotate", str(src),
               "-o", str(Path(tmp) / "out.txt")]
        if constraints:
            cmd += ["--constraint", str(constraints)]
        if no_deps:
            cmd.append("--no-deps")
        subprocess.run(cmd, check=True, env=dict(os.environ, UV_NO_CONFIG="1"))
        return (Path(tmp) / "out.txt").read_text()


def _compile(reqs: list[str], out: Path, constraints: Path | None, upgrade: bool,
             python: str = PYTHON) -> None:
    alone = [r for r in reqs if _name(r) in NO_DEPS]
    body = _resolve([r for r in reqs if r not in alone], out, constraints, upgrade, python)
    if alone:
        pinned = _resolve(alone, out, constraints, upgrade, python, no_deps=True)
        body = "".join(sorted(re.split(r"(?<=\n)(?=[A-Za-z0-9])", body + pinned),
                              key=lambda e: canonical(e.split("=", 1)[0])))
    out.write_text(
        "# Generated by `python3 tools/lock.py` (make lock) from pyproject.toml and\n"
        "# client/pyproject.toml: do not edit. Install with\n"
        f"#   pip install --require-hashes --no-deps -r {out.name}\n"
        f"{HEADER}{input_digest(reqs)}\n" + body)


def generate(upgrade: bool = False) -> None:
    _compile(declared(dev=True), DEV_LOCK, None, upgrade)
    with tempfile.TemporaryDirectory(prefix="sandman-lock-") as tmp:
        # The dev lock's versions as plain constraints, markers kept (no hashes).
        cons = Path(tmp) / "constraints.txt"
        cons.write_text("".join(f"{n}=={v}" + (f" ; {m}" if m else "") + "\n"
                                for n, v, m in entries(DEV_LOCK)))
        _compile(declared(dev=False), RUNTIME_LOCK, cons, upgrade)
    _compile(declared_frameworks(), FRAMEWORKS_LOCK, None, upgrade, FRAMEWORKS_PYTHON)


def main(argv: list[str]) -> int:
    if argv == ["check"]:
        found = (problems(DEV_LOCK, dev=True) + problems(RUNTIME_LOCK, dev=False)
                 + problems(FRAMEWORKS_LOCK, dev=False, reqs=declared_frameworks()))
        for p in found:
            print(f"lock: {p}; run `make lock`", file=sys.stderr)
        return 1 if found else 0
    if argv not in ([], ["--upgrade"]):
        print("usage: tools/lock.py [check | --upgrade]", file=sys.stderr)
        return 2
    generate(upgrade=argv == ["--upgrade"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
