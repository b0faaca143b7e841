"""`sandman.client.harbor` driven by Harbor's own code. Harbor needs Python >= 3.12 and this
venv is 3.11: the checks run in .venv-frameworks (`make deps`), as tests/client/harbor_checks.py,
against a real execd on 127.0.0.1 (conftest's `execd`). The whole trial, with Harbor's oracle
agent and verifier, runs on the test bed: tests/controller/test_harbor_e2e.py.

Harbor ships no conformance suite for environments (its own environment tests mock each
provider's SDK); what its trial, oracle agent and verifier call is exercised here and there.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
PYTHON = HERE.parents[1] / ".venv-frameworks" / "bin" / "python"


def run_checks(tmp_path: Path, *execd: str) -> dict:
    assert PYTHON.exists(), f"{PYTHON} is missing: make deps (tools/frameworks_venv.py)"
    work = tmp_path / "work"
    work.mkdir()
    out = subprocess.run([str(PYTHON), str(HERE / "harbor_checks.py"), str(work), *execd],
                         capture_output=True, text=True, timeout=120,
                         env={"PATH": os.environ["PATH"], "HOME": str(tmp_path),
                              "HARBOR_TELEMETRY": "0"})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_import_without_harbor_is_one_clear_line() -> None:
    """This venv has no Harbor (its extra needs 3.12): the module says what to install."""
    assert importlib.util.find_spec("harbor") is None
    with pytest.raises(ImportError) as e:
        importlib.import_module("sandman.client.harbor")
    assert "pip install 'sandman-client[harbor]' (Python >= 3.12)" in str(e.value)
    assert "\n" not in str(e.value)
    assert "sandman.client.harbor" not in sys.modules


def test_harbor_environment_on_execd(execd, tmp_path) -> None:
    """Harbor's environment factory builds the class from its import path; what a sandbox
    cannot be is refused before any acquire; exec, files and trees against a real execd."""
    got = run_checks(tmp_path, execd.address, str(execd.port), execd.token)
    no = got["refusals"]
    assert "builds no Dockerfile" in no["dockerfile_only"], no
    assert "Docker Compose task" in no["compose"], no
    assert "Windows task" in no["windows"], no
    # Harbor's own check of the declared capabilities refuses what sandman cannot enforce.
    assert "network_mode='allowlist' is not supported by sandman" in no["allowlist"], no
    assert "acquire_timeout_s must be a number" in no["bad_kwarg"], no
    assert no["image"] == "c/d:2" and "not started" in no["not_started"], no

    live = got["live"]
    # An attacker's cwd and variable values reach the command as data, never as shell.
    out, code, cwd = live["hostile"]
    assert code == 0 and out == "$(touch ENV_RAN)'\"`touch ENV_RAN2`; touch ENV_RAN3|" \
        + cwd + "\n", live["hostile"]
    assert live["ran"] == [], live["ran"]
    assert live["uploaded"] == "payload\n"
    assert live["isolated"].splitlines() == ["unset", str(tmp_path / "work")]
    assert live["streams"] == ["out\nerr\n", None, 3]
    assert live["timeout"] == "Command timed out after 1 seconds"
    assert live["after_timeout"] == "alive\n"
    assert live["concurrent"] == ["one\n", "two\n"]
    assert live["tree"] == ["deep\n", True] and live["filtered"] == ["a/b/deep.txt"]
    assert live["file"] == "#!/bin/sh\n" and live["is_dir"] == [True, False]
    if live["root"]:
        assert live["user_self"] == "root\n" and live["user_other"] == "nobody\n"
    else:
        assert "cannot become 'nobody'" in live["user_other"]
