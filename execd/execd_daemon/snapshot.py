"""Snapshots: the holder's changes to the root filesystem (against a stat-only base recorded at
start), with the shell's cwd and exported environment, as one tar; and their application in a
fresh pod of the same image (docs/execd.md, "Snapshots").

The base and the comparison are checked reuse's (reuse.py): one Baseline walker over the whole
root, on the root's own file system only, recording stat metadata and no copies; a snapshot is
its /diff read as "what to carry". A snapshot comes from a pod its holder shaped: on apply every
member is data, checked like a tree upload's (trees.py), staged, and moved in only once the
archive's SHA-256 matched."""

import errno
import os
import re
import stat
import time

from .base import _ENV_NAME, TAG_VAR, now, sh_quote, sha256
from .reuse import Baseline, FileState
from .wire import HTTPError, still_authorized

EXECD_SNAPSHOT_ENV = "SANDMAN_SNAPSHOT"  # copy of sandman/contract.py: "on" in agent pods
SNAPSHOT_MAX_BYTES = 1 << 30  # content bytes of one snapshot; --max-snapshot-bytes
SNAPSHOT_MAX_ENTRIES = 200000  # members of one snapshot, either way
SNAPSHOT_VERSION = 1
SNAPSHOT_MANIFEST = ".sandman-snapshot.json"  # the first member, never written anywhere
SNAPSHOT_MANIFEST_MAX = 64 << 20  # the manifest's bytes (its deleted list is most of it)
SNAPSHOT_STAGING_PREFIX = ".execd-snapshot-"
# A member's headers at most: its 512-byte header and a pax header holding a name and a link
# target of TREE_NAME_MAX bytes each (the archive's bound beyond its content bytes).
SNAPSHOT_MEMBER_MAX = 12288
# A whole archive at the default caps: what a client that relays one (the controller's fork)
# must accept.
SNAPSHOT_ARCHIVE_MAX = (SNAPSHOT_MAX_BYTES + SNAPSHOT_MANIFEST_MAX
                        + (SNAPSHOT_MAX_ENTRIES + 2) * SNAPSHOT_MEMBER_MAX)
# Never carried, never written: the kubelet's and the runtime's per-pod files are mount points
# (skipped by device); these are the pseudo file systems and execd's own read-only dir.
SNAPSHOT_EXCLUDE = ("proc", "sys", "dev")
# Set by bash itself or carried otherwise (the cwd): never part of the carried environment.
_SHELL_OWN = ("PWD", "OLDPWD", "SHLVL", "_", TAG_VAR)
_NO_BASE = ("this sandbox records no snapshot base (%s); it cannot be forked"
            % EXECD_SNAPSHOT_ENV)
_GRADING = "a grading pod is never snapshotted"


def snapshot_args(p):
    p.add_argument("--snapshot-at-start", choices=("on", "off"),
                   default="on" if os.environ.get(EXECD_SNAPSHOT_ENV) == "on" else "off",
                   help="record the snapshot base before serving (default: %s=on, which "
                        "the controller sets in agent pods)" % EXECD_SNAPSHOT_ENV)
    p.add_argument("--max-snapshot-bytes", type=int, default=SNAPSHOT_MAX_BYTES,
                   help="content bytes of one snapshot, either way")


def mount_points(root):
    """The mount points below `root` (mountinfo's fifth field, octal escapes undone): the
    kubelet's files (/etc/hosts, /etc/resolv.conf, the service-account token...), volumes and
    the runtime's masks. Never walked, carried or written; a file bind-mounted has the root's
    st_dev on some kernels, so the device alone cannot tell."""
    top = root.rstrip("/") + "/"
    out = []
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            lines = f.read().decode("utf-8", "surrogateescape").splitlines()
    except OSError:
        return out
    for line in lines:
        fields = line.split(" ")
        if len(fields) < 5:
            continue
        mp = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        if mp.startswith(top) and mp != root and mp not in out:
            out.append(mp)
    return out


