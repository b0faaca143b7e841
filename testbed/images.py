"""Container images for a real node, built without Docker: `python -m testbed.images ...`.

No Docker engine and no registry are reachable on our machines, so every image a real node
needs is built here, cached under ~/.cache/sandman-testbed/images-<name>-<key> (the key hashes
the image's inputs: a change rebuilds, a re-run is a no-op) and imported into a containerd with
`ctr -a <sock> -n k8s.io images import <archive>`:

- pause (`pause_image()`, sandman.local/pause:3.10): a static Go program
  (images/pause/pause.go) that holds the pod's namespaces, reaps children and exits on
  SIGTERM/SIGINT; the node's containerd uses it as `sandbox_image`.
- task (`task_image()`, sandman.local/task:bookworm): an UNMODIFIED task image, Debian minbase
  with bash and python3 3.11 (full standard library) from debootstrap, nothing of sandman in it.
- sandman (`sandman_image()`, sandman.local/sandman:<version>): images/Dockerfile, the file
  users build with Docker, built with buildah over localhost/sandman-base:bookworm as
  PYTHON_IMAGE.
- grading-task (`grading_task_image()`, sandman.local/grading-task:bookworm): the grading
  demo's task, testbed/taskimage.py (its own debootstrap with git and pytest, a repository at
  /testbed); built only when named or by the demo.

task and sandman-base are the same debootstrapped tree (`rootfs_layer()`: minbase + bash,
python3, python3-venv, ca-certificates, configured like debian:bookworm-slim) with their own
image config; it is debootstrapped once and cached as images-rootfs-<key>/rootfs.tar. `build
--force` rewrites an image from its cached inputs; delete images-rootfs-* to debootstrap again.

pause, task and the base are one-layer archives written here: OCI image layouts (oci-layout,
index.json, blobs/sha256/...) that also carry a Docker `manifest.json`. containerd 1.6's `ctr
images import` reads index.json and names the image from its `io.containerd.image.name`
annotation; `docker load` and podman read manifest.json. sandman is buildah's docker-archive
(RepoTags name it). Building needs root (debootstrap, buildah); importing needs the socket.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import io
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from testbed.build import cache_dir

REPO = Path(__file__).resolve().parent.parent
PAUSE_SRC = REPO / "images" / "pause" / "pause.go"
PAUSE_REF = "sandman.local/pause:3.10"
# Bump when the archive layout written below changes: it is part of every image's cache key.
ARCHIVE_FORMAT = "oci-layout+docker-manifest/1"

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"
EPOCH = "1970-01-01T00:00:00Z"


class ImageError(RuntimeError):
    pass


def goarch() -> str:
    m = platform.machine()
    return {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(m, m)


# --- archive writer ------------------------------------------------------------------------

def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def write_layer(src: Path, out: Path, *, mtime: int | None = 0, skip: tuple[str, ...] = ()) -> None:
    """Tar the tree under `src` as an image layer (paths relative, no leading ./).

    Owners stay numeric (no user names), hard links stay links, sockets are skipped. With
    `mtime` set every entry gets that time, so the same files give the same digest. `skip`
    lists relative directories whose contents are left out (the directory itself stays).
    """
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tf:
        for dirpath, dirnames, filenames in os.walk(src):
            dirnames.sort()
            rel_dir = os.path.relpath(dirpath, src)
            entries = sorted(dirnames + filenames) if rel_dir not in skip else []
            for name in entries:
                path = os.path.join(dirpath, name)
                arc = name if rel_dir == "." else f"{rel_dir}/{name}"
                ti = tf.gettarinfo(path, arc)
                if ti is None:  # socket
                    continue
                ti.uname = ti.gname = ""
                if mtime is not None:
                    ti.mtime = mtime
                if ti.isreg():
                    with open(path, "rb") as f:
                        tf.addfile(ti, f)
                else:
                    tf.addfile(ti)


def _tar_add_bytes(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mode, ti.mtime = len(data), 0o644, 0
    tf.addfile(ti, io.BytesIO(data))


def _tar_add_dir(tf: tarfile.TarFile, name: str) -> None:
    ti = tarfile.TarInfo(name)
    ti.type, ti.mode, ti.mtime = tarfile.DIRTYPE, 0o755, 0
    tf.addfile(ti)


def _json(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def write_archive(out: Path, ref: str, layer: Path, config: dict, *,
                  arch: str | None = None, created: str = EPOCH) -> dict:
    """Write a one-layer image archive for `ref` from an uncompressed layer tar.

    `config` is the image's runtime config (Entrypoint, Cmd, Env, User, WorkingDir...). The
    archive is written to a temporary name and renamed, so a half-written one never looks done.
    Returns {"manifest": digest, "config": digest, "layer": digest}.
    """
    layer_digest = _sha256_file(layer)
    layer_size = layer.stat().st_size
    image_config = {
        "architecture": arch or goarch(),
        "os": "linux",
        "created": created,
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        "history": [{"created": created, "created_by": "sandman testbed/images.py"}],
    }
    cfg = _json(image_config)
    cfg_digest = "sha256:" + hashlib.sha256(cfg).hexdigest()
    manifest = _json({
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": cfg_digest, "size": len(cfg)},
        "layers": [{"mediaType": OCI_LAYER, "digest": layer_digest, "size": layer_size}],
    })
    man_digest = "sha256:" + hashlib.sha256(manifest).hexdigest()
    tag = ref.rsplit(":", 1)[1] if ":" in ref.rsplit("/", 1)[-1] else "latest"
    index = _json({
        "schemaVersion": 2,
        "mediaType": OCI_INDEX,
        "manifests": [{
            "mediaType": OCI_MANIFEST, "digest": man_digest, "size": len(manifest),
            "annotations": {"io.containerd.image.name": ref,
                            "org.opencontainers.image.ref.name": tag},
        }],
    })

    def blob(d: str) -> str:
        return "blobs/sha256/" + d.split(":", 1)[1]

    docker_manifest = _json([{"Config": blob(cfg_digest), "RepoTags": [ref],
                              "Layers": [blob(layer_digest)]}])
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tf:
        _tar_add_dir(tf, "blobs")
        _tar_add_dir(tf, "blobs/sha256")
        _tar_add_bytes(tf, blob(cfg_digest), cfg)
        _tar_add_bytes(tf, blob(man_digest), manifest)
        ti = tarfile.TarInfo(blob(layer_digest))
        ti.size, ti.mode, ti.mtime = layer_size, 0o644, 0
        with open(layer, "rb") as f:
            tf.addfile(ti, f)
        _tar_add_bytes(tf, "oci-layout", _json({"imageLayoutVersion": "1.0.0"}))
        _tar_add_bytes(tf, "index.json", index)
        _tar_add_bytes(tf, "manifest.json", docker_manifest)
    tmp.rename(out)
    return {"manifest": man_digest, "config": cfg_digest, "layer": layer_digest}


# --- cache ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Image:
    name: str       # short name: pause, task, sandman
    ref: str        # what containerd and pods call it
    key: str        # hash of the inputs
    archive: Path   # the cached archive; exists once built

    @property
    def built(self) -> bool:
        return self.archive.exists()


def _key(inputs: dict) -> str:
    return hashlib.sha256(_json(inputs)).hexdigest()[:16]


def _image(name: str, ref: str, inputs: dict) -> Image:
    key = _key({"format": ARCHIVE_FORMAT, "ref": ref, "arch": goarch(), **inputs})
    return Image(name, ref, key, cache_dir() / f"images-{name}-{key}" / f"{name}.tar")


def _log(msg: str) -> None:
    print(f"images: {msg}", file=sys.stderr, flush=True)


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if res.returncode != 0:
        raise ImageError(f"`{' '.join(cmd[:4])} ...` exited {res.returncode}: "
                         f"{(res.stderr or res.stdout).strip()[-2000:]}")
    return res


def umount_under(path: Path) -> None:
    """Lazily unmount everything mounted at or below `path` (deepest first), so removing the
    tree can never reach into a leftover /proc, /sys or overlay mount."""
    prefix = str(path).rstrip("/")
    with open("/proc/self/mounts") as f:
        mounts = [ln.split()[1] for ln in f]
    for m in sorted((m for m in mounts if m == prefix or m.startswith(prefix + "/")),
                    key=len, reverse=True):
        subprocess.call(["umount", "-l", m], stderr=subprocess.DEVNULL)


def _finish(img: Image, digests: dict, t0: float) -> None:
    meta = {"ref": img.ref, "key": img.key, **digests, "seconds": round(time.monotonic() - t0, 1),
            "bytes": img.archive.stat().st_size}
    (img.archive.parent / "image.json").write_text(json.dumps(meta, indent=1) + "\n")
    _log(f"built {img.ref} in {meta['seconds']}s: {img.archive} ({meta['bytes'] / 1e6:.1f} MB)")
    _drop_stale(img.name, img.archive.parent)


KEEP_OTHER_BUILDS = 2


def _drop_stale(name: str, current: Path) -> None:
    """Keep the newest KEEP_OTHER_BUILDS builds of `name` with other inputs besides `current`,
    drop the rest. Not just `current`: checkouts of other branches share the cache, and each
    dropping the other's build made them rebuild in turn (seen with two worktrees)."""
    pattern = re.compile(rf"images-{re.escape(name)}-[0-9a-f]{{16}}")
    others = [d for d in current.parent.iterdir() if d != current and pattern.fullmatch(d.name)]
    others.sort(key=lambda d: d.stat().st_mtime, reverse=True)
    for d in others[KEEP_OTHER_BUILDS:]:
        shutil.rmtree(d, ignore_errors=True)


