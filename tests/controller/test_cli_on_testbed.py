"""The command-line client (`python -m sandman.client`, the `sandman` entry point) against the
real controller on the test bed, with a real execd behind every pod (testbed/standin.py), run
as a user would run it: a separate process per command, the same environment as `Client()`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sandman.client import cli
from testbed.procs import wait_for
from tests.controller.harness import pods, standin_stack

IMAGE = "registry.invalid/swe/task:1"


@pytest.fixture
def stack(cluster, namespace, tmp_path):
    with standin_stack(cluster, namespace, tmp_path, "cli") as got:
        yield got


def test_acquire_exec_cp_and_release_from_the_command_line(cluster, namespace, stack, tmp_path):
    ctl, standin = stack
    env = {**os.environ, "SANDMAN_URL": ctl.url, "SANDMAN_LEASE_DIR": str(tmp_path / "leases")}
    for k in ("SANDMAN_TOKEN_FILE", "SANDMAN_CA_FILE"):
        env.pop(k, None)

    def sandman(*argv: str, check: int | None = 0) -> subprocess.CompletedProcess:
        r = subprocess.run([sys.executable, "-m", "sandman.client", *argv], env=env,
                           capture_output=True, text=True, timeout=120)
        if check is not None:
            assert r.returncode == check, (argv, r.returncode, r.stdout, r.stderr)
        return r

    got = json.loads(sandman("-o", "json", "acquire", IMAGE, "--job", "cli", "--cpu", "1",
                             "--memory", "1Gi", "--lifetime", "600").stdout)
    sid, pod = got["id"], got["pod"]
    assert pod in standin.alive() and "token" not in json.dumps(got)
    # The acquiring process ended: the sandbox stays (detached, not released at its exit).
    assert pod in [p.metadata.name for p in pods(cluster.core, namespace)
                   if not p.metadata.deletion_timestamp]
    assert sid in sandman("list", "--job", "cli").stdout
    assert json.loads(sandman("-o", "json", "get", sid).stdout)["pod"] == pod

    # exec streams the output and exits with the command's own status.
    r = sandman("exec", sid, "--", "echo one; echo two >&2; exit 3", check=3)
    assert r.stdout.splitlines() == ["one", "two"]
    r = sandman("exec", sid, "--", "printf", "%s|", "a b", "c", check=0)
    assert r.stdout == "a b|c|"  # several words are quoted as typed

    # cp: a tree in, a file out, a tree out.
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_text("X = 1\n")
    (src / "run.sh").write_text("#!/bin/sh\necho ran\n")
    os.chmod(src / "run.sh", 0o755)
    remote = f"/tmp/sandman-cli-{namespace}"
    sandman("cp", str(src), f"{sid}:{remote}")
    assert sandman("exec", sid, "--", f"{remote}/run.sh").stdout == "ran\n"
    sandman("cp", f"{sid}:{remote}/pkg/mod.py", str(tmp_path / "mod.py"))
    assert (tmp_path / "mod.py").read_text() == "X = 1\n"
    out = tmp_path / "back"
    out.mkdir()
    sandman("cp", "--tree", f"{sid}:{remote}", str(out))
    assert (out / "pkg" / "mod.py").read_text() == "X = 1\n"
    assert os.stat(out / "run.sh").st_mode & 0o777 == 0o755
    sandman("exec", sid, "--", f"rm -rf {remote}")

    assert json.loads(sandman("-o", "json", "stats").stdout)["live"] >= 1
    r = sandman("-o", "json", "renew", sid, "--lifetime", "900")
    assert json.loads(r.stdout)["id"] == sid

    sandman("release", sid)
    assert not (tmp_path / "leases" / f"{sid}.json").exists()
    wait_for(lambda: pod not in {p.metadata.name for p in pods(cluster.core, namespace)
                                 if not p.metadata.deletion_timestamp}, 20, "release")
    r = sandman("get", sid, check=cli.EXIT_NOT_FOUND)  # gone: one line, the not-found code
    assert r.stderr.startswith("sandman: error: ") and r.stderr.count("\n") == 1
    sandman("exec", sid, "--", "true", check=cli.EXIT_NOT_FOUND)  # its lease went with it

    # drain: a job's sandboxes go at once; prewarm sets a pool's target.
    sandman("acquire", IMAGE, "--job", "cli-drain", "--cpu", "1", "--memory", "1Gi")
    assert json.loads(sandman("-o", "json", "drain", "cli-drain").stdout)["released"] == 1
    pool = json.loads(sandman("-o", "json", "prewarm", IMAGE, "0", "--cpu", "1",
                              "--memory", "1Gi").stdout)
    assert pool["target"] == 0
    wait_for(lambda: not [p for p in pods(cluster.core, namespace)
                          if not p.metadata.deletion_timestamp], 30, "nothing left")
