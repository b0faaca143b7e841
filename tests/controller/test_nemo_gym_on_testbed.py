"""`SandmanProvider` (sandman.client.nemo_gym) driven by NeMo Gym's own code against the real
controller on the test bed, with a real execd behind each pod (the kubelet stand-in,
testbed/standin.py): NeMo Gym's `AsyncSandbox` (start, its spec's files uploaded by NeMo Gym,
commands with cwd, variables and timeouts, transfers, status, stop), its sync `Sandbox`, and its
mini-swe-agent sandbox environment to its submit sentinel; then docs/sdk.md's example as
written. Every pod gone afterwards.

NeMo Gym needs Python >= 3.12: the checks run from .venv-frameworks (`make deps`), the client
installed there from this tree (its entry point is how NeMo Gym finds the provider). The
spec's workdir is an absolute /workspace, so the stand-in gives each pod its own
(`private_dirs`: a mount namespace per execd, root only)."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from testbed.procs import wait_for
from tests.client.test_nemo_gym import PYTHON, run_checks
from tests.controller.harness import pods, standin_stack

pytestmark = pytest.mark.netns  # the stand-in's private /workspace: mounts

IMAGE = "registry.invalid/nemo-gym/task:1"


@pytest.fixture
def stack(cluster, namespace, tmp_path):
    with standin_stack(cluster, namespace, tmp_path, "nemo-gym",
                       private_dirs=("workspace",)) as got:
        yield got


def docs_example() -> str:
    """docs/sdk.md's NeMo Gym example, as written (its one ```python block)."""
    md = (PYTHON.parents[2] / "docs" / "sdk.md").read_text()
    section = md.split("\n## NeMo Gym\n", 1)[1].split("\n## ", 1)[0]
    [code] = re.findall(r"```python\n(.*?)```", section, re.S)
    assert 'IMAGE = "' in code, code
    return re.sub(r'IMAGE = "[^"]*"', f'IMAGE = "{IMAGE}"', code)


def test_nemo_gym_drives_sandman(cluster, namespace, stack, tmp_path):
    ctl, standin = stack
    env = {"SANDMAN_URL": ctl.url, "HOME": str(tmp_path)}
    got = run_checks("bed", IMAGE, "/workspace", env=env, timeout=240)

    # NeMo Gym uploaded the spec's file itself; the spec's and the call's variables; the
    # spec's workdir; a failing command's status; one stream (stderr None).
    assert got["exec"] == ["hello\nhi there\n/workspace\n", None, 3, None], got["exec"]
    assert got["isolated"] == "/workspace\nnone\n", got["isolated"]  # no cd/export leaks
    assert got["cwd"] == "/\n"
    out, code, ran = got["hostile"]
    assert code == 0 and out == "$(touch RAN)'\"`touch RAN2`; touch RAN4|" and ran == "0", \
        got["hostile"]
    assert got["hostile_cwd"][0] != 0 and got["hostile_cwd"][1] != 0, got["hostile_cwd"]
    assert got["timeout"] == [124, "timeout"] and got["after_timeout"] == "alive\n"
    assert got["roundtrip"] is True
    assert got["status"] == "running" and got["status_after_stop"] == "stopped"
    assert got["sync"] == ["sync\n", 1] and got["status"] == "running"

    # NeMo Gym's mini-swe-agent environment: its commands in its cwd, and its sentinel.
    assert got["execute"] == ["1\ngreet\n", 0], got["execute"]
    assert got["failed"] == 7
    assert got["submitted"] == "the-patch\n", got["submitted"]

    # The documented example, as a user would paste it.
    out = subprocess.run([str(PYTHON), "-c", docs_example()], capture_output=True, text=True,
                         timeout=120, env={"PATH": os.environ["PATH"], **env})
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.splitlines()[-1] == "0 hello from sandman", out.stdout

    # Every sandbox released by NeMo Gym's stop()/cleanup(): the pods and their execds go.
    wait_for(lambda: not [p for p in pods(cluster.core, namespace)
                          if not p.metadata.deletion_timestamp], 30, "release")
    wait_for(lambda: not standin.alive(), 20, "the execds gone")
