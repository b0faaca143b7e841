"""One log setup for the server's processes (webhook, controller, netguard): `--log-format
text` (the default, for people) or `json` (one object per line, for a cluster's log pipeline).

A JSON line has the fields of the text line and nothing made up: `time` (UTC, ISO 8601 with
milliseconds), `level`, `logger`, `message`, and `exception` (the formatted traceback) when one
is attached. Fields passed with `extra=` are added under their own names, unless they would
replace one of those. Every line is one `json.dumps` call: a message with newlines stays one
line.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import sys

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
# LogRecord's own attributes: everything else on a record came from `extra=`. uvicorn adds
# `color_message` (the message with terminal colours): not a field.
_RECORD_FIELDS = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "color_message"}


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
        for k, v in vars(record).items():
            if k not in _RECORD_FIELDS and k not in out:
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
