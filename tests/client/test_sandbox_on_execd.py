"""The SDK against a real execd: commands, shell state, timeouts, auth, byte-exact files,
conditional writes, retries that never run a command twice, and a gone sandbox. Every test
runs once through the sync SDK and once through the async one (the `flavor` fixture)."""

from __future__ import annotations

import hashlib
import logging
import secrets

import pytest

from sandman.client import (
    CommandTimeout,
    ConditionReadings,
    ExecResult,
    FileNotFound,
    IntegrityError,
    SandboxBusy,
    SandboxGone,
    SandboxUnreachable,
    Unauthorized,
    WriteConflict,
)

from .conftest import CutProxy, Execd, Flavor


def test_exec_round_trip(flavor: Flavor, execd: Execd) -> None:
    async def body():
        async with flavor.connect(execd) as sb:
            r = await sb.exec("echo hello; echo oops >&2; exit 3", timeout=10)
            assert isinstance(r, ExecResult)
            assert r.exit_code == 3
            assert r.output == "hello\noops\n"
            assert not r.truncated and not r.timed_out and not r.ok
            assert len(r.request_id) == 32
            ok = await sb.exec("printf 'caf\\xc3\\xa9'")
            assert ok.ok and ok.output == "café"

    flavor.run(body)


def test_shell_state_persists_between_calls(flavor: Flavor, execd: Execd, tmp_path) -> None:
    async def body():
        async with flavor.connect(execd) as sb:
            await sb.exec(f"cd {tmp_path} && export SM_X=41 && f() {{ echo $((SM_X+1)); }}")
            r = await sb.exec("pwd; f")
            assert r.output == f"{tmp_path}\n42\n"
            env = await sb.env(set={"SM_Y": "a b'c"}, unset=["SM_X"])
            assert env["SM_Y"] == "a b'c" and "SM_X" not in env
            r = await sb.exec('echo "$SM_Y|${SM_X-unset}"')
            assert r.output == "a b'c|unset\n"

    flavor.run(body)


def test_command_timeout_is_typed_and_carries_the_output(flavor: Flavor, execd: Execd) -> None:
    async def body():
        async with flavor.connect(execd) as sb:
            with pytest.raises(CommandTimeout) as ei:
                await sb.exec("echo started; sleep 30", timeout=0.5)
            assert ei.value.result.exit_code == 124
            assert ei.value.result.timed_out
            assert "started" in ei.value.result.output
            assert isinstance(ei.value, TimeoutError)
            # A command that exits 124 by itself is not a timeout.
            r = await sb.exec("(exit 124)")
            assert r.exit_code == 124 and not r.timed_out
            assert (await sb.exec("echo alive")).output == "alive\n"

    flavor.run(body)


def test_wrong_token_is_unauthorized_and_never_shown(flavor: Flavor, execd: Execd,
                                                     caplog) -> None:
    caplog.set_level(logging.DEBUG)
    wrong = "wrong-" + secrets.token_hex(8)

    async def body():
        async with flavor.connect(execd, token=wrong) as sb:
            assert (await sb.health()).ok  # /health needs no token
            with pytest.raises(Unauthorized) as ei:
                await sb.exec("echo never")
            assert ei.value.status == 401
            assert wrong not in str(ei.value) and wrong not in repr(sb)
        async with flavor.connect(execd) as sb:
            assert execd.token not in repr(sb)
            assert (await sb.exec("true")).ok

    flavor.run(body)
    assert wrong not in caplog.text and execd.token not in caplog.text


