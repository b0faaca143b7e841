"""`sb.spawn()` and its `Process` handle against a real execd, both twins (the `flavor`
fixture): poll, output from an offset, wait with its timeout error, signal, the listing, typed
errors for foreign or forged ids and for the live cap, and a handle found again by a new
`Sandbox.connect` after the trainer process that spawned it was SIGKILLed."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import select
import signal
import subprocess
import sys
import time

import pytest

from sandman.client import (
    AsyncSandbox,
    BadRequest,
    Lease,
    ProcessNotFound,
    ProcessOutput,
    ProcessTimeout,
    Sandbox,
    TooManyProcesses,
    Unauthorized,
)

from .conftest import FAST_RETRY, CutProxy, Execd, Flavor, Synced, start_execd

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_spawn_poll_output_wait(flavor: Flavor, execd: Execd) -> None:
    async def body():
        async with flavor.connect(execd) as sb:
            p = await sb.spawn("echo one; echo two >&2; sleep 0.3; echo $SM_V; exit 4",
                               env={"SM_V": "three"})
            assert isinstance(p.id, str) and p.pid > 0 and "echo one" in p.command
            assert await p.poll() is None
            assert await p.wait(timeout=20) == 4
            assert await p.poll() == 4
            out = await p.output()
            assert isinstance(out, ProcessOutput)
            assert out.data == b"one\ntwo\nthree\n" and out.text == "one\ntwo\nthree\n"
            assert (out.start, out.end, out.dropped, out.running) == (0, 14, 0, False)
            more = await p.output(since=4)
            assert more.data == b"two\nthree\n" and more.start == 4
            listed = {q.id: q.last for q in await sb.processes()}
            assert listed[p.id].exit_code == 4 and not listed[p.id].running
            assert listed[p.id].command == p.command and listed[p.id].output_bytes == 14
            again = await sb.process(p.id)
            assert again.id == p.id and (await again.status()).exit_code == 4

    flavor.run(body)


def test_wait_timeout_and_signal(flavor: Flavor, execd: Execd) -> None:
    async def body():
        async with flavor.connect(execd) as sb:
            p = await sb.spawn("trap 'echo bye; exit 9' USR1; while :; do sleep 0.05; done")
            with pytest.raises(ProcessTimeout) as e:
                await p.wait(timeout=0.3)
            assert e.value.process_status.running and isinstance(e.value, TimeoutError)
            await p.signal("USR1")
            assert await p.wait(timeout=20) == 9
            assert b"bye" in (await p.output()).data
            # Signalled once both children exist: the spawn answers when bash starts, before
            # it forks them (CI once signalled bash alone).
            q = await sb.spawn("sleep 300 & sleep 300 & echo forked; wait")
            for _ in range(200):
                if b"forked" in (await q.output()).data:
                    break
                await asyncio.sleep(0.05)
            st = await q.signal(signal.SIGKILL)
            assert st.raw["signalled"] >= 2
            assert await q.wait(timeout=20) == 137

    flavor.run(body)


def test_typed_errors(flavor: Flavor, execd: Execd) -> None:
    async def body():
        async with flavor.connect(execd) as sb:
            with pytest.raises(ProcessNotFound):
                await sb.process("p1-" + secrets.token_hex(12))
            with pytest.raises(BadRequest):
                await sb.process("../../etc/passwd")
            with pytest.raises(BadRequest):
                await sb.spawn("true", cwd="/no/such/dir")
            with pytest.raises(BadRequest):
                await sb.spawn("")
            p = await sb.spawn("true")
            with pytest.raises(BadRequest):
                await p.output(since=-1)
            with pytest.raises(BadRequest):
                await p.signal("NOT-A-SIGNAL")
        async with flavor.connect(execd, token="wrong") as bad:
            with pytest.raises(Unauthorized):
                await bad.spawn("touch /tmp/never")
            with pytest.raises(Unauthorized):
                await bad.processes()

    flavor.run(body)


def test_live_cap_is_a_typed_error(flavor: Flavor, fresh_execd: Execd) -> None:
    async def body():
        async with flavor.connect(fresh_execd) as sb:
            procs = [await sb.spawn("sleep 300") for _ in range(16)]
            with pytest.raises(TooManyProcesses) as e:
                await sb.spawn("sleep 1")
            assert e.value.status == 429 and "16" in e.value.message
            await procs[0].signal("KILL")
            await procs[0].wait(timeout=20)
            for _ in range(100):  # its pipe closes once the reader saw EOF
                if not (await procs[0].status()).output_open:
                    break
                time.sleep(0.02)
            await sb.spawn("true")
            reset = await sb.reset()
            assert reset.ok
            assert await sb.processes() == []
            with pytest.raises(ProcessNotFound):
                await procs[1].poll()

    flavor.run(body, timeout_s=60)


TRAINER = """
import json, sys, time
from sandman.client import Sandbox
sb = Sandbox.connect(sys.argv[1], int(sys.argv[2]), sys.argv[3], id="sb-test", pod="pod-test")
p = sb.spawn("i=0; while [ $i -lt 100000 ]; do echo line-$i; i=$((i+1)); sleep 0.01; done")
print(json.dumps({"id": p.id, "lease": sb.lease().to_json()}), flush=True)
time.sleep(300)
"""


def _spawn_from_a_killed_trainer(ex: Execd) -> tuple[str, Lease]:
    """A separate trainer process spawns, prints the id and its lease (as a trainer would
    save them), and is SIGKILLed."""
    child = subprocess.Popen([sys.executable, "-c", TRAINER, ex.address, str(ex.port), ex.token],
                             stdout=subprocess.PIPE, cwd=REPO, start_new_session=True)
    try:
        ready, _, _ = select.select([child.stdout], [], [], 60)
        assert ready, "the trainer printed no id"
        saved = json.loads(child.stdout.readline())
    finally:
        child.kill()
        child.wait(10)
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    assert saved["lease"]["token"] == ex.token
    return saved["id"], Lease.from_json(saved["lease"])


def test_reattach_after_the_trainer_was_killed(flavor: Flavor, fresh_execd: Execd) -> None:
    pid_id, lease = _spawn_from_a_killed_trainer(fresh_execd)
    assert "token" not in repr(lease) and fresh_execd.token not in repr(lease)

    async def body():
        if flavor.is_async:
            sb = AsyncSandbox.connect(lease, retry=FAST_RETRY)
        else:
            sb = Synced(Sandbox.connect(lease, retry=FAST_RETRY))
        async with sb:
            assert sb.id == "sb-test" and sb.pod == "pod-test"
            p = await sb.process(pid_id)
            assert await p.poll() is None
            for _ in range(200):
                out = await p.output()
                if b"line-3\n" in out.data:
                    break
                time.sleep(0.02)
            assert out.data.startswith(b"line-0\nline-1\nline-2\nline-3\n")
            assert [q.id for q in await sb.processes()] == [pid_id]
            await p.signal("KILL")
            assert await p.wait(timeout=20) == 137

    flavor.run(body)


def test_connect_needs_port_and_token(flavor: Flavor) -> None:
    with pytest.raises(Exception, match="address, port and token"):
        (AsyncSandbox if flavor.is_async else Sandbox).connect("127.0.0.1")


def test_a_fresh_execd_is_not_shared(tmp_path) -> None:
    """An id is only its own sandbox's: another execd answers ProcessNotFound."""
    a = start_execd(tmp_path / "a", "--kill-grace", "0.2")
    b = start_execd(tmp_path / "b", "--kill-grace", "0.2")
    try:
        with Sandbox.connect(a.address, a.port, a.token, retry=FAST_RETRY) as sa, \
                Sandbox.connect(b.address, b.port, b.token, retry=FAST_RETRY) as sb:
            p = sa.spawn("sleep 300")
            with pytest.raises(ProcessNotFound):
                sb.process(p.id)
            assert p.poll() is None
    finally:
        a.stop()
        b.stop()


@pytest.mark.parametrize("cut", ["after_answer", "before_answer"])
def test_a_spawn_whose_answer_was_lost_starts_once(flavor: Flavor, execd: Execd,
                                                   proxy: CutProxy, tmp_path, cut: str) -> None:
    log = tmp_path / "spawned.log"
    proxy.plan.append((cut, "/processes/spawn"))

    async def body():
        async with flavor.connect(execd, port=proxy.port) as sb:
            p = await sb.spawn(f"echo ran >> {log}")
            assert await p.wait(timeout=20) == 0

    flavor.run(body)
    sent = proxy.requests_to("/processes/spawn")
    assert len(sent) == 2, "the first attempt was cut, so the SDK must have retried"
    assert sent[0].json()["request_id"] == sent[1].json()["request_id"]
    assert log.read_text() == "ran\n"
