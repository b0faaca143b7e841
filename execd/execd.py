#!/usr/bin/env python3
"""execd: the in-pod daemon that runs an agent's commands in one persistent bash.

Stdlib only, python3 >= 3.8, one file: it is mounted read-only into unmodified task images.
Start: python3 /sandman/execd.py --listen 0.0.0.0:9470   (docs/execd.md has the API)
"""

import argparse
import base64
import binascii
import collections
import errno
import fcntl
import io
import os
import pwd
import re
import select
import shutil
import signal
import socket
import socketserver
import stat
import sys
import threading
import time

# Imported where they are used instead (json, tempfile, glob): the start, exec -> listening, runs
# at every sandbox start under the pod's CPU quota (100m: 1 ms of CPU is 10 ms of wall time), and
# json alone was ~1.2 ms of it; a module that only some requests need is loaded by the first.

# execd never speaks TLS: keep http.client (imported by http.server) from loading OpenSSL, and use
# the builtin SHA-256 rather than hashlib's, for about 7 MiB less RSS in every sandbox.
sys.modules.setdefault("ssl", None)
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer  # noqa: E402
from urllib.parse import parse_qs, urlsplit  # noqa: E402

try:
    from _sha256 import sha256  # python <= 3.11
except ImportError:
    try:
        from _sha2 import sha256  # python >= 3.12
    except ImportError:
        from hashlib import sha256
try:
    from _operator import _compare_digest as compare_digest  # what hmac uses without OpenSSL
except ImportError:
    from hmac import compare_digest

VERSION = "0.1.0"

# Copies of sandman/contract.py (execd cannot import it); a test keeps them equal.
EXECD_PORT = 9470
EXECD_PATH = "/sandman/execd.py"
EXECD_TOKEN_ENV = "SANDMAN_TOKEN_SHA256"
NETGUARD_STATUS_PATH = "/sandman/run/netguard.json"
EXECD_READY_PATH = "/ready"

NETGUARD_STATUS_ENV = "SANDMAN_NETGUARD_STATUS"
WORKSPACE_ENV = "SANDMAN_WORKSPACE"
INSTANCE_ENV = "SANDMAN_EXECD_INSTANCE"
# The shell exports this variable (value: instance-call) to every process a call starts, so a timeout or a
# reset finds it again even after it double-forked or called setsid.
TAG_VAR = "__SANDMAN_CALL"

STATUS_FD = 62  # the shell writes exit-status frames here, apart from the command's output
DIAG_W_FD = 61  # syntax-check diagnostics go into this pipe...
DIAG_R_FD = 60  # ...and `read -t 0` on its other end tells bash, without a process, if any came
PROTO_FD = 63  # bash reads its script (our requests) here; stdin is /dev/null
DEFAULT_TIMEOUT = 300.0
DEFAULT_MAX_OUTPUT = 102400
MAX_OUTPUT_LIMIT = 64 << 20
CACHE_BYTES = 8 << 20  # stored answers for request_id retries
IDLE_TIMEOUT = 180.0  # keep-alive idle limit; callers pool connections for minutes
# A stream's client that takes longer than this to accept one chunk is gone: the command's
# loop (timeouts, kills) must not wait on a stalled reader.
STREAM_SEND_TIMEOUT = 10.0
# Pre-auth budget: what a client without the token can pin (connections, threads, header bytes,
# time). The agent's connections are never refused for the sake of unauthenticated ones: those
# are capped below the total and the oldest is shed to admit a new one.
MAX_CONNECTIONS = 64  # connections (one thread each), authenticated or not
MAX_PREAUTH = 16  # of which not (yet) authenticated
MAX_HEADER_BYTES = 32 << 10  # request line and headers together
HEADER_TIMEOUT = 10.0  # from a request's first byte to the end of its headers
PREAUTH_IDLE = 10.0  # idle limit of a connection that has not authenticated
BODY_DEADLINE = 30.0  # a request body must arrive within this (slow clients get 408)
READY_BUDGET = 2.0  # /ready answers within this, or fails
READY_CACHE = 1.0  # at most one readiness check a second, whoever asks
# Read as bash and the dynamic loader start, before any command of ours runs.
SHELL_STARTUP_VARS = ("BASH_ENV", "ENV", "LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT")
READY_PROBE_PREFIX = ".sandman-ready-"  # /ready's write probe file where O_TMPFILE is missing
PIPE_SIZE = 1 << 20
READ_SIZE = 1 << 20
PR_SET_CHILD_SUBREAPER = 36
PR_SET_DUMPABLE = 4
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_DIAG_PREFIX = re.compile(r"^[^:]*: (?:eval: )?line ")
_LINE_NO = re.compile(r"\bline (\d+)")
# bash's job notice ("bash: line 3: 4242 Killed   sleep 9"): a pid, then a capitalised status.
# A parse diagnostic goes on in lower case ("syntax error", "warning", "unexpected EOF").
_JOB_NOTICE = re.compile(r"^[^:]*: (?:line \d+: )?\s*\d+ [A-Z]")

# Shell-side helpers. The check parses the whole command with `set -n` inside eval: nothing runs
# (a `x; }; cmd` escape is parsed, not executed), an open quote or heredoc ends at the string's
# end instead of waiting for more input, and `local -` turns noexec off again on return.
# noexec stays on until that function returns, so __sm_chk1 does nothing after the eval.
# Any diagnostic (bash only *warns* on an unterminated heredoc) counts as a refusal.
BOOTSTRAP = r"""
builtin exec %(proto)d<&-
BASH_ARGV0=bash
__sm_k=0 __sm_t=0
builtin export %(tag)s=
__sm_chk1() {
  local -
  builtin set +xv
  builtin eval $'builtin set -n\n'"$__sm_c" 2>&%(diagw)d
}
# bash < 4.4 has no `local -`: parse in a forked subshell instead (slower, same verdicts).
if ((BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] < 404)) || [[ -n ${SANDMAN_EXECD_FORK_CHECK-} ]]
then
  __sm_chk1() { ( builtin eval $'builtin set -n\n'"$__sm_c" ) 2>&%(diagw)d; }
fi
__sm_chk() {
  local __sm_s __sm_x=1
  builtin shopt -q extglob || __sm_x=0
  builtin shopt -s extglob
  # A job that died since the last call (say, killed by a timeout) has a notice pending, which
  # bash prints at the next eval: flush it to the output here, not into the check's diagnostics.
  builtin eval :
  __sm_chk1
  __sm_s=$?
  ((__sm_x)) || builtin shopt -u extglob
  if ((__sm_s)) || builtin read -t 0 -u %(diagr)d; then
    __sm_k=0; builtin printf '%%sE%%d\n' "$__sm_m" "$__sm_s" >&%(st)d; return 1
  fi
  __sm_k=1
  if ((__sm_t)); then builtin set -x; fi
}
__sm_fin() {
  case $- in *x*) builtin set +x; __sm_t=1;; *) __sm_t=0;; esac
  ((__sm_k)) && builtin printf '%%sS%%d\n' "$__sm_m" "$1" >&%(st)d
  __sm_k=0; builtin set +v
}
__sm_c=')'; __sm_chk1; __sm_c=
builtin printf '%%sR0\n' "$1" >&%(st)d
builtin set --
"""


class HTTPError(Exception):
    def __init__(self, code, message, extra=None):
        Exception.__init__(self, message)
        self.code = code
        self.message = message
        self.extra = extra or {}


def now():
    return time.monotonic()


def sh_quote(data):
    return b"'" + data.replace(b"'", b"'\\''") + b"'"


# ---------------------------------------------------------------- processes (/proc)

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


TASK_SCAN_MAX = 64  # threads of a `Z` leader read for a live one


def proc_stat(pid):
    """(ppid, state, starttime ticks) or None when gone. A leader that called exit(2) alone
    reads `Z` while its other threads run (and write): it then gets a live thread's state, so
    every process set counts it and SIGKILL to its pid ends the whole group."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            data = f.read()
    except OSError:
        return None
    rest = data[data.rfind(b")") + 2:].split()
    try:
        state = rest[0].decode()
        if state == "Z":
            state = _live_thread_state(pid) or state
        return int(rest[1]), state, int(rest[19])
    except (IndexError, ValueError):
        return None


def _live_thread_state(pid):
    """The state of a thread of `pid` other than its leader that has not exited, or None.
    Read for `Z` pids only, so a listing stays one read per process. Exited threads leave
    /proc/PID/task at once unless traced; traced ones wait for their tracer, a sandbox process
    killed in the same round, so reading the first TASK_SCAN_MAX entries is enough."""
    try:
        tids = os.listdir("/proc/%d/task" % pid)
    except OSError:
        return None
    for tid in tids[:TASK_SCAN_MAX + 1]:
        if tid == str(pid):
            continue
        try:
            with open("/proc/%d/task/%s/stat" % (pid, tid), "rb") as f:
                data = f.read()
        except OSError:
            continue  # exited meanwhile
        state = data[data.rfind(b")") + 2:][:1].decode("ascii", "replace")
        if state and state not in "ZXx":
            return state
    return None


def proc_tag(pid):
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            env = f.read()
    except OSError:
        return None
    key = TAG_VAR.encode() + b"="
    for item in env.split(b"\0"):
        if item.startswith(key):
            return item[len(key):].decode("ascii", "replace")
    return None


def proc_cmdline(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            data = f.read(4096)
    except OSError:
        return None
    return data.replace(b"\0", b" ").strip().decode("utf-8", "replace")


def all_pids():
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            out.append(int(name))
    return out


def process_tree(pids, root):
    """(stat of each live pid, the set of `root`'s descendants): one walk for both the reset
    and the per-call process sets."""
    info = {}
    for p in pids:
        st = proc_stat(p)
        if st is not None:
            info[p] = st
    children = collections.defaultdict(list)
    for p, st in info.items():
        children[st[0]].append(p)
    desc = set()
    stack = [root]
    while stack:
        for c in children.get(stack.pop(), ()):
            if c not in desc:
                desc.add(c)
                stack.append(c)
    return info, desc


def boot_ticks():
    """Now, in the clock ticks /proc/<pid>/stat counts process start times in (the kernel
    counts them from CLOCK_BOOTTIME, truncated to whole ticks)."""
    clock = getattr(time, "CLOCK_BOOTTIME", None)
    if clock is not None:
        try:
            return float(int(time.clock_gettime(clock) * _CLK_TCK))
        except OSError:
            pass
    try:
        with open("/proc/uptime") as f:
            return float(f.read().split()[0]) * _CLK_TCK
    except (OSError, ValueError, IndexError):
        return None


class Reaper:
    """We are PID 1 or a child subreaper, so orphans land on us: reap everything, keep the
    statuses of the pids we watch (the shells)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.watched = {}  # pid -> status or None while running
        self.procs = {}  # pid -> BgProc: spawned processes, given their status when reaped

    def watch(self, pid):
        with self.lock:
            self.watched[pid] = None

    def forget(self, pid):
        with self.lock:
            self.watched.pop(pid, None)

    def reap(self):
        with self.lock:
            while True:
                try:
                    pid, st = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    return
                except InterruptedError:
                    continue
                if pid == 0:
                    return
                if pid in self.watched:
                    self.watched[pid] = st
                bg = self.procs.pop(pid, None)
                if bg is not None:
                    bg.status = st

    def status(self, pid):
        self.reap()
        with self.lock:
            return self.watched.get(pid)


def exit_code_of(st):
    if os.WIFSIGNALED(st):
        return 128 + os.WTERMSIG(st)
    if os.WIFEXITED(st):
        return os.WEXITSTATUS(st)
    return -1


# ---------------------------------------------------------------- output and frames


class Capture:
    """Keeps at most `cap` bytes of output (head and tail) while the rest is drained."""

    def __init__(self, cap):
        self.hcap = cap // 2
        self.tcap = cap - self.hcap
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, data):
        n = len(data)
        if not n:
            return
        self.total += n
        if len(self.head) < self.hcap:
            take = self.hcap - len(self.head)
            self.head += data[:take]
            data = data[take:]
            n = len(data)
        if n and self.tcap:
            if n >= self.tcap:
                self.tail[:] = data[n - self.tcap:]
            else:
                self.tail += data
                extra = len(self.tail) - self.tcap
                if extra > 0:
                    del self.tail[:extra]

    @property
    def truncated(self):
        return self.total > len(self.head) + len(self.tail)

    def text(self):
        if not self.truncated:
            return (bytes(self.head) + bytes(self.tail)).decode("utf-8", "replace")
        omitted = self.total - len(self.head) - len(self.tail)
        return (bytes(self.head).decode("utf-8", "replace")
                + "\n[... execd: %d bytes omitted ...]\n" % omitted
                + bytes(self.tail).decode("utf-8", "replace"))


class Teed(object):
    """A Capture whose every byte also goes, as it is read, to a stream (ExecStream)."""

    def __init__(self, cap, stream):
        self.cap = cap
        self.stream = stream

    def add(self, data):
        self.cap.add(data)
        if len(data):
            self.stream.output(bytes(data))

    @property
    def total(self):
        return self.cap.total

    @property
    def truncated(self):
        return self.cap.truncated

    def text(self):
        return self.cap.text()


def parse_frame(buf, marker):
    """Strict exit-status frame: marker, kind (S status, E refused), decimal 0-255, newline.
    Returns ("need", None, None) while buf may still become a frame, ("ok", kind, status), or
    ("invalid", reason, None)."""
    m = len(marker)
    if len(buf) < m:
        if marker.startswith(bytes(buf)):
            return ("need", None, None)
        return ("invalid", "bytes that are not this call's marker", None)
    if not buf.startswith(marker):
        return ("invalid", "bytes that are not this call's marker", None)
    rest = bytes(buf[m:])
    if not rest:
        return ("need", None, None)
    kind = rest[:1]
    if kind not in (b"S", b"E"):
        return ("invalid", "unknown frame kind %r" % kind, None)
    nl = rest.find(b"\n")
    digits = rest[1:] if nl < 0 else rest[1:nl]
    if not all(48 <= c <= 57 for c in digits) or len(digits) > 3:
        return ("invalid", "status %r is not a decimal 0-255" % digits[:16], None)
    if nl < 0:
        return ("need", None, None)
    if not digits or (len(digits) > 1 and digits[:1] == b"0") or int(digits) > 255:
        return ("invalid", "status %r is not a decimal 0-255" % digits, None)
    if len(rest) > nl + 1:
        return ("invalid", "bytes after the frame", None)
    return ("ok", kind.decode(), int(digits))


def job_notices_only(diag):
    lines = [ln for ln in diag.splitlines() if ln.strip()]
    return bool(lines) and all(_JOB_NOTICE.match(ln) for ln in lines)


def fix_diag(text, offset):
    # bash numbers eval lines from our helper's definition; report lines of the command itself,
    # as `bash -c` would (offset calibrated at bootstrap with a command failing on line 1).
    out = []
    for ln in text.strip().splitlines():
        ln = _DIAG_PREFIX.sub("bash: line ", ln, count=1)
        out.append(_LINE_NO.sub(lambda m: "line %d" % max(1, int(m.group(1)) - offset), ln))
    return "\n".join(out)


# ---------------------------------------------------------------- the shell


class ShellDead(Exception):
    pass


