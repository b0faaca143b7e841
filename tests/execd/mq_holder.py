"""POSIX message queues made as a holder's code would make them: ctypes into libc (glibc >= 2.34
has mq_open there; librt before), no util-linux.

`make NAME`: a queue /NAME holding one message. `send NAME`: one more message on it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

lib = ctypes.CDLL(None, use_errno=True)
if not hasattr(lib, "mq_open"):
    lib = ctypes.CDLL(ctypes.util.find_library("rt"), use_errno=True)


def check(v: int, what: str) -> int:
    if v == -1:
        raise OSError(ctypes.get_errno(), what)
    return v


def main(cmd: str, name: str) -> None:
    flags = os.O_WRONLY | (os.O_CREAT if cmd == "make" else 0)
    q = check(lib.mq_open(b"/" + name.encode(), flags, 0o600, None), "mq_open")
    check(lib.mq_send(q, b"left for later", ctypes.c_size_t(14), 0), "mq_send")
    print(cmd, name, flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
