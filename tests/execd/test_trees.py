"""Trees as one tar (POST /files/tree/write, GET /files/tree) against a real execd: byte-exact
round trips, and hostile archives POSTed straight to the route, each refused with nothing
written outside the target and nothing half-extracted inside it; the size cap; bounded memory
for a large archive."""

from __future__ import annotations

import hashlib
import io
import os
import socket
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from execd.execd_daemon import base, trees
from sandman import execd_api as api
from sandman.client import _tree

from .conftest import AUTH
from .tartrees import (
    ACROSS,
    HOSTILE,
    PLANTED,
    escaping_links,
    hard,
    hostile_archive,
    make_tree,
    reg,
    sha,
    snapshot,
    sym,
    tar_of,
)

WRITE, READ = "/files/tree/write", "/files/tree"


def post_tar(execd, target: Path | str, data: bytes, digest: str | None = None, **kw):
    headers = {api.TREE_SHA256_HEADER: digest or sha(data)}
    return execd.client.post(WRITE, params={"path": str(target)}, content=data,
                             headers=headers, **kw)


def fetch_tar(execd, path: Path | str) -> bytes:
    """The download's body checked: the tar, then its SHA-256 as 64 hex digits."""
    r = execd.get(READ, params={"path": str(path)})
    assert r.status_code == 200, r.text
    assert r.headers.get("transfer-encoding") == "chunked"
    body = r.content
    data, trailer = body[:-api.TREE_DIGEST_LEN], body[-api.TREE_DIGEST_LEN:]
    assert trailer.decode() == sha(data)
    return data


def packed(src: Path) -> bytes:
    buf = io.BytesIO()
    size, digest = _tree.pack(str(src), buf)
    assert size == len(buf.getvalue()) and digest == sha(buf.getvalue())
    return buf.getvalue()


def no_staging_left(root: Path) -> None:
    left = [p for p in root.rglob("*") if ".execd-tree-" in p.name or ".sandman-tree-" in p.name]
    assert not left, left


def test_round_trip_is_byte_exact_with_modes_and_links(execd, tmp_path):
    src = tmp_path / "src"
    make_tree(src)
    data = packed(src)
    r = post_tar(execd, tmp_path / "up" / "new", data)  # parents made too
    assert r.status_code == 200, r.text
    j = r.json()
    assert j["sha256"] == sha(data) and j["bytes"] == len(data)
    assert (j["files"], j["symlinks"], j["hardlinks"]) == (7, 3, 0)
    assert snapshot(tmp_path / "up" / "new") == snapshot(src)
    no_staging_left(tmp_path / "up")
    # And back down: execd's tar unpacked by the SDK's checks gives the same tree again.
    back = tmp_path / "back"
    _tree.unpack(io.BytesIO(fetch_tar(execd, tmp_path / "up" / "new")), str(back))
    assert snapshot(back) == snapshot(src)
    assert stat.S_IMODE((back / "run.sh").stat().st_mode) == 0o751
    assert stat.S_IMODE((back / "ro").stat().st_mode) == 0o555
    no_staging_left(back)


def test_upload_merges_into_an_existing_target(execd, tmp_path):
    dst = tmp_path / "dst"
    (dst / "keep").mkdir(parents=True)
    (dst / "keep" / "old.txt").write_bytes(b"old")
    (dst / "replace.txt").write_bytes(b"before")
    r = post_tar(execd, dst, tar_of(reg("replace.txt", b"after"), reg("keep/new.txt", b"n")))
    assert r.status_code == 200, r.text
    assert (dst / "replace.txt").read_bytes() == b"after"
    assert (dst / "keep" / "old.txt").read_bytes() == b"old"
    assert (dst / "keep" / "new.txt").read_bytes() == b"n"