def _kind(mode):
    return ("dir" if stat.S_ISDIR(mode) else "symlink" if stat.S_ISLNK(mode)
            else "file" if stat.S_ISREG(mode) else "special")


class SnapshotBase(object):
    """The image's filesystem as execd found it at start (stat only), and what a snapshot of
    this pod carries against it."""

    def __init__(self, daemon, args):
        self.d = daemon
        self.args = args
        self.walker = Baseline(daemon, args)  # its walk and compare; no store, no copies
        self.root = daemon.root
        self.dev = None
        self.fingerprint = None
        self.applied = False

    def rel(self, path):
        """`path` (under the root, as the walk names it) relative to the root; a slice, not
        os.path.relpath, which was half the base's CPU."""
        top = self.root.rstrip("/") + "/"
        if path == self.root:
            return "."
        return path[len(top):] if path.startswith(top) else os.path.relpath(path, self.root)

    def record(self):
        """Before execd serves: nothing the holder does can be in the base."""
        w, root = self.walker, self.root
        w.exclude = [os.path.join(root, x) for x in SNAPSHOT_EXCLUDE] + [
            os.path.dirname(os.path.dirname(os.path.realpath(__file__))),  # execd's own dir
            os.path.realpath(self.args.baseline_store)] + mount_points(root)
        w.forced = set()
        w.roots = [(root, "snapshot")]
        self.dev = os.lstat(root).st_dev
        found, _, _ = w.walk()
        entries = {}
        h = sha256()
        for p in sorted(found):
            st = found[p][0]
            if self.elsewhere(st):
                continue  # a mount point: per pod (kubelet files, volumes), never carried
            link = None
            if stat.S_ISLNK(st.st_mode):
                try:
                    link = os.readlink(p)
                except OSError:
                    pass
            entries[p] = FileState(st, link)
            # inode and ctime differ per pod; what the image fixes does not. A directory's
            # size and mtime move with what the runtime adds below it at the pod's start.
            k = _kind(st.st_mode)
            h.update(("%s\0%s\0%o\0%d\0%d\0%s\0%s\0%s\n" % (
                self.rel(p), k, st.st_mode, st.st_uid, st.st_gid,
                st.st_size if k != "dir" else "", st.st_mtime_ns if k != "dir" else "",
                link or "")).encode("utf-8", "surrogateescape"))
        kids = {}
        for p in entries:
            kids.setdefault(os.path.dirname(p), []).append(p)
        w.entries, w.kids, w.areas = entries, kids, {}
        self.fingerprint = h.hexdigest()
        # A change in the same clock tick as the walk could carry the ctime just recorded.
        time.sleep(0.011)
        return len(entries)

    def elsewhere(self, st):
        """A directory on another file system than the root's: a mount point mountinfo did not
        list. Only directories: overlayfs may report a file's st_dev as its layer's."""
        return stat.S_ISDIR(st.st_mode) and st.st_dev != self.dev

    def excluded(self, path):
        return self.walker._excluded(path)

    def changes(self, dirty=True):
        """(carried {path: lstat}, deleted [relative paths, top-most only], skipped [paths])
        by the reuse diff's rules (ctime catches a write whose mtime was set back). `dirty`:
        also the directories whose entries changed (their mtimes are carried)."""
        w = self.walker
        with w.lock:
            found = {}
            deleted, skipped = set(), []
            for c in w._file_changes():
                p = c.get("path")
                if p is None or c["kind"] in ("unreadable", "xattr"):
                    # "repo" names repeat a path; unreadable: nothing to read; xattrs are not
                    # carried (and the base has none: a label on every directory, SELinux's,
                    # would read as a change of each directory whose entries changed)
                    continue
                if c["kind"] in ("removed", "type"):
                    deleted.add(p)
                if c["kind"] != "removed":
                    found[p] = None
            if dirty:
                # Directories whose entries changed, and the parents of what the child will
                # write or delete (the renames there move their mtimes): their times go along.
                for p in list(found) + list(deleted):
                    found.setdefault(os.path.dirname(p), None)
                for p in w.dirty:
                    found.setdefault(p, None)
        carried = {}
        top = self.root.rstrip("/") + "/"
        for p in sorted(found):
            # The root itself (in a pod it is "/", which starts with its own top): the target
            # keeps its own; carried, its name is "." and the snapshot was cut at it.
            if p == self.root or not p.startswith(top) or p == top:
                continue
            try:
                st = os.lstat(p)
            except OSError:
                continue  # gone since the walk
            if self.elsewhere(st):
                continue
            if _kind(st.st_mode) == "special":
                skipped.append(self.rel(p))  # devices, FIFOs, sockets: never carried
                continue
            carried[p] = st
        tops = set()
        for p in sorted(deleted, key=len):  # parents first: a child of one is not listed
            up = os.path.dirname(p)
            while up not in tops and up.startswith(top) and up != self.root:
                up = os.path.dirname(up)
            if up not in tops:
                tops.add(p)
        return carried, [self.rel(p) for p in sorted(tops)], skipped


