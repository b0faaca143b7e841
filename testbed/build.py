"""Build the test bed's Kubernetes binaries from the Go module proxy, once per version.

k8s.io/kubernetes cannot be `go install`ed: its go.mod replaces every staging module with
`./staging/src/k8s.io/...`. We build from a throwaway wrapper module that requires
k8s.io/kubernetes and replaces each staging module with its published v0.N.x. The staging list
is read from k8s.io/kubernetes's own go.mod so it never goes stale.
"""

from __future__ import annotations

import contextlib
import fcntl
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


def kubernetes_version() -> str:
    """The control plane's pinned version ($SANDMAN_K8S, testbed/versions.py)."""
    try:
        return versions.kubernetes()
    except ValueError as e:
        raise BuildError(str(e)) from None


def bin_dir(kube_version: str | None = None) -> Path:
    return cache_dir() / (f"k8s-{kube_version or kubernetes_version()}_kwok-{versions.KWOK}"
                          f"_etcd-{versions.ETCD}") / "bin"


def helm_path() -> Path:
    # Its own versioned folder: a helm bump must not rebuild the Kubernetes binaries.
    return cache_dir() / f"helm-{versions.HELM}" / "bin" / "helm"


# The real node's binaries, each in its own versioned folder: adding or bumping one never
# rebuilds the control plane (or the others).
REALNODE_K8S = ("kubelet", "kube-proxy")


def realnode_binaries() -> dict[str, Path]:
    d = cache_dir()
    bins = {n: d / f"realnode-k8s-{versions.KUBERNETES}" / "bin" / n for n in REALNODE_K8S}
    bins["coredns"] = d / f"coredns-{versions.COREDNS}" / "bin" / "coredns"
    bins["kube-router"] = d / f"kube-router-{versions.KUBE_ROUTER}" / "bin" / "kube-router"
    bins["crictl"] = d / f"cri-tools-{versions.CRI_TOOLS}" / "bin" / "crictl"
    return bins


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


