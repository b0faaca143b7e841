"""Group acquires against the test bed: the real controller, kwok pods and a real execd behind
each (testbed/standin.py). What is asserted is what the controller and the API server record
(answers' timings, metrics, pods and their labels), never a tight wall-clock bound."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import threading
import time
from pathlib import Path

import httpx
import pytest

from sandman import api, contract
from sandman.client import AcquireTimeout, AsyncClient, BadRequest, Client
from testbed.procs import wait_for
from tests.controller.harness import pods, standin_stack, unowned

IMAGE = "registry.invalid/swe/task:1"  # kwok never pulls
SIZE = {"cpu": "1", "memory": "1Gi"}


@pytest.fixture
def bed(cluster, namespace, tmp_path, request):
    with standin_stack(cluster, namespace, tmp_path, "group",
                       *getattr(request, "param", ())) as (ctl, _standin):
        yield ctl


def metric(ctl, name: str) -> float:
    for line in httpx.get(f"{ctl.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def leased(ctl) -> set[str]:
    items = httpx.get(f"{ctl.url}{api.LIST.path}", timeout=10).json()["items"]
    return {i["id"] for i in items if i["state"] == "leased"}


def live(cluster, namespace) -> set[str]:
    return {p.metadata.name for p in pods(cluster.core, namespace)
            if not p.metadata.deletion_timestamp and (p.metadata.labels or {}).get(
                contract.LABEL_STATE) != contract.STATE_DELETING}


def nothing_left(cluster, namespace, ctl, held: frozenset[str] = frozenset()) -> None:
    """Only `held` (sandbox ids) is handed out, and every other pod is warm in the books or
    being deleted: none is unowned."""
    wait_for(lambda: leased(ctl) == set(held), 30, f"only {sorted(held)} leased")
    handed = {p.metadata.name for p in pods(cluster.core, namespace)
              if (p.metadata.labels or {}).get(contract.LABEL_STATE) == contract.STATE_LEASED}
    assert unowned(cluster.core, namespace, ctl.url, handed) == []


def test_a_group_is_all_ready_in_one_call_and_a_retry_gets_the_same_group(
        cluster, namespace, bed):
    ctl = bed
    with Client(ctl.url) as cl:
        with cl.acquire_group(IMAGE, 4, job="rollouts", timeout_s=60, **SIZE) as group:
            assert len(group) == 4 and len({sb.id for sb in group}) == 4
            assert leased(ctl) == {sb.id for sb in group}
            for i, sb in enumerate(group):
                assert sb.exec(f"echo {i}").output == f"{i}\n"
        assert all(sb.released for sb in group)
    wait_for(lambda: not live(cluster, namespace), 30, "every pod deleted")
    assert metric(ctl, 'sandman_controller_groups_total{result="ok"}') == 1
    assert metric(ctl, 'sandman_controller_group_sandboxes_total{warm="false"}') == 4

    # A retry of a lost answer (the same request_id) is answered with the same sandboxes.
    body = {"image": IMAGE, "job": "retry", "count": 2, "request_id": "r-1", **SIZE}
    first = httpx.post(f"{ctl.url}{api.GROUP.path}", json=body, timeout=60)
    assert first.status_code == 201, first.text
    again = httpx.post(f"{ctl.url}{api.GROUP.path}", json=body, timeout=60)
    assert again.status_code == 201, again.text
    ids = [s["id"] for s in first.json()["sandboxes"]]
    assert [s["id"] for s in again.json()["sandboxes"]] == ids and len(set(ids)) == 2
    for sid in ids:
        httpx.delete(f"{ctl.url}{api.RELEASE.url(id=sid)}", timeout=30)
    nothing_left(cluster, namespace, ctl)


@pytest.mark.parametrize("bed", [("--job-max-live", "3")], indirect=True)
def test_a_group_that_cannot_be_completed_fails_whole_and_leaves_nothing(cluster, namespace,
                                                                        bed):
    """Over the job's cap: refused at once, in one line, before any pod. Under it but not
    completable (one sandbox of the job already held): the members had are released when the
    group's timeout ends, and the error is the acquire's."""
    ctl = bed
    with Client(ctl.url) as cl:
        with pytest.raises(BadRequest, match="never fit") as err:
            cl.acquire_group(IMAGE, 4, job="capped", timeout_s=30, **SIZE)
        assert "\n" not in str(err.value)
        assert live(cluster, namespace) == set()
        held = cl.acquire(IMAGE, job="capped", timeout_s=60, **SIZE)
        with pytest.raises(AcquireTimeout) as err:
            cl.acquire_group(IMAGE, 3, job="capped", timeout_s=8, **SIZE)
        msg = str(err.value)
        assert "\n" not in msg and "group of 3" in msg and "no member was kept" in msg, msg
        nothing_left(cluster, namespace, ctl, frozenset({held.id}))
        held.release()
    assert metric(ctl, 'sandman_controller_groups_total{result="refused"}') == 1
    assert metric(ctl, 'sandman_controller_groups_total{result="acquire"}') == 1


@pytest.mark.parametrize("bed", [("--rate", "1", "--burst", "1")], indirect=True)
def test_a_caller_that_leaves_mid_group_leaves_nothing(cluster, namespace, bed):
    """Creates paced at 1/s: the caller gives up after 1.5 s with most members still queued;
    those handed out are released, the queued ones withdrawn, the ones in flight parked warm
    or deleted: nothing is leased and nothing is unowned."""
    ctl = bed
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{ctl.url}{api.GROUP.path}",
                   json={"image": IMAGE, "job": "leave", "count": 5, **SIZE},
                   timeout=httpx.Timeout(1.5))
    wait_for(lambda: metric(ctl, 'sandman_controller_groups_total{result="client_closed"}')
             == 1, 30, "the group saw its caller leave")
    nothing_left(cluster, namespace, ctl)
    # The queued members were withdrawn, never sent: fewer creates than members.
    assert metric(ctl, 'sandman_controller_creates_total{result="ok"}') < 5


@pytest.mark.parametrize("bed", [("--rate", "1", "--burst", "1")], indirect=True)
def test_a_retry_sent_while_the_first_attempt_runs_keeps_nothing_the_leaver_releases(
        cluster, namespace, bed):
    """A hedged retry (the same request_id, sent while the first attempt still runs) and then
    the first caller leaving: the retry's answer is sandboxes it holds, never members the
    first attempt's undo releases under it. Creates paced at 1/s keep the first attempt
    running when the retry arrives and when its caller leaves."""
    ctl = bed
    body = {"image": IMAGE, "job": "hedge", "count": 5, "request_id": "r-hedge", **SIZE}
    out: dict = {}

    def retry() -> None:
        out["r"] = httpx.post(f"{ctl.url}{api.GROUP.path}", json=body, timeout=90)

    t = threading.Thread(target=retry)
    with pytest.raises(httpx.ReadTimeout):
        with httpx.Client(timeout=httpx.Timeout(2.5)) as first:
            threading.Timer(0.5, t.start).start()
            first.post(f"{ctl.url}{api.GROUP.path}", json=body)
    t.join(120)
    r = out["r"]
    assert r.status_code == 201, r.text
    ids = [s["id"] for s in r.json()["sandboxes"]]
    assert len(set(ids)) == 5
    wait_for(lambda: metric(ctl, 'sandman_controller_groups_total{result="client_closed"}')
             == 1, 30, "the first attempt saw its caller leave")
    time.sleep(1)  # the first attempt's undo, had it anything of the retry's, is done by now
    assert set(ids) <= leased(ctl), f"the retry was answered with released sandboxes: {ids}"
    for sid in ids:
        httpx.delete(f"{ctl.url}{api.RELEASE.url(id=sid)}", timeout=30)
    nothing_left(cluster, namespace, ctl)


def test_the_warm_pool_serves_a_group_first(cluster, namespace, bed):
    """Three prewarmed pods of the key: a group of three is those very pods, no create."""
    ctl = bed
    with Client(ctl.url) as cl:
        cl.prewarm(IMAGE, 3, **SIZE)
        wait_for(lambda: sum(i.state == "warm" for i in cl.list()) == 3, 60, "3 warm pods")
        warm = {i.pod for i in cl.list() if i.state == "warm"}
        with cl.acquire_group(IMAGE, 3, job="warm", timeout_s=60, **SIZE) as group:
            assert all(sb.warm for sb in group), [sb.warm for sb in group]
            assert {sb.pod for sb in group} == warm
        cl.prewarm(IMAGE, 0, **SIZE)
    assert metric(ctl, 'sandman_controller_group_sandboxes_total{warm="true"}') == 3


@pytest.mark.parametrize("bed", [("--rate", "2", "--burst", "1")], indirect=True)
def test_a_group_is_paced_and_does_not_starve_another_jobs_acquires(cluster, namespace, bed):
    """A group of 8 under 2 creates/s, and another job's two single acquires sent while it
    waits: the group makes exactly 8 creates, queued behind the bucket (its last member's
    queue time is seconds), while the other job's creates are let in between its members (the
    pacer's round-robin), not after the last one."""
    ctl = bed
    out: dict = {}

    def group() -> None:
        with Client(ctl.url) as cl:
            g = cl.acquire_group(IMAGE, 8, job="big", timeout_s=120, **SIZE)
            out["big"] = [sb.timings.queued_ms for sb in g]
            g.release()

    t = threading.Thread(target=group)
    t.start()
    try:
        wait_for(lambda: metric(ctl, 'sandman_controller_creates_total{result="ok"}') >= 1,
                 30, "the group's first create")
        with Client(ctl.url) as cl:
            small = [cl.acquire(IMAGE, job="small", timeout_s=120, **SIZE) for _ in range(2)]
            out["small"] = [sb.timings.queued_ms for sb in small]
            assert "big" not in out, "the other job's acquires waited for the whole group"
            for sb in small:
                sb.release()
    finally:
        t.join(180)
    big, small_q = sorted(out["big"]), out["small"]
    assert metric(ctl, 'sandman_controller_creates_total{result="ok"}') == 10
    # 10 creates at 2/s, burst 1: the last of the group's waits seconds in the queue.
    assert big[-1] >= 2000, big
    # Each single acquire waited less than the group's last member: served in between.
    assert max(small_q) < big[-1], (small_q, big)
    nothing_left(cluster, namespace, ctl)


