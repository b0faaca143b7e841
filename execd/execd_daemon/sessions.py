"""Interactive sessions: programs on a pseudo-terminal, written to, read, resized, signalled and
closed by id; a session is a background process (BgProc) with a terminal."""

import base64
import binascii
import collections
import fcntl
import os
import re
import signal
import sys
import threading
import time

from .background import _BG_SIGNALS, BG_COMMAND_MAX, BG_LISTED_COMMAND, BgProc
from .base import _ENV_NAME, SHELL_STARTUP_VARS, TAG_VAR, now, sh_quote
from .children import ChildTable, reply_output
from .wire import HTTPError, still_authorized, wire_uint

# sb.session(): a program on its own pseudo-terminal (a REPL, an interactive shell), written
# to and read from across calls. Each runs in a new session with the pty as its controlling
# terminal, so ^C written to it and a resize reach its foreground job as on a terminal. One
# execd thread reads every session's output into a ring (PTY_RING bytes each): never through
# the shell's pipes, so a flooding session blocks neither the foreground shell nor a route.

PTY_MAX_LIVE = 8  # open sessions (not closed, not ended); one more is refused (429)
PTY_MAX_KEPT = 16  # ended sessions past this are forgotten, oldest first, at the next open
PTY_RING = 256 << 10  # the newest bytes of each session's output kept in memory
PTY_WRITE_MAX = 64 << 10  # bytes of one write
PTY_WRITE_WAIT = 10.0  # a write the program does not read within this is cut short (409)
PTY_READ_WAIT_MAX = 30.0  # one read waits at most this for new output; the SDK asks again
PTY_SIZE_MAX = 4096  # columns and rows
PTY_REQUEST_IDS = 64  # answers kept per session (and of opens) for request_id retries
# `abandon_after` (seconds, at most this): a session no call names for that long is closed as
# /sessions/close does, checked every PTY_ABANDON_CHECK s by the reader thread. Its client is
# gone (killed before the open's answer came, or since): nobody else knows its id.
PTY_ABANDON_MAX = 86400.0
PTY_ABANDON_CHECK = 0.5
_PTY_ID = re.compile(r"s[0-9]{1,12}-[0-9a-f]{24}")  # fullmatch: `$` would take a newline
_PTY_SECONDS = re.compile(r"[0-9]{1,6}(?:\.[0-9]{1,20})?")


class PtySession(BgProc):
    """One session: its pty's master fd (read and written by execd), its ring (BgProc's)."""

    RING = PTY_RING

    def __init__(self, pid, sid, tag, command, cwd, fd, cols, rows):
        BgProc.__init__(self, pid, sid, tag, command, cwd, fd)
        self.cols = cols
        self.rows = rows
        self.answers = collections.OrderedDict()  # request_id -> answer of a write or signal
        self.abandon_after = None  # seconds, or None: open until closed or reset
        self.used = now()  # the last time a call named it (a waiting read: when it ends)
        self.abandoned = False  # its close is under way

    def use(self, until=0.0):
        """A call names it now (and waits on it `until` seconds more)."""
        self.used = max(self.used, now() + until)

    def info(self):
        out = BgProc.info(self)
        out.update({"cols": self.cols, "rows": self.rows, "abandon_after": self.abandon_after})
        return out


def _pty_winsize(fd, cols, rows):
    import struct
    import termios

    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _pty_dim(req, name, default):
    v = req.get(name, default)
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= PTY_SIZE_MAX:
        raise HTTPError(400, "%s must be an integer in 1..%d" % (name, PTY_SIZE_MAX))
    return v


