"""`Sandbox.stream()` / `AsyncSandbox.stream()` against a real execd: output chunks as they are
printed and the ExecResult last, the shell shared with exec(), idle timeouts, what hanging up
does and does not kill, a cut stream that is never replayed, and the hook's report. Every
test runs through both twins (the `flavor` fixture)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from sandman.client import (
    BadRequest,
    CommandTimeout,
    ExecResult,
    SandboxBusy,
    SandboxUnreachable,
)

from .conftest import CutProxy, Execd, Flavor


def wait_for(pred, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return False


def busy(execd: Execd) -> bool:
    r = httpx.get(execd.url + "/state", headers={"Authorization": f"Bearer {execd.token}"},
                  timeout=10)
    return bool(r.json()["busy"])


def test_chunks_as_printed_then_the_result(flavor: Flavor, execd: Execd) -> None:
    async def body():
        async with flavor.connect(execd) as sb:
            t0 = time.monotonic()
            seen: list[tuple[float, object]] = []
            async for item in sb.stream("echo a; sleep 0.7; echo b; exit 3", timeout=20):
                seen.append((time.monotonic() - t0, item))
            *chunks, (_, last) = seen
            assert all(isinstance(c, str) for _, c in chunks)
            assert "".join(c for _, c in chunks) == "a\nb\n"  # type: ignore[misc]
            assert chunks[0][0] < 0.5, "the first chunk waited for the command's end"
            assert isinstance(last, ExecResult)
            assert last.exit_code == 3 and last.output == "a\nb\n" and not last.timed_out

    flavor.run(body)


def test_same_shell_as_exec(flavor: Flavor, execd: Execd, tmp_path) -> None:
    async def body():
        async with flavor.connect(execd) as sb:
            items = [i async for i in sb.stream(f"cd {tmp_path} && export SM_S=7")]
            assert isinstance(items[-1], ExecResult) and items[-1].ok
            r = await sb.exec("pwd; echo $SM_S")
            assert r.output == f"{tmp_path}\n7\n"

    flavor.run(body)


def test_idle_timeout_raises_after_the_output(flavor: Flavor, execd: Execd) -> None:
    async def body():
        async with flavor.connect(execd) as sb:
            got = []
            with pytest.raises(CommandTimeout) as ei:
                async for item in sb.stream("echo started; sleep 30", timeout=60,
                                            idle_timeout=0.5):
                    got.append(item)
            assert got[0] == "started\n" and all(isinstance(g, str) for g in got)
            assert ei.value.result.timed_out and ei.value.result.exit_code == 124
            with pytest.raises(CommandTimeout):
                await sb.exec("sleep 30", timeout=60, idle_timeout=0.5)
            assert (await sb.exec("echo alive")).output == "alive\n"

    flavor.run(body)


@pytest.mark.parametrize("kill", [False, True])
def test_hanging_up_kills_only_when_asked(flavor: Flavor, execd: Execd, tmp_path,
                                          kill: bool) -> None:
    done = tmp_path / "done"

    async def body():
        async with flavor.connect(execd) as sb:
            # `&&`: execd's kill ends the call's processes, not the rest of a `;` list.
            it = sb.stream(f"echo go; sleep 1 && touch {done}", timeout=30,
                           kill_on_disconnect=kill)
            assert await it.__anext__() == "go\n"
            await it.aclose()
            assert wait_for(lambda: not busy(execd), 10)
            assert done.exists() is (not kill)

    flavor.run(body)


def test_bad_arguments_are_refused_before_sending(flavor: Flavor, execd: Execd,
                                                  proxy: CutProxy) -> None:
    async def body():
        async with flavor.connect(execd, port=proxy.port) as sb:
            for kw in ({"idle_timeout": 0}, {"idle_timeout": True}, {"timeout": -1},
                       {"kill_on_disconnect": "yes"}):
                with pytest.raises(BadRequest):
                    async for _ in sb.stream("echo x", **kw):
                        pass
            with pytest.raises(BadRequest):
                await sb.exec("echo x", idle_timeout=-2)

    flavor.run(body)
    assert proxy.requests_to("/exec") == []


def test_busy_is_typed(flavor: Flavor, execd: Execd) -> None:
    async def body():
        async with flavor.connect(execd) as sb:
            with pytest.raises(SandboxBusy):
                async for _ in sb.stream("echo x"):
                    pass

    t = threading.Thread(target=lambda: httpx.post(
        execd.url + "/exec", json={"command": "sleep 1.5"}, timeout=30,
        headers={"Authorization": f"Bearer {execd.token}"}))
    t.start()
    try:
        assert wait_for(lambda: busy(execd), 5)
        flavor.run(body)
    finally:
        t.join(30)


def test_a_cut_stream_is_never_replayed(flavor: Flavor, execd: Execd, proxy: CutProxy,
                                        tmp_path) -> None:
    log = tmp_path / "ran.log"
    assert wait_for(lambda: not busy(execd), 10)  # the other twin's run has ended
    proxy.plan.append(("before_answer", "/exec/stream"))

    async def body():
        async with flavor.connect(execd, port=proxy.port) as sb:
            with pytest.raises(SandboxUnreachable, match="may still be running"):
                async for _ in sb.stream(f"echo ran >> {log}; sleep 0.3"):
                    pass

    flavor.run(body)
    assert len(proxy.requests_to("/exec/stream")) == 1
    assert wait_for(log.exists, 5) and log.read_text() == "ran\n"
    assert wait_for(lambda: not busy(execd), 10)


def test_the_hook_reports_one_stream_call(flavor: Flavor, execd: Execd) -> None:
    calls = []

    async def body():
        async with flavor.connect(execd, on_request=lambda *a: calls.append(a)) as sb:
            async for _ in sb.stream("seq 1 1000"):
                pass

    flavor.run(body)
    streams = [c for c in calls if c[0] == "EXEC_STREAM"]
    assert len(streams) == 1
    kind, path, ms, size, exc = streams[0]
    assert path == "/exec/stream" and exc is None and size > len("1\n") * 1000