@pytest.mark.parametrize("size", [0, 1, 3, 65537, 3 << 20])
def test_read_write_byte_exact(flavor: Flavor, execd: Execd, tmp_path, size: int) -> None:
    # Bytes a text-mode round trip would change: NUL, CR, CRLF, a BOM, invalid UTF-8.
    special = b"\xef\xbb\xbfa\r\nb\rc\x00\xff\xfe\n"
    data = (special + secrets.token_bytes(size))[:size] if size else b""
    path = tmp_path / f"f-{size}.bin"

    async def body():
        async with flavor.connect(execd) as sb:
            w = await sb.write(str(path), data)
            assert w.size == size and w.sha256 == hashlib.sha256(data).hexdigest()
            assert path.read_bytes() == data  # what execd stored, read behind its back
            fc = await sb.read_file(str(path))
            assert fc.data == data and fc.sha256 == w.sha256
            assert await sb.read(str(path)) == data

    flavor.run(body)


def test_write_text_mode_and_missing_file(flavor: Flavor, execd: Execd, tmp_path) -> None:
    async def body():
        async with flavor.connect(execd) as sb:
            await sb.write(str(tmp_path / "t.sh"), "echo ü\n", mode=0o755)
            assert (tmp_path / "t.sh").stat().st_mode & 0o777 == 0o755
            assert (await sb.exec(f"{tmp_path}/t.sh")).output == "ü\n"
            with pytest.raises(FileNotFound):
                await sb.read(str(tmp_path / "absent"))

    flavor.run(body)


def test_if_sha256_conflict(flavor: Flavor, execd: Execd, tmp_path) -> None:
    path = str(tmp_path / "conf.txt")

    async def body():
        async with flavor.connect(execd) as sb:
            await sb.write(path, b"v1\n")
            v1 = await sb.read_file(path)
            w2 = await sb.write(path, b"v2\n", if_sha256=v1.sha256)  # the read is current
            with pytest.raises(WriteConflict) as ei:
                await sb.write(path, b"v3\n", if_sha256=v1.sha256)  # stale
            assert ei.value.current_sha256 == w2.sha256
            assert await sb.read(path) == b"v2\n"
            with pytest.raises(WriteConflict) as ei:  # "only if it does not exist yet"
                await sb.write(str(tmp_path / "new"), b"x", if_sha256="0" * 64)
            assert ei.value.current_sha256 is None

    flavor.run(body)


def test_read_fails_closed_on_a_corrupted_answer(flavor: Flavor, execd: Execd,
                                                 proxy: CutProxy, tmp_path) -> None:
    path = tmp_path / "exact.bin"
    path.write_bytes(b"the exact bytes\r\n")
    proxy.plan.append(("corrupt", "/files"))

    async def body():
        async with flavor.connect(execd, port=proxy.port) as sb:
            with pytest.raises(IntegrityError):
                await sb.read(str(path))
            assert await sb.read(str(path)) == b"the exact bytes\r\n"  # plan used up

    flavor.run(body)
    assert proxy.cuts == 1


@pytest.mark.parametrize("cut", ["after_answer", "before_answer"])
def test_retried_command_runs_once(flavor: Flavor, execd: Execd, proxy: CutProxy, tmp_path,
                                   cut: str) -> None:
    """The connection drops after execd got the command (after its answer, or while it still
    runs); the SDK retries with the same request_id and execd runs the command once."""
    log = tmp_path / "ran.log"
    proxy.plan.append((cut, "/exec"))

    async def body():
        async with flavor.connect(execd, port=proxy.port) as sb:
            r = await sb.exec(f"sleep 0.3; echo ran >> {log}; wc -l < {log}", timeout=10)
            assert r.output.strip() == "1"
            return r

    r = flavor.run(body)
    sent = proxy.requests_to("/exec")
    assert len(sent) == 2, "the first attempt was cut, so the SDK must have retried"
    assert sent[0].json()["request_id"] == sent[1].json()["request_id"] == r.request_id
    assert log.read_text() == "ran\n"


