"""/ready: can this sandbox fork a process and write a file now, answered within a budget."""

import errno
import os
import signal
import threading
import time

from .base import now
from .procs import exit_code_of

READY_BUDGET = 2.0  # /ready answers within this, or fails
READY_CACHE = 1.0  # at most one readiness check a second, whoever asks
READY_PROBE_PREFIX = ".sandman-ready-"  # /ready's write probe file where O_TMPFILE is missing


class ReadyCheck:
    """Is the pod still able to work: can it fork and exec a process, can it write and fsync a
    file where the agent works? /health only proves execd's HTTP thread runs; a pod whose pids
    limit is exhausted or whose disk is full also answers it (paper A44).

    One long-lived checker thread (started with execd, so the check works when no new thread
    can be created); concurrent callers share the in-flight check and a result is reused for
    READY_CACHE seconds, so the unauthenticated route cannot be used to amplify load. Never
    touches the agent's shell or the exec lock."""

    def __init__(self, daemon):
        self.d = daemon
        self.lock = threading.Lock()
        self.want = threading.Event()
        self.running = None  # Event set when the in-flight check finishes
        self.last = None  # (monotonic time done, result)
        self.pids = set()  # our probe processes: never a call's, never a reset's
        self.checks = 0
        threading.Thread(target=self._loop, name="ready-check", daemon=True).start()

    def get(self):
        with self.lock:
            if self.last is not None and now() - self.last[0] < READY_CACHE:
                return dict(self.last[1], age_s=round(now() - self.last[0], 3),
                            checks=self.checks)
            ev = self.running
            if ev is None:
                ev = self.running = threading.Event()
                self.want.set()
        if not ev.wait(READY_BUDGET):
            return {"ok": False, "error": "the readiness check did not finish within %gs (a "
                    "fork or an fsync hangs)" % READY_BUDGET}
        with self.lock:
            return dict(self.last[1], age_s=round(now() - self.last[0], 3), checks=self.checks)

    def _loop(self):
        while True:
            self.want.wait()
            self.want.clear()
            try:
                res = self.check()
            except Exception as e:  # noqa: BLE001 - a failed check, never a dead checker
                res = {"ok": False, "error": "readiness check failed: %r" % (e,)}
            with self.lock:
                self.last = (now(), res)
                ev, self.running = self.running, None
                self.checks += 1
            if ev is not None:
                ev.set()

    def check(self):
        t0 = now()
        err = self.check_fork(t0 + READY_BUDGET * 0.75)
        fork_ms = round((now() - t0) * 1000, 3)
        t1 = now()
        if err is None:
            err = self.check_disk()
        return {"ok": err is None, "error": err, "fork_ms": fork_ms,
                "disk_ms": round((now() - t1) * 1000, 3)}

    def check_fork(self, deadline):
        if self.d.retired:  # the shell binary may be the previous holder's: never run it
            return self.d.retired
        devnull = os.dup(self.d.null_fd)
        try:
            actions = [(os.POSIX_SPAWN_DUP2, devnull, fd) for fd in (0, 1, 2)]
            # Spawned and recorded under the lock: a /diff that lists the processes in between
            # waits in own_pids() for the record instead of reporting the probe as "extra".
            with self.lock:
                # Watched under the reaper's lock: a reap between the spawn and the watch (a
                # /processes/wait reaps every few ms) would take the probe's status, and the
                # check would wait out its budget and fail.
                with self.d.reaper.lock:
                    pid = os.posix_spawn(self.d.bash, [self.d.bash, "--noprofile", "--norc",
                                                       "-c", ":"], {}, file_actions=actions,
                                         setsid=True)
                    self.d.reaper.watched[pid] = None
                self.pids.add(pid)
        except OSError as e:
            return "cannot fork and exec a process: %s" % (e.strerror or e)
        finally:
            os.close(devnull)
        try:
            while True:
                st = self.d.reaper.status(pid)
                if st is not None:
                    code = exit_code_of(st)
                    return None if code == 0 else "the probe process exited %d" % code
                if now() >= deadline:
                    with self.d.reaper.lock:  # unreaped: the pid is still the probe's
                        if self.d.reaper.watched.get(pid, 0) is None:
                            try:
                                os.kill(pid, signal.SIGKILL)
                            except ProcessLookupError:
                                pass
                    return "the probe process did not finish within %gs" % (
                        READY_BUDGET * 0.75)
                time.sleep(0.002)
        finally:
            self.d.reaper.forget(pid)
            with self.lock:
                self.pids.discard(pid)

    def check_disk(self):
        """Write, fsync and drop 4 KiB on the workspace's and the temp dir's filesystems. An
        unnamed O_TMPFILE where the filesystem has it (nothing appears in the directory), else a
        `.sandman-ready-*` file unlinked at once. A read-only filesystem or a directory our user
        may not write (EROFS, EACCES) is by design, not a fault; a full disk (ENOSPC, EDQUOT),
        an I/O error or an immutable directory (EPERM) is."""
        seen = set()
        # The shell's first cwd (the pod's workingDir without --workspace) and the temp dir.
        # (Not tempfile.gettempdir(): it probes by writing and caches a fallback dir.)
        tmp = self.d.base_env.get("TMPDIR") or "/tmp"
        for path in (self.d.start_dir, tmp):
            if not path:
                continue
            try:
                dev = os.stat(path).st_dev
            except OSError as e:
                return "cannot stat %s: %s" % (path, e.strerror or e)
            if dev in seen:
                continue
            seen.add(dev)
            with self.d.probe_lock:  # the baseline walk never sees the named probe file
                err = write_probe_file(path)
            if err is not None:
                return err
        return None


def write_probe_file(path):
    data = b"\0" * 4096
    name = None
    flags = os.O_WRONLY | getattr(os, "O_CLOEXEC", 0)
    try:
        try:
            fd = os.open(path, flags | os.O_TMPFILE, 0o600)
        except (AttributeError, OSError) as e:
            if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS,
                                             errno.EACCES, errno.EPERM):
                raise
            name = os.path.join(path, "%s%d-%s" % (READY_PROBE_PREFIX, os.getpid(),
                                                    os.urandom(4).hex()))
            fd = os.open(name, flags | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
            if name is not None:
                os.unlink(name)
    except OSError as e:
        if e.errno in (errno.EROFS, errno.EACCES):
            return None
        return "cannot write and fsync a file in %s: %s" % (path, e.strerror or e)
    return None
