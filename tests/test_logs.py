"""sandman/logs.py: the server processes' log lines, as text or one JSON object per line."""

from __future__ import annotations

import io
import json
import logging

import pytest

from sandman import logs


@pytest.fixture
def captured():
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    buf = io.StringIO()
    yield buf
    root.handlers[:], _ = saved[0], root.setLevel(saved[1])


def _configure(buf: io.StringIO, fmt: str, level: str = "INFO") -> None:
    logs.configure(level, fmt)
    logging.getLogger().handlers[0].setStream(buf)


def test_json_lines_carry_the_text_lines_fields_and_nothing_made_up(captured):
    _configure(captured, "json")
    log = logging.getLogger("controller.pipeline")
    log.info("pod %s Ready\nafter %d ms", "sb-1", 812, extra={"job": "grpo-7", "logger": "forged"})
    log.debug("not at INFO")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("create failed")
    lines = captured.getvalue().splitlines()
    assert len(lines) == 2  # a message with a newline is still one line
    first, second = (json.loads(x) for x in lines)
    assert first["message"] == "pod sb-1 Ready\nafter 812 ms"
    assert (first["level"], first["logger"], first["job"]) == ("INFO", "controller.pipeline",
                                                              "grpo-7")
    assert first["time"].endswith("Z") and "T" in first["time"]
    assert set(first) == {"time", "level", "logger", "message", "job"}  # extra cannot replace
    assert second["level"] == "ERROR" and "RuntimeError: boom" in second["exception"]


def test_text_is_the_default_and_a_bad_format_is_one_clear_error(captured):
    _configure(captured, "text", "DEBUG")
    logging.getLogger("webhook").debug("hello")
    line = captured.getvalue().strip()
    assert line.endswith("DEBUG webhook hello") and not line.startswith("{")
    with pytest.raises(ValueError, match="must be one of text, json"):
        logs.configure("INFO", "yaml")
    assert logs.uvicorn_log_config("json") is None and logs.uvicorn_log_config("text")
