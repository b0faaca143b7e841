"""testbed/install.py without a bed: "nothing left after uninstall" is only said by an API
server that answered. The real kubectl against a closed port on 127.0.0.1 must raise, never
report an empty list."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest
import yaml

from testbed import build
from testbed.install import Install, InstallError


def closed_port() -> int:
    """A 127.0.0.1 port nothing listens on (bound, then closed: connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def dead_install(tmp_path) -> Install:
    if not build.binaries()["kubectl"].exists():
        try:  # as tests/charts/helm.py: the bed's own kubectl, built once per version
            build.build()
        except build.BuildError as e:
            pytest.fail(f"cannot build kubectl: {e}", pytrace=False)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "dead",
        "clusters": [{"name": "dead", "cluster": {
            "server": f"https://127.0.0.1:{closed_port()}", "insecure-skip-tls-verify": True}}],
        "users": [{"name": "dead", "user": {"token": "t"}}],
        "contexts": [{"name": "dead", "context": {"cluster": "dead", "user": "dead"}}],
    }))
    tb = SimpleNamespace(realnode=object(), state_dir=tmp_path / "state", kubeconfig=kubeconfig)
    return Install(tb)


def test_leftovers_raise_when_the_api_server_is_unreachable(dead_install):
    with pytest.raises(InstallError, match="refused"):
        dead_install.leftovers()


def test_runtime_leftovers_raise_when_the_api_server_is_unreachable(dead_install):
    with pytest.raises(InstallError, match="refused"):
        dead_install.runtime_leftovers()
