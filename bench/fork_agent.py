"""The fork bench's program in the real node's trainer pod (bench/fork.py runs it there with
`kubectl exec -i ... python3 -u -c <this file's source> <config json>`: the image ships no
bench/). Standard library and the SDK only.

It measures, as bench/fork.py's kwok part does: a warm acquire, the delta upload (`files` new
files of a repository as one `upload_tree` into /work/repo, which makes that sandbox the
parent), `fork(children)` from a warm pool of `children`; then `count` fresh acquires at once,
the checkpoint of their job and, once the host answered its `WAIT` line (every released pod
deleted), the restore. Every child's and restored sandbox's manifest (kinds, modes, link
targets and sha256 of /work) is compared with its source's. One line
`BENCH {json}` at the end.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

PREFIX = "BENCH "
# The tree the holder changed; /etc and /root also hold the kubelet's per-pod files (the
# hostname), which differ between any two pods.
MANIFEST = ("cd /; find /work -xdev -printf '%p %y %m %l\\n' | sort; "
            "find /work -xdev -type f -exec sha256sum {} + | sort")
SHELL = 'pwd; echo "${WHO-unset}"'


def timed(fn, *a, **kw):
    t = time.perf_counter()
    out = fn(*a, **kw)
    return time.perf_counter() - t, out


def wait_warm(c, image: str, n: int, size: dict, timeout: float = 600) -> None:
    """Prewarm to n and wait until n are warm (the answer counts them; the same target
    again changes nothing)."""
    deadline = time.monotonic() + timeout
    while c.prewarm(image, n, **size).warm < n:
        if time.monotonic() > deadline:
            raise SystemExit(f"fork agent: not {n} warm pods after {timeout:.0f}s")
        time.sleep(0.5)


def main() -> None:
    from sandman.client import Client

    cfg = json.loads(sys.argv[1])
    image, n_kids, count = cfg["image"], cfg["children"], cfg["count"]
    size = {"cpu": cfg["cpu"], "memory": cfg["memory"]}
    delta = tempfile.mkdtemp(prefix="delta-")
    for i in range(cfg["files"]):
        os.makedirs(f"{delta}/pkg{i % 10}", exist_ok=True)
        with open(f"{delta}/pkg{i % 10}/mod{i}.py", "w") as f:
            f.write(f"# module {i}\nVALUE = {i}\n" * 8)
    out: dict = {}
    with Client(timeout_s=300) as c:
        wait_warm(c, image, 1, size)
        out["acquire"], parent = timed(c.acquire, image, job="bench-fork", timeout_s=600,
                                       **size)
        out["acquire_warm"] = parent.warm
        out["upload"], _ = timed(parent.upload_tree, delta, "/work/repo")
        parent.exec("cd /work/repo; export WHO=parent")
        want = parent.exec(MANIFEST, timeout=300).output
        wait_warm(c, image, n_kids, size)
        out["fork"], kids = timed(parent.fork, n_kids, timeout_s=600)
        out["kids_warm"] = sum(k.warm for k in kids)
        got = [k.exec(MANIFEST, timeout=300).output for k in kids]
        out["kids_same"] = sum(g == want for g in got)
        # What differs, for the failure's message.
        out["diff"] = [sorted(set(g.splitlines()) ^ set(want.splitlines()))[:6] for g in got
                       if g != want][:1]
        out["manifest_lines"] = len(want.splitlines())
        c.prewarm(image, 0, **size)
        for sb in (*kids, parent):
            sb.release()
        say({"wait": "released"})
        sys.stdin.readline()

        def fresh(_):
            t = time.perf_counter()
            sb = c.acquire(image, job="bench-ck", warm_ok=False, timeout_s=600, **size)
            return time.perf_counter() - t, sb

        with ThreadPoolExecutor(count) as ex:
            t = time.perf_counter()
            got = list(ex.map(fresh, range(count)))
            out["fresh"] = time.perf_counter() - t
        out["fresh_each"] = [g[0] for g in got]
        sbs = [g[1] for g in got]
        wants = {}
        for i, sb in enumerate(sbs):
            sb.upload_tree(delta, "/work/repo")
            sb.exec(f"printf {i} > /work/repo/own-{i}; cd /work/repo/pkg{i % 10}; "
                    f"export WHO=sb{i}")
            wants[sb.id] = (sb.exec(MANIFEST, timeout=300).output, sb.exec(SHELL).output)
        out["checkpoint"], ck = timed(c.checkpoint, job="bench-ck", timeout_s=600)
        out["bytes"] = sum(s.bytes for s in ck.sandboxes)
        for sb in sbs:
            sb.release()
        say({"wait": "released"})
        sys.stdin.readline()
        out["restore"], back = timed(c.restore, ck.id, timeout_s=600)
        out["restored_same"] = sum(
            (sb.exec(MANIFEST, timeout=300).output, sb.exec(SHELL).output) == wants[old]
            for old, sb in back.items())
        out["restored"] = len(back)
        for sb in back.values():
            sb.release()
    say(out)


def say(obj) -> None:
    sys.stdout.write(PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
