"""Snapshots as an attacker writes them (docs/execd.md, "Snapshots"). The parent's holder shapes
what /snapshot captures, and whoever can answer for the parent's execd shapes the archive
itself: every test below sends the attack first and then checks that the child's tree (and what
lies outside it) is as it was, or that what was carried is inert data. Each names the naive
version it breaks: an extraction with tarfile's defaults, a walk that follows links, a sender
that trusts the size it stat'ed."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from sandman import execd_api as X

from .snaptrees import (
    SNAP_ENV,
    apply,
    copy_image,
    craft,
    make_image,
    manifest_of,
    member,
    take,
    tree_manifest,
)


@pytest.fixture
def child(execd_factory, tmp_path):
    """A fresh child on an image copy, a dir outside its root that nothing may reach, and the
    image's fingerprint (read from the child's own, empty, snapshot)."""
    img = make_image(tmp_path / "img")
    root = copy_image(img, tmp_path / "child")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_text("keep me\n")
    (root / "lnk-out").symlink_to(outside)  # the image's own link out of the root
    os.utime(root / "lnk-out", (0, 0), follow_symlinks=False)
    d = execd_factory("--root", str(root), "--workspace", str(root / "work"), env=SNAP_ENV)
    base = manifest_of(take(d))["base"]
    return d, root, outside, base


def unchanged(root: Path, outside: Path, before: dict):
    assert tree_manifest(root, dir_mtimes=False) == before
    assert sorted(p.name for p in outside.iterdir()) == ["victim"]
    assert (outside / "victim").read_text() == "keep me\n"
    assert not [p for p in root.iterdir() if p.name.startswith(".execd-")]


def refused(d, tar: bytes, code: int, words: str):
    r = apply(d, tar)
    assert r.status_code == code, r.text
    assert words in r.json()["error"], r.text
    assert "\n" not in r.json()["error"]


@pytest.mark.parametrize("name, words", [
    ("../outside/victim", "'..'"),  # naive extractall: writes beside the root
    ("work/../../outside/victim", "'..'"),
    ("/etc/evil", "absolute"),  # naive: an absolute name lands at /
    ("a/" * 257 + "f", "deeper"),  # past the caps: refused before anything is made
    ("x" * 4097, "over 4096 bytes"),
    ("proc/self/environ", "never carried"),  # the excluded mounts, by name
    ("dev/evil", "never carried"),
    ("sys/kernel/evil", "never carried"),
])
def test_member_names_that_leave_the_root_or_reach_excluded_paths(child, name, words):
    d, root, outside, base = child
    before = tree_manifest(root, dir_mtimes=False)
    refused(d, craft(base, [member(name)]), 422, words)
    unchanged(root, outside, before)


def test_a_member_through_a_link_it_planted_is_refused(child):
    """The archive plants work/esc -> the outside dir, then writes work/esc/victim: a naive
    extractor (or one that opens names from the root) writes through the link."""
    d, root, outside, base = child
    before = tree_manifest(root, dir_mtimes=False)
    tar = craft(base, [member("work/esc", None, tarfile.SYMTYPE, link=str(outside)),
                       member("work/esc/victim", b"pwned\n")])
    refused(d, tar, 422, "through a symlink")
    unchanged(root, outside, before)


def test_a_member_through_a_link_already_in_the_image_is_refused(child):
    """lnk-out is the image's own link out of the root: a naive merge follows it."""
    d, root, outside, base = child
    before = tree_manifest(root, dir_mtimes=False)
    refused(d, craft(base, [member("lnk-out/victim", b"pwned\n")]), 409, "symlink")
    unchanged(root, outside, before)


def test_links_out_of_the_root_and_into_proc_are_carried_as_inert_data(child):
    """A symlink is data: the child's holder could make it itself. It lands as a link, and
    nothing is ever written through it."""
    d, root, outside, base = child
    tar = craft(base, [member("work/proc-link", None, tarfile.SYMTYPE,
                              link="/proc/self/root/etc/shadow"),
                       member("work/out-link", None, tarfile.SYMTYPE, link=str(outside))])
    r = apply(d, tar)
    assert r.status_code == 200, r.text
    assert os.readlink(root / "work/proc-link") == "/proc/self/root/etc/shadow"
    assert os.readlink(root / "work/out-link") == str(outside)
    assert (outside / "victim").read_text() == "keep me\n"


