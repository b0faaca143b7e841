"""Run helm and kubectl from the test-bed binary cache, isolated from the user's helm config."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from testbed import build

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "sandman"
RELEASE = "sandman"
NAMESPACE = "sandman-system"


def helm_binary() -> Path:
    path = build.helm_path()
    if not path.exists():
        try:
            build.build()
        except build.BuildError as e:
            pytest.fail(f"cannot build helm: {e}", pytrace=False)
    return path


def kubectl_binary() -> Path:
    path = build.binaries()["kubectl"]
    if not path.exists():
        build.build()
    return path


def _env(home: Path, kubeconfig: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HELM_")}
    # Helm's cache, config and data in the test's own directory: no repositories, no plugins,
    # nothing from the user's ~/.config/helm.
    env.update(HELM_CACHE_HOME=str(home / "cache"), HELM_CONFIG_HOME=str(home / "config"),
               HELM_DATA_HOME=str(home / "data"))
    if kubeconfig is not None:
        env["KUBECONFIG"] = str(kubeconfig)
    else:
        env.pop("KUBECONFIG", None)
    return env


class Helm:
    def __init__(self, home: Path, kubeconfig: Path | None = None):
        self.bin = str(helm_binary())
        self.env = _env(home, kubeconfig)

    def run(self, *args: str, check: bool = True, timeout: float = 180,
            stdin: str | None = None) -> subprocess.CompletedProcess:
        res = subprocess.run([self.bin, *args], env=self.env, capture_output=True, text=True,
                             timeout=timeout, input=stdin)
        if check and res.returncode != 0:
            raise AssertionError(f"helm {' '.join(args[:2])} exited {res.returncode}:\n"
                                 f"{res.stderr}{res.stdout[-2000:]}")
        return res

    def template(self, *args: str, release: str = RELEASE, namespace: str = NAMESPACE,
                 check: bool = True) -> subprocess.CompletedProcess:
        return self.run("template", release, str(CHART), "--namespace", namespace, *args,
                        check=check)


def objects(manifest: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(manifest) if d]


def kubectl(kubeconfig: Path, *args: str, check: bool = True, stdin: str | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess:
    res = subprocess.run([str(kubectl_binary()), "--kubeconfig", str(kubeconfig), *args],
                         capture_output=True, text=True, timeout=timeout, input=stdin)
    if check and res.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args[:3])} exited {res.returncode}:\n"
                             f"{res.stderr}{res.stdout[-2000:]}")
    return res
