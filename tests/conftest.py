"""Shared fixtures. `cluster` is the real local control plane (testbed), started once per
session on first use; `namespace` gives each test a fresh namespace.

SANDMAN_KUBECONFIG=/path runs the same tests against an existing cluster (kind, EKS) instead.
If the test bed cannot be built or started, every test that needs it FAILS with the reason.

`real_cluster` is a second, separate test bed with a node that runs real containers
(testbed/realnode.py, one per machine), started on first use; its tests are SKIPPED, with one
line saying why, only when this machine cannot host a real node (not root, no cgroups, Debian
packages missing and not installable).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from testbed.cluster import (
    Testbed,
    TestbedError,
    default_state_dir,
    remove_stale_state_dirs,
    remove_state_dir,
)
from testbed.kube import Cluster

_BED: dict[str, object] = {}


@pytest.fixture(scope="session")
def cluster() -> Cluster:
    external = os.environ.get("SANDMAN_KUBECONFIG")
    if external:
        yield Cluster.connect(Path(external))
        return
    remove_stale_state_dirs("pytest-")
    # One state dir per session: parallel sessions (several terminals, CI) never share one.
    tb = Testbed(default_state_dir(f"pytest-{os.getpid()}"),
                 nodes=int(os.environ.get("SANDMAN_TESTBED_NODES", "20")), audit=True)
    t0 = time.monotonic()
    try:
        tb.start()
    except TestbedError as e:
        pytest.fail(f"test bed failed to start: {e}", pytrace=False)
    _BED["testbed"] = tb
    _BED["startup_s"] = time.monotonic() - t0
    try:
        yield Cluster.connect(tb.kubeconfig, tb)
    finally:
        tb.stop()


def _remove_stale_state_dirs() -> None:
    """State dirs of sessions whose process is gone (their logs were kept until now). A real
    node such a session left behind is cleaned first (its mounts are under the dir)."""
    from testbed import realnode

    root = default_state_dir("x").parent
    for d in root.glob("pytest-*"):
        try:
            pid = int(d.name.split("-")[1])  # pytest-<pid> and pytest-<pid>-real
        except ValueError:
            continue
        if pid != os.getpid() and not Path(f"/proc/{pid}").exists():
            try:
                realnode.cleanup_leftovers(d)
                remove_state_dir(d)
            except TestbedError as e:
                print(f"conftest: cannot remove stale {d}: {e}")



class _RealBed:
    """The session's real-node test bed, started on first use and again after a test stopped
    it (the teardown test does)."""

    def __init__(self) -> None:
        self.tb: Testbed | None = None
        self.cluster: Cluster | None = None
        self.skip: str | None = None

    def get(self, figures: Figures) -> Cluster:
        if os.environ.get("SANDMAN_KUBECONFIG"):
            pytest.skip("real-node tests need the local test bed (SANDMAN_KUBECONFIG is set)")
        from testbed import realnode

        if self.skip is None:
            self.skip = realnode.install_sysdeps() or realnode.unavailable_reason() or ""
        if self.skip:
            pytest.skip(self.skip)
        if self.tb is not None and self.tb.realnode is not None and self.tb.components:
            return self.cluster
        _remove_stale_state_dirs()
        self.tb = Testbed(default_state_dir(f"pytest-{os.getpid()}-real"),
                          nodes=int(os.environ.get("SANDMAN_TESTBED_REAL_KWOK_NODES", "2")),
                          # One real node per machine: another session's is waited for.
                          real_node=True, real_node_wait=480)
        t0 = time.monotonic()
        try:
            self.tb.start()
        except TestbedError as e:
            self.tb = None
            pytest.fail(f"real-node test bed failed to start: {e}", pytrace=False)
        rn = self.tb.realnode
        wait = rn.timings.get("slot-wait", 0.0)
        figures.add(f"real-node test bed up in {time.monotonic() - t0 - wait:.1f}s (real node: "
                    f"network {rn.timings['prepare']:.1f}s, containerd..Ready..DNS/proxy/policy "
                    f"{rn.timings['start']:.1f}s)"
                    + (f", after {wait:.0f}s waiting for another bed's real node" if wait > 1
                       else ""))
        _BED["real"] = self.tb
        self.cluster = Cluster.connect(self.tb.kubeconfig, self.tb)
        return self.cluster

    def stop(self) -> None:
        tb = self.forget()
        if tb is not None:
            tb.stop()  # raises TestbedError naming whatever was left on the machine

    def forget(self) -> Testbed | None:
        """Drop the bed without stopping it (a test that crashed it on purpose)."""
        tb, self.tb, self.cluster = self.tb, None, None
        _BED.pop("real", None)
        return tb


@pytest.fixture(scope="session")
def _real_bed():
    bed = _RealBed()
    try:
        yield bed
    finally:
        bed.stop()


@pytest.fixture
def real_cluster(_real_bed: _RealBed, figures) -> Cluster:
    """The real-node test bed (see testbed/realnode.py): `.testbed.realnode` is the RealNode."""
    return _real_bed.get(figures)


@pytest.fixture
def real_namespace(real_cluster: Cluster, request) -> str:
    ns = real_cluster.new_namespace(request.node.name.replace("_", "-")[:30])
    yield ns
    if real_cluster.testbed is not None and real_cluster.testbed.components:
        real_cluster.delete_namespace(ns)


@pytest.fixture
def namespace(cluster: Cluster, request) -> str:
    ns = cluster.new_namespace(request.node.name.replace("_", "-").replace("[", "-")
                               .replace("]", "")[:30])
    yield ns
    cluster.delete_namespace(ns)


@pytest.fixture(autouse=True)
def _testbed_alive(request):
    """After each test-bed test: a component that crashed fails that test, loudly."""
    yield
    if "cluster" in request.fixturenames and "testbed" in _BED:
        _BED["testbed"].check()
    if "real_cluster" in request.fixturenames and "real" in _BED:
        _BED["real"].check()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    tb = _BED.get("testbed")
    if "real_cluster" in item.fixturenames:
        tb = _BED.get("real")
    if rep.failed and tb is not None and {"cluster", "real_cluster"} & set(item.fixturenames):
        for log in sorted(Path(tb.logs).glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()[-25:]
            rep.sections.append((f"test-bed log {log} (last 25 lines)", "\n".join(lines)))


# Figures printed at the end of the run: tests call `figures.add("...")`.
class Figures:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, line: str) -> None:
        self.lines.append(line)


_FIGURES = Figures()


@pytest.fixture(scope="session")
def figures() -> Figures:
    return _FIGURES


def pytest_terminal_summary(terminalreporter):
    lines = list(_FIGURES.lines)
    if "startup_s" in _BED:
        lines.insert(0, f"test bed up in {_BED['startup_s']:.1f}s")
    if lines:
        terminalreporter.section("sandman figures")
        for line in lines:
            terminalreporter.write_line(line)


# The tiers (docs/testbed.md "Test tiers") are selected with -m: `make check` runs what carries
# none of testbed, realnode, netns, e2e. A directory marks its tests, a fixture marks the tests
# that use it (in any directory), a test or module marks itself (root-only tests: `netns`).
_TESTS = Path(__file__).resolve().parent
_DIR_MARKERS = {
    "e2e": ("e2e", "realnode", "testbed"),  # sandman installed on the real node
    "images": ("netns",),  # a throwaway containerd, overlay mounts, debootstrap: root
}
# `helm`: the chart renders with the helm binary the test-bed build makes.
_FIXTURE_MARKERS = {
    "cluster": ("testbed",),
    "real_cluster": ("testbed", "realnode"),
    "helm": ("testbed",),
}


def pytest_collection_modifyitems(items):
    for item in items:
        try:
            top = Path(item.path).resolve().relative_to(_TESTS).parts[0]
        except ValueError:
            top = ""
        marks = set(_DIR_MARKERS.get(top, ()))
        for name in getattr(item, "fixturenames", ()):
            marks.update(_FIXTURE_MARKERS.get(name, ()))
        for mark in sorted(marks):
            item.add_marker(mark)