class Shell:
    def __init__(self, daemon):
        self.d = daemon
        self.pid = None
        self.started = None
        self.fds = []

    def spawn(self, bash):
        d = self.d
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        st_r, st_w = os.pipe()
        dg_r, dg_w = os.pipe()
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (out_r, dg_r):
            try:
                fcntl.fcntl(fd, 1031, PIPE_SIZE)  # F_SETPIPE_SZ: fewer wakeups under floods
            except OSError:
                pass
        env = dict(d.base_env)
        env.pop(TAG_VAR, None)
        # Read by bash or the dynamic loader as the shell starts: the files they name may be
        # the previous holder's (a grading pod), so the shell starts without them and exports
        # them for its commands once it runs (below).
        startup = [(k, env.pop(k)) for k in SHELL_STARTUP_VARS if k in env]
        actions = [
            (os.POSIX_SPAWN_DUP2, devnull, 0),
            (os.POSIX_SPAWN_DUP2, out_w, 1),
            (os.POSIX_SPAWN_DUP2, out_w, 2),
            (os.POSIX_SPAWN_DUP2, st_w, STATUS_FD),
            (os.POSIX_SPAWN_DUP2, dg_r, DIAG_R_FD),
            (os.POSIX_SPAWN_DUP2, dg_w, DIAG_W_FD),
            (os.POSIX_SPAWN_DUP2, in_r, PROTO_FD),
        ]
        sigs = [signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM,
                signal.SIGHUP, signal.SIGCHLD, signal.SIGUSR1, signal.SIGUSR2]
        ready = b"@ready" + os.urandom(4).hex().encode()
        try:
            pid = os.posix_spawn(
                bash, [bash, "--noprofile", "--norc", "/dev/fd/%d" % PROTO_FD, ready.decode()],
                env, file_actions=actions, setsid=True, setsigdef=sigs, setsigmask=[])
        finally:
            for fd in (in_r, out_w, st_w, dg_w, devnull):
                os.close(fd)
        d.reaper.watch(pid)
        self.pid = pid
        self.in_w, self.out_r, self.st_r, self.diag_r = in_w, out_r, st_r, dg_r
        self.fds = [in_w, out_r, st_r, dg_r]
        for fd in (out_r, st_r, dg_r, in_w):
            os.set_blocking(fd, False)
        self.pidfd = None
        pidfd_open = getattr(os, "pidfd_open", None)
        if pidfd_open is not None:
            try:
                self.pidfd = pidfd_open(pid)
                self.fds.append(self.pidfd)
            except OSError:
                self.pidfd = None
        self.poller = select.poll()
        self.poller.register(out_r, select.POLLIN)
        self.poller.register(st_r, select.POLLIN)
        if self.pidfd is not None:
            self.poller.register(self.pidfd, select.POLLIN)
        self.pending_out = bytearray()
        self.buf = bytearray(READ_SIZE)
        self.started = now()
        script = BOOTSTRAP % {"diagr": DIAG_R_FD, "diagw": DIAG_W_FD, "st": STATUS_FD,
                              "proto": PROTO_FD, "tag": TAG_VAR}
        cwd = d.workspace or os.getcwd()
        exports = "".join("builtin export %s=%s\n" % (k, sh_quote(
            v.encode("utf-8", "surrogatepass")).decode("utf-8", "surrogatepass"))
            for k, v in startup)
        text = ("%sbuiltin cd -- %s 2>/dev/null\n%s\n" % (
            exports, sh_quote(cwd.encode()).decode(), script)).encode("utf-8", "surrogatepass")
        self.write_all(text, now() + 10)
        buf = bytearray()
        deadline = now() + 10
        while now() < deadline:
            self.poller.poll(50)
            buf += self.read_avail(self.st_r, 4096)
            self.pending_out += self.read_avail(self.out_r, 65536)
            if buf.endswith(b"\n"):
                break
            if self.dead():
                break
        if bytes(buf) != ready + b"R0\n":
            out = bytes(self.pending_out)[-2000:].decode("utf-8", "replace")
            self.kill()
            raise RuntimeError("bash did not start: %r %s" % (bytes(buf), out))
        self.pending_out = bytearray()
        m = _LINE_NO.search(self.read_diag())
        self.line_offset = int(m.group(1)) - 1 if m else 0

    def read_diag(self):
        out = bytearray()
        for _ in range(64):
            got = self.read_avail(self.diag_r, 65536)
            if not got:
                break
            out += got
        return bytes(out).decode("utf-8", "replace")

    def write_all(self, data, deadline):
        view = memoryview(data)
        while view:
            try:
                n = os.write(self.in_w, view[:65536])
            except BlockingIOError:
                n = 0
                time.sleep(0.001)
            except BrokenPipeError:
                raise ShellDead() from None
            view = view[n:]
            if now() > deadline:
                raise ShellDead()

    def read_avail(self, fd, size):
        try:
            return os.read(fd, size)
        except (BlockingIOError, InterruptedError):
            return b""
        except OSError:
            return b""

    def exit_status(self):
        return self.d.reaper.status(self.pid)

    def dead(self):
        return self.exit_status() is not None

    def kill(self):
        if self.pid is None:
            return
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        deadline = now() + 5
        while self.exit_status() is None and now() < deadline:
            time.sleep(0.005)
        self.close()

    def close(self):
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []
        if self.pid is not None:
            self.d.reaper.forget(self.pid)


# ---------------------------------------------------------------- readiness (/ready)


class ReadyCheck:
    """Is the pod still able to work: can it fork and exec a process, can it write and fsync a
    file where the agent works? /health only proves execd's HTTP thread runs; a pod whose pids
    limit is exhausted or whose disk is full also answers it (paper A44).

    One long-lived checker thread (started with execd, so the check works when no new thread
    can be created); concurrent callers share the in-flight check and a result is reused for
    READY_CACHE seconds, so the unauthenticated route cannot be used to amplify load. Never
    touches the agent's shell or the exec lock."""

    def __init__(self, daemon):
        self.d = daemon
        self.lock = threading.Lock()
        self.want = threading.Event()
        self.running = None  # Event set when the in-flight check finishes
        self.last = None  # (monotonic time done, result)
        self.pids = set()  # our probe processes: never a call's, never a reset's
        self.checks = 0
        threading.Thread(target=self._loop, name="ready-check", daemon=True).start()

    def get(self):
        with self.lock:
            if self.last is not None and now() - self.last[0] < READY_CACHE:
                return dict(self.last[1], age_s=round(now() - self.last[0], 3),
                            checks=self.checks)
            ev = self.running
            if ev is None:
                ev = self.running = threading.Event()
                self.want.set()
        if not ev.wait(READY_BUDGET):
            return {"ok": False, "error": "the readiness check did not finish within %gs (a "
                    "fork or an fsync hangs)" % READY_BUDGET}
        with self.lock:
            return dict(self.last[1], age_s=round(now() - self.last[0], 3), checks=self.checks)

    def _loop(self):
        while True:
            self.want.wait()
            self.want.clear()
            try:
                res = self.check()
            except Exception as e:  # noqa: BLE001 - a failed check, never a dead checker
                res = {"ok": False, "error": "readiness check failed: %r" % (e,)}
            with self.lock:
                self.last = (now(), res)
                ev, self.running = self.running, None
                self.checks += 1
            if ev is not None:
                ev.set()

    def check(self):
        t0 = now()
        err = self.check_fork(t0 + READY_BUDGET * 0.75)
        fork_ms = round((now() - t0) * 1000, 3)
        t1 = now()
        if err is None:
            err = self.check_disk()
        return {"ok": err is None, "error": err, "fork_ms": fork_ms,
                "disk_ms": round((now() - t1) * 1000, 3)}

    def check_fork(self, deadline):
        if self.d.retired:  # the shell binary may be the previous holder's: never run it
            return self.d.retired
        devnull = os.open(os.devnull, os.O_RDWR)
        try:
            actions = [(os.POSIX_SPAWN_DUP2, devnull, fd) for fd in (0, 1, 2)]
            # Spawned and recorded under the lock: a /diff that lists the processes in between
            # waits in own_pids() for the record instead of reporting the probe as "extra".
            with self.lock:
                # Watched under the reaper's lock: a reap between the spawn and the watch (a
                # /processes/wait reaps every few ms) would take the probe's status, and the
                # check would wait out its budget and fail.
                with self.d.reaper.lock:
                    pid = os.posix_spawn(self.d.bash, [self.d.bash, "--noprofile", "--norc",
                                                       "-c", ":"], {}, file_actions=actions,
                                         setsid=True)
                    self.d.reaper.watched[pid] = None
                self.pids.add(pid)
        except OSError as e:
            return "cannot fork and exec a process: %s" % (e.strerror or e)
        finally:
            os.close(devnull)
        try:
            while True:
                st = self.d.reaper.status(pid)
                if st is not None:
                    code = exit_code_of(st)
                    return None if code == 0 else "the probe process exited %d" % code
                if now() >= deadline:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    return "the probe process did not finish within %gs" % (
                        READY_BUDGET * 0.75)
                time.sleep(0.002)
        finally:
            self.d.reaper.forget(pid)
            with self.lock:
                self.pids.discard(pid)

    def check_disk(self):
        """Write, fsync and drop 4 KiB on the workspace's and the temp dir's filesystems. An
        unnamed O_TMPFILE where the filesystem has it (nothing appears in the directory), else a
        `.sandman-ready-*` file unlinked at once. A read-only filesystem or a directory our user
        may not write (EROFS, EACCES) is by design, not a fault; a full disk (ENOSPC, EDQUOT),
        an I/O error or an immutable directory (EPERM) is."""
        seen = set()
        # The shell's first cwd (the pod's workingDir without --workspace) and the temp dir.
        # (Not tempfile.gettempdir(): it probes by writing and caches a fallback dir.)
        tmp = self.d.base_env.get("TMPDIR") or "/tmp"
        for path in (self.d.workspace or os.getcwd(), tmp):
            if not path:
                continue
            try:
                dev = os.stat(path).st_dev
            except OSError as e:
                return "cannot stat %s: %s" % (path, e.strerror or e)
            if dev in seen:
                continue
            seen.add(dev)
            with self.d.probe_lock:  # the baseline walk never sees the named probe file
                err = write_probe_file(path)
            if err is not None:
                return err
        return None