# --- pause ---------------------------------------------------------------------------------

def _go_version() -> str:
    if not shutil.which("go"):
        raise ImageError("`go` is not on PATH; the pause image is built with Go")
    return _run(["go", "env", "GOVERSION"]).stdout.strip()


def _pause_image() -> Image:
    return _image("pause", PAUSE_REF, {"src": hashlib.sha256(PAUSE_SRC.read_bytes()).hexdigest(),
                                       "go": _go_version()})


def build_pause(force: bool = False) -> Image:
    img = _pause_image()
    if img.built and not force:
        return img
    t0 = time.monotonic()
    img.archive.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sandman-pause-") as tmp:
        work, root = Path(tmp) / "src", Path(tmp) / "rootfs"
        work.mkdir()
        root.mkdir()
        (work / "go.mod").write_text("module sandman.local/pause\n\ngo 1.21\n")
        shutil.copy(PAUSE_SRC, work / "pause.go")
        env = dict(os.environ, CGO_ENABLED="0", GOFLAGS="-buildvcs=false", GOARCH=goarch())
        _run(["go", "build", "-trimpath", "-ldflags", "-s -w", "-o", str(root / "pause"), "."],
             cwd=work, env=env)
        layer = Path(tmp) / "layer.tar"
        write_layer(root, layer)
        # Like registry.k8s.io/pause: the nobody-ish 65535, no shell, nothing else in the image.
        digests = write_archive(img.archive, img.ref, layer,
                                {"Entrypoint": ["/pause"], "User": "65535:65535",
                                 "WorkingDir": "/"})
    _finish(img, digests, t0)
    return img