# ---- capture

def _busy(d):
    if not d.exec_lock.acquire(True, 30):
        raise HTTPError(409, "busy: a command did not finish within 30 s", {"busy": True})
    d.exec_lock.release()


def _refusals(d):
    if d.args.baseline_at_start == "on":
        # Its verdict would come from a pod the holder shaped.
        raise HTTPError(409, _GRADING)
    base = getattr(d, "snapshot", None)
    if base is None or base.fingerprint is None:
        raise HTTPError(409, _NO_BASE)
    return base


def _shell_state(d, base):
    """The shell's exported environment against execd's start environment ({set}, [unset])
    and its cwd relative to the root (None outside it)."""
    env = base.walker.shell_env()
    start = d.start_env
    sets = {k: v for k, v in env.items() if k not in _SHELL_OWN and start.get(k) != v}
    unset = sorted(k for k in start if k not in env and k not in _SHELL_OWN)
    cwd = None
    real = d.state().get("cwd")
    if real == base.root:
        cwd = "."
    elif real and real.startswith(base.root.rstrip("/") + "/"):
        cwd = base.rel(real)
    return sets, unset, cwd


def _r_snapshot(handler, query):
    """Sends the snapshot: the manifest, then every carried entry (parents first), as one
    tar, then its SHA-256. Refusals (409, 413) come before the answer begins; an entry that
    changed while it was read cuts the answer (no last chunk, no digest)."""
    import io
    import json
    import tarfile

    from .trees import TREE_DIGEST_LEN, TreeSender, tree_add, tree_open_dir, tree_parts

    d = handler.daemon
    base = _refusals(d)
    _busy(d)
    carried, deleted, skipped = base.changes()
    cap = d.args.max_snapshot_bytes
    size = sum(st.st_size for st in carried.values() if stat.S_ISREG(st.st_mode))
    if size > cap:
        raise HTTPError(413, "snapshot over the %d-byte cap (--max-snapshot-bytes): %d bytes "
                             "of files changed" % (cap, size))
    if len(carried) + len(deleted) > SNAPSHOT_MAX_ENTRIES:
        raise HTTPError(413, "snapshot over %d entries: %d changed" % (
            SNAPSHOT_MAX_ENTRIES, len(carried) + len(deleted)))
    for p, st in carried.items():
        if stat.S_ISREG(st.st_mode):  # a file execd cannot read fails here, not mid-answer
            try:
                os.close(os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
                                 | os.O_CLOEXEC))
            except OSError as e:
                raise HTTPError(409, "cannot read %r: %s" % (
                    base.rel(p)[:300], e.strerror)) from None
    sets, unset, cwd = _shell_state(d, base)
    manifest = json.dumps({
        "version": SNAPSHOT_VERSION, "base": base.fingerprint, "cwd": cwd,
        "env": {"set": sets, "unset": unset}, "deleted": deleted, "skipped": skipped,
        "counts": {"entries": len(carried), "deleted": len(deleted), "bytes": size}},
        sort_keys=True).encode("utf-8", "surrogateescape")
    if len(manifest) > SNAPSHOT_MANIFEST_MAX:
        raise HTTPError(413, "snapshot manifest over %d bytes" % SNAPSHOT_MANIFEST_MAX)
    root_fd = os.open(base.root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        handler.close_connection = True  # until the last chunk is out
        handler.wfile.write(("HTTP/1.1 200 OK\r\nServer: %s\r\nContent-Type: application/x-tar"
                             "\r\nTransfer-Encoding: chunked\r\nCache-Control: no-store\r\n\r\n"
                             % handler.server_version).encode("latin-1"))
        out = TreeSender(handler, size + (len(carried) + 2) * SNAPSHOT_MEMBER_MAX + len(manifest)
                         + 20480)
        links = {}  # (dev, ino) -> the first member's name: later names are hard links
        try:
            with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT,
                              encoding="utf-8", errors="surrogateescape") as tar:
                ti = tarfile.TarInfo(SNAPSHOT_MANIFEST)
                ti.size = len(manifest)
                tar.addfile(ti, io.BytesIO(manifest))
                for p, st in carried.items():
                    name = base.rel(p)
                    parts = tree_parts(name)
                    key = (st.st_dev, st.st_ino)
                    if stat.S_ISREG(st.st_mode) and st.st_nlink > 1 and key in links:
                        ti = tarfile.TarInfo(name)
                        ti.type = tarfile.LNKTYPE
                        ti.linkname = links[key]
                        ti.mode, ti.mtime = stat.S_IMODE(st.st_mode) & 0o1777, int(st.st_mtime)
                        ti.uid, ti.gid = st.st_uid, st.st_gid
                        tar.addfile(ti)
                        continue
                    pfd = tree_open_dir(root_fd, parts[:-1])  # never through a link
                    try:
                        now_st = os.lstat(parts[-1], dir_fd=pfd)
                        if (now_st.st_ino, stat.S_IFMT(now_st.st_mode)) != (
                                st.st_ino, stat.S_IFMT(st.st_mode)):
                            raise OSError(errno.EAGAIN, "replaced while sent", name)
                        tree_add(tar, pfd, parts[-1], tarfile.TarInfo(name), st, owner=True)
                    finally:
                        os.close(pfd)
                    if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                        links[key] = name
            out.flush()
            out.h.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (
                TREE_DIGEST_LEN, out.sha.hexdigest().encode()))
            handler.close_connection = False
        except Exception as e:  # noqa: BLE001 - OSError, TarError, HTTPError...
            # The answer began: cutting it (no last chunk, no digest) is the only way to say.
            import sys

            sys.stderr.write("execd: snapshot cut: %s\n" % (getattr(e, "message", e),))
    finally:
        os.close(root_fd)


