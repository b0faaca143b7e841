"""Shared fixtures. `cluster` is the real local control plane (testbed), started once per
session on first use; `namespace` gives each test a fresh namespace.

SANDMAN_KUBECONFIG=/path runs the same tests against an existing cluster (kind, EKS) instead.
If the test bed cannot be built or started, every test that needs it FAILS with the reason.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from testbed.cluster import Testbed, TestbedError, default_state_dir, remove_stale_state_dirs
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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    tb = _BED.get("testbed")
    if rep.failed and tb is not None and "cluster" in item.fixturenames:
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


def pytest_collection_modifyitems(items):
    # Every test that touches the cluster carries the marker, so `-m "not testbed"` works.
    for item in items:
        if "cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.testbed)
