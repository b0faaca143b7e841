"""Shared fixtures. `cluster` is the real local control plane (testbed), started once per
session on first use; `namespace` gives each test a fresh namespace.

SANDMAN_KUBECONFIG=/path runs the same tests against an existing cluster (kind, EKS) instead.
If the test bed cannot be built or started, every test that needs it FAILS with the reason.

`real_cluster` is a second, separate test bed with a node that runs real containers
(testbed/realnode.py, one per machine), started on first use; its tests are SKIPPED, with one
line saying why, only when this machine cannot host a real node (not root, no cgroups, Debian
packages missing and not installable).

`otlp_receiver` is a running Jaeger (tests/otlp_receiver.py), the real OTLP/HTTP receiver of the
trace tests; without a built Jaeger (`make jaeger`) its tests FAIL saying so.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from testbed.cluster import (
    Cluster,
    Testbed,
    TestbedError,
    default_state_dir,
    remove_stale_state_dirs,
    remove_state_dir,
)
from tests.otlp_receiver import Jaeger, JaegerError

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


@pytest.fixture
def otlp_receiver() -> Jaeger:
    jaeger, error = Jaeger(), ""
    try:
        jaeger.start()
    except JaegerError as e:
        error = str(e)
    if error:  # outside the except: the reason alone, not a chained traceback
        pytest.fail(error, pytrace=False)
    yield jaeger
    jaeger.stop()


def _beds_of(fixturenames) -> list[Testbed]:
    """The session's beds a test uses, through any fixture of its closure: `cluster` for the
    shared bed, `_real_bed` for the real-node one (`real_cluster`, and the e2e suite's
    `e2e`/`sandman`/`ns`, which reach it without `real_cluster`)."""
    names = set(fixturenames)
    beds = []
    if "cluster" in names and "testbed" in _BED:
        beds.append(_BED["testbed"])
    if "_real_bed" in names and "real" in _BED:
        beds.append(_BED["real"])
    return beds


@pytest.fixture(autouse=True)
def _testbed_alive(request):
    """After each test-bed test: a component that crashed fails that test, loudly."""
    yield
    for tb in _beds_of(request.fixturenames):
        tb.check()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if not rep.failed:
        return
    for tb in _beds_of(getattr(item, "fixturenames", ())):
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


# Skips: `make test` (SANDMAN_NO_SKIPS=1) and CI (CI=true) fail the run on any skipped test
# not listed here, so a test that silently stops running is seen. Each entry: a node id prefix
# and a substring of the skip's reason, with a comment saying why that skip is expected on
# the machines `make test` runs on. Deselected tests (`-m`, `-k`) are not skips.
ALLOWED_SKIPS: tuple[tuple[str, str], ...] = ()

_SKIPPED: list[tuple[str, str]] = []


def _no_skips() -> bool:
    return (os.environ.get("SANDMAN_NO_SKIPS") == "1"
            or os.environ.get("CI", "").lower() == "true")


def _record_skip(report) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(
            report.longrepr)
        _SKIPPED.append((report.nodeid, reason))


def pytest_runtest_logreport(report):
    _record_skip(report)


def pytest_collectreport(report):
    _record_skip(report)  # a module-level skip skips all of its tests at once


def _unexpected_skips() -> list[tuple[str, str]]:
    allowed = list(ALLOWED_SKIPS)
    if os.environ.get("SANDMAN_KUBECONFIG"):
        # Against an existing cluster the tests that need the local bed's own parts (its real
        # node, its CA) cannot run, and say so.
        allowed.append(("", "SANDMAN_KUBECONFIG is set"))
    return [(n, r) for n, r in _SKIPPED if not any(n.startswith(p) and s in r for p, s in allowed)]


def pytest_sessionfinish(session, exitstatus):
    if _no_skips() and _unexpected_skips() and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    lines = list(_FIGURES.lines)
    if "startup_s" in _BED:
        lines.insert(0, f"test bed up in {_BED['startup_s']:.1f}s")
    if lines:
        terminalreporter.section("sandman figures")
        for line in lines:
            terminalreporter.write_line(line)
    if _no_skips() and _unexpected_skips():
        terminalreporter.section("unexpected skips (SANDMAN_NO_SKIPS=1 or CI=true)", red=True)
        for nodeid, reason in _unexpected_skips():
            terminalreporter.write_line(f"SKIPPED {nodeid}: {reason}")
        terminalreporter.write_line("the run fails: every test must run here, or its skip "
                                    "be listed with its reason in tests/conftest.py "
                                    "ALLOWED_SKIPS")


# The tiers (docs/testbed.md "Test tiers") are selected with -m: `make check` runs what carries
# none of testbed, realnode, netns, e2e. A directory marks its tests, a fixture marks the tests
# that use it (in any directory), a test or module marks itself (root-only tests: `netns`).
_TESTS = Path(__file__).resolve().parent
_DIR_MARKERS = {
    "e2e": ("e2e", "realnode", "testbed"),  # sandman installed on the real node
    "images": ("netns",),  # a throwaway containerd, overlay mounts, debootstrap: root
}
_FIXTURE_MARKERS = {
    "cluster": ("testbed",),
    "real_cluster": ("testbed", "realnode"),
    # The real-node bed, also reached without real_cluster (the e2e suite's fixtures).
    "_real_bed": ("testbed", "realnode"),
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
