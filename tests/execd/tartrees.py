"""Crafting tar archives for the tree tests, the way an attacker would: tarfile writes any
member we describe (a `../` name, a device, a link to /etc/passwd), in memory."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from collections.abc import Callable
from pathlib import Path

Member = tuple[tarfile.TarInfo, bytes | None]


def reg(name: str, data: bytes = b"x", mode: int = 0o644) -> Member:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mode = len(data), mode
    return ti, data


def sym(name: str, target: str) -> Member:
    ti = tarfile.TarInfo(name)
    ti.type, ti.linkname, ti.mode = tarfile.SYMTYPE, target, 0o777
    return ti, None


def hard(name: str, target: str) -> Member:
    ti = tarfile.TarInfo(name)
    ti.type, ti.linkname = tarfile.LNKTYPE, target
    return ti, None


def dir_(name: str, mode: int = 0o755) -> Member:
    ti = tarfile.TarInfo(name)
    ti.type, ti.mode = tarfile.DIRTYPE, mode
    return ti, None


def special(name: str, kind: bytes) -> Member:
    ti = tarfile.TarInfo(name)
    ti.type, ti.devmajor, ti.devminor = kind, 1, 3
    return ti, None


def pax(m: Member, headers: dict[str, str]) -> Member:
    m[0].pax_headers = headers
    return m


def gnu_longname(size: int) -> Member:
    """A GNU long-name header ('L') claiming `size` bytes of name."""
    ti = tarfile.TarInfo("././@LongLink")
    ti.type, ti.size = tarfile.GNUTYPE_LONGNAME, size
    return ti, b"n" * size


def sparse(name: str) -> Member:
    ti = tarfile.TarInfo(name)
    ti.type, ti.size = tarfile.GNUTYPE_SPARSE, 0
    return ti, b""


def tar_of(*members: Member) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for ti, data in members:
            t.addfile(ti, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# (id, members given `outside`: an absolute directory beside the target, expected status, a
# word of the error). Each archive starts with a harmless member: a partial extraction shows.
HOSTILE: list[tuple[str, Callable[[str], list[Member]], int, str]] = [
    ("dotdot", lambda o: [reg("../escaped")], 422, "'..'"),
    ("dotdot_deep", lambda o: [reg("a/b/../../../escaped")], 422, "'..'"),
    ("absolute", lambda o: [reg(f"{o}/escaped")], 422, "absolute"),
    ("absolute_etc", lambda o: [reg("/etc/sandman-tree-escaped")], 422, "absolute"),
    ("symlink_root_then_through", lambda o: [sym("l", "/"), reg("l/etc/sandman-tree-escaped")],
     422, "symlink"),
    ("symlink_out_then_through", lambda o: [sym("l", "../outside"), reg("l/escaped")], 422,
     "through a symlink"),
    ("symlink_in_then_through", lambda o: [dir_("sub"), sym("l", "sub"), reg("l/escaped")],
     422, "through a symlink"),
    ("symlink_absolute", lambda o: [sym("l", o)], 422, "symlink leads outside"),
    ("symlink_dotdot", lambda o: [sym("up", "../../")], 422, "symlink leads outside"),
    ("symlink_dotdot_deep", lambda o: [sym("a/b/up", "../../../outside")], 422,
     "symlink leads outside"),
    # a/s -> . makes a/s/s/../.. climb two levels above a: lexically it stays in a.
    ("symlink_chain", lambda o: [sym("a/s", "."), sym("a/l", "s/s/../..")], 422,
     "symlink leads outside"),
    ("symlink_loop", lambda o: [sym("x", "y"), sym("y", "x/z")], 422, "symlink leads outside"),
    ("hardlink_passwd", lambda o: [hard("pw", "/etc/passwd")], 422, "absolute"),
    ("hardlink_outside", lambda o: [hard("pw", "../outside/secret")], 422, "'..'"),
    ("hardlink_not_in_archive", lambda o: [hard("pw", "elsewhere")], 422, "hard link"),
    ("hardlink_to_symlink", lambda o: [sym("s", "good.txt"), hard("h", "s")], 422, "hard link"),
    ("char_device", lambda o: [special("null", tarfile.CHRTYPE)], 422, "character device"),
    ("block_device", lambda o: [special("sda", tarfile.BLKTYPE)], 422, "block device"),
    ("fifo", lambda o: [special("pipe", tarfile.FIFOTYPE)], 422, "fifo"),
    ("setuid", lambda o: [reg("suid", b"#!/bin/sh\n", 0o4755)], 422, "setuid"),
    ("setgid_dir", lambda o: [dir_("sgid", 0o2755)], 422, "setgid"),
    ("duplicate", lambda o: [reg("a"), sym("a", "good.txt")], 422, "twice"),
    ("file_then_through", lambda o: [reg("f"), reg("f/x")], 422, "through a symlink or a file"),
    # tarfile reads a pax header whole: 2 MiB of "comment" must be refused before it is read.
    ("huge_pax_header", lambda o: [pax(reg("p"), {"comment": "x" * (2 << 20)})], 422,
     "metadata header"),
    ("huge_gnu_longname", lambda o: [gnu_longname(3 << 20)], 422, "metadata header"),
    ("gnu_sparse", lambda o: [sparse("s")], 422, "sparse"),
]


# Trees that stay inside their target across calls: each case is archives written into one
# directory in turn. All but the last are accepted; the last is refused, since with what the
# earlier ones left on disk one of its links, or one already there, would lead outside. Each
# archive alone passes a check that judges its names lexically.
ACROSS: list[tuple[str, list[list[Member]]]] = [
    ("dot_then_up", [[sym("a", ".")], [sym("b", "a/..")]]),
    ("chain_of_three", [[sym("s", ".")], [sym("t", "s/s")], [sym("l", "t/..")]]),
    # Through an earlier link whose target has `..` components.
    ("dotdot_through_earlier", [[dir_("x/y"), sym("x/y/up", "../..")], [sym("z", "x/y/up/..")]]),
    # The second archive replaces what a link already on disk goes through.
    ("replaced_under_old_link", [[dir_("d"), sym("a", "d"), sym("b", "a/..")], [sym("a", ".")]]),
    ("dangling_then_filled", [[sym("b", "a/..")], [sym("a", ".")]]),
    ("file_then_link", [[reg("f"), sym("b", "f/..")], [sym("f", ".")]]),
]

# Links already in the target before one archive (the agent's in a sandbox; anyone's in a local
# directory): (id, plant(target, outside), members). Each archive is refused.
PLANTED: list[tuple[str, Callable[[Path, Path], None], list[Member]]] = [
    ("through_link_to_root", lambda t, o: os.symlink("/", t / "r"), [sym("x", "r/etc")]),
    ("through_link_to_outside", lambda t, o: os.symlink(o, t / "o"), [sym("x", "o/secret")]),
    ("through_relative_link_out", lambda t, o: os.symlink(f"../{o.name}", t / "o"),
     [sym("x", "o")]),
    ("up_through_dot_link", lambda t, o: os.symlink(".", t / "a"), [sym("b", "a/..")]),
    ("deep_dotdot_through_link", lambda t, o: (os.makedirs(t / "p" / "q"),
                                                 os.symlink("../..", t / "p" / "q" / "up")),
     [dir_("p"), sym("p/l", "q/up/../..")]),
    # The archive's link is what makes the planted one lead out.
    ("makes_planted_link_escape", lambda t, o: os.symlink("a/..", t / "b"), [sym("a", ".")]),
]


def escaping_links(root: Path) -> list[str]:
    """The symlinks under root that resolve outside it (or loop)."""
    top = os.path.realpath(root)
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            if os.path.islink(p):
                try:
                    real = os.path.realpath(p, strict=True)
                except FileNotFoundError:
                    real = os.path.realpath(p)
                except OSError:
                    out.append(p)
                    continue
                if real != top and not real.startswith(top + "/"):
                    out.append(p)
    return out


def hostile_archive(case: str, outside: str) -> bytes:
    for name, members, _, _ in HOSTILE:
        if name == case:
            return tar_of(reg("good.txt", b"good"), *members(outside))
    raise KeyError(case)


def snapshot(root: Path) -> dict[str, tuple[int, bytes]]:
    """Every entry under root: its mode and its content (link target for a symlink)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            st = p.lstat()
            body = (os.readlink(p).encode() if p.is_symlink()
                    else p.read_bytes() if p.is_file() else b"")
            out[str(p.relative_to(root))] = (st.st_mode, body)
    return out