def write_probe_file(path):
    data = b"\0" * 4096
    name = None
    flags = os.O_WRONLY | getattr(os, "O_CLOEXEC", 0)
    try:
        try:
            fd = os.open(path, flags | os.O_TMPFILE, 0o600)
        except (AttributeError, OSError) as e:
            if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS,
                                             errno.EACCES, errno.EPERM):
                raise
            name = os.path.join(path, "%s%d-%s" % (READY_PROBE_PREFIX, os.getpid(),
                                                    os.urandom(4).hex()))
            fd = os.open(name, flags | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
            if name is not None:
                os.unlink(name)
    except OSError as e:
        if e.errno in (errno.EROFS, errno.EACCES):
            return None
        return "cannot write and fsync a file in %s: %s" % (path, e.strerror or e)
    return None


# ---------------------------------------------------------------- the daemon


class Daemon:
    def __init__(self, args):
        self.args = args
        self.started = now()
        self.instance = os.environ.get(INSTANCE_ENV) or os.urandom(6).hex()
        self.bash = shutil.which("bash") or "/bin/bash"
        self.workspace = args.workspace
        self.root = os.path.realpath(args.root)
        self.netguard_status = args.netguard_status
        self.kill_grace = args.kill_grace
        self.base_env = dict(os.environ)
        for k in (EXECD_TOKEN_ENV, INSTANCE_ENV):
            self.base_env.pop(k, None)
        self.reaper = Reaper()
        self.subreaper = self._become_subreaper()
        self.exec_lock = threading.Lock()
        self.files_lock = threading.Lock()
        self.cache_lock = threading.Lock()
        self.cache = collections.OrderedDict()  # request_id -> [event, response]
        self.cache_max = 512
        self.cache_bytes = 0
        self.resetting = False
        self.calls = 0
        self.shell = None
        self.retired = None  # why this execd starts no shell any more (a failed restore)
        self.token_gen = 0  # bumped at each /token rotation (still_authorized)
        self.probe_lock = threading.Lock()  # /ready's named probe file vs the baseline walk
        self.umask = os.umask(0o022)
        os.umask(self.umask)
        self.ready = ReadyCheck(self)
        self.bg = Background(self)
        self.pty = Sessions(self)
        # Set once make_undumpable() ran (main starts it once execd listens); a token is
        # checked only after, so no holder's token is read into a dumpable execd.
        self.undumpable = threading.Event()
        self.start_shell()

    def make_undumpable(self):
        """Clear execd's dumpable flag: /proc/<execd>/mem, /fd and /environ are then closed to
        the sandbox's processes even under execd's own uid (a pod has no CAP_SYS_PTRACE), so a
        process the agent leaves behind cannot read a holder's bearer token out of execd's
        memory. Its children are dumpable again at their execve, as always. Off the start's
        path (ctypes costs start CPU under the pod's quota); without ctypes (python3-minimal)
        execd stays dumpable and says so."""
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE)")
        except (ImportError, OSError, AttributeError) as e:
            sys.stderr.write("execd: stays dumpable (%s): the sandbox's processes can read its "
                             "memory\n" % (e,))
        finally:
            self.undumpable.set()

    def _become_subreaper(self):
        if os.getpid() == 1:
            return "pid1"
        try:
            # Imported here: Debian's python3-minimal (a common task-image base) has no ctypes,
            # and as the pod's PID 1 execd never needs it.
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0:
                return "subreaper"
        except (ImportError, OSError, AttributeError):
            pass
        return None

    def start_shell(self, bash=None):
        if self.retired:
            raise HTTPError(503, "retired: %s" % self.retired, {"retired": True})
        sh = Shell(self)
        sh.spawn(bash or self.bash)
        self.shell = sh

    def restart_shell(self):
        if self.shell is not None:
            self.shell.kill()
        self.start_shell()

    # ------------------------------------------------------------ process sets

    def sandbox_pids(self):
        """Every process of the sandbox but execd: all of them when we are PID 1, else our
        descendants (orphans land on us as subreaper) and anything carrying our tag."""
        me = os.getpid()
        pids = all_pids()
        if me == 1:
            own = self.own_pids()
            return [p for p in pids if p != me and p not in own]
        info, out = process_tree(pids, me)
        prefix = self.instance + "-"
        for p in info:
            if p not in out and p != me:
                tag = proc_tag(p)
                if tag is not None and tag.startswith(prefix):
                    out.add(p)
        out.discard(me)
        return sorted(out - self.own_pids())

    def call_pids(self, tag, root, since_ticks):
        """The processes of one call: those carrying its tag anywhere, plus untagged processes
        started since the call began whose parent is the shell, execd or another process of the
        call. execd is PID 1 or a subreaper, so a child that left the session, dropped the tag
        (`env -i setsid -f ...`) and was orphaned is re-parented to execd and still found; forked
        subshells never exec, so carry no tag either. A process of an earlier call (its tag, or
        untagged and older than this call) is never entered: earlier background jobs and their
        children stay."""
        me = os.getpid()
        shell_pid = root if root != me else None
        info, _ = process_tree(all_pids(), -1)
        children = collections.defaultdict(list)
        for p, s in info.items():
            children[s[0]].append(p)
        skip = self.own_pids()
        tags = {}
        out = set()
        for p, s in info.items():
            if p == me or p == shell_pid or p in skip or s[1] == "Z":
                continue
            t = tags[p] = proc_tag(p)
            if t == tag:
                out.add(p)
        # Ancestry: from the shell and from execd (orphans), through this call's processes only.
        stack = [me] + ([shell_pid] if shell_pid is not None else [])
        seen = set(stack)
        while stack:
            for c in children.get(stack.pop(), ()):
                if c in seen or c == shell_pid or c in skip:
                    continue
                seen.add(c)
                s = info[c]
                t = tags.get(c)
                mine = t == tag or (t is None and (since_ticks is None or s[2] >= since_ticks))
                if not mine:
                    continue
                if s[1] != "Z":
                    out.add(c)
                stack.append(c)
        return out

    def own_pids(self):
        """execd's own helper processes (the readiness check's fork): never a call's."""
        with self.ready.lock:
            return set(self.ready.pids)

    def kill_pids(self, pids, sig):
        for p in pids:
            try:
                os.kill(p, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def kill_sandbox(self, keep=()):
        """SIGKILL every sandbox process (rounds, since they may fork meanwhile) and reap."""
        deadline = now() + 10
        while now() < deadline:
            pids = [p for p in self.sandbox_pids() if p not in keep]
            alive = []
            for p in pids:
                s = proc_stat(p)
                if s is not None and s[1] != "Z":
                    alive.append(p)
            self.reaper.reap()
            if not alive:
                if not [p for p in pids if proc_stat(p) is not None]:
                    return True
                time.sleep(0.005)
                continue
            self.kill_pids(alive, signal.SIGKILL)
            time.sleep(0.005)
        return False

    # ------------------------------------------------------------ exec

    def exec_args(self, req):
        """The checked (command bytes, timeout, max_output, idle_timeout) of an exec body."""
        cmd = req.get("command")
        if not isinstance(cmd, str):
            raise HTTPError(400, "command must be a string")
        timeout = req.get("timeout", DEFAULT_TIMEOUT)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (
                0 < timeout <= 7 * 86400):
            raise HTTPError(400, "timeout must be a number of seconds in (0, 604800]")
        idle = req.get("idle_timeout")
        if idle is not None and (isinstance(idle, bool) or not isinstance(idle, (int, float))
                                 or not 0 < idle <= 7 * 86400):
            raise HTTPError(400, "idle_timeout must be a number of seconds in (0, 604800]")
        max_output = req.get("max_output", DEFAULT_MAX_OUTPUT)
        if isinstance(max_output, bool) or not isinstance(max_output, int) or not (
                0 <= max_output <= MAX_OUTPUT_LIMIT):
            raise HTTPError(400, "max_output must be an integer in [0, %d]" % MAX_OUTPUT_LIMIT)
        try:
            data = cmd.encode("utf-8")
        except UnicodeEncodeError:
            raise HTTPError(400, "command is not valid unicode") from None
        if b"\0" in data:
            raise HTTPError(400, "command contains a NUL byte")
        return data, float(timeout), max_output, None if idle is None else float(idle)

    def exec_command(self, req):
        data, timeout, max_output, idle = self.exec_args(req)
        rid = req.get("request_id")
        if rid is not None and (not isinstance(rid, str) or not rid or len(rid) > 256):
            raise HTTPError(400, "request_id must be a non-empty string of at most 256 chars")
        entry = None
        if rid is not None:
            with self.cache_lock:
                entry = self.cache.get(rid)
                if entry is None:
                    entry = [threading.Event(), None]
                    self.cache[rid] = entry
                    fresh = True
                else:
                    fresh = False
            if not fresh:
                # A retry: the stored answer, or wait for the first attempt's.
                if not entry[1] and not entry[0].wait(timeout + 60):
                    raise HTTPError(504, "the first attempt of this request_id is still running")
                if entry[1] is None:
                    raise HTTPError(409, "busy")
                return entry[1]
        if not self.exec_lock.acquire(False):
            if entry is not None:
                with self.cache_lock:
                    self.cache.pop(rid, None)
                entry[0].set()
            raise HTTPError(409, "busy", {"busy": True})
        try:
            still_authorized(self)
            resp = self._run_checked(data, timeout, max_output, idle)
        except BaseException:
            if entry is not None:
                with self.cache_lock:
                    self.cache.pop(rid, None)
                entry[0].set()
            raise
        finally:
            self.exec_lock.release()
        if entry is not None:
            entry[1] = resp
            entry[0].set()
            with self.cache_lock:
                # Bounded in count and in bytes: stored outputs must not grow execd's RSS.
                self.cache_bytes += len(resp["output"])
                while len(self.cache) > self.cache_max or self.cache_bytes > CACHE_BYTES:
                    k, e = next(iter(self.cache.items()))
                    if e[1] is None:
                        break
                    self.cache.pop(k)
                    self.cache_bytes -= len(e[1]["output"])
        return resp

    def _run_checked(self, data, timeout, max_output, idle=None, stream=None):
        r = self._run(data, timeout, max_output, idle, stream)
        notices = r.pop("notices", None)
        if notices is not None:
            # Only a job notice (a job died between the flush and the check) reached the check:
            # nothing ran, so run the command again, once, with the notice as output.
            if stream is not None:
                stream.output(notices.encode("utf-8", "replace") + b"\n")
            r = self._run(data, timeout, max_output, idle, stream)
            r.pop("notices", None)
            r["output"] = notices + "\n" + r["output"]
        return r

    def stream_command(self, req, stream):
        """An exec whose output also goes to `stream` as it is read (ExecStream); the answer
        is /exec's. One command at a time with /exec (409 busy)."""
        data, timeout, max_output, idle = self.exec_args(req)
        if req.get("request_id") is not None:
            raise HTTPError(400, "request_id is for /exec: a stream is never replayed")
        kill = req.get("kill_on_disconnect", False)
        if not isinstance(kill, bool):
            raise HTTPError(400, "kill_on_disconnect must be true or false")
        stream.kill_on_disconnect = kill
        if not self.exec_lock.acquire(False):
            raise HTTPError(409, "busy", {"busy": True})
        try:
            still_authorized(self)
            stream.begin()
            return self._run_checked(data, timeout, max_output, idle, stream)
        finally:
            self.exec_lock.release()

    def _ensure_shell(self):
        sh = self.shell
        if sh is None or sh.dead():
            st = sh.exit_status() if sh is not None else None
            if sh is not None:
                sh.close()
            self.start_shell()
            if st is not None:
                return ("the shell had exited (status %d) since the last call; a new shell was "
                        "started, state lost" % exit_code_of(st))
        return None

    def _run(self, data, timeout, max_output, idle=None, stream=None):
        t0 = now()
        # A process started in this tick or later may be the call's (10 ms ticks).
        since0 = boot_ticks()
        notice = self._ensure_shell()
        sh = self.shell
        self.calls += 1
        tag = "%s-%d" % (self.instance, self.calls)
        marker = ("@" + os.urandom(8).hex()).encode()
        cap = Capture(max_output)
        if stream is not None:
            cap = Teed(cap, stream)
        if sh.pending_out:
            cap.add(sh.pending_out)
            sh.pending_out = bytearray()
        # Late bytes on the status and diagnostic pipes belong to no call: drop them.
        for _ in range(64):
            if not sh.read_avail(sh.st_r, 65536):
                break
        sh.read_diag()
        line = b"".join((
            b"__sm_m=", marker, b"; ", TAG_VAR.encode(), b"=", tag.encode(),
            b"; __sm_c=", sh_quote(data),
            b"; __sm_chk && builtin eval \"$__sm_c\"; __sm_fin $?\n"))
        since = None  # in /proc start-time ticks; needed only on a timeout
        result = {"exit_code": None, "output": "", "truncated": False, "duration_ms": 0.0,
                  "error": None}
        status = bytearray()
        frame = None
        errors = []
        deadline = t0 + timeout
        ended = None  # why the command was killed: "timeout", "idle" or "disconnect"
        seen = cap.total  # output bytes read so far; more of them push the idle deadline
        idle_at = t0 + idle if idle else None
        phase = "run"  # run -> term -> kill -> wait for the frame, then restart
        phase_at = 0.0
        dead_st = None
        buf = sh.buf
        bufview = memoryview(buf)
        inview = memoryview(line)
        # With a pidfd, shell death wakes the poll; without one (python 3.8) we look every 50 ms.
        poll_s = 0.05 if sh.pidfd is None else 1.0
        last_look = t0
        while True:
            if inview:
                try:
                    n = os.write(sh.in_w, inview[:65536])
                    inview = inview[n:]
                except BlockingIOError:
                    pass
                except OSError:
                    inview = inview[:0]
            t = now()
            if phase == "run":
                wake = deadline if idle_at is None else min(deadline, idle_at)
                if stream is not None and stream.kill_on_disconnect:
                    wake = min(wake, last_look + 0.05)
            elif phase == "term":
                wake = min(phase_at + self.kill_grace, last_look + 0.05)
            else:
                wake = phase_at + 1.0
            wait = 0.001 if inview else min(poll_s, max(0.0, wake - t))
            events = sh.poller.poll(int(wait * 1000) + (1 if wait > 0 else 0))
            for fd, _ev in events:
                if fd == sh.out_r:
                    self._drain(sh, cap, buf, bufview, 64)
                elif fd == sh.st_r:
                    got = sh.read_avail(sh.st_r, self.args.status_read_size)
                    if got:
                        status += got
                        frame = parse_frame(status, marker)
            if frame is not None and frame[0] != "need":
                break
            t = now()
            if idle_at is not None and cap.total != seen:
                seen, idle_at = cap.total, t + idle
            if not events or t - last_look >= 0.05 or any(fd == sh.pidfd for fd, _ in events):
                if sh.dead():
                    dead_st = sh.exit_status()
                    break
            if phase == "run":
                if t >= deadline:
                    ended = "timeout"
                elif idle_at is not None and t >= idle_at:
                    ended = "idle"
                elif stream is not None and t - last_look >= 0.05 and stream.abandoned():
                    ended = "disconnect"
            if phase == "run" and ended is not None:
                phase, phase_at, last_look = "term", t, t
                since = since0
                self.kill_pids(self.call_pids(tag, sh.pid, since), signal.SIGTERM)
            elif phase == "term" and (t >= phase_at + self.kill_grace or (
                    t - last_look >= 0.05 and not self.call_pids(tag, sh.pid, since))):
                phase, phase_at = "kill", t
                self._kill_call(tag, sh.pid, since)
            elif phase == "kill" and t >= phase_at + 1.0:
                break
            if t - last_look >= 0.05:
                last_look = t
        timed_out = phase != "run"
        if frame is not None and frame[0] == "ok" and timed_out and phase == "term":
            # The command ended on SIGTERM; its leftovers still go.
            self._kill_call(tag, sh.pid, since)
        self._drain(sh, cap, buf, bufview, PIPE_SIZE // READ_SIZE + 1)
        result["output"] = cap.text()
        result["truncated"] = cap.truncated
        if dead_st is not None:
            code = exit_code_of(dead_st)
            # Its children are ours now (subreaper): the call's, tagged or started since, go.
            since = since0
            self._kill_call(tag, os.getpid(), since)
            result["exit_code"] = code
            msg = "shell exited (status %d); a new shell was started, state lost" % code
            if frame is not None and status:
                msg = "incomplete frame: " + msg
            if self.resetting:
                msg += " (reset)"
            errors.append(msg)
            sh.close()
            if not self.resetting:
                self.start_shell()
        elif frame is None or frame[0] != "ok":
            why = frame[1] if frame is not None and frame[0] == "invalid" else None
            if why is not None:
                errors.append("invalid frame (%s); the shell was restarted, state lost" % why)
            elif status:
                errors.append("incomplete frame; the shell was restarted, state lost")
            else:
                errors.append("no exit status after the kill; the shell was restarted, state "
                              "lost")
            self._kill_call(tag, sh.pid, since)
            result["exit_code"] = 124 if timed_out else -1
            self.restart_shell()
        elif frame[1] == "E":
            result["exit_code"] = 2
            diag = fix_diag(sh.read_diag(), sh.line_offset)
            if not diag:
                # The check's own plumbing failed (say, fd 61 closed): a fresh shell fixes it.
                diag = "the syntax check failed without a diagnosis; the shell was restarted"
                self.restart_shell()
            elif job_notices_only(diag):
                result["notices"] = diag
            errors.append(diag)
        else:
            result["exit_code"] = 124 if timed_out else frame[2]
        if ended == "timeout":
            errors.insert(0, "timeout after %gs; the command's processes were killed" % timeout)
        elif ended == "idle":
            # "timeout" first: the SDK reads an execd timeout as exit 124 with that prefix.
            errors.insert(0, "timeout: no output for %gs (idle_timeout); the command's "
                             "processes were killed" % idle)
        elif ended == "disconnect":
            errors.insert(0, "the stream's client went away (kill_on_disconnect); the "
                             "command's processes were killed")
        if notice:
            errors.append(notice)
        result["error"] = "; ".join(errors) if errors else None
        result["duration_ms"] = round((now() - t0) * 1000.0, 3)
        return result

    def _drain(self, sh, cap, buf, bufview, max_reads):
        for _ in range(max_reads):
            try:
                n = os.readv(sh.out_r, [buf])
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            if n <= 0:
                return
            cap.add(bufview[:n])
            if n < len(buf):
                return

    def _kill_call(self, tag, root, since):
        for _ in range(20):
            pids = self.call_pids(tag, root, since)
            if not pids:
                return
            self.kill_pids(pids, signal.SIGKILL)
            time.sleep(0.005)
            self.reaper.reap()

    # ------------------------------------------------------------ internal shell calls

    def internal(self, script, timeout=30.0):
        """Run our own (trusted, checked) bash at the shell's top level; stdout bytes."""
        if not self.exec_lock.acquire(False):
            raise HTTPError(409, "busy", {"busy": True})
        if not isinstance(script, bytes):
            script = script.encode("utf-8")
        try:
            r = self._run_checked(script, timeout, MAX_OUTPUT_LIMIT)
        finally:
            self.exec_lock.release()
        if r["exit_code"] != 0 or r["error"]:
            raise HTTPError(500, "shell call failed: %s" % (r["error"] or r["exit_code"]))
        return r["output"]

    def set_env(self, req):
        still_authorized(self)
        sets = req.get("set", {})
        unsets = req.get("unset", [])
        if not isinstance(sets, dict) or not isinstance(unsets, list):
            raise HTTPError(400, "set must be an object and unset a list")
        parts = []
        for k, v in sets.items():
            if not _ENV_NAME.match(k) or k.startswith("__sm_") or k == TAG_VAR:
                raise HTTPError(400, "invalid variable name %r" % k[:100])
            if not isinstance(v, str) or "\0" in v:
                raise HTTPError(400, "value of %s must be a string without NUL" % k)
            parts.append("export %s=%s" % (k, sh_quote(v.encode("utf-8", "surrogatepass"))
                                           .decode("utf-8", "surrogatepass")))
        for k in unsets:
            if not isinstance(k, str) or not _ENV_NAME.match(k) or k.startswith("__sm_"):
                raise HTTPError(400, "invalid variable name %r" % (str(k)[:100],))
            parts.append("unset -v %s" % k)
        parts.append("while IFS= read -r __sm_e; do builtin printf '%s=%s\\0' \"$__sm_e\" "
                     "\"${!__sm_e}\"; done < <(compgen -e); unset -v __sm_e")
        try:
            out = self.internal("\n".join(parts))
        except UnicodeEncodeError:
            raise HTTPError(400, "values must be valid unicode") from None
        # Later shells (after a crash, timeout or reset) start with the same environment.
        for k, v in sets.items():
            self.base_env[k] = v
        for k in unsets:
            self.base_env.pop(k, None)
        env = {}
        for item in out.split("\0"):
            if "=" in item:
                k, v = item.split("=", 1)
                if k != TAG_VAR:
                    env[k] = v
        return {"env": env}

    def reset(self, req):
        still_authorized(self)
        wipe = req.get("workspace", False)
        if not isinstance(wipe, bool):
            raise HTTPError(400, "workspace must be a boolean")
        if wipe and not self.workspace:
            raise HTTPError(400, "no workspace configured (--workspace); nothing to wipe")
        t0 = now()
        self.resetting = True
        try:
            with self.bg.lock, self.pty.lock:
                pass  # a spawn or open under way ends first; later ones see `resetting`
            self.kill_sandbox()
            if not self.exec_lock.acquire(True, 30):
                raise HTTPError(503, "a command did not stop for the reset")
            try:
                if self.shell is not None:
                    self.shell.close()
                    self.shell = None
                clean = self.kill_sandbox()
                self.bg.reset()
                self.pty.reset()
                wiped = None
                if wipe:
                    wiped = self._wipe(self.workspace)
                self.reaper.reap()
                self.start_shell()
                left = [p for p in self.sandbox_pids() if p != self.shell.pid]
            finally:
                self.exec_lock.release()
        finally:
            self.resetting = False
        with self.cache_lock:
            self.cache.clear()
            self.cache_bytes = 0
        return {"ok": clean and not left, "left": left, "shell_pid": self.shell.pid,
                "workspace_wiped": wiped, "duration_ms": round((now() - t0) * 1000, 3)}

    def _wipe(self, path):
        """Empties the workspace (the path as configured; below it, never through a symlink):
        any depth, within REMOVE_MAX_S. Returns how many entries it held."""
        deadline = now() + REMOVE_MAX_S
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
        try:
            names = os.listdir(fd)
            for name in names:
                remove_tree(fd, name, deadline)
        finally:
            os.close(fd)
        return len(names)

    # ------------------------------------------------------------ state and conditions

    def state(self):
        sh = self.shell
        cwd = None
        if sh is not None:
            try:
                cwd = os.readlink("/proc/%d/cwd" % sh.pid)
            except OSError:
                cwd = None
        procs = []
        for p in self.sandbox_pids():
            s = proc_stat(p)
            if s is None:
                continue
            procs.append({"pid": p, "ppid": s[0], "state": s[1], "cmd": proc_cmdline(p),
                          "shell": sh is not None and p == sh.pid})
        return {"version": VERSION, "pid": os.getpid(),
                "shell_pid": sh.pid if sh is not None else None, "cwd": cwd,
                "busy": self.exec_lock.locked(), "processes": procs,
                "reaper": self.subreaper, "guard": self.guard_status(),
                "uptime_s": round(now() - self.started, 3),
                "shell_uptime_s": round(now() - sh.started, 3) if sh is not None else None}

    def guard_status(self):
        try:
            with open(self.netguard_status, "rb") as f:
                raw = f.read(1 << 20)
        except FileNotFoundError:
            return None
        except OSError as e:
            return {"error": "unreadable: %s" % e.strerror}
        import json  # here, not at start (the imports at the top say why)

        try:
            return json.loads(raw.decode("utf-8"))
        except ValueError:
            return {"error": "unreadable: not JSON"}

    def conditions(self, query):
        root = getattr(self.args, "conditions_root", "/") or "/"
        sh = self.shell
        out = {}
        out.update(cpu_limits(root))
        out.update(visible_cpus(root, sh.pid if sh is not None else None))
        out.update(memory_limit(root))
        out.update(user_info(root))
        out["tz_env"] = self.base_env.get("TZ")
        out.update(time_zone(root, out["tz_env"]))
        # Unset means Python picks a random seed per process: that is a reading too (None).
        out["pythonhashseed"] = self.base_env.get("PYTHONHASHSEED")
        try:
            out["hostname"] = socket.gethostname()
        except OSError:
            out["hostname"] = None
        g = self.guard_status()
        out["netguard_mode"] = (g.get("mode") if isinstance(g, dict) and g.get("ok") is True
                                and isinstance(g.get("mode"), str) else None)
        out["netguard_allow_egress"] = guard_allowlist(g)
        probe = query.get("egress_probe")
        out["egress"] = egress_probe(probe[-1]) if probe else None
        return out


# ---------------------------------------------------------------- conditions readers
# Every reader takes `root`, the directory that stands for "/" (a test builds real cgroup v1
# and v2 trees under a temp dir; execd's --conditions-root). Reported paths are as seen from
# inside the sandbox, without the root.


def _at(root, path):
    return os.path.join(root, path.lstrip("/")) if root not in ("", "/") else path


def _read_first(path):
    try:
        with open(path) as f:
            return f.read(4096).strip()
    except OSError:
        return None


def _unescape_mount(s):
    # mountinfo escapes space, tab, newline and backslash as octal.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), s)


def _cgroup_mounts(root):
    """(version, mount root, mount point, controllers) for every cgroup mount in mountinfo."""
    out = []
    try:
        with open(_at(root, "/proc/self/mountinfo")) as f:
            lines = f.read().splitlines()
    except OSError:
        return out
    for ln in lines:
        left, sep, right = ln.partition(" - ")
        a, b = left.split(), right.split()
        if not sep or len(a) < 5 or len(b) < 3:
            continue
        if b[0] == "cgroup2":
            out.append((2, _unescape_mount(a[3]), _unescape_mount(a[4]), None))
        elif b[0] == "cgroup":
            out.append((1, _unescape_mount(a[3]), _unescape_mount(a[4]),
                        set(b[2].split(","))))
    return out


def _within(mount_root, cg_path):
    """cg_path relative to the mount's root, or None when the mount does not show it."""
    mr = mount_root.rstrip("/")
    if cg_path == mr or mr == "":
        rel = cg_path[len(mr):]
    elif cg_path.startswith(mr + "/"):
        rel = cg_path[len(mr):]
    else:
        return None
    return rel.strip("/")


def _cgroup_dirs(controller, root="/"):
    """The cgroup directories that bound `controller` for this process: (version, [dirs]),
    own cgroup first, then each ancestor up to the top of what is mounted (a container sees
    its own subtree only). (None, []) when there is no such hierarchy.

    The hierarchy is the v1 one listing the controller in /proc/self/cgroup, else the v2 one
    when its cgroup.controllers offers the controller (a hybrid host has a v2 hierarchy
    without controllers beside v1)."""
    try:
        with open(_at(root, "/proc/self/cgroup")) as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    v1 = v2 = None
    for ln in lines:
        parts = ln.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif controller in parts[1].split(","):
            v1 = (parts[1], parts[2])
    mounts = _cgroup_mounts(root)
    if v1 is not None:
        names, path = v1
        want = set(names.split(","))
        for ver, mroot, mpoint, opts in mounts:
            if ver == 1 and want <= opts:
                rel = _within(mroot, path)
                return 1, _ancestors(mpoint, rel)
        # No mountinfo: the usual places, the full path first, then the mount's top.
        for mpoint in ("/sys/fs/cgroup/" + names, "/sys/fs/cgroup/" + controller):
            if os.path.isdir(_at(root, mpoint)):
                d = mpoint + "/" + path.strip("/")
                return 1, ([d.rstrip("/")] if os.path.isdir(_at(root, d)) else []) + [mpoint]
        return None, []
    if v2 is not None:
        v2m = [(mr, mp) for ver, mr, mp, _ in mounts if ver == 2]
        mroot, mpoint = v2m[0] if v2m else ("/", "/sys/fs/cgroup")
        top = _read_first(_at(root, mpoint + "/cgroup.controllers"))
        if top is None or controller not in top.split():
            return None, []
        return 2, _ancestors(mpoint, _within(mroot, v2))
    return None, []


def _ancestors(mpoint, rel):
    mpoint = mpoint.rstrip("/") or "/"
    if rel is None:  # the cgroup lies outside what is mounted: only the top is readable
        return [mpoint]
    out = []
    parts = [p for p in rel.split("/") if p]
    while parts:
        out.append(mpoint.rstrip("/") + "/" + "/".join(parts))
        parts.pop()
    out.append(mpoint)
    return out


def cpu_limits(root="/"):
    """The effective CPU quota: the smallest quota/period (in cores) of the own cgroup and
    its ancestors (a quota at the pod level bounds the container even if its own is `max`).
    `cpu_quota_us`/`cpu_period_us` are that level's, `cpu_source` its file."""
    res = {"cpu_quota_us": None, "cpu_period_us": None, "cpu_unlimited": None,
           "cpu_cores": None, "cpu_source": None}
    ver, dirs = _cgroup_dirs("cpu", root)
    best = None  # (cores, quota, period, source)
    seen = False
    for d in dirs:
        if ver == 2:
            src = d + "/cpu.max"
            v = _read_first(_at(root, src))
            if v is None:
                continue
            parts = v.split()
            try:
                period = int(parts[1])
                quota = None if parts[0] == "max" else int(parts[0])
            except (IndexError, ValueError):
                continue
        else:
            src = d + "/cpu.cfs_quota_us"
            q = _read_first(_at(root, src))
            p = _read_first(_at(root, d + "/cpu.cfs_period_us"))
            if q is None or p is None:
                continue
            try:
                quota, period = int(q), int(p)
            except ValueError:
                continue
            if quota < 0:
                quota = None
        if period <= 0:
            continue
        seen = True
        if quota is not None:
            cores = quota / period
            if best is None or cores < best[0]:
                best = (cores, quota, period, src)
        elif res["cpu_source"] is None:
            res["cpu_period_us"], res["cpu_source"] = period, src
    if best is not None:
        res.update(cpu_quota_us=best[1], cpu_period_us=best[2], cpu_unlimited=False,
                   cpu_cores=round(best[0], 6), cpu_source=best[3])
    elif seen:
        res["cpu_unlimited"] = True
    return res


def parse_cpu_list(text):
    """"0-3,8,10-11" -> [0, 1, 2, 3, 8, 10, 11]; None if malformed (empty is [])."""
    out = set()
    if text is None:
        return None
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        try:
            lo = int(lo)
            hi = int(hi) if hi else lo
        except ValueError:
            return None
        if hi < lo or hi - lo > 65536:
            return None
        out.update(range(lo, hi + 1))
    return sorted(out)


def cpuset(root="/"):
    """The effective cpuset: the first `cpuset.cpus.effective` (v2) or `cpuset.effective_cpus`
    / `cpuset.cpus` (v1) found from the own cgroup up."""
    ver, dirs = _cgroup_dirs("cpuset", root)
    names = (("cpuset.cpus.effective",) if ver == 2
             else ("cpuset.effective_cpus", "cpuset.cpus"))
    for d in dirs:
        for n in names:
            cpus = parse_cpu_list(_read_first(_at(root, d + "/" + n)))
            if cpus:
                return cpus, d + "/" + n
    return None, None


def visible_cpus(root="/", pid=None):
    """The CPUs a test can run on: the affinity of the process the tests are started from
    (the persistent shell: every command inherits its pinning), within the cgroup cpuset."""
    aff, src = None, None
    for p in ((pid, 0) if pid else (0,)):
        try:
            aff = sorted(os.sched_getaffinity(p))
            src = "sched_getaffinity(%s)" % ("shell" if p else "execd")
            break
        except (AttributeError, OSError):
            continue
    cs, cs_src = cpuset(root)
    vis = aff
    if aff is not None and cs is not None:
        vis = sorted(set(aff) & set(cs))
        src = src + " & " + cs_src
    elif aff is None and cs is not None:
        vis, src = cs, cs_src
    return {"visible_cpus": vis, "visible_cpu_count": len(vis) if vis is not None else None,
            "affinity_cpus": aff, "cpuset_cpus": cs, "visible_cpus_source": src}


def memory_limit(root="/"):
    """The effective memory limit: the smallest limit of the own cgroup and its ancestors."""
    res = {"memory_limit_bytes": None, "memory_unlimited": None, "memory_source": None}
    ver, dirs = _cgroup_dirs("memory", root)
    name = "/memory.max" if ver == 2 else "/memory.limit_in_bytes"
    best = None
    seen = None  # the first file read, named when every level is unlimited
    for d in dirs:
        v = _read_first(_at(root, d + name))
        if v is None:
            continue
        if v == "max":
            seen = seen or d + name
            continue
        try:
            n = int(v)
        except ValueError:
            continue
        seen = seen or d + name
        if ver == 1 and n >= (1 << 62):  # v1 writes "unlimited" as a huge number
            continue
        if best is None or n < best[0]:
            best = (n, d + name)
    if best is not None:
        res.update(memory_limit_bytes=best[0], memory_unlimited=False, memory_source=best[1])
    elif seen:
        res.update(memory_unlimited=True, memory_source=seen)
    return res


def user_info(root="/"):
    uid, gid = os.getuid(), os.getgid()
    user = None
    if root in ("", "/"):
        try:
            user = pwd.getpwuid(uid).pw_name
        except KeyError:
            user = None
    else:
        try:
            with open(_at(root, "/etc/passwd")) as f:
                for ln in f.read().splitlines():
                    p = ln.split(":")
                    if len(p) >= 3 and p[2] == str(uid):
                        user = p[0]
                        break
        except OSError:
            user = None
    return {"uid": uid, "gid": gid, "user": user}


_TZ_UTC = ("UTC", "Etc/UTC", "UCT", "Etc/UCT", "Universal", "Etc/Universal", "Zulu",
           "Etc/Zulu", "GMT", "Etc/GMT", "GMT0", "Etc/GMT0", "GMT+0", "Etc/GMT+0", "GMT-0",
           "Etc/GMT-0", "Greenwich", "Etc/Greenwich", "UTC0")


def local_zone(root="/"):
    """The zone name /etc/localtime stands for: its symlink target under zoneinfo/, else
    /etc/timezone; None when neither names one."""
    try:
        target = os.readlink(_at(root, "/etc/localtime"))
        if "zoneinfo/" in target:
            return target.split("zoneinfo/", 1)[1]
    except OSError:
        pass
    v = _read_first(_at(root, "/etc/timezone"))
    return v or None


def time_zone(root="/", tz_env=None):
    """The zone programs use: TZ when set, else /etc/localtime (glibc reads UTC when the
    file is absent). `tz` is None when neither can be named."""
    lt = local_zone(root)
    if tz_env is not None:
        tz, src = tz_env[1:] if tz_env.startswith(":") else tz_env, "TZ"
    elif lt is not None:
        tz, src = lt, "/etc/localtime"
    elif not os.path.lexists(_at(root, "/etc/localtime")):
        tz, src = "UTC", "no /etc/localtime"
    else:
        tz, src = None, None
    if tz is not None and tz.startswith(("posix/", "right/")):
        tz = tz.split("/", 1)[1]
    return {"localtime": lt, "tz": tz, "tz_utc": (tz in _TZ_UTC) if tz is not None else None,
            "tz_source": src}


def guard_allowlist(g):
    # The entries netguard applied (its status's options), as it recorded them; None when the
    # status is missing, failed or not of that form (the reading is then unverified).
    if not isinstance(g, dict) or g.get("ok") is not True:
        return None
    allow = (g.get("options") or {}).get("allow_egress") if isinstance(g.get("options"),
                                                                      dict) else None
    if not isinstance(allow, list) or not all(isinstance(x, str) for x in allow):
        return None
    return allow


def egress_probe(target):
    # [0-9], not \d: \d and int() read other scripts' digits as a port.
    m = re.fullmatch(r"\[([0-9a-fA-F:.]+)\]:([0-9]{1,5})", target) or re.fullmatch(
        r"([A-Za-z0-9.\-]{1,253}):([0-9]{1,5})", target)
    if not m or not (0 < int(m.group(2)) < 65536):
        raise HTTPError(400, "egress_probe must be host:port or [v6]:port")
    host, port = m.group(1), int(m.group(2))
    t0 = now()
    try:
        with socket.create_connection((host, port), timeout=2.0):
            pass
        ok, err = True, None
    except socket.timeout:
        ok, err = False, "timeout"
    except OSError as e:
        ok, err = False, e.strerror or str(e)
    return {"target": target, "open": ok, "error": err,
            "duration_ms": round((now() - t0) * 1000, 3)}


# ---------------------------------------------------------------- files


def resolve_path(d, path, for_write=False):
    if not isinstance(path, str) or not path:
        raise HTTPError(400, "path must be a non-empty string")
    if "\0" in path:
        raise HTTPError(400, "path contains a NUL byte")
    if not os.path.isabs(path):
        base = None
        if d.shell is not None:
            try:
                base = os.readlink("/proc/%d/cwd" % d.shell.pid)
            except OSError:
                base = None
        path = os.path.join(base or os.getcwd(), path)
    real = os.path.realpath(path)
    root = d.root
    if root != "/" and real != root and not real.startswith(root + "/"):
        raise HTTPError(403, "path is outside the filesystem root %s" % root, {"path": real})
    return real


def open_regular(real):
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise HTTPError(404, "no such file", {"path": real}) from None
    except IsADirectoryError:
        raise HTTPError(400, "not a regular file (directory)", {"path": real}) from None
    except PermissionError:
        raise HTTPError(403, "permission denied", {"path": real}) from None
    except OSError as e:
        raise HTTPError(400, "cannot open: %s" % (e.strerror or e), {"path": real}) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise HTTPError(400, "not a regular file (%s)" % file_kind(st.st_mode), {"path": real})
    os.set_blocking(fd, True)
    return fd, st


def file_kind(mode):
    for test, name in ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "fifo"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISSOCK, "socket"), (stat.S_ISLNK, "symlink")):
        if test(mode):
            return name
    return "unknown"


