"""Static checks of images/Dockerfile (no Docker engine here: it is never built in tests)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "images" / "Dockerfile"


def _copies() -> list[str]:
    sources = []
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            sources += line.split()[1:-1]
    return sources


def test_every_copy_source_exists():
    sources = _copies()
    assert sources
    for src in sources:
        assert (ROOT / src).exists(), f"Dockerfile copies {src}, which does not exist"


# Installed by `pip install -e .` for development only, never into the image: the test bed
# builds and runs Kubernetes binaries on a developer's machine; nothing in a cluster imports it.
NOT_IN_IMAGE = {"testbed"}


def test_every_installed_package_is_copied():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = project["tool"]["setuptools"]["packages"]["find"]["include"]
    modules = project["tool"]["setuptools"]["py-modules"]
    # The sandman namespace's other half and the lock come with the client distribution.
    packages = ({p.rstrip("*") for p in patterns} | {m.split(".")[0] for m in modules}
                | {"client", "requirements.lock"}) - NOT_IN_IMAGE
    copied = {Path(s).parts[0] for s in _copies()}
    assert packages <= copied, f"not copied into the image: {packages - copied}"
    assert not NOT_IN_IMAGE & copied, "the test bed must stay out of the image"


def test_pinned_system_packages_and_non_root_user():
    text = DOCKERFILE.read_text()
    for pkg in ("iptables", "iproute2"):
        assert re.search(rf"\b{pkg}=\S+", text), f"{pkg} is not pinned"
    assert re.search(r"^USER 65532", text, re.M)
    assert re.search(r"^ARG PYTHON_IMAGE=python:\d+\.\d+\.\d+-slim", text, re.M)