def pause_image() -> tuple[str, Path]:
    """(ref, archive path) of the pause image, built on first use."""
    img = build_pause()
    return img.ref, img.archive


# --- Debian root filesystems (debootstrap) ---------------------------------------------------

SUITE = "bookworm"
# Removed from every debootstrapped tree: package lists and caches (apt-get update refetches
# them), docs, man pages, locales and logs. Part of the cache key: edit it and images rebuild.
CLEAN = ("var/lib/apt/lists/*", "var/cache/apt/*", "var/cache/debconf/*-old", "var/log/*",
         "usr/share/doc/*", "usr/share/man/*", "usr/share/info/*", "usr/share/locale/*",
         "usr/share/lintian/*", "tmp/*", "var/tmp/*", "root/.cache")
# What debian:bookworm-slim (python:3.11-slim's base) configures, so apt and dpkg behave in a
# RUN step as they do over the Docker base: no .deb or pkgcache left in the layer (without this
# the Dockerfile's apt-get install made an 91 MB layer, 78 MB of it /var/cache/apt/*.bin), and
# no docs, man pages or locales unpacked.
SLIM_FILES = {
    "etc/apt/apt.conf.d/docker-clean": (
        'DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb '
        '/var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };\n'
        'APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb '
        '/var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };\n'
        'Dir::Cache::pkgcache "";\nDir::Cache::srcpkgcache "";\n'),
    "etc/apt/apt.conf.d/docker-no-languages": 'Acquire::Languages "none";\n',
    "etc/apt/apt.conf.d/docker-autoremove-suggests": (
        'Apt::AutoRemove::SuggestsImportant "false";\n'),
    "etc/dpkg/dpkg.cfg.d/docker": "".join(
        f"path-exclude {p}\n" for p in ("/usr/share/doc/*", "/usr/share/man/*",
                                        "/usr/share/info/*", "/usr/share/locale/*",
                                        "/usr/share/lintian/*", "/usr/share/linda/*")
    ) + "path-include /usr/share/doc/*/copyright\n",
}
# debootstrap's /dev nodes are left out: the runtime mounts its own /dev.
LAYER_SKIP = ("dev", "proc", "sys", "run")


