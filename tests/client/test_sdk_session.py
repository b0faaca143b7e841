"""`sb.session()` and its `Session` handle against a real execd, both twins (the `flavor`
fixture): a python REPL round trip with expect, the window size the child sees after a
resize, ^C by signal, the cursor and `since`, expect's timeout error, close killing a tree
that ignores SIGHUP, the listing, the live cap and reset as typed errors, forged ids and a
wrong token; an open stopped before its answer (a signal, a cancellation) leaves nothing."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import threading
import time

import pytest

from sandman.client import (
    BadRequest,
    ExpectTimeout,
    SessionEnded,
    SessionNotFound,
    SessionOutput,
    TooManySessions,
    Unauthorized,
)
from sandman.execd_api import SESSION_CLOSE, SESSION_OPEN

from .conftest import CutProxy, Execd, Flavor


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return False
    return data[data.rfind(b")") + 2:].split()[0] != b"Z"


def test_python_repl_round_trip(flavor: Flavor, execd: Execd) -> None:
    async def body():
        async with flavor.connect(execd) as sb:
            async with await sb.session("python3 -i -q") as s:
                assert isinstance(s.id, str) and s.pid > 0 and s.command == "python3 -i -q"
                await s.expect(r">>> ")
                assert await s.write("1+1\n") == 4
                got = await s.expect(r"\n2\r?\n>>> ")
                assert got.startswith("1+1") and "\x1b" not in got
                await s.write(b"for i in range(3):\n    print('row', i)\n\n")
                got = await s.expect(r"row 2\r?\n>>> ")
                assert "row 0" in got and "row 1" in got
                listed = {x.id: x.last for x in await sb.sessions()}
                assert listed[s.id].running and (listed[s.id].cols, listed[s.id].rows) == (80, 24)
                pid = s.pid
            assert not _alive(pid)
            assert s.id not in [x.id for x in await sb.sessions()]
            await s.close()  # again: nothing

    flavor.run(body)


def test_resize_signal_cursor_and_expect_timeout(flavor: Flavor, execd: Execd) -> None:
    async def body():
        async with flavor.connect(execd) as sb:
            s = await sb.session("bash --norc --noprofile -i", env={"PS1": "P$ "}, cols=100,
                                 rows=30)
            try:
                await s.expect(r"P\$ ")
                await s.write("stty size\n")
                await s.expect(r"30 100")
                st = await s.resize(132, 43)
                assert (st.cols, st.rows) == (132, 43)
                await s.write("stty size\n")
                await s.expect(r"43 132")
                await s.write("echo zz-started; sleep 300; echo af''ter\n")
                await s.expect(r"zz-started\r\n")  # the output, not the echoed line
                time.sleep(0.2)
                await s.signal("INT")  # to the foreground job: the sleep
                await s.write("echo done-$((1+1))\n")
                got = await s.expect(r"done-2")
                assert "after" not in got
                with pytest.raises(ExpectTimeout) as e:
                    await s.expect(r"never-printed", timeout=0.5)
                assert isinstance(e.value, TimeoutError) and "never-printed" in e.value.message
                # The cursor: read() goes on from where expect left; since= reads again.
                await s.write("echo X$((40+2))\n")
                out = await s.read(timeout=5)
                assert isinstance(out, SessionOutput)
                # Until the prompt after the answer: the shell prints it a moment later, and a
                # read then would not be empty.
                while b"X42" not in out.data or not out.data.endswith(b"P$ "):
                    more = await s.read(timeout=5)
                    assert more.data, "no more output"
                    out = SessionOutput(out.data + more.data, out.start, more.end, 0, True,
                                        None, True)
                again = await s.read(since=out.start)
                assert again.data.startswith(out.data[:10]) and again.end >= out.end
                empty = await s.read(timeout=0.2)
                assert empty.data == b"" and empty.start == s.offset
                with pytest.raises(BadRequest):
                    await s.resize(0, 5)
                with pytest.raises(BadRequest):
                    await s.read(since=-1)
                with pytest.raises(BadRequest):
                    await s.signal("NOT-A-SIGNAL")
                with pytest.raises(BadRequest):
                    await s.expect("(")
                await s.write("exit 3\n")
                for _ in range(200):
                    if not (await s.read(timeout=0.5)).output_open:
                        break
                with pytest.raises(SessionEnded):
                    await s.write("echo too late\n")
                with pytest.raises(ExpectTimeout):
                    await s.expect("anything", timeout=30)  # ended: no 30 s wait
                assert (await s.status()).exit_code == 3
            finally:
                await s.close()

    flavor.run(body, timeout_s=60)


def test_the_read_that_sees_the_end_carries_the_exit_status(flavor: Flavor, execd: Execd) -> None:
    # The kernel closes a dying program's terminal before the program can be reaped, and a
    # program may close it and go on (ignoring the hang-up): the read that says the output ended waits (within its
    # own timeout) for the exit, so its answer and status() after it carry the exit status.
    async def body():
        async with flavor.connect(execd) as sb:
            s = await sb.session("trap '' HUP; exec 0<&- 1>&- 2>&-; sleep 0.5; exit 3")
            try:
                for _ in range(100):
                    out = await s.read(timeout=5)
                    if not out.output_open:
                        break
                assert not out.output_open
                assert out.exit_code == 3, out
                assert (await s.status()).exit_code == 3
            finally:
                await s.close()

    flavor.run(body, timeout_s=60)


def test_close_kills_a_tree_that_ignores_sighup(flavor: Flavor, execd: Execd) -> None:
    async def body():
        async with flavor.connect(execd) as sb:
            s = await sb.session("trap '' HUP TERM; (trap '' HUP; sleep 301; :) & "
                                 "echo kid=$!; sleep 302; :")
            got = await s.expect(r"kid=(\d+)")
            kid = int(got.rsplit("kid=", 1)[1])
            assert _alive(kid) and _alive(s.pid)
            st = await s.close()
            assert not st.running
            assert not _alive(kid) and not _alive(s.pid)
            with pytest.raises(SessionNotFound):
                await s.write("x")

    flavor.run(body)


def test_cap_reset_forged_ids_and_token(flavor: Flavor, fresh_execd: Execd) -> None:
    async def body():
        async with flavor.connect(fresh_execd) as sb:
            items = [await sb.session("sleep 300") for _ in range(8)]
            with pytest.raises(TooManySessions) as e:
                await sb.session("sleep 1")
            assert e.value.status == 429 and "8" in e.value.message
            await items[0].close()
            extra = await sb.session("sleep 300")
            assert len(await sb.sessions()) == 8
            reset = await sb.reset()
            assert reset.ok
            assert await sb.sessions() == []
            for s in items[1:] + [extra]:
                assert not _alive(s.pid)
            with pytest.raises(SessionNotFound):
                await items[1].write("x")
            forged = await sb.session("sleep 300")
            handle = getattr(forged, "_obj", forged)  # the sync twin behind its test wrapper
            handle.id = "s1-" + secrets.token_hex(12)
            with pytest.raises(SessionNotFound):
                await forged.read()
            handle.id = "../../etc/passwd"
            with pytest.raises(BadRequest):
                await forged.read()
            with pytest.raises(BadRequest):
                await sb.session("sleep 1", cols=0)
            with pytest.raises(BadRequest):
                await sb.session("")
        async with flavor.connect(fresh_execd, token="wrong") as bad:
            with pytest.raises(Unauthorized):
                await bad.session("touch /tmp/never-" + str(os.getpid()))
            with pytest.raises(Unauthorized):
                await bad.sessions()
        assert not os.path.exists("/tmp/never-" + str(os.getpid()))

    flavor.run(body, timeout_s=60)


def marked(marker: str) -> list[int]:
    """The pids whose command line holds `marker`."""
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        pids.append(int(name))
            except OSError:
                pass
    return [p for p in pids if _alive(p)]


def held_open(marker: str) -> str:
    """A session's command whose running program is `marker` (argv[0]); the line itself says
    $((6*7)) where the marker says 42, so only the program matches."""
    return f'exec -a "{marker.replace("-42-", "-$((6*7))-")}" sleep 600'


def wait_marked(marker: str) -> list[int]:
    deadline = time.monotonic() + 20
    while not marked(marker):
        assert time.monotonic() < deadline, "the session's program never started"
        time.sleep(0.05)
    return marked(marker)


class _Stop(Exception):
    pass


def test_an_open_stopped_before_its_answer_leaves_no_session(flavor: Flavor, execd: Execd,
                                                              proxy: CutProxy) -> None:
    """execd opened the session; its answer is on its way when the caller stops (the sync
    twin: a signal handler raises, as `sandman shell`'s SIGTERM does; async: the task is
    cancelled). The caller never learns the id: the SDK closes the session by the open's
    request_id. (It stayed open, its program running, until the sandbox was reset.)"""
    marker = f"sm-open-42-{secrets.token_hex(6)}"
    proxy.plan.append(("hold", SESSION_OPEN.path))

    async def body():
        async with flavor.connect(execd, port=proxy.port) as sb:
            before = {x.id for x in await sb.sessions()}
            if flavor.is_async:
                task = asyncio.ensure_future(sb.session(held_open(marker)))
                assert await asyncio.to_thread(proxy.holding.wait, 20)
                await asyncio.to_thread(wait_marked, marker)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            else:
                main = threading.get_ident()

                def stop_when_held() -> None:
                    if proxy.holding.wait(20):
                        wait_marked(marker)
                        signal.pthread_kill(main, signal.SIGUSR1)

                def raise_stop(signum, frame):
                    raise _Stop()

                old = signal.signal(signal.SIGUSR1, raise_stop)
                t = threading.Thread(target=stop_when_held)
                t.start()
                try:
                    with pytest.raises(_Stop):
                        await sb.session(held_open(marker))
                finally:
                    t.join(30)
                    signal.signal(signal.SIGUSR1, old)
            proxy.release.set()
            assert {x.id for x in await sb.sessions()} == before
            assert marked(marker) == []
            rid = proxy.requests_to(SESSION_OPEN.path)[0].json()["request_id"]
            closes = [f.json() for f in proxy.requests_to(SESSION_CLOSE.path)]
            assert closes == [{"open_request_id": rid}]

    flavor.run(body, timeout_s=60)


def test_abandon_after_is_sent_and_checked(flavor: Flavor, execd: Execd) -> None:
    async def body():
        async with flavor.connect(execd) as sb:
            s = await sb.session("sleep 300", abandon_after=60)
            assert s.last.abandon_after == 60
            assert (await s.close()).abandon_after == 60
            for bad in (0, -1, True, "5", 86401):
                with pytest.raises(BadRequest):
                    await sb.session("sleep 1", abandon_after=bad)

    flavor.run(body)
