"""A job's recorded image pins against the fake `Kube`: the paths the test bed cannot make
happen on demand (the record unreadable or unwritable: the API server failing), and the
record read by a second controller as a new leader would. The registry is replaced by a
resolver that says which digest the tag names now; the same attacks with the real API server
and registry: test_image_pinning_on_testbed.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from controller.core import Controller
from controller.create import job_object_name
from controller.errors import ImageUnresolved
from controller.images import pin_key
from controller.settings import Settings
from tests.controller.fakekube import FakeKube

TAG = "registry.invalid/swe/task:v1"
D1, D2 = "sha256:" + "1" * 64, "sha256:" + "2" * 64
KEY = b"k" * 32


def controller(kube: FakeKube, names: str | None, key: bytes | None = None) -> Controller:
    """A controller whose registry says `names` for every tag (None: fails the test if asked)."""
    c = Controller(kube, Settings(namespace="ns", ready_check="pod", image_pinning="resolve",
                                  books_key=key))

    async def resolve(ref):
        assert names is not None, "a tag was resolved"
        return names
    c.pins._resolve = resolve  # type: ignore[method-assign]
    return c


def test_a_new_leader_reads_the_job_s_pin_instead_of_resolving_again():
    async def main():
        kube = FakeKube()
        first = await controller(kube, D1).pins.pin("run", TAG)
        assert first == f"registry.invalid/swe/task@{D1}"
        # The tag has moved; a new leader (a new Controller) starts with empty memory.
        assert await controller(kube, D2).pins.pin("run", TAG) == first
        assert await controller(kube, D2).pins.pin("other", TAG) == f"registry.invalid/swe/task@{D2}"
    asyncio.run(main())


def test_an_unreadable_record_refuses_the_acquire_and_resolves_nothing():
    async def main():
        kube = FakeKube()
        kube.fault("read_cm", "500")
        pins = controller(kube, None).pins
        with pytest.raises(ImageUnresolved) as ei:
            await pins.pin("run", TAG)
        msg = str(ei.value)
        assert "could not be read" in msg and "refused" in msg and "\n" not in msg, msg
    asyncio.run(main())


def test_an_unwritable_record_refuses_and_keeps_nothing_in_memory():
    async def main():
        kube = FakeKube()
        pins = controller(kube, D1).pins
        await pins.pin("first-creates-the-configmap", TAG)
        kube.fault("patch_cm", "500")
        with pytest.raises(ImageUnresolved) as ei:
            await pins.pin("run", TAG)
        assert "could not be written" in str(ei.value), ei.value
        assert pins.pinned("run", TAG) is None  # unrecorded: never used, never cached
        assert await pins.pin("run", TAG) == f"registry.invalid/swe/task@{D1}"
        data = kube.config_maps[job_object_name("run")]["data"]
        assert json.loads(data[pin_key(TAG)])["pinned"].endswith(D1)
    asyncio.run(main())


def test_a_pin_copied_from_another_job_does_not_verify_under_the_books_key():
    async def main():
        kube = FakeKube()
        await controller(kube, D2, KEY).pins.pin("attacker", TAG)
        await controller(kube, D1, KEY).pins.pin("victim", TAG)
        theirs = kube.config_maps[job_object_name("attacker")]["data"][pin_key(TAG)]
        kube.config_maps[job_object_name("victim")]["data"][pin_key(TAG)] = theirs
        with pytest.raises(ImageUnresolved) as ei:
            await controller(kube, None, KEY).pins.pin("victim", TAG)
        assert "proof" in str(ei.value) and "not resolved anew" in str(ei.value), ei.value
    asyncio.run(main())