class Sessions(ChildTable):
    """The interactive sessions of this execd. Ids are never reused (a sequence number) and
    not guessable (96 random bits); /reset and /restore kill them with the sandbox and forget
    them. Output waits on `cond` (the reader notifies it)."""

    READER = "execd-pty-output"
    ID, WHAT, LISTING = _PTY_ID, ("session", "s12", "closed, ended by a reset"), "sessions"
    MAX_LIVE = PTY_MAX_LIVE
    _check_at = 0.0  # when the reader next looks for abandoned sessions

    def open(self, req):
        d = self.d
        unknown = sorted(set(req) - {"command", "cwd", "env", "cols", "rows", "request_id",
                                     "abandon_after"})
        if unknown:
            raise HTTPError(400, "unknown field(s): %s" % ", ".join(unknown)[:200])
        cmd = req.get("command")
        if cmd is not None and (not isinstance(cmd, str) or not cmd.strip()):
            raise HTTPError(400, "command must be a non-empty string (or absent: bash -i)")
        data = None
        if cmd is not None:
            try:
                data = cmd.encode("utf-8")
            except UnicodeEncodeError:
                raise HTTPError(400, "command is not valid unicode") from None
            if b"\0" in data or len(data) > BG_COMMAND_MAX:
                raise HTTPError(400, "command has a NUL byte or is over %d bytes"
                                % BG_COMMAND_MAX)
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
        cols = _pty_dim(req, "cols", 80)
        rows = _pty_dim(req, "rows", 24)
        rid = _request_id(req)
        abandon = req.get("abandon_after")
        if abandon is not None and (isinstance(abandon, bool)
                                    or not isinstance(abandon, (int, float))
                                    or not 0 < abandon <= PTY_ABANDON_MAX):
            raise HTTPError(400, "abandon_after must be seconds in (0, %d]" % PTY_ABANDON_MAX)
        cwd = d.bg._cwd(req.get("cwd"))
        sigs = [signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM,
                signal.SIGHUP, signal.SIGCHLD, signal.SIGUSR1, signal.SIGUSR2]
        d.reaper.reap()
        with self.lock:
            if d.retired:
                raise HTTPError(503, "retired: %s" % d.retired, {"retired": True})
            if d.resetting or self.held:
                raise HTTPError(409, "a reset or restore is running; open a session after it")
            still_authorized(d)
            if rid is not None and rid in self.rids and self.rids[rid] is None:
                # Closed by its request_id before this (late) open came: its caller is gone.
                raise HTTPError(409, "the session of request_id %s was closed before it opened"
                                % rid[:100], {"closed": True})
            # A retry of an open whose answer was lost: the same session, never a second one.
            known = self.items.get(self.rids.get(rid)) if rid is not None else None
            if known is not None:
                known.use()
                return known.info()
            live = sum(1 for s in self.items.values() if s.fd is not None or s.status is None)
            if live >= PTY_MAX_LIVE:
                raise HTTPError(429, "%d sessions are open (the limit): close one, or reset"
                                % PTY_MAX_LIVE)
            self._forget_ended(PTY_MAX_KEPT - 1)
            self.seq += 1
            sid = "s%d-%s" % (self.seq, os.urandom(12).hex())
            tag = "%s-pty%d" % (d.instance, self.seq)
            e = dict(d.base_env)
            # Plain text (no colours, no bracketed paste) unless the caller names a terminal:
            # execd's own TERM describes no terminal of the session's.
            e["TERM"] = "dumb"
            e.update(env)
            e[TAG_VAR] = tag
            # The prompts too: the non-interactive bash that starts the session unsets them.
            startup = [(k, e.pop(k)) for k in SHELL_STARTUP_VARS + ("PS0", "PS1", "PS2")
                       if k in e]
            script = b"".join(
                [b"builtin export %s=%s\n" % (k.encode(), sh_quote(
                    v.encode("utf-8", "surrogatepass"))) for k, v in startup]
                + [b"builtin cd -- %s || builtin exit 126\n" % sh_quote(os.fsencode(cwd))]
                + [data if data is not None
                   else b"builtin exec %s -i" % sh_quote(os.fsencode(d.bash))])
            master, slave = os.openpty()
            try:
                _pty_winsize(master, cols, rows)
                # Opened again by the child after setsid, without O_NOCTTY: that open makes
                # the pty its controlling terminal.
                actions = [(os.POSIX_SPAWN_OPEN, 0, os.ttyname(slave), os.O_RDWR, 0),
                           (os.POSIX_SPAWN_DUP2, 0, 1), (os.POSIX_SPAWN_DUP2, 0, 2)]
                bash = os.fsencode(d.bash)
                with d.reaper.lock:
                    pid = os.posix_spawn(bash, [bash, b"--noprofile", b"--norc", b"-c", script],
                                         e, file_actions=actions, setsid=True, setsigdef=sigs,
                                         setsigmask=[])
                    s = PtySession(pid, sid, tag, (cmd or "bash -i")[:BG_LISTED_COMMAND], cwd,
                                   master, cols, rows)
                    s.abandon_after = abandon
                    d.reaper.procs[pid] = s
            except OSError as ex:
                os.close(master)
                raise HTTPError(500, "session start failed: %s" % (ex.strerror or ex)) from None
            finally:
                os.close(slave)  # the child's end only: EOF on the master when it is gone
            os.set_blocking(master, False)
            self.items[sid] = s
            if rid is not None:
                _remember(self.rids, rid, sid)
            self._start_reader()
            self._poke()
            return s.info()

    def _forget_ended(self, keep):
        ended = [k for k, s in self.items.items() if s.fd is None and s.status is not None]
        for k in ended[:max(0, len(self.items) - keep)]:
            self.items.pop(k).drop()

    def write(self, req):
        unknown = sorted(set(req) - {"id", "data_b64", "request_id"})
        if unknown:
            raise HTTPError(400, "unknown field(s): %s" % ", ".join(unknown)[:200])
        raw = req.get("data_b64")
        if not isinstance(raw, str) or len(raw) > (PTY_WRITE_MAX * 4) // 3 + 4:
            raise HTTPError(400, "data_b64 must be the base64 of at most %d bytes"
                            % PTY_WRITE_MAX)
        try:
            data = base64.b64decode(raw.encode("ascii"), validate=True)
        except (binascii.Error, ValueError, UnicodeEncodeError):
            raise HTTPError(400, "data_b64 is not base64") from None
        rid = _request_id(req)
        with self.lock:
            s = self.get(req.get("id"))
            s.use(PTY_WRITE_WAIT)
            fd = s.fd
            if rid is not None and rid in s.answers:
                return s.answers[rid]  # a retry: these bytes were written once already
        if fd is None:
            raise HTTPError(409, "session %s ended; nothing reads its input" % s.id,
                            {"ended": True})
        view = memoryview(data)
        done = 0
        deadline = now() + PTY_WRITE_WAIT
        while done < len(data):
            with self.lock:
                if s.fd != fd:
                    break  # closed or reset meanwhile: the fd may be another file's by now
                try:
                    done += os.write(fd, view[done:])
                    continue
                except (BlockingIOError, InterruptedError):
                    pass
                except OSError:
                    break  # the program is gone (EIO)
            left = deadline - now()
            if left <= 0:
                break
            time.sleep(min(0.01, left))
        out = s.info()
        out["written"] = done
        if rid is not None:
            with self.lock:
                _remember(s.answers, rid, out)
        if done < len(data):
            raise HTTPError(409, "session %s took %d of %d bytes (it does not read its input, "
                                 "or it ended)" % (s.id, done, len(data)), out)
        return out

    def read(self, sid, since, wait):
        """(the answer without its data, the data bytes): what came from `since` on, waiting
        up to `wait` seconds for something new (or the end) when nothing is."""
        deadline = now() + wait
        self.d.reaper.reap()
        with self.cond:
            s = self.get(sid)
            s.use(wait)
            if since > s.total:
                raise HTTPError(400, "since=%d is past the end of the output (%d bytes so far)"
                                % (since, s.total))
            while s.total == since and s.fd is not None and self.items.get(sid) is s:
                left = deadline - now()
                if left <= 0:
                    break
                self.cond.wait(min(left, 1.0))
            start = s.total - s.kept
            frm = max(since, start)
            data = s.data()[frm - start:]
        self.d.reaper.reap()
        # The kernel closes a dying program's terminal before the program can be reaped (and a
        # program may close it and go on): within this read's wait, the answer that says the
        # output ended waits for the exit, so it carries the exit status.
        while s.fd is None and s.status is None and now() < deadline:
            time.sleep(0.01)
            self.d.reaper.reap()
        out = s.info()
        out.update({"start": frm, "end": frm + len(data), "dropped": frm - since})
        return out, data

    def resize(self, req):
        cols = _pty_dim(req, "cols", None)
        rows = _pty_dim(req, "rows", None)
        with self.lock:
            s = self.get(req.get("id"))
            s.use()
            if s.fd is None:
                raise HTTPError(409, "session %s ended" % s.id, {"ended": True})
            _pty_winsize(s.fd, cols, rows)  # the kernel sends SIGWINCH to its foreground job
            s.cols, s.rows = cols, rows
        return s.info()

    def signal(self, req):
        """A signal to the terminal's foreground process group (as its keys send ^C, ^Z),
        or to the session's leader when there is none."""
        rid = _request_id(req)
        with self.lock:
            s = self.get(req.get("id"))
            s.use()
            if rid is not None and rid in s.answers:
                return s.answers[rid]  # a retry: sent once already
            fd = s.fd
            pgrp = None
            if fd is not None:
                try:
                    pgrp = os.tcgetpgrp(fd)
                except OSError:
                    pgrp = None
        num = _signal_number(req.get("signal", "INT"))
        sent = 0
        with self.d.reaper.lock:
            try:
                if pgrp and pgrp > 1 and pgrp != os.getpgrp():
                    os.killpg(pgrp, num)
                    sent = 1
                elif s.status is None:
                    os.kill(s.pid, num)
                    sent = 1
            except (ProcessLookupError, PermissionError):
                pass
        out = s.info()
        out["signalled"] = sent
        if rid is not None:
            with self.lock:
                _remember(s.answers, rid, out)
        return out

    def close(self, req):
        """SIGKILL the session's tree (its descendants and whatever carries its tag, in
        rounds since it may fork meanwhile), reap it, close the pty, forget the id. By
        `open_request_id` instead of `id`: the session an open with that request_id started,
        and that open refused from now on (its caller stopped before the answer came)."""
        unknown = sorted(set(req) - {"id", "open_request_id"})
        if unknown:
            raise HTTPError(400, "unknown field(s): %s" % ", ".join(unknown)[:200])
        if "open_request_id" not in req:
            with self.lock:
                s = self.get(req.get("id"))
            return self._close(s)
        if "id" in req:
            raise HTTPError(400, "give id or open_request_id, not both")
        rid = req["open_request_id"]
        if not isinstance(rid, str) or not rid or len(rid) > 256:
            raise HTTPError(400, "open_request_id must be a non-empty string of at most 256 "
                                 "chars")
        with self.lock:
            s = self.items.get(self.rids.get(rid))
            _remember(self.rids, rid, None)
        if s is None:
            return {"closed": False, "open_request_id": rid}
        return self._close(s)

    def _close(self, s):
        for _ in range(50):
            pids = self.d.bg._tree(s)
            with self.d.reaper.lock:
                if s.status is None:
                    pids.add(s.pid)
                self.d.kill_pids(pids, signal.SIGKILL)
            if not pids:
                break
            time.sleep(0.005)
            self.d.reaper.reap()
        self.d.reaper.reap()
        with self.cond:
            if self.items.get(s.id) is s:
                self.items.pop(s.id)
                if s.fd is not None:
                    self.closing.append(s.fd)
                    s.fd = None
            self.cond.notify_all()
            if self.wake is not None:
                self._poke()
        out = s.info()
        s.drop()
        out["closed"] = True
        return out

    def tick(self):
        """In the reader thread: close the sessions no call named for their abandon_after,
        each in a thread of its own (a close kills in rounds: the reader never waits on it)."""
        t = now()
        if t < self._check_at:
            return
        self._check_at = t + PTY_ABANDON_CHECK
        gone = []
        with self.lock:
            for s in self.items.values():
                if (s.abandon_after is not None and not s.abandoned
                        and t - s.used >= s.abandon_after):
                    s.abandoned = True
                    gone.append(s)
        for s in gone:
            threading.Thread(target=self._abandon, args=(s,), name="execd-pty-abandoned",
                             daemon=True).start()

    def _abandon(self, s):
        with self.lock:
            if now() - s.used < s.abandon_after:  # named since the check
                s.abandoned = False
                return
        sys.stderr.write("execd: session %s: no call named it for %g s; closing it\n"
                         % (s.id, s.abandon_after))
        self._close(s)


