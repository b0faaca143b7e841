"""The attributes of the processes the baseline holds besides execd and its shell (a daemon the
image started), for checked reuse.

A holder running as their uid can lower such a process's rlimits (`prlimit --pid`), raise its
nice (`renice`), narrow its CPU affinity (`taskset`), change its `oom_score_adj` or I/O class,
or make it change its own cwd or environment (a signal it answers, ptrace where allowed): what
it starts for the next holder inherits them. The baseline records them per process (nice,
policy and affinity per thread), /diff compares them (kind "process", `name` the attribute) and
any change retires the pod: execd does not put another process's attributes back. A few /proc
reads per baseline process: the set is usually empty (a controller pod's execd is PID 1)."""

import hashlib
import os

from .procattrs import _ioprio
from .procs import proc_stat


def _text(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        return "unreadable: %s" % e.strerror


def _thread(pid, tid):
    """(nice, policy, rt priority, cpus, ioprio) from the task's stat and the affinity call."""
    stat = _text("/proc/%d/task/%d/stat" % (pid, tid))
    if not isinstance(stat, bytes):
        return None
    f = stat[stat.rfind(b")") + 2:].split()
    try:
        cpus = sorted(os.sched_getaffinity(tid))
    except OSError:
        return None
    return int(f[16]), int(f[38]), int(f[37]), cpus, _ioprio(tid)


def _cwd(pid):
    try:
        st = os.stat("/proc/%d/cwd" % pid)
        return os.readlink("/proc/%d/cwd" % pid), st.st_dev, st.st_ino
    except OSError as e:
        return "unreadable: %s" % e.strerror


def _read(pid):
    """{attribute: value} of one process; None once it has exited."""
    try:
        tids = [int(t) for t in os.listdir("/proc/%d/task" % pid)]
    except OSError:
        return None
    env = _text("/proc/%d/environ" % pid)
    out = {"rlimit": _text("/proc/%d/limits" % pid),
           "oom_score_adj": _text("/proc/%d/oom_score_adj" % pid),
           "environment": hashlib.sha256(env).hexdigest() if isinstance(env, bytes) else env,
           "cwd": _cwd(pid), "threads": {}}
    for tid in tids:
        got = _thread(pid, tid)
        if got is not None:
            out["threads"][tid] = got
    return out


def record(procs):
    """procs: {pid: start ticks} of the baseline (reuse.py's processes())."""
    return {pid: (start, _read(pid)) for pid, start in procs.items()}


_THREAD = (("nice", 0), ("sched", slice(1, 3)), ("affinity", 3), ("ionice", 4))


def changes(base):
    """/diff's entries: one per attribute changed, for each baseline process still alive as
    the same process (one that exited is the process set's `exited`)."""
    out = []
    for pid, (start, old) in sorted((base or {}).items()):
        s = proc_stat(pid)
        if old is None or s is None or s[2] != start:
            continue
        new = _read(pid)
        if new is None:
            continue
        names = [k for k in ("rlimit", "oom_score_adj", "environment", "cwd")
                 if old[k] != new[k]]
        both = set(old["threads"]) & set(new["threads"])  # a thread may start or end
        for name, i in _THREAD:
            if any(old["threads"][t][i] != new["threads"][t][i] for t in both):
                names.append(name)
        for name in names:
            out.append({"kind": "process", "pid": pid, "name": name, "change": "changed"})
    return out


def restore(base):
    """Nothing put back: every change is `left` (the pod is retired)."""
    left = changes(base)
    for c in left:
        c["why"] = "%s of baseline process %d changed; not put back" % (c["name"], c["pid"])
    return left
