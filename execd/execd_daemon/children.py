"""The child table that background processes and PTY sessions share: children with handles
(ids never reused, not guessable), one reader thread polling all their output fds, and the
forgetting that /reset and /restore do. Background and Sessions add their own requests."""

import base64
import collections
import os
import select
import threading

from .base import READ_SIZE
from .wire import HTTPError, json_bytes


class ChildTable(object):
    """id -> child (a BgProc or a PtySession), oldest first, under `lock`; `cond` (on the same
    lock) is notified whenever a child's output grows or ends. Only the reader thread closes a
    child's fd (it alone polls them): others hand it over through `closing`."""

    READER = "execd-children"  # the reader thread's name
    ID = None  # the ids' pattern (fullmatch: `$` would take a newline)
    WHAT = ("child", "c12", "gone")  # in messages: the kind, an id's prefix, how one ends
    LISTING = "children"  # the listing's key
    MAX_LIVE = 0

    def __init__(self, daemon):
        self.d = daemon
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.items = collections.OrderedDict()  # id -> child, oldest first
        self.rids = collections.OrderedDict()  # request_id -> id
        self.seq = 0
        self.closing = []  # fds the reader thread closes
        self.wake = None  # (r, w): a pipe that wakes the reader; made by the first child
        self.thread = None
        self.held = False  # a restore is killing the old holder's children: none is started

    def get(self, cid):
        kind, prefix, ended = self.WHAT
        if not isinstance(cid, str) or not self.ID.fullmatch(cid):
            raise HTTPError(400, "invalid %s id (ids look like %s-<24 hex>)" % (kind, prefix))
        c = self.items.get(cid)
        if c is None:
            raise HTTPError(404, "no %s %s in this sandbox (%s, or another sandbox's)"
                            % (kind, cid, ended), {"not_found": True})
        return c

    def listing(self):
        self.d.reaper.reap()
        with self.lock:
            items = [c.info() for c in self.items.values()]
        live = sum(1 for c in items if c["running"] or c["output_open"])
        return {self.LISTING: items, "live": live, "max_live": self.MAX_LIVE}

    def hold(self):
        """No new child until reset(): /restore kills the old holder's meanwhile."""
        with self.lock:
            self.held = True

    def reset(self):
        """After /reset or /restore killed the sandbox: forget every child (ids stay unused),
        so a next holder never sees the last one's commands, terminals or output."""
        with self.cond:
            self.held = False
            with self.d.reaper.lock:
                for c in self.items.values():
                    self.d.reaper.procs.pop(c.pid, None)
            for c in self.items.values():
                if c.fd is not None:
                    self.closing.append(c.fd)
                    c.fd = None
                c.drop()
            self.items.clear()
            self.rids.clear()
            self.forgotten()
            self.cond.notify_all()
            if self.wake is not None:
                self._poke()

    def forgotten(self):
        """Called under the lock once reset() has forgotten every child."""

    def took(self, child, data):
        """Called under the lock with output the reader took from `child`'s fd."""
        child.add(data)

    def tick(self):
        """Called by the reader thread, without the lock, after each poll (at least once a
        second)."""

    # ---- the reader thread

    def _start_reader(self):
        if self.thread is not None:
            return
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        self.wake = (r, w)
        self.thread = threading.Thread(target=self._loop, name=self.READER, daemon=True)
        self.thread.start()

    def _poke(self):
        try:
            os.write(self.wake[1], b"x")
        except OSError:
            pass  # full: the reader is awake already

    def _loop(self):
        wake = self.wake[0]
        rbuf = bytearray(READ_SIZE)
        rview = memoryview(rbuf)
        while True:
            with self.lock:
                for fd in self.closing:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
                self.closing = []
                watch = {c.fd: c for c in self.items.values() if c.fd is not None}
            poller = select.poll()
            poller.register(wake, select.POLLIN)
            for fd in watch:
                poller.register(fd, select.POLLIN)
            try:
                events = poller.poll(1000)
            except InterruptedError:
                continue
            self.tick()
            for fd, _ev in events:
                if fd == wake:
                    try:
                        os.read(wake, 4096)
                    except OSError:
                        pass
                    continue
                c = watch.get(fd)
                if c is None:
                    continue
                try:
                    # Into one buffer: a fresh 1 MiB object per read, shrunk to what came,
                    # fragmented the heap under many small reads. Outside the lock: only this
                    # thread closes the fd, so it is still this child's.
                    n = os.readv(fd, [rbuf])
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    n = 0  # EIO from a terminal: no process holds it any more
                with self.cond:
                    if c.fd != fd:
                        continue  # closed or reset meanwhile: the fd is in self.closing
                    if n:
                        self.took(c, rview[:n])
                    else:
                        os.close(fd)
                        c.fd = None
                    self.cond.notify_all()


def reply_output(handler, out, data):
    """A child's answer `out` with its output bytes as `data_b64`. The base64 is written as it
    is, not copied into a JSON string: at most the ring and its encoding in memory per call."""
    b64 = base64.b64encode(data)
    del data
    head = json_bytes(out)[:-1] + b',"data_b64":"'
    handler.send_raw(200, head, "application/json", length=len(head) + len(b64) + 2)
    handler.wfile.write(b64)
    handler.wfile.write(b'"}')
