"""`make release REGISTRY=host/prefix`: the sandman image and the Helm chart, pushed to an OCI
registry, the chart referring to its image by digest, so `helm install oci://...` of a version
runs exactly the image that was released with it.

    .venv/bin/python tools/release.py --registry host/prefix [--plain-http]

1. The version is sandman/_version.py's; charts/sandman/Chart.yaml's version and appVersion must
   equal it (refused in one line otherwise: the lead bumps all three together).
2. The registry must answer (`/v2/`) before anything is built.
3. Every image the chart runs (IMAGES: the one sandman image) is built as `make images` builds
   it (testbed/images.py: buildah, cached by the hash of its inputs, so a cached one is reused
   as is) and pushed with crane as `host/prefix/<name>:<version>`; the digest crane pushed is
   read back from the registry through the tag and must be the same (a tag moved under us, or a
   registry that rewrote the manifest, is refused).
4. The chart is packaged from a copy whose values.yaml names `host/prefix/<name>` and that digest.
   Before it is pushed, every container image of every object it renders (hooks and the `helm
   test` pod included) must be a `@sha256:` reference to an image pushed in step 3 that the
   registry serves by that digest: a chart pointing anywhere else is never pushed.
5. `helm push` to `oci://host/prefix/charts` (the chart's own repository: `host/prefix/sandman`
   is the image's), refused when that version is already there (a release is never replaced);
   the chart's digest is read back the same way.
6. Prints what was released: the chart's reference and digest, each image's.

crane and helm are the test bed's (~/.cache/sandman-testbed, `make helm`; crane is built on first
use). Both use the caller's registry logins: `crane auth login` / `docker login` and `helm
registry login`. --plain-http: a registry without TLS (the test bed's, on 127.0.0.1).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import ssl
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: testbed is a package of this tree
    sys.path.insert(0, str(ROOT))

from testbed import build, images  # noqa: E402

CHART = ROOT / "charts" / "sandman"
# The images the chart runs, by testbed.images name; each is `<registry>/<name>` in the release.
IMAGES = ("sandman",)
CHART_SUBPATH = "charts"
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
# Kinds whose pod templates hold containers: a chart rendering another such kind is refused
# (its images would go unchecked).
POD_KINDS = {"Pod": ("spec",), "Deployment": ("spec", "template", "spec"),
             "DaemonSet": ("spec", "template", "spec"),
             "StatefulSet": ("spec", "template", "spec"), "Job": ("spec", "template", "spec"),
             "CronJob": ("spec", "jobTemplate", "spec", "template", "spec")}


class ReleaseError(RuntimeError):
    pass


@dataclass(frozen=True)
class Released:
    version: str
    chart: str          # oci://host/prefix/charts/sandman
    chart_digest: str   # sha256:...
    images: dict[str, str]  # name -> host/prefix/name@sha256:...

    def summary(self) -> str:
        lines = [f"released sandman {self.version}",
                 f"  chart  {self.chart} --version {self.version}  ({self.chart_digest})"]
        lines += [f"  image  {ref}" for ref in self.images.values()]
        return "\n".join(lines)


def _log(msg: str) -> None:
    print(f"release: {msg}", file=sys.stderr, flush=True)


# --- checks before anything is built ---------------------------------------------------------

def versions() -> str:
    """The one version; refused unless Chart.yaml's version and appVersion equal it."""
    version = images.sandman_version()
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    got = (str(chart.get("version")), str(chart.get("appVersion")))
    if got != (version, version):
        raise ReleaseError(f"version mismatch: sandman/_version.py is {version}, "
                           f"charts/sandman/Chart.yaml has version {got[0]}, appVersion "
                           f"{got[1]}; the three must be equal")
    return version


def parse_registry(registry: str) -> str:
    """`host[:port]/prefix` without a scheme or trailing slash; one line when malformed."""
    reg = registry.strip().removeprefix("oci://").rstrip("/")
    if not reg:
        raise ReleaseError("no registry: make release REGISTRY=host/prefix "
                           "(e.g. ghcr.io/your-org)")
    if not re.fullmatch(r"[A-Za-z0-9.-]+(:[0-9]+)?(/[a-z0-9]+([._-][a-z0-9]+)*)*", reg):
        raise ReleaseError(f"registry {registry!r} is not host[:port]/prefix "
                           f"(lower-case path, no scheme, no tag)")
    return reg


