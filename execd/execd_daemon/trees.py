"""Whole directory trees as one tar, both ways: every member checked before anything lands,
staged and merged in; sent with a SHA-256 trailer; and bounded removal of a tree."""

import errno
import os
import socket
import stat
import sys

from .base import _SHA256_HEX, STREAM_SEND_TIMEOUT, compare_digest, now, sha256
from .files import file_kind, resolve_path
from .treelinks import DIR_FLAGS as _DIR_FLAGS
from .treelinks import tree_link_escapes, tree_symlinks
from .wire import HTTPError, still_authorized, wire_uint

# POST /files/tree/write?path=DIR takes a tar (Content-Length, X-Content-SHA256 of the body);
# GET /files/tree?path=DIR answers one (chunked: the tar, then the 64 hex digits of its SHA-256).
# A tree comes from outside (a trainer's files, or an archive someone crafted): every member is
# checked by hand, since tarfile's extraction filters need Python 3.12 or a backport.

TREE_SHA256_HEADER = "X-Content-SHA256"  # the upload's digest
TREE_DIGEST_LEN = 64  # the download's trailer: SHA-256 hex of the tar before it
TREE_STAGING_PREFIX = ".execd-tree-"
TREE_CHUNK = 256 << 10
# A pax or GNU long-name header is read whole by tarfile: bounded here, so a crafted 900 MiB
# "name" cannot make execd hold it in memory.
TREE_META_MAX = 1 << 20
# A member's name: at most 4,096 bytes (PATH_MAX) and 256 components; a symlink's target at
# most 4,096 bytes. Deeper names are refused (422) before anything is made for them.
TREE_NAME_MAX = 4096
TREE_DEPTH_MAX = 256
# A member's mtime: finite, within +-2**34 s of the epoch (years -542 to 2514); else refused.
TREE_MTIME_MAX = 1 << 34


def tree_refuse(message, name=None):
    return HTTPError(422, message if name is None else "%s: %r" % (message, name[:300]))


def tree_parts(name):
    """A member name as path components under the target; refuses what could land outside."""
    if not name or "\0" in name:
        raise tree_refuse("empty name or NUL byte in a member name", name)
    if name.startswith("/"):
        raise tree_refuse("absolute member name", name)
    if len(name.encode("utf-8", "surrogateescape")) > TREE_NAME_MAX:
        raise tree_refuse("member name over %d bytes" % TREE_NAME_MAX, name)
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise tree_refuse("'..' in a member name", name)
    if len(parts) > TREE_DEPTH_MAX:
        raise tree_refuse("member name deeper than %d components" % TREE_DEPTH_MAX, name)
    return parts


def tree_links_judged(stage_fd, target_fd, stage_name, links):
    """Refuses (422) the archive when one of its symlinks, or one already in the target, would
    lead outside the target once the staged tree is merged in: judged against the staging
    directory over the target as it is on disk, whatever earlier calls or the agent left
    there. A link on disk is refused only when the archive is what makes it lead out."""
    roots = (stage_fd, target_fd)
    for parts, target in links:
        if tree_link_escapes(roots, parts, target, hide=stage_name):
            raise tree_refuse("symlink leads outside the target (or loops)", "/".join(parts))
    if not links:
        return  # files and directories alone never make a path lead elsewhere
    for parts, target in tree_symlinks(target_fd, TREE_STAGING_PREFIX):
        try:
            fd = tree_open_dir(stage_fd, parts[:-1])
        except (OSError, HTTPError):
            fd = -1
        if fd >= 0:
            try:
                os.lstat(parts[-1], dir_fd=fd)
                continue  # replaced by the archive's own member, judged above
            except OSError:
                pass
            finally:
                os.close(fd)
        if tree_link_escapes(roots, parts, target, hide=stage_name) and \
                not tree_link_escapes((target_fd,), parts, target, hide=stage_name):
            raise tree_refuse("symlink already in the target would lead outside it (or loop) "
                              "with this archive", "/".join(parts))


