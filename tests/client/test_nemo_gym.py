"""`sandman.client.nemo_gym` found and driven by NeMo Gym's own code. NeMo Gym needs Python >=
3.12 and this venv is 3.11: the checks run in .venv-frameworks (`make deps`), as
tests/client/nemo_gym_checks.py. Here, what needs no controller: NeMo Gym's registry finds the
provider through the distribution's entry point, and what a sandbox cannot be is refused in one
line before any call. The sandboxes themselves, through NeMo Gym's facades and its mini-swe-agent
environment, are on the test bed: tests/controller/test_nemo_gym_on_testbed.py."""

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


def run_checks(*argv: str, env: dict[str, str] | None = None, timeout: float = 120) -> dict:
    assert PYTHON.exists(), f"{PYTHON} is missing: make deps (tools/frameworks_venv.py)"
    out = subprocess.run([str(PYTHON), str(HERE / "nemo_gym_checks.py"), *argv],
                         capture_output=True, text=True, timeout=timeout,
                         env={"PATH": os.environ["PATH"], **(env or {})})
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout)


def test_import_without_nemo_gym_is_one_clear_line() -> None:
    assert importlib.util.find_spec("nemo_gym") is None
    with pytest.raises(ImportError) as e:
        importlib.import_module("sandman.client.nemo_gym")
    assert "pip install 'sandman-client[nemo-gym]' (Python >= 3.12)" in str(e.value)
    assert "\n" not in str(e.value)
    assert "sandman.client.nemo_gym" not in sys.modules


def test_nemo_gym_finds_the_provider_and_refuses_what_a_sandbox_cannot_be() -> None:
    got = run_checks("refusals")
    # NeMo Gym's registry: the entry point the client distribution declares.
    assert "sandman" in got["providers"] and got["class"] == "sandman.client.nemo_gym", got
    # Each refused before any call (the URL has no listener), one line each.
    assert got["gpu"] == "sandman provider: GPU sandboxes are not supported"
    assert got["option"].startswith("sandman provider: unknown provider option(s) snapshot;")
    assert "entrypoint is not supported" in got["entrypoint"]
    assert "names no image" in got["no_image"]
    assert got["bad_labels"] == ("sandman provider: provider option labels must be a mapping "
                                 "of strings, not str")
    assert got["bad_job"] == "sandman provider: provider option job must be a string, not int"
    assert all("\n" not in v for k, v in got.items() if isinstance(v, str))
