"""Snapshots between two "pods" of one image, each laid out as a container runtime lays out a
sandbox: execd in a private mount namespace whose --root is an overlay (the image as the lower
layer, a per-pod upper), a file bind-mounted over the image's etc/hosts (the kubelet's, per
pod) and a tmpfs volume at mnt/vol. What the overlay reports (one st_dev, inodes of its own,
copy-ups) and what mountinfo lists are the real thing, not a copy of a directory.

The trees are compared from inside each namespace (the mounts are private to it), through
execd's own /exec."""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import tarfile

import pytest

from .snaptrees import SNAP_ENV, apply, craft, make_image, manifest_of, member, take

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                       reason="needs root and unshare for a private mount namespace"),
]

POD = r"""
set -e
lower=$1 upper=$2 work=$3 root=$4 hosts=$5
shift 5
mount -t overlay sandbox-root -o "lowerdir=$lower,upperdir=$upper,workdir=$work" "$root"
mount --bind "$hosts" "$root/etc/hosts"
mount -t tmpfs sandbox-vol "$root/mnt/vol"
exec "$@"
"""

# Each entry's type, mode, owner, content hash or link target, file mtime: as test_snapshot's
# tree_manifest, printed as JSON by the pod's own python.
MANIFEST = r"""
import hashlib, json, os, stat, sys
root = sys.argv[1]
out = {}
for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if not d.startswith(".execd-")]
    for n in filenames + dirnames:
        p = os.path.join(dirpath, n)
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode):
            what = ["link", os.readlink(p)]
        elif stat.S_ISDIR(st.st_mode):
            what = ["dir"]
        else:
            what = ["file", hashlib.sha256(open(p, "rb").read()).hexdigest(), int(st.st_mtime)]
        out[os.path.relpath(p, root)] = [what, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid]
print(json.dumps(out, sort_keys=True))
"""


def start_pod(execd_factory, tmp_path, image, name):
    base = tmp_path / name
    for d in ("upper", "work", "root"):
        (base / d).mkdir(parents=True)
    hosts = base / "hosts"
    hosts.write_text(f"10.0.0.1 {name}\n")
    root = base / "root"
    prefix = ("unshare", "-m", "--propagation", "private", "sh", "-c", POD, "sh", str(image),
              str(base / "upper"), str(base / "work"), str(root), str(hosts))
    d = execd_factory("--root", str(root), "--workspace", str(root / "work"), env=SNAP_ENV,
                      prefix=prefix)
    assert d.exec(f"cat {root}/etc/hosts")["output"] == f"10.0.0.1 {name}\n"  # as laid out
    return d, root


def tree(d, root) -> dict:
    r = d.exec(f"{sys.executable} -c '{MANIFEST}' {root}")
    assert r["exit_code"] == 0, r
    return json.loads(r["output"])


@pytest.fixture
def image(tmp_path):
    img = make_image(tmp_path / "image")
    (img / "etc/hosts").write_text("127.0.0.1 localhost\n")
    (img / "mnt/vol").mkdir(parents=True)
    return img


def test_a_fork_between_two_overlay_pods_carries_the_root_and_no_mount(execd_factory,
                                                                         tmp_path, image):
    parent, proot = start_pod(execd_factory, tmp_path, image, "parent")
    child, croot = start_pod(execd_factory, tmp_path, image, "child")
    r = parent.exec(f"""
        set -e
        cd {proot}
        echo changed >> opt/pkg/lib/mod.py        # a copy-up of an image file
        rm etc/old.conf                            # a whiteout
        rm -r srv/tree                             # an opaque dir's worth of whiteouts
        mkdir -p work/src && echo 'x = 1' > work/src/m.py
        echo 'pod-local' >> etc/hosts              # the kubelet's file: never carried
        echo scratch > mnt/vol/data                # a volume: never carried
        cd work/src
    """)
    assert r["exit_code"] == 0, r
    tar = take(parent)
    man = manifest_of(tar)
    assert "etc/hosts" not in man["deleted"] and man["cwd"] == "work/src"
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        names = t.getnames()[1:]
    assert not [n for n in names if n.startswith(("mnt/vol/", "etc/hosts"))], names
    r = apply(child, tar)
    assert r.status_code == 200, r.text
    want, got = tree(parent, proot), tree(child, croot)
    for t in (want, got):  # the per-pod mounts: each pod's own
        for k in [k for k in t if k == "etc/hosts" or k.startswith("mnt/vol/")]:
            del t[k]
    assert got == want
    assert child.exec(f"cat {croot}/etc/hosts")["output"] == "10.0.0.1 child\n"
    assert child.exec(f"ls -A {croot}/mnt/vol")["output"] == ""
    assert child.exec("pwd")["output"] == f"{croot}/work/src\n"


def test_a_member_or_a_deletion_at_a_mount_point_is_refused(execd_factory, tmp_path, image):
    """The kubelet's etc/hosts and the volume, by name: a naive apply renames over the bind
    mount (EBUSY midway) or writes into the volume."""
    parent, proot = start_pod(execd_factory, tmp_path, image, "parent")
    child, croot = start_pod(execd_factory, tmp_path, image, "child")
    fingerprint = manifest_of(take(parent))["base"]
    before = tree(child, croot)
    for tar in (craft(fingerprint, [member("etc/hosts", b"10.6.6.6 evil\n")]),
                craft(fingerprint, [member("mnt/vol/planted", b"x\n")]),
                craft(fingerprint, deleted=["etc/hosts"]),
                craft(fingerprint, deleted=["mnt/vol"])):
        r = apply(child, tar)
        assert r.status_code == 422 and "never carried" in r.json()["error"], r.text
    assert tree(child, croot) == before
    assert child.exec(f"cat {croot}/etc/hosts")["output"] == "10.0.0.1 child\n"