# ---- apply

class _Members(object):
    """The archive's members for tree_extract: the manifest (first, read here) taken out,
    every other member judged first (the excluded paths, the caps); owners and times kept for
    after the merge."""

    def __init__(self, tar, base, cap):
        self.tar = tar
        self.base = base
        self.cap = cap
        self.manifest = None
        self.meta = []  # (parts, kind, uid, gid, mtime)
        self.bytes = 0

    def extractfile(self, m):
        return self.tar.extractfile(m)

    def __iter__(self):
        from .trees import tree_parts, tree_refuse

        for m in self.tar:
            if self.manifest is None:
                self.manifest = self._manifest(m)
                continue
            parts = tree_parts(m.name)
            if not parts:
                continue
            if self.base.excluded(os.path.join(self.base.root, *parts)):
                raise tree_refuse("a member under a path never carried", m.name)
            if len(self.meta) >= SNAPSHOT_MAX_ENTRIES:
                raise HTTPError(413, "snapshot over %d entries" % SNAPSHOT_MAX_ENTRIES)
            if m.isreg():
                self.bytes += m.size
                if self.bytes > self.cap:
                    raise HTTPError(413, "snapshot over the %d-byte cap "
                                         "(--max-snapshot-bytes)" % self.cap)
            self.meta.append((parts, "d" if m.isdir() else "l" if m.issym() else "f",
                              m.uid, m.gid, m.mtime))
            yield m

    def _manifest(self, m):
        import json

        if m.name != SNAPSHOT_MANIFEST or not m.isreg() or m.size > SNAPSHOT_MANIFEST_MAX:
            raise HTTPError(422, "not a snapshot: its first member must be %s"
                            % SNAPSHOT_MANIFEST)
        try:
            man = json.loads(self.tar.extractfile(m).read().decode("utf-8", "surrogateescape"))
        except ValueError:
            raise HTTPError(422, "the snapshot's manifest is not JSON") from None
        env = man.get("env") if isinstance(man, dict) else None
        if not isinstance(man, dict) or man.get("version") != SNAPSHOT_VERSION \
                or not isinstance(man.get("base"), str) or not isinstance(env, dict) \
                or not isinstance(env.get("set"), dict) or not isinstance(env.get("unset"), list) \
                or not isinstance(man.get("deleted"), list) \
                or not (man.get("cwd") is None or isinstance(man.get("cwd"), str)):
            raise HTTPError(422, "the snapshot's manifest is not version %d's form"
                            % SNAPSHOT_VERSION)
        if man["base"] != self.base.fingerprint:
            raise HTTPError(409, "the snapshot's image is not this pod's (a restore into a pod "
                                 "of another image)")
        for k, v in env["set"].items():
            if not _ENV_NAME.match(k) or k.startswith("__sm_") or k in _SHELL_OWN \
                    or not isinstance(v, str) or "\0" in v:
                raise HTTPError(422, "the snapshot's environment has a bad variable: %r"
                                % k[:100])
        for k in env["unset"]:
            if not isinstance(k, str) or not _ENV_NAME.match(k) or k.startswith("__sm_"):
                raise HTTPError(422, "the snapshot's environment has a bad variable: %r"
                                % (str(k)[:100],))
        if len(man["deleted"]) > SNAPSHOT_MAX_ENTRIES:
            raise HTTPError(413, "snapshot over %d entries" % SNAPSHOT_MAX_ENTRIES)
        return man


