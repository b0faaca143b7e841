"""What the locust users share: the SDK (`sandman.client`, the trainers' own code path) with
its `on_request` hook firing locust's request events, and the run's book of acquired sandboxes,
released at the end whatever happened to the user that held them."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import gevent
import gevent.pool

from loadtest.run import RUN, RequestFailed
from sandman.client import Client, Sandbox, SandmanError


def failure(exc: BaseException) -> RequestFailed:
    """The SDK's error as locust groups failures: by status and error type
    (`HTTP 504 AcquireTimeout`), or by the error's class when no server answered; never by
    its message, which names sandboxes."""
    status = getattr(exc, "status", None)
    if status is not None:
        return RequestFailed(f"HTTP {status} {getattr(exc, 'type', None) or type(exc).__name__}")
    return RequestFailed(type(exc).__name__)


class LocustEvents:
    """The SDK's `on_request` hook: each call is one locust request event, named by the route's
    template (`{id}` in it, never an id), plus the user's current label (`/exec (turn)`)."""

    def __init__(self, env) -> None:
        self.env = env
        self.label = ""

    def __call__(self, kind: str, name: str, elapsed_ms: float, length: int,
                 exc: BaseException | None) -> None:
        self.env.events.request.fire(
            request_type=kind, name=f"{name} ({self.label})" if self.label else name,
            response_time=elapsed_ms, response_length=length,
            exception=failure(exc) if exc is not None else None, context={})

    @contextlib.contextmanager
    def labelled(self, label: str) -> Iterator[None]:
        old, self.label = self.label, label
        try:
            yield
        finally:
            self.label = old


class Sandboxes:
    """One user's SDK client (one connection pool: a trainer's). Errors are already reported
    by the hook; the calls here answer None or False instead of raising into locust."""

    def __init__(self, env, controller_url: str) -> None:
        self.env = env
        self.events = LocustEvents(env)
        self.client = Client(controller_url, on_request=self.events)

    def acquire(self, job: str) -> Sandbox | None:
        o = self.env.parsed_options
        t = time.time()
        sb = None
        try:
            sb = self.client.acquire(o.image, job=job, cpu=o.cpu, memory=o.memory,
                                     timeout_s=o.acquire_timeout_s)
        except SandmanError:
            pass
        self._book(t, [sb] if sb is not None else [None])
        return sb

    def acquire_group(self, job: str, count: int) -> list[Sandbox] | None:
        """One GROUP call for `count` sandboxes; each member is one row of the run's acquires
        (its own queue and create timings), a failed group one failed row."""
        o = self.env.parsed_options
        t = time.time()
        group = None
        try:
            group = self.client.acquire_group(o.image, count, job=job, cpu=o.cpu,
                                              memory=o.memory, timeout_s=o.acquire_timeout_s)
        except SandmanError:
            pass
        self._book(t, list(group) if group is not None else [None])
        return group

    def _book(self, t: float, got: list[Sandbox | None]) -> None:
        for sb in got:
            tm = sb.timings if sb is not None else None
            RUN.acquires.append([RUN.rel(t), RUN.rel(), sb is not None,
                                 bool(sb is not None and sb.warm),
                                 tm.queued_ms if tm else None, tm.create_ms if tm else None,
                                 tm.ready_ms if tm else None])
            if sb is not None and sb.id is not None:
                RUN.live += 1
                RUN.held[sb.id] = sb

    def exec(self, sb: Sandbox, command: str, label: str = "") -> int | None:
        """The command's exit code, None when the call failed."""
        try:
            with self.events.labelled(label):
                return sb.exec(command, timeout=30).exit_code
        except SandmanError:
            return None

    def write(self, sb: Sandbox, path: str, data: bytes) -> bool:
        try:
            sb.write(path, data)
            return True
        except SandmanError:
            return False

    def read(self, sb: Sandbox, path: str) -> bytes | None:
        try:
            return sb.read(path)
        except SandmanError:
            return None


def idle(sb: Sandbox, timeout_s: float = 10.0) -> bool:
    """Whether the sandbox's shell is free, waiting up to `timeout_s` for it. A user stopped in
    the middle of a turn leaves that turn's command running in execd, and the clean-up's
    command would be refused as busy (409) until it ends."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if not sb.state().busy:
                return True
        except SandmanError:
            return False
        if time.monotonic() >= deadline:
            return False
        gevent.sleep(0.05)


def release(sb: Sandbox) -> bool:
    """One RELEASE (the SDK retries transport errors: a release is idempotent). A sandbox stays
    in `RUN.held` until a release succeeds, so the end of the run tries again."""
    if sb.id not in RUN.held:
        return False
    try:
        sb.release()
    except SandmanError:
        return False
    if RUN.held.pop(sb.id, None) is not None:
        RUN.live -= 1
    return True


_PENDING: list = []


def later(fn, *args) -> None:
    """From a user's on_stop: clean-up runs in its own greenlet, outside the runner's user
    group, so stopping or quitting the run cannot interrupt it half way."""
    _PENDING.append(gevent.spawn(fn, *args))


def release_all(timeout_s: float = 120.0) -> None:
    """Clean-ups started by stopped users finish; whatever is still held is released again,
    50 at a time."""
    gevent.joinall(_PENDING, timeout=timeout_s)
    pool = gevent.pool.Pool(50)
    for sb in list(RUN.held.values()):
        pool.spawn(release, sb)
    pool.join(timeout=timeout_s)
