"""The two distributions of this tree, built as a user gets them, and a bare Python 3.9 to
install the client into (tests/test_distributions.py, tests/client/test_py39_wheel.py).

`build_wheel()` copies what a distribution is built from (client/ or the root pyproject.toml,
and the source folders) into a scratch folder and runs `pip wheel --no-deps` there, so the
test never writes build/ or egg-info into the work tree.

The client (`sandman-client`) promises Python >= 3.9, and only a real 3.9 shows that the wheel
installs and imports there. Only PyPI, the Go module proxy, npm and Debian's packages are
reachable from here and from CI, so the interpreter is Debian bullseye's python3.9: a minbase
bullseye tree (`python3`, `python3-venv` for ensurepip) debootstrapped once with the same
machinery as the real-node images (testbed/images.py), cached in
~/.cache/sandman-testbed/py39-bullseye-<key>/rootfs, and entered with chroot in a private mount
namespace (`unshare -m`): its /proc mount ends with the process, so nothing is left mounted.
The chroot shares the host's network namespace, so a client in it reaches servers the test
started on 127.0.0.1. Needs root and debootstrap (`make sysdeps` installs it); the first build
took 196 s here (2 shared cores), 123 MB.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from testbed.build import cache_dir
from testbed.images import ImageError, _key, debootstrap, goarch, umount_under

REPO = Path(__file__).resolve().parent.parent
# What each distribution is built from (the server's list: its packages.find include).
SOURCES = {
    "client": ["client", "sandman"],
    "server": ["pyproject.toml", "sandman", "testbed", "webhook", "controller", "netguard",
               "execd", "loadtest"],
}


def build_wheel(dist: str, out: Path, timeout: float = 300) -> Path:
    """Build `dist` ("client" or "server") into `out`, from a scratch copy of the tree."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"sandman-{dist}-src-") as tmp:
        for rel in SOURCES[dist]:
            src = REPO / rel
            if src.is_dir():
                shutil.copytree(src, Path(tmp) / rel,
                                ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
            else:
                shutil.copy2(src, Path(tmp) / rel)
        project = Path(tmp) / ("client" if dist == "client" else ".")
        before = set(out.glob("*.whl"))
        # No build isolation: setuptools is the locked one of this venv (requirements*.lock).
        r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                            "--no-build-isolation", "--disable-pip-version-check", "-w",
                            str(out), str(project)], capture_output=True, text=True,
                           timeout=timeout)
        if r.returncode != 0:
            raise RuntimeError(f"building the {dist} wheel failed: {r.stderr.strip()[-2000:]}")
    new = sorted(set(out.glob("*.whl")) - before)
    if len(new) != 1:
        raise RuntimeError(f"building the {dist} wheel made {len(new)} wheels in {out}")
    return new[0]


SUITE = "bullseye"  # Debian 11: python3 is 3.9
PACKAGES = ["python3", "python3-venv"]
PYTHON = "/usr/bin/python3.9"


def _rootfs_key() -> str:
    return _key({"suite": SUITE, "include": PACKAGES, "arch": goarch()})


def rootfs(force: bool = False) -> Path:
    """The debootstrapped bullseye tree with python3.9, built on first use."""
    out = cache_dir() / f"py39-{SUITE}-{_rootfs_key()}" / "rootfs"
    if (out / PYTHON.lstrip("/")).exists() and not force:
        return out
    t0 = time.monotonic()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".rootfs-", dir=out.parent))
    try:
        debootstrap(tmp / "rootfs", PACKAGES, out.parent / "build.log", suite=SUITE)
        umount_under(tmp)
        if out.exists():
            shutil.rmtree(out)
        (tmp / "rootfs").rename(out)
    finally:
        umount_under(tmp)  # debootstrap mounts proc and sys in the target
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"dist: debootstrapped {SUITE} ({', '.join(PACKAGES)}) in "
          f"{time.monotonic() - t0:.1f}s: {out}", flush=True)
    return out


def missing() -> str | None:
    """Why this machine cannot provide the interpreter, or None when it can."""
    if os.geteuid() != 0:
        return "needs root (debootstrap, chroot)"
    for tool in ("debootstrap", "chroot", "unshare", "mount"):
        if not shutil.which(tool):
            raise ImageError(f"`{tool}` is not on PATH (make sysdeps)")
    return None


def run(root: Path, argv: list[str], *, timeout: float,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`argv` inside `root` (paths are the chroot's), with a clean environment and /proc
    mounted in a private mount namespace that ends with the command."""
    base = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/root",
            "PYTHONDONTWRITEBYTECODE": "1"}
    script = 'mount -t proc proc "$1/proc" && r="$1" && shift && exec chroot "$r" "$@"'
    cmd = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh",
           str(root), "/usr/bin/env", "-i", *(f"{k}={v}" for k, v in {**base, **(env or {})}
                                              .items()), *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


if __name__ == "__main__":
    r = rootfs()
    print(run(r, [PYTHON, "--version"], timeout=60).stdout.strip())