def tree_open_dir(root_fd, parts, create=None):
    """An fd on the directory root/parts, never through a symlink (O_NOFOLLOW at each step).
    `create`: a list that gets the parts of each directory made on the way (umask's mode)."""
    fd = os.dup(root_fd)
    try:
        for i, p in enumerate(parts):
            try:
                nfd = os.open(p, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if create is None:
                    raise
                os.mkdir(p, 0o777, dir_fd=fd)
                create.append(tuple(parts[:i + 1]))
                nfd = os.open(p, _DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise tree_refuse("a member goes through a symlink or a file",
                                      "/".join(parts[:i + 1])) from None
                raise
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


_TREE_TARINFO = []


def tree_tarinfo():
    """tarfile's TarInfo that refuses, before reading them, metadata headers over
    TREE_META_MAX and GNU sparse maps (their extension blocks are read whole too)."""
    import tarfile

    if _TREE_TARINFO:
        return _TREE_TARINFO[0]

    class Checked(tarfile.TarInfo):
        def _proc_member(self, tar):
            if self.type == tarfile.GNUTYPE_SPARSE:
                raise tree_refuse("sparse member", self.name)
            if self.type in (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE,
                             tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK) \
                    and self.size > TREE_META_MAX:
                raise tree_refuse("a %d-byte metadata header (over %d)" % (
                    self.size, TREE_META_MAX), self.name)
            return tarfile.TarInfo._proc_member(self, tar)

        def _proc_gnusparse_10(self, next, pax_headers, tar):
            raise tree_refuse("sparse member", next.name)

    _TREE_TARINFO.append(Checked)
    return Checked


class TreeStats(object):
    def __init__(self):
        self.files = self.dirs = self.symlinks = self.hardlinks = self.bytes = 0

    def json(self):
        return {"files": self.files, "dirs": self.dirs, "symlinks": self.symlinks,
                "hardlinks": self.hardlinks}


def tree_made(made, kinds, stats):
    for d in made:
        kinds["/".join(d)] = "d"
        stats.dirs += 1


def tree_extract(tar, stage_fd, stats, absolute_links=False):
    """Writes every member of `tar` (opened "r|") under stage_fd. Returns the directories'
    modes (applied once everything is in place) and the symlinks (checked at the end: a link
    may lead through one that comes later). `absolute_links`: a symlink may name any target
    (a snapshot's, whose target is the whole root); it is data, never followed here."""
    import tarfile

    dirs = {}
    links = []
    kinds = {}  # "a/b" -> "d", "f" or "l": a name comes once (a directory may repeat)
    for m in tar:
        parts = tree_parts(m.name)
        if not parts:
            continue  # "." itself: the target keeps its own mode
        key = "/".join(parts)
        if m.mode & (stat.S_ISUID | stat.S_ISGID):
            raise tree_refuse("setuid or setgid bit on a member", key)
        if not -TREE_MTIME_MAX <= m.mtime <= TREE_MTIME_MAX:  # NaN fails too
            raise tree_refuse("mtime %r out of range (+-%d s)" % (m.mtime, TREE_MTIME_MAX), key)
        mode = m.mode & 0o1777
        made = []
        if m.isdir():
            if kinds.get(key, "d") != "d":
                raise tree_refuse("a name comes twice in the archive", key)
            os.close(tree_open_dir(stage_fd, parts, made))
            tree_made(made, kinds, stats)
            dirs[tuple(parts)] = mode
            continue
        if key in kinds:
            raise tree_refuse("a name comes twice in the archive", key)
        if m.type == tarfile.GNUTYPE_SPARSE or getattr(m, "sparse", None) is not None:
            raise tree_refuse("sparse member", key)
        kind = ("f" if m.isreg() else "l" if m.issym() else "h" if m.islnk() else None)
        if kind is None:
            what = ("character device" if m.ischr() else "block device" if m.isblk()
                    else "fifo" if m.isfifo() else "member of type %r" % m.type)
            raise tree_refuse("refused %s" % what, key)
        pfd = tree_open_dir(stage_fd, parts[:-1], made)
        tree_made(made, kinds, stats)
        try:
            if kind == "f":
                fd = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                             | getattr(os, "O_CLOEXEC", 0), 0o600, dir_fd=pfd)
                try:
                    src = tar.extractfile(m)
                    left = m.size
                    while left > 0:
                        chunk = src.read(min(left, 1 << 20))
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
                stats.files += 1
            elif kind == "l":
                if not m.linkname or "\0" in m.linkname or (
                        m.linkname.startswith("/") and not absolute_links):
                    raise tree_refuse("symlink leads outside the target", key)
                if len(m.linkname.encode("utf-8", "surrogateescape")) > TREE_NAME_MAX:
                    raise tree_refuse("symlink target over %d bytes" % TREE_NAME_MAX, key)
                os.symlink(m.linkname, parts[-1], dir_fd=pfd)
                links.append((parts, m.linkname))
                stats.symlinks += 1
            else:
                src_parts = tree_parts(m.linkname)
                if kinds.get("/".join(src_parts)) != "f":
                    raise tree_refuse("hard link to something not a file earlier in the "
                                      "archive", key)
                sfd = tree_open_dir(stage_fd, src_parts[:-1])
                try:
                    os.link(src_parts[-1], parts[-1], src_dir_fd=sfd, dst_dir_fd=pfd,
                            follow_symlinks=False)
                finally:
                    os.close(sfd)
                stats.hardlinks += 1
        finally:
            os.close(pfd)
        kinds[key] = "f" if kind == "h" else kind
    return dirs, links


def tree_mkstage(parent_fd, prefix):
    """Makes a staging directory (0700, a random name) in the directory open as parent_fd;
    returns its name."""
    for _ in range(100):
        name = prefix + os.urandom(6).hex()
        try:
            os.mkdir(name, 0o700, dir_fd=parent_fd)
            return name
        except FileExistsError:
            continue
    raise OSError(errno.EEXIST, "no free staging name")


def tree_merge(src_fd, dst_fd, dry, where="", dev=None, gone=()):
    """Moves what src holds into dst: a name dst lacks is renamed in whole; two directories
    merge; a file or symlink replaces a file or symlink. A directory never meets a file or a
    symlink (409): replacing one would drop a tree or write through a link. `dry`: check
    only, so a refusal comes before anything moved. `dev`: dst's file system; a directory of
    dst on another (a mount point: a volume) is never merged into (422); a file mounted over
    cannot be renamed over (EBUSY). `gone`: names of dst ("a/b") to judge as absent (a dry
    run before they are deleted)."""
    for name in sorted(os.listdir(src_fd)):
        s = os.lstat(name, dir_fd=src_fd)
        try:
            d = os.lstat(name, dir_fd=dst_fd)
        except FileNotFoundError:
            d = None
        rel = where + name
        if rel in gone:
            d = None
        if d is not None and dev is not None and stat.S_ISDIR(d.st_mode) and d.st_dev != dev:
            raise tree_refuse("a member lands on a mount point", rel)
        if d is None or (not stat.S_ISDIR(s.st_mode) and not stat.S_ISDIR(d.st_mode)):
            if not dry:
                os.rename(name, name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
        elif stat.S_ISDIR(s.st_mode) and stat.S_ISDIR(d.st_mode):
            sfd = os.open(name, _DIR_FLAGS, dir_fd=src_fd)
            try:
                dfd = os.open(name, _DIR_FLAGS, dir_fd=dst_fd)
                try:
                    tree_merge(sfd, dfd, dry, rel + "/", dev, gone)
                finally:
                    os.close(dfd)
            finally:
                os.close(sfd)
        else:
            raise HTTPError(409, "the target has a %s at %r where the archive has a %s" % (
                file_kind(d.st_mode) if not stat.S_ISREG(d.st_mode) else "file", rel,
                "directory" if stat.S_ISDIR(s.st_mode) else "file or symlink"))


def tree_set_modes(root_fd, dirs):
    for parts in sorted(dirs, key=len, reverse=True):  # deepest first: a 0500 parent is last
        try:
            fd = tree_open_dir(root_fd, list(parts))
        except (OSError, HTTPError):
            continue  # changed meanwhile under our feet: its mode is not ours to force
        try:
            os.fchmod(fd, dirs[parts])
        finally:
            os.close(fd)


REMOVE_FDS = 32  # directory fds one removal holds open at once; deeper levels are reopened
REMOVE_MAX_S = 60.0  # one removal's time budget (a /reset wipe, a refused upload's staging dir)


def remove_tree(parent_fd, name, deadline):
    """Removes `name` in the directory open as parent_fd and everything below it, at any depth:
    iterative (no recursion), by fd, never through a symlink (a link is unlinked, not
    followed). At most REMOVE_FDS directory fds held: a level whose fd was closed is reopened
    as ".." of its child and must be the same directory (dev, ino), else the removal stops
    (the tree was moved meanwhile). Stops at `deadline` (monotonic, as `now()`). What cannot
    be removed (no permission, busy) is skipped and left. Returns whether `name` is gone."""
    try:
        os.unlink(name, dir_fd=parent_fd)
        return True
    except FileNotFoundError:
        return True
    except OSError as e:
        if e.errno not in (errno.EISDIR, errno.EPERM):
            return False
    # A level: [fd or -1, (dev, ino), its name in the level above, names skipped, names to do].
    stack = []
    try:
        top = os.dup(parent_fd)
        stack.append([top, None, None, set(), []])
        st = os.fstat(top)
        stack[0][1] = (st.st_dev, st.st_ino)
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=top)
        except OSError:
            return False
        stack.append([fd, None, name, set(), None])
        st = os.fstat(fd)
        stack[-1][1] = (st.st_dev, st.st_ino)
        while len(stack) > 1:
            if now() > deadline:
                return False
            level = stack[-1]
            if not level[4]:  # listed again once done: what came meanwhile goes too
                level[4] = [n for n in os.listdir(level[0]) if n not in level[3]]
            if level[4]:
                n = level[4].pop()
                try:
                    os.unlink(n, dir_fd=level[0])
                    continue
                except FileNotFoundError:
                    continue
                except OSError as e:
                    if e.errno not in (errno.EISDIR, errno.EPERM):
                        level[3].add(n)
                        continue
                try:
                    cfd = os.open(n, _DIR_FLAGS, dir_fd=level[0])
                except OSError:
                    level[3].add(n)
                    continue
                stack.append([cfd, None, n, set(), None])
                st = os.fstat(cfd)
                stack[-1][1] = (st.st_dev, st.st_ino)
                held = [lv for lv in stack[1:-1] if lv[0] >= 0]
                if len(held) >= REMOVE_FDS:
                    os.close(held[0][0])
                    held[0][0] = -1
                continue
            # Nothing left in this level that can go: remove it from its parent.
            parent = stack[-2]
            if parent[0] < 0:
                parent[0] = os.open("..", _DIR_FLAGS, dir_fd=level[0])
                st = os.fstat(parent[0])
                if (st.st_dev, st.st_ino) != parent[1]:
                    return False
            stack.pop()
            os.close(level[0])
            try:
                os.rmdir(level[2], dir_fd=parent[0])
            except FileNotFoundError:
                pass
            except OSError:
                parent[3].add(level[2])
        return name not in stack[0][3]
    except OSError:
        return False
    finally:
        for lv in stack:
            if lv[0] >= 0:
                os.close(lv[0])


class TreeBody(object):
    """The request body as a file for tarfile: at most Content-Length bytes, each read within
    the body timeout, hashed as it goes. Nothing is kept."""

    def __init__(self, handler, length, timeout, want):
        self.h = handler
        self.want = want
        self.left = length
        self.got = 0
        self.timeout = timeout
        self.sha = sha256()

    def read(self, size=-1):
        if self.left <= 0:
            return b""
        want = self.left if size is None or size < 0 else min(size, self.left)
        try:
            self.h.connection.settimeout(self.timeout)
            chunk = self.h.rfile.read1(min(want, 1 << 20))
        except socket.timeout:
            raise HTTPError(408, "archive body too slow (no bytes for %gs)" % self.timeout,
                            {"close": True}) from None
        if not chunk:
            raise HTTPError(400, "archive ended early: %d of %d bytes" % (
                self.got, self.got + self.left), {"close": True})
        self.sha.update(chunk)
        self.got += len(chunk)
        self.left -= len(chunk)
        return chunk

    def drain(self):
        while self.left > 0:
            self.read(1 << 20)


def tree_write(handler, query):
    """Extracts the request's tar into ?path= (made if missing). Staged in a directory inside
    the target, checked whole (every member, the SHA-256, every symlink), then moved in:
    a refusal leaves the target as it was."""
    body = tree_body(handler, handler.daemon.args.max_tree_bytes, "--max-tree-bytes")
    try:
        res = tree_write_into(handler.daemon, query, body)
    except HTTPError as e:
        if body.left > 0:
            e.extra["close"] = True  # the rest of the body is not read: no reuse
        raise
    handler.reply(200, res)


def tree_body(handler, cap, flag):
    """The request's archive as a TreeBody, once its headers are checked: one Content-Length
    within `cap` (the option `flag` sets it) and the SHA-256 it must have."""
    d = handler.daemon
    if handler.headers.get("Transfer-Encoding"):
        raise HTTPError(411, "send a Content-Length (chunked bodies are not accepted)",
                        {"close": True})
    raws = handler.headers.get_all("Content-Length") or []
    lengths = {wire_uint(raw, cap) for raw in raws}
    if not raws or None in lengths or len(lengths) > 1:
        raise HTTPError(411, "send one Content-Length of ASCII digits", {"close": True})
    n = lengths.pop()
    if n > cap:
        raise HTTPError(413, "archive over the %d-byte cap (%s)" % (cap, flag),
                        {"close": True})
    want = (handler.headers.get(TREE_SHA256_HEADER) or "").strip().lower()
    if not _SHA256_HEX.match(want):
        raise HTTPError(400, "%s must be the archive's SHA-256 hex digest" % TREE_SHA256_HEADER,
                        {"close_body": True})
    return TreeBody(handler, n, d.args.body_timeout, want)


def tree_stage(body, stage_fd, stats, wrap=None, absolute_links=False):
    """Extracts the request's archive (`body`, a TreeBody) under stage_fd, then checks its
    SHA-256 once the last byte is read; tree_extract's (dirs, links). `wrap`: a function of
    the open tar giving what tree_extract iterates instead (a snapshot's judged members)."""
    import tarfile

    try:
        with tarfile.open(fileobj=body, mode="r|", encoding="utf-8",
                          errors="surrogateescape", tarinfo=tree_tarinfo()) as tar:
            out = tree_extract(wrap(tar) if wrap else tar, stage_fd, stats, absolute_links)
        body.drain()  # the end-of-archive padding: the digest covers every byte
    except (tarfile.TarError, EOFError) as e:
        raise HTTPError(400, "not a valid tar archive (truncated or corrupt): %s" % e) \
            from None
    except OSError as e:
        raise HTTPError(400, "extracting failed: %s" % (e.strerror or e)) from None
    got = body.sha.hexdigest()
    if not compare_digest(got, body.want):
        raise HTTPError(400, "archive SHA-256 mismatch: got %s, X-Content-SHA256 says %s"
                        % (got, body.want), {"sha256": got})
    return out


def tree_unstage(parent_fd, stage, stage_fd):
    """After an upload or an apply, whatever became of it: the staging directory's fd closed,
    the directory removed (what the merge did not move in with it), the parent's fd closed."""
    if stage_fd >= 0:
        os.close(stage_fd)
    if stage is not None:
        remove_tree(parent_fd, stage, now() + REMOVE_MAX_S)
    if parent_fd >= 0:
        os.close(parent_fd)


def tree_write_into(d, query, body):
    path = query.get("path")
    real = resolve_path(d, path[-1] if path else None, for_write=True)
    want = body.want
    made = []  # target directories this call created, removed again on failure
    stage = None
    stage_fd = target_fd = -1
    stats = TreeStats()
    try:
        p = real
        while not os.path.lexists(p):
            made.append(p)
            p = os.path.dirname(p)
        for p in reversed(made):
            try:
                os.mkdir(p, 0o777 & ~d.umask)
            except OSError as e:
                made.remove(p)
                raise HTTPError(400, "cannot make %s: %s" % (p, e.strerror)) from None
        try:
            target_fd = os.open(real, _DIR_FLAGS)
        except OSError as e:
            raise HTTPError(400, "target is not a directory: %s" % (e.strerror or e),
                            {"path": real}) from None
        try:  # made from the target's fd: never in whatever a link put at `real` meanwhile
            stage = tree_mkstage(target_fd, TREE_STAGING_PREFIX)
            stage_fd = os.open(stage, _DIR_FLAGS, dir_fd=target_fd)
        except OSError as e:
            raise HTTPError(403 if e.errno in (errno.EACCES, errno.EROFS) else 400,
                            "cannot stage in %s: %s" % (real, e.strerror)) from None
        dirs, links = tree_stage(body, stage_fd, stats)
        with d.files_lock:  # judged and merged at once: two uploads never miss each other
            still_authorized(d)
            tree_links_judged(stage_fd, target_fd, stage, links)
            tree_merge(stage_fd, target_fd, True)
            tree_merge(stage_fd, target_fd, False)
            tree_set_modes(target_fd, dirs)
        made = []
    finally:
        tree_unstage(target_fd, stage, stage_fd)
        for p in made:
            try:
                os.rmdir(p)
            except OSError:
                pass
    res = {"path": real, "bytes": body.got, "sha256": want}
    res.update(stats.json())
    return res


def tree_walk(root_fd, where=""):
    """(relative name, lstat) of everything under root_fd, sorted, parents first; never
    through a symlink."""
    for name in sorted(os.listdir(root_fd)):
        st = os.lstat(name, dir_fd=root_fd)
        yield where + name, st
        if stat.S_ISDIR(st.st_mode):
            fd = os.open(name, _DIR_FLAGS, dir_fd=root_fd)
            try:
                for item in tree_walk(fd, where + name + "/"):
                    yield item
            finally:
                os.close(fd)


class TreeSender(object):
    """The answer's body as a file for tarfile: chunked HTTP, TREE_CHUNK at a time, hashed."""

    def __init__(self, handler, cap):
        self.h = handler
        self.cap = cap
        self.buf = bytearray()
        self.sent = 0
        self.sha = sha256()

    def write(self, data):
        self.sent += len(data)
        if self.sent > self.cap:
            raise HTTPError(413, "tree over the %d-byte cap" % self.cap)
        self.sha.update(data)
        self.buf += data
        if len(self.buf) >= TREE_CHUNK:
            self.flush()
        return len(data)

    def flush(self):
        if self.buf:
            self.h.connection.settimeout(STREAM_SEND_TIMEOUT)
            self.h.wfile.write(b"%x\r\n%s\r\n" % (len(self.buf), bytes(self.buf)))
            del self.buf[:]


class _FdReader(object):
    def __init__(self, fd):
        self.fd = fd

    def read(self, size=-1):
        return os.read(self.fd, size if size and size > 0 else 1 << 20)


def tree_add(tar, dir_fd, leaf, ti, st, owner=False):
    """Adds `leaf` of the directory open as dir_fd, as lstat saw it (`st`), to `tar` as `ti`
    (named by the caller): a directory, a symlink as a link, or a regular file's bytes, read
    without following a link; mode without setuid/setgid, mtime to the second, owners only
    with `owner`. A file that is no longer the one `st` saw, or that changed while it was read
    (size, mtime or ctime), raises OSError: the sender cuts its answer, never sends a torn
    copy."""
    import tarfile

    ti.mode = stat.S_IMODE(st.st_mode) & 0o1777
    ti.mtime = int(st.st_mtime)
    ti.uid, ti.gid = (st.st_uid, st.st_gid) if owner else (0, 0)
    ti.uname = ti.gname = ""
    if stat.S_ISDIR(st.st_mode):
        ti.type = tarfile.DIRTYPE
        tar.addfile(ti)
    elif stat.S_ISLNK(st.st_mode):
        ti.type = tarfile.SYMTYPE
        ti.linkname = os.readlink(leaf, dir_fd=dir_fd)
        tar.addfile(ti)
    else:
        fd = os.open(leaf, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
                     | getattr(os, "O_CLOEXEC", 0), dir_fd=dir_fd)
        try:
            fst = os.fstat(fd)
            if not stat.S_ISREG(fst.st_mode) or fst.st_ino != st.st_ino:
                raise OSError(errno.EINVAL, "changed kind while sent")
            os.set_blocking(fd, True)
            ti.size = fst.st_size
            tar.addfile(ti, _FdReader(fd))
            end = os.fstat(fd)
            if (end.st_size, end.st_mtime_ns, end.st_ctime_ns) != (
                    fst.st_size, fst.st_mtime_ns, fst.st_ctime_ns):
                raise OSError(errno.EAGAIN, "changed while sent", leaf)
        finally:
            os.close(fd)


def tree_read(handler, query):
    """Sends ?path= as a tar: regular files, directories and symlinks (as links), modes
    without setuid/setgid, mtimes; no owners. A first walk refuses special files and a tree
    over the cap with a plain error; a tree changed during the second walk cuts the answer
    (the client sees no final chunk)."""
    import tarfile

    d = handler.daemon
    path = query.get("path")
    real = resolve_path(d, path[-1] if path else None)
    try:
        root_fd = os.open(real, _DIR_FLAGS)
    except FileNotFoundError:
        raise HTTPError(404, "no such directory", {"path": real}) from None
    except OSError as e:
        raise HTTPError(400, "not a directory: %s" % (e.strerror or e), {"path": real}) from None
    try:
        cap = d.args.max_tree_bytes
        total = 1024
        try:
            for name, st in tree_walk(root_fd):
                if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)
                        or stat.S_ISLNK(st.st_mode)):
                    raise HTTPError(400, "cannot send %s %r" % (file_kind(st.st_mode), name),
                                    {"path": real})
                total += 1536 + len(name) + (st.st_size + 511) // 512 * 512 * \
                    stat.S_ISREG(st.st_mode)
                if total > cap:
                    raise HTTPError(413, "tree over the %d-byte cap (--max-tree-bytes)" % cap,
                                    {"path": real})
        except OSError as e:
            raise HTTPError(400, "cannot read the tree: %s" % (e.strerror or e),
                            {"path": real}) from None
        except RecursionError:
            raise HTTPError(400, "tree too deep to walk", {"path": real}) from None
        handler.close_connection = True  # until the last chunk is out
        handler.wfile.write(("HTTP/1.1 200 OK\r\nServer: %s\r\nContent-Type: application/x-tar"
                             "\r\nTransfer-Encoding: chunked\r\nCache-Control: no-store\r\n\r\n"
                             % handler.server_version).encode("latin-1"))
        out = TreeSender(handler, cap)
        try:
            with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT,
                              encoding="utf-8", errors="surrogateescape") as tar:
                for name, st in tree_walk(root_fd):
                    tree_add(tar, root_fd, name, tarfile.TarInfo(name), st)
            out.flush()
            out.h.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (
                TREE_DIGEST_LEN, out.sha.hexdigest().encode()))
            handler.close_connection = False
        except Exception as e:  # noqa: BLE001 - OSError, TarError, a tree too deep...
            # The answer began: cutting it (no last chunk, no digest) is the only way to say.
            sys.stderr.write("execd: tree %s cut: %s\n" % (real, getattr(e, "message", e)))
    finally:
        os.close(root_fd)
