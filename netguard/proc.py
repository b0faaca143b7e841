"""Running iptables-save/-restore: posix_spawn, pipes and poll, without `subprocess`.

`subprocess` imports signal, threading, selectors, contextlib and warnings (with their enum and
collections): ~8 ms of CPU on every guarded pod's start, paid under the pod's own quota, for
what netguard needs of it: start a program with its three pipes, feed it a few kilobytes, read
what it prints, give up after a deadline. A child that outlives its deadline is SIGKILLed and
reaped: no process is left behind, whatever the outcome.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # no stub: the C module `signal` wraps
import os
import select
import time

# subprocess's restore_signals: the interpreter ignores these, and an exec keeps what is
# ignored, so without this a tool writing to a closed pipe would not die of SIGPIPE.
_RESTORED = tuple(getattr(_signal, n) for n in ("SIGPIPE", "SIGXFZ", "SIGXFSZ")
                  if hasattr(_signal, n))
_CHUNK = 65536


def _inheritable(skip: set[int]) -> list[int]:
    out = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in skip:
            try:
                if os.get_inheritable(fd):
                    out.append(fd)
            except OSError:
                pass  # the listing's own descriptor, closed by now
    return out


class Timeout(Exception):
    """The child did not finish before the deadline; it was killed and reaped."""


class Child:
    """One started program whose stdin, stdout and stderr are pipes held by this process."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        fds: list[int] = []
        try:
            for _ in range(3):
                fds += os.pipe()  # both ends close-on-exec: only the dup2'd copies reach it
            in_r, in_w, out_r, out_w, err_r, err_w = fds
            actions: list[tuple[int, ...]] = [
                (os.POSIX_SPAWN_DUP2, in_r, 0), (os.POSIX_SPAWN_DUP2, out_w, 1),
                (os.POSIX_SPAWN_DUP2, err_w, 2)]
            # subprocess's close_fds: nothing but the three pipes reaches the tool, not even
            # a descriptor this process was handed inheritable.
            actions += [(os.POSIX_SPAWN_CLOSE, fd) for fd in _inheritable(set(fds))]
            self.pid = os.posix_spawn(argv[0], argv, os.environ if env is None else env,
                                      file_actions=actions, setsigdef=_RESTORED)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        for fd in (in_r, out_w, err_w):
            os.close(fd)
        self.stdin, self.stdout, self.stderr = in_w, out_r, err_r
        self.returncode: int | None = None

    def communicate(self, data: str = "", timeout: float = 30.0) -> tuple[str, str]:
        """Write `data`, close stdin, read both outputs to their end, reap the child: (stdout,
        stderr) as text. Timeout once `timeout` seconds pass (the child killed and reaped)."""
        deadline = time.monotonic() + timeout
        pending = data.encode()
        out = {self.stdout: bytearray(), self.stderr: bytearray()}
        poller = select.poll()
        open_fds = {self.stdout, self.stderr}
        for fd in open_fds:
            poller.register(fd, select.POLLIN)
        if pending:
            os.set_blocking(self.stdin, False)
            poller.register(self.stdin, select.POLLOUT)
        else:
            self._close_stdin()
        try:
            while open_fds or self.stdin >= 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Timeout
                for fd, _ in poller.poll(left * 1000):
                    if fd == self.stdin:
                        try:
                            pending = pending[os.write(fd, pending):]
                        except BrokenPipeError:
                            pending = b""  # it stopped reading: its exit status says why
                        if not pending:
                            poller.unregister(fd)
                            self._close_stdin()
                        continue
                    chunk = os.read(fd, _CHUNK)
                    if chunk:
                        out[fd] += chunk
                    else:
                        poller.unregister(fd)
                        open_fds.discard(fd)
            self._reap(deadline)
        except BaseException:
            self.kill()
            raise
        finally:
            self._close_stdin()
            for fd in (self.stdout, self.stderr):
                os.close(fd)
        return (out[self.stdout].decode(errors="replace"),
                out[self.stderr].decode(errors="replace"))

    def _close_stdin(self) -> None:
        if self.stdin >= 0:
            os.close(self.stdin)
            self.stdin = -1

    def _reap(self, deadline: float) -> None:
        # Both pipes are at their end: the child has exited or is about to; bounded anyway.
        while True:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
                return
            if time.monotonic() >= deadline:
                raise Timeout
            time.sleep(0.001)

    def kill(self) -> None:
        """SIGKILL and reap, if not reaped already."""
        if self.returncode is not None:
            return
        try:
            os.kill(self.pid, _signal.SIGKILL)
        except ProcessLookupError:
            pass
        _, status = os.waitpid(self.pid, 0)
        self.returncode = os.waitstatus_to_exitcode(status)


def run(argv: list[str], data: str = "", timeout: float = 30.0,
        env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Start, feed, read and reap: (exit code, stdout, stderr); Timeout past the deadline,
    OSError when it cannot be started."""
    child = Child(argv, env)
    out, err = child.communicate(data, timeout)
    assert child.returncode is not None
    return child.returncode, out, err
