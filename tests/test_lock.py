"""requirements*.lock (tools/lock.py): current with the pyprojects, hash-checked, and what this
venv has installed. Offline: the lock's header records the declared set it was made from."""

from __future__ import annotations

import importlib.metadata
import re
import shutil

import pytest
from packaging.markers import Marker

from tools import lock


@pytest.mark.parametrize("dev", [True, False], ids=["dev", "runtime"])
def test_locks_are_current(dev):
    path = lock.DEV_LOCK if dev else lock.RUNTIME_LOCK
    assert lock.problems(path, dev) == []


def test_runtime_pins_are_the_dev_pins():
    # Markers may read differently (a package reached by other paths); versions may not.
    dev = {(n, v) for n, v, _ in lock.entries(lock.DEV_LOCK)}
    runtime = {(n, v) for n, v, _ in lock.entries(lock.RUNTIME_LOCK)}
    assert runtime and runtime < dev, runtime - dev


def test_entries_read_forks_and_markers():
    assert any(marker for _, _, marker in lock.entries(lock.DEV_LOCK))
    n = sum(1 for ln in lock.DEV_LOCK.read_text().splitlines() if re.match(r"[A-Za-z0-9]", ln))
    assert len(lock.entries(lock.DEV_LOCK)) == n


def test_this_venv_has_the_dev_lock_installed():
    """`make deps` installs from the lock: every entry that applies here is installed at its
    version (a `pip install` outside the lock shows up as a difference)."""
    wrong = []
    for name, version, marker in lock.entries(lock.DEV_LOCK):
        if marker and not Marker(marker.strip()).evaluate():
            continue
        try:
            got = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            got = None
        if got != version:
            wrong.append(f"{name}: locked {version}, installed {got}")
    assert not wrong, "; ".join(wrong) + " (make deps)"


@pytest.fixture
def copies(tmp_path, monkeypatch):
    """tools.lock pointed at copies of the pyprojects and locks, to edit them."""
    (tmp_path / "client").mkdir()
    for attr, rel in (("SERVER", "pyproject.toml"), ("CLIENT", "client/pyproject.toml"),
                      ("DEV_LOCK", "requirements-dev.lock"),
                      ("RUNTIME_LOCK", "requirements.lock")):
        shutil.copy2(getattr(lock, attr), tmp_path / rel)
        monkeypatch.setattr(lock, attr, tmp_path / rel)
    return tmp_path


def test_a_changed_range_makes_the_lock_stale(copies):
    server = copies / "pyproject.toml"
    server.write_text(server.read_text().replace('"jsonpatch>=1.48,<2"', '"jsonpatch>=1.48,<3"'))
    for dev, path in ((True, lock.DEV_LOCK), (False, lock.RUNTIME_LOCK)):
        assert any("other requirements" in p for p in lock.problems(path, dev))
    assert lock.main(["check"]) == 1


def test_a_new_dependency_makes_the_lock_stale(copies):
    client = copies / "client" / "pyproject.toml"
    client.write_text(client.read_text().replace('dependencies = ["httpx>=0.27,<1"]',
                                                 'dependencies = ["httpx>=0.27,<1", "tomli-w"]'))
    found = lock.problems(lock.RUNTIME_LOCK, dev=False)
    assert any("other requirements" in p for p in found)
    assert any("no pin for tomli-w" in p for p in found)


def test_a_pin_outside_its_range_or_without_hash_is_refused(copies):
    text = lock.RUNTIME_LOCK.read_text()
    (version,) = lock.pins(lock.RUNTIME_LOCK)["fastapi"]
    lock.RUNTIME_LOCK.write_text(text.replace(f"fastapi=={version}", "fastapi==0.100.0"))
    assert any("pins fastapi==0.100.0, outside" in p
               for p in lock.problems(lock.RUNTIME_LOCK, dev=False))
    lock.RUNTIME_LOCK.write_text(re.sub(r"(?m)^(idna==\S+) \\\n(    --hash=\S+ \\\n)*"
                                        r"    --hash=\S+\n", r"\1\n", text))
    assert any("without a hash: idna" in p for p in lock.problems(lock.RUNTIME_LOCK, dev=False))