def file_sha256(real):
    try:
        fd, st = open_regular(real)
    except HTTPError as e:
        if e.code == 404:
            return None
        raise
    h = sha256()
    left = st.st_size  # bounded even if a writer keeps appending
    try:
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            h.update(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    return h.hexdigest()


def write_file(d, req):
    real = resolve_path(d, req.get("path"), for_write=True)
    b64 = req.get("data_b64")
    if not isinstance(b64, str):
        raise HTTPError(400, "data_b64 must be a base64 string")
    try:
        data = base64.b64decode(b64.encode("ascii"), validate=True)
    except (binascii.Error, ValueError, UnicodeEncodeError):
        raise HTTPError(400, "data_b64 is not valid base64") from None
    mode = req.get("mode")
    if mode is not None:
        if isinstance(mode, str) and re.fullmatch(r"0?o?[0-7]{1,4}", mode):
            mode = int(mode.replace("o", ""), 8)
        if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o7777:
            raise HTTPError(400, "mode must be an integer 0-4095 or an octal string")
    want = req.get("if_sha256")
    if want is not None and (not isinstance(want, str) or not _SHA256_HEX.match(want.lower())):
        raise HTTPError(400, "if_sha256 must be a SHA-256 hex digest")
    with d.files_lock:
        still_authorized(d)
        try:
            st = os.stat(real)
        except FileNotFoundError:
            st = None
        except OSError as e:
            raise HTTPError(400, "cannot stat: %s" % e.strerror, {"path": real}) from None
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise HTTPError(400, "not a regular file (%s)" % file_kind(st.st_mode),
                            {"path": real})
        if want is not None:
            cur = file_sha256(real) if st is not None else None
            if cur != want.lower():
                raise HTTPError(409, "file changed: its SHA-256 differs from if_sha256",
                                {"path": real, "sha256": cur})
        parent = os.path.dirname(real)
        if not os.path.isdir(parent):
            raise HTTPError(404, "parent directory does not exist", {"path": real})
        import tempfile  # here, not at start (the imports at the top say why)

        try:
            fd, tmp = tempfile.mkstemp(prefix=".execd-", dir=parent)
        except OSError as e:
            raise HTTPError(403 if e.errno in (errno.EACCES, errno.EROFS) else 400,
                            "cannot create a file in %s: %s" % (parent, e.strerror)) from None
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if st is not None:
                if (st.st_uid, st.st_gid) != (os.getuid(), os.getgid()):
                    try:
                        os.fchown(fd, st.st_uid, st.st_gid)
                    except OSError:
                        pass
                os.fchmod(fd, stat.S_IMODE(st.st_mode) if mode is None else mode)
            else:
                os.fchmod(fd, (0o666 & ~d.umask) if mode is None else mode)
            os.close(fd)
            fd = -1
            os.replace(tmp, real)
        except OSError as e:
            if fd >= 0:
                os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise HTTPError(400, "write failed: %s" % (e.strerror or e), {"path": real}) from None
    return {"path": real, "size": len(data), "sha256": sha256(data).hexdigest()}


# ---------------------------------------------------------------- trees
# POST /files/tree/write?path=DIR takes a tar (Content-Length, X-Content-SHA256 of the body);
# GET /files/tree?path=DIR answers one (chunked: the tar, then the 64 hex digits of its SHA-256).
# A tree comes from outside (a trainer's files, or an archive someone crafted): every member is
# checked by hand, since tarfile's extraction filters need Python 3.12 or a backport.

TREE_MAX_BYTES = 1 << 30  # whole archive; --max-tree-bytes
TREE_SHA256_HEADER = "X-Content-SHA256"  # the upload's digest
TREE_DIGEST_LEN = 64  # the download's trailer: SHA-256 hex of the tar before it
TREE_STAGING_PREFIX = ".execd-tree-"
TREE_LINK_HOPS = 40  # symlinks followed while checking where one leads (the kernel's limit)
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


def tree_link_escapes(root_fd, link_parts, target, hops=TREE_LINK_HOPS):
    """Whether following the symlink at link_parts (a path in the tree open as root_fd) to
    `target` ends outside the tree. Resolved component by component against what the tree
    holds, so a chain (s -> ., l -> s/s/../..) is judged as the kernel would follow it."""
    if not target or target.startswith("/"):
        return True
    stack = list(link_parts[:-1])
    todo = target.split("/")[::-1]
    while todo:
        p = todo.pop()
        if p in ("", "."):
            continue
        if p == "..":
            if not stack:
                return True
            stack.pop()
            continue
        stack.append(p)
        rel = "/".join(stack)
        try:
            st = os.lstat(rel, dir_fd=root_fd)
        except OSError:
            continue  # missing: nothing below it is a link, the rest is lexical
        if stat.S_ISLNK(st.st_mode):
            hops -= 1
            if hops < 0:
                return True
            t = os.readlink(rel, dir_fd=root_fd)
            if not t or t.startswith("/"):
                return True
            stack.pop()
            todo.extend(t.split("/")[::-1])
    return False


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


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


def tree_extract(tar, stage_fd, stats):
    """Writes every member of `tar` (opened "r|") under stage_fd. Returns the directories'
    modes (applied once everything is in place) and the symlinks (checked at the end: a link
    may lead through one that comes later)."""
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
                if not m.linkname or "\0" in m.linkname or m.linkname.startswith("/"):
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


def tree_merge(src_fd, dst_fd, dry, where=""):
    """Moves what src holds into dst: a name dst lacks is renamed in whole; two directories
    merge; a file or symlink replaces a file or symlink. A directory never meets a file or a
    symlink (409): replacing one would drop a tree or write through a link. `dry`: check
    only, so a refusal comes before anything moved."""
    for name in sorted(os.listdir(src_fd)):
        s = os.lstat(name, dir_fd=src_fd)
        try:
            d = os.lstat(name, dir_fd=dst_fd)
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
                    tree_merge(sfd, dfd, dry, rel + "/")
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
    d = handler.daemon
    if handler.headers.get("Transfer-Encoding"):
        raise HTTPError(411, "send a Content-Length (chunked bodies are not accepted)",
                        {"close": True})
    raws = handler.headers.get_all("Content-Length") or []
    cap = d.args.max_tree_bytes
    lengths = {wire_uint(raw, cap) for raw in raws}
    if not raws or None in lengths or len(lengths) > 1:
        raise HTTPError(411, "send one Content-Length of ASCII digits", {"close": True})
    n = lengths.pop()
    if n > cap:
        raise HTTPError(413, "archive over the %d-byte cap (--max-tree-bytes)" % cap,
                        {"close": True})
    want = (handler.headers.get(TREE_SHA256_HEADER) or "").strip().lower()
    if not _SHA256_HEX.match(want):
        raise HTTPError(400, "%s must be the archive's SHA-256 hex digest" % TREE_SHA256_HEADER,
                        {"close_body": True})
    body = TreeBody(handler, n, d.args.body_timeout, want)
    try:
        res = tree_write_into(d, query, body)
    except HTTPError as e:
        if body.left > 0:
            e.extra["close"] = True  # the rest of the body is not read: no reuse
        raise
    handler.reply(200, res)


def tree_write_into(d, query, body):
    import tarfile
    import tempfile

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
        try:
            stage = tempfile.mkdtemp(prefix=TREE_STAGING_PREFIX, dir=real)
            stage_fd = os.open(os.path.basename(stage), _DIR_FLAGS, dir_fd=target_fd)
        except OSError as e:
            raise HTTPError(403 if e.errno in (errno.EACCES, errno.EROFS) else 400,
                            "cannot stage in %s: %s" % (real, e.strerror)) from None
        try:
            with tarfile.open(fileobj=body, mode="r|", encoding="utf-8",
                              errors="surrogateescape", tarinfo=tree_tarinfo()) as tar:
                dirs, links = tree_extract(tar, stage_fd, stats)
            body.drain()  # the end-of-archive padding: the digest covers every byte
        except (tarfile.TarError, EOFError) as e:
            raise HTTPError(400, "not a valid tar archive (truncated or corrupt): %s" % e) \
                from None
        except OSError as e:
            raise HTTPError(400, "extracting failed: %s" % (e.strerror or e)) from None
        got = body.sha.hexdigest()
        if not compare_digest(got, want):
            raise HTTPError(400, "archive SHA-256 mismatch: got %s, X-Content-SHA256 says %s"
                            % (got, want), {"sha256": got})
        for parts, target in links:
            if tree_link_escapes(stage_fd, parts, target):
                raise tree_refuse("symlink leads outside the target (or loops)", "/".join(parts))
        with d.files_lock:
            still_authorized(d)
            tree_merge(stage_fd, target_fd, True)
            tree_merge(stage_fd, target_fd, False)
            tree_set_modes(target_fd, dirs)
        made = []
    finally:
        if stage_fd >= 0:
            os.close(stage_fd)
        if stage is not None:
            remove_tree(target_fd, os.path.basename(stage), now() + REMOVE_MAX_S)
        if target_fd >= 0:
            os.close(target_fd)
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
                    ti = tarfile.TarInfo(name)
                    ti.mode = stat.S_IMODE(st.st_mode) & 0o1777
                    ti.mtime = int(st.st_mtime)
                    ti.uid = ti.gid = 0
                    ti.uname = ti.gname = ""
                    if stat.S_ISDIR(st.st_mode):
                        ti.type = tarfile.DIRTYPE
                        tar.addfile(ti)
                    elif stat.S_ISLNK(st.st_mode):
                        ti.type = tarfile.SYMTYPE
                        ti.linkname = os.readlink(name, dir_fd=root_fd)
                        tar.addfile(ti)
                    else:
                        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
                                     | getattr(os, "O_CLOEXEC", 0), dir_fd=root_fd)
                        try:
                            fst = os.fstat(fd)
                            if not stat.S_ISREG(fst.st_mode):
                                raise OSError(errno.EINVAL, "changed kind while sent")
                            os.set_blocking(fd, True)
                            ti.size = fst.st_size
                            tar.addfile(ti, _FdReader(fd))
                        finally:
                            os.close(fd)
            out.flush()
            out.h.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (
                TREE_DIGEST_LEN, out.sha.hexdigest().encode()))
            handler.close_connection = False
        except Exception as e:  # noqa: BLE001 - OSError, TarError, a tree too deep...
            # The answer began: cutting it (no last chunk, no digest) is the only way to say.
            sys.stderr.write("execd: tree %s cut: %s\n" % (real, getattr(e, "message", e)))
    finally:
        os.close(root_fd)


