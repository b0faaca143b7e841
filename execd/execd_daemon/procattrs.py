"""execd's own process attributes, for checked reuse: its rlimits and oom_score_adj (one per
process) and each thread's nice, scheduling policy and CPU affinity (per thread on Linux).

A holder running as execd's uid can change them against execd's pid or any of its threads
(`prlimit --pid`, `renice`, `chrt`, `taskset`, /proc/<pid>/oom_score_adj), and every shell or
process execd starts later inherits them from the thread that starts it: the next holder's
correct patch would grade failed. The baseline records them, /diff compares them and /restore
puts back what the kernel allows; what it does not (a hard limit raised, nice or policy raised
back, oom_score_adj lowered, all without the capability) is named in `left`, which retires the
pod. Syscalls only: no file but oom_score_adj and the autogroup is read, no process started.

The autogroup (/proc/<pid>/autogroup, one per session) is execd's alone, as each shell gets
its own (setsid); the holder can raise its nice, which starves execd of CPU beside every other
session."""

import os
import resource
import sys
import time

from .conditions import cpuset

OOM_SCORE_ADJ = "/proc/self/oom_score_adj"
AUTOGROUP = "/proc/self/autogroup"  # absent without CONFIG_SCHED_AUTOGROUP


def _limits():
    """(name, resource) for every rlimit the kernel has, RLIMIT_LOCKS included (the module
    lacks it; 10 on every Linux architecture)."""
    out, seen = [], set()
    for name in sorted(dir(resource)):
        if name.startswith("RLIMIT_") and name != "RLIMIT_OFILE":  # OFILE: NOFILE's old name
            num = getattr(resource, name)
            if num not in seen:
                seen.add(num)
                out.append((name[7:].lower(), num))
    if sys.platform.startswith("linux") and 10 not in seen:
        out.append(("locks", 10))
    return out


LIMITS = _limits()
# ioprio_get, ioprio_set (no stdlib call): the I/O class every later process inherits.
_IOPRIO_CALLS = {"x86_64": (252, 251), "aarch64": (31, 30)}
IOPRIO_WHO_PROCESS = 1


def _ioprio_calls():
    """(syscall, get, set), or why not: a Python without ctypes (Debian's python3-minimal)."""
    nums = _IOPRIO_CALLS.get(os.uname().machine)
    if nums is None:
        return "no ioprio syscall numbers for %s" % os.uname().machine
    try:
        import ctypes

        return (ctypes.CDLL(None, use_errno=True).syscall,) + nums
    except (ImportError, OSError) as e:
        return "no ctypes: %s" % (e,)


_IOPRIO = None


def _ioprio(tid, value=None):
    """A thread's I/O priority, or set it (OSError on failure); None where it cannot be read."""
    global _IOPRIO
    if _IOPRIO is None:
        _IOPRIO = _ioprio_calls()
    if isinstance(_IOPRIO, str):
        return None
    call, get, put = _IOPRIO
    if value is None:
        r = call(get, IOPRIO_WHO_PROCESS, tid)
        return r if r >= 0 else None
    if call(put, IOPRIO_WHO_PROCESS, tid, value) != 0:
        import ctypes

        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return value


def _thread(tid):
    """(nice, policy, priority, cpus, ioprio) of one thread; None once it has exited."""
    try:
        return (os.getpriority(os.PRIO_PROCESS, tid), os.sched_getscheduler(tid),
                os.sched_getparam(tid).sched_priority, frozenset(os.sched_getaffinity(tid)),
                _ioprio(tid))
    except OSError:  # ESRCH: the thread ended between the listing and the call
        return None


