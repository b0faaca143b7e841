"""helm-docs in the test-bed cache (`make helm-docs`), and the chart README it writes.

    .venv/bin/python tools/helm_docs.py            # install when missing, print the path
    .venv/bin/python tools/helm_docs.py readme     # (re)write charts/sandman/README.md

The binary is `go install`ed from the Go module proxy at VERSION into
~/.cache/sandman-testbed/helm-docs-<version>/bin, as tools/kubeconform.py installs kubeconform.
It renders charts/sandman/README.md from README.md.gotmpl and the `# --` comments of
values.yaml; charts/gen_schema.py fills values.schema.json's descriptions from the same
comments. tests/charts/test_chart_readme.py renders the README into a temporary folder and fails when
the committed one differs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script by make
    sys.path.insert(0, str(ROOT))

from testbed import build  # noqa: E402

# The last release (2024-06); its go.mod has no replace lines, so `go install pkg@version` works.
VERSION = "v1.14.2"
CHART = ROOT / "charts" / "sandman"


def binary() -> Path:
    return build.cache_dir() / f"helm-docs-{VERSION}" / "bin" / "helm-docs"


def ensure(log_path: Path | None = None) -> Path:
    """The helm-docs binary, installed when missing."""
    if binary().exists():
        return binary()
    if not shutil.which("go"):
        raise build.BuildError("`go` is not on PATH; helm-docs comes from the Go module proxy "
                               "(make helm-docs)")
    log_path = log_path or binary().parent.parent / "build.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as log, tempfile.TemporaryDirectory(prefix="sandman-helm-docs-") as tmp:
        try:
            build._go_install(f"github.com/norwoodj/helm-docs/cmd/helm-docs@{VERSION}",
                              binary(), Path(tmp), log, build._go_env(),
                              ldflags=f"-s -w -X main.version={VERSION.lstrip('v')}")
        except build.BuildError as e:
            raise build.BuildError(f"helm-docs: {e}; see {log_path}") from None
    return binary()


def render(chart: Path = CHART) -> str:
    """The README helm-docs writes for `chart` (a copy of it, so the tree is not touched)."""
    with tempfile.TemporaryDirectory(prefix="sandman-readme-") as tmp:
        copy = Path(tmp) / chart.name
        shutil.copytree(chart, copy)
        (copy / "README.md").unlink(missing_ok=True)
        res = subprocess.run(
            [str(ensure()), "--chart-search-root", str(copy), "--log-level", "warning",
             "--template-files", "README.md.gotmpl", "--output-file", "README.md",
             "--sort-values-order", "file"],
            capture_output=True, text=True, timeout=120, env=dict(os.environ, NO_COLOR="1"))
        if res.returncode != 0:
            raise build.BuildError(f"helm-docs exited {res.returncode}: {res.stderr}")
        return (copy / "README.md").read_text()


def main(argv: list[str]) -> int:
    try:
        if argv[1:] == ["readme"]:
            (CHART / "README.md").write_text(render())
            print(CHART / "README.md")
        else:
            print(f"helm-docs: {ensure()}")
    except build.BuildError as e:
        print(str(e), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
