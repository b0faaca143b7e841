"""Background processes (sb.spawn()): commands beside the shell, each with a handle, its output
in a bounded ring, signals and waits."""

import collections
import fcntl
import os
import re
import signal
import time

from .base import _ENV_NAME, PIPE_SIZE, SHELL_STARTUP_VARS, TAG_VAR, now, sh_quote
from .children import ChildTable, reply_output
from .procs import all_pids, exit_code_of, freeze, proc_tag, process_tree
from .wire import HTTPError, still_authorized, wire_uint

# sb.spawn(): commands that run beside the shell, each with a handle (an id) the SDK can
# find again after its own restart. Each one's stdout and stderr go to its own pipe, read by
# one execd thread into a ring: never through the shell's pipes, so a chatty process cannot
# block a foreground command, and never more than BG_RING bytes of it in memory.

BG_MAX_LIVE = 16  # running, or its output pipe still open; one more is refused (429)
BG_MAX_SPAWNED = 1024  # handles kept (exit statuses stay queryable) until /reset
BG_RING = 1 << 20  # the newest bytes of each process's output kept in memory
# Small reads are gathered into chunks of this size: a ring of 1-byte reads was ~40 bytes of
# object per byte kept (a process writing one byte at a time grew execd 5 MiB per 1 MiB ring).
BG_CHUNK = 64 << 10
BG_OUTPUT_BUDGET = 32 << 20  # all rings together: past it, the oldest ended outputs go
BG_COMMAND_MAX = 64 << 10  # bytes of a spawned command
BG_LISTED_COMMAND = 4096  # characters of the command kept for listings
BG_WAIT_MAX = 30.0  # one /processes/wait answers within this; the SDK asks again
_BG_ID = re.compile(r"p[0-9]{1,12}-[0-9a-f]{24}")  # fullmatch: `$` would take a newline
_BG_SIGNALS = ("HUP", "INT", "QUIT", "KILL", "USR1", "USR2", "TERM", "CONT", "STOP", "TSTP",
               "ALRM", "WINCH")


class BgProc(object):
    """One spawned process: its pipe, its output ring and, once reaped, its wait status."""

    RING = BG_RING  # bytes of output kept

    def __init__(self, pid, pid_id, tag, command, cwd, fd):
        self.pid = pid
        self.id = pid_id
        self.tag = tag
        self.command = command
        self.cwd = cwd
        self.fd = fd  # None once the pipe reached EOF (no writer left) or after /reset
        self.status = None  # set by the Reaper when it reaps the pid
        self.started_at = time.time()
        self.chunks = collections.deque()  # full chunks (bytes), oldest first
        self.tail = bytearray()  # then the newest bytes, until they make a chunk
        self.kept = 0  # bytes in chunks and tail
        self.total = 0  # bytes ever read: the offset of the next byte

    def add(self, data):
        n = len(data)
        self.kept += n
        self.total += n
        if not self.tail and n >= BG_CHUNK:
            self.chunks.append(bytes(data))
        else:
            self.tail += data
            if len(self.tail) >= BG_CHUNK:
                self.chunks.append(bytes(self.tail))
                self.tail = bytearray()
        over = self.kept - self.RING
        while over > 0 and self.chunks:
            first = self.chunks[0]
            if len(first) <= over:
                self.chunks.popleft()
                self.kept -= len(first)
                over -= len(first)
            else:
                self.chunks[0] = first[over:]
                self.kept -= over
                over = 0
        if over > 0:
            del self.tail[:over]
            self.kept -= over

    def data(self):
        return b"".join(self.chunks) + bytes(self.tail)

    def drop(self):
        n = self.kept
        self.chunks.clear()
        self.tail = bytearray()
        self.kept = 0
        return n

    def info(self):
        st = self.status
        return {"id": self.id, "pid": self.pid, "command": self.command, "cwd": self.cwd,
                "running": st is None,
                "exit_code": None if st is None else exit_code_of(st),
                "signal": os.WTERMSIG(st) if st is not None and os.WIFSIGNALED(st) else None,
                "started_at": round(self.started_at, 3), "output_bytes": self.total,
                "output_open": self.fd is not None}


