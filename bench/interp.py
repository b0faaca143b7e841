"""The interpreter a bench runs pod-side code under (netguard, execd's start), so its CPU is
what a pod pays, not what this checkout's venv costs."""

from __future__ import annotations

import subprocess
import sys

DEBIAN_PYTHON = "/usr/bin/python3"


def pod_python() -> str:
    """The test bed's images run Debian bookworm's python3 3.11 (testbed/images.py), which is
    this machine's /usr/bin/python3 when that is a 3.11; else this process's own (the report
    names the one used: a pyenv build here starts in ~38 ms of CPU, Debian's in ~16 ms)."""
    try:
        out = subprocess.run([DEBIAN_PYTHON, "-c", "import sys; print(sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except OSError:
        return sys.executable
    return DEBIAN_PYTHON if out == "(3, 11)" else sys.executable
