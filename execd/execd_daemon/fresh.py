"""Fresh commands (/exec with "fresh": true): one command in a bash execd starts for it alone,
never the persistent shell, so nothing the holder did there (functions, exports, /env, cd,
traps, options) reaches it. The grader runs every step of a verdict this way.

Its environment is execd's own at start (never what /env or a restore set since), without the
variables bash reads as it starts; cwd is the body's; stdin is execd's /dev/null; it leads its
own session. When the command returns, times out, or its client hangs up, every process of
the call (its descendants, what carries its tag, and what was started since and re-parented to
execd) is killed before the answer is sent: nothing it started outlives the call. bash itself
reports the command's status on a socket and waits to be killed last, so a process that waits
for the command's end to act (say, to rewrite a report) is dead before it ends."""

import os
import select
import signal
import socket
import time

from .base import SHELL_STARTUP_VARS, TAG_VAR, now, sh_quote
from .procs import boot_ticks, exit_code_of
from .shell import Capture
from .wire import HTTPError

# bash -c takes the command as one argument: under the kernel's 128 KiB for one.
FRESH_COMMAND_MAX = 96 << 10
KILL_ROUNDS_S = 5.0  # a tree that forks while it is killed: rounds for at most this long
STATUS_FD = 9  # bash writes the command's status here (a socket: not reopened via /proc)
HOLD_FD = 8  # bash waits on this one until execd killed the call's other processes
_SIGDEF = [signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM,
           signal.SIGHUP, signal.SIGCHLD, signal.SIGUSR1, signal.SIGUSR2]


def check_cwd(cwd):
    if not isinstance(cwd, str) or not cwd.startswith("/") or "\0" in cwd or len(cwd) > 4096:
        raise HTTPError(400, "a fresh command needs cwd: an absolute path")
    if not os.path.isdir(cwd):
        raise HTTPError(400, "cwd %s is not a directory" % cwd[:300])
    return cwd


def hung_up(sock):
    """Whether the client closed its end (readable with nothing to read is its FIN)."""
    try:
        if not select.select([sock], [], [], 0)[0]:
            return False
        return not sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return False
    except (OSError, ValueError):
        return True


def start_env(d, tag):
    """(environment bash starts with, exports for the command): execd's start environment;
    BASH_ENV and ENV dropped, the loader's variables exported after bash started (as the
    shell does)."""
    env = dict(d.start_env)
    for k in ("BASH_ENV", "ENV"):
        env.pop(k, None)
    env[TAG_VAR] = tag
    late = [(k, env.pop(k)) for k in SHELL_STARTUP_VARS if k in env]
    exports = b"".join(b"builtin export %s=%s\n" % (k.encode(), sh_quote(
        v.encode("utf-8", "surrogatepass"))) for k, v in late)
    return env, exports


def _socketpair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return a.detach(), b.detach()


def run_fresh(d, data, timeout, max_output, idle, cwd, sock):
    """Run `data` (bytes) in a fresh bash in `cwd`; /exec's answer. Called under exec_lock."""
    if len(data) > FRESH_COMMAND_MAX:
        raise HTTPError(400, "a fresh command is at most %d bytes" % FRESH_COMMAND_MAX)
    t0 = now()
    since = boot_ticks()
    d.calls += 1
    tag = "%s-f%d" % (d.instance, d.calls)
    env, exports = start_env(d, tag)
    # The command runs without the status and hold sockets; `exit` in it ends bash at once.
    script = b"".join((
        exports, b"builtin cd -- ", sh_quote(os.fsencode(cwd)), b" || builtin exit 126\n{ ",
        data, b"\n} %d>&- %d<&-\nbuiltin printf '%%d\\n' $? >&%d\n" % (
            STATUS_FD, HOLD_FD, STATUS_FD),
        b"builtin read -r -u %d __sm_x\n" % HOLD_FD))
    bash = os.fsencode(d.bash)
    r, w = os.pipe()
    st_r, st_w = _socketpair()
    hold_r, hold_w = _socketpair()
    devnull = os.dup(d.null_fd)
    actions = [(os.POSIX_SPAWN_DUP2, devnull, 0), (os.POSIX_SPAWN_DUP2, w, 1),
               (os.POSIX_SPAWN_DUP2, w, 2), (os.POSIX_SPAWN_DUP2, st_w, STATUS_FD),
               (os.POSIX_SPAWN_DUP2, hold_r, HOLD_FD)]
    try:
        with d.reaper.lock:  # not reaped before it is watched
            pid = os.posix_spawn(bash, [bash, b"--noprofile", b"--norc", b"-c", script], env,
                                 file_actions=actions, setsid=True, setsigdef=_SIGDEF,
                                 setsigmask=[])
            d.reaper.watched[pid] = None
    except OSError as e:
        for fd in (r, st_r, hold_w):
            os.close(fd)
        raise HTTPError(500, "spawn failed: %s" % (e.strerror or e)) from None
    finally:
        for fd in (w, st_w, hold_r, devnull):
            os.close(fd)
    try:
        return _wait(d, pid, tag, since, r, st_r, t0, timeout, max_output, idle, sock)
    finally:
        for fd in (r, st_r, hold_w):
            os.close(fd)
        d.reaper.forget(pid)


