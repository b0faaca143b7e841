"""`SandmanEnvironment` (sandman.client.minisweagent) against the real controller on the test bed,
with a real execd behind the pod (the kubelet stand-in, testbed/standin.py, which lists what it
does not reproduce): mini-swe-agent's `DefaultAgent` with its deterministic test model, built
from a config by its own `get_environment`, run to the task's end; a timeout and non-zero exit
codes on the way; the pod gone after cleanup()."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from minisweagent import package_dir
from minisweagent.agents.default import DefaultAgent
from minisweagent.environments import get_environment
from minisweagent.models.test_models import DeterministicModel, make_output

from sandman.client import Client, SandboxGone
from testbed.procs import wait_for
from tests.controller.harness import pods, standin_stack

IMAGE = "registry.invalid/swe/task:1"


@pytest.fixture
def stack(cluster, namespace, tmp_path):
    with standin_stack(cluster, namespace, tmp_path, "mini") as got:
        yield got


def test_default_agent_to_the_task_end_on_the_test_bed(cluster, namespace, stack):
    ctl, standin = stack
    # The stand-in's execd serves files under /tmp only (its --root).
    work = Path(tempfile.mkdtemp(prefix=f"mini-e2e-{namespace}-", dir="/tmp"))
    task, repo, home = work / "task", work / "repo", work / "home"
    (task / "pkg").mkdir(parents=True)
    home.mkdir()
    (task / "pkg" / "greet.py").write_text("def greet():\n    return 'hello world'\n")
    # As mini-swe-agent's YAML configs name an environment; HOME: the stand-in's execd runs on
    # this host, whose ~/.profile (read by the login bash) runs `pyenv init`.
    env = get_environment({"environment_class": "sandman.client.minisweagent.SandmanEnvironment",
                           "image": IMAGE, "job": "mini-e2e", "cpu": "1", "memory": "1Gi",
                           "acquire_timeout_s": 60, "url": ctl.url, "cwd": str(repo),
                           "timeout": 20, "env": {"HOME": str(home)}})
    try:
        sb = env.sandbox
        assert sb.pod in standin.alive()
        sid, pod = sb.id, sb.pod
        sb.upload_tree(task, str(repo))
        model = DeterministicModel(outputs=[
            make_output("read", [{"command": "cat pkg/greet.py"}]),
            make_output("edit", [{"command": "sed -i \"s/hello world/hello sandman/\" "
                                              "pkg/greet.py"}]),
            make_output("test", [{"command": "python3 -c 'import pkg.greet as g; "
                                              "assert g.greet() == \"hello sandman\"' && "
                                              "echo tested"}]),
            make_output("fail", [{"command": "ls /nonexistent-dir"}]),
            make_output("hang", [{"command": "sleep 60"}]),
            make_output("submit", [{"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && "
                                                "cat pkg/greet.py"}]),
        ])
        cfg = yaml.safe_load((package_dir / "config" / "default.yaml").read_text())["agent"]
        agent = DefaultAgent(model, env, **{**cfg, "cost_limit": 0, "step_limit": 20})
        # One action's timeout from mini-swe-agent's own execute(..., timeout=): the agent's
        # steps use the config's 20 s, this one 2 s.
        assert env.execute({"command": "sleep 60"}, timeout=2)["returncode"] == -1
        env.config.timeout = 3
        t0 = time.monotonic()
        result = agent.run("greet sandman")
        assert time.monotonic() - t0 < 60
        assert result == {"exit_status": "Submitted",
                          "submission": "def greet():\n    return 'hello sandman'\n"}, \
            agent.messages[-1]
        obs = [m["content"] for m in agent.messages if m["role"] == "user"][1:]
        assert "hello world" in obs[0] and "<returncode>0</returncode>" in obs[1]
        assert "tested" in obs[2]
        assert "<returncode>2</returncode>" in obs[3] and "No such file" in obs[3], obs[3]
        assert "<returncode>-1</returncode>" in obs[4] and "timed out after 3" in obs[4], obs[4]
        # The edited file, read back through the SDK the environment holds.
        assert sb.read(str(repo / "pkg" / "greet.py")) == \
            b"def greet():\n    return 'hello sandman'\n"
    finally:
        env.cleanup()
        shutil.rmtree(work, ignore_errors=True)
    # cleanup() released it: the pod goes, and its execd with it.
    wait_for(lambda: pod not in {p.metadata.name for p in pods(cluster.core, namespace)
                                 if not p.metadata.deletion_timestamp}, 20, "release")

    def gone(cl: Client) -> bool:
        try:
            cl.get(sid)
        except SandboxGone:
            return True
        return False

    with Client(ctl.url) as cl:
        wait_for(lambda: gone(cl), 30, "the released sandbox answered as gone", interval=0.2)