def check_reachable(registry: str, plain_http: bool, timeout: float = 10) -> None:
    """GET /v2/ answers (200, or 401 asking for a login): anything else, before a build."""
    host = registry.split("/", 1)[0]
    url = f"{'http' if plain_http else 'https'}://{host}/v2/"
    opener = urllib.request.build_opener(
        *([urllib.request.ProxyHandler({})] if _local(host) else []),
        urllib.request.HTTPSHandler(context=ssl.create_default_context()))
    try:
        with opener.open(url, timeout=timeout):
            return
    except urllib.error.HTTPError as e:
        if e.code == 401:
            return
        raise ReleaseError(f"registry {host} unreachable: {url} answered {e.code}") from None
    except (OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise ReleaseError(f"registry {host} unreachable: {url}: {reason}") from None


def _local(host: str) -> bool:
    return host.split(":", 1)[0] in ("127.0.0.1", "localhost", "[::1]")


# --- tools -------------------------------------------------------------------------------------

class Tools:
    """crane and helm from the test bed's cache, with the caller's logins."""

    def __init__(self, registry: str, plain_http: bool):
        self.plain_http = plain_http
        self.env = dict(os.environ)
        host = registry.split("/", 1)[0]
        if _local(host):  # a proxy in the environment must not be asked for 127.0.0.1
            for var in ("NO_PROXY", "no_proxy"):
                self.env[var] = ",".join(filter(None, (self.env.get(var), host.split(":")[0])))
        helm = build.helm_path()
        if not helm.exists():
            raise ReleaseError(f"helm is not built ({helm}); run `make helm`")
        self.helm_bin = str(helm)
        try:
            self.crane_bin = str(build.build_crane())
        except build.BuildError as e:
            raise ReleaseError(f"crane: {e}") from None

    def _run(self, argv: list[str], timeout: float) -> str:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                             env=self.env)
        if res.returncode != 0:
            msg = " ".join((res.stderr or res.stdout).split())[-400:]
            raise ReleaseError(f"{Path(argv[0]).name} {argv[1]}: {msg}")
        return res.stdout + res.stderr

    def crane(self, *args: str, timeout: float = 600) -> str:
        return self._run([self.crane_bin, *args, *(["--insecure"] if self.plain_http else [])],
                         timeout).strip()

    def helm(self, *args: str, timeout: float = 300) -> str:
        return self._run([self.helm_bin, *args], timeout)

    def helm_oci(self, *args: str, timeout: float = 300) -> str:
        return self.helm(*args, *(["--plain-http"] if self.plain_http else []), timeout=timeout)

    def digest(self, ref: str) -> str | None:
        """The manifest digest the registry serves for `ref`, None when it serves none."""
        res = subprocess.run([self.crane_bin, "digest", ref,
                              *(["--insecure"] if self.plain_http else [])],
                             capture_output=True, text=True, timeout=60, env=self.env)
        out = res.stdout.strip()
        if res.returncode == 0 and DIGEST.fullmatch(out):
            return out
        if "MANIFEST_UNKNOWN" in res.stderr or "NAME_UNKNOWN" in res.stderr or \
                "404" in res.stderr:
            return None
        raise ReleaseError(f"crane digest {ref}: {' '.join(res.stderr.split())[-400:]}")


# --- images ------------------------------------------------------------------------------------

