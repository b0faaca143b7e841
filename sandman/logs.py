"""One log setup for the server's processes (webhook, controller, netguard): `--log-format
text` (the default, for people) or `json` (one object per line, for a cluster's log pipeline).

A JSON line has the fields of the text line and nothing made up: `time` (UTC, ISO 8601 with
milliseconds), `level`, `logger`, `message`, and `exception` (the formatted traceback) when one
is attached. Fields passed with `extra=` are added under their own names, unless they would
replace one of those. Every line is one `json.dumps` call: a message with newlines stays one
line.

Ids a line is about travel as fields, never only inside the message, so a sandbox's or a
request's lines are found with a field match (`jq 'select(.sandbox == "sbx-...")'`), not a
regex: `extra=` for what one line names (the controller's `Books.fields(entry)`), `bind()` for
what a whole request or task is about (the HTTP request id, the tenant it names): an asyncio
task started inside a `bind()` carries its fields (`unbound()` starts one without). `extra=`
wins over a bound field of the same name; an `extra=` field of None leaves the field out, bound
or not (a warm pod's line has no tenant even inside a tenant's request). The names used:
`FIELDS`.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime as dt
import json
import logging
import sys
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Any, TypeVar

T = TypeVar("T")

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
# LogRecord's own attributes: everything else on a record came from `extra=`. uvicorn adds
# `color_message` (the message with terminal colours): not a field.
_RECORD_FIELDS = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "color_message"}
# The id fields of lines about a sandbox or a request: the sandbox (its pod's name), its job
# (without the tenant), its tenant (namespace), the pod and namespace a webhook review is
# about, and the request (the controller's X-Request-Id, an admission review's uid).
FIELDS = ("sandbox", "job", "tenant", "pod", "namespace", "request_id")
_BOUND: contextvars.ContextVar[Mapping[str, str]] = contextvars.ContextVar(
    "sandman_log_fields", default=MappingProxyType({}))


@contextlib.contextmanager
def bind(**fields: str | None) -> Iterator[None]:
    """Every line logged in this context (and in the tasks started from it) carries `fields`
    (None values are left out), until the block ends."""
    token = _BOUND.set({**_BOUND.get(), **{k: v for k, v in fields.items() if v is not None}})
    try:
        yield
    finally:
        _BOUND.reset(token)


def add(**fields: str | None) -> None:
    """Bind `fields` for the rest of the current task: in a request handler, whose task ends
    with the request (the controller's API middleware `bind()`s around each request, which
    undoes these at its end too)."""
    _BOUND.set({**_BOUND.get(), **{k: v for k, v in fields.items() if v is not None}})


def unbound(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` outside every bound field: a task it starts carries none (a warm build an
    acquire set off is no part of that acquire's request)."""
    return contextvars.Context().run(fn, *args)


def bound() -> dict[str, str]:
    """The fields bound in this context."""
    return dict(_BOUND.get())


class JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"time": dt.datetime.fromtimestamp(record.created, dt.UTC)
               .isoformat(timespec="milliseconds").replace("+00:00", "Z"),
               "level": record.levelname, "logger": record.name,
               "message": record.getMessage()}
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exception"] = record.exc_text
        extra = {k: v for k, v in vars(record).items() if k not in _RECORD_FIELDS}
        for k, v in {**_BOUND.get(), **extra}.items():
            if v is not None and k not in out:
                out[k] = v
        return json.dumps(out, default=str, ensure_ascii=False)


def say(fmt: str, logger: str, message: str, level: str = "INFO") -> None:
    """A line a process prints whatever its log level (the address it serves on, a start-up
    refusal), in the process's log format, on stderr."""
    if fmt == "json":
        message = JSONFormatter().format(logging.makeLogRecord(
            {"name": logger, "levelname": level, "msg": message}))
    print(message, file=sys.stderr, flush=True)


def configure(level: str | int = "INFO", fmt: str = "text") -> None:
    """The root logger's one handler on stderr, at `level`, in `fmt` (text or json)."""
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: must be one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler()
    handler.setFormatter(JSONFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)


def uvicorn_log_config(fmt: str) -> dict | None:
    """uvicorn's `log_config`: in json, None, so its loggers reach the root handler above
    instead of printing text through their own (uvicorn's default otherwise)."""
    if fmt == "json":
        return None
    from uvicorn.config import LOGGING_CONFIG

    return LOGGING_CONFIG
