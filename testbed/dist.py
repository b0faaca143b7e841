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
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import uuid
from pathlib import Path

from testbed.build import cache_dir
from testbed.images import ImageError, _key, debootstrap, goarch, umount_under

REPO = Path(__file__).resolve().parent.parent
# What each distribution is built from (the server's list: its packages.find include).
SOURCES = {
    "client": ["client", "sandman"],
    # testbed/ and bench/ are copied although the wheel must not ship them: so a package
    # discovery that took them would show (tests/test_distributions.py).
    "server": ["LICENSE", "pyproject.toml", "sandman", "testbed", "bench", "webhook", "controller",
               "netguard", "execd", "loadtest"],
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


def _run_twice(argv: list[str], offline: list[str], timeout: float) -> str:
    """`argv` offline (from caches) first, then with the index."""
    r = subprocess.run([*argv, *offline], capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} failed: {r.stderr.strip()[-2000:]}")
    return r.stdout


def client_dependency_wheels() -> list[Path]:
    """The client's dependencies as wheels for CPython 3.9, cached in py39-wheels/. Resolved
    by uv for 3.9: `pip download --python-version` evaluates markers for the running 3.11
    (and left out anyio's `exceptiongroup; python_version < "3.11"`)."""
    wheels = cache_dir() / "py39-wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or "uv"
    requirements = tomllib.loads((REPO / "client" / "pyproject.toml").read_text())[
        "project"]["dependencies"]
    with tempfile.TemporaryDirectory(prefix="sandman-py39-") as tmp:
        src = Path(tmp) / "requirements.in"
        src.write_text("\n".join(requirements) + "\n")
        pins = _run_twice([uv, "pip", "compile", "--quiet", "--no-header", "--no-annotate",
                           "--python-version", "3.9", "--only-binary", ":all:", str(src)],
                          ["--offline"], timeout=120).split()
    _run_twice([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                "--disable-pip-version-check", "--only-binary=:all:", "--python-version", "3.9",
                "--implementation", "cp", "-d", str(wheels), *pins],
               ["--no-index", "--find-links", str(wheels)], timeout=300)
    found = []
    for pin in pins:
        name, version = pin.split("==")
        found += wheels.glob(f"{re.sub(r'[-_.]+', '_', name)}-{version}-*.whl")
    if len(found) != len(pins) or not any(p.startswith("httpx==") for p in pins):
        raise RuntimeError(f"client dependencies for 3.9: pinned {pins}, found {found}")
    return found


class Py39Venv:
    """A fresh venv of bullseye's python3.9 in the cached tree, with the client wheel built
    from this tree installed offline (its dependencies from `client_dependency_wheels()`):
    what `pip install sandman-client` gives a 3.9 trainer. Everything lives in one folder of
    the tree, /sandman-test-<random>, removed by `close()`."""

    def __init__(self, root: Path, scratch: Path) -> None:
        self.root, self.scratch = root, scratch
        self.work = f"/sandman-test-{uuid.uuid4().hex[:12]}"
        self.host_work = root / self.work.lstrip("/")
        self.python = f"{self.work}/venv/bin/python"

    def __enter__(self) -> Py39Venv:
        try:
            wheel = build_wheel("client", self.scratch / "wheel")
            deps = client_dependency_wheels()
            (self.host_work / "wheels").mkdir(parents=True)
            for w in [wheel, *deps]:
                shutil.copy2(w, self.host_work / "wheels" / w.name)
            self.check([PYTHON, "-m", "venv", f"{self.work}/venv"])
            # Offline, from the wheel: the client's own metadata must bring httpx.
            self.check([self.python, "-m", "pip", "install", "--quiet", "--no-index",
                        "--disable-pip-version-check", "--find-links", f"{self.work}/wheels",
                        f"{self.work}/wheels/{wheel.name}"])
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        shutil.rmtree(self.host_work, ignore_errors=True)

    def put(self, name: str, text: str) -> str:
        """Write a file into the work folder; its path inside the tree."""
        (self.host_work / name).write_text(text)
        return f"{self.work}/{name}"

    def check(self, argv: list[str], timeout: float = 300) -> str:
        r = run(self.root, argv, timeout=timeout)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[:3])} exited {r.returncode} in the py39 "
                               f"tree: {r.stderr[-3000:]}")
        return r.stdout


if __name__ == "__main__":
    r = rootfs()
    print(run(r, [PYTHON, "--version"], timeout=60).stdout.strip())
