"""Calls made idempotent by the caller's `request_id` (docs/controller.md, "Request ids"):
acquire, group, fork and restore.

A retry with the same key is answered by the first attempt: it waits for it while it runs (a
hedged retry, or one sent before the server saw the first caller leave), and gets its answer
afterwards while every sandbox in it is still handed out. Only the whole call is keyed, never
its members: a member shared by two attempts would be released by the undo of the one whose
caller left, under the other's answer. When the first attempt's caller leaves, its undo runs
alone and a waiting retry starts anew.

A key is (call, scope, request_id), the request id already scoped to the caller's identity (so
nobody else's replay finds the answer); the same key sent with other arguments is refused.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from controller.errors import AcquireError, BadRequest, FirstAttemptLeft

T = TypeVar("T")

MAX_KEYS = 10000  # bounded: the oldest keys are forgotten first
MAX_WAITS = 100  # each pass waits for one whole earlier attempt


class Requests:
    def __init__(self, max_keys: int = MAX_KEYS):
        self.max_keys = max_keys
        self._calls: dict[tuple[str, str, str], tuple[object, asyncio.Future]] = {}

    def __len__(self) -> int:
        return len(self._calls)

    async def once(self, call: str, scope: str, request_id: str | None, args: object,
                   run: Callable[[], Awaitable[T]], alive: Callable[[T], bool]) -> T:
        """`run()`'s answer, or the answer of an earlier attempt with the same key and `args`
        for which `alive(answer)` still holds."""
        if request_id is None:
            return await run()
        key = (call, scope, request_id)
        for _ in range(MAX_WAITS):
            prior = self._calls.get(key)
            if prior is None:
                break
            first_args, fut = prior
            if first_args != args:
                raise BadRequest(f"request_id {request_id.split(':', 1)[-1]!r} was first sent "
                                 f"with other arguments to this {call}; a new {call} needs a "
                                 "new request_id")
            if fut.done():
                if not fut.cancelled() and fut.exception() is None and alive(fut.result()):
                    return fut.result()
                break
            try:
                return await asyncio.shield(fut)
            except FirstAttemptLeft:
                continue  # a second waiting retry then waits on this one's attempt
        fut = asyncio.get_running_loop().create_future()
        self._calls.pop(key, None)
        self._calls[key] = (args, fut)
        while len(self._calls) > self.max_keys:
            self._calls.pop(next(iter(self._calls)))
        try:
            result = await run()
        except BaseException as ex:
            if self._calls.get(key, (None, None))[1] is fut:
                del self._calls[key]
            if not fut.done():
                fut.set_exception(ex if isinstance(ex, AcquireError)
                                  else FirstAttemptLeft(f"the first attempt of this request_id "
                                                        f"was abandoned; retry the {call}"))
                fut.exception()  # retrieved: no "never retrieved" warning without waiters
            raise
        fut.set_result(result)
        return result
