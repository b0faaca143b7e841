"""SysV IPC objects made as a holder's code would make them: ctypes into libc, no util-linux.

`make`: a 1 MiB shared memory segment (written, so its pages are charged to the memory cgroup),
a message queue holding one message, and a semaphore array; prints `shm ID`, `msg ID`, `sem ID`.
`hold`: one more segment, attached, then sleeps (a process that keeps it in use).
`rm KIND ID`: removes one object (IPC_RMID).
"""

from __future__ import annotations

import ctypes
import sys
import time

IPC_PRIVATE, IPC_CREAT, IPC_RMID = 0, 0o1000, 0
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]


def check(v: int, what: str) -> int:
    if v == -1:
        raise OSError(ctypes.get_errno(), what)
    return v


def shm(size: int) -> tuple[int, int]:
    sid = check(libc.shmget(IPC_PRIVATE, ctypes.c_size_t(size), IPC_CREAT | 0o600), "shmget")
    addr = libc.shmat(sid, None, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "shmat")
    ctypes.memset(addr, 0x5A, size)
    return sid, addr


def make() -> None:
    sid, addr = shm(1 << 20)
    check(libc.shmdt(ctypes.c_void_p(addr)), "shmdt")
    mid = check(libc.msgget(IPC_PRIVATE, IPC_CREAT | 0o600), "msgget")

    class Msg(ctypes.Structure):
        _fields_ = [("mtype", ctypes.c_long), ("mtext", ctypes.c_char * 16)]

    m = Msg(1, b"left for later")
    check(libc.msgsnd(mid, ctypes.byref(m), ctypes.c_size_t(16), 0), "msgsnd")
    semid = check(libc.semget(IPC_PRIVATE, 4, IPC_CREAT | 0o600), "semget")
    print(f"shm {sid}\nmsg {mid}\nsem {semid}", flush=True)


def hold() -> None:
    sid, _ = shm(1 << 16)
    print(f"shm {sid}", flush=True)
    time.sleep(300)


def rm(kind: str, oid: int) -> None:
    if kind == "shm":
        check(libc.shmctl(oid, IPC_RMID, None), "shmctl")
    elif kind == "msg":
        check(libc.msgctl(oid, IPC_RMID, None), "msgctl")
    else:
        check(libc.semctl(oid, 0, IPC_RMID), "semctl")


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make()
    elif sys.argv[1] == "hold":
        hold()
    else:
        rm(sys.argv[2], int(sys.argv[3]))
