"""The grading task image: a small SWE-style task, built without Docker like testbed/images.py.

`sandman.local/grading-task:bookworm` is Debian minbase + bash, python3, git and python3-pytest
(its own debootstrap, cached as images-gradingroot-<key>/rootfs.tar, so the plain task image
and the sandman base keep their cache keys) plus a git repository at `/testbed`: a tiny
package `calc` whose `add` is wrong, and pytest tests that catch it. `TASK` below is the task
as `sandman.client.grading.Task` describes it: image, repository path, base commit, test
files, test command, reference patch and time limit. The base commit is deterministic (fixed
author, committer and dates), so `TASK["base_commit"]` is known without building.

    python -m testbed.images build grading-task
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from testbed import images
from testbed.build import cache_dir

REF = "sandman.local/grading-task:bookworm"
REPO_PATH = "/testbed"
PACKAGES = ["bash", "python3", "git", "python3-pytest"]
CONFIG = {"Cmd": ["/bin/bash"], "WorkingDir": REPO_PATH,
          "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]}

# The repository at its base commit. `add` subtracts: the bug the reference patch fixes.
FILES: dict[str, str] = {
    "README.md": "# calc\n\nA tiny task for sandman's grading demo.\n",
    "calc/__init__.py": (
        '"""Arithmetic, with one bug."""\n\n\n'
        "def add(a, b):\n"
        "    return a - b\n\n\n"
        "def mul(a, b):\n"
        "    return a * b\n"),
    "tests/__init__.py": "",
    "tests/test_calc.py": (
        "from calc import add, mul\n\n\n"
        "def test_add():\n"
        "    assert add(2, 3) == 5\n\n\n"
        "def test_add_negative():\n"
        "    assert add(-1, 1) == 0\n\n\n"
        "def test_mul():\n"
        "    assert mul(2, 3) == 6\n"),
    "setup.cfg": ("[metadata]\nname = calc\n\n"
                  "[tool:pytest]\naddopts = -p no:cacheprovider\n"),
}
TEST_FILES = ["tests/test_calc.py"]
TEST_COMMAND = "python3 -m pytest -q tests/test_calc.py"

REFERENCE_PATCH = (
    b"diff --git a/calc/__init__.py b/calc/__init__.py\n"
    b"--- a/calc/__init__.py\n"
    b"+++ b/calc/__init__.py\n"
    b"@@ -2,7 +2,7 @@\n"
    b" \n"
    b" \n"
    b" def add(a, b):\n"
    b"-    return a - b\n"
    b"+    return a + b\n"
    b" \n"
    b" \n"
    b" def mul(a, b):\n")

_GIT_ENV = {"GIT_AUTHOR_NAME": "sandman", "GIT_AUTHOR_EMAIL": "testbed@sandman.local",
            "GIT_COMMITTER_NAME": "sandman", "GIT_COMMITTER_EMAIL": "testbed@sandman.local",
            "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z",
            "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z",
            "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_SYSTEM": "/dev/null"}


def _git(repo: Path, *args: str) -> str:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(repo), **_GIT_ENV}
    res = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                         env=env)
    if res.returncode != 0:
        raise images.ImageError(f"git {' '.join(args)}: {res.stderr.strip()}")
    return res.stdout.strip()


def make_repo(dest: Path) -> str:
    """Write the task repository at `dest` and commit it; returns the base commit."""
    dest.mkdir(parents=True, exist_ok=True)
    _git(dest, "init", "-q", "-b", "main")
    for rel, text in FILES.items():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_text(text)
    (dest / ".gitignore").write_text("__pycache__/\n*.pyc\n")
    _git(dest, "add", "-A")
    _git(dest, "commit", "-q", "-m", "calc: base commit of the grading demo task")
    return _git(dest, "rev-parse", "HEAD")


def base_commit() -> str:
    """The deterministic base commit, computed in a temp dir (no image build)."""
    with tempfile.TemporaryDirectory() as d:
        return make_repo(Path(d) / "repo")


def task(image: str = REF) -> dict:
    """The demo task as keyword arguments of `sandman.client.grading.Task`."""
    return {"name": "calc-add", "image": image, "repo": REPO_PATH,
            "base_commit": base_commit(), "test_files": list(TEST_FILES),
            "test_command": TEST_COMMAND, "reference_patch": REFERENCE_PATCH,
            "time_limit_s": 120.0}


def _rootfs_key() -> str:
    return images._key({"suite": images.SUITE, "include": PACKAGES, "clean": images.CLEAN,
                        "slim": images.SLIM_FILES, "skip": images.LAYER_SKIP,
                        "arch": images.goarch(), "writer": images.ARCHIVE_FORMAT,
                        "files": FILES})


def _image() -> images.Image:
    return images._image("grading-task", REF, {"rootfs": _rootfs_key(), "config": CONFIG})


def build(force: bool = False) -> images.Image:
    img = _image()
    if img.built and not force:
        return img
    t0 = time.monotonic()
    root = cache_dir() / f"images-gradingroot-{_rootfs_key()}"
    layer = root / "rootfs.tar"
    root.mkdir(parents=True, exist_ok=True)
    if not layer.exists() or force:
        tmp = Path(tempfile.mkdtemp(prefix=".rootfs-", dir=root))
        try:
            images.debootstrap(tmp / "rootfs", PACKAGES, root / "build.log")
            make_repo(tmp / "rootfs" / REPO_PATH.lstrip("/"))
            images.write_layer(tmp / "rootfs", tmp / "layer.tar", mtime=None,
                               skip=images.LAYER_SKIP)
            (tmp / "layer.tar").rename(layer)
        finally:
            images.umount_under(tmp)
            shutil.rmtree(tmp, ignore_errors=True)
        images._drop_stale("gradingroot", root)
    img.archive.parent.mkdir(parents=True, exist_ok=True)
    digests = images.write_archive(img.archive, img.ref, layer, CONFIG)
    images._finish(img, digests, t0)
    return img