def make_tree(root: Path) -> None:
    """Nested directories, modes, symlinks inside, empty files, a unicode name, binary data."""
    (root / "a" / "b" / "c").mkdir(parents=True)
    (root / "a" / "b" / "c" / "deep.bin").write_bytes(bytes(range(256)) * 40 + b"\r\n\0")
    (root / "empty").write_bytes(b"")
    (root / "ünïcødé ☃.txt").write_text("snow\n", encoding="utf-8")
    (root / "run.sh").write_bytes(b"#!/bin/sh\necho hi\n")
    os.chmod(root / "run.sh", 0o751)
    (root / "secret").write_bytes(b"s")
    os.chmod(root / "secret", 0o600)
    (root / "emptydir").mkdir()
    (root / "ro").mkdir()
    (root / "ro" / "inside").write_bytes(b"i")
    os.chmod(root / "ro", 0o555)
    os.symlink("b/c/deep.bin", root / "a" / "to_file")
    os.symlink("../a/b", root / "emptydir" / "to_dir")
    os.symlink("missing-but-inside", root / "dangling")
    (root / ("n" * 120) / ("m" * 120)).mkdir(parents=True)  # past ustar's 100-byte names
    (root / ("n" * 120) / ("m" * 120) / "f").write_bytes(b"long")