# ---------------------------------------------------------------- HTTP


_HEAD_END = re.compile(b"\n\r?\n")


def head_end(buf, start=0):
    """Length of the header block at the start of buf (through its empty line), or -1."""
    if buf[:1] == b"\n" or buf[:2] == b"\r\n":  # an empty request line: let http.server judge
        return buf.index(b"\n") + 1
    m = _HEAD_END.search(buf, start)
    return m.end() if m else -1


class ConnBudget:
    """Live connections in accept order, each authenticated or not. Over MAX_PREAUTH
    unauthenticated ones, the oldest is shed (shutdown wakes its thread, which exits); over
    MAX_CONNECTIONS with none to shed, the new one gets a 503 and is closed at once."""

    def __init__(self, max_conns, max_preauth):
        self.max_conns = max_conns
        self.max_preauth = max_preauth
        self.lock = threading.Lock()
        self.conns = collections.OrderedDict()  # socket -> authenticated
        self.shed = 0
        self.refused = 0

    def admit(self, sock):
        shed = []
        with self.lock:
            pre = [c for c, a in self.conns.items() if not a]
            n_pre, n_all = len(pre), len(self.conns)
            while pre and (n_pre >= self.max_preauth or n_all >= self.max_conns):
                c = pre.pop(0)
                del self.conns[c]
                shed.append(c)
                n_pre -= 1
                n_all -= 1
            ok = n_all < self.max_conns
            if ok:
                self.conns[sock] = False
            self.shed += len(shed)
            self.refused += 0 if ok else 1
        for c in shed:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        return ok

    def authed(self, sock):
        with self.lock:
            return self.conns.get(sock, False)

    def mark_authed(self, sock):
        with self.lock:
            if sock in self.conns:
                self.conns[sock] = True

    def release(self, sock):
        with self.lock:
            self.conns.pop(sock, None)

    def counts(self):
        with self.lock:
            pre = sum(1 for a in self.conns.values() if not a)
            return {"connections": len(self.conns), "preauth": pre, "shed": self.shed,
                    "refused": self.refused}