@pytest.mark.parametrize("case", [c[0] for c in HOSTILE])
def test_hostile_archive_refused_nothing_written(execd, tmp_path, case):
    target, outside = tmp_path / "target", tmp_path / "outside"
    target.mkdir()
    outside.mkdir()
    (target / "keep.txt").write_bytes(b"keep")
    (outside / "secret").write_bytes(b"secret")
    before_t, before_o = snapshot(target), snapshot(outside)
    before_tmp = sorted(p.name for p in tmp_path.iterdir())
    _, _, status, word = next(c for c in HOSTILE if c[0] == case)
    r = post_tar(execd, target, hostile_archive(case, str(outside)))
    assert r.status_code == status, r.text
    assert word in r.json()["error"]
    assert "\n" not in r.json()["error"]
    assert snapshot(target) == before_t  # not even good.txt: nothing half-extracted
    assert snapshot(outside) == before_o
    assert sorted(p.name for p in tmp_path.iterdir()) == before_tmp
    assert not os.path.lexists("/etc/sandman-tree-escaped")
    # The connection and the daemon are fine after a refusal.
    assert execd.get("/health").status_code == 200


def test_refusal_of_a_new_target_removes_the_directories_it_made(execd, tmp_path):
    r = post_tar(execd, tmp_path / "x" / "y", hostile_archive("dotdot", str(tmp_path)))
    assert r.status_code == 422
    assert not (tmp_path / "x").exists()


def test_symlink_already_in_the_target_is_never_written_through(execd, tmp_path):
    target, outside = tmp_path / "target", tmp_path / "outside"
    target.mkdir()
    outside.mkdir()
    (outside / "secret").write_bytes(b"secret")
    os.symlink(outside, target / "d")  # planted by the agent
    os.symlink(outside / "secret", target / "f")
    r = post_tar(execd, target, tar_of(reg("ok.txt"), reg("d/x", b"evil")))
    assert r.status_code == 409, r.text
    assert "symlink" in r.json()["error"]
    assert sorted(os.listdir(outside)) == ["secret"] and not (target / "ok.txt").exists()
    # A file over a planted symlink replaces the link; the file it pointed to is untouched.
    r = post_tar(execd, target, tar_of(reg("f", b"evil")))
    assert r.status_code == 200, r.text
    assert (outside / "secret").read_bytes() == b"secret"
    assert not (target / "f").is_symlink() and (target / "f").read_bytes() == b"evil"


@pytest.mark.parametrize("case", [c[0] for c in ACROSS])
def test_links_stay_inside_across_uploads(execd, tmp_path, case):
    """Each upload's links are judged against what the target holds on disk, not against the
    archive's own names: the last of these is refused, and nothing left leads outside."""
    target = tmp_path / "target"
    target.mkdir()
    archives = next(c[1] for c in ACROSS if c[0] == case)
    for members in archives[:-1]:
        r = post_tar(execd, target, tar_of(*members))
        assert r.status_code == 200, r.text
    before = snapshot(target)
    r = post_tar(execd, target, tar_of(reg("good.txt"), *archives[-1]))
    assert r.status_code == 422, r.text
    assert "symlink" in r.json()["error"] and "\n" not in r.json()["error"]
    assert snapshot(target) == before and escaping_links(target) == []
    no_staging_left(target)


@pytest.mark.parametrize("case", [c[0] for c in PLANTED])
def test_links_planted_in_the_target_are_judged(execd, tmp_path, case):
    """The agent's links already in the target count when an upload's links are judged."""
    target, outside = tmp_path / "target", tmp_path / "outside"
    target.mkdir()
    outside.mkdir()
    (outside / "secret").write_bytes(b"secret")
    plant, members = next(c[1:] for c in PLANTED if c[0] == case)
    plant(target, outside)
    before_t, before_o = snapshot(target), snapshot(outside)
    r = post_tar(execd, target, tar_of(reg("good.txt"), *members))
    assert r.status_code == 422, r.text
    assert "symlink" in r.json()["error"]
    assert snapshot(target) == before_t and snapshot(outside) == before_o


def test_links_that_stay_inside_across_uploads_are_kept(execd, tmp_path):
    """What the judgement must not refuse: links through earlier links that end inside, a
    dangling link, and a link of the holder's that already led out and the archive leaves be."""
    target, outside = tmp_path / "target", tmp_path / "outside"
    target.mkdir()
    outside.mkdir()
    os.symlink(outside, target / "theirs")
    for members in ([sym("s", "."), reg("d/f")], [sym("t", "s/s/d"), sym("u", "t/f")],
                    [sym("v", "t/../s/d/../missing"), sym("w", "u")]):
        r = post_tar(execd, target, tar_of(*members))
        assert r.status_code == 200, r.text
    assert (target / "w").read_bytes() == b"x"
    assert escaping_links(target) == [str(target / "theirs")]


