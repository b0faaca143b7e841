"""The real-node suite: sandman installed with `helm install --wait` on the test bed's real
node (testbed/install.py), each test a real pod.

The bed (control plane + 2 kwok nodes + the real node) is the session's `_real_bed` (one real
node per machine, shared with tests/testbed/test_realnode.py); the install happens once, for
this package, and is removed after its last test. The lifecycle test (upgrade, uninstall) runs
last. The whole directory is skipped, with one line saying why, when this machine cannot host
a real node (not root, no cgroups, Debian packages missing and not installable).
"""

from __future__ import annotations

import os
import time

import pytest

from tests.e2e.helpers import E2E

if os.environ.get("SANDMAN_KUBECONFIG"):
    pytest.skip("real-node suite: needs the local test bed (SANDMAN_KUBECONFIG is set)",
                allow_module_level=True)


def _unavailable() -> str | None:
    from testbed import realnode

    return realnode.install_sysdeps() or realnode.unavailable_reason()


_REASON = _unavailable()
if _REASON:
    pytest.skip(f"real-node suite: {_REASON}", allow_module_level=True)

LAST = ("test_lifecycle.py",)


def pytest_collection_modifyitems(items):
    """Upgrade and uninstall end the install every other test uses: they run last of this
    directory (the other directories keep their places)."""
    mine = [i for i, item in enumerate(items) if "/e2e/" in str(item.path)]
    ordered = sorted((items[i] for i in mine), key=lambda it: it.path.name in LAST)
    for i, item in zip(mine, ordered, strict=True):
        item.add_marker(pytest.mark.realnode)
        item.add_marker(pytest.mark.testbed)
        items[i] = item


@pytest.fixture(scope="package")
def e2e(_real_bed, figures) -> E2E:
    """sandman installed on the real node; uninstalled after the package's last test."""
    from testbed.install import Install, InstallError

    cluster = _real_bed.get(figures)
    inst = Install(cluster.testbed)
    env = E2E(cluster, inst)
    t0 = time.monotonic()
    try:
        # 600 s by default; shorter to see an install that never completes fail sooner.
        took = inst.install(timeout=os.environ.get("SANDMAN_E2E_INSTALL_TIMEOUT", "600s"))
    except InstallError as e:
        env.install_error = str(e)
        took = None
    if took is not None:
        figures.add(f"e2e: images {inst.timings['images']:.1f}s, helm install --wait "
                    f"(3 webhook + 2 controller replicas, cert Job) {took:.1f}s")
    try:
        yield env
    finally:
        try:
            inst.uninstall()
        finally:
            figures.add(f"e2e: install to uninstall {time.monotonic() - t0:.1f}s")


@pytest.fixture
def sandman(e2e: E2E) -> E2E:
    """The installed product; a test using it fails (not errors later) if the install failed."""
    if e2e.install_error:
        pytest.fail(f"helm install --wait failed: {e2e.install_error}", pytrace=False)
    return e2e


@pytest.fixture
def ns(sandman: E2E, request):
    """A fresh namespace (no NetworkPolicy in it), deleted afterwards."""
    name = sandman.cluster.new_namespace("e2e-" + request.node.name.replace("_", "-")[5:25])
    yield name
    sandman.cluster.delete_namespace(name)