def push_image(tools: Tools, archive: Path, repo: str, version: str) -> str:
    """Push one image archive as `repo:version`; its reference by digest, read back."""
    with tempfile.TemporaryDirectory(prefix="sandman-release-") as tmp:
        refs = Path(tmp) / "refs"
        tools.crane("push", str(archive), f"{repo}:{version}", "--image-refs", str(refs))
        pushed = refs.read_text().strip()
    m = re.fullmatch(rf"{re.escape(repo)}@({DIGEST.pattern})", pushed)
    if not m:
        raise ReleaseError(f"crane push {repo}:{version} reported {pushed!r}, not a digest")
    digest = m.group(1)
    served = tools.digest(f"{repo}:{version}")
    if served != digest:
        raise ReleaseError(f"{repo}:{version} is {served} in the registry, not the {digest} "
                           f"just pushed (another push moved the tag?)")
    return f"{repo}@{digest}"


def publish_images(tools: Tools, registry: str, version: str) -> dict[str, str]:
    out = {}
    for name in IMAGES:
        img = images.BUILDERS[name]()  # cached by its inputs' hash: reused when built
        _log(f"pushing {img.archive} as {registry}/{name}:{version}")
        out[name] = push_image(tools, img.archive, f"{registry}/{name}", version)
    return out


# --- chart -------------------------------------------------------------------------------------

def pinned_values(text: str, repository: str, digest: str) -> str:
    """values.yaml with the top-level `image` block naming `repository` at `digest` (the
    comments stay: they are the chart's documentation); checked by parsing the result."""
    block = re.search(r"^image:\n((?:[ #].*\n|\n)*)", text, re.M)
    if block is None:
        raise ReleaseError("charts/sandman/values.yaml has no top-level `image:` block")
    body = block.group(1)
    body, n_repo = re.subn(r"^  repository: .*$", f"  repository: {repository}", body,
                           count=1, flags=re.M)
    body, n_digest = re.subn(r"^  digest: .*$", f'  digest: "{digest}"', body, count=1,
                             flags=re.M)
    if (n_repo, n_digest) != (1, 1):
        raise ReleaseError("values.yaml's `image` block has no `repository:` or `digest:` line")
    out = text[:block.start(1)] + body + text[block.end(1):]
    image = yaml.safe_load(out)["image"]
    if (image.get("repository"), image.get("digest")) != (repository, digest):
        raise ReleaseError(f"values.yaml's `image` after pinning is {image}, not "
                           f"{repository}@{digest}")
    return out


def package_chart(tools: Tools, refs: dict[str, str], out: Path) -> Path:
    """The chart packaged into `out` with its image pinned to `refs["sandman"]`."""
    repository, digest = refs["sandman"].split("@", 1)
    src = out / "src" / CHART.name
    shutil.copytree(CHART, src)
    values = src / "values.yaml"
    values.write_text(pinned_values(values.read_text(), repository, digest))
    tools.helm("package", str(src), "--destination", str(out))
    tgz = sorted(out.glob(f"{CHART.name}-*.tgz"))
    if len(tgz) != 1:
        raise ReleaseError(f"helm package wrote {[p.name for p in tgz]} into {out}")
    return tgz[0]


def _pod_spec(obj: dict) -> dict | None:
    path = POD_KINDS.get(obj.get("kind", ""))
    spec: object = obj
    for key in path or ():
        spec = spec.get(key) if isinstance(spec, dict) else None
    return spec if path and isinstance(spec, dict) else None


def rendered_images(tools: Tools, tgz: Path) -> list[str]:
    """Every container image of every object the packaged chart renders with its defaults,
    hooks and the `helm test` pod included."""
    docs = [d for d in yaml.safe_load_all(tools.helm("template", "release-check", str(tgz),
                                                     "--namespace", "sandman-system"))
            if isinstance(d, dict)]
    found: list[str] = []
    for obj in docs:
        spec = _pod_spec(obj)
        if spec is None:
            continue
        for key in ("initContainers", "containers", "ephemeralContainers"):
            found += [c["image"] for c in spec.get(key) or []]
    if not found:
        raise ReleaseError(f"{tgz.name} renders no container: nothing to check, refusing")
    return sorted(set(found))


def verify_chart(tools: Tools, tgz: Path, pushed: dict[str, str]) -> list[str]:
    """Refuse a chart that runs any image other than one pushed now and served by its digest."""
    imgs = rendered_images(tools, tgz)
    for ref in imgs:
        if ref not in pushed.values():
            raise ReleaseError(f"{tgz.name} runs {ref}, not an image of this release "
                               f"({', '.join(pushed.values())}); not pushed")
        if tools.digest(ref) != ref.split("@", 1)[1]:
            raise ReleaseError(f"{tgz.name} runs {ref}, which the registry does not serve; "
                               f"not pushed")
    return imgs


