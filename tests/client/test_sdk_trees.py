"""sb.upload_tree / sb.download_tree, both twins: a byte-exact round trip through a real execd,
execd's refusals as typed errors, and a hostile server (a real HTTP server on 127.0.0.1 that
answers GET /files/tree with a crafted tar) that cannot make the SDK write outside local_dir."""

from __future__ import annotations

import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sandman import execd_api
from sandman.client import (
    IntegrityError,
    SandboxUnreachable,
    TreeConflict,
    TreeError,
    TreeResult,
    TreeTooLarge,
    UnsafeArchive,
)
from testbed.execd import start_execd
from tests.execd.tartrees import (
    ACROSS,
    HOSTILE,
    PLANTED,
    escaping_links,
    hostile_archive,
    make_tree,
    reg,
    sha,
    snapshot,
    tar_of,
)

from .conftest import FAST_RETRY, Execd, Flavor


def test_round_trip_both_ways(flavor: Flavor, execd: Execd, tmp_path) -> None:
    src, remote, back = tmp_path / "src", tmp_path / "remote", tmp_path / "back"
    make_tree(src)
    calls = []

    async def body():
        async with flavor.connect(execd, on_request=lambda *a: calls.append(a)) as sb:
            up = await sb.upload_tree(src, str(remote))
            assert isinstance(up, TreeResult) and up.path == str(remote)
            assert (up.files, up.symlinks, up.hardlinks) == (7, 3, 0)
            down = await sb.download_tree(str(remote), back)
            assert (down.files, down.dirs, down.symlinks) == (up.files, up.dirs, up.symlinks)
            assert len(down.sha256) == 64 and down.bytes > 0
            # A second upload merges over the first: the same tree, nothing left staged.
            await sb.upload_tree(src, str(remote))

    flavor.run(body)
    assert snapshot(remote) == snapshot(src) == snapshot(back)
    assert [c[0] for c in calls] == ["TREE_WRITE", "TREE_READ", "TREE_WRITE"]
    assert all(c[4] is None for c in calls)
    assert not [p for p in tmp_path.rglob("*") if "-tree-" in p.name]


def test_execd_refusals_are_typed(flavor: Flavor, execd: Execd, tmp_path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    os.symlink("/etc", src / "etc")  # execd refuses a link that leads out of the target
    conflict = tmp_path / "conflict"
    conflict.mkdir()
    (conflict / "d").write_bytes(b"a file where the tree has a directory")
    tree = tmp_path / "tree"
    (tree / "d").mkdir(parents=True)
    (tree / "d" / "f").write_bytes(b"f")
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "p")

    async def body():
        async with flavor.connect(execd) as sb:
            with pytest.raises(UnsafeArchive, match="symlink leads outside"):
                await sb.upload_tree(src, str(tmp_path / "out1"))
            with pytest.raises(TreeConflict):
                await sb.upload_tree(tree, str(conflict))
            with pytest.raises(TreeError, match="fifo"):
                await sb.upload_tree(fifo, str(tmp_path / "out2"))
            with pytest.raises(TreeError, match="no-such-dir"):
                await sb.upload_tree(tmp_path / "no-such-dir", str(tmp_path / "out3"))

    flavor.run(body)
    assert not (tmp_path / "out1").exists() and not (tmp_path / "out2").exists()
    assert (conflict / "d").read_bytes().startswith(b"a file")


def test_size_cap_is_typed(flavor: Flavor, tmp_path) -> None:
    ex = start_execd(tmp_path / "execd", "--max-tree-bytes", "65536")
    try:
        src = tmp_path / "src"
        src.mkdir()
        (src / "big").write_bytes(os.urandom(70000))

        async def body():
            async with flavor.connect(ex) as sb:
                with pytest.raises(TreeTooLarge, match="65536"):
                    await sb.upload_tree(src, str(tmp_path / "up"))
                with pytest.raises(TreeTooLarge):
                    await sb.download_tree(str(src), tmp_path / "down1")
                # The SDK's own cap, under execd's:
                (src / "big").write_bytes(os.urandom(30000))
                with pytest.raises(TreeTooLarge, match="max_bytes"):
                    await sb.download_tree(str(src), tmp_path / "down2", max_bytes=20000)

        flavor.run(body)
        assert not (tmp_path / "up").exists() and not (tmp_path / "down1").exists()
        assert not (tmp_path / "down2").exists()
    finally:
        ex.stop()


# ---------------------------------------------------------------- a hostile execd


class Hostile:
    """A real HTTP server on 127.0.0.1 answering GET /files/tree with `body` (the tar and a
    digest trailer, or anything else); `cut`: announce more bytes than it sends, then close."""

    def __init__(self) -> None:
        self.body = b""
        self.cut = False
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                body = outer.body
                self.send_response(200)
                self.send_header("Content-Type", "application/x-tar")
                self.send_header("Content-Length", str(len(body) + (100 if outer.cut else 0)))
                self.end_headers()
                self.wfile.write(body)
                self.close_connection = True

            def log_message(self, *a: object) -> None:
                pass

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = self.srv.server_address[1]
        self.thread = threading.Thread(target=self.srv.serve_forever, daemon=True)
        self.thread.start()

    def serve(self, tar: bytes, digest: str | None = None) -> None:
        self.body = tar + (digest or sha(tar)).encode()

    def close(self) -> None:
        self.srv.shutdown()
        self.srv.server_close()