_BUSY_BODY = b'{"error":"too many connections","code":503}'
_BUSY_503 = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
             b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(_BUSY_BODY),
                                                                        _BUSY_BODY))
# ---------------------------------------------------------------- checked reuse: baseline / diff / restore
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


def baseline_args(p):
    p.add_argument("--baseline-at-start", choices=("on", "off"),
                   default="on" if os.environ.get(EXECD_BASELINE_ENV) == "on" else "off",
                   help="record the reuse baseline before serving (default: %s=on, which "
                        "the controller sets in grading pods)" % EXECD_BASELINE_ENV)
    p.add_argument("--baseline-store", default=BASELINE_STORE,
                   help="private dir (0700) for the baseline's file copies")
    p.add_argument("--baseline-paths", default=BASELINE_PATHS,
                   help="':'-separated system and home roots (~ is $HOME)")
    p.add_argument("--baseline-packages", default=BASELINE_PACKAGES,
                   help="':'-separated package roots (globs; dirs or files)")
    p.add_argument("--baseline-exclude", default=BASELINE_EXCLUDE,
                   help="':'-separated paths never watched (with --baseline-scope root: "
                        "the pod's scratch mounts)")
    scope = os.environ.get(EXECD_BASELINE_SCOPE_ENV) or "listed"
    p.add_argument("--baseline-scope", choices=BASELINE_SCOPES,
                   default=scope if scope in BASELINE_SCOPES else "invalid",
                   help="listed: the roots above; root: also the whole of --root except "
                        "/proc, /sys, /dev (not /dev/shm), the store, execd's own dir and "
                        "--baseline-exclude, watched without copies (default: $%s, "
                        "which the controller sets in grading pods, else listed)"
                        % EXECD_BASELINE_SCOPE_ENV)
    p.add_argument("--baseline-localtime", default="/etc/localtime")
    p.add_argument("--baseline-rerecord", action="store_true",
                   help="let POST /baseline replace an existing baseline (tests, local use)")
    p.add_argument("--baseline-copy-cap", type=int, default=BASELINE_COPY_CAP)
    p.add_argument("--baseline-store-cap", type=int, default=BASELINE_STORE_CAP)


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


