"""GET /activity: when the holder last used execd, for the controller's idle rule. Written as
the attacker would: a reader trying to keep a sandbox alive by asking, a long command the
rule must never call idle, a caller without the token.

No timed assertions: every bound compares execd's monotonic clock with this process's (the
same CLOCK_MONOTONIC), taken before and after the calls."""

from __future__ import annotations

import threading
import time

import httpx

from .conftest import wait_for

GAP_S = 0.3  # between the last real call and the refused ones
LAG_S = 0.1  # the most execd's own end of a call may come after its answer reached us

def activity(execd) -> dict:
    r = execd.get("/activity")
    assert r.status_code == 200, r.text
    a = r.json()
    assert set(a) == {"idle_s", "busy"}, a
    return a


def test_a_counted_call_resets_the_clock(execd):
    sent = time.monotonic()
    execd.exec("true")
    a = activity(execd)
    assert a["busy"] == 0
    assert a["idle_s"] <= time.monotonic() - sent + 0.001  # ended after `sent`


def test_reading_activity_or_a_snapshot_never_counts_as_use(execd):
    execd.exec("true")
    ended = time.monotonic()  # the exec's answer came: its end is before this
    for _ in range(20):
        activity(execd)
        execd.get("/snapshot")  # refused here (no base): the route is the controller's read
    asked = time.monotonic()
    a = activity(execd)
    # Idle at least since the exec ended: none of the 40 reads moved the clock.
    assert a["idle_s"] >= asked - ended - 0.001, a


def test_a_long_command_is_never_idle_while_it_runs(execd):
    done = threading.Event()

    def run() -> None:
        execd.exec("sleep 2")
        done.set()

    t = threading.Thread(target=run)
    t.start()
    try:
        assert wait_for(lambda: activity(execd)["busy"] == 1, 10)
        seen = []
        while not done.is_set() and len(seen) < 50:
            seen.append(activity(execd))
            time.sleep(0.02)
        assert all(a["idle_s"] == 0 for a in seen if a["busy"]), seen
    finally:
        t.join(30)
    assert activity(execd)["busy"] == 0


def test_without_the_token_activity_is_refused_and_nothing_counts(execd):
    execd.exec("true")
    ended = time.monotonic()
    # execd counts a call's end after its answer is written, so a loaded machine puts it a
    # few ms after `ended` (seen in CI: 3 ms): the refused calls come GAP_S later, and had
    # they counted, idle_s would be about 0, far under GAP_S minus that lag.
    time.sleep(GAP_S)
    anon = httpx.Client(base_url=execd.url, timeout=10)
    try:
        for path in ("/activity", "/exec", "/state"):
            r = anon.get(path) if path != "/exec" else anon.post(path, json={"command": "id"})
            assert r.status_code == 401, (path, r.text)
    finally:
        anon.close()
    asked = time.monotonic()
    a = activity(execd)
    assert a["idle_s"] >= asked - ended - LAG_S, a  # the refused calls were not use
