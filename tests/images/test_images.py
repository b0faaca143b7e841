"""The real-node images (testbed/images.py), imported into a throwaway containerd and run.

Needs root, containerd, ctr and runc (tools/sysdeps.py installs them when root), plus Go for
the pause image.
"""

from __future__ import annotations

import os
import shutil
import time

import pytest

from testbed import images


def _missing(*exes: str) -> str | None:
    if os.geteuid() != 0:
        return "needs root (containerd, overlay mounts)"
    absent = [e for e in exes if not shutil.which(e)]
    return f"needs {', '.join(absent)} on PATH (make sysdeps as root)" if absent else None


@pytest.fixture(scope="module")
def containerd(tmp_path_factory):
    why = _missing("containerd", "ctr", "runc", "go")
    if why:
        pytest.skip(why)
    with images.Containerd(tmp_path_factory.mktemp("containerd")) as c:
        yield c


def test_pause_imports_runs_and_stops_on_sigterm(containerd):
    ref, archive = images.pause_image()
    images.import_archive(containerd.sock, archive)
    assert ref in containerd.ctr("images", "ls", "-q").stdout.split()
    r = containerd.run(ref, "/pause", "-v")
    assert r.returncode == 0 and "3.10" in r.stdout, r.stderr
    cid = f"pause-{os.getpid()}"
    r = containerd.ctr("run", "-d", "--net-host", ref, cid)
    assert r.returncode == 0, r.stderr
    try:
        time.sleep(0.5)
        assert "RUNNING" in containerd.ctr("tasks", "ls").stdout
        assert containerd.ctr("tasks", "kill", "-s", "SIGTERM", cid).returncode == 0
        deadline = time.monotonic() + 10
        while "RUNNING" in containerd.ctr("tasks", "ls").stdout:
            assert time.monotonic() < deadline, "pause ignored SIGTERM"
            time.sleep(0.1)
    finally:
        containerd.ctr("tasks", "kill", "-s", "SIGKILL", cid)
        containerd.ctr("tasks", "delete", "-f", cid)
        containerd.ctr("containers", "rm", cid)


def test_pause_rebuild_is_a_noop():
    if not shutil.which("go"):
        pytest.skip("needs go on PATH")
    img = images.build_pause()
    mtime = img.archive.stat().st_mtime_ns
    assert images.build_pause().archive.stat().st_mtime_ns == mtime