def debian_mirror() -> str:
    """$SANDMAN_DEBIAN_MIRROR, else the first Debian (non-security) URI apt uses here."""
    if os.environ.get("SANDMAN_DEBIAN_MIRROR"):
        return os.environ["SANDMAN_DEBIAN_MIRROR"]
    files = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for f in files:
        try:
            text = f.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            words = line.split()
            uris = words[1:] if words[:1] == ["URIs:"] else (
                [w for w in words[1:] if "://" in w][:1] if words[:1] == ["deb"] else [])
            for uri in uris:
                if uri.rstrip("/").endswith("/debian"):
                    return uri
    return "http://deb.debian.org/debian"


def debootstrap(target: Path, include: list[str], log: Path, suite: str = SUITE) -> None:
    """`debootstrap --variant=minbase --include=...` of `suite` into `target`, then clean it.

    Downloaded .debs are kept in the cache (debs/): the second tree and every rebuild skip
    most of the download.
    """
    if not shutil.which("debootstrap"):
        raise ImageError("`debootstrap` is not on PATH (Debian package debootstrap; make sysdeps)")
    if os.geteuid() != 0:
        raise ImageError("debootstrap needs root")
    debs = cache_dir() / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    cmd = ["debootstrap", "--variant=minbase", f"--include={','.join(include)}",
           f"--cache-dir={debs}", suite, str(target), debian_mirror()]
    with open(log, "ab") as f:
        f.write(f"$ {' '.join(cmd)}\n".encode())
        f.flush()
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT)
    if rc != 0:
        raise ImageError(f"debootstrap exited {rc}; see {log}")
    for rel, text in SLIM_FILES.items():
        (target / rel).parent.mkdir(parents=True, exist_ok=True)
        (target / rel).write_text(text)
    for pattern in CLEAN:
        for p in target.glob(pattern):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()


