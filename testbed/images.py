"""Container images for a real node, built without Docker: `python -m testbed.images ...`.

No Docker engine and no registry are reachable on our machines, so every image a real node
needs is built here, cached under ~/.cache/sandman-testbed/images-<name>-<key> (the key hashes
the image's inputs: a change rebuilds, a re-run is a no-op) and imported into a containerd with
`ctr -a <sock> -n k8s.io images import <archive>`:

- pause: a static Go program (images/pause/pause.go) that holds the pod's namespaces, reaps
  children and exits on SIGTERM/SIGINT; the node's containerd uses it as `sandbox_image`.

Archives are OCI image layouts (oci-layout, index.json, blobs/sha256/...) that also carry a
Docker `manifest.json`: containerd 1.6's `ctr images import` reads index.json and names the image
from its `io.containerd.image.name` annotation; `docker load` and podman read manifest.json.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import platform
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


def _finish(img: Image, digests: dict, t0: float) -> None:
    meta = {"ref": img.ref, "key": img.key, **digests, "seconds": round(time.monotonic() - t0, 1),
            "bytes": img.archive.stat().st_size}
    (img.archive.parent / "image.json").write_text(json.dumps(meta, indent=1) + "\n")
    _log(f"built {img.ref} in {meta['seconds']}s: {img.archive} ({meta['bytes'] / 1e6:.1f} MB)")


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


# --- registry of images, import, CLI -------------------------------------------------------

BUILDERS = {"pause": build_pause}


def describe(name: str) -> Image:
    return {"pause": _pause_image}[name]()


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

    def run(self, ref: str, *cmd: str, user: str | None = None, timeout: float = 60
            ) -> subprocess.CompletedProcess:
        """`ctr run --rm` a command in `ref` (host network, no TTY); returns the result."""
        cid = f"smoke-{os.getpid()}-{time.monotonic_ns()}"
        extra = ["--user", user] if user else []
        return self.ctr("run", "--rm", "--net-host", *extra, ref, cid, *cmd, timeout=timeout)

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
        root = str(self.base / "root")
        with open("/proc/self/mounts") as f:
            mounts = [ln.split()[1] for ln in f if ln.split()[1].startswith(root)]
        for m in reversed(mounts):
            subprocess.call(["umount", "-l", m], stderr=subprocess.DEVNULL)

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
    b.add_argument("names", nargs="*", help=f"default: all ({', '.join(BUILDERS)})")
    b.add_argument("--force", action="store_true", help="rebuild even when cached")
    i = sub.add_parser("import", help="build if needed, then import into a containerd")
    i.add_argument("--address", "-a", required=True, help="containerd socket")
    i.add_argument("--namespace", "-n", default="k8s.io")
    i.add_argument("names", nargs="*", help="default: all")
    sub.add_parser("list", help="ref, cache state and archive path of each image")
    args = ap.parse_args(argv)
    names = getattr(args, "names", None) or list(BUILDERS)
    unknown = [n for n in names if n not in BUILDERS]
    if unknown:
        ap.error(f"unknown image(s) {unknown}; known: {list(BUILDERS)}")
    try:
        if args.verb == "list":
            for n in BUILDERS:
                img = describe(n)
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
