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


def test_bound_ids_reach_the_tasks_started_inside_and_no_others(captured):
    """`bind()`: the request's ids on every line logged in its block and in the tasks started
    from it; a task started with `unbound()` (a warm build an acquire set off) and any line
    after the block carry none. `extra=` wins, and its None leaves a bound field out."""
    import asyncio

    _configure(captured, "json")
    log = logging.getLogger("controller")

    async def line(msg: str, **extra) -> None:
        log.info(msg, extra=extra)

    async def run() -> None:
        with logs.bind(request_id="r-1", tenant="team-a"):
            log.info("in the block")
            await asyncio.ensure_future(line("in a task"))
            await logs.unbound(asyncio.ensure_future, line("in an unbound task"))
            log.info("a pool pod's", extra={"sandbox": "sbx-warm-1", "tenant": None})
            log.info("another tenant's", extra={"tenant": "team-b"})
        log.info("after the block")

    asyncio.run(run())
    got = {x["message"]: {k: x[k] for k in logs.FIELDS if k in x}
           for x in map(json.loads, captured.getvalue().splitlines())}
    assert got == {
        "in the block": {"request_id": "r-1", "tenant": "team-a"},
        "in a task": {"request_id": "r-1", "tenant": "team-a"},
        "in an unbound task": {},
        "a pool pod's": {"request_id": "r-1", "sandbox": "sbx-warm-1"},
        "another tenant's": {"request_id": "r-1", "tenant": "team-b"},
        "after the block": {}}
    assert logs.bound() == {}
