"""Books only the controller can write, against the fake `Kube` (pure logic; the same attacks on
the real API server: test_books_on_testbed.py).

Other tenants of a shared cluster may create pods in the sandbox namespace. A pod carrying the
controller's labels (`managed-by=sandman-controller`, `state=leased`) but not made by the
controller must never enter the books on a rebuild (it would count against the caps forever),
and must never be deleted by the controller either (it is not the controller's pod). A grading
pod released with reuse goes back only to a grading of the same tenant.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid

import pytest

from controller import metrics
from controller.books import State
from controller.core import Controller
from controller.pacer import Limits
from controller.pods import AcquireOrder, SandboxSpec
from controller.settings import Settings
from controller.warmpool import WarmPool
from sandman import contract
from tests.controller.fakekube import FakeKube

SPEC = SandboxSpec("registry.invalid/img:1", cpu="1", memory="1Gi")
GRADING = SandboxSpec("registry.invalid/grader:1", cpu="1", memory="1Gi",
                      role=contract.ROLE_GRADING)
KEY = b"k" * 32


def settings(**kw) -> Settings:
    kw.setdefault("limits", Limits(rate=100, burst=100, max_live=5))
    return Settings(namespace="ns", ready_check="pod", image_pinning="off", sweep_interval=3600, sweep_grace=0,
                    **kw)


def forged(name: str, job: str = "victim.run", sandbox: bool = False,
           annotations: dict | None = None) -> dict:
    """What any pod creator can write: the controller's labels, without the controller."""
    labels = {contract.LABEL_MANAGED_BY: contract.MANAGED_BY_CONTROLLER,
              contract.LABEL_STATE: contract.STATE_LEASED, contract.LABEL_JOB: job,
              contract.LABEL_NONCE: "0123456789abcdef"}
    if sandbox:
        labels[contract.LABEL_SANDBOX] = contract.SANDBOX_TRUE
    old = dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "ns", "uid": str(uuid.uuid4()),
                         "resourceVersion": "1", "labels": labels,
                         "annotations": dict(annotations or {}),
                         "creationTimestamp": old.strftime("%Y-%m-%dT%H:%M:%SZ")},
            "spec": {"containers": [{"name": "sandbox", "image": "registry.invalid/img:1"}]},
            "status": {"phase": "Running", "podIP": "127.0.0.9"}}


def plant(kube: FakeKube, pods: list[dict]) -> None:
    for p in pods:
        kube.pods[p["metadata"]["name"]] = p
        kube.view[p["metadata"]["name"]] = p


def foreign_count(reason: str) -> float:
    return metrics.FOREIGN_PODS.labels(reason)._value.get()


def run(body, s: Settings, kube: FakeKube | None = None, timeout: float = 30.0):
    async def main():
        k = kube or FakeKube()
        ctl = Controller(k, s)
        await ctl.start()
        try:
            await asyncio.wait_for(body(ctl, k), timeout)
        finally:
            await ctl.stop()
        assert ctl.books.illegal == 0

    asyncio.run(main())


@pytest.mark.parametrize("sandbox_label", [False, True], ids=["no-sandbox-label", "no-proof"])
def test_forged_leased_pods_never_enter_the_books_nor_fill_the_caps(sandbox_label):
    kube = FakeKube()
    plant(kube, [forged(f"forged-{i}", sandbox=sandbox_label) for i in range(5)])
    reason = "no_proof" if sandbox_label else "no_sandbox_label"
    before = foreign_count(reason)

    async def body(ctl: Controller, kube: FakeKube):
        assert not ctl.books.entries, "a forged pod became an entry of the books"
        assert ctl.pacer.live == 0
        # max_live=5 and five forged pods: another tenant still gets a sandbox at once.
        got = await ctl.acquire(AcquireOrder(SPEC, "other.run", timeout_s=5, wait=False))
        assert ctl.books.entries[got["id"]].stage is State.LEASED
        await ctl.sweep()
        await asyncio.sleep(0.1)
        # Not the controller's pods: never labelled, never deleted.
        for i in range(5):
            p = kube.pods[f"forged-{i}"]
            assert p["metadata"]["labels"][contract.LABEL_STATE] == contract.STATE_LEASED
        assert not [n for m, n in kube.calls if m in ("delete", "patch") and
                    n.startswith("forged-")]
        # Counted once per pod, however many rebuilds and sweeps see it.
        ctl.sweeper.rebuild(list(kube.view.values()))
        await ctl.sweep()
        assert foreign_count(reason) - before == 5

    run(body, settings(books_key=KEY), kube)