def _deletions(base, root_fd, names):
    """[(parent fd, leaf, "a/b")] of the manifest's deleted paths, each judged before any
    goes: under the root, never under an excluded path, its parents opened without following
    a link."""
    from .trees import tree_open_dir, tree_parts, tree_refuse

    out = []
    try:
        for name in names:
            parts = tree_parts(name) if isinstance(name, str) else None
            if not parts:
                raise tree_refuse("a deleted path that is no path", str(name))
            if base.excluded(os.path.join(base.root, *parts)):
                raise tree_refuse("a deleted path under a path never carried", name)
            try:
                pfd = tree_open_dir(root_fd, parts[:-1])
            except FileNotFoundError:
                continue  # gone already: nothing to delete
            out.append((pfd, parts[-1], "/".join(parts)))
            if base.elsewhere(os.fstat(pfd)):
                raise tree_refuse("a deleted path on a mount point", name)
            try:
                st = os.lstat(parts[-1], dir_fd=pfd)
            except FileNotFoundError:
                continue
            if base.elsewhere(st):
                raise tree_refuse("a deleted path on a mount point", name)
    except BaseException:
        for fd, _, _ in out:
            os.close(fd)
        raise
    return out


def _set_attrs(root_fd, meta, dirs):
    """Modes (directories), owners and mtimes of what was moved in, deepest first: a directory
    by its own fd, anything else by its parent's, never following a link. What execd may not
    do (an owner when it is not root; a directory of the image it does not own, whose mode
    is the image's anyway) stays as it is."""
    from .trees import tree_open_dir

    for parts, kind, uid, gid, mtime in sorted(meta, key=lambda x: -len(x[0])):
        try:
            fd = tree_open_dir(root_fd, parts if kind == "d" else parts[:-1])
        except (OSError, HTTPError):
            continue
        try:
            if kind == "d":
                st = os.fstat(fd)
                if (st.st_uid, st.st_gid) != (uid, gid):
                    _quiet(os.fchown, fd, uid, gid)
                mode = dirs.get(tuple(parts))
                if mode is not None and stat.S_IMODE(os.fstat(fd).st_mode) != mode:
                    _quiet(os.fchmod, fd, mode)
                _quiet(os.utime, fd, (mtime, mtime))
                continue
            st = os.lstat(parts[-1], dir_fd=fd)
            if (st.st_uid, st.st_gid) != (uid, gid):
                _quiet(os.chown, parts[-1], uid, gid, dir_fd=fd, follow_symlinks=False)
            _quiet(os.utime, parts[-1], (mtime, mtime), dir_fd=fd, follow_symlinks=False)
        except OSError:
            pass
        finally:
            os.close(fd)


