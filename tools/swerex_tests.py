"""SWE-ReX's own runtime tests, tests/test_execution.py of its sdist at the version
requirements-dev.lock pins, hash-checked against the lock's hashes (pip download
--require-hashes), extracted into the test bed's cache. tests/controller/test_swerex_upstream.py
runs them against sandman's adapter; a `make lock` that moves swe-rex moves them with it.

    python3 tools/swerex_tests.py   # print the file's path (fetched from PyPI when missing)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEV_LOCK = ROOT / "requirements-dev.lock"
MEMBER = "tests/test_execution.py"


def locked(lock: Path = DEV_LOCK) -> tuple[str, str]:
    """swe-rex's pinned version and its lock entry (the version and every hash)."""
    m = re.search(r"^swe-rex==(\S+)(?: ;[^\\\n]*)? \\\n((?:    --hash=sha256:[0-9a-f]{64}(?: \\)?\n)+)",
                  lock.read_text(), re.M)
    if not m:
        raise SystemExit(f"swerex tests: no swe-rex entry with hashes in {lock.name}")
    return m.group(1), m.group(0)


def ensure(lock: Path = DEV_LOCK, cache: Path | None = None,
           pip_args: tuple[str, ...] = ()) -> Path:
    """The cached file, fetched first when missing. `cache`: default the test bed's cache
    ($SANDMAN_TESTBED_CACHE, ~/.cache/sandman-testbed); `pip_args`: added to pip download's
    (tests: an index of their own)."""
    if cache is None:
        sys.path.insert(0, str(ROOT))
        from testbed.build import cache_dir

        cache = cache_dir()
    version, entry = locked(lock)
    out = cache / "swerex-tests" / version / "test_execution.py"
    if out.exists():
        return out
    with tempfile.TemporaryDirectory(prefix="sandman-swerex-") as tmp:
        req = Path(tmp) / "requirements.txt"
        req.write_text(entry)
        # The sdist (what has the tests), its hash one of the lock's; pip reads its metadata
        # with the venv's locked setuptools (--no-build-isolation), never an unlocked one.
        got = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
             "--no-deps", "--no-binary", ":all:", "--no-build-isolation", "--require-hashes",
             "-r", str(req), "-d", tmp, *pip_args], capture_output=True, text=True)
        if got.returncode != 0:
            bad = re.search(r"^\s*Got\s+([0-9a-f]{64})\s*$", got.stderr, re.M)
            why = (f"its sha256 {bad.group(1)} is none the lock lists" if bad else
                   (got.stderr.strip().splitlines() or ["no output"])[-1].strip())
            raise SystemExit(f"swerex tests: pip download of swe-rex=={version} failed: {why}")
        [sdist] = Path(tmp).glob("swe_rex-*.tar.gz")  # --no-deps: the one file
        with tarfile.open(sdist) as tar:  # one member read, nothing extracted to disk
            try:
                member = tar.extractfile(f"{sdist.name[:-len('.tar.gz')]}/{MEMBER}")
            except KeyError:
                member = None
            if member is None:
                raise SystemExit(f"swerex tests: {sdist.name} has no {MEMBER}")
            data = member.read()
    out.parent.mkdir(parents=True, exist_ok=True)
    # A temp file of this process's own, then an atomic rename: two runs fetching at once
    # (make deps beside a test) never see, or leave, half a file.
    with tempfile.NamedTemporaryFile(dir=out.parent, suffix=".tmp", delete=False) as f:
        f.write(data)
    os.chmod(f.name, 0o644)
    Path(f.name).replace(out)
    return out


if __name__ == "__main__":
    print(ensure())
