"""`SandmanEnvironment` (sandman.client.harbor) driven by Harbor's own command line against the
real controller on the test bed, with a real execd behind each pod (the kubelet stand-in,
testbed/standin.py, which lists what it does not reproduce): `harbor trial start` of a task
with its oracle agent, scored by Harbor's verifier, reward 1; the same task with a broken
solution, reward 0; the pods gone afterwards.

Harbor needs Python >= 3.12: it runs from .venv-frameworks (`make deps`,
tools/frameworks_venv.py), the client installed there from this tree. Harbor writes fixed
top-level paths in its environment (/logs, /tests, /solution), so the stand-in gives each pod
its own (`private_dirs`: a mount namespace per execd, root only)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from testbed.procs import wait_for
from tests.controller.harness import pods, standin_stack

pytestmark = pytest.mark.netns  # the stand-in's private /logs, /tests, /solution: mounts

ROOT = Path(__file__).resolve().parents[2]
HARBOR = ROOT / ".venv-frameworks" / "bin" / "harbor"
SDK_MD = ROOT / "docs" / "sdk.md"
IMAGE = "registry.invalid/harbor/greet:1"
ENV_CLASS = "sandman.client.harbor:SandmanEnvironment"

TASK_TOML = f"""\
schema_version = "1.4"

[task]
name = "sandman/greet"
version = "1.0.0"

[verifier]
timeout_sec = 60.0
environment_mode = "shared"

[agent]
timeout_sec = 60.0

[environment]
docker_image = "{IMAGE}"
network_mode = "no-network"
cpus = 1
memory_mb = 512
build_timeout_sec = 60.0
"""

# The verifier's script, as Harbor tasks write it: the reward into /logs/verifier.
TEST_SH = """\
#!/bin/bash
if python3 -c 'import greet; assert greet.greet() == "hello sandman"'; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""


def make_task(root: Path, solve: str) -> Path:
    """A Harbor task on a prebuilt image: environment/ (no Dockerfile) is uploaded into the
    sandbox's working directory at start, the oracle runs solution/solve.sh, the verifier
    tests/test.sh."""
    task = root / "greet"
    for d in ("environment", "solution", "tests"):
        (task / d).mkdir(parents=True)
    (task / "task.toml").write_text(TASK_TOML)
    (task / "instruction.md").write_text("Make greet() in greet.py return 'hello sandman'.\n")
    (task / "environment" / "greet.py").write_text("def greet():\n    return 'hello world'\n")
    (task / "solution" / "solve.sh").write_text("#!/bin/bash\n" + solve)
    (task / "tests" / "test.sh").write_text(TEST_SH)
    return task


def docs_command() -> list[str]:
    """docs/sdk.md's Harbor command line, as written (its one `harbor ...` line)."""
    section = SDK_MD.read_text().split("\n## Harbor\n", 1)[1].split("\n## ", 1)[0]
    [line] = [ln for block in re.findall(r"```sh\n(.*?)```", section, re.S)
              for ln in block.splitlines() if ln.startswith("harbor ")]
    argv = shlex.split(line)
    assert "path/to/task" in argv and ENV_CLASS in argv, argv
    return argv


def run_trial(task: Path, tmp_path: Path, url: str, name: str) -> dict:
    """docs/sdk.md's `harbor trial start` (the oracle agent in a sandman environment), on
    `task`, into a trial directory of the test's; its result.json."""
    assert HARBOR.exists(), f"{HARBOR} is missing: make deps (tools/frameworks_venv.py)"
    home = tmp_path / f"home-{name}"
    home.mkdir()
    trials = tmp_path / "trials"
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "HARBOR_TELEMETRY": "0",
           "SANDMAN_URL": url}
    argv = [str(task) if a == "path/to/task" else a for a in docs_command()]
    argv[0] = str(HARBOR)
    out = subprocess.run(
        [*argv, "--environment-kwarg", "acquire_timeout_s=60",
         "--trial-name", name, "--trials-dir", str(trials)],
        env=env, capture_output=True, text=True, timeout=180)
    result = trials / name / "result.json"
    assert result.exists(), f"harbor exited {out.returncode}:\n{out.stdout}\n{out.stderr}"
    return json.loads(result.read_text())


@pytest.fixture
def stack(cluster, namespace, tmp_path):
    with standin_stack(cluster, namespace, tmp_path, "harbor",
                       private_dirs=("logs", "tests", "solution")) as got:
        yield got


def test_oracle_scored_by_harbors_verifier(cluster, namespace, stack, tmp_path):
    ctl, standin = stack
    good = make_task(tmp_path / "good", "sed -i 's/hello world/hello sandman/' greet.py\n")
    result = run_trial(good, tmp_path, ctl.url, "good")
    assert result.get("exception_info") is None, result.get("exception_info")
    assert result["verifier_result"]["rewards"] == {"reward": 1.0}, result
    # The oracle's log, downloaded from the sandbox's /logs/agent by Harbor.
    agent_dir = tmp_path / "trials" / "good" / "agent"
    assert (agent_dir / "oracle.txt").exists(), list(agent_dir.iterdir())

    # A solution that changes nothing the verifier checks: reward 0, from the same verifier.
    broken = make_task(tmp_path / "broken", "echo 'def greet(): return 1' > other.py\n")
    result = run_trial(broken, tmp_path, ctl.url, "broken")
    assert result.get("exception_info") is None, result.get("exception_info")
    assert result["verifier_result"]["rewards"] == {"reward": 0.0}, result

    # Harbor's stop() released both sandboxes: their pods go, and their execds with them.
    wait_for(lambda: not [p for p in pods(cluster.core, namespace)
                          if not p.metadata.deletion_timestamp], 30, "release")
    wait_for(lambda: not standin.alive(), 20, "the execds gone")