def _quiet(fn, *args, **kw):
    try:
        fn(*args, **kw)
    except PermissionError:
        pass


def _stage_dir(d, base, root_fd):
    """(fd, name): a staging directory made on the root's file system (the merge renames from
    there) where execd may write: in the root itself, else (execd not root) in the temp dirs
    or execd's first cwd. The fd is of the directory it was made in."""
    from .trees import tree_mkstage, tree_open_dir, tree_parts

    why = "no such directory"
    for where in ("", "tmp", "var/tmp", base.rel(d.start_dir)):
        if where.startswith(".."):
            continue
        try:
            fd = tree_open_dir(root_fd, tree_parts(where) if where not in ("", ".") else [])
        except (OSError, HTTPError):
            continue
        try:
            if os.fstat(fd).st_dev == base.dev:
                return fd, tree_mkstage(fd, SNAPSHOT_STAGING_PREFIX)
        except OSError as e:
            why = e.strerror or str(e)
        os.close(fd)
    raise HTTPError(403, "cannot stage a snapshot: no directory on the root's file system "
                         "that execd may write (%s)" % why)


def _r_snapshot_apply(handler, query):
    """Applies a snapshot to this (fresh) pod: staged under the root, checked whole (manifest,
    every member, the SHA-256), and only then the deleted paths go and the staged tree moves
    in; then the shell's environment and cwd."""
    from .trees import tree_body

    d = handler.daemon
    base = _refusals(d)
    if base.applied:
        raise HTTPError(409, "a snapshot was applied here already (one per pod)")
    cap = d.args.max_snapshot_bytes
    body = tree_body(handler, cap + SNAPSHOT_MANIFEST_MAX
                     + (SNAPSHOT_MAX_ENTRIES + 2) * SNAPSHOT_MEMBER_MAX, "--max-snapshot-bytes")
    try:
        res = _apply(d, base, body, cap)
    except HTTPError as e:
        if body.left > 0:
            e.extra["close"] = True  # the rest of the body is not read: no reuse
        raise
    handler.reply(200, res)