class Background(ChildTable):
    """The spawned processes of this execd. Their ids are never reused (a sequence number) and
    not guessable (96 random bits); /reset kills them with the sandbox and forgets them."""

    READER = "execd-spawn-output"
    ID, WHAT, LISTING = _BG_ID, ("process", "p12", "ended by a reset"), "processes"
    MAX_LIVE = BG_MAX_LIVE

    def __init__(self, daemon):
        ChildTable.__init__(self, daemon)
        self.kept = 0  # bytes in all rings

    # ---- requests

    def spawn(self, req):
        d = self.d
        unknown = sorted(set(req) - {"command", "cwd", "env", "request_id"})
        if unknown:
            raise HTTPError(400, "unknown field(s): %s" % ", ".join(unknown)[:200])
        cmd = req.get("command")
        if not isinstance(cmd, str) or not cmd.strip():
            raise HTTPError(400, "command must be a non-empty string")
        try:
            data = cmd.encode("utf-8")
        except UnicodeEncodeError:
            raise HTTPError(400, "command is not valid unicode") from None
        if b"\0" in data:
            raise HTTPError(400, "command contains a NUL byte")
        if len(data) > BG_COMMAND_MAX:
            raise HTTPError(400, "command over %d bytes" % BG_COMMAND_MAX)
        env = req.get("env")
        env = {} if env is None else env
        if not isinstance(env, dict):
            raise HTTPError(400, "env must be an object of names to strings")
        for k, v in env.items():
            if not _ENV_NAME.match(k) or k.startswith("__sm_") or k == TAG_VAR:
                raise HTTPError(400, "invalid variable name %r" % k[:100])
            if not isinstance(v, str) or "\0" in v:
                raise HTTPError(400, "value of %s must be a string without NUL" % k)
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise HTTPError(400, "value of %s is not valid unicode" % k) from None
        rid = req.get("request_id")
        if rid is not None and (not isinstance(rid, str) or not rid or len(rid) > 256):
            raise HTTPError(400, "request_id must be a non-empty string of at most 256 chars")
        cwd = self._cwd(req.get("cwd"))
        sigs = [signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM,
                signal.SIGHUP, signal.SIGCHLD, signal.SIGUSR1, signal.SIGUSR2]
        d.reaper.reap()  # an exited process still unreaped is not live
        with self.lock:
            if d.retired:
                raise HTTPError(503, "retired: %s" % d.retired, {"retired": True})
            if d.resetting or self.held:
                raise HTTPError(409, "a reset or restore is running; spawn after it")
            still_authorized(d)
            # A retry of a spawn whose answer was lost: the same process, never a second one.
            known = self.items.get(self.rids.get(rid)) if rid is not None else None
            if known is not None:
                return known.info()
            if len(self.items) >= BG_MAX_SPAWNED:
                raise HTTPError(429, "%d processes were spawned since the last reset (the "
                                     "limit); /reset forgets them" % BG_MAX_SPAWNED)
            live = sum(1 for p in self.items.values() if p.fd is not None or p.status is None)
            if live >= BG_MAX_LIVE:
                raise HTTPError(429, "%d background processes are live (the limit): wait for "
                                     "one, signal it, or reset" % BG_MAX_LIVE)
            self.seq += 1
            pid_id = "p%d-%s" % (self.seq, os.urandom(12).hex())
            tag = "%s-bg%d" % (d.instance, self.seq)
            e = dict(d.base_env)
            e.update(env)
            e[TAG_VAR] = tag  # a foreground call's kill never takes it for one of its own
            # As for the shell: read by bash or the loader at its start, so exported after it.
            startup = [(k, e.pop(k)) for k in SHELL_STARTUP_VARS if k in e]
            script = b"".join(
                [b"builtin export %s=%s\n" % (k.encode(), sh_quote(
                    v.encode("utf-8", "surrogatepass"))) for k, v in startup]
                + [b"builtin cd -- %s || builtin exit 126\n" % sh_quote(os.fsencode(cwd)), data])
            r, w = os.pipe()
            try:
                fcntl.fcntl(r, 1031, PIPE_SIZE)  # F_SETPIPE_SZ: fewer wakeups under floods
            except OSError:
                pass
            devnull = os.dup(d.null_fd)
            actions = [(os.POSIX_SPAWN_DUP2, devnull, 0), (os.POSIX_SPAWN_DUP2, w, 1),
                       (os.POSIX_SPAWN_DUP2, w, 2)]
            bash = os.fsencode(d.bash)
            try:
                # Under the reaper's lock: the pid cannot be reaped before it is known.
                with d.reaper.lock:
                    pid = os.posix_spawn(bash, [bash, b"--noprofile", b"--norc", b"-c", script],
                                         e, file_actions=actions, setsid=True, setsigdef=sigs,
                                         setsigmask=[])
                    p = BgProc(pid, pid_id, tag, cmd[:BG_LISTED_COMMAND], cwd, r)
                    d.reaper.procs[pid] = p
            except OSError as ex:
                os.close(r)
                raise HTTPError(500, "spawn failed: %s" % (ex.strerror or ex)) from None
            finally:
                os.close(w)
                os.close(devnull)
            os.set_blocking(r, False)
            self.items[pid_id] = p
            if rid is not None:
                self.rids[rid] = pid_id
            self._start_reader()
            self._poke()
            return p.info()

    def _cwd(self, cwd):
        base = None
        sh = self.d.shell
        if sh is not None and sh.pid is not None:
            try:
                base = os.readlink("/proc/%d/cwd" % sh.pid)
            except OSError:
                base = None
        base = base or self.d.start_dir
        if cwd is None:
            return base
        if not isinstance(cwd, str) or not cwd or "\0" in cwd or len(cwd) > 4096:
            raise HTTPError(400, "cwd must be a path (a non-empty string without NUL)")
        path = os.path.join(base, cwd)
        if not os.path.isdir(path):
            raise HTTPError(400, "cwd %s is not a directory" % path[:300])
        return path

    def info(self, pid_id):
        self.d.reaper.reap()
        return self.get(pid_id).info()

    def output(self, pid_id, since):
        """(the answer without its data, the data bytes)."""
        self.d.reaper.reap()
        with self.lock:
            p = self.get(pid_id)
            if since > p.total:
                raise HTTPError(400, "since=%d is past the end of the output (%d bytes so far)"
                                % (since, p.total))
            start = p.total - p.kept
            frm = max(since, start)
            data = p.data()[frm - start:]
            out = p.info()
        out.update({"start": frm, "end": frm + len(data), "dropped": frm - since})
        return out, data

    def wait(self, req):
        p = self.get(req.get("id"))
        tmo = req.get("timeout", BG_WAIT_MAX)
        if isinstance(tmo, bool) or not isinstance(tmo, (int, float)) or not 0 <= tmo <= 86400:
            raise HTTPError(400, "timeout must be a number of seconds in [0, 86400]")
        deadline = now() + min(float(tmo), BG_WAIT_MAX)
        pause = 0.005
        while True:
            self.d.reaper.reap()
            if p.status is not None or now() >= deadline:
                return p.info()
            time.sleep(min(pause, max(0.0, deadline - now())))
            pause = min(pause * 2, 0.05)

    def signal(self, req):
        p = self.get(req.get("id"))
        sig = req.get("signal", "TERM")
        if isinstance(sig, str):
            name = sig.upper()
            name = name[3:] if name.startswith("SIG") else name
            if name not in _BG_SIGNALS:
                raise HTTPError(400, "signal must be one of %s or a number in 1..64"
                                % ", ".join(_BG_SIGNALS))
            num = int(getattr(signal, "SIG" + name))
        elif isinstance(sig, int) and not isinstance(sig, bool) and 1 <= sig <= 64:
            num = sig
        else:
            raise HTTPError(400, "signal must be a name (TERM, KILL...) or a number in 1..64")
        rounds = 20 if num == signal.SIGKILL else 1  # a tree may fork while it is killed
        if num == signal.SIGKILL:
            # Stopped first, all of it (as kill_sandbox does), so none acts on another's death
            # before its own: a `wait` whose children died first exited 0, not 137. Under the
            # reaper's lock an unreaped leader is still this process.
            with self.d.reaper.lock:
                freeze(lambda: self._tree(p) | ({p.pid} if p.status is None else set()))
        sent = set()
        for _ in range(rounds):
            pids = self._tree(p)
            with self.d.reaper.lock:
                # While we hold it nothing is reaped: an unreaped pid is still this process.
                if p.status is None:
                    pids.add(p.pid)
                self.d.kill_pids(pids, num)
            sent |= pids
            if num != signal.SIGKILL or not pids:
                break
            time.sleep(0.005)
            self.d.reaper.reap()
        out = p.info()
        out["signalled"] = len(sent)
        return out

    def _tree(self, p):
        """The live processes of a spawn but its leader: its descendants, and anything that
        still carries its tag (orphans re-parented to execd)."""
        info, desc = process_tree(all_pids(), p.pid if p.status is None else -1)
        me = os.getpid()
        out = set()
        for pid, st in info.items():
            if pid == me or pid == p.pid or st[1] == "Z":
                continue
            if pid in desc or proc_tag(pid) == p.tag:
                out.add(pid)
        return out

    def forgotten(self):
        self.kept = 0

    def took(self, p, data):
        before = p.kept
        p.add(data)
        self.kept += p.kept - before
        if self.kept > BG_OUTPUT_BUDGET:
            self._shed()

    def _shed(self):
        """Drop the oldest ended outputs (pipe closed) until the rings fit the budget; live
        rings alone fit in it (BG_MAX_LIVE * BG_RING)."""
        for p in self.items.values():
            if self.kept <= BG_OUTPUT_BUDGET:
                return
            if p.fd is None and p.kept:
                self.kept -= p.drop()


def _r_spawn(handler, query):
    handler.reply(200, handler.daemon.bg.spawn(handler.json_body()))


def _r_processes(handler, query):
    handler.reply(200, handler.daemon.bg.listing())


def _r_process(handler, query):
    ids = query.get("id")
    handler.reply(200, handler.daemon.bg.info(ids[-1] if ids else None))


def _r_process_output(handler, query):
    ids = query.get("id")
    raw = query.get("since")
    since = 0
    if raw:
        since = wire_uint(raw[-1], 1 << 62)
        if since is None:
            raise HTTPError(400, "since must be a byte offset (ASCII digits)")
    out, data = handler.daemon.bg.output(ids[-1] if ids else None, since)
    reply_output(handler, out, data)


def _r_process_signal(handler, query):
    handler.reply(200, handler.daemon.bg.signal(handler.json_body()))


def _r_process_wait(handler, query):
    handler.reply(200, handler.daemon.bg.wait(handler.json_body()))
