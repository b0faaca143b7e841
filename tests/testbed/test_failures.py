"""Bad input to the test bed: one clear line naming the component and its log, nothing left
running afterwards."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from testbed import build
from testbed.cluster import Testbed, TestbedError


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.testbed  # starts etcd from the test-bed build
def test_apiserver_port_in_use_names_component_and_log(tmp_path, monkeypatch):
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        monkeypatch.setenv("SANDMAN_TESTBED_APISERVER_PORT", str(port))
        tb = Testbed(tmp_path / "bed", nodes=1)
        started: list[int] = []
        orig = tb._spawn

        def spy(name, cmd):
            comp = orig(name, cmd)
            started.append(comp.pid)
            return comp

        tb._spawn = spy
        with pytest.raises(TestbedError) as err:
            tb.start()
    msg = str(err.value)
    assert msg.startswith("kube-apiserver: port 127.0.0.1:") and "in use" in msg
    assert str(tmp_path / "bed" / "logs" / "kube-apiserver.log") in msg
    assert "\n" not in msg
    assert started, "etcd should have been started before the apiserver check"
    assert not any(_alive(pid) for pid in started), "a component was left running"


def test_build_without_go_fails_with_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("SANDMAN_TESTBED_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path))  # no `go` here
    with pytest.raises(build.BuildError) as err:
        build.build()
    assert "`go` is not on PATH" in str(err.value) and "\n" not in str(err.value)
    assert not any((tmp_path / "cache").rglob("kube-apiserver")), "no half-built binary"


def test_staging_list_comes_from_kubernetes_gomod():
    gomod = (
        "module k8s.io/kubernetes\n\nreplace (\n"
        "\tk8s.io/api => ./staging/src/k8s.io/api\n"
        "\tk8s.io/client-go => ./staging/src/k8s.io/client-go\n"
        "\tgithub.com/x/y => github.com/x/y v1.0.0\n)\n")
    mods = build.staging_modules(gomod)
    assert mods == ["k8s.io/api", "k8s.io/client-go"]
    wrapper = build._wrapper_gomod("v1.36.2", mods)
    assert "\tk8s.io/api => k8s.io/api v0.36.2\n" in wrapper
    assert "require k8s.io/kubernetes v1.36.2" in wrapper
    with pytest.raises(build.BuildError):
        build.staging_modules("module x\n")


@pytest.mark.testbed  # builds the binaries unless cached
def test_cached_binaries_are_not_rebuilt(monkeypatch):
    bins = build.build()  # the session's bed already built them
    mtimes = {n: p.stat().st_mtime for n, p in bins.items()}
    monkeypatch.setenv("PATH", "/nonexistent")  # a rebuild would need go and fail
    assert build.build() == bins
    assert {n: p.stat().st_mtime for n, p in bins.items()} == mtimes
    assert all(os.access(p, os.X_OK) for p in bins.values())