@pytest.fixture
def hostile():
    h = Hostile()
    yield h
    h.close()


def connect_hostile(flavor: Flavor, h: Hostile):
    from sandman.client import AsyncSandbox, Sandbox

    from .conftest import Synced

    if flavor.is_async:
        return AsyncSandbox.connect("127.0.0.1", h.port, "t", retry=FAST_RETRY)
    return Synced(Sandbox.connect("127.0.0.1", h.port, "t", retry=FAST_RETRY))


@pytest.mark.parametrize("case", [c[0] for c in HOSTILE])
def test_hostile_download_cannot_escape_local_dir(flavor: Flavor, hostile: Hostile, tmp_path,
                                                 case: str) -> None:
    local, outside = tmp_path / "local", tmp_path / "outside"
    local.mkdir()
    outside.mkdir()
    (local / "keep.txt").write_bytes(b"keep")
    (outside / "secret").write_bytes(b"secret")
    before_l, before_o = snapshot(local), snapshot(outside)
    hostile.serve(hostile_archive(case, str(outside)))

    async def body():
        async with connect_hostile(flavor, hostile) as sb:
            with pytest.raises(UnsafeArchive) as ei:
                await sb.download_tree("/x", local)
            assert "\n" not in str(ei.value)

    flavor.run(body)
    assert snapshot(local) == before_l and snapshot(outside) == before_o
    assert not os.path.lexists("/etc/sandman-tree-escaped")


@pytest.mark.parametrize("case", [c[0] for c in ACROSS])
def test_hostile_downloads_into_one_dir_stay_inside(flavor: Flavor, hostile: Hostile, tmp_path,
                                                    case: str) -> None:
    """Several downloads into one local_dir: each is judged against what the earlier ones left
    there, so the last is refused and no symlink in local_dir leads outside it."""
    local = tmp_path / "local"
    local.mkdir()
    archives = next(c[1] for c in ACROSS if c[0] == case)
    state = {}

    async def body():
        async with connect_hostile(flavor, hostile) as sb:
            for members in archives[:-1]:
                hostile.serve(tar_of(*members))
                await sb.download_tree("/x", local)
            state["before"] = snapshot(local)
            hostile.serve(tar_of(reg("good.txt"), *archives[-1]))
            with pytest.raises(UnsafeArchive, match="symlink"):
                await sb.download_tree("/x", local)

    flavor.run(body)
    assert snapshot(local) == state["before"] and escaping_links(local) == []


@pytest.mark.parametrize("case", [c[0] for c in PLANTED])
def test_hostile_download_judged_against_links_in_local_dir(flavor: Flavor, hostile: Hostile,
                                                           tmp_path, case: str) -> None:
    local, outside = tmp_path / "local", tmp_path / "outside"
    local.mkdir()
    outside.mkdir()
    (outside / "secret").write_bytes(b"secret")
    plant, members = next(c[1:] for c in PLANTED if c[0] == case)
    plant(local, outside)
    before_l, before_o = snapshot(local), snapshot(outside)
    hostile.serve(tar_of(reg("good.txt"), *members))

    async def body():
        async with connect_hostile(flavor, hostile) as sb:
            with pytest.raises(UnsafeArchive, match="symlink"):
                await sb.download_tree("/x", local)

    flavor.run(body)
    assert snapshot(local) == before_l and snapshot(outside) == before_o


def test_hostile_download_wrong_digest_cut_or_planted_link(flavor: Flavor, hostile: Hostile,
                                                           tmp_path) -> None:
    local, outside = tmp_path / "local", tmp_path / "outside"
    local.mkdir()
    outside.mkdir()
    os.symlink(outside, local / "d")  # a link already in local_dir: never written through
    good = tar_of(reg("a.txt", b"a"))

    async def body():
        async with connect_hostile(flavor, hostile) as sb:
            hostile.serve(good, "0" * 64)
            with pytest.raises(IntegrityError):
                await sb.download_tree("/x", local)
            hostile.serve(good[:700])  # the digest of the cut bytes: still not a whole tar
            with pytest.raises(UnsafeArchive, match="not a valid tar"):
                await sb.download_tree("/x", local)
            hostile.serve(good)
            hostile.cut = True
            with pytest.raises(SandboxUnreachable):
                await sb.download_tree("/x", local)
            hostile.cut = False
            hostile.serve(tar_of(reg("d/evil", b"evil")))
            with pytest.raises(TreeConflict):
                await sb.download_tree("/x", local)
            hostile.body = b"short"  # not even a digest
            with pytest.raises(IntegrityError):
                await sb.download_tree("/x", local)

    flavor.run(body)
    assert os.listdir(outside) == [] and sorted(os.listdir(local)) == ["d"]


def test_download_result_names_local_dir(flavor: Flavor, hostile: Hostile, tmp_path) -> None:
    hostile.serve(tar_of(reg("x/y.txt", b"y")))

    async def body():
        async with connect_hostile(flavor, hostile) as sb:
            return await sb.download_tree("/x", tmp_path / "new" / "dir")

    r = flavor.run(body)
    assert r.path == str(tmp_path / "new" / "dir") and r.files == 1 and r.dirs == 1
    assert (tmp_path / "new" / "dir" / "x" / "y.txt").read_bytes() == b"y"
    assert execd_api.TREE_DIGEST_LEN == 64
