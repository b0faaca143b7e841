"""tools/swerex_tests.py, offline: real pip against an index of the test's own (a local folder
holding a stand-in swe-rex sdist), so what is proven is the tool's checks, not PyPI's: the
upstream tests come only from an sdist whose SHA-256 the lock lists, nothing is cached
otherwise, and each refusal is one line."""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

import pytest

from tools import swerex_tests

TESTS = b"async def test_upstream():\n    pass\n"
OTHER = "0" * 64


def _sdist(index: Path, files: dict[str, bytes]) -> str:
    """A minimal swe-rex 9.9.9 sdist in `index`; its SHA-256."""
    index.mkdir(exist_ok=True)
    base = {"pyproject.toml": b'[build-system]\nrequires = ["setuptools"]\n'
                              b'build-backend = "setuptools.build_meta"\n'
                              b'[project]\nname = "swe-rex"\nversion = "9.9.9"\n'
                              b'[tool.setuptools]\npy-modules = []\n',
            "PKG-INFO": b"Metadata-Version: 2.1\nName: swe-rex\nVersion: 9.9.9\n"}
    path = index / "swe_rex-9.9.9.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, data in {**base, **files}.items():
            info = tarfile.TarInfo(f"swe_rex-9.9.9/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _lock(tmp_path: Path, *hashes: str) -> Path:
    lines = "".join(f"    --hash=sha256:{h} \\\n" for h in hashes).rstrip(" \\\n") + "\n"
    lock = tmp_path / "requirements-dev.lock"
    lock.write_text(f"starlette==1.0 \\\n    --hash=sha256:{OTHER}\nswe-rex==9.9.9 \\\n{lines}"
                    f"tenacity==9.2.1 \\\n    --hash=sha256:{OTHER}\n")
    return lock


def _ensure(tmp_path: Path, lock: Path) -> Path:
    return swerex_tests.ensure(lock, tmp_path / "cache",
                               ("--no-index", "--find-links", str(tmp_path / "index")))


def test_an_sdist_the_lock_lists_gives_its_tests(tmp_path):
    digest = _sdist(tmp_path / "index", {swerex_tests.MEMBER: TESTS})
    got = _ensure(tmp_path, _lock(tmp_path, OTHER, digest))
    assert got == tmp_path / "cache" / "swerex-tests" / "9.9.9" / "test_execution.py"
    assert got.read_bytes() == TESTS
    assert [p.name for p in got.parent.iterdir()] == ["test_execution.py"]


def test_an_sdist_the_lock_does_not_list_is_refused_and_nothing_cached(tmp_path):
    # The index serves other bytes under the pinned name and version: a hostile mirror.
    _sdist(tmp_path / "index", {swerex_tests.MEMBER: b"import os; os.system('evil')\n"})
    with pytest.raises(SystemExit, match=r"^swerex tests: pip download of swe-rex==9\.9\.9 "
                                         r"failed: its sha256 [0-9a-f]{64} is none the lock lists$") as e:
        _ensure(tmp_path, _lock(tmp_path, OTHER))
    assert "\n" not in str(e.value)
    assert not (tmp_path / "cache").exists()


def test_an_sdist_without_the_tests_is_one_line(tmp_path):
    digest = _sdist(tmp_path / "index", {})
    with pytest.raises(SystemExit, match=r"^swerex tests: swe_rex-9\.9\.9\.tar\.gz has no "
                                         r"tests/test_execution\.py$"):
        _ensure(tmp_path, _lock(tmp_path, digest))
    assert not (tmp_path / "cache").exists()


def test_a_lock_without_swe_rex_is_one_line(tmp_path):
    lock = tmp_path / "requirements-dev.lock"
    lock.write_text(f"starlette==1.0 \\\n    --hash=sha256:{OTHER}\nswe-rex==9.9.9\n")
    with pytest.raises(SystemExit, match=r"^swerex tests: no swe-rex entry with hashes in "
                                         r"requirements-dev\.lock$"):
        swerex_tests.locked(lock)


def test_the_real_lock_pins_swe_rex_with_hashes():
    version, entry = swerex_tests.locked()
    assert version and entry.count("--hash=sha256:") >= 1
