"""execd/install.py: what a sandbox's /sandman holds after the install, written as the guard
(root) writes it: read-only files, the daemon package's modules with their sources' mtimes, the
launcher last, and nothing written through a link planted in the volume."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from execd import install

REPO = Path(__file__).resolve().parents[2]


def test_install_leaves_the_pods_layout(tmp_path):
    written = install.install(str(tmp_path))
    assert Path(written[-1]).name == "execd.py"  # the file the sandbox runs comes last
    assert (tmp_path / "execd.py").read_bytes() == (REPO / "execd" / "execd.py").read_bytes()
    src_pkg = REPO / "execd" / install.DAEMON
    modules = sorted(p.name for p in src_pkg.glob("*.py"))
    assert sorted(p.name for p in (tmp_path / install.DAEMON).glob("*.py")) == modules
    for name in modules:
        src, got = src_pkg / name, tmp_path / install.DAEMON / name
        assert got.read_bytes() == src.read_bytes()
        assert got.stat().st_mtime_ns == src.stat().st_mtime_ns  # the bytecode's check
    for f in written:
        assert os.stat(f).st_mode & 0o777 == 0o444, f
    assert (tmp_path / "run").is_dir()
    assert not list(tmp_path.rglob("*.tmp"))
    assert install.install(str(tmp_path)) == written  # a restarted init container


def test_a_link_planted_at_a_temporary_name_is_removed_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("unchanged\n")
    volume = tmp_path / "volume"
    volume.mkdir()
    (volume / "execd.py.tmp").symlink_to(victim)
    (volume / install.DAEMON).mkdir()
    (volume / install.DAEMON / "main.py.tmp").symlink_to(victim)
    install.install(str(volume))
    assert victim.read_text() == "unchanged\n"
    assert (volume / install.DAEMON / "main.py").read_bytes() == (
        REPO / "execd" / install.DAEMON / "main.py").read_bytes()
    assert (volume / "execd.py").read_bytes() == (REPO / "execd" / "execd.py").read_bytes()
    assert not (volume / "execd.py").is_symlink()


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "execd.install", *args], capture_output=True,
                          text=True, timeout=60, cwd=REPO)


def test_the_command_line_says_what_is_wrong_in_one_line(tmp_path):
    for args in ((), ("a", "b"), ("--help",)):
        p = _run(*args)
        assert p.returncode == 2 and p.stderr.strip().splitlines() == [
            "usage: python3 -m execd.install DIR"], (args, p.stderr)
    p = _run(str(tmp_path / "missing"))
    assert p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "cannot install into" in p.stderr
    p = _run(str(tmp_path))
    assert p.returncode == 0 and (tmp_path / "execd.py").is_file(), p.stderr


@pytest.mark.parametrize("flags,prefix,src", [
    ([], None, "/opt/x/execd.py"), (["-O"], None, "/opt/x/execd.py"),
    (["-OO"], None, "/opt/x/execd.py"), ([], "/tmp/pfx", "/opt/x/execd.py"),
    (["-O"], "/tmp/pfx", "rel/dir/execd.py"), ([], None, "/a.b/execd.py"),
])
def test_bytecode_path_is_what_importlib_would_use(flags, prefix, src):
    """install's bytecode_path against importlib.util.cache_from_source, in an interpreter
    with each setting it reads (the -O level, the pycache prefix, a relative path)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPYCACHEPREFIX"}
    if prefix:
        env["PYTHONPYCACHEPREFIX"] = prefix
    code = ("import sys, importlib.util, execd.install as i\n"
            f"src = {src!r}\n"
            "print(i.bytecode_path(src) == importlib.util.cache_from_source(src),"
            " i.bytecode_path(src))")
    out = subprocess.run([sys.executable, *flags, "-c", code], env=env, capture_output=True,
                         text=True, timeout=60, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                             os.path.abspath(__file__))))).stdout.split()
    assert out[0] == "True", out


def test_a_link_planted_at_the_package_directory_is_refused_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    volume = tmp_path / "volume"
    volume.mkdir()
    (volume / install.DAEMON).symlink_to(victim)
    with pytest.raises(OSError):
        install.install(str(volume))
    assert list(victim.iterdir()) == [] and not (volume / "execd.py").exists()
