"""`make kind-up` (testbed/kind_up.py) without a Docker engine, as on our machines: one line on
stderr, exit 2, and nothing run past the check (no kind, no build). The path with Docker is
not runnable here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _kind_up(tmp_path: Path, path: str) -> subprocess.CompletedProcess:
    env = {"PATH": path, "HOME": str(tmp_path), "SANDMAN_TESTBED_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "testbed.kind_up"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def _fake(tmp_path: Path, name: str, script: str) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / name).write_text("#!/bin/sh\n" + script)
    (bin_dir / name).chmod(0o755)
    return bin_dir


@pytest.mark.parametrize("docker", ["absent", "daemon-down"])
def test_without_docker_it_stops_with_one_line(tmp_path, docker):
    calls = tmp_path / "calls"
    # Anything past the check would call kind, go or a built kubectl: record kind and go.
    bin_dir = _fake(tmp_path, "kind", f'echo "kind $*" >> {calls}\n')
    _fake(tmp_path, "go", f'echo "go $*" >> {calls}\n')
    if docker == "daemon-down":
        _fake(tmp_path, "docker", 'echo "Cannot connect to the Docker daemon at '
              'unix:///var/run/docker.sock. Is the docker daemon running?" >&2\nexit 1\n')
    r = _kind_up(tmp_path, f"{bin_dir}:/usr/bin:/bin")
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("make kind-up: needs a running Docker engine")
    if docker == "absent":
        assert "`docker` is not on PATH" in lines[0]
    else:
        assert "`docker info` failed (Cannot connect to the Docker daemon" in lines[0]
    assert not calls.exists(), calls.read_text()
    assert not (tmp_path / "cache").exists()