@pytest.mark.parametrize("link", ["etc/app.conf", "/etc/passwd", "../outside/victim"])
def test_hard_links_to_anything_not_earlier_in_the_snapshot_are_refused(child, link):
    """A naive extractor links to the image's file (or, by an absolute or '..' target, to a
    file outside): the child's holder would then write through to it."""
    d, root, outside, base = child
    before = tree_manifest(root, dir_mtimes=False)
    r = apply(d, craft(base, [member("work/h", None, tarfile.LNKTYPE, link=link)]))
    assert r.status_code == 422, r.text
    unchanged(root, outside, before)


@pytest.mark.parametrize("kind, words", [(tarfile.CHRTYPE, "character device"),
                                         (tarfile.BLKTYPE, "block device"),
                                         (tarfile.FIFOTYPE, "fifo")])
def test_device_nodes_and_fifos_are_refused(child, kind, words):
    d, root, outside, base = child
    before = tree_manifest(root, dir_mtimes=False)
    ti, _ = member("work/node", None, kind)
    ti.devmajor, ti.devminor = 1, 3  # /dev/null's number
    refused(d, craft(base, [(ti, None)]), 422, words)
    unchanged(root, outside, before)


@pytest.mark.parametrize("mode", [0o4755, 0o2755])
def test_setuid_and_setgid_members_are_refused(child, mode):
    d, root, outside, base = child
    before = tree_manifest(root, dir_mtimes=False)
    refused(d, craft(base, [member("usr/bin/tool", b"#!/bin/sh\nid\n", mode=mode)]), 422,
            "setuid or setgid")
    unchanged(root, outside, before)


@pytest.mark.parametrize("deleted, code, words", [
    (["../outside/victim"], 422, "'..'"),
    (["/etc"], 422, "absolute"),
    (["lnk-out/victim"], 422, "through a symlink"),  # a naive rm follows the image's link
    (["proc/1"], 422, "never carried"),
    ([""], 422, "empty name"),
    (["."], 422, "no path"),  # the root itself
    (["work/.."], 422, "'..'"),
    ([7], 422, "no path"),
])
def test_deleted_paths_outside_or_through_a_link_are_refused(child, deleted, code, words):
    d, root, outside, base = child
    before = tree_manifest(root, dir_mtimes=False)
    refused(d, craft(base, [member("work/new", b"n\n")], deleted=deleted), code, words)
    unchanged(root, outside, before)


def test_a_refused_member_after_a_deletion_puts_nothing_out_of_place(child):
    """Deletions are judged with the merge: a conflict found then puts them back."""
    d, root, outside, base = child
    before = tree_manifest(root, dir_mtimes=False)
    refused(d, craft(base, [member("lnk-out/x", b"n\n")], deleted=["etc/app.conf"]), 409,
            "symlink")
    unchanged(root, outside, before)


