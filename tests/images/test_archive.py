"""The image archive writer (testbed/images.py): digests in the manifests match the blobs."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from pathlib import Path

from testbed import images

# The manifest digest of the archive below. It changes only when the archive layout does: then
# bump images.ARCHIVE_FORMAT (it keys every cached image) and update this value.
GOLDEN_MANIFEST = "sha256:6de6d3da178e9a500f7a6027082303cf31bfe2f77cf89009b843c75954df76bf"


def _read(archive: Path) -> dict[str, bytes]:
    with tarfile.open(archive) as tf:
        return {m.name: tf.extractfile(m).read() for m in tf.getmembers() if m.isfile()}


def _layer(tmp_path: Path, mtime: int) -> Path:
    src = tmp_path / f"src{mtime}"
    (src / "bin").mkdir(parents=True)
    (src / "bin" / "hello").write_text("#!/bin/sh\necho hi\n")
    os.chmod(src / "bin" / "hello", 0o755)
    os.symlink("bin/hello", src / "hello")
    os.link(src / "bin" / "hello", src / "bin" / "hello2")
    (src / "dev").mkdir()
    (src / "dev" / "skipped").write_text("x")
    for p in [*src.rglob("*"), src]:
        os.utime(p, (mtime, mtime), follow_symlinks=False)
    out = tmp_path / f"layer{mtime}.tar"
    images.write_layer(src, out, skip=("dev",))
    return out


def test_layer_is_reproducible_and_keeps_links(tmp_path):
    a, b = _layer(tmp_path, 1000), _layer(tmp_path, 2000)
    assert a.read_bytes() == b.read_bytes(), "same files, other mtimes: the layer must not change"
    with tarfile.open(a) as tf:
        m = {x.name: x for x in tf.getmembers()}
    assert sorted(m) == ["bin", "bin/hello", "bin/hello2", "dev", "hello"]
    assert m["hello"].issym() and m["hello"].linkname == "bin/hello"
    assert m["bin/hello2"].islnk() and m["bin/hello2"].linkname == "bin/hello"
    assert m["bin/hello"].mode == 0o755 and m["bin/hello"].uname == ""


def test_digests_match_blobs(tmp_path):
    layer = tmp_path / "layer.tar"
    with tarfile.open(layer, "w") as tf:
        ti = tarfile.TarInfo("etc/hostname")
        ti.size = 5
        tf.addfile(ti, io.BytesIO(b"test\n"))
    out = tmp_path / "img.tar"
    got = images.write_archive(out, "sandman.local/test:1", layer,
                               {"Cmd": ["/bin/true"], "User": "65532:65532"}, arch="amd64")
    files = _read(out)
    for name, data in files.items():
        if name.startswith("blobs/sha256/"):
            assert hashlib.sha256(data).hexdigest() == name.rsplit("/", 1)[1], name

    def blob(d):
        return files["blobs/sha256/" + d.split(":", 1)[1]]

    assert json.loads(files["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    index = json.loads(files["index.json"])
    [desc] = index["manifests"]
    assert desc["digest"] == got["manifest"] and desc["size"] == len(blob(desc["digest"]))
    assert desc["annotations"]["io.containerd.image.name"] == "sandman.local/test:1"
    assert desc["annotations"]["org.opencontainers.image.ref.name"] == "1"
    manifest = json.loads(blob(desc["digest"]))
    assert manifest["config"]["digest"] == got["config"]
    assert manifest["config"]["size"] == len(blob(got["config"]))
    [lay] = manifest["layers"]
    assert lay == {"mediaType": images.OCI_LAYER, "digest": got["layer"],
                   "size": layer.stat().st_size}
    assert blob(got["layer"]) == layer.read_bytes()
    config = json.loads(blob(got["config"]))
    assert config["rootfs"] == {"type": "layers", "diff_ids": [got["layer"]]}
    assert (config["os"], config["architecture"]) == ("linux", "amd64")
    assert config["config"] == {"Cmd": ["/bin/true"], "User": "65532:65532"}
    # docker load / podman read manifest.json: the same config and layer blobs.
    [dm] = json.loads(files["manifest.json"])
    assert dm == {"Config": "blobs/sha256/" + got["config"][7:], "RepoTags": ["sandman.local/test:1"],
                  "Layers": ["blobs/sha256/" + got["layer"][7:]]}
    # Golden: the layout is stable for a given layer and config (see GOLDEN_MANIFEST).
    assert got["manifest"] == GOLDEN_MANIFEST, got["manifest"]
    assert not list(tmp_path.glob(".*.tmp")), "the temporary archive was left behind"


def test_stale_builds_are_capped_not_dropped_at_once(tmp_path):
    """Two checkouts sharing the cache must not delete each other's build on every run."""
    dirs = []
    for i in range(5):
        d = tmp_path / f"images-x-{i:016x}"
        d.mkdir()
        os.utime(d, (1000 + i, 1000 + i))
        dirs.append(d)
    lookalike = tmp_path / f"images-x-base-{0:016x}"
    lookalike.mkdir()
    images._drop_stale("x", dirs[0])
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([dirs[0].name, dirs[4].name, dirs[3].name, lookalike.name])
