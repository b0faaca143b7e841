"""The SDK against the real controller on the test bed, with a real execd behind every pod.

kwok runs no container; the kubelet stand-in (testbed/standin.py, which lists what it does not
reproduce) starts the real execd on each pod's loopback IP and port 9470 with the token hash
from the pod's annotation. The controller runs with its default `--ready-check execd`, so it
hands a sandbox out only after execd answers from the pod IP.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from sandman.client import AsyncClient, Client, CommandTimeout, SandboxGone, Unauthorized
from testbed.procs import wait_for
from tests.controller.harness import pods, standin_stack

IMAGE = "registry.invalid/swe/task:1"


@pytest.fixture
def stack(cluster, namespace, tmp_path):
    with standin_stack(cluster, namespace, tmp_path, "sdk") as got:
        yield got


def test_sync_sdk_end_to_end(cluster, namespace, stack):
    ctl, standin = stack
    with Client(ctl.url) as cl:
        with cl.acquire(IMAGE, job="sdk-sync", cpu="1", memory="1Gi", timeout_s=60) as sb:
            assert sb.pod in standin.alive()
            r = sb.exec("cd /tmp && export X=41 && echo $((X+1))", timeout=30)
            assert r.exit_code == 0 and r.output.strip() == "42"
            assert sb.exec("echo $X; pwd").output.split() == ["41", "/tmp"]
            path = f"/tmp/sandman-e2e-{namespace}.txt"
            data = b"line1\r\nline2\n\xff\xfe"
            sb.write(path, data)
            assert sb.read(path) == data
            with pytest.raises(CommandTimeout):
                sb.exec("sleep 30", timeout=1)
            sid, pod = sb.id, sb.pod
        # Leaving the block released it: from the release's answer it is never leased again,
        # and the pod goes, and its execd with it.
        assert state(cl, sid) in ("deleting", "gone")
        wait_for(lambda: pod not in {p.metadata.name for p in pods(cluster.core, namespace)
                                     if not p.metadata.deletion_timestamp}, 60, "release")
        # The controller reads it `deleting` until its watch brings the pod's delete, which
        # may come after the API server shows the pod gone (CI, 2 busy cores: DID NOT RAISE).
        wait_for(lambda: state(cl, sid) == "gone", 60, "the controller to see the pod gone")
        with pytest.raises(SandboxGone):
            cl.get(sid)
    os.unlink(path)


def state(cl: Client, sid: str) -> str:
    """The controller's word for the sandbox, `gone` for SandboxGone."""
    try:
        return cl.get(sid).state
    except SandboxGone:
        return "gone"


def test_async_sdk_end_to_end(cluster, namespace, stack):
    ctl, standin = stack

    async def main():
        async with AsyncClient(ctl.url) as cl:
            sbs = await asyncio.gather(*(cl.acquire(IMAGE, job="sdk-async", cpu="1",
                                                    memory="1Gi", timeout_s=60)
                                         for _ in range(3)))
            outs = await asyncio.gather(*(sb.exec(f"echo {i}") for i, sb in enumerate(sbs)))
            assert [o.output.strip() for o in outs] == ["0", "1", "2"]
            # A sandbox's token opens only that sandbox.
            from sandman.client import AsyncSandbox

            wrong = AsyncSandbox(sbs[0].address, sbs[0].port, "not-the-token")
            with pytest.raises(Unauthorized):
                await wrong.exec("true")
            await wrong.aclose()
            for sb in sbs:
                await sb.release()

    asyncio.run(main())
    wait_for(lambda: not [p for p in pods(cluster.core, namespace)
                          if not p.metadata.deletion_timestamp], 20, "all released")


@pytest.mark.parametrize("cut", ["before_answer", "after_answer"])
def test_acquire_whose_answer_is_lost_is_retried_into_the_same_sandbox(cluster, namespace,
                                                                       stack, cut):
    """The real controller behind a proxy that loses the first acquire's answer: while the
    first attempt is in flight ("before_answer") or after it was handed out ("after_answer").
    The SDK retries with the same request_id and gets that sandbox; no second pod exists."""
    from tests.client.conftest import CutProxy

    ctl, standin = stack
    proxy = CutProxy(ctl.port)
    proxy.plan.append((cut, "/v1/sandboxes"))
    try:
        with Client(f"http://127.0.0.1:{proxy.port}") as cl:
            sb = cl.acquire(IMAGE, job="lost", cpu="1", memory="1Gi", timeout_s=60)
            assert proxy.cuts == 1
            posts = [f for f in proxy.forwarded if f.method == "POST"]
            assert len(posts) == 2 and posts[0].json()["request_id"] == posts[1].json()[
                "request_id"]
            assert sb.exec("echo same").output == "same\n"
            live = [p.metadata.name for p in pods(cluster.core, namespace)
                    if not p.metadata.deletion_timestamp]
            assert live == [sb.pod], f"one acquire, pods {live}"
            sb.release()
    finally:
        proxy.close()
    wait_for(lambda: not [p for p in pods(cluster.core, namespace)
                          if not p.metadata.deletion_timestamp], 20, "released")
