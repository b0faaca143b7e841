"""execd's snapshots (docs/execd.md, "Snapshots"): the holder's changes to an "image" root taken
from one execd and applied by a second execd started on a copy of the same image; both trees
then hold the same entries (content, mode, owner, link targets, mtimes), and the second shell
the first one's cwd and exported environment. Against real execd processes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sandman import contract
from sandman import execd_api as X

from .snaptrees import (
    SNAP_ENV,
    T0,
    apply,
    copy_image,
    make_image,
    manifest_of,
    take,
    tree_manifest,
)


def start_pair(execd_factory, tmp_path: Path, image: Path | None = None):
    """The parent on image A, the child on a copy of it (or on `image`)."""
    a = make_image(tmp_path / "imgA")
    b = image or copy_image(a, tmp_path / "imgB")
    parent = execd_factory("--root", str(a), "--workspace", str(a / "work"), env=SNAP_ENV)
    child = execd_factory("--root", str(b), "--workspace", str(b / "work"), env=SNAP_ENV)
    return a, b, parent, child


def test_a_snapshot_applied_in_a_copy_of_the_image_makes_the_same_tree(execd_factory,
                                                                         tmp_path):
    a, b, parent, child = start_pair(execd_factory, tmp_path)
    script = f"""
        set -e
        cd {a}
        echo level=2 > etc/app.conf           # changed (a hard link's content: both names)
        rm etc/old.conf                       # deleted
        rm -r srv/tree/a                      # a deleted dir: one entry in the deleted list
        mkdir -p work/src/pkg && echo 'print(1)' > work/src/pkg/main.py
        chmod 0700 work/src
        chown 1234:2345 work/src/pkg/main.py     # an owner (execd is root here)
        chown -h 1234:2345 work/src/pkg
        ln -s ../../etc/app.conf work/src/conf-link
        ln -s /usr/bin/tool work/abs-link
        ln work/src/pkg/main.py work/src/pkg/main-hard.py
        chmod 4755 usr/bin/tool               # setuid: never carried
        echo sneaky > opt/pkg/lib/mod.py && touch -d @{T0} opt/pkg/lib/mod.py  # mtime set back
        rm usr/bin/tool-link && mkdir usr/bin/tool-link  # a symlink became a dir
        cd work/src
        export FORKED=yes GREETING='a b  c'
        unset HOSTNAME_NOT_SET_ANYWAY
    """
    r = parent.exec(script)
    assert r["exit_code"] == 0, r
    tar = take(parent)
    man = manifest_of(tar)
    assert set(man["deleted"]) == {"etc/old.conf", "srv/tree/a", "usr/bin/tool-link"}
    assert man["cwd"] == "work/src"
    assert man["env"]["set"]["FORKED"] == "yes"
    assert man["env"]["set"]["GREETING"] == "a b  c"
    r = apply(child, tar)
    assert r.status_code == 200, r.text
    res = X.SnapshotApplied.from_json(r.json())
    assert res.deleted == 3 and res.files > 0 and res.bytes == len(tar)
    assert res.cwd == str(b / "work/src")
    want = tree_manifest(a)
    # setuid is not carried: the child's tool is the parent's without it
    assert want["usr/bin/tool"][1] == 0o4755
    want["usr/bin/tool"] = (want["usr/bin/tool"][0], 0o755) + want["usr/bin/tool"][2:]
    got = tree_manifest(b)
    assert got == want
    assert got["work/src/pkg/main.py"][2:4] == (1234, 2345)
    out = child.exec('echo "$PWD|$FORKED|$GREETING"')
    assert out["output"].strip() == f"{b}/work/src|yes|a b  c"


def test_an_untouched_sandbox_gives_an_empty_snapshot(execd_factory, tmp_path):
    a, b, parent, child = start_pair(execd_factory, tmp_path)
    tar = take(parent)
    man = manifest_of(tar)
    assert man["deleted"] == [] and man["counts"]["entries"] == 0, man
    r = apply(child, tar)
    assert r.status_code == 200, r.text
    assert tree_manifest(a, dir_mtimes=False) == tree_manifest(b, dir_mtimes=False)


def test_without_the_base_or_in_a_grading_pod_it_refuses(execd_factory, tmp_path):
    a = make_image(tmp_path / "img")
    plain = execd_factory("--root", str(a))
    r = plain.get(X.SNAPSHOT.path)
    assert r.status_code == 409 and "SANDMAN_SNAPSHOT" in r.json()["error"], r.text
    grading = execd_factory("--root", str(a), "--baseline-store", str(tmp_path / "store"),
                            "--baseline-paths", str(a / "etc"), "--baseline-packages", "",
                            env={**SNAP_ENV, contract.EXECD_BASELINE_ENV: "on"})
    r = grading.get(X.SNAPSHOT.path)
    assert r.status_code == 409 and r.json()["error"] == "a grading pod is never snapshotted"
    r = apply(grading, b"x" * 1024)
    assert r.status_code == 409 and r.json()["error"] == "a grading pod is never snapshotted"


def test_a_snapshot_of_another_image_is_refused_and_changes_nothing(execd_factory, tmp_path):
    other = make_image(tmp_path / "imgC")
    (other / "etc/extra").write_text("another image\n")
    a, b, parent, child = start_pair(execd_factory, tmp_path, image=other)
    parent.exec(f"echo changed > {a}/etc/app.conf")
    before = tree_manifest(b)
    r = apply(child, take(parent))
    assert r.status_code == 409 and "another image" in r.json()["error"], r.text
    assert tree_manifest(b) == before


def test_apply_is_for_a_fresh_sandbox_once(execd_factory, tmp_path):
    a, b, parent, child = start_pair(execd_factory, tmp_path)
    parent.exec(f"echo v2 > {a}/etc/app.conf")
    tar = take(parent)
    child.exec(f"echo mine > {b}/work/own")
    r = apply(child, tar)
    assert r.status_code == 409 and "fresh" in r.json()["error"], r.text
    child.exec(f"rm {b}/work/own")
    assert apply(child, tar).status_code == 200
    r = apply(child, tar)
    assert r.status_code == 409 and "already" in r.json()["error"], r.text


def test_a_fork_of_a_fork_carries_both_holders_changes(execd_factory, tmp_path):
    a, b, parent, child = start_pair(execd_factory, tmp_path)
    parent.exec(f"echo one > {a}/work/one")
    assert apply(child, take(parent)).status_code == 200
    child.exec(f"echo two > {b}/work/two")
    c = copy_image(make_image(tmp_path / "imgD"), tmp_path / "imgE")
    grandchild = execd_factory("--root", str(c), "--workspace", str(c / "work"), env=SNAP_ENV)
    assert apply(grandchild, take(child)).status_code == 200
    assert (c / "work/one").read_text() == "one\n" and (c / "work/two").read_text() == "two\n"


@pytest.mark.parametrize("cap", [4096])
def test_a_snapshot_over_the_byte_cap_is_refused_before_it_streams(execd_factory, tmp_path,
                                                                    cap):
    a = make_image(tmp_path / "img")
    d = execd_factory("--root", str(a), "--max-snapshot-bytes", str(cap), env=SNAP_ENV)
    d.exec(f"head -c {cap + 1} /dev/zero > {a}/work/big")
    r = d.get(X.SNAPSHOT.path)
    assert r.status_code == 413 and "--max-snapshot-bytes" in r.json()["error"], r.text


def test_execds_copy_of_the_contract_name_is_the_contracts():
    from execd.execd_daemon import snapshot

    assert snapshot.EXECD_SNAPSHOT_ENV == contract.EXECD_SNAPSHOT_ENV
    assert snapshot.SNAPSHOT_MAX_BYTES == X.SNAPSHOT_MAX_BYTES


def test_the_mount_points_below_the_root_are_never_walked(tmp_path):
    """The kubelet's files are bind mounts over the root's file system (same st_dev on some
    kernels): mountinfo names them, and the base excludes each."""
    from execd.execd_daemon import snapshot

    mounted = snapshot.mount_points("/")
    assert "/proc" in mounted and "/" not in mounted
    assert snapshot.mount_points(str(tmp_path / "img")) == []


DROP = "-dac_override,-fowner,-dac_read_search,-chown"
UNPRIVILEGED = ("setpriv", f"--bounding-set={DROP}", f"--inh-caps={DROP}")


def test_an_execd_that_may_not_write_the_root_stages_in_tmp(execd_factory, tmp_path):
    """As in a pod whose user is not root: the image's / (here owned by another user, and
    execd without the capabilities that pass over that) cannot take the staging directory,
    /tmp can; the image's directories execd does not own keep their own mode and owner."""
    a = make_image(tmp_path / "imgA")
    (a / "tmp").mkdir()
    (a / "tmp").chmod(0o1777)
    for p in (a, a / "tmp", a / "etc"):
        os.chown(p, 1000, 1000)
    b = copy_image(a, tmp_path / "imgB")
    parent = execd_factory("--root", str(a), "--workspace", str(a / "work"), env=SNAP_ENV,
                           prefix=UNPRIVILEGED)
    child = execd_factory("--root", str(b), "--workspace", str(b / "work"), env=SNAP_ENV,
                          prefix=UNPRIVILEGED)
    r = parent.exec(f"touch {a}/cannot 2>/dev/null; echo $?; echo data > {a}/tmp/scratch; "
                    f"mkdir {a}/work/new && echo n > {a}/work/new/f; rm {a}/work/README")
    assert r["output"].split()[0] == "1", r  # the root is not the holder's to write
    r = apply(child, take(parent))
    assert r.status_code == 200, r.text
    assert tree_manifest(b, dir_mtimes=False) == tree_manifest(a, dir_mtimes=False)
    assert os.stat(b).st_uid == 1000 and not [p for p in b.iterdir()
                                               if p.name.startswith(".execd-")]
    assert not [p for p in (b / "tmp").iterdir() if p.name.startswith(".execd-")]


def test_a_pods_root_slash_is_never_carried():
    """In a pod the root is "/", which starts with its own top ("/"): a change at the top
    level (a file of /etc) made "/" a carried directory named ".", and every snapshot was
    cut at it."""
    import threading
    import types

    from execd.execd_daemon import snapshot

    base = snapshot.SnapshotBase.__new__(snapshot.SnapshotBase)
    base.root, base.dev = "/", os.lstat("/").st_dev
    base.walker = types.SimpleNamespace(
        lock=threading.Lock(), dirty={"/"},
        _file_changes=lambda: [{"path": "/etc/hostname", "kind": "changed"},
                               {"path": "/etc/no-such-entry", "kind": "removed"}])
    carried, deleted, _ = base.changes()
    assert "/" not in carried and "/etc" in carried and "/etc/hostname" in carried
    assert deleted == ["etc/no-such-entry"]
