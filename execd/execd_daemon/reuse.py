"""Checked reuse: a baseline of the image's filesystem and the shell's state, the exact diff
against it, and the restore that undoes a holder's changes before the next one."""

import base64
import os
import shutil
import signal
import stat
import threading
import time

from . import devwatch, xattrs
from .base import MAX_OUTPUT_LIMIT, TAG_VAR, now, sh_quote
from .devwatch import is_device
from .files import file_sha256
from .procs import proc_cmdline, proc_stat
from .store import Store, copy_hashed
from .wire import HTTPError

#
# A baseline is the stat of every entry under the watched roots (workspace, packages, system and
# home dirs), a private copy of each regular file's content (the store), the shell's exported
# environment, the time zone and the process set. /diff compares stat metadata only (ctime_ns and
# ino change on every write, chmod, rename or utime and cannot be set back), so it costs one
# directory walk; /restore writes back the stored copies and re-records what it wrote.

EXECD_BASELINE_ENV = "SANDMAN_BASELINE"  # copy of sandman/contract.py: "on" in grading pods
EXECD_BASELINE_SCOPE_ENV = "SANDMAN_BASELINE_SCOPE"  # copy of sandman/contract.py
BASELINE_SCOPES = ("listed", "root")  # copy of sandman/contract.py
BASELINE_STORE = "/var/lib/sandman/baseline"
BASELINE_PATHS = "/etc:/usr/local:/opt:~:/tmp"
BASELINE_PACKAGES = ("/usr/lib/python3*/site-packages:/usr/lib/python3/dist-packages:"
                     "/usr/local/lib/python3*/site-packages:/var/lib/dpkg/status")
