"""Trees as one tar, the SDK's half: pack a local tree for `upload_tree`, check and unpack what
execd sends for `download_tree`. Local disk only (both twins call it; the async one in a
thread). The sandbox is not trusted: every member is checked by hand (tarfile's extraction
filters need Python 3.12 or a backport), the same rules execd applies to an upload
(docs/execd.md, "Trees"): nothing lands outside the target, nothing is written through a
symlink, no device, FIFO, setuid or setgid file, and a refusal leaves the target as it was.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import tarfile
import threading
from typing import IO, Any

from sandman import execd_api
from sandman.client.errors import TreeConflict, TreeError, TreeTooLarge, UnsafeArchive

STAGING_PREFIX = ".sandman-tree-"
LINK_HOPS = 40  # symlinks followed while checking where one leads (the kernel's limit)
COPY_CHUNK = 1 << 20
# A pax or GNU long-name header is read whole by tarfile: bounded here as execd bounds it.
META_MAX = execd_api.TREE_META_MAX
# A member's name: at most 4,096 bytes (PATH_MAX) and 256 components; a symlink's target at
# most 4,096 bytes; an mtime finite and within +-2**34 s: execd's limits. Anything else is
# refused (UnsafeArchive).
NAME_MAX = execd_api.TREE_NAME_MAX
DEPTH_MAX = execd_api.TREE_DEPTH_MAX
MTIME_MAX = execd_api.TREE_MTIME_MAX
# Modes from the sandbox are masked with this: rwxr-xr-x at most, so no download makes a local
# file or directory group- or world-writable (the umask does not apply to fchmod), and no
# sticky bit (setuid and setgid are refused).
MODE_MASK = 0o755
REMOVE_FDS = 32  # directory fds a staging dir's removal holds open at once
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Judging a link only looks: O_PATH (Linux) opens a directory that can be traversed but not
# read, as the kernel's own lookup would go through it.
_LOOK_FLAGS = _DIR_FLAGS | getattr(os, "O_PATH", 0)
LOOK_FDS = 32  # directory levels a View holds open at once; deeper ones are reopened
# Judging and merging are one step per process: two downloads into one directory at once
# would each be judged without the other's links.
_MERGING = threading.Lock()


# ---- pack (upload)

class _HashingWriter:
    """What tarfile writes goes to `out`, hashed and counted, refused past `cap`."""

    def __init__(self, out: IO[bytes], cap: int) -> None:
        self.out = out
        self.cap = cap
        self.size = 0
        self.sha = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.size += len(data)
        if self.size > self.cap:
            raise TreeTooLarge(f"the tree's archive is over the {self.cap}-byte cap")
        self.sha.update(data)
        self.out.write(data)
        return len(data)


def walk(root_fd: int, where: str = "") -> Any:
    """(relative name, lstat) of everything under root_fd, sorted, parents first; never
    through a symlink."""
    for name in sorted(os.listdir(root_fd)):
        st = os.lstat(name, dir_fd=root_fd)
        yield where + name, st
        if stat.S_ISDIR(st.st_mode):
            fd = os.open(name, _DIR_FLAGS, dir_fd=root_fd)
            try:
                yield from walk(fd, where + name + "/")
            finally:
                os.close(fd)


def pack(local_dir: str, out: IO[bytes],
         cap: int = execd_api.TREE_MAX_BYTES) -> tuple[int, str]:
    """Writes `local_dir` as a tar (PAX) to `out`: regular files, directories and symlinks
    (as links), modes without setuid/setgid (stripped: execd refuses them), mtimes, no
    owners; a hard link goes as a second copy. Returns (size, SHA-256 hex)."""
    try:
        root_fd = os.open(local_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise TreeError(f"upload_tree: {local_dir}: {e.strerror or e}") from None
    w = _HashingWriter(out, cap)
    try:
        with tarfile.open(fileobj=w, mode="w|", format=tarfile.PAX_FORMAT,  # type: ignore[call-overload]
                          encoding="utf-8", errors="surrogateescape") as tar:
            for name, st in walk(root_fd):
                ti = tarfile.TarInfo(name)
                ti.mode = stat.S_IMODE(st.st_mode) & 0o1777
                ti.mtime = int(st.st_mtime)
                if stat.S_ISDIR(st.st_mode):
                    ti.type = tarfile.DIRTYPE
                    tar.addfile(ti)
                elif stat.S_ISLNK(st.st_mode):
                    ti.type = tarfile.SYMTYPE
                    ti.linkname = os.readlink(name, dir_fd=root_fd)
                    tar.addfile(ti)
                elif stat.S_ISREG(st.st_mode):
                    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root_fd)
                    with os.fdopen(fd, "rb") as f:
                        ti.size = os.fstat(fd).st_size
                        tar.addfile(ti, f)
                else:
                    raise TreeError(f"upload_tree: cannot send {_kind(st.st_mode)} {name!r} "
                                    f"in {local_dir} (regular files, directories and "
                                    f"symlinks only)")
    except OSError as e:
        raise TreeError(f"upload_tree: reading {local_dir}: {e}") from None
    finally:
        os.close(root_fd)
    return w.size, w.sha.hexdigest()


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "fifo"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "special file"


# ---- unpack (download): the same rules as execd's tree_write

def _refuse(message: str, name: str) -> UnsafeArchive:
    return UnsafeArchive(f"download_tree: {message}: {name[:300]!r}; nothing was written")


def member_parts(name: str) -> list[str]:
    """A member name as path components under the target; refuses what could land outside."""
    if not name or "\0" in name:
        raise _refuse("empty name or NUL byte in a member name", name)
    if name.startswith("/"):
        raise _refuse("absolute member name", name)
    if len(name.encode("utf-8", "surrogateescape")) > NAME_MAX:
        raise _refuse(f"member name over {NAME_MAX} bytes", name)
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise _refuse("'..' in a member name", name)
    if len(parts) > DEPTH_MAX:
        raise _refuse(f"member name deeper than {DEPTH_MAX} components", name)
    return parts


def link_escapes(roots: int | list[int] | tuple[int, ...], link_parts: list[str], target: str,
                 hops: int = LINK_HOPS, hide: str | None = None) -> bool:
    """Whether following the symlink at link_parts to `target` ends outside the tree (execd's
    tree_link_escapes): `roots` one fd on the tree's top, or several seen as one (View: the
    staging directory over local_dir as it is on disk); resolved component by component, each
    level opened from the one above with O_NOFOLLOW and each link read where it is, whether
    it comes from this archive, an earlier download or anyone else. `hide`: a name at the top
    taken as missing (the staging directory)."""
    if not target or target.startswith("/"):
        return True
    view = View([roots] if isinstance(roots, int) else list(roots), hide)
    lost = 0  # components below the last directory found (missing, or a file): lexical
    try:
        for p in link_parts[:-1]:
            if lost or view.look(p) is not True:
                lost += 1
        todo = target.split("/")[::-1]
        while todo:
            p = todo.pop()
            if p in ("", "."):
                continue
            if p == "..":
                if lost:
                    lost -= 1
                elif not view.names:
                    return True
                else:
                    view.up()
                continue
            if lost:
                lost += 1
                continue
            got = view.look(p)
            if got is None:
                lost += 1  # missing: nothing below it is a link, the rest is lexical
            elif got is not True:
                hops -= 1
                if hops < 0 or not got or got.startswith("/"):
                    return True
                todo.extend(got.split("/")[::-1])
        return False
    finally:
        view.close()


def links_judged(stage_fd: int, target_fd: int, stage_name: str,
                 links: list[tuple[list[str], str]]) -> None:
    """Refuses (UnsafeArchive) the archive when one of its symlinks, or one already in
    local_dir (an earlier download's, anyone's), would lead outside local_dir once the staged
    tree is merged in (execd's tree_links_judged). A link on disk is refused only when the
    archive is what makes it lead out."""
    roots = (stage_fd, target_fd)
    for parts, target in links:
        if link_escapes(roots, parts, target, hide=stage_name):
            raise _refuse("symlink leads outside the target (or loops)", "/".join(parts))
    if not links:
        return  # files and directories alone never make a path lead elsewhere
    for parts, target in symlinks(target_fd, STAGING_PREFIX):
        try:
            fd = open_dir(stage_fd, parts[:-1])
        except (OSError, UnsafeArchive):
            fd = -1
        if fd >= 0:
            try:
                os.lstat(parts[-1], dir_fd=fd)
                continue  # replaced by the archive's own member, judged above
            except OSError:
                pass
            finally:
                os.close(fd)
        if link_escapes(roots, parts, target, hide=stage_name) and \
                not link_escapes((target_fd,), parts, target, hide=stage_name):
            raise _refuse("symlink already in the target would lead outside it (or loop) "
                          "with this archive", "/".join(parts))


def _open(fd: int, name: str, flags: int) -> int:
    if fd < 0:
        return -1
    try:
        return os.open(name, flags, dir_fd=fd)
    except OSError:
        return -1


class View:
    """One path below `roots`, fds on the tops of trees seen as one (execd's TreeView): the
    first's entry wins and a directory in several is one merged directory (merge's rules).
    Each level opened from the one above with O_NOFOLLOW; at most LOOK_FDS levels held, a
    closed one reopened from the nearest held above it. The roots stay the caller's."""

    def __init__(self, roots: list[int], hide: str | None = None,
                 flags: int = _LOOK_FLAGS) -> None:
        self.hide = hide
        self.flags = flags
        self.names: list[str] = []
        self.levels: list[list[int] | None] = [list(roots)]

    def fds(self) -> list[int]:
        i = len(self.levels) - 1
        while self.levels[i] is None:
            i -= 1
        for k in range(i + 1, len(self.levels)):
            above = self.levels[k - 1]
            assert above is not None
            self.levels[k] = [_open(fd, self.names[k - 1], self.flags) for fd in above]
        self._cap()
        last = self.levels[-1]
        assert last is not None
        return last

    def _cap(self) -> None:
        held = [k for k in range(1, len(self.levels)) if self.levels[k] is not None]
        for k in held[:max(0, len(held) - LOOK_FDS)]:
            self._close(k)

    def _close(self, k: int) -> None:
        for fd in self.levels[k] or ():
            if fd >= 0:
                os.close(fd)
        self.levels[k] = None

    def look(self, name: str) -> bool | str | None:
        """`name` here: True (a directory: the view went down into it), its target (a
        symlink), or None (missing, a file, or not to be looked into)."""
        fds = self.fds()
        if len(self.levels) == 1 and name == self.hide:
            return None
        for i, fd in enumerate(fds):
            if fd < 0:
                continue
            try:
                nfd = os.open(name, self.flags, dir_fd=fd)
            except OSError as e:
                if e.errno == errno.ENOENT:
                    continue
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    try:
                        return os.readlink(name, dir_fd=fd)
                    except OSError:
                        return None  # a file (or gone meanwhile)
                return None
            new = [-1] * len(fds)
            new[i] = nfd
            for j in range(i + 1, len(fds)):
                new[j] = _open(fds[j], name, self.flags)
            self.names.append(name)
            self.levels.append(new)
            self._cap()
            return True
        return None

    def up(self) -> None:
        self._close(len(self.levels) - 1)
        self.levels.pop()
        self.names.pop()

    def close(self) -> None:
        while len(self.levels) > 1:
            self.up()


def symlinks(root_fd: int, skip: str) -> list[tuple[list[str], str]]:
    """(parts, target) of every symlink under root_fd, never through one; iterative, at most
    LOOK_FDS directory fds held; names at the top starting with `skip` left out."""
    view = View([root_fd], flags=_DIR_FLAGS)
    out: list[tuple[list[str], str]] = []
    todo: list[tuple[int, str | None]] = [(0, None)]  # back up to depth, then down into name
    try:
        while todo:
            depth, name = todo.pop()
            while len(view.names) > depth:
                view.up()
            if name is not None and view.look(name) is not True:
                continue  # changed meanwhile
            fd = view.fds()[0]
            if fd < 0:
                continue
            try:
                with os.scandir(fd) as it:
                    for e in it:
                        if not view.names and e.name.startswith(skip):
                            continue
                        if e.is_symlink():
                            try:
                                out.append((view.names + [e.name],
                                            os.readlink(e.name, dir_fd=fd)))
                            except OSError:
                                pass
                        elif e.is_dir(follow_symlinks=False):
                            todo.append((len(view.names), e.name))
            except OSError:
                continue
    finally:
        view.close()
    return out


def open_dir(root_fd: int, parts: list[str], made: list[tuple[str, ...]] | None = None) -> int:
    """An fd on root/parts, never through a symlink; `made` gets each directory created."""
    fd = os.dup(root_fd)
    try:
        for i, p in enumerate(parts):
            try:
                nfd = os.open(p, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if made is None:
                    raise
                os.mkdir(p, 0o777, dir_fd=fd)
                made.append(tuple(parts[:i + 1]))
                nfd = os.open(p, _DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _refuse("a member goes through a symlink or a file",
                                  "/".join(parts[:i + 1])) from None
                raise
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


class _CheckedInfo(tarfile.TarInfo):
    """Refuses, before tarfile reads them, metadata headers over META_MAX and GNU sparse maps
    (read whole too): a hostile execd cannot make the SDK hold a huge header in memory."""

    def _proc_member(self, tar: tarfile.TarFile) -> Any:
        if self.type == tarfile.GNUTYPE_SPARSE:
            raise _refuse("sparse member", self.name)
        if self.type in (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE,
                         tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK) \
                and self.size > META_MAX:
            raise _refuse(f"a {self.size}-byte metadata header (over {META_MAX})", self.name)
        return super()._proc_member(tar)  # type: ignore[misc]

    def _proc_gnusparse_10(self, next: tarfile.TarInfo, pax_headers: Any,
                           tar: tarfile.TarFile) -> Any:
        raise _refuse("sparse member", next.name)


def _extract(tar: tarfile.TarFile, stage_fd: int, stats: dict[str, int]
             ) -> tuple[dict[tuple[str, ...], int], list[tuple[list[str], str]]]:
    dirs: dict[tuple[str, ...], int] = {}
    links: list[tuple[list[str], str]] = []
    kinds: dict[str, str] = {}  # a name comes once (a directory may repeat)
    for m in tar:
        parts = member_parts(m.name)
        if not parts:
            continue  # "." itself: the target keeps its own mode
        key = "/".join(parts)
        if m.mode & (stat.S_ISUID | stat.S_ISGID):
            raise _refuse("setuid or setgid bit on a member", key)
        if not -MTIME_MAX <= m.mtime <= MTIME_MAX:  # NaN fails too
            raise _refuse(f"mtime {m.mtime!r} out of range (+-{MTIME_MAX} s)", key)
        mode = m.mode & MODE_MASK
        made: list[tuple[str, ...]] = []
        if m.isdir():
            if kinds.get(key, "d") != "d":
                raise _refuse("a name comes twice in the archive", key)
            os.close(open_dir(stage_fd, parts, made))
            kinds.update(("/".join(d), "d") for d in made)
            stats["dirs"] += len(made)
            dirs[tuple(parts)] = mode
            continue
        if key in kinds:
            raise _refuse("a name comes twice in the archive", key)
        if m.type == tarfile.GNUTYPE_SPARSE or getattr(m, "sparse", None) is not None:
            raise _refuse("sparse member", key)
        kind = "f" if m.isreg() else "l" if m.issym() else "h" if m.islnk() else None
        if kind is None:
            what = ("character device" if m.ischr() else "block device" if m.isblk()
                    else "fifo" if m.isfifo() else f"member of type {m.type!r}")
            raise _refuse(f"refused {what}", key)
        pfd = open_dir(stage_fd, parts[:-1], made)
        kinds.update(("/".join(d), "d") for d in made)
        stats["dirs"] += len(made)
        stats[{"f": "files", "l": "symlinks", "h": "hardlinks"}[kind]] += 1
        try:
            if kind == "f":
                fd = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o600, dir_fd=pfd)
                try:
                    src = tar.extractfile(m)
                    left = m.size
                    while left > 0:
                        chunk = src.read(min(left, COPY_CHUNK)) if src else b""
                        if not chunk:
                            raise tarfile.ReadError("unexpected end of data")
                        view = memoryview(chunk)
                        while view:
                            view = view[os.write(fd, view):]
                        left -= len(chunk)
                    os.fchmod(fd, mode)
                    os.utime(fd, (m.mtime, m.mtime))
                finally:
                    os.close(fd)
            elif kind == "l":
                if not m.linkname or "\0" in m.linkname or m.linkname.startswith("/"):
                    raise _refuse("symlink leads outside the target", key)
                if len(m.linkname.encode("utf-8", "surrogateescape")) > NAME_MAX:
                    raise _refuse(f"symlink target over {NAME_MAX} bytes", key)
                os.symlink(m.linkname, parts[-1], dir_fd=pfd)
                links.append((parts, m.linkname))
            else:
                src_parts = member_parts(m.linkname)
                if kinds.get("/".join(src_parts)) != "f":
                    raise _refuse("hard link to something not a file earlier in the archive",
                                  key)
                sfd = open_dir(stage_fd, src_parts[:-1])
                try:
                    os.link(src_parts[-1], parts[-1], src_dir_fd=sfd, dst_dir_fd=pfd,
                            follow_symlinks=False)
                finally:
                    os.close(sfd)
        finally:
            os.close(pfd)
        kinds[key] = "f" if kind == "h" else kind
    return dirs, links


def mkstage(parent_fd: int) -> str:
    """Makes a staging directory (0700, a random name) in parent_fd; returns its name."""
    for _ in range(100):
        name = STAGING_PREFIX + os.urandom(6).hex()
        try:
            os.mkdir(name, 0o700, dir_fd=parent_fd)
            return name
        except FileExistsError:
            continue
    raise OSError(errno.EEXIST, "no free staging name")


def merge(src_fd: int, dst_fd: int, dry: bool, where: str = "") -> None:
    """Moves what src holds into dst (execd's tree_merge): a missing name is renamed in whole,
    two directories merge, a file or symlink replaces a file or symlink; a directory never
    meets a file or a symlink (TreeConflict). `dry`: check only."""
    for name in sorted(os.listdir(src_fd)):
        s = os.lstat(name, dir_fd=src_fd)
        try:
            d: os.stat_result | None = os.lstat(name, dir_fd=dst_fd)
        except FileNotFoundError:
            d = None
        rel = where + name
        if d is None or (not stat.S_ISDIR(s.st_mode) and not stat.S_ISDIR(d.st_mode)):
            if not dry:
                os.rename(name, name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
        elif stat.S_ISDIR(s.st_mode) and stat.S_ISDIR(d.st_mode):
            sfd = os.open(name, _DIR_FLAGS, dir_fd=src_fd)
            try:
                dfd = os.open(name, _DIR_FLAGS, dir_fd=dst_fd)
                try:
                    merge(sfd, dfd, dry, rel + "/")
                finally:
                    os.close(dfd)
            finally:
                os.close(sfd)
        else:
            there = "directory" if stat.S_ISDIR(d.st_mode) else (
                "symlink" if stat.S_ISLNK(d.st_mode) else "file")
            raise TreeConflict(f"download_tree: the target has a {there} at {rel!r} where "
                               f"the archive has a {'directory' if there != 'directory' else 'file or symlink'}; "
                               "nothing was written")


def _set_modes(root_fd: int, dirs: dict[tuple[str, ...], int]) -> None:
    for parts in sorted(dirs, key=len, reverse=True):  # deepest first: a 0500 parent is last
        try:
            fd = open_dir(root_fd, list(parts))
        except (OSError, UnsafeArchive):
            continue
        try:
            os.fchmod(fd, dirs[parts])
        finally:
            os.close(fd)


def unpack(archive: IO[bytes], local_dir: str) -> dict[str, int]:
    """Extracts the tar `archive` (already checked against its SHA-256) into local_dir (made
    if missing): staged in a directory inside it, every member and symlink checked, then moved
    in; on any refusal local_dir is left as it was (and removed if this call made it).
    Returns the counts of files, dirs, symlinks and hardlinks."""
    stats = dict.fromkeys(("files", "dirs", "symlinks", "hardlinks"), 0)
    local_dir = os.path.realpath(local_dir)
    made_top: list[str] = []
    p = local_dir
    while not os.path.lexists(p):
        made_top.append(p)
        p = os.path.dirname(p)
    stage: str | None = None
    stage_fd = target_fd = -1
    try:
        for p in reversed(made_top):
            os.mkdir(p)
        target_fd = os.open(local_dir, _DIR_FLAGS)
        stage = mkstage(target_fd)  # from the fd: never where a link put local_dir meanwhile
        stage_fd = os.open(stage, _DIR_FLAGS, dir_fd=target_fd)
        try:
            with tarfile.open(fileobj=archive, mode="r|", encoding="utf-8",
                              errors="surrogateescape", tarinfo=_CheckedInfo) as tar:
                dirs, links = _extract(tar, stage_fd, stats)
        except (tarfile.TarError, EOFError) as e:
            raise UnsafeArchive(f"download_tree: not a valid tar archive (truncated or "
                                f"corrupt): {e}; nothing was written") from None
        with _MERGING:
            links_judged(stage_fd, target_fd, stage, links)
            merge(stage_fd, target_fd, True)
            merge(stage_fd, target_fd, False)
            _set_modes(target_fd, dirs)
        made_top = []
    except OSError as e:
        raise TreeError(f"download_tree: writing {local_dir}: {e}") from None
    finally:
        if stage_fd >= 0:
            os.close(stage_fd)
        if stage is not None and target_fd >= 0:
            remove_tree(target_fd, stage)
        if target_fd >= 0:
            os.close(target_fd)
        for p in made_top:
            try:
                os.rmdir(p)
            except OSError:
                pass
    return stats


def remove_tree(parent_fd: int, name: str) -> bool:
    """Removes `name` in the directory open as parent_fd and everything below it (execd's
    remove_tree): iterative, by fd, never through a symlink, at most REMOVE_FDS directory fds
    held (a closed level is reopened as ".." of its child and must be the same directory).
    What cannot be removed is skipped. Returns whether `name` is gone."""
    try:
        os.unlink(name, dir_fd=parent_fd)
        return True
    except FileNotFoundError:
        return True
    except OSError as e:
        if e.errno not in (errno.EISDIR, errno.EPERM):
            return False
    # A level: fd (or -1), (dev, ino), its name in the level above, names skipped, to do.
    fds: list[int] = []
    ids: list[tuple[int, int]] = []
    names: list[str] = []
    skipped: list[set[str]] = []
    todo: list[list[str] | None] = []

    def push(fd: int, nm: str) -> None:
        fds.append(fd)
        st = os.fstat(fd)
        ids.append((st.st_dev, st.st_ino))
        names.append(nm)
        skipped.append(set())
        todo.append(None)

    try:
        push(os.dup(parent_fd), "")
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=fds[0])
        except OSError:
            return False
        push(fd, name)
        while len(fds) > 1:
            cur = fds[-1]
            if not todo[-1]:  # listed again once done: what came meanwhile goes too
                todo[-1] = [n for n in os.listdir(cur) if n not in skipped[-1]]
            left = todo[-1]
            if left:
                n = left.pop()
                try:
                    os.unlink(n, dir_fd=cur)
                    continue
                except FileNotFoundError:
                    continue
                except OSError as e:
                    if e.errno not in (errno.EISDIR, errno.EPERM):
                        skipped[-1].add(n)
                        continue
                try:
                    cfd = os.open(n, _DIR_FLAGS, dir_fd=cur)
                except OSError:
                    skipped[-1].add(n)
                    continue
                push(cfd, n)
                held = [i for i in range(1, len(fds) - 1) if fds[i] >= 0]
                if len(held) >= REMOVE_FDS:
                    os.close(fds[held[0]])
                    fds[held[0]] = -1
                continue
            if fds[-2] < 0:
                fds[-2] = os.open("..", _DIR_FLAGS, dir_fd=cur)
                st = os.fstat(fds[-2])
                if (st.st_dev, st.st_ino) != ids[-2]:
                    return False
            nm = names[-1]
            fds.pop()
            ids.pop()
            names.pop()
            skipped.pop()
            todo.pop()
            os.close(cur)
            try:
                os.rmdir(nm, dir_fd=fds[-1])
            except FileNotFoundError:
                pass
            except OSError:
                skipped[-1].add(nm)
        return name not in skipped[0]
    except OSError:
        return False
    finally:
        for fd in fds:
            if fd >= 0:
                os.close(fd)


class Withheld:
    """The download's body as it arrives: all but the last TREE_DIGEST_LEN bytes (the digest
    trailer) go to `out`, hashed and counted against `cap`."""

    def __init__(self, out: IO[bytes], cap: int) -> None:
        self.out = out
        self.cap = cap
        self.tail = b""
        self.size = 0
        self.sha = hashlib.sha256()

    def feed(self, chunk: bytes) -> None:
        buf = self.tail + chunk
        keep = execd_api.TREE_DIGEST_LEN
        if len(buf) > keep:
            data, self.tail = buf[:-keep], buf[-keep:]
            self.size += len(data)
            if self.size > self.cap:
                raise TreeTooLarge(f"download_tree: the archive is over the {self.cap}-byte "
                                   f"cap (max_bytes); nothing was written")
            self.sha.update(data)
            self.out.write(data)
        else:
            self.tail = buf

    def digest_ok(self) -> bool:
        return len(self.tail) == execd_api.TREE_DIGEST_LEN and \
            self.tail.decode("latin-1").lower() == self.sha.hexdigest()
