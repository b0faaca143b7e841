"""Build the test bed's Kubernetes binaries from the Go module proxy, once per version.

k8s.io/kubernetes cannot be `go install`ed: its go.mod replaces every staging module with
`./staging/src/k8s.io/...`. We build from a throwaway wrapper module that requires
k8s.io/kubernetes and replaces each staging module with its published v0.N.x. The staging list
is read from k8s.io/kubernetes's own go.mod so it never goes stale.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from testbed import versions

# kubectl is built too: Debian's kubectl is 1.20, too old to talk to a v1.36 API server.
K8S_COMPONENTS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
STAGING_RE = re.compile(r"^\s*(k8s\.io/[\w.-]+)\s*=>\s*\./staging/src/", re.M)


class BuildError(RuntimeError):
    pass


def cache_dir() -> Path:
    root = os.environ.get("SANDMAN_TESTBED_CACHE") or os.path.expanduser("~/.cache/sandman-testbed")
    return Path(root)


def bin_dir() -> Path:
    return cache_dir() / (f"k8s-{versions.KUBERNETES}_kwok-{versions.KWOK}"
                          f"_etcd-{versions.ETCD}") / "bin"


def helm_path() -> Path:
    # Its own versioned folder: a helm bump must not rebuild the Kubernetes binaries.
    return cache_dir() / f"helm-{versions.HELM}" / "bin" / "helm"


def binaries() -> dict[str, Path]:
    d = bin_dir()
    bins = {name: d / name for name in (*K8S_COMPONENTS, "kwok", "etcd")}
    bins["helm"] = helm_path()
    return bins


def _run(cmd: list[str], cwd: Path, log, env: dict[str, str]) -> None:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    rc = subprocess.call(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env=env)
    if rc != 0:
        raise BuildError(f"`{' '.join(cmd[:3])} ...` exited {rc}")


def _go_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("CGO_ENABLED", "0")
    env.setdefault("GOFLAGS", "-buildvcs=false")
    # Builds run in CI on 2 cores with a 90 min budget; keep go's parallelism at the core count.
    env.setdefault("GOMAXPROCS", str(os.cpu_count() or 2))
    return env


def staging_modules(kubernetes_gomod: str) -> list[str]:
    """Module paths that k8s.io/kubernetes replaces with ./staging/src/... ."""
    mods = sorted(set(STAGING_RE.findall(kubernetes_gomod)))
    if not mods:
        raise BuildError("k8s.io/kubernetes go.mod lists no staging replacements; format changed?")
    return mods


def _wrapper_gomod(kube_version: str, staging: list[str]) -> str:
    minor = kube_version.lstrip("v").split(".", 1)[1]  # "36.2" for v1.36.2
    lines = ["module sandman.dev/testbed-build", "", "go 1.26", "",
             f"require k8s.io/kubernetes {kube_version}", "", "replace ("]
    lines += [f"\t{m} => {m} v0.{minor}" for m in staging]
    lines += [")", ""]
    return "\n".join(lines)


def _ldflags(kube_version: str) -> str:
    major, minor = kube_version.lstrip("v").split(".")[:2]
    pkg = "k8s.io/component-base/version"
    # Without stamping the binaries report v0.0.0 and version-checking clients (helm) misbehave.
    stamp = {
        "gitVersion": kube_version,
        "gitMajor": major,
        "gitMinor": minor,
        "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean",
        "buildDate": "2026-01-01T00:00:00Z",
    }
    return "-s -w " + " ".join(f"-X {pkg}.{k}={v}" for k, v in stamp.items())


def _helm_ldflags() -> str:
    # Unstamped, helm reports "v3.22" and renders for Kubernetes v1.20 (its fallback), which
    # fails charts with a kubeVersion constraint; stamp it like helm's Makefile does, with the
    # test bed's Kubernetes version as the default for `helm template` and `helm lint`.
    major, minor = versions.KUBERNETES.lstrip("v").split(".")[:2]
    flags = [f"-X helm.sh/helm/v3/internal/version.version={versions.HELM}",
             "-X helm.sh/helm/v3/internal/version.gitTreeState=clean"]
    for pkg in ("helm.sh/helm/v3/pkg/lint/rules", "helm.sh/helm/v3/pkg/chartutil"):
        flags += [f"-X {pkg}.k8sVersionMajor={major}", f"-X {pkg}.k8sVersionMinor={minor}"]
    return "-s -w " + " ".join(flags)


def build(log_path: Path | None = None, force: bool = False) -> dict[str, Path]:
    """Build any missing binary; return name -> path. Safe to call on every start."""
    bins = binaries()
    missing = [n for n, p in bins.items() if force or not p.exists()]
    if not missing:
        return bins
    out = bin_dir()
    out.mkdir(parents=True, exist_ok=True)
    log_path = log_path or out.parent / "build.log"
    env = _go_env()
    if not shutil.which("go"):
        raise BuildError("`go` is not on PATH; the test bed builds its binaries with Go >= 1.26")
    t0 = time.monotonic()
    with open(log_path, "a") as log, tempfile.TemporaryDirectory(prefix="sandman-k8s-build-") as tmp:
        work = Path(tmp)
        try:
            k8s_missing = [n for n in missing if n in K8S_COMPONENTS]
            if k8s_missing:
                (work / "go.mod").write_text("module sandman.dev/probe\n\ngo 1.26\n")
                res = subprocess.run(
                    ["go", "mod", "download", "-json", f"k8s.io/kubernetes@{versions.KUBERNETES}"],
                    cwd=work, env=env, capture_output=True, text=True)
                if res.returncode != 0:
                    log.write(res.stdout + res.stderr)
                    raise BuildError(f"cannot download k8s.io/kubernetes@{versions.KUBERNETES}")
                gomod = Path(json.loads(res.stdout)["GoMod"]).read_text()
                (work / "go.mod").write_text(_wrapper_gomod(versions.KUBERNETES, staging_modules(gomod)))
                pkgs = [f"k8s.io/kubernetes/cmd/{n}" for n in k8s_missing]
                _run(["go", "mod", "download"], work, log, env)
                for p in pkgs:
                    _run(["go", "get", f"{p}@{versions.KUBERNETES}"], work, log, env)
                for name, pkg in zip(k8s_missing, pkgs, strict=True):
                    tmp_out = out / f".{name}.tmp"
                    _run(["go", "build", "-trimpath", "-ldflags", _ldflags(versions.KUBERNETES),
                          "-o", str(tmp_out), pkg], work, log, env)
                    tmp_out.rename(out / name)  # atomic: a half-built binary never looks done
            if "etcd" in missing:
                # etcd's own go.mod replaces its sibling modules with ../ paths, so it too is
                # built from a wrapper module that requires it (the siblings are published).
                ew = work / "etcd"
                ew.mkdir()
                (ew / "go.mod").write_text("module sandman.dev/etcd-build\n\ngo 1.26\n\n"
                                           f"require go.etcd.io/etcd/server/v3 {versions.ETCD}\n")
                _run(["go", "get", f"go.etcd.io/etcd/server/v3@{versions.ETCD}"], ew, log, env)
                tmp_out = out / ".etcd.tmp"
                _run(["go", "build", "-trimpath", "-ldflags", "-s -w", "-o", str(tmp_out),
                      "go.etcd.io/etcd/server/v3"], ew, log, env)
                tmp_out.rename(out / "etcd")
            if "kwok" in missing:
                genv = dict(env, GOBIN=str(work / "gobin"))
                _run(["go", "install", "-trimpath", "-ldflags", "-s -w",
                      f"sigs.k8s.io/kwok/cmd/kwok@{versions.KWOK}"], work, log, genv)
                shutil.move(str(work / "gobin" / "kwok"), out / "kwok")
            if "helm" in missing:
                # helm's go.mod has no replace lines, so plain `go install` works (chart tests).
                genv = dict(env, GOBIN=str(work / "helmbin"))
                _run(["go", "install", "-trimpath", "-ldflags", _helm_ldflags(),
                      f"helm.sh/helm/v3/cmd/helm@{versions.HELM}"], work, log, genv)
                helm_path().parent.mkdir(parents=True, exist_ok=True)
                tmp_out = helm_path().parent / f".helm.tmp.{os.getpid()}"
                shutil.move(str(work / "helmbin" / "helm"), tmp_out)
                tmp_out.rename(helm_path())  # atomic, even when two sessions build at once
        except BuildError as e:
            raise BuildError(f"test-bed build failed: {e}; see {log_path}") from None
    print(f"testbed: built {', '.join(missing)} in {time.monotonic() - t0:.0f}s into {out}",
          file=sys.stderr)
    return bins


if __name__ == "__main__":
    try:
        for name, path in build().items():
            print(f"{name}: {path}")
    except BuildError as e:
        print(f"testbed: {e}", file=sys.stderr)
        sys.exit(1)