class Entry(object):
    __slots__ = ("mode", "uid", "gid", "size", "mtime", "atime", "ctime", "ino", "dev", "link",
                 "blob", "why")

    def __init__(self, st, link=None):
        self.set_stat(st)
        self.link = link
        self.blob = None  # store file with the content (regular files)
        self.why = None  # why there is no copy

    def set_stat(self, st):
        self.mode, self.uid, self.gid, self.size = st.st_mode, st.st_uid, st.st_gid, st.st_size
        self.mtime, self.atime, self.ctime = st.st_mtime_ns, st.st_atime_ns, st.st_ctime_ns
        self.ino, self.dev = st.st_ino, st.st_dev

    def same(self, st):
        if stat.S_ISDIR(self.mode):  # a dir's times move with its entries, which are compared
            return (st.st_mode == self.mode and st.st_uid == self.uid
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
        self.store = os.path.realpath(args.baseline_store)
        self.entries = None  # path -> Entry; None until recorded
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
        self.stored_bytes = 0
        self.blobs = 0
        self.baseline_id = None
        self.forced = set()  # roots watched although under an excluded path (/dev/shm)
        self.shell_bin = None  # (realpath, sha256) of the shell binary at baseline

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
        ws = os.path.realpath(self.d.workspace or os.getcwd())
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
                        if stat.S_ISDIR(st.st_mode):
                            stack.append(p)
        return out, unreadable, same

    # ---- store

    def _copy(self, path, ent):
        """Copy a regular file's content into the store; the copy counts only if the file did
        not change while it was read."""
        if ent.size > self.args.baseline_copy_cap:
            ent.why = "over the %d-byte copy cap" % self.args.baseline_copy_cap
            return
        if self.stored_bytes + ent.size > self.args.baseline_store_cap:
            ent.why = "store cap (%d bytes) reached" % self.args.baseline_store_cap
            return
        self.blobs += 1
        blob = os.path.join(self.store, "blobs", "%x" % self.blobs)
        try:
            src = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as e:
            ent.why = "unreadable at baseline: %s" % e.strerror
            return
        try:
            dst = os.open(blob, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            h = sha256()
            try:
                while True:
                    chunk = os.read(src, 1 << 20)
                    if not chunk:
                        break
                    h.update(chunk)
                    os.write(dst, chunk)
            finally:
                os.close(dst)
            st = os.fstat(src)
        except OSError as e:
            ent.why = "copy failed: %s" % e.strerror
            return
        finally:
            os.close(src)
        if not ent.same(st):
            ent.why = "changed while it was copied"
            os.unlink(blob)
            return
        # The hash stays in execd's memory: a copy altered in the store (an agent running as
        # execd's user can reach it) is refused at restore instead of written back.
        ent.blob = (blob, h.hexdigest())
        self.stored_bytes += ent.size

    def _reset_store(self):
        if os.path.lexists(self.store):
            shutil.rmtree(self.store)
        os.makedirs(os.path.join(self.store, "blobs"), 0o700)
        os.chmod(self.store, 0o700)
        self.stored_bytes = self.blobs = 0

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
            self.exclude = _split_paths(self.args.baseline_exclude) + [self.store]
            self.forced = set()
            if self.args.baseline_scope == "root":
                # execd's own dir is mounted read-only; pseudo filesystems are no state.
                self.exclude += [os.path.join(self.d.root, x) for x in ("proc", "sys", "dev")]
                self.exclude.append(os.path.dirname(os.path.realpath(__file__)))
                self.forced.add(os.path.join(self.d.root, "dev/shm"))
            self.roots = self._roots()
            self.shell_bin = _shell_binary(self.d.bash)
            self._reset_store()
            self.env = self.shell_env()
            self.base_env = dict(self.d.base_env)
            self.tz = self.tz_state()
            self.procs = self.processes()
            found, _, _ = self.walk()
            entries = {}
            for p, (st, area) in found.items():
                link = None
                if stat.S_ISLNK(st.st_mode):
                    try:
                        link = os.readlink(p)
                    except OSError:
                        link = None
                ent = Entry(st, link)
                if stat.S_ISREG(st.st_mode):
                    if area == "rest":
                        # The image's own tree (/usr, /var, ...): copying it would double the
                        # pod's disk and delay its start; a restore deletes what was added
                        # there and retires the pod on any other change.
                        ent.why = "outside the copied roots"
                    else:
                        self._copy(p, ent)
                entries[p] = ent
            self.entries = entries
            kids = {}
            for p in entries:
                kids.setdefault(os.path.dirname(p), []).append(p)
            self.kids = kids  # dir -> its baseline entries (restore keeps the same paths)
            self.areas = {p: area for p, (st, area) in found.items()}
            _tick(self.store)
            self.recorded_at = time.time()
            self.baseline_id = os.urandom(8).hex()
        return {"recorded": True, "baseline_id": self.baseline_id, "entries": len(self.entries),
                "stored_bytes": self.stored_bytes,
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
                changes.append({"kind": "retired", "why": self.d.retired})
            else:
                env = self.shell_env()
                t2 = now()
                changes += self._other_changes(env)
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
                    d.bg.hold()
                    d.pty.hold()
                    left = self._restore_processes()
                    d.bg.reset()
                    d.pty.reset()
                    d.base_env = dict(self.base_env)
                    d.reaper.reap()
                    left += self._restore_files()
                    left += self._restore_tz()
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
            _tick(self.store)
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
        for p, (st, _area) in found.items():
            ent = self.entries.get(p)
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
            if cur is not None and p not in gone and ent.same(cur[0]):
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
            tmp = os.path.join(os.path.dirname(p), ".sandman-restore-%s" % os.urandom(6).hex())
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            h = sha256()
            try:
                with open(ent.blob[0], "rb") as src:
                    while True:
                        chunk = src.read(1 << 20)
                        if not chunk:
                            break
                        h.update(chunk)
                        os.write(fd, chunk)
            except BaseException:
                os.close(fd)
                os.unlink(tmp)
                raise
            os.close(fd)
            if h.hexdigest() != ent.blob[1]:
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


def _shell_binary(path):
    """(realpath, sha256) of the shell binary; the hash is None where it cannot be read."""
    real = os.path.realpath(path)
    try:
        return (real, file_sha256(real))
    except (HTTPError, OSError):
        return (real, None)


def _tick(store):
    """Wait until the file system's clock moved past now, so a change made right after this
    cannot carry the ctime just recorded (git's "racy clean" problem)."""
    probe = os.path.join(store, ".tick")
    with open(probe, "wb"):
        pass
    first = os.lstat(probe).st_ctime_ns
    deadline = now() + 1
    while now() < deadline:
        time.sleep(0.001)
        os.utime(probe)
        if os.lstat(probe).st_ctime_ns != first:
            break


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


# The token generation the current request was authorized under (None: a public route).
_REQ = threading.local()


def still_authorized(d):
    """Refuse an action of a request authorized with a token rotated since: when a grading pod
    changes holders, the last holder's request in flight (a slow body, a wait on a lock) must
    not act after /restore and /diff said clean. Called when the body is complete and again
    under the lock /restore also takes, so an action runs wholly before the restore or not."""
    gen = getattr(_REQ, "gen", None)
    if gen is not None and gen != d.token_gen:
        raise HTTPError(401, "the token this request was authorized with has been rotated",
                        {"close_body": True})


def _r_token(handler, query):
    """Rotate the token (authenticated with the current one): when a grading pod is reused,
    the controller gives the next holder a new token and the last holder loses access. Held in
    memory only: the pod's annotation (and so a restarted execd) keeps the first hash, which is
    why sandbox pods never restart (restartPolicy Never)."""
    want = handler.json_body().get("token_sha256")
    if not isinstance(want, str) or not _SHA256_HEX.match(want) or want.endswith("\n"):
        raise HTTPError(400, "token_sha256 must be 64 lowercase hex characters")
    d = handler.daemon
    d.args.token_sha256 = want
    d.token_gen += 1  # only the holder of the current token rotates: no concurrent bump
    handler.reply(200, {"ok": True})


# ---------------------------------------------------------------- background processes
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


class Background(object):
    """The spawned processes of this execd. Their ids are never reused (a sequence number) and
    not guessable (96 random bits); /reset kills them with the sandbox and forgets them."""

    def __init__(self, daemon):
        self.d = daemon
        self.lock = threading.Lock()
        self.procs = collections.OrderedDict()  # id -> BgProc, oldest first
        self.rids = {}  # request_id -> id, as many as procs at most
        self.seq = 0
        self.kept = 0  # bytes in all rings
        self.closing = []  # fds the reader thread closes (it alone polls them)
        self.wake = None  # (r, w): a pipe that wakes the reader; made by the first spawn
        self.thread = None
        self.held = False  # a restore is killing the old holder's processes: no spawn

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
            known = self.procs.get(self.rids.get(rid)) if rid is not None else None
            if known is not None:
                return known.info()
            if len(self.procs) >= BG_MAX_SPAWNED:
                raise HTTPError(429, "%d processes were spawned since the last reset (the "
                                     "limit); /reset forgets them" % BG_MAX_SPAWNED)
            live = sum(1 for p in self.procs.values() if p.fd is not None or p.status is None)
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
            devnull = os.open(os.devnull, os.O_RDONLY)
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
            self.procs[pid_id] = p
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
        base = base or self.d.workspace or "/"
        if cwd is None:
            return base
        if not isinstance(cwd, str) or not cwd or "\0" in cwd or len(cwd) > 4096:
            raise HTTPError(400, "cwd must be a path (a non-empty string without NUL)")
        path = os.path.join(base, cwd)
        if not os.path.isdir(path):
            raise HTTPError(400, "cwd %s is not a directory" % path[:300])
        return path

    def get(self, pid_id):
        if not isinstance(pid_id, str) or not _BG_ID.fullmatch(pid_id):
            raise HTTPError(400, "invalid process id (ids look like p12-<24 hex>)")
        p = self.procs.get(pid_id)
        if p is None:
            raise HTTPError(404, "no process %s in this sandbox (ended by a reset, or "
                                 "another sandbox's)" % pid_id, {"not_found": True})
        return p

    def listing(self):
        self.d.reaper.reap()
        with self.lock:
            procs = [p.info() for p in self.procs.values()]
        live = sum(1 for p in procs if p["running"] or p["output_open"])
        return {"processes": procs, "live": live, "max_live": BG_MAX_LIVE}

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

    def hold(self):
        """No spawn until reset(): /restore kills the old holder's processes meanwhile."""
        with self.lock:
            self.held = True

    def reset(self):
        """After /reset or /restore killed the sandbox: forget every handle (ids stay unused),
        so a next holder never sees the last one's commands or output."""
        with self.lock:
            self.held = False
            with self.d.reaper.lock:
                for p in self.procs.values():
                    self.d.reaper.procs.pop(p.pid, None)
            for p in self.procs.values():
                if p.fd is not None:
                    self.closing.append(p.fd)
                    p.fd = None
                p.drop()
            self.procs.clear()
            self.rids.clear()
            self.kept = 0
            if self.wake is not None:
                self._poke()

    # ---- the reader thread

    def _start_reader(self):
        if self.thread is not None:
            return
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        self.wake = (r, w)
        self.thread = threading.Thread(target=self._loop, name="execd-spawn-output",
                                       daemon=True)
        self.thread.start()

    def _poke(self):
        try:
            os.write(self.wake[1], b"x")
        except OSError:
            pass  # full: the reader is awake already

    def _loop(self):
        wake = self.wake[0]
        rbuf = bytearray(READ_SIZE)
        rview = memoryview(rbuf)
        while True:
            with self.lock:
                for fd in self.closing:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
                self.closing = []
                watch = {p.fd: p for p in self.procs.values() if p.fd is not None}
            poller = select.poll()
            poller.register(wake, select.POLLIN)
            for fd in watch:
                poller.register(fd, select.POLLIN)
            try:
                events = poller.poll(1000)
            except InterruptedError:
                continue
            for fd, _ev in events:
                if fd == wake:
                    try:
                        os.read(wake, 4096)
                    except OSError:
                        pass
                    continue
                p = watch.get(fd)
                if p is None:
                    continue
                try:
                    # Into one buffer: a fresh 1 MiB object per read, shrunk to what came,
                    # fragmented the heap under many small reads.
                    n = os.readv(fd, [rbuf])
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    n = 0
                data = rview[:n]
                with self.lock:
                    if p.fd != fd:
                        continue  # reset meanwhile: the fd is in self.closing
                    if n:
                        before = p.kept
                        p.add(data)
                        self.kept += p.kept - before
                        if self.kept > BG_OUTPUT_BUDGET:
                            self._shed()
                    else:
                        os.close(fd)
                        p.fd = None

    def _shed(self):
        """Drop the oldest ended outputs (pipe closed) until the rings fit the budget; live
        rings alone fit in it (BG_MAX_LIVE * BG_RING)."""
        for p in self.procs.values():
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
    # The base64 is written as it is, not copied into a JSON string: at most the ring and its
    # encoding in memory per call.
    b64 = base64.b64encode(data)
    del data
    head = json_bytes(out)[:-1] + b',"data_b64":"'
    handler.send_raw(200, head, "application/json", length=len(head) + len(b64) + 2)
    handler.wfile.write(b64)
    handler.wfile.write(b'"}')


def _r_process_signal(handler, query):
    handler.reply(200, handler.daemon.bg.signal(handler.json_body()))


def _r_process_wait(handler, query):
    handler.reply(200, handler.daemon.bg.wait(handler.json_body()))


# ---------------------------------------------------------------- interactive sessions
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

    def info(self):
        out = BgProc.info(self)
        out.update({"cols": self.cols, "rows": self.rows})
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


class Sessions(object):
    """The interactive sessions of this execd. Ids are never reused (a sequence number) and
    not guessable (96 random bits); /reset and /restore kill them with the sandbox and forget
    them. Output waits on `cond` (the reader notifies it)."""

    def __init__(self, daemon):
        self.d = daemon
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.items = collections.OrderedDict()  # id -> PtySession, oldest first
        self.rids = collections.OrderedDict()  # request_id of an open -> session id
        self.seq = 0
        self.closing = []  # fds the reader thread closes (it alone polls them)
        self.wake = None
        self.thread = None
        self.held = False

    def open(self, req):
        d = self.d
        unknown = sorted(set(req) - {"command", "cwd", "env", "cols", "rows", "request_id"})
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
            # A retry of an open whose answer was lost: the same session, never a second one.
            known = self.items.get(self.rids.get(rid)) if rid is not None else None
            if known is not None:
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

    def get(self, sid):
        if not isinstance(sid, str) or not _PTY_ID.fullmatch(sid):
            raise HTTPError(400, "invalid session id (ids look like s12-<24 hex>)")
        s = self.items.get(sid)
        if s is None:
            raise HTTPError(404, "no session %s in this sandbox (closed, ended by a reset, or "
                                 "another sandbox's)" % sid, {"not_found": True})
        return s

    def listing(self):
        self.d.reaper.reap()
        with self.lock:
            items = [s.info() for s in self.items.values()]
        live = sum(1 for s in items if s["running"] or s["output_open"])
        return {"sessions": items, "live": live, "max_live": PTY_MAX_LIVE}

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
        out = s.info()
        out.update({"start": frm, "end": frm + len(data), "dropped": frm - since})
        return out, data

    def resize(self, req):
        cols = _pty_dim(req, "cols", None)
        rows = _pty_dim(req, "rows", None)
        with self.lock:
            s = self.get(req.get("id"))
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
        rounds since it may fork meanwhile), reap it, close the pty, forget the id."""
        with self.lock:
            s = self.get(req.get("id"))
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

    def hold(self):
        with self.lock:
            self.held = True

    def reset(self):
        """After /reset or /restore killed the sandbox: forget every session (ids stay
        unused), so a next holder never sees the last one's terminal."""
        with self.cond:
            self.held = False
            with self.d.reaper.lock:
                for s in self.items.values():
                    self.d.reaper.procs.pop(s.pid, None)
            for s in self.items.values():
                if s.fd is not None:
                    self.closing.append(s.fd)
                    s.fd = None
                s.drop()
            self.items.clear()
            self.rids.clear()
            self.cond.notify_all()
            if self.wake is not None:
                self._poke()

    # ---- the reader thread

    def _start_reader(self):
        if self.thread is not None:
            return
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        self.wake = (r, w)
        self.thread = threading.Thread(target=self._loop, name="execd-pty-output", daemon=True)
        self.thread.start()

    def _poke(self):
        try:
            os.write(self.wake[1], b"x")
        except OSError:
            pass

    def _loop(self):
        wake = self.wake[0]
        rbuf = bytearray(READ_SIZE)
        rview = memoryview(rbuf)
        while True:
            with self.lock:
                for fd in self.closing:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
                self.closing = []
                watch = {s.fd: s for s in self.items.values() if s.fd is not None}
            poller = select.poll()
            poller.register(wake, select.POLLIN)
            for fd in watch:
                poller.register(fd, select.POLLIN)
            try:
                events = poller.poll(1000)
            except InterruptedError:
                continue
            for fd, _ev in events:
                if fd == wake:
                    try:
                        os.read(wake, 4096)
                    except OSError:
                        pass
                    continue
                s = watch.get(fd)
                if s is None:
                    continue
                with self.cond:
                    if s.fd != fd:
                        continue  # closed or reset meanwhile: the fd is in self.closing
                    try:
                        n = os.readv(fd, [rbuf])
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError:
                        n = 0  # EIO: no process holds the terminal any more
                    if n:
                        s.add(rview[:n])
                    else:
                        os.close(fd)
                        s.fd = None
                    self.cond.notify_all()


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
    b64 = base64.b64encode(data)
    del data
    head = json_bytes(out)[:-1] + b',"data_b64":"'
    handler.send_raw(200, head, "application/json", length=len(head) + len(b64) + 2)
    handler.wfile.write(b64)
    handler.wfile.write(b'"}')


def _r_session_resize(handler, query):
    handler.reply(200, handler.daemon.pty.resize(handler.json_body()))


def _r_session_signal(handler, query):
    handler.reply(200, handler.daemon.pty.signal(handler.json_body()))


def _r_session_close(handler, query):
    handler.reply(200, handler.daemon.pty.close(handler.json_body()))


_HTTP_VERSION = re.compile(r"HTTP/[0-9]{1,3}\.[0-9]{1,3}")


def wire_uint(value, cap):
    """A number taken from the wire: 1*DIGIT of ASCII digits, SP/HTAB around it allowed;
    min(value, cap + 1), or None when it is not that. str.isdigit, int() and regex \\d also
    take superscripts, other scripts' digits, signs, underscores and Unicode spaces, and int()
    refuses over 4300 digits."""
    s = value.strip(" \t")
    if not s or s.strip("0123456789"):
        return None
    s = s.lstrip("0") or "0"
    if len(s) > len(str(cap)):
        return cap + 1
    return min(int(s), cap + 1)


def json_bytes(obj):
    import json  # by the first reply, not at start (the imports at the top say why)

    return json.dumps(obj, separators=(",", ":")).encode()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # without it each small response waits ~40 ms for an ACK
    server_version = "execd/" + VERSION
    sys_version = ""
    timeout = IDLE_TIMEOUT
    daemon = None  # set in main()

    # ------------------------------------------------------------ pre-auth budget

    def handle_one_request(self):
        """http.server's, with the header block read under a byte and time budget first (the
        stdlib allows 64 KiB per line, 100 lines and IDLE_TIMEOUT per read)."""
        head = self.read_head()
        if head is None:
            self.close_connection = True
            return
        try:  # the header budget is over: writes (a slow reader of a big file) get the old limit
            self.connection.settimeout(IDLE_TIMEOUT)
        except OSError:
            pass
        nl = head.find(b"\n") + 1
        self.raw_requestline = head[:nl]
        # http.server reads the version with int() (and before 3.9 without isdigit): signs,
        # underscores and non-ASCII digits would pass.
        words = head[:nl].decode("latin-1").rstrip("\r\n").split()
        if len(words) >= 3 and not _HTTP_VERSION.fullmatch(words[-1]):
            self.requestline, self.request_version, self.command = "", "", ""
            self.send_error(400, "bad HTTP version %r (want HTTP/DIGITS.DIGITS)" % words[-1][:20])
            return
        rfile = self.rfile
        self.rfile = io.BytesIO(head[nl:])
        try:
            ok = self.parse_request()
        finally:
            self.rfile = rfile
        if not ok:
            return
        method = getattr(self, "do_" + self.command, None)
        if method is None:
            self.send_error(405, "unsupported method %r" % self.command[:20])
            return
        method()
        self.wfile.flush()

    def read_head(self):
        """The request line and headers (through the empty line), or None after replying 431 or
        408, or when the peer closed or was shed. One socket read at a time (peek), so the
        time limit holds however slowly the bytes drip, and no body byte is consumed."""
        budget = self.server.budget
        authed = budget.authed(self.connection)
        limit = self.daemon.args.max_header_bytes
        buf = bytearray()
        deadline = now() + (IDLE_TIMEOUT if authed else self.daemon.args.preauth_idle)
        started = False
        try:
            while True:
                left = deadline - now()
                if left <= 0:
                    raise socket.timeout()
                self.connection.settimeout(left)
                data = self.rfile.peek(1)
                if not data:
                    return None
                if not started:
                    started = True
                    deadline = now() + self.daemon.args.header_timeout
                start = max(0, len(buf) - 2)
                cand = buf + data[:limit + 1 - len(buf)]
                end = head_end(cand, start)
                # Consume through the empty line only: what follows is the body or the next
                # request, read from the same buffer.
                buf += self.rfile.read((end if end >= 0 else len(cand)) - len(buf))
                if end >= 0:
                    return bytes(buf)
                if len(buf) > limit:
                    self.requestline, self.request_version, self.command = "", "", ""
                    self.send_error(431, "request line and headers over %d bytes" % limit)
                    return None
        except socket.timeout:
            if started:
                self.requestline, self.request_version, self.command = "", "", ""
                self.send_error(408, "request headers too slow")
            return None
        except OSError:
            return None

    def log_message(self, fmt, *args):
        if self.daemon.args.verbose:
            sys.stderr.write("execd: %s %s\n" % (self.address_string(), fmt % args))

    def send_error(self, code, message=None, explain=None):
        # http.server's own errors (bad request line, huge headers...): JSON, then close.
        self.close_connection = True
        # Client mistakes (an HTTP version or method http.server rejects) are 4xx, not 5xx.
        code = {505: 400, 501: 405}.get(code, code)
        try:
            self.reply(code, {"error": message or "bad request", "code": code}, close=True)
        except OSError:
            pass

    def reply(self, code, obj, close=False, headers=None):
        body = obj if isinstance(obj, bytes) else json_bytes(obj)
        ctype = "application/octet-stream" if isinstance(obj, bytes) else "application/json"
        self.send_raw(code, body, ctype, close, headers)

    def send_raw(self, code, body, ctype, close=False, headers=None, length=None):
        if close:
            self.close_connection = True
        reason = self.responses.get(code, ("",))[0]
        head = ["HTTP/1.1 %d %s" % (code, reason), "Server: " + self.server_version,
                "Content-Type: " + ctype,
                "Content-Length: %d" % (len(body) if length is None else length)]
        if headers:
            for k, v in headers:
                head.append("%s: %s" % (k, v))
        if self.close_connection:
            head.append("Connection: close")
        self.wfile.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)

    def do_GET(self):
        self.dispatch("GET")

    def do_POST(self):
        self.dispatch("POST")

    def do_PUT(self):
        self.dispatch("PUT")

    def do_DELETE(self):
        self.dispatch("DELETE")

    def do_PATCH(self):
        self.dispatch("PATCH")

    def do_HEAD(self):
        self.close_connection = True
        self.dispatch("HEAD")

    def do_OPTIONS(self):
        self.dispatch("OPTIONS")

    def read_body(self):
        if self.headers.get("Transfer-Encoding"):
            raise HTTPError(411, "send a Content-Length (chunked bodies are not accepted)",
                            {"close": True})
        raws = self.headers.get_all("Content-Length") or []
        if not raws:
            return b""
        cap = self.daemon.args.max_body
        lengths = {wire_uint(raw, cap) for raw in raws}
        if None in lengths:
            raise HTTPError(400, "Content-Length must be ASCII digits", {"close": True})
        if len(lengths) > 1:
            # Which one frames the body is ambiguous; the rest would become the next request.
            raise HTTPError(400, "conflicting Content-Length headers", {"close": True})
        n = lengths.pop()
        if n > cap:
            raise HTTPError(413, "request body over %d bytes" % self.daemon.args.max_body,
                            {"close": True})
        chunks = []
        got = 0
        deadline = now() + self.daemon.args.body_timeout
        try:
            while got < n:
                left = deadline - now()
                if left <= 0:
                    raise socket.timeout()
                self.connection.settimeout(left)
                chunk = self.rfile.read1(min(n - got, 1 << 20))
                if not chunk:
                    raise HTTPError(400, "body ended early", {"close": True})
                chunks.append(chunk)
                got += len(chunk)
        except socket.timeout:
            raise HTTPError(408, "request body too slow", {"close": True}) from None
        finally:
            try:
                self.connection.settimeout(IDLE_TIMEOUT)
            except OSError:
                pass
        still_authorized(self.daemon)
        return b"".join(chunks)

    def json_body(self):
        import json  # here, not at start (the imports at the top say why)

        body = self.read_body()
        try:
            obj = json.loads(body.decode("utf-8")) if body.strip() else {}
        except (ValueError, UnicodeDecodeError):
            raise HTTPError(400, "body is not valid JSON") from None
        if not isinstance(obj, dict):
            raise HTTPError(400, "body must be a JSON object")
        return obj

    def authorized(self):
        self.daemon.undumpable.wait(5.0)
        want = self.daemon.args.token_sha256
        if want is None:
            return True
        got = self.headers.get("Authorization", "")
        if not got.startswith("Bearer "):
            return False
        digest = sha256(got[7:].strip().encode("utf-8", "surrogateescape")).hexdigest()
        return compare_digest(digest, want)

    def dispatch(self, method):
        try:
            url = urlsplit(self.path)
            route = url.path
            query = parse_qs(url.query, keep_blank_values=True)
            handler = ROUTES.get(route)
            if handler is None:
                raise HTTPError(404, "no such route: %s" % route[:200], {"close_body": True})
            # The generation is read before the check: a rotation in between leaves this
            # request with the old one, refused at its action (still_authorized).
            _REQ.gen = None if route in PUBLIC_ROUTES else self.daemon.token_gen
            if route not in PUBLIC_ROUTES and not self.authorized():
                raise HTTPError(401, "missing or wrong bearer token", {"close_body": True})
            if route not in PUBLIC_ROUTES or self.authorized():
                # Authenticated connections leave the pre-auth budget (longer idle, no shedding).
                self.server.budget.mark_authed(self.connection)
            want_method = handler[0]
            if method != want_method:
                raise HTTPError(405, "use %s for %s" % (want_method, route),
                                {"close_body": True})
            handler[1](self, query)
        except HTTPError as e:
            close = bool(e.extra.pop("close", False))
            if e.extra.pop("close_body", False) and self.headers.get("Content-Length", "0") \
                    not in ("0", ""):
                close = True  # we did not read the body: the connection cannot be reused
            obj = {"error": e.message, "code": e.code}
            obj.update(e.extra)
            self.reply(e.code, obj, close=close)
        except (BrokenPipeError, ConnectionResetError, socket.timeout):
            self.close_connection = True
        except Exception as e:  # never a traceback to the client
            sys.stderr.write("execd: internal error on %s: %r\n" % (self.path[:200], e))
            try:
                self.reply(500, {"error": "internal error: %s" % type(e).__name__, "code": 500},
                           close=True)
            except OSError:
                self.close_connection = True

    # ------------------------------------------------------------ routes

    def r_health(self, query):
        self.reply(200, {"ok": True, "version": VERSION})

    def r_ready(self, query):
        res = self.daemon.ready.get()
        res["version"] = VERSION
        self.reply(200 if res.get("ok") else 503, res)

    def r_exec(self, query):
        self.reply(200, self.daemon.exec_command(self.json_body()))

    def r_exec_stream(self, query):
        stream = ExecStream(self)
        body = self.json_body()
        try:
            result = self.daemon.stream_command(body, stream)
        except HTTPError as e:
            if not stream.started:
                raise
            obj = {"error": e.message, "code": e.code}
            obj.update(e.extra)
            stream.finish(obj)
            return
        except Exception as e:
            if not stream.started:
                raise
            sys.stderr.write("execd: internal error on /exec/stream: %r\n" % (e,))
            self.close_connection = True
            stream.finish({"error": "internal error: %s" % type(e).__name__, "code": 500})
            return
        stream.finish({"result": result})

    def r_env(self, query):
        self.reply(200, self.daemon.set_env(self.json_body()))

    def r_reset(self, query):
        self.reply(200, self.daemon.reset(self.json_body()))

    def r_state(self, query):
        st = self.daemon.state()
        st["connections"] = self.server.budget.counts()  # the pre-auth budget at work
        self.reply(200, st)

    def r_conditions(self, query):
        self.reply(200, self.daemon.conditions(query))

    def r_files_write(self, query):
        self.reply(200, write_file(self.daemon, self.json_body()))

    def r_files_read(self, query):
        """Streams {"data_b64": ..., "size": n, "sha256": ...}: one pass over the file, the
        hash covers exactly the bytes sent."""
        req = self.json_body()
        real = resolve_path(self.daemon, req.get("path"))
        fd, st = open_regular(real)
        try:
            size = st.st_size
            prefix = b'{"path":' + json_bytes(real) + b',"data_b64":"'
            suffix_len = len(b'","size":%d,"sha256":"' % size) + 64 + 2
            length = len(prefix) + 4 * ((size + 2) // 3) + suffix_len
            self.send_raw(200, prefix, "application/json", length=length)
            h = sha256()
            left = size
            while left > 0:
                chunk = os.read(fd, min(left, 3 << 18))  # multiple of 3: base64 joins cleanly
                if not chunk:
                    break
                if len(chunk) % 3 and len(chunk) < left:
                    more = os.read(fd, 3 - len(chunk) % 3)
                    chunk += more
                h.update(chunk)
                left -= len(chunk)
                self.wfile.write(base64.b64encode(chunk))
            if left:
                # The file shrank while we sent it: cut the response so the client sees it.
                self.close_connection = True
                return
            self.wfile.write(b'","size":%d,"sha256":"%s"}' % (size, h.hexdigest().encode()))
        finally:
            os.close(fd)

    def r_files_get(self, query):
        path = query.get("path")
        real = resolve_path(self.daemon, path[-1] if path else None)
        fd, st = open_regular(real)
        try:
            size = st.st_size
            h = sha256()
            left = size
            while left > 0:  # pass 1: the hash header must precede the body
                chunk = os.read(fd, min(left, 1 << 20))
                if not chunk:
                    break
                h.update(chunk)
                left -= len(chunk)
            if left:
                raise HTTPError(409, "file changed while reading", {"path": real})
            digest = h.hexdigest()
            os.lseek(fd, 0, os.SEEK_SET)
            self.send_raw(200, b"", "application/octet-stream", length=size,
                          headers=[("X-Content-SHA256", digest)])
            h2 = sha256()
            left = size
            while left > 0:  # pass 2 streams; a file changed in between cuts the connection
                chunk = os.read(fd, min(left, 1 << 20))
                if not chunk:
                    break
                h2.update(chunk)
                left -= len(chunk)
                if left == 0 and h2.hexdigest() != digest:
                    self.close_connection = True
                    return
                self.wfile.write(chunk)
            if left:
                self.close_connection = True
        finally:
            os.close(fd)


PUBLIC_ROUTES = ("/health", EXECD_READY_PATH)  # no token: the kubelet calls them

ROUTES = {
    "/health": ("GET", Handler.r_health),
    EXECD_READY_PATH: ("GET", Handler.r_ready),
    "/exec": ("POST", Handler.r_exec),
    "/exec/stream": ("POST", Handler.r_exec_stream),
    "/files/read": ("POST", Handler.r_files_read),
    "/files": ("GET", Handler.r_files_get),
    "/files/write": ("POST", Handler.r_files_write),
    "/files/tree": ("GET", tree_read),
    "/files/tree/write": ("POST", tree_write),
    "/env": ("POST", Handler.r_env),
    "/reset": ("POST", Handler.r_reset),
    "/state": ("GET", Handler.r_state),
    "/conditions": ("GET", Handler.r_conditions),
    "/baseline": ("POST", _r_baseline),
    "/diff": ("GET", _r_diff),
    "/restore": ("POST", _r_restore),
    "/token": ("POST", _r_token),
    "/processes": ("GET", _r_processes),
    "/processes/spawn": ("POST", _r_spawn),
    "/processes/info": ("GET", _r_process),
    "/processes/output": ("GET", _r_process_output),
    "/processes/signal": ("POST", _r_process_signal),
    "/processes/wait": ("POST", _r_process_wait),
    "/sessions": ("GET", _r_sessions),
    "/sessions/open": ("POST", _r_session_open),
    "/sessions/write": ("POST", _r_session_write),
    "/sessions/read": ("GET", _r_session_read),
    "/sessions/resize": ("POST", _r_session_resize),
    "/sessions/signal": ("POST", _r_session_signal),
    "/sessions/close": ("POST", _r_session_close),
}


class ExecStream(object):
    """The answer of /exec/stream: chunked HTTP, one JSON object per line (NDJSON). Lines
    `{"output": text}` as the command prints (UTF-8 decoded across read boundaries), then
    one `{"result": ...}` with /exec's answer, or `{"error": ..., "code": ...}` if the call
    failed after the stream began. Bounded: each chunk is one pipe read (at most READ_SIZE)
    written straight to the socket; a client that stalls STREAM_SEND_TIMEOUT is gone.
    A client gone kills nothing unless the request said kill_on_disconnect."""

    def __init__(self, handler):
        import codecs

        self.handler = handler
        self.sock = handler.connection
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.kill_on_disconnect = False
        self.started = False
        self.gone = False

    def begin(self):
        self.started = True
        head = ("HTTP/1.1 200 OK\r\nServer: %s\r\nContent-Type: application/x-ndjson\r\n"
                "Transfer-Encoding: chunked\r\nCache-Control: no-store\r\n\r\n"
                % self.handler.server_version)
        self._send(head.encode("latin-1"))

    def _send(self, data):
        if self.gone:
            return
        try:
            self.sock.settimeout(STREAM_SEND_TIMEOUT)
            self.handler.wfile.write(data)
        except OSError:  # socket.timeout included: the reader stalled
            self.gone = True
            self.handler.close_connection = True

    def line(self, obj):
        data = json_bytes(obj) + b"\n"
        self._send(b"%x\r\n%s\r\n" % (len(data), data))

    def output(self, data):
        text = self.decoder.decode(data)
        if text:
            self.line({"output": text})

    def finish(self, last):
        rest = self.decoder.decode(b"", True)
        if rest:
            self.line({"output": rest})
        self.line(last)
        self._send(b"0\r\n\r\n")
        try:
            self.sock.settimeout(IDLE_TIMEOUT)
        except OSError:
            pass

    def abandoned(self):
        """Whether the command should end because its client is gone (asked for only)."""
        if not self.kill_on_disconnect:
            return False
        if not self.gone:
            try:
                readable = select.select([self.sock], [], [], 0)[0]
                # Readable with nothing to read is the client's FIN (or a reset).
                if readable and not self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                    self.gone = True
            except (BlockingIOError, InterruptedError):
                pass
            except (OSError, ValueError):
                self.gone = True
            if self.gone:
                self.handler.close_connection = True
        return self.gone


class Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True
    request_queue_size = 128
    budget = None  # a ConnBudget, set in main()
    listen_socket = None  # already bound and listening (the pod's launcher), or None

    def server_bind(self):
        # Not HTTPServer.server_bind: its server_name is socket.getfqdn(), a host lookup of the
        # address through NSS (files, then DNS) at every start, ~2 ms of CPU, for a name that
        # only CGI handlers read.
        if self.listen_socket is None:
            socketserver.TCPServer.server_bind(self)
        else:
            self.socket.close()
            self.socket = self.listen_socket
            self.server_address = self.socket.getsockname()
        self.server_name = self.server_address[0]
        self.server_port = self.server_address[1]

    def server_activate(self):
        if self.listen_socket is None:
            ThreadingHTTPServer.server_activate(self)

    def process_request(self, request, client_address):
        # In the accept thread: cheap refusals only (no thread, no read).
        if not self.budget.admit(request):
            try:
                request.setblocking(False)
                request.send(_BUSY_503)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        ThreadingHTTPServer.process_request(self, request, client_address)

    def shutdown_request(self, request):
        self.budget.release(request)
        ThreadingHTTPServer.shutdown_request(self, request)

    def handle_error(self, request, client_address):
        pass  # a client that vanished is not our error; never print a traceback


def parse_listen(value):
    m = re.match(r"^\[([0-9a-fA-F:.]*)\]:(\d+)$", value) or re.match(r"^([^:]*):(\d+)$", value)
    if not m:
        raise ValueError("--listen wants HOST:PORT or [V6]:PORT")
    return m.group(1), int(m.group(2))


def adopt_listener(sock, host, port):
    """`sock` if it listens on exactly (host, port) over TCP (port 0: any), else None (closed):
    execd then binds itself and reports its own errors."""
    if sock is None:
        return None
    try:
        ok = (sock.type == socket.SOCK_STREAM
              and sock.family == (socket.AF_INET6 if ":" in host else socket.AF_INET)
              and sock.getsockname()[0] == host and port in (0, sock.getsockname()[1])
              and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
    except OSError:
        ok = False
    if not ok:
        sock.close()
        return None
    return sock


def main(argv=None, listen_socket=None):
    """`listen_socket`: a socket the caller bound to --listen and listens on before importing
    this module (the pod's launcher): connections made while the imports run wait in its
    backlog, answered once execd serves, instead of being refused."""
    p = argparse.ArgumentParser(description="sandman execd")
    p.add_argument("--listen", default="0.0.0.0:%d" % EXECD_PORT)
    p.add_argument("--token-sha256", default=os.environ.get(EXECD_TOKEN_ENV))
    p.add_argument("--insecure-no-token", action="store_true",
                   help="serve without a token (tests only)")
    p.add_argument("--workspace", default=os.environ.get(WORKSPACE_ENV),
                   help="the shell's first cwd; /reset {\"workspace\": true} empties it")
    p.add_argument("--root", default="/", help="file routes refuse paths outside this dir")
    p.add_argument("--netguard-status",
                   default=os.environ.get(NETGUARD_STATUS_ENV, NETGUARD_STATUS_PATH))
    # Tests only: the directory /conditions reads as "/" (cgroup, mountinfo, passwd, zone).
    p.add_argument("--conditions-root", default="/", help=argparse.SUPPRESS)
    p.add_argument("--kill-grace", type=float, default=2.0,
                   help="seconds between SIGTERM and SIGKILL on a timeout")
    p.add_argument("--max-body", type=int, default=96 << 20, help="request size cap (bytes)")
    p.add_argument("--body-timeout", type=float, default=BODY_DEADLINE,
                   help="a request body must arrive within this many seconds")
    p.add_argument("--max-tree-bytes", type=int, default=TREE_MAX_BYTES,
                   help="size cap of a tree's tar, up or down (bytes)")
    # Tests only: small status reads split frames at chosen points.
    p.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS,
                   help="open connections (one thread each); over it a new one gets 503")
    p.add_argument("--max-preauth", type=int, default=MAX_PREAUTH,
                   help="connections not yet authenticated; over it the oldest is closed")
    p.add_argument("--max-header-bytes", type=int, default=MAX_HEADER_BYTES,
                   help="request line plus headers (431 above)")
    p.add_argument("--header-timeout", type=float, default=HEADER_TIMEOUT,
                   help="seconds from a request's first byte to the end of its headers")
    p.add_argument("--preauth-idle", type=float, default=PREAUTH_IDLE,
                   help="idle seconds allowed to a connection that has not authenticated")
    p.add_argument("--status-read-size", type=int, default=4096, help=argparse.SUPPRESS)
    p.add_argument("--verbose", action="store_true")
    baseline_args(p)
    args = p.parse_args(argv)
    if args.token_sha256:
        args.token_sha256 = args.token_sha256.strip().lower()
        if not _SHA256_HEX.match(args.token_sha256):
            sys.stderr.write("execd: the token hash must be 64 hex characters\n")
            return 2
    elif args.insecure_no_token:
        args.token_sha256 = None
    else:
        sys.stderr.write("execd: no token hash (%s or --token-sha256); refusing to start "
                         "(--insecure-no-token overrides)\n" % EXECD_TOKEN_ENV)
        return 2
    if args.baseline_scope not in BASELINE_SCOPES:
        sys.stderr.write("execd: %s=%r: must be listed or root; refusing to start\n"
                         % (EXECD_BASELINE_SCOPE_ENV, os.environ.get(EXECD_BASELINE_SCOPE_ENV)))
        return 2
    host, port = parse_listen(args.listen)
    if args.workspace:
        args.workspace = os.path.realpath(args.workspace)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    daemon = Daemon(args)
    Handler.daemon = daemon
    daemon.baseline = Baseline(daemon, args)
    if args.baseline_at_start == "on":
        try:  # before serving: the first holder must not act before the baseline exists
            daemon.baseline.record()
        except (OSError, HTTPError) as e:
            sys.stderr.write("execd: no reuse baseline: %s\n" % (getattr(e, "message", e),))
    Server.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
    Server.budget = ConnBudget(args.max_connections, min(args.max_preauth,
                                                         args.max_connections))
    Server.listen_socket = adopt_listener(listen_socket, host, port)
    srv = Server((host, port), Handler)
    stopping = threading.Event()

    def stop(signum, frame):
        # Leave nothing behind: the shell and everything it started go with us.
        stopping.set()
        try:
            daemon.kill_sandbox()
        finally:
            os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    def reap_loop():
        while not stopping.wait(0.5):
            daemon.reaper.reap()

    threading.Thread(target=reap_loop, daemon=True).start()
    addr = srv.server_address
    sys.stderr.write("execd %s listening on %s:%d (pid %d, %s)\n" % (
        VERSION, addr[0], addr[1], os.getpid(), daemon.subreaper or "no subreaper"))
    sys.stderr.flush()
    threading.Thread(target=daemon.make_undumpable, daemon=True).start()
    try:
        srv.serve_forever(poll_interval=0.5)
    finally:
        daemon.kill_sandbox()
    return 0


if __name__ == "__main__":
    sys.exit(main())
