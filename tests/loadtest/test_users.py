"""The locust users' clean-up against a real execd process: a user stopped in the middle of a
turn leaves that turn's command running, and the clean-up must wait for the shell rather
than be refused as busy."""

from __future__ import annotations

import threading

import pytest

from loadtest import users
from sandman.client import RetryPolicy, Sandbox, SandboxBusy
from testbed.execd import start_execd

RETRY = RetryPolicy(attempts=2, backoff_s=0.05, backoff_max_s=0.1, budget_s=2.0,
                    connect_timeout_s=2.0)


@pytest.fixture(scope="module")
def execd(tmp_path_factory):
    ex = start_execd(tmp_path_factory.mktemp("execd"), "--kill-grace", "0.2")
    try:
        yield ex
    finally:
        ex.stop()


def connect(ex) -> Sandbox:
    return Sandbox.connect(ex.address, ex.port, ex.token, retry=RETRY)


def stopped_mid_turn(ex, seconds: float) -> tuple[threading.Thread, threading.Event]:
    """A turn's command still running in execd (another connection, as the killed user's)."""
    started = threading.Event()

    def turn() -> None:
        sb = connect(ex)
        try:
            started.set()
            sb.exec(f"sleep {seconds}", timeout=10)
        finally:
            sb.close()

    t = threading.Thread(target=turn, daemon=True)
    t.start()
    assert started.wait(5)
    return t, started


def wait_busy(sb: Sandbox) -> None:
    for _ in range(100):
        if sb.state().busy:
            return
        threading.Event().wait(0.02)
    pytest.fail("the turn's command never ran")


def test_cleanup_right_after_a_stopped_turn_is_refused_without_waiting(execd):
    t, _ = stopped_mid_turn(execd, 1.0)
    sb = connect(execd)
    try:
        wait_busy(sb)
        with pytest.raises(SandboxBusy):
            sb.exec("true", timeout=5)
    finally:
        t.join(10)
        sb.close()


def test_idle_waits_for_the_turn_then_the_cleanup_runs(execd):
    t, _ = stopped_mid_turn(execd, 0.5)
    sb = connect(execd)
    try:
        wait_busy(sb)
        assert users.idle(sb, timeout_s=10)
        assert sb.exec("true", timeout=5).exit_code == 0
    finally:
        t.join(10)
        sb.close()


def test_idle_is_bounded_and_answers_false_while_still_busy(execd):
    t, _ = stopped_mid_turn(execd, 2.0)
    sb = connect(execd)
    try:
        wait_busy(sb)
        assert users.idle(sb, timeout_s=0.3) is False
    finally:
        t.join(10)
        sb.close()