def _request_id(req):
    rid = req.get("request_id")
    if rid is not None and (not isinstance(rid, str) or not rid or len(rid) > 256):
        raise HTTPError(400, "request_id must be a non-empty string of at most 256 chars")
    return rid


def _remember(answers, rid, value):
    answers[rid] = value
    while len(answers) > PTY_REQUEST_IDS:
        answers.popitem(last=False)


def _signal_number(sig):
    if isinstance(sig, str):
        name = sig.upper()
        name = name[3:] if name.startswith("SIG") else name
        if name not in _BG_SIGNALS:
            raise HTTPError(400, "signal must be one of %s or a number in 1..64"
                            % ", ".join(_BG_SIGNALS))
        return int(getattr(signal, "SIG" + name))
    if isinstance(sig, int) and not isinstance(sig, bool) and 1 <= sig <= 64:
        return sig
    raise HTTPError(400, "signal must be a name (INT, TERM, KILL...) or a number in 1..64")


def _r_session_open(handler, query):
    handler.reply(200, handler.daemon.pty.open(handler.json_body()))


def _r_sessions(handler, query):
    handler.reply(200, handler.daemon.pty.listing())


def _r_session_write(handler, query):
    handler.reply(200, handler.daemon.pty.write(handler.json_body()))


def _r_session_read(handler, query):
    ids = query.get("id")
    since = 0
    raw = query.get("since")
    if raw:
        since = wire_uint(raw[-1], 1 << 62)
        if since is None:
            raise HTTPError(400, "since must be a byte offset (ASCII digits)")
    wait = 0.0
    raw = query.get("timeout")
    if raw:
        if not _PTY_SECONDS.fullmatch(raw[-1]):
            raise HTTPError(400, "timeout must be seconds (digits, an optional fraction)")
        wait = min(float(raw[-1]), PTY_READ_WAIT_MAX)
    out, data = handler.daemon.pty.read(ids[-1] if ids else None, since, wait)
    reply_output(handler, out, data)


def _r_session_resize(handler, query):
    handler.reply(200, handler.daemon.pty.resize(handler.json_body()))


def _r_session_signal(handler, query):
    handler.reply(200, handler.daemon.pty.signal(handler.json_body()))


def _r_session_close(handler, query):
    handler.reply(200, handler.daemon.pty.close(handler.json_body()))
