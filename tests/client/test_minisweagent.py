"""`sandman.client.minisweagent` driven by mini-swe-agent's own code against a real execd on
127.0.0.1 (conftest's `execd`), acquired through the stand-in controller (conftest's
`controller`, a real HTTP server handing out that execd): `DefaultAgent` with its deterministic
test model, to the task's end, and its `get_environment` loading the class from a config.

mini-swe-agent's own environment tests (tests/environments/test_local.py and test_docker.py
in its repository) are not shipped in its wheel and ship no conformance suite; their cases
that apply to a remote sandbox are re-stated here (`test_upstream_*`), and the same actions go
through its `LocalEnvironment` for comparison.
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from minisweagent import package_dir
from minisweagent.agents.default import DefaultAgent
from minisweagent.environments import get_environment
from minisweagent.environments.local import LocalEnvironment
from minisweagent.exceptions import Submitted
from minisweagent.models.test_models import DeterministicModel, make_output

from sandman.client import Client, Sandbox
from sandman.client.minisweagent import SandmanEnvironment, SandmanEnvironmentConfig
from testbed.execd import start_execd

from .conftest import FAST_RETRY, FakeController

SDK_MD = Path(__file__).resolve().parents[2] / "docs" / "sdk.md"

CLASS = "sandman.client.minisweagent.SandmanEnvironment"


@pytest.fixture
def home(tmp_path) -> str:
    """A login bash (the default interpreter, as DockerEnvironment's) reads ~/.profile: the
    machine's own one (which runs `pyenv init`) must not decide these tests."""
    h = tmp_path / "home"
    h.mkdir()
    return str(h)


@pytest.fixture
def menv(execd, home):
    """An environment on the module's execd, no controller (`sandbox=`)."""
    sb = Sandbox.connect(execd.address, execd.port, execd.token, retry=FAST_RETRY)
    env = SandmanEnvironment(sandbox=sb, env={"HOME": home})
    try:
        yield env
    finally:
        env.cleanup()
        sb.close()


def agent_config(tmp_path: Path, **kw) -> dict:
    """mini-swe-agent's own default agent config (its templates render our template vars)."""
    cfg = yaml.safe_load((package_dir / "config" / "default.yaml").read_text())["agent"]
    # The deterministic model charges 1.0 a call; its default cost limit would stop at 3.
    return {**cfg, "cost_limit": 0, "step_limit": 20,
            "output_path": tmp_path / "traj.json", **kw}


def test_default_agent_runs_to_submission(controller: FakeController, tmp_path, home) -> None:
    """DefaultAgent with mini-swe-agent's deterministic model through an environment built from
    a config as its run scripts build it: the task's tree uploaded, the scripted actions edit
    a file, fail once, time out once, and submit; the sandbox is released by cleanup()."""
    task = tmp_path / "task"
    (task / "pkg").mkdir(parents=True)
    (task / "pkg" / "hello.py").write_text("print('hello world')\n")
    work = tmp_path / "work"
    env = get_environment({"environment_class": CLASS, "image": "swebench/x:1",
                           "job": "mini-1", "cwd": str(work), "timeout": 2,
                           "env": {"HOME": home}, "url": controller.url})
    assert isinstance(env, SandmanEnvironment)
    sid = env.sandbox.id
    try:
        [(_, _, body)] = controller.calls("POST")
        assert (body["image"], body["job"]) == ("swebench/x:1", "mini-1")
        env.sandbox.upload_tree(task, str(work))
        model = DeterministicModel(outputs=[
            make_output("look", [{"command": "cat pkg/hello.py"}]),
            make_output("edit", [{"command": "sed -i 's/world/sandman/' pkg/hello.py && "
                                              "python3 pkg/hello.py"}]),
            make_output("fail", [{"command": "echo oops >&2; exit 3"}]),
            make_output("hang", [{"command": "sleep 30"}]),
            make_output("done", [{"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && "
                                              "cat pkg/hello.py"}]),
        ])
        agent = DefaultAgent(model, env, **agent_config(tmp_path))
        t0 = time.monotonic()
        result = agent.run("say hello to sandman")
        took = time.monotonic() - t0
        assert result["exit_status"] == "Submitted", agent.messages[-1]
        assert result["submission"] == "print('hello sandman')\n"
        observations = [m["content"] for m in agent.messages if m["role"] == "user"][1:]
        assert "<returncode>0</returncode>" in observations[0]
        assert "print('hello world')" in observations[0]
        assert "hello sandman" in observations[1]
        assert "<returncode>3</returncode>" in observations[2] and "oops" in observations[2]
        assert "timed out after 2 seconds" in observations[3]
        assert "<returncode>-1</returncode>" in observations[3]
        assert took < 20, took  # the timeout killed the sleep
        # The file in the sandbox, and the trajectory mini-swe-agent saved.
        assert env.sandbox.read(str(work / "pkg" / "hello.py")) == b"print('hello sandman')\n"
        out = tmp_path / "out"
        env.sandbox.download_tree(str(work), out)
        assert (out / "pkg" / "hello.py").read_text() == "print('hello sandman')\n"
        traj = agent.save(None)
        assert traj["info"]["exit_status"] == "Submitted"
        assert traj["info"]["config"]["environment_type"] == CLASS
        assert traj["info"]["config"]["sandman"]["sandbox"] == sid
        assert (tmp_path / "traj.json").is_file()
        # The system information the template rendered is the sandbox's uname.
        uname = os.uname()
        assert f"{uname.sysname} {uname.release}" in agent.messages[1]["content"]
    finally:
        env.cleanup()
    assert sid not in controller.sandboxes
    assert [p for m, p, _ in controller.calls("DELETE")] == [f"/v1/sandboxes/{sid}"]
    env.cleanup()  # idempotent: no second release
    assert len(controller.calls("DELETE")) == 1
    out = env.execute({"command": "echo late"})
    assert out["returncode"] == -1 and "released" in out["exception_info"]


def test_each_action_starts_anew(menv, tmp_path) -> None:
    """mini-swe-agent's prompt: "Every action is executed in a new subshell"."""
    assert menv.execute({"command": "cd /; export X=1; Y=2"})["returncode"] == 0
    out = menv.execute({"command": "pwd; echo ${X-unset}${Y-unset}"}, cwd=str(tmp_path))
    assert out == {"output": f"{tmp_path}\nunsetunset\n", "returncode": 0, "exception_info": ""}


def test_exit_codes_and_syntax_errors(menv) -> None:
    for command, code in (("true", 0), ("false", 1), ("exit 42", 42), ("kill -9 $$", 137)):
        assert menv.execute({"command": command})["returncode"] == code, command
    # A command that does not parse: the interpreter's message and status, as under Docker.
    out = menv.execute({"command": "echo (("})
    assert out["returncode"] == 2 and "syntax error" in out["output"], out
    # The shell is fine afterwards.
    assert menv.execute({"command": "echo ok"})["output"] == "ok\n"


def test_timeout_per_call_and_config(menv, tmp_path) -> None:
    t0 = time.monotonic()
    out = menv.execute({"command": "echo started; sleep 30"}, timeout=1)
    assert time.monotonic() - t0 < 15
    assert out["returncode"] == -1 and out["output"] == "started\n", out
    assert out["exception_info"] == ("An error occurred while executing the command: Command "
                                     "'echo started; sleep 30' timed out after 1 seconds")
    assert out["extra"]["exception_type"] == "TimeoutExpired"
    menv.config.timeout = 1
    assert menv.execute({"command": "sleep 30"})["returncode"] == -1
    assert menv.execute({"command": "sleep 0.1; echo fine"}, timeout=10)["output"] == "fine\n"


def test_submission(menv) -> None:
    with pytest.raises(Submitted) as e:
        menv.execute({"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; printf 'a\\nb'"})
    [msg] = e.value.messages
    assert msg["extra"] == {"exit_status": "Submitted", "submission": "a\nb"}
    # Only when the command succeeded, as every mini-swe-agent environment.
    out = menv.execute({"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; exit 1"})
    assert out["returncode"] == 1


def test_template_vars_and_serialize(menv) -> None:
    v = menv.get_template_vars(task="t")
    u = os.uname()
    assert (v["system"], v["release"], v["version"], v["machine"]) == \
        (u.sysname, u.release, u.version, u.machine)
    assert v["task"] == "t" and v["timeout"] == 30 and v["interpreter"] == ["bash", "-lc"]
    s = menv.serialize()["info"]["config"]
    assert s["environment_type"] == CLASS and s["environment"]["cwd"] == ""


# ---------------------------------------------------------------- mini-swe-agent's own cases


def test_upstream_basic_env_and_cwd(menv, tmp_path, monkeypatch) -> None:
    """test_local.py / test_docker.py: execution, env, forward_env, cwd and its override."""
    assert "hello world" in menv.execute({"command": "echo 'hello world'"})["output"]
    monkeypatch.setenv("HOST_VAR", "host_value")
    monkeypatch.setenv("CONFLICT_VAR", "from_host")
    menv.config.env.update({"TEST_VAR": "test_value", "CONFLICT_VAR": "from_config"})
    menv.config.forward_env = ["HOST_VAR", "CONFLICT_VAR", "NONEXISTENT_VAR"]
    out = menv.execute({"command": 'echo $TEST_VAR $HOST_VAR $CONFLICT_VAR "[$NONEXISTENT_VAR]"'})
    assert out["output"] == "test_value host_value from_config []\n", out
    d1, d2 = tmp_path / "d1", tmp_path / "d2"
    d1.mkdir()
    d2.mkdir()
    menv.config.cwd = str(d1)
    assert menv.execute({"command": "pwd"})["output"] == f"{d1}\n"
    assert menv.execute({"command": "pwd"}, cwd=str(d2))["output"] == f"{d2}\n"
    # A missing cwd runs nothing, as docker exec -w refuses it.
    out = menv.execute({"command": "touch made"}, cwd=str(tmp_path / "missing"))
    assert out["returncode"] != 0 and not (tmp_path / "missing").exists()


@pytest.mark.parametrize(("command", "code"), [("echo 'test'", 0), ("exit 1", 1),
                                               ("exit 42", 42)])
def test_upstream_return_codes(menv, command, code) -> None:
    assert menv.execute({"command": command})["returncode"] == code


def test_upstream_failure_output_stderr_multiline_shell(menv, tmp_path) -> None:
    assert menv.execute({"command": "exit 1"}) == {"output": "", "returncode": 1,
                                                   "exception_info": ""}
    out = menv.execute({"command": "nonexistent_command_12345"})
    assert out["returncode"] != 0 and "nonexistent_command_12345" in out["output"]
    out = menv.execute({"command": "echo 'error message' >&2"})
    assert out["returncode"] == 0 and "error message" in out["output"]
    lines = menv.execute({"command": "echo -e 'line1\\nline2\\nline3'"})["output"].split("\n")
    assert lines[:3] == ["line1", "line2", "line3"]
    assert "hello world" in menv.execute({"command": "echo 'hello world' | grep 'world'"})[
        "output"]
    assert "nested" in menv.execute({"command": "echo $(echo 'nested')"})["output"]
    menv.config.cwd = str(tmp_path)
    assert menv.execute({"command": "echo 'test content' > test.txt"})["returncode"] == 0
    assert "test content" in menv.execute({"command": "cat test.txt"})["output"]
    assert menv.sandbox.read(str(tmp_path / "test.txt")) == b"test content\n"


def test_upstream_timeout_kills_child_process(menv, tmp_path) -> None:
    pid_file = tmp_path / "child.pid"
    script = tmp_path / "child.py"
    script.write_text("import os, sys, time\nfrom pathlib import Path\n"
                      "Path(sys.argv[1]).write_text(str(os.getpid()))\n"
                      "while True:\n    time.sleep(1)\n")
    out = menv.execute({"command": f"python3 {script} {pid_file}"}, timeout=2)
    assert out["returncode"] == -1
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists(), "the command's child outlived its timeout"


def test_same_answers_as_local_environment(menv, tmp_path, home) -> None:
    """The same actions through mini-swe-agent's LocalEnvironment (on this machine, where the
    test's execd runs too) and the sandman environment: the same dicts."""
    local = LocalEnvironment(cwd=str(tmp_path), env={"HOME": home, "V": "1"})
    menv.config.cwd = str(tmp_path)
    menv.config.env["V"] = "1"
    menv.config.interpreter = ["bash", "-c"]  # LocalEnvironment: subprocess's shell=True
    for command in ("echo hi; echo err >&2; exit 3", "printf 'a\\nb'", "echo $V; pwd",
                    "true", "exit 7", "echo ünï ✓", "for i in 1 2 3; do echo $i; done"):
        assert menv.execute({"command": command}) == local.execute({"command": command}), \
            command
    with pytest.raises(Submitted) as ours:
        menv.execute({"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; echo patch"})
    with pytest.raises(Submitted) as theirs:
        local.execute({"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; echo patch"})
    assert ours.value.messages == theirs.value.messages


# ---------------------------------------------------------------- lifecycle


def test_given_sandbox_stays_held_and_client_is_shared(controller: FakeController,
                                                       home) -> None:
    with Client(controller.url, retry=FAST_RETRY) as client:
        envs = [SandmanEnvironment(client=client, image="img", job="mini-2",
                                   env={"HOME": home}) for _ in range(2)]
        ids = [e.sandbox.id for e in envs]
        assert len(set(ids)) == 2 and all(i in controller.sandboxes for i in ids)
        envs[0].cleanup()
        assert ids[0] not in controller.sandboxes and ids[1] in controller.sandboxes
        assert envs[1].execute({"command": "echo still"})["output"] == "still\n"
        sb = envs[1].sandbox
        on_it = SandmanEnvironment(sandbox=sb, env={"HOME": home})
        on_it.cleanup()  # not its sandbox: still held
        assert ids[1] in controller.sandboxes
        envs[1].cleanup()
        assert controller.sandboxes == {}
        assert client.list(job="mini-2") == []  # the shared client still works


def test_context_manager_and_dropped_environment(controller: FakeController, home) -> None:
    with SandmanEnvironment(image="img", job="mini-3", url=controller.url) as env:
        sid = env.sandbox.id
        assert sid in controller.sandboxes
    assert sid not in controller.sandboxes
    # Dropped without cleanup() (mini-swe-agent's runners do that): released from a thread.
    env = SandmanEnvironment(image="img", job="mini-4", url=controller.url)
    sid = env.sandbox.id
    del env
    gc.collect()
    deadline = time.monotonic() + 10
    while sid in controller.sandboxes and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sid not in controller.sandboxes


def test_config() -> None:
    with pytest.raises(ValueError):
        SandmanEnvironmentConfig(image="i", job="j", run_args=["--rm"])
    with pytest.raises(ValueError, match="needs `image` and `job`"):
        SandmanEnvironment(image="i")
    c = SandmanEnvironmentConfig(image="i", job="j", egress={"allow": ["pypi.org"]})
    assert c.timeout == 30 and c.cwd == "" and c.egress == {"allow": ["pypi.org"]}


def test_core_client_does_not_import_minisweagent() -> None:
    code = ("import sys, sandman.client; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'minisweagent' "
            "or m == 'sandman.client.minisweagent'); print(bad); sys.exit(1 if bad else 0)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr


def test_missing_minisweagent_is_one_clear_error() -> None:
    code = ("import sys; sys.modules['minisweagent'] = None\n"
            "try:\n    import sandman.client.minisweagent\n"
            "except ImportError as e:\n    print(e); sys.exit(0)\n"
            "sys.exit(1)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "pip install 'sandman-client[mini-swe-agent]'" in p.stdout


def test_docs_example_runs(make_controller, tmp_path, monkeypatch) -> None:
    """docs/sdk.md's mini-swe-agent example, as written, against the stand-in controller."""
    section = SDK_MD.read_text().split("\n## mini-swe-agent\n", 1)[1].split("\n## ", 1)[0]
    [example] = re.findall(r"```python\n(.*?)```", section, re.S)
    home = tmp_path / "home"
    home.mkdir()
    # Its execd runs on this host, where the login bash would read the machine's ~/.profile.
    ex = start_execd(tmp_path / "execd", env={"HOME": str(home)})
    try:
        monkeypatch.setenv("SANDMAN_URL", make_controller(ex).url)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(example, str(SDK_MD), "exec"), {})
        printed = out.getvalue().splitlines()
        said = re.search(r"print\(result\)\s+# (.*)", example).group(1)
        assert printed[-1] == said, printed
        assert (tmp_path / "execd" / "answer.py").read_text() == "print(6 * 7)\n"
    finally:
        ex.stop()