def test_retried_write_after_lost_answer_succeeds(flavor: Flavor, execd: Execd,
                                                  proxy: CutProxy, tmp_path) -> None:
    """A conditional write whose answer was lost: the retry sees our own bytes (409 with our
    SHA-256) and reports success instead of a conflict."""
    path = tmp_path / "cond.txt"
    path.write_bytes(b"old")
    old = hashlib.sha256(b"old").hexdigest()
    proxy.plan.append(("after_answer", "/files/write"))

    async def body():
        async with flavor.connect(execd, port=proxy.port) as sb:
            w = await sb.write(str(path), b"new", if_sha256=old)
            assert w.sha256 == hashlib.sha256(b"new").hexdigest()

    flavor.run(body)
    assert len(proxy.requests_to("/files/write")) == 2
    assert path.read_bytes() == b"new"


def test_one_pooled_connection_per_sandbox(flavor: Flavor, execd: Execd,
                                           proxy: CutProxy) -> None:
    async def body():
        async with flavor.connect(execd, port=proxy.port) as sb:
            for i in range(10):
                assert (await sb.exec(f"echo {i}")).output == f"{i}\n"
            await sb.state()
            await sb.conditions()

    flavor.run(body)
    assert len(proxy.requests_to("/")) == 12
    assert proxy.connections == 1


def test_busy_shell_is_typed(flavor: Flavor, execd: Execd) -> None:
    import asyncio
    import threading

    async def wait_busy(sb) -> None:
        for _ in range(200):  # bounded: 10 s
            if (await sb.state()).busy:
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the first command never started")

    async def body():
        async with flavor.connect(execd) as a, flavor.connect(execd) as b:
            # One command at a time per sandbox: a second caller gets SandboxBusy.
            if flavor.is_async:
                first = asyncio.ensure_future(a.exec("sleep 1", timeout=10))
                await wait_busy(b)
                with pytest.raises(SandboxBusy):
                    await b.exec("echo second")
                assert (await first).ok
            else:
                t = threading.Thread(target=lambda: a._obj.exec("sleep 1", timeout=10))
                t.start()
                try:
                    await wait_busy(b)
                    with pytest.raises(SandboxBusy):
                        await b.exec("echo second")
                finally:
                    t.join(10)

    flavor.run(body)


def test_state_conditions_reset(flavor: Flavor, execd: Execd) -> None:
    async def body():
        async with flavor.connect(execd) as sb:
            bg = int((await sb.exec("sleep 60 & echo $!")).output)
            st = await sb.state()
            assert st.shell_pid and bg in [p.pid for p in st.processes]
            c = await sb.conditions()
            assert isinstance(c, ConditionReadings) and c.visible_cpu_count and c.uid is not None
            r = await sb.reset()
            assert r.ok and r.left == [] and r.shell_pid != st.shell_pid
            st2 = await sb.state()
            assert bg not in [p.pid for p in st2.processes]
            assert [p.pid for p in st2.processes] == [r.shell_pid]

    flavor.run(body)


def test_released_sandbox_is_gone(flavor: Flavor, execd: Execd) -> None:
    async def body():
        sb = flavor.connect(execd)
        assert (await sb.exec("true")).ok
        assert await sb.release() is True
        assert await sb.release() is False  # idempotent
        with pytest.raises(SandboxGone):
            await sb.exec("true")
        assert "released" in repr(sb)

    flavor.run(body)


def test_with_block_releases_on_exception(flavor: Flavor, execd: Execd) -> None:
    async def body():
        sb = flavor.connect(execd)
        with pytest.raises(ZeroDivisionError):
            async with sb:
                await sb.exec("true")
                1 / 0  # noqa: B018
        assert sb.released
        with pytest.raises(SandboxGone):
            await sb.exec("true")

    flavor.run(body)


def test_dead_execd_without_controller_is_unreachable(flavor: Flavor,
                                                      fresh_execd: Execd) -> None:
    async def body():
        async with flavor.connect(fresh_execd) as sb:
            assert (await sb.exec("true")).ok
            fresh_execd.stop()
            with pytest.raises(SandboxUnreachable):
                await sb.exec("true")

    flavor.run(body)