def _oom():
    try:
        with open(OOM_SCORE_ADJ, "rb") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _autogroup():
    """The autogroup's nice ("/autogroup-7 nice 0"), None where the kernel has none."""
    try:
        with open(AUTOGROUP, "rb") as f:
            return int(f.read().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def _set_autogroup(nice):
    """Write it; the kernel takes one write per 100 ms from a writer without CAP_SYS_ADMIN
    (EAGAIN), node-wide, so a few tries."""
    for i in range(10):
        try:
            with open(AUTOGROUP, "w") as f:
                f.write(str(nice))
            return
        except BlockingIOError:
            if i == 9:
                raise
            time.sleep(0.11)


def read():
    """The attributes as they are now."""
    limits = {}
    for name, num in LIMITS:
        try:
            limits[name] = resource.getrlimit(num)
        except (ValueError, OSError):
            pass
    threads = {}
    for t in os.listdir("/proc/self/task"):
        got = _thread(int(t))
        if got is not None:
            threads[int(t)] = got
    return {"rlimits": limits, "oom_score_adj": _oom(), "autogroup": _autogroup(),
            "threads": threads, "main": threads.get(os.getpid())}


def record():
    """The baseline: the attributes and the cgroup's effective cpuset."""
    out = read()
    out["cpuset"] = frozenset(cpuset()[0] or ())
    return out


def _wants(base, cur):
    """{tid: what the thread should have}. A thread of the baseline keeps its own values; a
    later one (a connection's) has the main thread's, which it inherits through the thread
    that accepted its connection. An affinity that was the whole cpuset follows the cpuset: the
    kubelet moves it (the CPU manager's shared pool), and the kernel the threads with it."""
    out, now_set = {}, None
    for tid, attrs in cur["threads"].items():
        want = base["threads"].get(tid, base["main"])
        if want is not None and want[3] != attrs[3] and want[3] == base["cpuset"]:
            if now_set is None:
                now_set = frozenset(cpuset()[0] or ())
            if now_set:
                want = want[:3] + (now_set,) + want[4:]
        out[tid] = want
    return out


def _limit(v):
    return "unlimited" if v == resource.RLIM_INFINITY else v


_THREAD_ATTRS = (("nice", lambda a: a[0]), ("sched", lambda a: [a[1], a[2]]),
                 ("affinity", lambda a: sorted(a[3])), ("ionice", lambda a: a[4]))


def changes(base, cur=None):
    """/diff's entries (kind "execd"): each rlimit, oom_score_adj, and per thread attribute
    one entry for each (old, new) pair with the threads that have it."""
    cur = cur or read()
    out = []
    for name, _ in LIMITS:
        old, new = base["rlimits"].get(name), cur["rlimits"].get(name)
        if old != new:
            out.append({"kind": "execd", "name": "rlimit " + name,
                        "old": [_limit(v) for v in old or ()],
                        "new": [_limit(v) for v in new or ()]})
    if cur["oom_score_adj"] != base["oom_score_adj"]:
        out.append({"kind": "execd", "name": "oom_score_adj", "old": base["oom_score_adj"],
                    "new": cur["oom_score_adj"]})
    if base.get("autogroup") is not None and cur.get("autogroup") != base["autogroup"]:
        out.append({"kind": "execd", "name": "autogroup", "old": base["autogroup"],
                    "new": cur.get("autogroup")})
    if isinstance(_IOPRIO, str):  # fail closed: execd cannot vouch for its threads' I/O class
        out.append({"kind": "execd", "name": "ionice", "why": "not read: %s" % _IOPRIO})
    wants = _wants(base, cur)
    for name, get in _THREAD_ATTRS:
        groups = {}
        for tid, attrs in sorted(cur["threads"].items()):
            if wants[tid] is None:
                continue
            old, new = get(wants[tid]), get(attrs)
            if old != new:
                groups.setdefault(repr((old, new)), (old, new, []))[2].append(tid)
        for old, new, tids in groups.values():
            out.append({"kind": "execd", "name": name, "old": old, "new": new, "tids": tids})
    return out


def _put_back(base, whys):
    cur = read()
    for name, num in LIMITS:
        want, now = base["rlimits"].get(name), cur["rlimits"].get(name)
        if want is None or now is None or want == now:
            continue
        try:
            resource.setrlimit(num, want)
        except (ValueError, OSError) as e:
            # Without CAP_SYS_RESOURCE a lowered hard limit stays: the soft one goes back up
            # as far as it allows.
            if _below(now[1], want[1]):
                try:
                    resource.setrlimit(num, (want[0] if not _below(now[1], want[0])
                                             else now[1], now[1]))
                except (ValueError, OSError):
                    pass
                whys["rlimit " + name] = ("hard limit %s is below the baseline's %s; raising "
                                          "it needs CAP_SYS_RESOURCE" % (_limit(now[1]),
                                                                          _limit(want[1])))
            else:
                whys["rlimit " + name] = "cannot be set back: %s" % (e,)
    if cur["oom_score_adj"] != base["oom_score_adj"] and base["oom_score_adj"] is not None:
        try:
            with open(OOM_SCORE_ADJ, "w") as f:
                f.write(str(base["oom_score_adj"]))
        except OSError as e:
            whys["oom_score_adj"] = ("%s cannot go back to %s: %s (lowering it needs "
                                     "CAP_SYS_RESOURCE)" % (cur["oom_score_adj"],
                                                            base["oom_score_adj"], e.strerror))
    want = base.get("autogroup")
    if want is not None and cur["autogroup"] != want:
        try:
            _set_autogroup(want)
        except OSError as e:
            whys["autogroup"] = ("autogroup nice %s cannot go back to %d: %s (a negative nice "
                                 "needs CAP_SYS_NICE)" % (cur["autogroup"], want, e.strerror))
    wants = _wants(base, cur)
    for tid, now in cur["threads"].items():
        want = wants[tid]
        if want is None or now == want:
            continue
        try:
            if now[1:3] != want[1:3]:
                os.sched_setscheduler(tid, want[1], os.sched_param(want[2]))
        except ProcessLookupError:
            continue
        except OSError as e:
            whys["sched"] = ("policy %d/%d cannot go back to %d/%d: %s (needs CAP_SYS_NICE)"
                             % (now[1], now[2], want[1], want[2], e.strerror))
        try:
            if now[0] != want[0]:
                os.setpriority(os.PRIO_PROCESS, tid, want[0])
        except ProcessLookupError:
            continue
        except OSError as e:
            whys["nice"] = ("nice %d cannot go back to %d: %s (lowering it needs "
                            "CAP_SYS_NICE)" % (now[0], want[0], e.strerror))
        try:
            if now[3] != want[3]:
                os.sched_setaffinity(tid, want[3])
        except ProcessLookupError:
            continue
        except OSError as e:
            whys["affinity"] = "CPU affinity cannot be set back: %s" % e.strerror
        try:
            if now[4] != want[4] and want[4] is not None:
                _ioprio(tid, want[4])
        except OSError as e:
            if e.errno == 3:  # ESRCH: the thread ended
                continue
            whys["ionice"] = "I/O priority cannot be set back: %s" % e.strerror


def _below(a, b):
    """a < b for rlimit values, where RLIM_INFINITY (-1 here) is the largest."""
    inf = resource.RLIM_INFINITY
    if b == inf:
        return a != inf
    return a != inf and a < b


def restore(base):
    """Put execd's attributes back where the kernel allows; returns `left` entries for the
    rest. Called with no process of the holder left (none can change them again) and before a
    shell starts (it would inherit them). Twice at most: a connection thread started during the
    first pass from a thread not yet put back inherits the old values."""
    whys = {}
    for _ in range(2):
        if not changes(base):
            return []
        _put_back(base, whys)
    left = changes(base)
    for c in left:
        c["why"] = whys.get(c["name"]) or c.get("why") or "differs after restore"
    return left
