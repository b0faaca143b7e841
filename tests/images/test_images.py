"""The real-node images (testbed/images.py), imported into a throwaway containerd and run.

Needs root, containerd, ctr and runc, plus Go (pause), debootstrap (task) and buildah (sandman);
tools/sysdeps.py installs the Debian ones when root. The first run builds the images (a few
minutes, PyPI and the Debian mirror reachable); later runs use the cache.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

from sandman import contract, podspec
from testbed import images

ROOT = Path(__file__).resolve().parents[2]


def _missing(*exes: str) -> str | None:
    if os.geteuid() != 0:
        return "needs root (containerd, overlay mounts, debootstrap, buildah)"
    absent = [e for e in exes if not shutil.which(e)]
    return f"needs {', '.join(absent)} on PATH (make sysdeps as root installs them)" if absent \
        else None


def _need(*exes: str) -> None:
    why = _missing(*exes)
    if why:
        pytest.skip(why)


@pytest.fixture(scope="module")
def containerd(tmp_path_factory):
    _need("containerd", "ctr", "runc")
    with images.Containerd(tmp_path_factory.mktemp("containerd")) as c:
        yield c


def _imported(containerd: images.Containerd, ref: str, archive: Path) -> str:
    images.import_archive(containerd.sock, archive)
    assert ref in containerd.ctr("images", "ls", "-q").stdout.split()
    return ref


def _ok(containerd: images.Containerd, ref: str, *cmd: str) -> str:
    r = containerd.run(ref, *cmd)
    assert r.returncode == 0, f"{' '.join(cmd)} exited {r.returncode}: {r.stderr or r.stdout}"
    return r.stdout


def _layer_names(archive: Path) -> list[str]:
    """Every path in every layer of an image archive (ours or buildah's docker-archive)."""
    names = []
    with tarfile.open(archive) as outer:
        for m in outer.getmembers():
            if m.isfile() and (m.name.endswith(".tar") or m.name.startswith("blobs/")):
                f = outer.extractfile(m)
                try:
                    with tarfile.open(fileobj=f, mode="r|") as layer:
                        names += [x.name for x in layer]
                except tarfile.ReadError:
                    continue  # a JSON blob (config, manifest)
    return names


# --- pause ---------------------------------------------------------------------------------

def test_pause_imports_runs_and_stops_on_sigterm(containerd):
    _need("go")
    ref = _imported(containerd, *images.pause_image())
    assert "3.10" in _ok(containerd, ref, "/pause", "-v")
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
    _need("go")
    img = images.build_pause()
    mtime = img.archive.stat().st_mtime_ns
    assert images.build_pause().archive.stat().st_mtime_ns == mtime


# --- task: unmodified, nothing of sandman --------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_task_image_is_plain_debian_with_bash_and_python311(containerd):
    _need("debootstrap")
    ref, archive = images.task_image()
    names = _layer_names(archive)
    assert "usr/bin/bash" in names and "usr/bin/python3.11" in names
    ours = [n for n in names if any(w in n.lower() for w in ("sandman", "execd", "netguard"))]
    assert not ours, f"the task image must carry nothing of sandman: {ours[:5]}"
    assert not [n for n in names if n.startswith("var/lib/apt/lists/") and n.endswith("Packages")]
    _imported(containerd, ref, archive)
    assert _ok(containerd, ref, "python3", "-c",
               "import sys; print(sys.version_info[:2])").strip() == "(3, 11)"
    assert "GNU bash" in _ok(containerd, ref, "bash", "--version")
    assert _ok(containerd, ref, "id", "-u").strip() == "0"
    r = containerd.run(ref, "bash", "-c", "ls -d /opt/sandman /sandman /opt/venv 2>&1; exit 0")
    assert r.stdout.count("No such file") == 3, r.stdout


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_execd_mounted_read_only_runs_in_the_task_image(containerd):
    """What the webhook does on a real node: the image stays as it is, execd.py comes in
    through a read-only mount and runs on the image's own python3."""
    _need("debootstrap")
    ref = _imported(containerd, *images.task_image())
    r = containerd.ctr("run", "--rm", "--net-host", "--mount",
                       f"type=bind,src={ROOT / 'execd'},dst=/sandman,options=rbind:ro",
                       ref, f"execd-{os.getpid()}", "python3", "/sandman/execd.py", "--help")
    assert r.returncode == 0 and "--token-sha256" in r.stdout, r.stderr


# --- sandman: images/Dockerfile built with buildah -----------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_sandman_image_runs_every_component(containerd):
    _need("buildah", "debootstrap")
    ref = _imported(containerd, *images.sandman_image())
    for module in ("controller", "webhook", "netguard"):
        assert "usage:" in _ok(containerd, ref, "python3", "-m", module, "--help")
    for module, verb in (("controller", "serve"), ("webhook", "serve"), ("netguard", "apply")):
        _ok(containerd, ref, "python3", "-m", module, verb, "--help")
    assert "nf_tables" in _ok(containerd, ref, "iptables", "--version")
    assert "legacy" in _ok(containerd, ref, "iptables-legacy", "--version")
    assert "iproute2" in _ok(containerd, ref, "ip", "-V")
    assert _ok(containerd, ref, "python3", "-c",
               "import sys; print(sys.version_info[:2])").strip() == "(3, 11)"
    assert _ok(containerd, ref, "id", "-u").strip() == "65532"
    assert _ok(containerd, ref, "id", "-g").strip() == "65532"
    want = hashlib.sha256((ROOT / "execd" / "execd.py").read_bytes()).hexdigest()
    got = _ok(containerd, ref, "python3", "-c", "import hashlib; print(hashlib.sha256("
              "open('/opt/sandman/execd.py', 'rb').read()).hexdigest())").strip()
    assert got == want, "/opt/sandman/execd.py is not the repository's execd/execd.py"
    want = hashlib.sha256((ROOT / "execd" / "execd_daemon" / "main.py").read_bytes()).hexdigest()
    got = _ok(containerd, ref, "python3", "-c", "import hashlib; print(hashlib.sha256("
              "open('/opt/sandman/execd_daemon/main.py', 'rb').read()).hexdigest())").strip()
    assert got == want, "/opt/sandman/execd_daemon is not the repository's execd/execd_daemon"
    # The install init container copies the installed package: it must be importable too.
    _ok(containerd, ref, "python3", "-c", "import execd.execd_daemon.main")
    # The guard's command (podspec.NETGUARD_COMMAND) runs the package's own __main__.py.
    assert _ok(containerd, ref, *podspec.NETGUARD_COMMAND[:-1], "render").startswith("# ipv4:")
    main = _ok(containerd, ref, "python3", "-c", "import os, netguard; print(os.path.join("
               "os.path.dirname(netguard.__file__), '__main__.py'))").strip()
    assert _ok(containerd, ref, "readlink", "-f", contract.NETGUARD_PATH).strip() == main
    r = containerd.run(ref, "ls", "/src")
    assert r.returncode != 0, "the build stage's sources leaked into the final image"


@pytest.mark.timeout(600)
def test_buildah_honours_dockerignore(tmp_path):
    """The build context is what .dockerignore lets through: the Dockerfile's COPY sources,
    without __pycache__, and never .git, .venv or tests."""
    _need("buildah")
    (tmp_path / "Containerfile").write_text("FROM scratch\nCOPY . /ctx\n")
    b = images.buildah_cmd()
    tag = f"localhost/sandman-ctx-check:{os.getpid()}"
    pycache = ROOT / "sandman" / "__pycache__"
    pycache.mkdir(exist_ok=True)  # make sure there is one to leave out
    try:
        subprocess.run([*b, "bud", "--isolation", "chroot", "-f", str(tmp_path / "Containerfile"),
                        "-t", tag, str(ROOT)], check=True, capture_output=True)
        out = tmp_path / "ctx.tar"
        subprocess.run([*b, "push", "--quiet", tag, f"docker-archive:{out}:{tag}"], check=True,
                       capture_output=True)
    finally:
        subprocess.run([*b, "rmi", "-f", tag], capture_output=True)
    names = [n for n in _layer_names(out) if n.startswith("ctx/")]
    top = {n.split("/")[1] for n in names if n.count("/") >= 1 and n.split("/")[1]}
    assert top == {s.split("/")[0] for s in images.dockerfile_copy_sources()}, top
    assert not [n for n in names if "__pycache__" in n]
