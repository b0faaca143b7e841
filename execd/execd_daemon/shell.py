"""The persistent bash and its protocol: requests on one socket, exit-status frames on another,
syntax-checked before anything runs, and the output captured apart from the frames.

The request, status and diagnostic channels are sockets, not pipes, and every command runs with
them closed: a job a command leaves behind can neither inherit them nor open them again through
/proc/<shell>/fd (a pipe can be reopened there by anyone of the uid; a socket cannot), so it can
neither take a later call's request nor answer its status."""

import fcntl
import os
import re
import select
import signal
import socket
import stat
import time

from .base import PIPE_SIZE, READ_SIZE, SHELL_STARTUP_VARS, TAG_VAR, now, sh_quote
from .procs import freeze, group_states, proc_stat

STATUS_FD = 62  # the shell writes exit-status frames here, apart from the command's output
DIAG_W_FD = 61  # syntax-check diagnostics go into this socket...
DIAG_R_FD = 60  # ...and `read -t 0` on its other end tells bash, without a process, if any came
NULL_FD = 59  # /dev/null as execd opened it: every command's stdin (bash reads requests on 0)
# What a command runs with, after the check: stdin from NULL_FD, the shell's channels closed
# (bash keeps its own copies close-on-exec and puts them back once the command is done).
COMMAND_REDIRECTS = b"0<&59 59<&- 60<&- 61>&- 62>&-"
_DIAG_PREFIX = re.compile(r"^[^:]*: (?:eval: )?line ")
_LINE_NO = re.compile(r"\bline (\d+)")
# Sent to the frozen shell when its command is killed: its trap skips the rest of the command.
# A real-time signal (SIGRTMIN+8), so no command's own `trap ... USR2` takes it over by chance.
ABORT_SIGNAL = getattr(signal, "SIGRTMIN", 34) + 8
# read, readv, pread64, open, openat as /proc/<pid>/syscall numbers them: the shell blocked on
# its own input (a substitution, `$(< fifo)`, a redirection's FIFO).
_INPUT_CALLS = {"x86_64": {"0", "19", "17", "2", "257"},
                "aarch64": {"63", "65", "67", "56"}}.get(os.uname().machine)
EXPANSION_KILLED = ("the shell was blocked reading what the kill ended ($(...), `...`, <(...), "
                    "a FIFO), so it was killed too: bash would have run the command it was "
                    "expanding; a new shell was started, state lost")
# bash's job notice ("bash: line 3: 4242 Killed   sleep 9"): a pid, then a capitalised status.
# A parse diagnostic goes on in lower case ("syntax error", "warning", "unexpected EOF").
_JOB_NOTICE = re.compile(r"^[^:]*: (?:line \d+: )?\s*\d+ [A-Z]")

# Shell-side helpers. The check parses the whole command with `set -n` inside eval: nothing runs
# (a `x; }; cmd` escape is parsed, not executed), an open quote or heredoc ends at the string's
# end instead of waiting for more input, and `local -` turns noexec off again on return.
# noexec stays on until that function returns, so __sm_chk1 does nothing after the eval.
# Any diagnostic (bash only *warns* on an unterminated heredoc) counts as a refusal.
BOOTSTRAP = r"""
BASH_ARGV0=bash
__sm_k=0 __sm_t=0 __sm_r=0 __sm_a=0
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
  __sm_r=0
  if ((__sm_a)); then
    __sm_a=0; builtin trap - DEBUG; builtin eval "$__sm_tr"
    [[ $__sm_o == *D* ]] || builtin shopt -u extdebug
    for __sm_tr in e T E x; do [[ $__sm_o != *$__sm_tr* ]] || builtin set -$__sm_tr; done
  fi
  case $- in *x*) builtin set +x; __sm_t=1;; *) __sm_t=0;; esac
  ((__sm_k)) && builtin printf '%%sS%%d\n' "$__sm_m" "$1" >&%(st)d
  __sm_k=0; builtin set +v
}
# A killed command (execd froze it, killed all of it but this shell, then sent ABORT_SIGNAL):
# every further command of it is skipped (extdebug: a DEBUG trap that fails skips the command;
# set -T: inside functions too) and every loop broken, until __sm_fin. errexit is off and the
# ERR and RETURN traps cleared meanwhile, so nothing acts on a skip; __sm_fin puts them back.
# A no-op when no command runs (__sm_r) or the command is already framing.
__sm_ab() {
  ((__sm_r && !__sm_a)) && [[ ${FUNCNAME[1]-} != __sm_fin ]] || return 1
  __sm_a=1 __sm_o=$-
  builtin shopt -q extdebug && __sm_o+=D
  __sm_tr=$(builtin trap -p ERR RETURN)
  builtin trap - ERR RETURN; builtin set +ex; builtin shopt -s extdebug
}
builtin trap '__sm_ab && builtin trap '\''if [[ $BASH_COMMAND == "__sm_fin "* || ${FUNCNAME-} == __sm_fin ]]; then builtin trap - DEBUG; else builtin break 999 2>&-; builtin false; fi'\'' DEBUG' %(abort)d
__sm_c=')'; __sm_chk1; __sm_c=
builtin printf '%%sR0\n' "$1" >&%(st)d
builtin set --
"""