def test_the_digest_is_checked_before_anything_changes(child):
    d, root, outside, base = child
    before = tree_manifest(root, dir_mtimes=False)
    tar = craft(base, [member("etc/app.conf", b"tampered\n"), member("work/big", b"b" * 65536)],
                deleted=["etc/old.conf"])
    r = apply(d, tar, sha=hashlib.sha256(b"the parent's real archive").hexdigest())
    assert r.status_code == 400 and "SHA-256 mismatch" in r.json()["error"], r.text
    unchanged(root, outside, before)
    r = apply(d, tar[:len(tar) // 2])  # cut in the middle of work/big, its own digest
    assert r.status_code == 400 and "truncated" in r.json()["error"], r.text
    unchanged(root, outside, before)
    assert apply(d, tar).status_code == 200  # the same archive, whole: applied
    assert (root / "etc/app.conf").read_text() == "tampered\n"
    assert not (root / "etc/old.conf").exists()


def test_a_manifest_that_is_not_first_or_not_a_manifest_is_refused(child):
    d, root, outside, base = child
    before = tree_manifest(root, dir_mtimes=False)
    refused(d, craft(base, manifest_name="work/x.json"), 422, "not a snapshot")
    refused(d, craft("0" * 64), 409, "another image")
    unchanged(root, outside, before)


@pytest.mark.parametrize("env, words", [
    ({"set": {"BAD NAME": "x"}, "unset": []}, "bad variable"),
    ({"set": {"__SANDMAN_CALL": "x"}, "unset": []}, "bad variable"),
    ({"set": {}, "unset": ["A;touch /tmp/x"]}, "bad variable"),
])
def test_hostile_environment_names_are_refused_before_any_change(child, env, words):
    d, root, outside, base = child
    before = tree_manifest(root, dir_mtimes=False)
    refused(d, craft(base, [member("work/new", b"n\n")], env=env), 422, words)
    unchanged(root, outside, before)


def test_values_and_cwd_are_data_never_code(child, tmp_path):
    d, root, outside, base = child
    flag = tmp_path / "ran"
    env = {"set": {"V": f"$(touch {flag})`touch {flag}`'"}, "unset": []}
    r = apply(d, craft(base, env=env, cwd="../../.."))  # a cwd outside the root: not applied
    assert r.status_code == 200, r.text
    assert not flag.exists()
    assert d.exec('printf %s "$V"')["output"] == env["set"]["V"]
    assert not X.SnapshotApplied.from_json(r.json()).cwd.startswith(str(tmp_path) + "/outside")


def test_a_fifo_and_the_excluded_dirs_are_not_captured(execd_factory, tmp_path):
    root = make_image(tmp_path / "img")
    for x in ("proc", "dev", "sys"):
        (root / x).mkdir()
    d = execd_factory("--root", str(root), "--workspace", str(root / "work"), env=SNAP_ENV)
    d.exec(f"mkfifo {root}/work/pipe; echo x > {root}/dev/planted; echo y > {root}/proc/p; "
           f"echo z > {root}/work/kept")
    tar = take(d)  # a naive sender blocks on the FIFO's open, or sends /dev
    man = manifest_of(tar)
    assert man["skipped"] == ["work/pipe"]
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        names = t.getnames()[1:]
    assert "work/kept" in names
    assert not [n for n in names if n.split("/")[0] in ("proc", "dev", "sys")] and \
        "work/pipe" not in names


def test_a_file_that_grows_while_captured_cuts_the_stream(execd_factory, tmp_path):
    """A naive sender sends the size it stat'ed: a torn copy with a good digest. Here the
    answer ends without its last chunk (or with a digest that does not match)."""
    root = make_image(tmp_path / "img")
    d = execd_factory("--root", str(root), "--workspace", str(root / "work"), env=SNAP_ENV)
    big = root / "work/grow"
    big.write_bytes(b"\0" * (64 << 20))
    stop = threading.Event()

    def grow():
        with open(big, "ab") as f:
            while not stop.is_set():
                f.write(b"x" * 4096)
                f.flush()
                time.sleep(0.0005)

    t = threading.Thread(target=grow)
    t.start()
    try:
        with pytest.raises(httpx.RemoteProtocolError):
            r = d.get(X.SNAPSHOT.path, timeout=120)
            body = r.content
            assert hashlib.sha256(body[:-64]).hexdigest() == body[-64:].decode()  # not reached
    finally:
        stop.set()
        t.join()
    assert "snapshot cut" in d.log.read_text()


def test_an_archive_over_the_childs_cap_is_refused(execd_factory, tmp_path):
    img = make_image(tmp_path / "img")
    root = copy_image(img, tmp_path / "child")
    d = execd_factory("--root", str(root), "--max-snapshot-bytes", "1000", env=SNAP_ENV)
    base = manifest_of(take(d))["base"]
    before = tree_manifest(root, dir_mtimes=False)
    r = apply(d, craft(base, [member("work/a", b"a" * 600), member("work/b", b"b" * 600)]))
    assert r.status_code == 413 and "--max-snapshot-bytes" in r.json()["error"], r.text
    assert tree_manifest(root, dir_mtimes=False) == before


def test_two_applies_at_once_apply_one(child):
    """Both pass the first check while neither holds the lock: the second must not merge
    over the first."""
    d, root, outside, base = child
    tars = [craft(base, [member(f"work/from-{i}", b"%d\n" % i)]) for i in range(2)]
    out: list = [None, None]

    def go(i):
        out[i] = apply(d, tars[i]).status_code

    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(out) == [200, 409], out
    assert len([p for p in (root / "work").iterdir() if p.name.startswith("from-")]) == 1
