"""`SandmanDeployment` (sandman.client.swerex) against the real controller on the test bed, with
a real execd behind the pod (the kubelet stand-in, testbed/standin.py, which lists what it does
not reproduce): the SWE-agent call sequence through SWE-ReX's interface, each call under its
own `asyncio.run()` as SWEEnv does, and the pod gone after stop()."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

import pytest
from swerex.exceptions import CommandTimeoutError, NonZeroExitCodeError
from swerex.runtime.abstract import (
    BashAction,
    BashInterruptAction,
    Command,
    CreateBashSessionRequest,
    ReadFileRequest,
    UploadRequest,
    WriteFileRequest,
)

from sandman.client import Client, SandboxGone
from sandman.client.swerex import SandmanDeploymentConfig
from testbed.procs import wait_for
from tests.controller.harness import pods, standin_stack

IMAGE = "registry.invalid/swe/task:1"
run = asyncio.run


@pytest.fixture
def stack(cluster, namespace, tmp_path):
    with standin_stack(cluster, namespace, tmp_path, "rex") as got:
        yield got


def test_swe_agent_sequence_on_the_test_bed(cluster, namespace, stack):
    ctl, standin = stack
    # The stand-in's execd serves files under /tmp only (its --root).
    work = Path(tempfile.mkdtemp(prefix=f"rex-e2e-{namespace}-", dir="/tmp"))
    src = work / "src"
    (src / "bin").mkdir(parents=True)
    (src / "bin" / "hello").write_text("#!/bin/sh\necho hello from tools\n")
    (src / "bin" / "hello").chmod(0o755)
    dep = SandmanDeploymentConfig(image=IMAGE, job="rex-e2e", cpu="1", memory="1Gi",
                                  acquire_timeout_s=60, url=ctl.url).get_deployment()
    try:
        run(dep.start())
        sb = dep.sandbox
        assert sb.pod in standin.alive()
        rt = dep.runtime
        assert run(dep.is_alive())
        bashrc = work / "bashrc"
        bashrc.write_text("export FROM_RC=1\n")
        # SWE-agent sources /root/.bashrc with SWE-ReX's 1 s default; this host's own one, at
        # a load average of 20 from other work, can take longer.
        run(rt.create_session(CreateBashSessionRequest(startup_source=[str(bashrc)],
                                                       startup_timeout=30)))
        run(rt.run_in_session(BashAction(command="export LANG=C.UTF-8 && cd /tmp",
                                         check="raise")))
        obs = run(rt.run_in_session(BashAction(command="echo $LANG $FROM_RC; pwd", timeout=25,
                                               check="silent")))
        assert (obs.output, obs.exit_code) == ("C.UTF-8 1\n/tmp\n", 0)
        with pytest.raises(NonZeroExitCodeError):
            run(rt.run_in_session(BashAction(command="false", check="raise")))
        with pytest.raises(CommandTimeoutError):
            run(rt.run_in_session(BashAction(command="sleep 30", timeout=1)))
        assert run(rt.run_in_session(BashInterruptAction())).exit_code == 0
        # An interactive program on a terminal of its own (an execd session), then quit.
        obs = run(rt.run_in_session(BashAction(command="python3 -i -q", expect=[">>> "],
                                               is_interactive_command=True, timeout=30)))
        assert obs.expect_string == ">>> "
        obs = run(rt.run_in_session(BashAction(command="1+1", expect=[">>> "],
                                               is_interactive_command=True, timeout=30)))
        assert (obs.output, obs.expect_string) == ("2", ">>> ")
        obs = run(rt.run_in_session(BashAction(command="quit()", is_interactive_quit=True,
                                               timeout=30)))
        assert obs.expect_string == "SHELLPS1PREFIX" and sb.sessions() == []
        path = str(work / "out" / "f.py")
        run(rt.write_file(WriteFileRequest(path=path, content="print('ünï')\n")))
        assert run(rt.read_file(ReadFileRequest(path=path))).content == "print('ünï')\n"
        run(rt.upload(UploadRequest(source_path=str(src), target_path=str(work / "tools"))))
        r = run(rt.execute(Command(command=[str(work / "tools" / "bin" / "hello")])))
        assert (r.stdout, r.exit_code) == ("hello from tools\n", 0)
        sid, pod = sb.id, sb.pod
    finally:
        run(dep.stop())
        shutil.rmtree(work, ignore_errors=True)
    # stop() released it: the pod goes, and its execd with it.
    wait_for(lambda: pod not in {p.metadata.name for p in pods(cluster.core, namespace)
                                 if not p.metadata.deletion_timestamp}, 20, "release")
    # The books keep a released sandbox as "deleting" until the watch shows its pod gone.
    states = []

    def gone(cl: Client) -> bool:
        try:
            states.append(cl.get(sid).state)
        except SandboxGone:
            return True
        return False

    with Client(ctl.url) as cl:
        wait_for(lambda: gone(cl), 30, "the released sandbox answered as gone", interval=0.2)
    assert set(states) <= {"deleting"}, states
