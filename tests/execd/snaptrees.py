"""What the snapshot tests share: a small "image" root, its copy as another pod of the same
image has it, a tree's manifest to compare two roots by, and the two snapshot calls."""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import subprocess
import tarfile
from pathlib import Path

import httpx

from sandman import contract
from sandman import execd_api as X

SNAP_ENV = {contract.EXECD_SNAPSHOT_ENV: "on"}
T0 = 1_600_000_000  # the image's mtimes


def make_image(root: Path) -> Path:
    """A small "image": files, an executable, a symlink, a hard link pair, nested dirs."""
    for rel, data, mode in [("usr/bin/tool", b"#!/bin/sh\necho tool\n", 0o755),
                            ("etc/app.conf", b"level=1\n", 0o644),
                            ("etc/old.conf", b"gone soon\n", 0o644),
                            ("opt/pkg/lib/mod.py", b"X = 1\n", 0o644),
                            ("opt/pkg/lib/data.bin", bytes(range(256)) * 64, 0o600),
                            ("srv/tree/a/b/c.txt", b"deep\n", 0o644),
                            ("work/README", b"the task\n", 0o644)]:
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        p.chmod(mode)
    (root / "usr/bin/tool-link").symlink_to("tool")
    os.link(root / "etc/app.conf", root / "etc/app.conf.hard")
    for dirpath, dirnames, filenames in os.walk(root):
        for n in filenames + dirnames:
            os.utime(os.path.join(dirpath, n), (T0, T0), follow_symlinks=False)
    return root


def copy_image(src: Path, dst: Path) -> Path:
    # contents, modes, owners, mtimes and hard links, as every pod of one image has them
    subprocess.run(["cp", "-a", str(src), str(dst)], check=True)
    return dst


def tree_manifest(root: Path, dir_mtimes: bool = True) -> dict[str, tuple]:
    """What a tree holds: per path its type, mode, owner, content's SHA-256 or link target,
    and mtime (to the second); hard links as the group they form."""
    out: dict[str, tuple] = {}
    inodes: dict[int, list[str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".execd-")]
        for n in sorted(filenames + dirnames):
            p = os.path.join(dirpath, n)
            rel = os.path.relpath(p, root)
            st = os.lstat(p)
            mode = stat.S_IMODE(st.st_mode)
            if stat.S_ISLNK(st.st_mode):
                what = ("link", os.readlink(p))
            elif stat.S_ISDIR(st.st_mode):
                what = ("dir", int(st.st_mtime) if dir_mtimes else None)
            else:
                what = ("file", hashlib.sha256(Path(p).read_bytes()).hexdigest(),
                        int(st.st_mtime))
                if st.st_nlink > 1:
                    inodes.setdefault(st.st_ino, []).append(rel)
            out[rel] = (what, mode, st.st_uid, st.st_gid)
    for names in inodes.values():
        for n in names:
            out[n] = out[n] + (tuple(sorted(names)),)
    return out


def take(d) -> bytes:
    """GET /snapshot: the tar, checked against its SHA-256 trailer."""
    r = d.get(X.SNAPSHOT.path, timeout=120)
    assert r.status_code == 200, r.text
    body = r.content
    tar, digest = body[:-X.TREE_DIGEST_LEN], body[-X.TREE_DIGEST_LEN:].decode()
    assert hashlib.sha256(tar).hexdigest() == digest
    return tar


def apply(d, tar: bytes, sha: str | None = None) -> httpx.Response:
    return d.client.post(X.SNAPSHOT_APPLY.path, content=tar, timeout=120, headers={
        X.TREE_SHA256_HEADER: sha or hashlib.sha256(tar).hexdigest()})


def manifest_of(tar: bytes) -> dict:
    with tarfile.open(fileobj=io.BytesIO(tar), mode="r:") as t:
        first = t.next()
        assert first is not None and first.name == ".sandman-snapshot.json"
        f = t.extractfile(first)
        assert f is not None
        return json.loads(f.read())


def craft(base: str, members=(), deleted=(), env=None, cwd=None, manifest_name=None) -> bytes:
    """A snapshot archive: the manifest, then (TarInfo, bytes or None) members."""
    man = json.dumps({"version": 1, "base": base, "cwd": cwd,
                      "env": env or {"set": {}, "unset": []}, "deleted": list(deleted),
                      "skipped": [], "counts": {}}).encode()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        ti = tarfile.TarInfo(manifest_name or ".sandman-snapshot.json")
        ti.size = len(man)
        t.addfile(ti, io.BytesIO(man))
        for ti, data in members:
            if data is not None:
                ti.size = len(data)
            t.addfile(ti, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def member(name: str, data: bytes | None = b"x\n", kind=tarfile.REGTYPE, mode=0o644,
           link: str = "") -> tuple:
    ti = tarfile.TarInfo(name)
    ti.type = kind
    ti.mode = mode
    ti.mtime = 1_600_000_000
    ti.linkname = link
    return ti, (data if kind == tarfile.REGTYPE else None)