def _socketpair():
    """Two connected stream sockets as plain fds, close-on-exec (posix_spawn's dup2 clears
    that on the copy the shell gets)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return a.detach(), b.detach()


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


class ShellDead(Exception):
    pass


class Shell:
    def __init__(self, daemon):
        self.d = daemon
        self.pid = None
        self.started = None
        self.fds = []
        self.note = None  # why it started elsewhere than the workspace; said by its first call
        self.own = set()  # (dev, ino) of its channels and /dev/null

    def spawn(self, bash):
        d = self.d
        in_r, in_w = _socketpair()
        out_r, out_w = os.pipe()
        st_r, st_w = _socketpair()
        dg_r, dg_w = _socketpair()
        devnull = os.dup(d.null_fd)
        try:
            fcntl.fcntl(out_r, 1031, PIPE_SIZE)  # F_SETPIPE_SZ: fewer wakeups under floods
        except OSError:
            pass
        env = dict(d.base_env)
        env.pop(TAG_VAR, None)
        # Read by bash or the dynamic loader as the shell starts: the files they name may be
        # the previous holder's (a grading pod), so the shell starts without them and exports
        # them for its commands once it runs (below).
        startup = [(k, env.pop(k)) for k in SHELL_STARTUP_VARS if k in env]
        actions = [
            (os.POSIX_SPAWN_DUP2, in_r, 0),
            (os.POSIX_SPAWN_DUP2, devnull, NULL_FD),
            (os.POSIX_SPAWN_DUP2, out_w, 1),
            (os.POSIX_SPAWN_DUP2, out_w, 2),
            (os.POSIX_SPAWN_DUP2, st_w, STATUS_FD),
            (os.POSIX_SPAWN_DUP2, dg_r, DIAG_R_FD),
            (os.POSIX_SPAWN_DUP2, dg_w, DIAG_W_FD),
        ]
        sigs = [signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM,
                signal.SIGHUP, signal.SIGCHLD, signal.SIGUSR1, signal.SIGUSR2, ABORT_SIGNAL]
        ready = b"@ready" + os.urandom(4).hex().encode()
        # What the shell reads that is its own: channels and /dev/null (expanding()).
        self.own = {(s.st_dev, s.st_ino) for s in map(os.fstat, (in_r, st_w, dg_r, dg_w,
                                                                  devnull))}
        try:
            pid = os.posix_spawn(
                bash, [bash, "--noprofile", "--norc", "-s", ready.decode()],
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
                              "tag": TAG_VAR, "abort": ABORT_SIGNAL}
        cwd = d.start_dir
        if not os.path.isdir(cwd):
            # Removed within a holding (the restore puts it back): a shell in / that says so
            # beats one in a deleted directory, or none.
            self.note = "the workspace %s is gone; the shell started in /" % cwd
            cwd = "/"
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

    def resume(self):
        """SIGCONT to the shell if something of the uid stopped it (a job a command left can
        SIGSTOP its parent): a stopped shell would time out every later call."""
        st = proc_stat(self.pid) if self.pid is not None else None
        if st is not None and st[1] == "T":
            self.unreaped(lambda: os.kill(self.pid, signal.SIGCONT))

    def unreaped(self, send):
        """Run `send` (a signal to the shell or to its group) only while the shell is unreaped,
        under the reaper's lock: a reaped pid is free, and with pid_max at 32768 another
        process takes it within minutes; a group signal then stops a stranger's processes.
        Returns whether it was sent."""
        r = self.d.reaper
        with r.lock:
            if self.pid is None or r.watched.get(self.pid, 0) is not None:
                return False
            try:
                send()
            except ProcessLookupError:
                pass
            return True

    def freeze(self, find):
        """Stop the shell's process group at once (a fork racing a group signal is restarted
        by the kernel) and whatever `find()` returns, the call's processes in other groups and
        sessions too, in rounds until none is new: a stopped process forks no more. Returns
        the group's processes that were stopped already (a job the agent stopped): thaw()
        leaves them so."""
        if not self.unreaped(lambda: None):
            freeze(find)  # the shell is gone: its group number may be a stranger's
            return set()
        held = {p for p, st in group_states(self.pid).items() if st == "T"}
        held.discard(self.pid)
        self.unreaped(lambda: freeze(lambda: (), self.pid))
        freeze(find)
        return held

    def expanding(self):
        """Why the stopped shell must die with its killed command, or None: it is blocked in
        read(2) or open(2) itself, so expanding a `$(...)`, backticks, `<(...)` or `$(< f)`
        (or a builtin reading one). bash takes no trap between an expansion and its command,
        and no signal makes it drop one: once what it reads dies, the command runs with what
        was printed. Where /proc does not name the call, holding a pipe, FIFO, socket or
        device to read that is none of the shell's own is enough."""
        pid = self.pid
        for _ in range(200):  # SIGSTOP lands when the shell next leaves the kernel
            st = proc_stat(pid)
            if st is None or st[1] != "S" and st[1] != "R":
                break
            time.sleep(0.001)
        try:
            with open("/proc/%d/syscall" % pid) as f:
                call = f.read().split(None, 1)[0]
        except (OSError, IndexError):
            call = None
        if call is not None and _INPUT_CALLS is not None:
            return EXPANSION_KILLED if call in _INPUT_CALLS else None
        try:
            fds = os.listdir("/proc/%d/fd" % pid)
        except OSError:
            return None
        for fd in fds:
            try:
                st = os.stat("/proc/%d/fd/%s" % (pid, fd))
                with open("/proc/%d/fdinfo/%s" % (pid, fd)) as f:
                    flags = [ln for ln in f.read().splitlines() if ln.startswith("flags:")]
                mode = int(flags[0].split()[1], 8) & os.O_ACCMODE
            except (OSError, IndexError, ValueError):
                continue
            kind = stat.S_IFMT(st.st_mode)
            if mode != os.O_WRONLY and kind in (stat.S_IFIFO, stat.S_IFSOCK, stat.S_IFCHR) \
                    and (st.st_dev, st.st_ino) not in self.own:
                return EXPANSION_KILLED
        return None

    def abort(self):
        """Make the (stopped) shell skip the rest of its command once continued: BOOTSTRAP."""
        self.unreaped(lambda: os.kill(self.pid, ABORT_SIGNAL))

    def thaw(self, held):
        """SIGCONT to the shell and to whatever of its group freeze() stopped and left alive."""
        def cont():
            for p in group_states(self.pid):
                if p not in held:
                    try:
                        os.kill(p, signal.SIGCONT)
                    except ProcessLookupError:
                        pass
        self.unreaped(cont)

    def exit_status(self):
        return self.d.reaper.status(self.pid)

    def dead(self):
        return self.exit_status() is not None

    def kill(self):
        if self.pid is None:
            return
        self.unreaped(lambda: os.kill(self.pid, signal.SIGKILL))
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
