"""Make sure a Go >= 1.26 is at hand for the test bed's builds (`make deps`).

A `go` of at least MIN_GO on PATH is used as it is. Otherwise the toolchain is fetched the way
`go` itself fetches one (GOTOOLCHAIN): Go distributions are served by the Go module proxy as
the module golang.org/toolchain, version v0.0.1-go<VERSION>.linux-<arch>. The zip is checked
against the checksum database's h1: hash pinned below (read through the proxy's sumdb
endpoint; sum.golang.org itself is not reachable from here), unpacked into
~/.cache/sandman-testbed/go-toolchain (the Makefile puts its bin/ first on PATH), and the
executables get their mode bits back (module zips carry none). A mismatch or a failed download
is one line on stderr, exit 1, and nothing is left in the cache. Stdlib only: it runs before
the venv exists.
"""

from __future__ import annotations

import base64
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
from pathlib import Path

MIN_GO = (1, 26)
VERSION = "1.26.8"
# `golang.org/toolchain v0.0.1-go1.26.8.linux-<arch> h1:...` from the checksum database.
H1 = {
    "amd64": "h1:ZOmGe1OnfREDMIdb1Qi4G9JSuDPBLGExZMQ4nis1RXM=",
    "arm64": "h1:sYL/O6MqS68ML0kjsQ36WoYIpJqkw60TxizWUYUKQMc=",
}
DOWNLOAD_TIMEOUT_S = 600


class ToolchainError(RuntimeError):
    pass


def cache_dir() -> Path:
    root = os.environ.get("SANDMAN_TESTBED_CACHE") or os.path.expanduser("~/.cache/sandman-testbed")
    return Path(root) / "go-toolchain"


def go_version(go: str) -> tuple[int, int] | None:
    """(major, minor) that `go version` reports, None when it does not run."""
    try:
        out = subprocess.run([go, "version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"\bgo(\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def arch() -> str:
    machine = platform.machine().lower()
    goarch = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(machine)
    if goarch is None:
        raise ToolchainError(f"no pinned Go toolchain for {machine}; install Go >= "
                             f"{MIN_GO[0]}.{MIN_GO[1]} yourself")
    return goarch


def dirhash_h1(zip_path: Path) -> str:
    """The `h1:` hash of a module zip (golang.org/x/mod/sumdb/dirhash.Hash1): SHA-256 over
    the sorted lines "<sha256 hex>  <file name>\\n" of every file in it."""
    summary = hashlib.sha256()
    with zipfile.ZipFile(zip_path) as z:
        names = sorted(i.filename for i in z.infolist() if not i.is_dir())
        for name in names:
            if "\n" in name:
                raise ToolchainError(f"file name with a newline in {zip_path}")
            h = hashlib.sha256()
            with z.open(name) as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            summary.update(f"{h.hexdigest()}  {name}\n".encode())
    return "h1:" + base64.b64encode(summary.digest()).decode()


def proxy() -> str:
    """The first proxy URL of $GOPROXY (the default, proxy.golang.org, otherwise)."""
    for entry in re.split(r"[,|]", os.environ.get("GOPROXY", "")):
        if entry.startswith(("https://", "http://")):
            return entry.rstrip("/")
    return "https://proxy.golang.org"


def fetch(dest: Path) -> Path:
    goarch = arch()
    module_version = f"v0.0.1-go{VERSION}.linux-{goarch}"
    url = f"{proxy()}/golang.org/toolchain/@v/{module_version}.zip"
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".go-toolchain-", dir=dest.parent))
    try:
        zpath = tmp / "toolchain.zip"
        try:
            with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as r, \
                    open(zpath, "wb") as f:
                shutil.copyfileobj(r, f, 1 << 20)
        except OSError as e:
            raise ToolchainError(f"downloading {url} failed: {e}") from e
        try:
            got = dirhash_h1(zpath)
        except zipfile.BadZipFile as e:
            raise ToolchainError(f"{url} is not a zip: {e}") from e
        if got != H1[goarch]:
            raise ToolchainError(f"{url} has hash {got}, expected {H1[goarch]}; not installed")
        prefix = f"golang.org/toolchain@{module_version}/"
        root = tmp / "go"
        with zipfile.ZipFile(zpath) as z:
            for info in z.infolist():
                if not info.filename.startswith(prefix) or ".." in info.filename.split("/"):
                    raise ToolchainError(f"unexpected path {info.filename!r} in {url}")
            z.extractall(tmp / "unpacked")
        (tmp / "unpacked" / prefix).rename(root)
        # What go's own toolchain switch does: module zips have no mode bits.
        for exe in [*root.glob("bin/*"), *root.glob("pkg/tool/*/*")]:
            if exe.is_file():
                exe.chmod(0o755)
        if go_version(str(root / "bin" / "go")) is None:
            raise ToolchainError(f"the fetched go ({root}/bin/go) does not run")
        if dest.exists():
            shutil.rmtree(dest)
        root.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def main() -> int:
    go = shutil.which("go")
    found = go_version(go) if go else None
    if found is not None and found >= MIN_GO:
        return 0
    cached = cache_dir() / "bin" / "go"
    if cached.exists() and (go_version(str(cached)) or (0, 0)) >= MIN_GO:
        print(f"gotoolchain: Go {VERSION} is in {cache_dir()}; put {cached.parent} on PATH "
              "(the Makefile does)", file=sys.stderr)
        return 0
    have = f"go{found[0]}.{found[1]}" if found else "no go"
    print(f"gotoolchain: {have} on PATH; fetching Go {VERSION} from the Go module proxy into "
          f"{cache_dir()}", file=sys.stderr)
    try:
        fetch(cache_dir())
    except ToolchainError as e:
        print(f"gotoolchain: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
