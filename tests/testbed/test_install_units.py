"""testbed/install.py without a bed: "nothing left after uninstall" is only said by an API
server that answered. The real kubectl against a refused port on 127.0.0.1 must raise, never
report an empty list."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import yaml

from testbed import build
from testbed.install import Install, InstallError
from testbed.procs import refused_port

# The bed's tier: the fixture needs the bed's kubectl and builds the bed's binaries when they
# are missing (417 s of `make check` on a machine whose `make testbed-build` had not ended);
# the check tier needs `make deps` only.
pytestmark = pytest.mark.testbed


@pytest.fixture
def dead_install(tmp_path) -> Iterator[Install]:
    if not build.binaries()["kubectl"].exists():
        try:  # as tests/charts/helm.py: the bed's own kubectl, built once per version
            build.build()
        except build.BuildError as e:
            pytest.fail(f"cannot build kubectl: {e}", pytrace=False)
    kubeconfig = tmp_path / "kubeconfig"
    dead = contextlib.ExitStack()  # held for the test: connections to its port are refused
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "dead",
        "clusters": [{"name": "dead", "cluster": {
            "server": f"https://127.0.0.1:{dead.enter_context(refused_port())}",
            "insecure-skip-tls-verify": True}}],
        "users": [{"name": "dead", "user": {"token": "t"}}],
        "contexts": [{"name": "dead", "context": {"cluster": "dead", "user": "dead"}}],
    }))
    tb = SimpleNamespace(realnode=object(), state_dir=tmp_path / "state", kubeconfig=kubeconfig)
    with dead:
        yield Install(tb)


def test_leftovers_raise_when_the_api_server_is_unreachable(dead_install):
    with pytest.raises(InstallError, match="refused"):
        dead_install.leftovers()


def test_runtime_leftovers_raise_when_the_api_server_is_unreachable(dead_install):
    with pytest.raises(InstallError, match="refused"):
        dead_install.runtime_leftovers()