# One debootstrap serves the task image and the sandman base: each is a debootstrap of 80-200 s
# on this machine (2 shared cores), and they would share all but two packages. The union:
# - bash, python3: the task image (python3, not python3-minimal: execd.py needs the standard
#   library, json, shutil, ctypes, http.server, which python3-minimal leaves out; measured on
#   minbase + python3-minimal, `python3 execd.py --help` failed with "No module named 'ctypes'");
# - python3-venv (ensurepip), ca-certificates (pip over TLS): what images/Dockerfile's stages
#   take from python:3.11-slim-bookworm besides python3; apt comes with minbase.
ROOTFS_PACKAGES = ["bash", "python3", "python3-venv", "ca-certificates"]


def _rootfs_key() -> str:
    return _key({"suite": SUITE, "include": ROOTFS_PACKAGES, "clean": CLEAN, "slim": SLIM_FILES,
                 "skip": LAYER_SKIP, "arch": goarch(), "writer": ARCHIVE_FORMAT})


def rootfs_layer(force: bool = False) -> Path:
    """The debootstrapped bookworm tree as one uncompressed layer tar, built on first use."""
    out = cache_dir() / f"images-rootfs-{_rootfs_key()}" / "rootfs.tar"
    if out.exists() and not force:
        return out
    t0 = time.monotonic()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".rootfs-", dir=out.parent))
    try:
        debootstrap(tmp / "rootfs", ROOTFS_PACKAGES, out.parent / "build.log")
        # Real mtimes: the .pyc files debootstrap compiled record their sources' mtimes.
        write_layer(tmp / "rootfs", tmp / "layer.tar", mtime=None, skip=LAYER_SKIP)
        (tmp / "layer.tar").rename(out)
    finally:
        umount_under(tmp)  # debootstrap mounts proc and sys in the target
        shutil.rmtree(tmp, ignore_errors=True)
    _log(f"debootstrapped {SUITE} ({', '.join(ROOTFS_PACKAGES)}) in "
         f"{time.monotonic() - t0:.1f}s: {out} ({out.stat().st_size / 1e6:.1f} MB)")
    _drop_stale("rootfs", out.parent)
    return out


def _rootfs_image(img: Image, config: dict, force: bool) -> Image:
    if img.built and not force:
        return img
    t0 = time.monotonic()
    img.archive.parent.mkdir(parents=True, exist_ok=True)
    digests = write_archive(img.archive, img.ref, rootfs_layer(), config)
    _finish(img, digests, t0)
    return img


# --- task: an UNMODIFIED task image, as a user's would be -----------------------------------

