"""Hostile review of the SDK's tree download (sandman/client/_tree.py) and of the controller's
event counting (controller/events.py), as the attackers: the agent inside the sandbox (it
chooses what a download brings back), a hostile execd (a real HTTP server on 127.0.0.1), and
another tenant of the cluster (it creates events in its own namespace). Each xfail(strict)
test is a bypass that works on the code as it stands; the fix flips it."""

from __future__ import annotations

import os
import stat

from prometheus_client import REGISTRY

from controller import events as E
from sandman.client import TreeError, UnsafeArchive, _tree
from tests.execd.tartrees import pax, reg, tar_of

from .conftest import Execd, Flavor
from .test_sdk_trees import Hostile, connect_hostile, hostile  # noqa: F401 - the fixture

GROUP_OTHER_WRITE = stat.S_IWGRP | stat.S_IWOTH | stat.S_ISVTX


# ---------------------------------------------------------------- the agent, through a real execd


def test_download_never_makes_local_files_world_writable(flavor: Flavor, execd: Execd,
                                                         tmp_path) -> None:
    remote, local = tmp_path / f"remote-{flavor.name}", tmp_path / f"local-{flavor.name}"

    async def body():
        async with flavor.connect(execd) as sb:
            r = await sb.exec(f"mkdir -p {remote}/bin && echo 'echo hi' > {remote}/bin/run.sh "
                              f"&& chmod 0777 {remote}/bin/run.sh && chmod 1777 {remote}/bin "
                              f"&& echo data > {remote}/data && chmod 0666 {remote}/data")
            assert r.exit_code == 0, r
            await sb.download_tree(str(remote), local)

    flavor.run(body)
    modes = {p.name: stat.S_IMODE(os.lstat(p).st_mode) for p in local.rglob("*")}
    assert set(modes) == {"bin", "run.sh", "data"}
    # Another user of the trainer's machine must not be able to rewrite what was fetched.
    assert {n: oct(m) for n, m in modes.items() if m & GROUP_OTHER_WRITE} == {}


# ---------------------------------------------------------------- a hostile execd


def test_refused_deep_download_is_typed_and_leaves_nothing(flavor: Flavor, hostile: Hostile,  # noqa: F811
                                                          tmp_path) -> None:
    local = tmp_path / "local"
    local.mkdir()
    hostile.serve(tar_of(reg("/".join(["d"] * 1500) + "/f"), reg("../escape")))
    raised: list[BaseException] = []

    async def body():
        async with connect_hostile(flavor, hostile) as sb:
            try:
                await sb.download_tree("/x", local)
            except BaseException as e:  # noqa: BLE001 - the kind is what is checked
                raised.append(e)

    flavor.run(body)
    assert raised and isinstance(raised[0], UnsafeArchive), repr(raised[:1])[:200]
    assert os.listdir(local) == []


def test_refused_download_at_the_depth_cap_leaves_nothing(flavor: Flavor, hostile: Hostile,  # noqa: F811
                                                          tmp_path) -> None:
    local = tmp_path / "local"
    local.mkdir()
    deep = "/".join(["d"] * (_tree.DEPTH_MAX - 1))
    hostile.serve(tar_of(reg(deep + "/f"), reg(deep + "/g"), reg("../escape")))
    raised: list[BaseException] = []

    async def body():
        async with connect_hostile(flavor, hostile) as sb:
            try:
                await sb.download_tree("/x", local)
            except BaseException as e:  # noqa: BLE001 - the kind is what is checked
                raised.append(e)

    flavor.run(body)
    assert raised and isinstance(raised[0], UnsafeArchive), repr(raised[:1])[:200]
    assert os.listdir(local) == [] and not (tmp_path / "escape").exists()


def test_absurd_mtime_from_execd_is_a_typed_error(flavor: Flavor, hostile: Hostile,  # noqa: F811
                                                 tmp_path) -> None:
    local = tmp_path / "local"
    hostile.serve(tar_of(pax(reg("f"), {"mtime": "1e300"})))
    raised: list[BaseException] = []

    async def body():
        async with connect_hostile(flavor, hostile) as sb:
            try:
                await sb.download_tree("/x", local)
            except BaseException as e:  # noqa: BLE001
                raised.append(e)

    flavor.run(body)
    assert raised and isinstance(raised[0], TreeError), repr(raised[:1])[:200]
    assert not local.exists()


# ---------------------------------------------------------------- another tenant: events

NS = "sandman-sandboxes"
OWN_POD = "11111111-1111-1111-1111-111111111111"


def _failures(scope: str) -> float:
    return REGISTRY.get_sample_value("sandman_controller_pod_address_failures_total",
                                     {"scope": scope}) or 0.0


def _ev(uid: str, count: int, ns: str, pod_uid: str) -> dict:
    return E.slim_event({"metadata": {"uid": uid}, "reason": E.REASON_SANDBOX_FAILED,
                         "count": count,
                         "involvedObject": {"kind": "Pod", "namespace": ns, "name": "x",
                                            "uid": pod_uid}})


def test_a_cotenants_event_flood_cannot_inflate_sandmans_failures() -> None:
    s = E.CapacitySignals(NS)
    s.remember(OWN_POD, "agent")
    s.on_event("ADDED", _ev("ours", 50, NS, OWN_POD))  # 50 occurrences before we saw it
    before = _failures("sandman")
    # Another tenant's pods fail (or it creates Events for its own pods: allowed in its
    # namespace), each a new event object: the cluster-wide watch delivers all of them.
    for i in range(E.SEEN_CAP):
        s.on_event("ADDED", _ev(f"cotenant-{i}", 1, "team-b", f"pod-{i}"))
    s.on_event("MODIFIED", _ev("ours", 51, NS, OWN_POD))  # one more real occurrence
    assert _failures("sandman") - before == 1