def test_hard_links_never_reach_a_link_on_disk(execd, tmp_path):
    """A hard link's source must be a file of the same archive; a name that is a symlink on disk
    is replaced, never written through."""
    target, outside = tmp_path / "target", tmp_path / "outside"
    target.mkdir()
    outside.mkdir()
    (outside / "secret").write_bytes(b"secret")
    os.symlink(outside / "secret", target / "p")
    os.symlink(outside, target / "o")
    r = post_tar(execd, target, tar_of(reg("good.txt"), hard("h", "p")))
    assert r.status_code == 422 and "hard link" in r.json()["error"], r.text
    r = post_tar(execd, target, tar_of(reg("good.txt"), hard("o/h", "good.txt")))
    assert r.status_code == 409, r.text
    r = post_tar(execd, target, tar_of(reg("f", b"new"), hard("p", "f")))
    assert r.status_code == 200, r.text
    assert not (target / "p").is_symlink() and (target / "p").read_bytes() == b"new"
    assert os.listdir(outside) == ["secret"] and (outside / "secret").read_bytes() == b"secret"


@pytest.mark.parametrize("impl", ["execd", "sdk"])
def test_merge_never_follows_a_directory_swapped_for_a_link(tmp_path, impl):
    """A directory checked as one, then replaced by a symlink before the write: the merge
    opens each level with O_NOFOLLOW from its parent's fd, so it stops there."""
    target, stage, outside = tmp_path / "target", tmp_path / "stage", tmp_path / "outside"
    (target / "d").mkdir(parents=True)
    (stage / "d").mkdir(parents=True)
    (stage / "d" / "x").write_bytes(b"evil")
    outside.mkdir()
    merge = trees.tree_merge if impl == "execd" else _tree.merge
    sfd = os.open(stage, os.O_RDONLY | os.O_DIRECTORY)
    tfd = os.open(target, os.O_RDONLY | os.O_DIRECTORY)
    try:
        merge(sfd, tfd, True)
        os.rmdir(target / "d")
        os.symlink(outside, target / "d")
        with pytest.raises((OSError, trees.HTTPError, _tree.TreeConflict)):
            merge(sfd, tfd, False)
    finally:
        os.close(sfd)
        os.close(tfd)
    assert os.listdir(outside) == []


def test_directory_over_a_file_conflicts(execd, tmp_path):
    target = tmp_path / "t"
    target.mkdir()
    (target / "a").write_bytes(b"file")
    r = post_tar(execd, target, tar_of(reg("a/b")))
    assert r.status_code == 409 and (target / "a").read_bytes() == b"file"


def test_wrong_sha_refused_nothing_left(execd, tmp_path):
    data = tar_of(reg("a.txt", b"a"))
    r = post_tar(execd, tmp_path / "t", data, digest="0" * 64)
    assert r.status_code == 400, r.text
    assert "mismatch" in r.json()["error"] and r.json()["sha256"] == sha(data)
    assert not (tmp_path / "t").exists()
    r = post_tar(execd, tmp_path / "t", data, digest="not-a-digest")
    assert r.status_code == 400 and "X-Content-SHA256" in r.json()["error"]


def test_truncated_archive_refused(execd, tmp_path):
    whole = tar_of(reg("a.txt", b"a"), reg("big.bin", os.urandom(5000)))
    cut = whole[:512 * 4]  # a.txt whole, big.bin's header and part of its data
    r = post_tar(execd, tmp_path / "t", cut)  # a correct digest of the cut bytes
    assert r.status_code == 400, r.text
    assert "not a valid tar" in r.json()["error"]
    assert not (tmp_path / "t").exists()
    r = post_tar(execd, tmp_path / "t", b"this is no tar archive" * 100)
    assert r.status_code == 400 and not (tmp_path / "t").exists()