TASK_REF = "sandman.local/task:bookworm"
TASK_CONFIG = {"Cmd": ["/bin/bash"], "WorkingDir": "/",
               "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]}


def _task_image() -> Image:
    return _image("task", TASK_REF, {"rootfs": _rootfs_key(), "config": TASK_CONFIG})


def build_task(force: bool = False) -> Image:
    """Debian minbase + bash + python3 3.11 and nothing of sandman: what the webhook must
    make work by mounting execd read-only, without changing the image."""
    return _rootfs_image(_task_image(), TASK_CONFIG, force)


def task_image() -> tuple[str, Path]:
    """(ref, archive path) of the task image, built on first use."""
    img = build_task()
    return img.ref, img.archive


# --- sandman: images/Dockerfile, built with buildah over a Debian base ---------------------

DOCKERFILE = REPO / "images" / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
BASE_REF = "localhost/sandman-base:bookworm"
BASE_CONFIG = {"Cmd": ["python3"], "WorkingDir": "/", "Env": TASK_CONFIG["Env"]}

# chroot isolation: no OCI runtime for RUN steps, and they share the host's network (PyPI and
# Debian). --layers keeps each step's layer: a source change rebuilds from its COPY onwards.
# --force-rm: a failed RUN must not leave its working container (it pins its images).
BUD_FLAGS = ("--isolation", "chroot", "--network", "host", "--layers", "--pull=never",
             "--force-rm")


def sandman_version() -> str:
    """sandman/_version.py, the one version of both distributions (read, not imported: this
    runs before the tree is installed)."""
    text = (REPO / "sandman" / "_version.py").read_text()
    m = re.search(r'^__version__ = "([^"]+)"$', text, re.M)
    if not m:
        raise ImageError("sandman/_version.py has no `__version__ = \"...\"` line")
    return m.group(1)


def dockerfile_copy_sources() -> list[str]:
    """Context paths that images/Dockerfile COPYs (not --from= copies)."""
    out = []
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            out += line.split()[1:-1]
    return out


def _tree_hash(paths: list[str]) -> str:
    h = hashlib.sha256()
    for rel in sorted(set(paths)):
        top = REPO / rel
        files = [top] if top.is_file() else sorted(
            p for p in top.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc")
        for f in files:
            h.update(str(f.relative_to(REPO)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def _base_image() -> Image:
    return _image("sandman-base", BASE_REF, {"rootfs": _rootfs_key(), "config": BASE_CONFIG})


def build_base(force: bool = False) -> Image:
    return _rootfs_image(_base_image(), BASE_CONFIG, force)


def _buildah_version() -> str:
    if not shutil.which("buildah"):
        raise ImageError("`buildah` is not on PATH (Debian package buildah; make sysdeps)")
    return _run(["buildah", "--version"]).stdout.strip()


def buildah_cmd() -> list[str]:
    """buildah with its own storage in the cache (layers stay cached between builds).
    Storage driver: overlay (native, as root), or $SANDMAN_BUILDAH_DRIVER (vfs)."""
    root = cache_dir() / "buildah"
    return ["buildah", "--root", str(root / "storage"), "--runroot", str(root / "run"),
            "--storage-driver", os.environ.get("SANDMAN_BUILDAH_DRIVER", "overlay")]


def _dockerfile_image(name: str, target: str = "") -> Image:
    ref = f"sandman.local/{name}:{sandman_version()}"
    return _image(name, ref, {
        "base": _base_image().key, "dockerfile": DOCKERFILE.read_text(),
        "dockerignore": DOCKERIGNORE.read_text(),
        "sources": _tree_hash(dockerfile_copy_sources()), "buildah": _buildah_version(),
        "flags": BUD_FLAGS + (("--target", target) if target else ())})


def _sandman_image() -> Image:
    return _dockerfile_image("sandman")


def _loadtest_image() -> Image:
    return _dockerfile_image("sandman-loadtest", "loadtest")


def build_sandman(force: bool = False) -> Image:
    """The product image from images/Dockerfile, the file users build with Docker, here with
    buildah over the Debian base (passed as PYTHON_IMAGE)."""
    return _build_dockerfile(_sandman_image(), "", force)


def build_loadtest(force: bool = False) -> Image:
    """images/Dockerfile's `loadtest` target: the sandman venv plus locust (the in-cluster
    load-test Job, loadtest/job.py)."""
    return _build_dockerfile(_loadtest_image(), "loadtest", force)


def _build_dockerfile(img: Image, target: str, force: bool) -> Image:
    if img.built and not force:
        return img
    if os.geteuid() != 0:
        raise ImageError("buildah builds here as root (overlay storage, chroot isolation)")
    # One buildah build at a time per cache: `make test`'s bed tier (tools/release.py's test)
    # and real-node tier want the same image at once, and one's `rmi --prune` would remove
    # the other's intermediate images mid-build. The second finds it built.
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / ".images-buildah.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when closed, also if this process dies
        if img.built and not force:
            return img
        return _buildah_build(img, target)


def _buildah_build(img: Image, target: str) -> Image:
    base = build_base()
    t0 = time.monotonic()
    img.archive.parent.mkdir(parents=True, exist_ok=True)
    log = img.archive.parent / "build.log"
    b = buildah_cmd()
    local = "localhost/" + img.ref.split("/", 1)[1]

    def step(*args: str) -> str:
        with open(log, "a") as f:
            f.write(f"$ {' '.join(args)}\n")
            f.flush()
            res = subprocess.run([*b, *args], stdout=subprocess.PIPE, stderr=f, text=True)
            f.write(res.stdout)
        if res.returncode != 0:
            raise ImageError(f"`buildah {args[0]}` exited {res.returncode}; see {log}")
        return res.stdout

    # `pull --quiet` prints the image ID; the Dockerfile's FROM then finds it by name.
    image_id = step("pull", "--quiet", f"oci-archive:{base.archive}").split()[-1]
    step("tag", image_id, BASE_REF)
    # RUN steps see the host's CA bundle (read-only, during the build only, never in a layer):
    # where egress goes through a TLS-inspecting proxy, pip inside the build must trust what
    # the host trusts. Debian's pip reads the system bundle.
    bundle = "/etc/ssl/certs/ca-certificates.crt"
    trust = ["--volume", f"{bundle}:{bundle}:ro"] if os.path.exists(bundle) else []
    step("bud", *BUD_FLAGS, *(("--target", target) if target else ()), *trust,
         "-f", str(DOCKERFILE),
         "--build-arg", f"PYTHON_IMAGE={BASE_REF}", "-t", local, str(REPO))
    tmp = img.archive.with_name(f".{img.archive.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    step("push", "--quiet", local, f"docker-archive:{tmp}:{img.ref}")
    tmp.rename(img.archive)
    # Untagged images are earlier builds (and the build stage, which only a source change
    # reruns, and then from its COPY): without this the storage grew by ~400 MB per build.
    subprocess.run([*b, "rmi", "--prune"], capture_output=True)
    _finish(img, {"archive": _sha256_file(img.archive)}, t0)
    return img


def sandman_image() -> tuple[str, Path]:
    """(ref, archive path) of the sandman image, built on first use."""
    img = build_sandman()
    return img.ref, img.archive


def loadtest_image() -> tuple[str, Path]:
    """(ref, archive path) of the load-test image, built on first use."""
    img = build_loadtest()
    return img.ref, img.archive


# --- registry of images, import, CLI -------------------------------------------------------

def build_grading_task(force: bool = False) -> Image:
    """The grading demo's task image (testbed/taskimage.py): git, pytest, a repo at /testbed."""
    from testbed import taskimage

    return taskimage.build(force)


def grading_task_image() -> tuple[str, Path]:
    """(ref, archive path) of the grading task image, built on first use."""
    img = build_grading_task()
    return img.ref, img.archive


def _grading_task_image() -> Image:
    from testbed import taskimage

    return taskimage._image()


BUILDERS = {"pause": build_pause, "task": build_task, "sandman": build_sandman,
            "grading-task": build_grading_task, "loadtest": build_loadtest}
# What `build`/`import` without names do: the images every real-node run needs. grading-task
# (its own debootstrap) is built by the grading demo, loadtest by tests/e2e/test_loadtest_job.py,
# or either when named.
DEFAULT_BUILD = ("pause", "task", "sandman")


def describe(name: str) -> Image:
    return {"pause": _pause_image, "task": _task_image, "sandman": _sandman_image,
            "grading-task": _grading_task_image, "loadtest": _loadtest_image}[name]()


class Containerd:
    """A throwaway containerd with its own root, state and socket under `base` (tests, smoke
    checks). The CRI plugin is off: images are run with `ctr run`. Stopped by PID."""

    def __init__(self, base: Path):
        self.base = Path(base)
        self.sock = self.base / "containerd.sock"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 20) -> Containerd:
        for exe in ("containerd", "ctr", "runc"):
            if not shutil.which(exe):
                raise ImageError(f"`{exe}` is not on PATH (Debian packages containerd, runc)")
        self.base.mkdir(parents=True, exist_ok=True)
        cfg = self.base / "config.toml"
        cfg.write_text("\n".join([
            "version = 2",
            f'root = "{self.base}/root"',
            f'state = "{self.base}/state"',
            'disabled_plugins = ["io.containerd.grpc.v1.cri"]',
            "[grpc]", f'  address = "{self.sock}"',
            "[ttrpc]", f'  address = "{self.sock}.ttrpc"',
            "[debug]", '  address = ""', ""]))
        log = open(self.base / "containerd.log", "ab")
        self.proc = subprocess.Popen(["containerd", "--config", str(cfg)], stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ImageError(f"containerd exited {self.proc.returncode}; see "
                                 f"{self.base / 'containerd.log'}")
            if self.sock.exists() and subprocess.call(
                    ["ctr", "-a", str(self.sock), "version"], stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL) == 0:
                return self
            time.sleep(0.1)
        self.stop()
        raise ImageError(f"containerd did not answer on {self.sock} within {timeout}s")

    def ctr(self, *args: str, namespace: str = "k8s.io", timeout: float = 120
            ) -> subprocess.CompletedProcess:
        return subprocess.run(["ctr", "-a", str(self.sock), "-n", namespace, *args],
                              capture_output=True, text=True, timeout=timeout)

    def run(self, ref: str, *cmd: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """`ctr run --rm` a command in `ref` as the image's user (host network, no TTY)."""
        cid = f"smoke-{os.getpid()}-{time.monotonic_ns()}"
        return self.ctr("run", "--rm", "--net-host", ref, cid, *cmd, timeout=timeout)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            # Shims outlive containerd by design; every `run` above is --rm, so none is left.
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        # Snapshots are overlay mounts under root/: unmount what a crash may have left.
        umount_under(self.base / "root")

    def __enter__(self) -> Containerd:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def import_archive(sock: str | Path, archive: Path, namespace: str = "k8s.io",
                   ctr: str = "ctr") -> None:
    """`ctr -a <sock> -n <namespace> images import <archive>` (unpacks for this platform)."""
    _run([ctr, "-a", str(sock), "-n", namespace, "images", "import", str(archive)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m testbed.images", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="verb", required=True)
    b = sub.add_parser("build", help="build the missing images into the cache")
    b.add_argument("names", nargs="*", help=f"{', '.join(BUILDERS)}; default: "
                   f"{', '.join(DEFAULT_BUILD)}")
    b.add_argument("--force", action="store_true",
                   help="rebuild even when cached (from the cached debootstrap tree)")
    i = sub.add_parser("import", help="build if needed, then import into a containerd")
    i.add_argument("--address", "-a", required=True, help="containerd socket")
    i.add_argument("--namespace", "-n", default="k8s.io")
    i.add_argument("names", nargs="*", help=f"default: {', '.join(DEFAULT_BUILD)}")
    sub.add_parser("list", help="ref, cache state and archive path of each image")
    args = ap.parse_args(argv)
    names = getattr(args, "names", None) or list(DEFAULT_BUILD)
    unknown = [n for n in names if n not in BUILDERS]
    if unknown:
        ap.error(f"unknown image(s) {unknown}; known: {list(BUILDERS)}")
    try:
        if args.verb == "list":
            for n in BUILDERS:
                try:
                    img = describe(n)
                except ImageError as e:  # a build tool is missing: say which, list the rest
                    print(f"{n}\tcannot build: {e}")
                    continue
                state = f"{img.archive.stat().st_size / 1e6:.1f} MB" if img.built else "not built"
                print(f"{img.ref}\t{state}\t{img.archive}")
            return 0
        for n in names:
            img = BUILDERS[n](force=getattr(args, "force", False))
            if args.verb == "import":
                import_archive(args.address, img.archive, args.namespace)
                _log(f"imported {img.ref} into {args.address} ({args.namespace})")
            else:
                print(f"{img.ref}\t{img.archive}")
    except ImageError as e:
        print(f"images: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