BASELINE_EXCLUDE = "/proc:/sys:/dev:/sandman"
BASELINE_COPY_CAP = 64 << 20  # bigger files are "unrestorable if changed"
BASELINE_STORE_CAP = 2 << 30
_NO_ENV = (TAG_VAR, "_")  # execd's tag and bash's last-argument variable are not state
# The shell's exported variables, NUL-separated, without a fork on bash >= 4.4: every name by
# prefix (${!A*}...), kept when its attributes (${!n@a}) say exported. A `< <(compgen -e)` costs
# a process substitution (a fork, several ms on a busy node) on every /diff.
_ENV_SCRIPT = (
    "if ((BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] >= 404)); then\n"
    "for __sm_e in %s; do [[ ${!__sm_e@a} == *x* ]] && "
    "builtin printf '%%s=%%s\\0' \"$__sm_e\" \"${!__sm_e}\"; done\n"
    "else while IFS= read -r __sm_e; do builtin printf '%%s=%%s\\0' \"$__sm_e\" "
    "\"${!__sm_e}\"; done < <(compgen -e); fi\nbuiltin unset -v __sm_e" % " ".join(
        "${!%s*}" % c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz_"))


def _split_paths(value, globbing=False):
    import glob

    out = []
    for item in (value or "").split(":"):
        item = item.strip()
        if not item:
            continue
        item = os.path.expanduser(item)
        for p in (sorted(glob.glob(item)) if globbing else [item]):
            p = os.path.realpath(p)
            if p not in out:
                out.append(p)
    return out


def _ftype(mode):
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISFIFO(mode):
        return "fifo"
    return "special"


class FileState(object):
    __slots__ = ("mode", "uid", "gid", "size", "mtime", "atime", "ctime", "ino", "dev", "rdev",
                 "link", "blob", "why", "nlink", "xattrs")

    def __init__(self, st, link=None):
        self.set_stat(st)
        self.nlink = st.st_nlink  # the baseline's: a rewrite would split a hard link
        self.xattrs = ()  # recorded for dirs, symlinks and copied files (xattrs.py)
        self.link = link
        self.blob = None  # store file with the content (regular files)
        self.why = None  # why there is no copy

    def set_stat(self, st):
        self.mode, self.uid, self.gid, self.size = st.st_mode, st.st_uid, st.st_gid, st.st_size
        self.mtime, self.atime, self.ctime = st.st_mtime_ns, st.st_atime_ns, st.st_ctime_ns
        self.ino, self.dev, self.rdev = st.st_ino, st.st_dev, st.st_rdev

    def same(self, st):
        if stat.S_ISDIR(self.mode):  # a dir's times move with its entries, which are compared
            return (st.st_mode == self.mode and st.st_uid == self.uid
                    and st.st_gid == self.gid)
        if is_device(self.mode):  # a tty's times move with its use; its number is what counts
            return (st.st_ino == self.ino and st.st_dev == self.dev and st.st_mode == self.mode
                    and st.st_rdev == self.rdev and st.st_uid == self.uid
                    and st.st_gid == self.gid)
        return (st.st_ctime_ns == self.ctime and st.st_ino == self.ino and st.st_dev == self.dev
                and st.st_mode == self.mode and st.st_size == self.size
                and st.st_mtime_ns == self.mtime)


class Baseline(object):
    """One recorded baseline and the private store behind it."""

    def __init__(self, daemon, args):
        self.d = daemon
        self.args = args
        self.lock = threading.Lock()
        self.store = Store(args.baseline_store)
        # Resolved at start (daemon.py): the holder may remove it and make another at its path.
        self.cwd = daemon.start_cwd
        self.entries = None  # path -> FileState; None until recorded
        self.areas = {}  # path -> area (repo, packages, system, home)
        self.kids = {}
        self.dirty = []
        self.roots = []  # (path, area), most specific first
        self.exclude = []
        self.env = None
        self.base_env = None
        self.procs = None  # pid -> start ticks
        self.tz = None
        self.recorded_at = None
        self.baseline_id = None
        self.forced = set()  # roots watched although under an excluded path (/dev/shm, /dev)
        self.dev_removable = False  # what was added to /dev may be deleted (not devtmpfs)
        self.forced_dev = []  # /dev, and the cgroup v1 tmpfs where there is one
        self.shell_bin = None  # (realpath, sha256) of the shell binary at baseline
        self.attrs = None  # execd's rlimits, oom_score_adj, threads' nice/policy/affinity
        self.ipc = None  # the SysV IPC objects and POSIX message queues of the namespace
        self.mq = None  # where the queues are listed (sysvipc.mq_source)
        self.keys = None  # the keys reachable from execd's keyrings (keyrings.py)
        self.pattrs = None  # the attributes of the baseline's processes (baseprocs.py)

    # ---- roots

    def _roots(self):
        roots = []
        ws = self.workspace()
        if ws:
            roots.append((ws, "repo"))
        for p in _split_paths(self.args.baseline_packages, globbing=True):
            roots.append((p, "packages"))
        for p in _split_paths(self.args.baseline_paths):
            roots.append((p, "home" if p == os.path.realpath(os.path.expanduser("~"))
                          else "system"))
        roots += [(p, "dev") for p in self.forced_dev]  # both scopes: devwatch.py
        if self.args.baseline_scope == "root":
            # The rest of the root: watched, never copied (a change there retires the pod).
            roots.append((os.path.join(self.d.root, "dev/shm"), "rest"))
            roots.append((self.d.root, "rest"))
        seen, out = set(), []
        top = self.d.root.rstrip("/") + "/"
        for p, area in roots:
            # Only inside --root, like the file routes: a restore deletes what was added.
            if not (p + "/").startswith(top):
                continue
            if p not in seen and os.path.lexists(p):
                seen.add(p)
                out.append((p, area))
        return out

    def workspace(self):
        """--workspace, else execd's cwd (a pod: the container's workingDir), never /."""
        ws = os.path.realpath(self.d.workspace or self.cwd)
        return ws if ws != "/" else None

    def _excluded(self, path):
        for x in self.exclude:
            if path == x or path.startswith(x + "/"):
                return True
        return False

    def walk(self, known=None):
        # /ready's probe file (named where the filesystem lacks O_TMPFILE) exists only while
        # its writer holds probe_lock: the walk never sees it, and no name is skipped.
        with self.d.probe_lock:
            return self._walk(known)

    def _walk(self, known=None):
        """{path: (stat, area)} of everything under the roots (each path once, in the most
        specific root), the dirs that could not be read, and how many `known` entries were
        seen unchanged. With `known` (the baseline's entries, for /diff) an unchanged entry is
        counted, not returned: same ctime_ns and inode (a dir: same mode and owner), the
        cheapest sound test, since any write, chmod, chown, rename or utime moves ctime."""
        out, unreadable = {}, []
        same = 0
        self.dirty = []  # known dirs whose ctime moved: where entries may have been removed
        rootset = {p for p, _ in self.roots}
        skip = rootset.union(self.exclude)  # excluded dirs are never entered, so exact matches
        for root, area in sorted(self.roots, key=lambda r: -len(r[0])):
            if root in out or (self._excluded(root) and root not in self.forced):
                continue
            try:
                st = os.lstat(root)
            except OSError:
                continue
            out[root] = (st, area)
            if not stat.S_ISDIR(st.st_mode):
                continue
            xdev = st.st_dev if area == "dev" else None  # devpts, /dev/shm: not entered
            if known is not None and root in known and st.st_ctime_ns != known[root].ctime:
                self.dirty.append(root)
            stack = [root]
            while stack:
                d = stack.pop()
                try:
                    it = os.scandir(d)
                except OSError:
                    unreadable.append(d)
                    continue
                with it:
                    for e in it:
                        p = e.path
                        if p in skip:
                            continue
                        try:
                            st = e.stat(follow_symlinks=False)
                        except OSError:
                            continue
                        if known is not None:
                            ent = known.get(p)
                            if ent is not None:
                                if stat.S_ISDIR(st.st_mode):
                                    if xdev is None or st.st_dev == xdev:
                                        stack.append(p)
                                    if st.st_ctime_ns != ent.ctime:
                                        self.dirty.append(p)
                                    if (st.st_mode == ent.mode and st.st_uid == ent.uid
                                            and st.st_gid == ent.gid):
                                        same += 1
                                        continue
                                elif st.st_ctime_ns == ent.ctime and st.st_ino == ent.ino:
                                    same += 1
                                    continue
                                out[p] = (st, area)
                                continue
                        out[p] = (st, area)
                        if stat.S_ISDIR(st.st_mode) and (xdev is None or st.st_dev == xdev):
                            stack.append(p)
        return out, unreadable, same

    # ---- env, tz, processes

    def sh(self, script, locked):
        """Our own bash at the shell's top level; `locked`: the caller holds exec_lock."""
        if not locked:
            return self.d.internal(script)
        r = self.d._run(script.encode("utf-8", "surrogatepass"), 30.0, MAX_OUTPUT_LIMIT)
        if r["exit_code"] != 0 or r["error"]:
            raise HTTPError(500, "shell call failed: %s" % (r["error"] or r["exit_code"]))
        return r["output"]

    def shell_env(self, locked=False):
        out = self.sh(_ENV_SCRIPT, locked)
        env = {}
        for item in out.split("\0"):
            if "=" in item:
                k, v = item.split("=", 1)
                if k not in _NO_ENV:
                    env[k] = v
        return env

    def tz_state(self):
        path = self.args.baseline_localtime
        try:
            if os.path.islink(path):
                return {"TZ": self.d.base_env.get("TZ"), "localtime": ["symlink",
                                                                      os.readlink(path)]}
            with open(path, "rb") as f:
                data = f.read(1 << 20)
            return {"TZ": self.d.base_env.get("TZ"),
                    "localtime": ["file", base64.b64encode(data).decode()]}
        except OSError:
            return {"TZ": self.d.base_env.get("TZ"), "localtime": None}

    def processes(self):
        sh = self.d.shell.pid if self.d.shell is not None else None
        out = {}
        for p in self.d.sandbox_pids():
            s = proc_stat(p)
            if p != sh and s is not None and s[1] != "Z":
                out[p] = s[2]
        return out

    # ---- record

    def record(self):
        t0 = now()
        with self.lock:
            self.exclude = _split_paths(self.args.baseline_exclude) + [self.store.path]
            self.forced_dev = devwatch.watched(self.d.root)
            self.forced = set(self.forced_dev)
            self.dev_removable = all(devwatch.removable(p) for p in self.forced_dev)
            if self.args.baseline_scope == "root":
                # execd's own dir is mounted read-only; pseudo filesystems are no state.
                self.exclude += [os.path.join(self.d.root, x) for x in ("proc", "sys", "dev")]
                self.exclude.append(os.path.dirname(os.path.dirname(  # launcher and package
                    os.path.realpath(__file__))))
                self.forced.add(os.path.join(self.d.root, "dev/shm"))
            self.roots = self._roots()
            self.shell_bin = _shell_binary(self.d.bash)
            self.store.reset()
            self.env = self.shell_env()
            self.base_env = dict(self.d.base_env)
            self.tz = self.tz_state()
            self.procs = self.processes()
            from . import baseprocs, keyrings, procattrs, sysvipc  # first here
            self.attrs = procattrs.record()
            self.keys = keyrings.read()
            self.pattrs = baseprocs.record(self.procs)
            self.mq = sysvipc.mq_source(os.path.join(self.d.root, "dev/mqueue"))  # a pod's
            self.ipc = sysvipc.read(mq=self.mq)
            found, _, _ = self.walk()
            entries = {}
            for p, (st, area) in found.items():
                link = None
                if stat.S_ISLNK(st.st_mode):
                    try:
                        link = os.readlink(p)
                    except OSError:
                        link = None
                ent = FileState(st, link)
                if stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode) or (
                        stat.S_ISREG(st.st_mode) and area != "rest"):
                    ent.xattrs = xattrs.read(p)
                if stat.S_ISREG(st.st_mode):
                    if area == "rest":
                        # The image's own tree (/usr, /var, ...): copying it would double the
                        # pod's disk and delay its start; a restore deletes what was added
                        # there and retires the pod on any other change.
                        ent.why = "outside the copied roots"
                    else:
                        self.store.copy(p, ent, self.args.baseline_copy_cap,
                                        self.args.baseline_store_cap)
                entries[p] = ent
            self.entries = entries
            kids = {}
            for p in entries:
                kids.setdefault(os.path.dirname(p), []).append(p)
            self.kids = kids  # dir -> its baseline entries (restore keeps the same paths)
            self.areas = {p: area for p, (st, area) in found.items()}
            self.store.tick()
            self.recorded_at = time.time()
            self.baseline_id = os.urandom(8).hex()
        return {"recorded": True, "baseline_id": self.baseline_id, "entries": len(self.entries),
                "stored_bytes": self.store.stored_bytes,
                "uncopied": sum(1 for e in self.entries.values() if e.why),
                "roots": [{"path": p, "area": a} for p, a in self.roots],
                "processes": sorted(self.procs), "duration_ms": round((now() - t0) * 1000, 3)}

    # ---- diff

    def _file_changes(self):
        """[(change dict, path)] for the watched files, by stat only."""
        found, unreadable, same = self.walk(self.entries)
        changes = []
        candidates = [p for p in found if p in self.entries]
        missing = len(self.entries) - same - len(candidates)
        if missing:
            # Removals: a removal moves its parent dir's ctime, so only the children of those
            # dirs (and, below a removed dir, its whole baseline subtree) need a look.
            gone = []
            for d in self.dirty:
                for c in self.kids.get(d, ()):
                    if c not in found and not os.path.lexists(c):
                        stack = [c]
                        while stack:
                            x = stack.pop()
                            gone.append(x)
                            stack.extend(self.kids.get(x, ()))
            if len(gone) == missing:
                candidates += gone
            else:  # e.g. a dir that can no longer be read: compare everything
                found, unreadable, _ = self.walk()
                candidates = self.entries
        for p in candidates:
            ent = self.entries[p]
            cur = found.get(p)
            area = self.areas.get(p)
            if cur is None:
                changes.append({"kind": "removed", "path": p, "type": _ftype(ent.mode),
                                "area": area})
                continue
            st = cur[0]
            if ent.same(st):
                continue
            old_t, new_t = _ftype(ent.mode), _ftype(st.st_mode)
            if old_t != new_t:
                changes.append({"kind": "type", "path": p, "old": old_t, "new": new_t,
                                "area": area})
                continue
            if new_t == "symlink":
                try:
                    target = os.readlink(p)
                except OSError:
                    target = None
                if target != ent.link:
                    changes.append({"kind": "symlink", "path": p, "old": ent.link,
                                    "new": target, "area": area})
                else:  # its own xattrs (trusted.*, security.*) move only its ctime
                    c = xattrs.change(p, ent.xattrs, area)
                    if c is not None:
                        changes.append(c)
            elif is_device(st.st_mode):
                c = devwatch.device_change(p, ent, st, area)
                if c is not None:
                    changes.append(c)
            elif new_t != "dir":
                # A chmod or chown moves only ctime; any other ctime move may hide a write
                # whose mtime was set back, so it counts as modified (restore rewrites it).
                meta = (st.st_mode, st.st_uid, st.st_gid) != (ent.mode, ent.uid, ent.gid)
                if (st.st_size, st.st_mtime_ns, st.st_ino) != (ent.size, ent.mtime, ent.ino) \
                        or (st.st_ctime_ns != ent.ctime and not meta):
                    changes.append({"kind": "modified", "path": p, "area": area,
                                    "size": [ent.size, st.st_size]})
            if stat.S_IMODE(st.st_mode) != stat.S_IMODE(ent.mode):
                changes.append({"kind": "mode", "path": p, "area": area,
                                "old": "%04o" % stat.S_IMODE(ent.mode),
                                "new": "%04o" % stat.S_IMODE(st.st_mode)})
            if (st.st_uid, st.st_gid) != (ent.uid, ent.gid):
                changes.append({"kind": "owner", "path": p, "area": area,
                                "old": [ent.uid, ent.gid], "new": [st.st_uid, st.st_gid]})
        for p, (st, area) in found.items():
            if p not in self.entries:
                changes.append({"kind": "added", "path": p, "type": _ftype(st.st_mode),
                                "area": area})
        for p in self.dirty:  # a dir's xattr change moves its ctime, as its entries do
            ent = self.entries.get(p)
            if ent is not None and stat.S_ISDIR(ent.mode) and os.path.isdir(p) \
                    and not os.path.islink(p):
                c = xattrs.change(p, ent.xattrs, self.areas.get(p))
                if c is not None:
                    changes.append(c)
        for d in unreadable:
            if d in self.entries:
                changes.append({"kind": "unreadable", "path": d, "area": self.areas.get(d)})
        ws = self.workspace()
        if ws:  # name the repository's own state too
            git = os.path.join(ws, ".git")
            for c in list(changes):
                p = c["path"]
                if p in (git + "/HEAD", git + "/index", git + "/packed-refs") \
                        or p.startswith(git + "/refs/"):
                    changes.append({"kind": "repo", "name": p[len(git) + 1:],
                                    "change": c["kind"]})
        changes.sort(key=lambda c: (c.get("path") or "", c["kind"]))
        return changes

    def _other_changes(self, env):
        changes = []
        for k in sorted(set(self.env) | set(env)):
            if k not in env:
                changes.append({"kind": "env", "name": k, "change": "unset",
                                "old": self.env[k]})
            elif k not in self.env:
                changes.append({"kind": "env", "name": k, "change": "set", "new": env[k]})
            elif env[k] != self.env[k]:
                changes.append({"kind": "env", "name": k, "change": "changed",
                                "old": self.env[k], "new": env[k]})
        tz = self.tz_state()
        tz["TZ"] = env.get("TZ")
        base_tz = dict(self.tz, TZ=self.env.get("TZ"))
        for k in ("TZ", "localtime"):
            if tz[k] != base_tz[k]:
                changes.append({"kind": "tz", "name": k, "old": base_tz[k], "new": tz[k]})
        cur = self.processes()
        for p, start in sorted(cur.items()):
            if self.procs.get(p) != start:
                changes.append({"kind": "process", "name": proc_cmdline(p) or "", "pid": p,
                                "change": "extra"})
        for p, start in sorted(self.procs.items()):
            if cur.get(p) != start:
                changes.append({"kind": "process", "name": "", "pid": p, "change": "exited"})
        return changes

    def _state_changes(self):
        """execd's own process attributes and the SysV IPC objects (procattrs.py, sysvipc.py):
        no shell needed, a retired execd reports them too."""
        from . import baseprocs, keyrings, procattrs, sysvipc  # loaded by the record
        return (procattrs.changes(self.attrs) + sysvipc.changes(self.ipc, mq=self.mq)
                + keyrings.changes(self.keys) + baseprocs.changes(self.pattrs))

    def _need(self):
        if self.entries is None:
            raise HTTPError(409, "no baseline recorded (POST /baseline)")

    def diff(self):
        t0 = now()
        with self.lock:
            self._need()
            changes = self._file_changes()
            t1 = now()
            if self.d.retired:  # no shell runs any more: the files still tell what differs
                t2 = now()
                changes += self._state_changes()
                changes.append({"kind": "retired", "why": self.d.retired})
            else:
                env = self.shell_env()
                t2 = now()
                changes += self._other_changes(env) + self._state_changes()
        t3 = now()
        return {"clean": not changes, "changes": changes, "baseline_id": self.baseline_id,
                "duration_ms": round((t3 - t0) * 1000, 3),
                "parts_ms": {"files": round((t1 - t0) * 1000, 3),
                             "env": round((t2 - t1) * 1000, 3),
                             "tz_processes": round((t3 - t2) * 1000, 3)}}

    # ---- restore

    def restore(self):
        t0 = now()
        d = self.d
        with self.lock:
            self._need()
            if not d.exec_lock.acquire(True, 30):
                raise HTTPError(409, "busy: a command did not finish within 30 s",
                                {"busy": True})
            try:
                with d.files_lock:
                    # Nothing of the old holder may run, or be read by the next shell as it
                    # starts: processes go, files and the time zone come back and are checked
                    # clean, and only then a shell starts, from the binary whose hash the
                    # baseline recorded. Any failure retires this execd (no shell starts again,
                    # the controller deletes the pod).
                    from . import baseprocs, keyrings, procattrs, sysvipc  # loaded by record
                    procattrs.restore(self.attrs)  # first, as execd works under its limits
                    d.bg.hold()
                    d.pty.hold()
                    left = self._restore_processes()
                    d.bg.reset()
                    d.pty.reset()
                    d.base_env = dict(self.base_env)
                    d.reaper.reap()
                    # No holder's process is left to change them again, and no shell has
                    # started yet to inherit them.
                    left += procattrs.restore(self.attrs) + sysvipc.restore(self.ipc, self.mq)
                    left += keyrings.restore(self.keys) + baseprocs.restore(self.pattrs)
                    left += self._restore_files()
                    left += self._restore_tz() + _revive_cwd(self.cwd)
                    if not left:
                        left += [{"kind": c["kind"], "path": c.get("path"),
                                  "why": "differs after restore"}
                                 for c in self._file_changes()]
                    if not left:
                        now_bin = _shell_binary(self.shell_bin[0])
                        if now_bin != self.shell_bin:
                            left.append({"kind": "shell", "path": self.shell_bin[0],
                                         "why": "the shell binary is not the baseline's"})
                    if left:
                        d.retired = "restore failed: %s" % (left[0].get("why"),)
                        with d.ready.lock:  # not ready from now on, no cached answer
                            d.ready.last = None
                    else:
                        # A fresh shell drops shell-local state (cwd, functions, jobs).
                        d.bash = self.shell_bin[0]
                        d.start_shell(self.shell_bin[0])
                        left += self._restore_env(self.shell_env(True))
            finally:
                d.exec_lock.release()
            with d.cache_lock:  # a new holder must not see the old holder's answers
                d.cache.clear()
                d.cache_bytes = 0
            self.store.tick()
        return {"restored": not left, "left": left, "baseline_id": self.baseline_id,
                "duration_ms": round((now() - t0) * 1000, 3)}

    def _restore_processes(self):
        d = self.d
        if d.shell is not None:
            d.shell.close()
            d.shell = None
        deadline = now() + 10
        extra = []
        while now() < deadline:
            cur = self.processes()
            extra = [p for p, s in cur.items() if self.procs.get(p) != s]
            d.reaper.reap()
            if not extra:
                break
            d.kill_pids(extra, signal.SIGKILL)
            time.sleep(0.005)
        left = [{"kind": "process", "pid": p, "name": proc_cmdline(p) or "",
                 "why": "did not die after SIGKILL"} for p in extra]
        cur = self.processes()
        for p, s in self.procs.items():
            if cur.get(p) != s:
                left.append({"kind": "process", "pid": p, "why": "exited; cannot be restarted"})
        return left

    def _restore_files(self):
        found, _, _ = self.walk()
        left = []
        touched_dirs = set()
        redo = []  # baseline paths to (re)create, parents first
        # 1. drop what was added, and what changed type (re-created below)
        gone = []
        for p, (st, area) in found.items():
            ent = self.entries.get(p)
            if area == "dev" and (ent is not None or not self.dev_removable):
                if ent is None:  # the node's devtmpfs; a type changed in /dev stays (left)
                    left.append({"kind": "added", "path": p, "why": devwatch.NOT_REMOVED})
                continue
            if ent is None or _ftype(ent.mode) != _ftype(st.st_mode):
                gone.append(p)
        for p in sorted(gone, key=lambda x: -x.count("/")):
            try:
                if os.path.isdir(p) and not os.path.islink(p):
                    shutil.rmtree(p)
                else:
                    os.unlink(p)
                touched_dirs.add(os.path.dirname(p))
            except FileNotFoundError:
                pass
            except OSError as e:
                left.append({"kind": "added", "path": p, "why": e.strerror})
        # 2. what is missing or differs
        for p, ent in self.entries.items():
            cur = found.get(p)
            if cur is not None and p not in gone and ent.same(cur[0]) and not (
                    stat.S_ISDIR(ent.mode) and cur[0].st_ctime_ns != ent.ctime
                    and xattrs.read(p) != ent.xattrs):
                continue
            redo.append(p)
        for p in sorted(redo, key=lambda x: (x.count("/"), x)):
            ent = self.entries[p]
            try:
                why = self._put(p, ent)
            except OSError as e:
                why = "%s: %s" % (type(e).__name__, e.strerror)
            if why:
                left.append({"kind": "file", "path": p, "why": why})
            touched_dirs.add(os.path.dirname(p))
            if stat.S_ISDIR(ent.mode):
                touched_dirs.add(p)
        # 3. dirs last (their times move while their entries are written), deepest first
        for p in sorted(touched_dirs, key=lambda x: -x.count("/")):
            ent = self.entries.get(p)
            if ent is None or not stat.S_ISDIR(ent.mode):
                continue
            try:
                os.utime(p, ns=(ent.atime, ent.mtime), follow_symlinks=False)
                ent.set_stat(os.lstat(p))
            except OSError:
                pass
        return left

    def _put(self, p, ent):
        """Make `p` what the baseline recorded; returns why not, or None."""
        if self.areas.get(p) == "dev":
            return devwatch.NOT_PUT_BACK
        t = _ftype(ent.mode)
        mode = stat.S_IMODE(ent.mode)
        exists = os.path.lexists(p)
        if t == "dir":
            if not exists:
                os.mkdir(p, 0o700)
        elif t == "symlink":
            if exists:
                os.unlink(p)
            os.symlink(ent.link, p)
        elif t == "fifo":
            if exists:
                os.unlink(p)
            os.mkfifo(p, 0o600)
        elif t == "file":
            if ent.blob is None:
                return "no copy of the content (%s)" % ent.why
            if ent.nlink > 1:
                return "a hard link (%d names at baseline): a rewrite would split it" % ent.nlink
            tmp = os.path.join(os.path.dirname(p), ".sandman-restore-%s" % os.urandom(6).hex())
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                src = self.store.open_blob(ent.blob[0])
                try:
                    digest = copy_hashed(src, fd)
                finally:
                    os.close(src)
            except BaseException:
                os.close(fd)
                os.unlink(tmp)
                raise
            os.close(fd)
            if digest != ent.blob[1]:
                os.unlink(tmp)
                return "the stored copy was altered since the baseline"
            os.rename(tmp, p)
        else:
            return "a %s cannot be re-created" % t
        if t != "symlink":
            os.chmod(p, mode)
        if (ent.uid, ent.gid) != (os.geteuid(), os.getegid()) or os.geteuid() == 0:
            try:
                os.lchown(p, ent.uid, ent.gid)
            except PermissionError:
                return "owner %d:%d cannot be set back" % (ent.uid, ent.gid)
        why = xattrs.put_back(p, ent.xattrs)  # after chown, which drops security.capability
        if why:
            return why
        os.utime(p, ns=(ent.atime, ent.mtime), follow_symlinks=False)
        ent.set_stat(os.lstat(p))
        return None

    def _restore_tz(self):
        base = self.tz.get("localtime")
        if self.tz_state().get("localtime") == base or base is None:
            return []
        path = self.args.baseline_localtime
        try:
            if os.path.lexists(path):
                os.unlink(path)
            if base[0] == "symlink":
                os.symlink(base[1], path)
            else:
                with open(path, "wb") as f:
                    f.write(base64.b64decode(base[1]))
            ent = self.entries.get(os.path.realpath(os.path.dirname(path)) + "/"
                                   + os.path.basename(path))
            if ent is not None:
                ent.set_stat(os.lstat(path))
        except OSError as e:
            return [{"kind": "tz", "name": "localtime", "why": e.strerror}]
        return []

    def _restore_env(self, env):
        parts = []
        for k in env:
            if k not in self.env:
                parts.append("builtin unset -v %s" % k)
        for k, v in self.env.items():
            if env.get(k) != v:
                parts.append("builtin export %s=%s" % (
                    k, sh_quote(v.encode("utf-8", "surrogatepass")).decode("utf-8",
                                                                          "surrogatepass")))
        if parts:
            self.sh("\n".join(parts), True)
        env = self.shell_env(True)
        return [{"kind": "env", "name": k, "why": "differs after restore"}
                for k in sorted(set(env) | set(self.env)) if env.get(k) != self.env.get(k)]


def _revive_cwd(path):
    """Back into execd's cwd as at start, where the holder removed it (a new one at its path
    is the restored one by now): every later shell, spawn and /ready starts from it."""
    try:
        if os.path.samestat(os.stat("."), os.stat(path)):
            return []
    except OSError:
        pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fchdir(fd)
        finally:
            os.close(fd)
    except OSError as e:
        return [{"kind": "cwd", "path": path,
                 "why": "execd's working directory is gone: %s" % e.strerror}]
    return []


def _shell_binary(path):
    """(realpath, sha256) of the shell binary; the hash is None where it cannot be read."""
    real = os.path.realpath(path)
    try:
        return (real, file_sha256(real))
    except (HTTPError, OSError):
        return (real, None)


def _r_baseline(handler, query):
    handler.json_body()
    d = handler.daemon
    if d.baseline.entries is not None and not d.args.baseline_rerecord:
        # Else a holder could make its own changes the state that restore "restores".
        raise HTTPError(409, "a baseline exists and is fixed for this execd's life "
                             "(--baseline-rerecord allows recording again)")
    if not d.exec_lock.acquire(True, 30):
        raise HTTPError(409, "busy: a command did not finish within 30 s", {"busy": True})
    d.exec_lock.release()
    handler.reply(200, d.baseline.record())


def _r_diff(handler, query):
    handler.reply(200, handler.daemon.baseline.diff())


def _r_restore(handler, query):
    handler.json_body()
    handler.reply(200, handler.daemon.baseline.restore())
