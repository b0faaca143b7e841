"""Checked reuse of extended attributes, ACLs and hard links, against a holder who sets them
where the baseline compared only mode and owner (a directory: a default ACL there is what every
file made in it later inherits) or where the restore's rewrite dropped them (a file's own
xattrs and ACL, a hard link split into two files)."""

from __future__ import annotations

import base64
import os
import struct

import pytest


def acl(*entries) -> bytes:
    """A POSIX ACL as the kernel stores it in system.posix_acl_*: version 2, then (tag, perm,
    id) per entry. Tags: user_obj 1, user 2, group_obj 4, mask 0x10, other 0x20."""
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)


DEFAULT_ACL = acl((1, 7, 0xFFFFFFFF), (2, 7, 4321), (4, 5, 0xFFFFFFFF), (0x10, 7, 0xFFFFFFFF),
                  (0x20, 5, 0xFFFFFFFF))


def xattrs(path) -> dict:
    return {n: os.getxattr(path, n, follow_symlinks=False)
            for n in os.listxattr(path, follow_symlinks=False)}


@pytest.fixture
def etc(tmp_path):
    try:
        os.setxattr(tmp_path, "user.probe", b"1")
    except OSError as e:
        pytest.fail(f"the test's filesystem takes no user xattrs: {e}")
    os.removexattr(tmp_path, "user.probe")
    e = tmp_path / "etc"
    (e / "conf.d").mkdir(parents=True)
    os.setxattr(e / "conf.d", "user.keep", b"image")
    (e / "hosts").write_text("127.0.0.1 localhost\n")
    os.setxattr(e / "hosts", "user.tag", b"image")
    return e


def start(execd_factory, tmp_path):
    ws, etc = tmp_path / "ws", tmp_path / "etc"
    ws.mkdir()
    return execd_factory("--workspace", str(ws), "--baseline-at-start", "on",
                         "--baseline-store", str(tmp_path / "store"), "--baseline-paths",
                         str(etc), "--baseline-packages", str(etc / "none"),
                         "--baseline-localtime", str(etc / "localtime"))


def py(d, code: str) -> None:
    """The holder's Python, run by execd's shell."""
    b64 = base64.b64encode(code.encode()).decode()
    r = d.exec(f"python3 -c 'import base64; exec(base64.b64decode(\"{b64}\"))'", timeout=30)
    assert r["exit_code"] == 0, r


def test_xattrs_and_a_default_acl_on_a_directory_are_seen_and_undone(execd_factory, tmp_path,
                                                                      etc):
    d = start(execd_factory, tmp_path)
    conf = etc / "conf.d"
    py(d, f"import os; p = {str(conf)!r}; os.setxattr(p, \"user.evil\", b\"1\"); "
          f"os.removexattr(p, \"user.keep\"); "
          f"os.setxattr(p, \"system.posix_acl_default\", {DEFAULT_ACL!r})")
    assert "system.posix_acl_default" in os.listxattr(conf)
    changes = d.get("/diff").json()["changes"]
    assert {"kind": "xattr", "path": str(conf), "area": "system",
            "names": ["system.posix_acl_default", "user.evil", "user.keep"]} in changes, changes
    r = d.post("/restore", {})
    assert r.status_code == 200 and r.json()["restored"] is True, r.text
    assert xattrs(conf) == {"user.keep": b"image"}
    assert d.get("/diff").json()["clean"] is True


def test_a_rewritten_file_keeps_its_own_xattrs_and_acl(execd_factory, tmp_path, etc):
    hosts = etc / "hosts"
    access = acl((1, 6, 0xFFFFFFFF), (2, 6, 4321), (4, 4, 0xFFFFFFFF), (0x10, 6, 0xFFFFFFFF),
                 (0x20, 4, 0xFFFFFFFF))
    os.setxattr(hosts, "system.posix_acl_access", access)
    before = xattrs(hosts)
    d = start(execd_factory, tmp_path)
    py(d, f"import os; p = {str(hosts)!r}; os.removexattr(p, \"user.tag\"); "
          f"open(p, \"w\").write(\"6.6.6.6 localhost\\n\")")
    r = d.post("/restore", {})
    assert r.status_code == 200 and r.json()["restored"] is True, r.text
    assert hosts.read_text() == "127.0.0.1 localhost\n"
    assert xattrs(hosts) == before
    assert d.get("/diff").json()["clean"] is True


def test_a_hard_link_of_the_baseline_is_not_split_silently(execd_factory, tmp_path, etc):
    """Two names of one file: the rewrite from the copy would make them two files."""
    os.link(etc / "hosts", etc / "hosts.also")
    d = start(execd_factory, tmp_path)
    py(d, f"open({str(etc / 'hosts')!r}, \"a\").write(\"6.6.6.6 evil\\n\")")
    r = d.post("/restore", {})
    assert r.status_code == 200 and r.json()["restored"] is False, r.text
    assert any("hard link" in x["why"] for x in r.json()["left"]), r.json()


def test_a_symlinks_own_xattrs_are_seen_and_undone(execd_factory, tmp_path, etc):
    """A symlink takes only trusted.* and security.* (root): changing them moves its ctime
    alone, its target the same, which was all the baseline compared of a symlink."""
    link = etc / "link"
    os.symlink("hosts", link)
    try:
        os.setxattr(link, "trusted.keep", b"image", follow_symlinks=False)
    except OSError as e:
        pytest.skip(f"no trusted xattrs on a symlink here (root on a filesystem with them): {e}")
    d = start(execd_factory, tmp_path)
    py(d, f"import os; p = {str(link)!r}; "
          f"os.setxattr(p, \"trusted.evil\", b\"1\", follow_symlinks=False); "
          f"os.removexattr(p, \"trusted.keep\", follow_symlinks=False)")
    changes = d.get("/diff").json()["changes"]
    assert {"kind": "xattr", "path": str(link), "area": "system",
            "names": ["trusted.evil", "trusted.keep"]} in changes, changes
    r = d.post("/restore", {})
    assert r.status_code == 200 and r.json()["restored"] is True, r.text
    assert os.readlink(link) == "hosts"
    assert xattrs(link) == {"trusted.keep": b"image"}
    assert d.get("/diff").json()["clean"] is True
