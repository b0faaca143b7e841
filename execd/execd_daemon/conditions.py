"""/conditions' readers: the CPU quota, visible CPUs, memory limit, user, time zone and egress a
grader depends on, read from cgroups and /proc as the sandbox sees them."""

import os
import pwd
import re
import socket

from .base import now
from .wire import HTTPError

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