def push_chart(tools: Tools, tgz: Path, registry: str, version: str,
               pushed: dict[str, str]) -> tuple[str, str]:
    """Verify, then `helm push`; (oci:// reference, chart digest read back)."""
    verify_chart(tools, tgz, pushed)
    repo = f"{registry}/{CHART_SUBPATH}"
    name = f"{repo}/{CHART.name}"
    not_released(tools, registry, version)
    out = tools.helm_oci("push", str(tgz), f"oci://{repo}")
    m = re.search(rf"Digest: ({DIGEST.pattern})", out)
    if not m:
        raise ReleaseError(f"helm push printed no digest: {' '.join(out.split())[-300:]}")
    served = tools.digest(f"{name}:{version}")
    if served != m.group(1):
        raise ReleaseError(f"{name}:{version} is {served} in the registry, not the "
                           f"{m.group(1)} helm pushed")
    return f"oci://{name}", m.group(1)


def not_released(tools: Tools, registry: str, version: str) -> None:
    """Refuse a version whose chart is in the registry already (checked before any push, and
    again just before the chart's)."""
    name = f"{registry}/{CHART_SUBPATH}/{CHART.name}"
    if tools.digest(f"{name}:{version}") is not None:
        raise ReleaseError(f"oci://{name} {version} is already released; a release is never "
                           f"replaced (bump the version)")


def shipped_paths() -> list[str]:
    """What a release is made of: the image's build context (images/Dockerfile, what it COPYs,
    .dockerignore) and the chart."""
    rel = [str(images.DOCKERFILE.relative_to(ROOT)), str(images.DOCKERIGNORE.relative_to(ROOT)),
           str(CHART.relative_to(ROOT))]
    return sorted(set(rel + images.dockerfile_copy_sources()))


def uncommitted(root: Path, paths: list[str]) -> list[str]:
    """Paths under `paths` that differ from the commit checked out in `root` (untracked files
    included): the image and chart are built from the working tree, so these would ship."""
    res = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=all",
                          "--", *paths], capture_output=True, text=True)
    if res.returncode != 0:
        raise ReleaseError(f"git status in {root}: {' '.join(res.stderr.split())[-300:]} "
                           f"(a release is built from a git checkout)")
    return [line[3:] for line in res.stdout.splitlines() if line.strip()]


def release(registry: str, plain_http: bool = False, allow_dirty: bool = False) -> Released:
    version = versions()
    registry = parse_registry(registry)
    dirty = uncommitted(ROOT, shipped_paths())
    if dirty and not allow_dirty:
        more = f" and {len(dirty) - 3} more" if len(dirty) > 3 else ""
        raise ReleaseError(f"uncommitted changes would ship: {', '.join(dirty[:3])}{more}; "
                           f"commit them (or ALLOW_DIRTY=1 for a test release)")
    check_reachable(registry, plain_http)
    tools = Tools(registry, plain_http)
    not_released(tools, registry, version)
    pushed = publish_images(tools, registry, version)
    with tempfile.TemporaryDirectory(prefix="sandman-release-") as tmp:
        tgz = package_chart(tools, pushed, Path(tmp))
        chart, digest = push_chart(tools, tgz, registry, version, pushed)
    return Released(version, chart, digest, pushed)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tools/release.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--registry", default="", help="host[:port]/prefix (REGISTRY of make release)")
    ap.add_argument("--plain-http", action="store_true",
                    help="the registry speaks http, not https (a local one)")
    ap.add_argument("--allow-dirty", action="store_true",
                    help="release uncommitted changes of the image's sources or the chart")
    args = ap.parse_args(argv)
    try:
        print(release(args.registry, args.plain_http, args.allow_dirty).summary())
    except (ReleaseError, images.ImageError) as e:
        print(f"release: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