def _build_k8s(names: list[str], out: Path, work: Path, log, env: dict[str, str],
               kube_version: str = versions.KUBERNETES) -> None:
    """`go build` k8s.io/kubernetes/cmd/<name> at kube_version for each name from a wrapper
    module in `work`."""
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    (work / "go.mod").write_text("module sandman.dev/probe\n\ngo 1.26\n")
    res = subprocess.run(
        ["go", "mod", "download", "-json", f"k8s.io/kubernetes@{kube_version}"],
        cwd=work, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        log.write(res.stdout + res.stderr)
        raise BuildError(f"cannot download k8s.io/kubernetes@{kube_version}")
    gomod = Path(json.loads(res.stdout)["GoMod"]).read_text()
    (work / "go.mod").write_text(_wrapper_gomod(kube_version, staging_modules(gomod)))
    pkgs = [f"k8s.io/kubernetes/cmd/{n}" for n in names]
    _run(["go", "mod", "download"], work, log, env)
    for p in pkgs:
        _run(["go", "get", f"{p}@{kube_version}"], work, log, env)
    for name, pkg in zip(names, pkgs, strict=True):
        tmp_out = out / f".{name}.tmp.{os.getpid()}"
        _run(["go", "build", "-trimpath", "-ldflags", _ldflags(kube_version),
              "-o", str(tmp_out), pkg], work, log, env)
        tmp_out.rename(out / name)  # atomic: a half-built binary never looks done


def _go_install(pkg: str, dest: Path, work: Path, log, env: dict[str, str],
                ldflags: str = "-s -w") -> None:
    """`go install pkg@version` (modules without replace lines) and move the binary to dest."""
    gobin = work / f"gobin-{dest.name}"
    _run(["go", "install", "-trimpath", "-ldflags", ldflags, pkg], work, log,
         dict(env, GOBIN=str(gobin)))
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = dest.parent / f".{dest.name}.tmp.{os.getpid()}"
    shutil.move(str(gobin / dest.name), tmp_out)
    tmp_out.rename(dest)  # atomic, even when two sessions build at once


@contextlib.contextmanager
def _build_lock():
    """One build at a time per cache: a second session (the other tier of `make test`, another
    checkout) waits for the first and then finds the binaries built, instead of compiling the
    same Kubernetes packages beside it (~2 GB and all the machine's cores each)."""
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / ".build.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when f closes, also if this process dies
        yield


def build_realnode(log_path: Path | None = None, force: bool = False) -> dict[str, Path]:
    """Build the real node's missing binaries (kubelet, kube-proxy, CoreDNS, kube-router,
    crictl) into their own cache folders; return name -> path."""
    bins = realnode_binaries()
    if not force and all(p.exists() for p in bins.values()):
        return bins
    with _build_lock():
        return _build_realnode(bins, log_path, force)


def _build_realnode(bins: dict[str, Path], log_path: Path | None, force: bool) -> dict[str, Path]:
    missing = [n for n, p in bins.items() if force or not p.exists()]
    if not missing:
        return bins
    if not shutil.which("go"):
        raise BuildError("`go` is not on PATH; the test bed builds its binaries with Go >= 1.26")
    log_path = log_path or cache_dir() / "realnode-build.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = _go_env()
    t0 = time.monotonic()
    with open(log_path, "a") as log, tempfile.TemporaryDirectory(prefix="sandman-realnode-build-") as tmp:
        work = Path(tmp)
        try:
            k8s = [n for n in missing if n in REALNODE_K8S]
            if k8s:
                _build_k8s(k8s, bins[k8s[0]].parent, work / "k8s", log, env)
            if "coredns" in missing:
                _go_install(f"github.com/coredns/coredns@{versions.COREDNS}", bins["coredns"],
                            work, log, env)
            if "kube-router" in missing:
                pkg = "github.com/cloudnativelabs/kube-router/v2"
                _go_install(f"{pkg}/cmd/kube-router@{versions.KUBE_ROUTER}", bins["kube-router"],
                            work, log, env,
                            ldflags=f"-s -w -X {pkg}/pkg/version.Version={versions.KUBE_ROUTER}")
            if "crictl" in missing:
                _go_install(f"sigs.k8s.io/cri-tools/cmd/crictl@{versions.CRI_TOOLS}", bins["crictl"],
                            work, log, env)
        except BuildError as e:
            raise BuildError(f"real-node build failed: {e}; see {log_path}") from None
    print(f"testbed: built {', '.join(missing)} in {time.monotonic() - t0:.0f}s", file=sys.stderr)
    return bins


def crane_path() -> Path:
    return cache_dir() / f"crane-{versions.CRANE}" / "bin" / "crane"


def build_crane(log_path: Path | None = None) -> Path:
    """crane, for the real node's optional local registry (testbed/registry.py); built on
    first use into its own versioned folder."""
    path = crane_path()
    if path.exists():
        return path
    if not shutil.which("go"):
        raise BuildError("`go` is not on PATH; the test bed builds its binaries with Go >= 1.26")
    log_path = log_path or cache_dir() / "realnode-build.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock():
        if path.exists():  # another session built it while this one waited
            return path
        with open(log_path, "a") as log, \
                tempfile.TemporaryDirectory(prefix="sandman-crane-build-") as tmp:
            try:
                _go_install("github.com/google/go-containerregistry/cmd/crane@"
                            f"{versions.CRANE}", path, Path(tmp), log, _go_env())
            except BuildError as e:
                raise BuildError(f"crane build failed: {e}; see {log_path}") from None
    return path


def build(log_path: Path | None = None, force: bool = False,
          only: tuple[str, ...] = ()) -> dict[str, Path]:
    """Build any missing binary (of `only`, when given: `make deps` builds helm alone for the
    chart checks of `make check`); return name -> path. Safe to call on every start."""
    bins = {n: p for n, p in binaries().items() if not only or n in only}
    if not force and all(p.exists() for p in bins.values()):
        return bins
    with _build_lock():
        return _build(bins, log_path, force)


def _build(bins: dict[str, Path], log_path: Path | None, force: bool) -> dict[str, Path]:
    missing = [n for n, p in bins.items() if force or not p.exists()]
    if not missing:
        return bins
    kube_version = kubernetes_version()
    out = bin_dir(kube_version)
    out.mkdir(parents=True, exist_ok=True)
    # etcd and kwok do not depend on the Kubernetes version: another minor's folder takes
    # CI's copies (hard links) instead of building them again.
    for name in ("etcd", "kwok"):
        src = bin_dir(versions.KUBERNETES) / name
        if name in missing and not force and src.exists() and src.parent != out:
            os.link(src, out / name)
            missing.remove(name)
    log_path = log_path or out.parent / "build.log"
    if not missing:
        return bins
    env = _go_env()
    if not shutil.which("go"):
        raise BuildError("`go` is not on PATH; the test bed builds its binaries with Go >= 1.26")
    t0 = time.monotonic()
    with open(log_path, "a") as log, tempfile.TemporaryDirectory(prefix="sandman-k8s-build-") as tmp:
        work = Path(tmp)
        try:
            k8s_missing = [n for n in missing if n in K8S_COMPONENTS]
            if k8s_missing:
                _build_k8s(k8s_missing, out, work / "k8s", log, env, kube_version)
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
