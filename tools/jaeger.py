"""Jaeger v2 in the test-bed cache (`make jaeger`): the real OTLP receiver of the trace tests.

    .venv/bin/python tools/jaeger.py    # build when missing, print the path

Jaeger v2 is an OpenTelemetry Collector build with Jaeger's storage and query API; the tests
export spans to its OTLP/HTTP receiver and read them back over its HTTP query API
(tests/otlp_receiver.py). `go install pkg@version` refuses it (its go.mod has a replace line),
so it is built inside a throwaway module that requires it as a tool and copies its replace
lines, into ~/.cache/sandman-testbed/jaeger-<version>/bin.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script by make
    sys.path.insert(0, str(ROOT))

from testbed import build  # noqa: E402

# The Go module's tag; Jaeger tags each release twice, v1.N (this module path) and v2.M (the
# version the v2 binary reports), from one commit.
VERSION = "v1.75.0"
V2_VERSION = "v2.12.0"
BUILD_DATE = "2025-11-13T16:44:30Z"  # the tag's time, as the module proxy reports it
MODULE = "github.com/jaegertracing/jaeger"
PKG = f"{MODULE}/cmd/jaeger"
# Jaeger's own release builds stamp these (scripts/makefiles/BuildInfo.mk); unstamped, the
# binary reports an empty version.
_STAMP = f"{MODULE}/internal/version"
LDFLAGS = (f"-s -w -X {_STAMP}.latestVersion={V2_VERSION} -X {_STAMP}.date={BUILD_DATE}")
# `old => new vX` lines (module replacements; a local-path target would have no version).
_REPLACE_RE = re.compile(r"^\s*(?:replace\s+)?(\S+)(?:\s+(v\S+))?\s*=>\s*(\S+)\s+(v\S+)\s*$", re.M)


def binary() -> Path:
    return build.cache_dir() / f"jaeger-{VERSION}" / "bin" / "jaeger"


def replacements(gomod: str) -> list[str]:
    """`old=new@version` for each module replacement in Jaeger's go.mod (`go mod edit -replace`)."""
    return [f"{old}{'@' + old_ver if old_ver else ''}={new}@{ver}"
            for old, old_ver, new, ver in _REPLACE_RE.findall(gomod)]


def _build(dest: Path, work: Path, log: IO[str]) -> None:
    env = dict(build._go_env(), GOFLAGS="-mod=mod -buildvcs=false")
    build._run(["go", "mod", "init", "sandman.dev/jaeger-build"], work, log, env)
    download = ["go", "mod", "download", "-json", f"{MODULE}@{VERSION}"]
    log.write(f"$ {' '.join(download)}\n")
    log.flush()
    info = subprocess.run(download, cwd=work, env=env, capture_output=True, text=True)
    log.write(info.stderr)
    if info.returncode != 0:
        raise build.BuildError(f"`go mod download {MODULE}@{VERSION}` exited {info.returncode}")
    gomod = Path(json.loads(info.stdout)["GoMod"]).read_text()
    for rep in replacements(gomod):
        build._run(["go", "mod", "edit", f"-replace={rep}"], work, log, env)
    build._run(["go", "get", "-tool", f"{PKG}@{VERSION}"], work, log, env)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = dest.parent / f".{dest.name}.tmp"
    build._run(["go", "build", "-trimpath", "-ldflags", LDFLAGS, "-o", str(tmp_out), PKG],
               work, log, env)
    tmp_out.rename(dest)  # atomic: a half-written binary is never at dest


def ensure(log_path: Path | None = None) -> Path:
    """The Jaeger binary, built when missing (about 2.5 min on 2 cores with a warm module cache)."""
    if binary().exists():
        return binary()
    if not shutil.which("go"):
        raise build.BuildError("`go` is not on PATH; Jaeger is built from the Go module proxy "
                               "(make jaeger)")
    log_path = log_path or binary().parent.parent / "build.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with build._build_lock():
        if binary().exists():  # another session built it while this one waited
            return binary()
        with open(log_path, "a") as log, tempfile.TemporaryDirectory(prefix="sandman-jaeger-") as tmp:
            try:
                _build(binary(), Path(tmp), log)
            except build.BuildError as e:
                raise build.BuildError(f"jaeger: {e}; see {log_path}") from None
    return binary()


def main(argv: list[str]) -> int:
    try:
        print(ensure())
    except build.BuildError as e:
        print(str(e), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