def test_without_a_key_a_pod_without_the_sandbox_label_is_still_ignored():
    kube = FakeKube()
    plant(kube, [forged(f"forged-{i}") for i in range(5)])

    async def body(ctl: Controller, kube: FakeKube):
        assert not ctl.books.entries
        await ctl.acquire(AcquireOrder(SPEC, "other.run", timeout_s=5, wait=False))

    run(body, settings(), kube)


def test_a_proof_for_another_pod_does_not_check_out():
    """A forger that copies a real pod's proof annotation onto a pod of its own gains nothing:
    the proof binds the pod's name and nonce."""
    async def first(ctl: Controller, kube: FakeKube):
        got = await ctl.acquire(AcquireOrder(SPEC, "a.run", timeout_s=5))
        real = kube.pods[got["pod"]]
        ann = {contract.ANNOTATION_PROOF: real["metadata"]["annotations"][contract.ANNOTATION_PROOF]}
        plant(kube, [forged("copycat", sandbox=True, annotations=ann)])

    kube = FakeKube()
    run(first, settings(books_key=KEY), kube)

    async def second(ctl: Controller, kube: FakeKube):
        assert set(ctl.books.entries) == {n for n in kube.pods if n != "copycat"}
        assert "copycat" in kube.pods

    run(second, settings(books_key=KEY), kube)


@pytest.mark.parametrize("key", [None, KEY], ids=["no-key", "key"])
def test_the_controllers_own_pods_are_rebuilt_after_a_restart(key):
    kube = FakeKube()
    names: list[str] = []

    async def first(ctl: Controller, kube: FakeKube):
        for job in ("a.run", "b.run"):
            names.append((await ctl.acquire(AcquireOrder(SPEC, job, timeout_s=5)))["pod"])

    run(first, settings(books_key=key), kube)

    async def second(ctl: Controller, kube: FakeKube):
        assert {n: e.stage for n, e in ctl.books.entries.items()} == {
            n: State.LEASED for n in names}
        assert ctl.pacer.live == 2

    run(second, settings(books_key=key), kube)


def test_a_pod_made_before_the_key_is_not_the_books_once_there_is_one():
    """Turning the key on makes the pods the controller made without it foreign: docs say to
    drain first."""
    kube = FakeKube()

    async def first(ctl: Controller, kube: FakeKube):
        await ctl.acquire(AcquireOrder(SPEC, "a.run", timeout_s=5))

    run(first, settings(), kube)

    async def second(ctl: Controller, kube: FakeKube):
        assert not ctl.books.entries

    run(second, settings(books_key=KEY), kube)


# ---- checked reuse never crosses tenants -------------------------------------------------------
async def _clean(self, e, token, token_sha):
    return None  # execd's restore is tested on the test bed; here only where the pod goes


def test_a_reused_grading_pod_goes_back_only_to_its_tenant(monkeypatch):
    monkeypatch.setattr(WarmPool, "_restore", _clean)

    async def body(ctl: Controller, kube: FakeKube):
        first = await ctl.acquire(AcquireOrder(GRADING, "a.grade", timeout_s=5))
        assert await ctl.release_reuse(first["id"]) == (True, True)
        assert ctl.books.entries[first["pod"]].stage is State.PARKED
        # Another tenant's grading that accepts a reused pod gets a new one...
        other = await ctl.acquire(AcquireOrder(GRADING, "b.grade", timeout_s=5, reused_ok=True))
        assert other["pod"] != first["pod"]
        assert ctl.books.entries[first["pod"]].stage is State.PARKED
        # ...and the same tenant's (another job of it) gets the restored pod.
        again = await ctl.acquire(AcquireOrder(GRADING, "a.other", timeout_s=5, reused_ok=True))
        assert again["pod"] == first["pod"] and again["warm"]

    run(body, settings(tenants=True))


def test_without_tenants_a_reused_pod_goes_to_the_next_grading(monkeypatch):
    monkeypatch.setattr(WarmPool, "_restore", _clean)

    async def body(ctl: Controller, kube: FakeKube):
        first = await ctl.acquire(AcquireOrder(GRADING, "grade", timeout_s=5))
        assert await ctl.release_reuse(first["id"]) == (True, True)
        again = await ctl.acquire(AcquireOrder(GRADING, "grade-2", timeout_s=5, reused_ok=True))
        assert again["pod"] == first["pod"]

    run(body, settings())