def _apply(d, base, body, cap):
    from .treelinks import DIR_FLAGS
    from .trees import REMOVE_MAX_S, TreeStats, remove_tree, tree_merge, tree_stage, tree_unstage

    _busy(d)
    carried, deleted, _ = base.changes(dirty=False)
    if carried or deleted:
        # Apply is for a freshly acquired child: merged over a holder's own changes, the
        # result would be neither the parent's state nor this one's.
        raise HTTPError(409, "this sandbox changed since it started (%s); a snapshot applies "
                             "to a fresh one only" % (base.rel(sorted(carried)[0])
                                                      if carried else deleted[0]))
    root_fd = os.open(base.root, DIR_FLAGS)
    stage = None
    stage_fd = at_fd = -1
    gone = []
    stats = TreeStats()
    try:
        at_fd, stage = _stage_dir(d, base, root_fd)
        stage_fd = os.open(stage, DIR_FLAGS, dir_fd=at_fd)
        judged = []  # the archive's members, judged as tree_extract reads them

        def judge(tar):
            judged.append(_Members(tar, base, cap))
            return judged[0]

        dirs, _links = tree_stage(body, stage_fd, stats, judge, absolute_links=True)
        man = judged[0].manifest if judged else None
        if man is None:
            raise HTTPError(422, "not a snapshot: an empty archive")
        members = judged[0]
        # Nothing outside the staging directory changed before this point.
        if not d.exec_lock.acquire(True, 30):
            raise HTTPError(409, "busy: a command did not finish within 30 s", {"busy": True})
        try:
            with d.files_lock:
                still_authorized(d)
                if base.applied:  # a concurrent apply won the lock first
                    raise HTTPError(409, "a snapshot was applied here already (one per pod)")
                gone = _deletions(base, root_fd, man["deleted"])
                # Judged against the tree as it will be: the deleted paths count as absent.
                # (Not moved aside to judge: overlayfs refuses to rename an image directory,
                # EXDEV, without redirect_dir.)
                tree_merge(stage_fd, root_fd, True, dev=base.dev,
                           gone={key for _, _, key in gone})
                base.applied = True  # from here on a failure leaves a partial state
                try:
                    for pfd, leaf, _ in gone:
                        if not remove_tree(pfd, leaf, now() + REMOVE_MAX_S):
                            raise OSError(errno.EPERM, "cannot delete", leaf)
                    tree_merge(stage_fd, root_fd, False, dev=base.dev)
                    _set_attrs(root_fd, members.meta, dirs)
                except (OSError, HTTPError) as e:
                    raise HTTPError(500, "the snapshot was applied in part (%s); release this "
                                         "sandbox" % (getattr(e, "message", None)
                                                      or e.strerror or e)) from None
        finally:
            d.exec_lock.release()
    finally:
        for pfd, _, _ in gone:
            os.close(pfd)
        tree_unstage(at_fd, stage, stage_fd)
        os.close(root_fd)
    env = man["env"]
    if env["set"] or env["unset"]:
        d.set_env({"set": env["set"], "unset": env["unset"]})
    cwd = man["cwd"]
    if cwd is not None:
        target = os.path.normpath(os.path.join(base.root, cwd))
        if target == base.root or target.startswith(base.root.rstrip("/") + "/"):
            try:  # the holder of the child could `cd` there itself: no judgement needed
                d.internal("builtin cd -- %s 2>/dev/null || :" % sh_quote(
                    target.encode("utf-8", "surrogateescape")).decode(
                        "utf-8", "surrogateescape"))
            except HTTPError:
                pass
    return {"files": stats.files + stats.dirs + stats.symlinks + stats.hardlinks,
            "deleted": len(man["deleted"]), "bytes": body.got,
            "cwd": d.state().get("cwd") or "", "sha256": body.want,
            "env": len(env["set"]) + len(env["unset"])}


def record_at_start(daemon, args):
    """main.py: the base, before serving, in agent pods (never in grading pods)."""
    import sys

    daemon.snapshot = None
    if args.snapshot_at_start != "on" or args.baseline_at_start == "on":
        return
    base = SnapshotBase(daemon, args)
    t0 = now()
    try:
        n = base.record()
    except OSError as e:
        sys.stderr.write("execd: no snapshot base: %s\n" % (e,))
        return
    daemon.snapshot = base
    if args.verbose:
        sys.stderr.write("execd: snapshot base: %d entries in %.0f ms\n"
                         % (n, (now() - t0) * 1000))