def test_body_cut_by_the_client_leaves_nothing(execd, tmp_path):
    data = tar_of(reg("a.txt", b"a"), reg("b.bin", os.urandom(20000)))
    target = tmp_path / "t"
    with socket.create_connection(("127.0.0.1", execd.port), timeout=10) as s:
        head = (f"POST {WRITE}?path={target} HTTP/1.1\r\nHost: x\r\n"
                f"Authorization: {AUTH['Authorization']}\r\nContent-Length: {len(data)}\r\n"
                f"{api.TREE_SHA256_HEADER}: {sha(data)}\r\n\r\n")
        s.sendall(head.encode() + data[:len(data) // 2])
        s.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 400") and b"ended early" in answer
    assert not target.exists()


def test_unauthenticated_and_bad_requests(execd, tmp_path):
    data = tar_of(reg("a"))
    r = execd.client.post(WRITE, params={"path": str(tmp_path / "t")}, content=data,
                          headers={"Authorization": "Bearer wrong",
                                   api.TREE_SHA256_HEADER: sha(data)})
    assert r.status_code == 401 and not (tmp_path / "t").exists()
    r = execd.client.get(READ, params={"path": str(tmp_path)}, headers={"Authorization": ""})
    assert r.status_code == 401
    (tmp_path / "file").write_bytes(b"f")
    assert post_tar(execd, tmp_path / "file", data).status_code == 400
    assert execd.get(READ, params={"path": str(tmp_path / "file")}).status_code == 400
    assert execd.get(READ, params={"path": str(tmp_path / "nope")}).status_code == 404


def test_paths_outside_root_refused(execd_factory, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    ex = execd_factory("--root", str(root))
    r = post_tar(ex, tmp_path / "t", tar_of(reg("a")))
    assert r.status_code == 403 and not (tmp_path / "t").exists()
    assert ex.get(READ, params={"path": str(tmp_path)}).status_code == 403


def test_download_refuses_special_files_and_strips_setuid(execd, tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (d / "suid").write_bytes(b"x")
    os.chmod(d / "suid", 0o4755)
    with tarfile.open(fileobj=io.BytesIO(fetch_tar(execd, d))) as t:
        assert [(m.name, m.mode) for m in t.getmembers()] == [("suid", 0o755)]
    os.mkfifo(d / "pipe")
    r = execd.get(READ, params={"path": str(d)})
    assert r.status_code == 400 and "fifo" in r.json()["error"]


def test_size_cap_both_ways(execd_factory, tmp_path):
    ex = execd_factory("--max-tree-bytes", "65536")
    data = tar_of(reg("big.bin", os.urandom(70000)))
    r = post_tar(ex, tmp_path / "t", data)
    assert r.status_code == 413 and "65536" in r.json()["error"]
    assert not (tmp_path / "t").exists()
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "big.bin").write_bytes(os.urandom(70000))
    r = ex.get(READ, params={"path": str(tmp_path / "d")})
    assert r.status_code == 413 and "cap" in r.json()["error"]
    ok = tar_of(reg("small.bin", os.urandom(30000)))
    assert post_tar(ex, tmp_path / "t", ok).status_code == 200


def _big_body(size: int):
    """A one-member tar of `size` bytes, generated: never whole in this process either."""
    ti = tarfile.TarInfo("big.bin")
    ti.size = size
    yield ti.tobuf(tarfile.PAX_FORMAT)
    block = (b"0123456789abcdef" * 65536)[: 1 << 20]
    left = size
    while left:
        n = min(left, len(block))
        yield block[:n]
        left -= n
    yield b"\0" * ((-size) % 512) + b"\0" * 1024


@pytest.mark.slow
def test_memory_stays_bounded_for_a_large_archive(execd, tmp_path):
    size = 300 << 20
    h, total = hashlib.sha256(), 0
    for chunk in _big_body(size):
        h.update(chunk)
        total += len(chunk)
    before = execd.rss_kib()
    peak = [before]

    def sample():
        peak[0] = max(peak[0], execd.rss_kib())

    class Sampled:
        def __iter__(self):
            for i, chunk in enumerate(_big_body(size)):
                if i % 16 == 0:
                    sample()
                yield chunk

    r = execd.client.post(WRITE, params={"path": str(tmp_path / "t")}, content=Sampled(),
                          headers={api.TREE_SHA256_HEADER: h.hexdigest(),
                                   "Content-Length": str(total)}, timeout=300)
    assert r.status_code == 200, r.text
    sample()
    assert (tmp_path / "t" / "big.bin").stat().st_size == size
    assert peak[0] - before < 32 * 1024, (before, peak[0])  # KiB: a 300 MiB body, < 32 MiB
    os.unlink(tmp_path / "t" / "big.bin")



def test_download_of_a_tree_changed_while_sent_is_cut(execd, tmp_path):
    """A file that shrinks while it is sent: execd cannot say so in a tar that has begun, so
    it ends the answer without its last chunk and digest; the client sees a cut stream."""
    import httpx

    d = tmp_path / "d"
    d.mkdir()
    big = d / "big.bin"
    with open(big, "wb") as f:
        for _ in range(64):  # far more than the socket buffers hold: execd waits on us
            f.write(b"z" * (1 << 20))
    with execd.client.stream("GET", READ, params={"path": str(d)}) as r:
        assert r.status_code == 200
        it = r.iter_raw()
        next(it)
        os.truncate(big, 0)
        with pytest.raises(httpx.RemoteProtocolError):
            for _ in it:
                pass
    assert execd.get("/health").status_code == 200
    r = execd.get(READ, params={"path": str(d)})  # and the tree as it is now goes whole
    assert r.status_code == 200 and r.content[-64:].decode() == sha(r.content[:-64])


# ---------------------------------------------------------------- removing a tree, any depth


@pytest.mark.parametrize("impl", ["execd", "sdk"])
@pytest.mark.slow
def test_remove_tree_goes_deep_and_never_follows_a_link(tmp_path, impl):

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("x")
    root = tmp_path / "root"
    p = root / "t"
    p.mkdir(parents=True)
    for _ in range(1100):  # past the recursion limit and REMOVE_FDS
        p = Path(os.path.join(p, "d"))
        os.mkdir(p)
    os.symlink(outside, os.path.join(p, "out"))
    os.symlink("../../../..", os.path.join(p, "up"))
    (root / "t" / "f").write_text("y")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if impl == "execd":
            gone = trees.remove_tree(fd, "t", base.now() + 60)
        else:
            gone = _tree.remove_tree(fd, "t")
        left = os.listdir(root)
    finally:
        os.close(fd)
        # What a failed removal left is too deep for pytest's own (recursive) cleanup of its
        # temporary directories, which would fail a later session: GNU rm does not recurse.
        subprocess.run(["rm", "-rf", "--one-file-system", str(root)], check=False, timeout=120)
    assert gone and left == [] and (outside / "keep").read_text() == "x"


def test_remove_tree_stops_at_its_deadline(tmp_path):

    (tmp_path / "t" / "a").mkdir(parents=True)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert not trees.remove_tree(fd, "t", base.now() - 1)
    finally:
        os.close(fd)
    assert (tmp_path / "t" / "a").is_dir()


def test_remove_tree_skips_what_it_cannot_remove(tmp_path):

    locked = tmp_path / "t" / "locked"
    locked.mkdir(parents=True)
    (locked / "f").write_text("x")
    (tmp_path / "t" / "other").write_text("y")
    locked.chmod(0o500)
    try:
        if os.geteuid() == 0:
            # Root removes a 0500 directory's entries anyway: the removal runs in a process
            # without the capabilities that override file modes, as a pod's root may be.
            code = ("import os, sys; from execd.execd_daemon import base, trees; "
                    "fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY); "
                    "sys.exit(0 if trees.remove_tree(fd, 't', base.now() + 10) else 3)")
            r = subprocess.run(["setpriv", "--bounding-set=-dac_override,-fowner,-dac_read_search",
                                "--inh-caps=-dac_override,-fowner,-dac_read_search",
                                sys.executable, "-c", code, str(tmp_path)],
                               cwd=Path(__file__).resolve().parents[2], capture_output=True,
                               text=True, timeout=60)
            assert r.returncode == 3, (r.returncode, r.stderr[-500:])
        else:
            fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
            try:
                assert not trees.remove_tree(fd, "t", base.now() + 10)
            finally:
                os.close(fd)
    finally:
        locked.chmod(0o700)
    assert os.listdir(tmp_path / "t") == ["locked"]
