"""kubeconform and the built-in kinds' JSON schemas in the test-bed cache (`make deps`).

    .venv/bin/python tools/kubeconform.py    # install what is missing, print the paths

The binary is `go install`ed from the Go module proxy at testbed/versions.py's KUBECONFORM into
~/.cache/sandman-testbed/kubeconform-<version>/bin. kubeconform fetches the built-in kinds'
schemas from GitHub by default, which this machine cannot reach; they are generated instead
from the swagger.json of the test bed's own Kubernetes version (tools/kubeschemas.py), into a
folder keyed by that version and by the converter's hash, so a change to either regenerates
them. tests/charts/test_kubeconform.py calls ensure() too, as the chart tests build helm.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script by make
    sys.path.insert(0, str(ROOT))

from testbed import build, versions  # noqa: E402
from tools import kubeschemas  # noqa: E402


def binary() -> Path:
    return build.cache_dir() / f"kubeconform-{versions.KUBECONFORM}" / "bin" / "kubeconform"


def schema_root() -> Path:
    """The folder for kubeconform's `{{ .NormalizedKubernetesVersion }}-standalone-strict/...`
    template (the layout of its default registry)."""
    digest = hashlib.sha256(Path(kubeschemas.__file__).read_bytes()).hexdigest()[:12]
    return build.cache_dir() / f"kubernetes-json-schema-{versions.KUBERNETES}-{digest}"


def core_dir() -> Path:
    return schema_root() / f"{versions.KUBERNETES}-standalone-strict"


def ensure(log_path: Path | None = None) -> tuple[Path, Path]:
    """(kubeconform, schema root), installing whichever is missing."""
    if not shutil.which("go") and not (binary().exists() and core_dir().exists()):
        raise build.BuildError("`go` is not on PATH; kubeconform and its schemas come from the "
                               "Go module proxy (make deps)")
    if not binary().exists():
        log_path = log_path or binary().parent.parent / "build.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "a") as log, tempfile.TemporaryDirectory(
                prefix="sandman-kubeconform-") as tmp:
            try:
                build._go_install(
                    f"github.com/yannh/kubeconform/cmd/kubeconform@{versions.KUBECONFORM}",
                    binary(), Path(tmp), log, build._go_env(),
                    ldflags=f"-s -w -X main.version={versions.KUBECONFORM}")
            except build.BuildError as e:
                raise build.BuildError(f"kubeconform: {e}; see {log_path}") from None
    if not core_dir().exists():
        schema_root().mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".core-", dir=schema_root()))
        try:
            kubeschemas.write_core(versions.KUBERNETES, tmp)
            tmp.rename(core_dir())  # atomic: a half-written folder never looks done
        except kubeschemas.SchemaError as e:
            raise build.BuildError(str(e)) from None
        except OSError:
            if not core_dir().exists():  # else another session won the rename
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return binary(), schema_root()


def main() -> int:
    try:
        kc, schemas = ensure()
    except build.BuildError as e:
        print(f"kubeconform: {e}", file=sys.stderr)
        return 1
    print(f"kubeconform: {kc}\nschemas: {schemas}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
