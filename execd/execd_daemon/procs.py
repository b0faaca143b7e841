"""Processes as /proc shows them: stat, tags, command lines, trees, and the reaper that collects
exit statuses of the children execd adopts as a subreaper."""

import collections
import os
import signal
import sys
import threading
import time

from .base import PR_SET_CHILD_SUBREAPER, PR_SET_DUMPABLE, TAG_VAR

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


def group_states(pgid):
    """{pid: state} of the live processes in process group `pgid`."""
    out = {}
    for p in all_pids():
        try:
            with open("/proc/%d/stat" % p, "rb") as f:
                data = f.read()
        except OSError:
            continue
        rest = data[data.rfind(b")") + 2:].split()
        if len(rest) > 2 and rest[2] == b"%d" % pgid and rest[0] not in (b"Z", b"X"):
            out[p] = rest[0].decode()
    return out


def freeze(find, pgid=None, rounds=500):
    """SIGSTOP group `pgid` at once, then every process `find()` returns, in rounds until a
    round finds none it has not stopped: only a process not stopped yet can fork, so the rounds
    end even under a fork loop. Nothing stopped acts on another's death before the SIGKILL.
    Returns the pids stopped by name."""
    if pgid is not None:
        try:
            os.killpg(pgid, signal.SIGSTOP)
        except (ProcessLookupError, PermissionError):
            pass
    stopped = set()
    for _ in range(rounds):
        new = set(find()) - stopped
        if not new:
            break
        for p in new:
            try:
                os.kill(p, signal.SIGSTOP)
            except (ProcessLookupError, PermissionError):
                pass
        stopped |= new
    return stopped


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


def clear_dumpable():
    """Clear the dumpable flag: /proc/<execd>/mem, /fd and /environ are then closed to the
    sandbox's processes even under execd's own uid (a pod has no CAP_SYS_PTRACE), so a process
    the agent leaves behind cannot read a holder's bearer token out of execd's memory. Its
    children are dumpable again at their execve, as always. Without ctypes (python3-minimal)
    execd stays dumpable and says so."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE)")
    except (ImportError, OSError, AttributeError) as e:
        sys.stderr.write("execd: stays dumpable (%s): the sandbox's processes can read its "
                         "memory\n" % (e,))


def become_subreaper():
    """"pid1", "subreaper" or None: how orphans of the sandbox come to execd."""
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