def _wait(d, pid, tag, since, r, st_r, t0, timeout, max_output, idle, sock):
    cap = Capture(max_output)
    os.set_blocking(r, False)
    os.set_blocking(st_r, False)
    poller = select.poll()
    poller.register(r, select.POLLIN)
    poller.register(st_r, select.POLLIN)
    pidfd = None
    pidfd_open = getattr(os, "pidfd_open", None)  # 3.9+: bash's end wakes the poll at once
    if pidfd_open is not None:
        try:
            pidfd = pidfd_open(pid)
            poller.register(pidfd, select.POLLIN)
        except OSError:
            pidfd = None
    deadline = t0 + timeout
    idle_at = t0 + idle if idle else None
    seen = 0
    ended = None
    st = None
    code = None  # the command's status, as bash reported it
    frame = bytearray()
    last_look = t0
    try:
        while True:
            poller.poll(50)
            _drain(r, cap)
            code = _status(st_r, frame)
            if code is not None:
                break
            st = d.reaper.status(pid)
            if st is not None:
                break
            t = now()
            if idle_at is not None and cap.total != seen:
                seen, idle_at = cap.total, t + idle
            if t >= deadline:
                ended = "timeout"
            elif idle_at is not None and t >= idle_at:
                ended = "idle"
            elif sock is not None and t - last_look >= 0.05:
                last_look = t
                if hung_up(sock):
                    ended = "disconnect"
            if ended is not None:
                break
    finally:
        if pidfd is not None:
            os.close(pidfd)
    _kill_tree(d, pid, tag, since)
    # Every writer of the pipe is dead: what is left in it, then EOF.
    end = now() + 2.0
    while now() < end and _drain(r, cap):
        select.select([r], [], [], 0.01)
    if code is None:
        st = d.reaper.status(pid) if st is None else st
        code = exit_code_of(st) if st is not None else -1
    result = {"exit_code": code, "output": cap.text(), "truncated": cap.truncated,
              "error": None}
    if ended == "timeout":
        result["exit_code"] = 124
        result["error"] = "timeout after %gs; the command's processes were killed" % timeout
    elif ended == "idle":
        result["exit_code"] = 124
        result["error"] = ("timeout: no output for %gs (idle_timeout); the command's processes "
                           "were killed" % idle)
    elif ended == "disconnect":
        result["exit_code"] = -1
        result["error"] = "the client went away; the command's processes were killed"
    result["duration_ms"] = round((now() - t0) * 1000.0, 3)
    return result


def _status(st_r, frame):
    """The status bash reported (decimal 0-255 and a newline), or None while there is none
    (an invalid frame is none: bash's exit status counts then)."""
    try:
        frame += os.read(st_r, 16)
    except (BlockingIOError, InterruptedError, OSError):
        pass
    if not frame.endswith(b"\n"):
        return None
    text = bytes(frame[:-1])
    if not text.isdigit() or len(text) > 3 or int(text) > 255:
        return None
    return int(text)


def _drain(r, cap):
    """Read what the pipe holds; False at EOF."""
    for _ in range(64):
        try:
            data = os.read(r, 1 << 16)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False
        if not data:
            return False
        cap.add(data)
    return True


def _kill_tree(d, pid, tag, since):
    """SIGKILL the call's processes in rounds until none is left, then its bash (the reaper's
    lock held: unreaped, the pid is still ours): bash ends last."""
    end = now() + KILL_ROUNDS_S
    while True:
        pids = d.call_pids(tag, pid, since)
        if not pids:
            break
        d.kill_pids(pids, signal.SIGKILL)
        if now() > end:
            break
        time.sleep(0.005)
        d.reaper.reap()
    with d.reaper.lock:
        if d.reaper.watched.get(pid, 0) is None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    while d.reaper.status(pid) is None and now() < end + 1.0:
        time.sleep(0.002)