def test_the_async_twin_acquires_a_group(cluster, namespace, bed):
    ctl = bed

    async def run() -> None:
        async with AsyncClient(ctl.url) as cl:
            async with cl.acquire_group(IMAGE, 2, job="async", timeout_s=60, **SIZE) as group:
                outs = await asyncio.gather(*(sb.exec("echo hi") for sb in group))
                assert [o.output for o in outs] == ["hi\n", "hi\n"]
            assert all(sb.released for sb in group)

    asyncio.run(asyncio.wait_for(run(), 120))
    nothing_left(cluster, namespace, ctl)


def test_the_cli_acquires_a_group_and_keeps_every_lease(cluster, namespace, bed, tmp_path):
    ctl = bed
    from sandman.client import cli

    os.environ[cli.ENV_LEASE_DIR] = str(tmp_path / "leases")
    try:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert cli.main(["--url", ctl.url, "-o", "json", "acquire", IMAGE, "--job", "cli",
                             "--count", "3", "--cpu", "1", "--memory", "1Gi"]) == 0
        got = json.loads(buf.getvalue())
        assert [sorted(g) for g in got] == [["expires_at", "id", "lease_file", "pod"]] * 3
        assert leased(ctl) == {g["id"] for g in got}
        for g in got:
            assert Path(g["lease_file"]).exists()
            assert cli.main(["--url", ctl.url, "release", g["id"]]) == 0
    finally:
        os.environ.pop(cli.ENV_LEASE_DIR, None)
    nothing_left(cluster, namespace, ctl)
