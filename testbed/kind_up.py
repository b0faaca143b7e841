"""`make kind-up`: sandman on a kind cluster, for users who have Docker.

    kind create cluster --name sandman            (reused when it exists)
    docker build -f images/Dockerfile -t sandman.local/sandman:<version> .
    kind load docker-image sandman.local/sandman:<version> --name sandman
    kubectl label nodes --all sandman.dev/node-pool=sandbox   (the chart's default pool)
    kubectl create namespace sandboxes                        (the chart's sandbox namespace)
    helm install --wait sandman charts/sandman -n sandman-system -f testbed/values-kind.yaml
    helm test sandman -n sandman-system

Not runnable on our machines: they have no Docker engine (the docker CLI may be there, its
daemon is not). Without a working `docker info` it stops before anything, with one line on
stderr and exit code 2 (tests/testbed/test_kind_up.py), before building anything. kubectl and
helm are the test bed's (built into the cache on first use); kind is `go install sigs.k8s.io/kind@KIND` into the cache when it is not
on PATH. `--down` deletes the cluster.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from sandman import contract
from testbed import build, install
from testbed.images import sandman_version

ROOT = Path(__file__).resolve().parent.parent
VALUES = Path(__file__).with_name("values-kind.yaml")
CLUSTER = "sandman"
KIND = "v0.33.0"  # served by the Go module proxy; `go install` builds it (built here once)
IMAGE_REPO = "sandman.local/sandman"
NODE_POOL = contract.LABEL_NODE_POOL_DEFAULT
NODE_POOL_VALUE = "sandbox"  # charts/sandman/values.yaml controller.nodePool.value


class KindUpError(RuntimeError):
    pass


def docker_problem() -> str | None:
    """Why Docker cannot be used here, or None when `docker info` answers."""
    docker = shutil.which("docker")
    if docker is None:
        return "`docker` is not on PATH"
    try:
        r = subprocess.run([docker, "info", "--format", "{{.ServerVersion}}"],
                           capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "`docker info` did not answer within 30 s"
    if r.returncode != 0 or not r.stdout.strip():
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return f"`docker info` failed ({last[:200]})"
    return None


def _run(*cmd: str | Path, env: dict[str, str] | None = None) -> None:
    print("+ " + " ".join(map(str, cmd)), flush=True)
    if subprocess.call([str(c) for c in cmd], env=env) != 0:
        raise KindUpError(f"`{' '.join(map(str, cmd[:3]))} ...` failed")


def kind_binary() -> Path:
    found = shutil.which("kind")
    if found:
        return Path(found)
    dest = build.cache_dir() / f"kind-{KIND}" / "bin"
    if not (dest / "kind").exists():
        _run("go", "install", "-trimpath", f"sigs.k8s.io/kind@{KIND}",
             env=dict(build._go_env(), GOBIN=str(dest)))
    return dest / "kind"


def up() -> None:
    bins = build.build()  # kubectl and helm: the test bed's, cached after the first build
    kubectl, helm = bins["kubectl"], bins["helm"]
    kind = kind_binary()
    clusters = subprocess.run([str(kind), "get", "clusters"], capture_output=True,
                              text=True).stdout.split()
    if CLUSTER not in clusters:
        _run(kind, "create", "cluster", "--name", CLUSTER, "--wait", "180s")
    kubeconfig = build.cache_dir() / f"kind-{CLUSTER}.kubeconfig"
    with open(kubeconfig, "w") as f:
        subprocess.run([str(kind), "get", "kubeconfig", "--name", CLUSTER], stdout=f, check=True)
    env = dict(os.environ, KUBECONFIG=str(kubeconfig))
    image = f"{IMAGE_REPO}:{sandman_version()}"
    _run("docker", "build", "-f", ROOT / "images" / "Dockerfile", "-t", image, ROOT)
    _run(kind, "load", "docker-image", image, "--name", CLUSTER)
    _run(kubectl, "label", "nodes", "--all", "--overwrite", f"{NODE_POOL}={NODE_POOL_VALUE}",
         env=env)
    if subprocess.run([str(kubectl), "get", "namespace", install.SANDBOX_NAMESPACE],
                      env=env, capture_output=True).returncode != 0:
        _run(kubectl, "create", "namespace", install.SANDBOX_NAMESPACE, env=env)
    repo, tag = image.rsplit(":", 1)
    _run(helm, "upgrade", "--install", install.RELEASE, ROOT / "charts" / "sandman", "-n",
         install.NAMESPACE, "--create-namespace", "-f", VALUES, "--set",
         f"image.repository={repo}", "--set-string", f"image.tag={tag}", "--wait",
         "--timeout", "10m", env=env)
    _run(helm, "test", install.RELEASE, "-n", install.NAMESPACE, "--timeout", "10m", env=env)
    print(f"sandman is up on kind cluster {CLUSTER!r}: export KUBECONFIG={kubeconfig}")


def down() -> None:
    _run(kind_binary(), "delete", "cluster", "--name", CLUSTER)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="make kind-up", description=__doc__.splitlines()[0])
    p.add_argument("--down", action="store_true", help="delete the kind cluster")
    args = p.parse_args(argv)
    problem = docker_problem()
    if problem:
        print(f"make kind-up: needs a running Docker engine and {problem}; on a machine without "
              "Docker use the test bed instead (make testbed-up REAL_NODE=1 INSTALL=1)",
              file=sys.stderr)
        return 2
    try:
        down() if args.down else up()
    except KindUpError as e:
        print(f"make kind-up: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
