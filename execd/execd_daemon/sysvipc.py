"""SysV IPC objects of the sandbox's IPC namespace, for checked reuse.

Shared memory segments, message queues and semaphore arrays outlive the processes that made
them (a segment stays charged to the pod's memory cgroup, a queue keeps its messages), and a
pod's containers share one IPC namespace of their own. The baseline records what
/proc/sysvipc lists, /diff names any object added, removed or changed since, and /restore
removes every added one (IPC_RMID) once the holder's processes are gone. An object of the
baseline removed or changed cannot be made again: it is left, which retires the pod. In the
node's own IPC namespace (hostIPC, or execd run outside a pod) objects are never removed,
since they may be anyone's: they are only reported."""

import os

KINDS = (("shm", "shmid"), ("msg", "msqid"), ("sem", "semid"))
# What must not move on an object of the baseline: its key, mode and owners, its last change
# (IPC_SET, a semaphore's SETVAL/SETALL), its size and a queue's messages.
_KEPT = ("key", "perms", "size", "nsems", "qnum", "cbytes", "uid", "gid", "cuid", "cgid",
         "ctime")
IPC_RMID = 0
INIT_IPC_NS_INO = 0xEFFFFFFF  # PROC_IPC_INIT_INO: the inode of the node's initial namespace


def read(root="/proc/sysvipc"):
    """{(kind, id): the kept fields} of every object the namespace lists."""
    out = {}
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


def changes(base, cur=None):
    """/diff's entries (kind "ipc"): name shm, msg or sem, id, and added, removed or changed."""
    cur = read() if cur is None else cur
    out = []
    for k in sorted(set(base) | set(cur)):
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
        "changed": "an object of the baseline was changed; it cannot be set back"}


def restore(base):
    """Remove every object the baseline did not have; `left` entries for what remains."""
    added = [k for k in read() if k not in base]
    whys = {}
    if added:
        if _own_namespace():
            whys = _remove(added)
        else:
            whys = {k: "the IPC namespace is the node's, not the pod's: not removed"
                    for k in added}
    return [{"kind": "ipc", "name": c["name"], "id": c["id"],
             "why": whys.get((c["name"], c["id"]), _WHY[c["change"]])} for c in changes(base)]
