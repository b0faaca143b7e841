"""SysV IPC objects of the sandbox's IPC namespace, for checked reuse.

Shared memory segments, message queues and semaphore arrays outlive the processes that made
them (a segment stays charged to the pod's memory cgroup, a queue keeps its messages), and a
pod's containers share one IPC namespace of their own. The baseline records what
/proc/sysvipc lists, /diff names any object added, removed or changed since, and /restore
removes every added one (IPC_RMID) once the holder's processes are gone. An object of the
baseline removed or changed cannot be made again: it is left, which retires the pod. In the
node's own IPC namespace (hostIPC, or execd run outside a pod) objects are never removed,
since they may be anyone's: they are only reported.

POSIX message queues (mq_open) are per IPC namespace too, listed where the namespace's mqueue
filesystem is mounted (a container's /dev/mqueue): each queue's inode, mode, owners, last
change (a message sent or received moves it) and its line (QSIZE, NOTIFY) are kept as kind
"mq", and an added queue is unlinked by the restore (mq_unlink is an unlink there). Where the
pod's own namespace has no such mount, the queues cannot be listed: /diff says "unlisted",
which retires the pod; outside a pod they are not watched."""

import os
import stat

KINDS = (("shm", "shmid"), ("msg", "msqid"), ("sem", "semid"))
# What must not move on an object of the baseline: its key, mode and owners, its last change
# (IPC_SET, a semaphore's SETVAL/SETALL), its size and a queue's messages.
_KEPT = ("key", "perms", "size", "nsems", "qnum", "cbytes", "uid", "gid", "cuid", "cgid",
         "ctime")
IPC_RMID = 0
INIT_IPC_NS_INO = 0xEFFFFFFF  # PROC_IPC_INIT_INO: the inode of the node's initial namespace


def read(root="/proc/sysvipc", mq=None):
    """{(kind, id): the kept fields} of every object the namespace lists; with `mq` (from
    mq_source) its queues as ("mq", name), or ("mq", "") where they cannot be listed."""
    out = _read_mq(mq) if mq is not None else {}
    for kind, id_col in KINDS:
        try:
            with open(os.path.join(root, kind), "rb") as f:
                lines = f.read().decode("ascii", "replace").splitlines()
        except OSError:  # a kernel without SysV IPC
            continue
        head = lines[0].split() if lines else []
        if id_col not in head:
            continue
        at = head.index(id_col)
        kept = [i for i, h in enumerate(head) if h in _KEPT]
        for line in lines[1:]:
            cols = line.split()
            if len(cols) == len(head):
                out[(kind, int(cols[at]))] = tuple(cols[i] for i in kept)
    return out


def mq_source(path):
    """`path` where the namespace's queues are mounted there; "" (cannot be listed) where the
    namespace is the pod's own and they are not; None (not watched) in the node's. Read once,
    by the record: a pod cannot mount or unmount."""
    from .devwatch import fs_type

    if fs_type(path) == "mqueue":
        return path
    return "" if _own_namespace() else None


def _read_mq(path):
    if not path:
        return {("mq", ""): ()}
    out = {}
    try:
        names = os.listdir(path)
        for name in names:
            fd = os.open(os.path.join(path, name), os.O_RDONLY | os.O_NOFOLLOW
                         | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                st, line = os.fstat(fd), os.read(fd, 4096)
            finally:
                os.close(fd)
            out[("mq", name)] = (st.st_ino, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid,
                                 st.st_ctime_ns, line)
    except OSError:
        return {("mq", ""): ()}
    return out


def changes(base, cur=None, mq=None):
    """/diff's entries (kind "ipc"): name shm, msg, sem or mq, id, and added, removed or
    changed (mq: "unlisted" where the queues cannot be listed)."""
    cur = read(mq=mq) if cur is None else cur
    out = []
    for k in sorted(set(base) | set(cur), key=lambda k: (k[0], str(k[1]))):
        if k == ("mq", ""):
            if k in cur:
                out.append({"kind": "ipc", "name": "mq", "id": "", "change": "unlisted"})
            continue
        if k not in base:
            change = "added"
        elif k not in cur:
            change = "removed"
        elif base[k] != cur[k]:
            change = "changed"
        else:
            continue
        out.append({"kind": "ipc", "name": k[0], "id": k[1], "change": change})
    return out


def _own_namespace():
    try:
        return os.stat("/proc/self/ns/ipc").st_ino != INIT_IPC_NS_INO
    except OSError:  # cannot tell: never remove what may be another's
        return False


def _remove(added):
    """IPC_RMID each (kind, id); {(kind, id): why} for those that failed."""
    try:
        import ctypes  # here: Debian's python3-minimal has no ctypes

        libc = ctypes.CDLL(None, use_errno=True)
    except (ImportError, OSError) as e:
        return {k: "cannot be removed without ctypes: %s" % (e,) for k in added}
    whys = {}
    for kind, oid in added:
        if kind == "mq":
            continue
        if kind == "shm":
            r = libc.shmctl(oid, IPC_RMID, None)
        elif kind == "msg":
            r = libc.msgctl(oid, IPC_RMID, None)
        else:
            r = libc.semctl(oid, 0, IPC_RMID)
        if r != 0:
            whys[(kind, oid)] = "IPC_RMID failed: %s" % os.strerror(ctypes.get_errno())
    return whys


_WHY = {"added": "still there after IPC_RMID (a segment still attached)",
        "removed": "an object of the baseline was removed; it cannot be made again",
        "changed": "an object of the baseline was changed; it cannot be set back",
        "unlisted": "the POSIX message queues cannot be listed (no mqueue mount of the pod's "
                    "IPC namespace): not vouched for"}


def restore(base, mq=None):
    """Remove every object the baseline did not have; `left` entries for what remains."""
    added = [k for k in read(mq=mq) if k not in base and k != ("mq", "")]
    whys = {}
    if added:
        if _own_namespace():
            whys = _remove(added)
            for kind, name in added:
                if kind == "mq":
                    try:
                        os.unlink(os.path.join(mq, name))
                    except OSError as e:
                        whys[(kind, name)] = "unlink failed: %s" % e.strerror
        else:
            whys = {k: "the IPC namespace is the node's, not the pod's: not removed"
                    for k in added}
    return [{"kind": "ipc", "name": c["name"], "id": c["id"],
             "why": whys.get((c["name"], c["id"]), _WHY[c["change"]])}
            for c in changes(base, mq=mq)]
