"""The framework tests' venv, .venv-frameworks: Python 3.12 with requirements-frameworks.lock
(the client's extras that need a newer Python than the dev venv's 3.11: Harbor, NeMo Gym) and the
client distribution from this tree, editable.

The interpreter: $FRAMEWORKS_PYTHON, else a `python3.12` under pyenv's versions (the machine
image's; its shims answer only for the global version), else a `python3.12` on PATH that runs.
The install is uv's (the dev lock pins it), hash-checked and without dependencies of its own,
as `make deps` installs the dev lock; a stamp holding the lock's and client pyproject's digest
skips it when nothing changed.

    python3 tools/frameworks_venv.py          # create or update (make deps)
    python3 tools/frameworks_venv.py --path   # print the venv's python, or exit 1
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-frameworks"
LOCK = ROOT / "requirements-frameworks.lock"
STAMP = VENV / ".deps-stamp"
VERSION = (3, 12)


def _runs(python: str) -> bool:
    want = f"{VERSION[0]}.{VERSION[1]}"
    try:
        out = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and out.stdout.strip() == want


def find_python() -> str:
    name = f"python{VERSION[0]}.{VERSION[1]}"
    candidates = [os.environ.get("FRAMEWORKS_PYTHON", "")]
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    if pyenv.is_dir():
        candidates += [str(p / "bin" / name) for p in sorted(
            pyenv.glob(f"{VERSION[0]}.{VERSION[1]}.*"), reverse=True)]
    candidates.append(shutil.which(name) or "")
    for c in candidates:
        if c and _runs(c):
            return c
    raise SystemExit(f"frameworks venv: no {name} found ($FRAMEWORKS_PYTHON, "
                     f"{pyenv}/{VERSION[0]}.{VERSION[1]}.*, PATH); the Harbor tests need one")


def _digest() -> str:
    h = hashlib.sha256()
    for p in (LOCK, ROOT / "client" / "pyproject.toml"):
        h.update(p.read_bytes())
    return h.hexdigest()


def _uv() -> str:
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    if not uv:
        raise SystemExit("frameworks venv: `uv` not found (it is in the dev lock: make deps)")
    return uv


def check(uv: str, env: dict[str, str]) -> None:
    """`uv pip check`, but for the dependencies of the frameworks locked without theirs
    (tools/lock.py NO_DEPS): every other missing or conflicting package fails."""
    sys.path.insert(0, str(ROOT))
    from tools.lock import NO_DEPS, canonical

    out = subprocess.run([uv, "pip", "check"], env=env, capture_output=True, text=True)
    if out.returncode == 0:
        return
    # "The package `nemo-gym` requires `openai<=2.7.2`, but it's not installed"
    lines = [ln.strip() for ln in (out.stdout + out.stderr).splitlines()]
    named = [ln for ln in lines if ln.startswith("The package `")]
    if not named or any(canonical(ln.split("`")[1]) not in NO_DEPS for ln in named):
        raise SystemExit("frameworks venv: uv pip check failed:\n" + out.stdout + out.stderr)


def ensure() -> Path:
    python = VENV / "bin" / "python"
    digest = _digest()
    if python.exists() and STAMP.exists() and STAMP.read_text().strip() == digest \
            and _runs(str(python)):
        return python
    env = dict(os.environ, UV_NO_CONFIG="1", UV_PYTHON_DOWNLOADS="never",
               VIRTUAL_ENV=str(VENV))
    uv = _uv()
    subprocess.run([uv, "venv", "--quiet", "--clear", "--python", find_python(), str(VENV)],
                   check=True, env=env)
    subprocess.run([uv, "pip", "install", "--quiet", "--require-hashes", "--no-deps",
                    "-r", str(LOCK)], check=True, env=env)
    subprocess.run([uv, "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "-e", str(ROOT / "client")], check=True, env=env)
    check(uv, env)
    STAMP.write_text(digest + "\n")
    return python


def main(argv: list[str]) -> int:
    if argv == ["--path"]:
        python = VENV / "bin" / "python"
        if not python.exists():
            return 1
        print(python)
        return 0
    if argv:
        print("usage: tools/frameworks_venv.py [--path]", file=sys.stderr)
        return 2
    print(f"frameworks venv: {ensure()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
