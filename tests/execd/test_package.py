"""execd's source as the pod gets it: a package of standard-library modules, each small enough
to read, importing nothing from outside the standard library (task images have no
site-packages of ours, and execd runs with -I -S) and nothing from the rest of this tree."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

EXECD = Path(__file__).resolve().parents[2] / "execd"
SHIPPED = sorted([EXECD / "execd.py", EXECD / "install.py", *(EXECD / "execd_daemon").glob("*.py")])
MAX_LINES = 800


def _imports(path: Path) -> list[tuple[int, str]]:
    """(level, top-level name) of every import in the file, function-level ones included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(0, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append((node.level, (node.module or "").split(".")[0]))
    return out


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(EXECD)))
def test_execd_imports_the_standard_library_only(path):
    stdlib = set(sys.stdlib_module_names) | {"_sha2"}  # _sha256's name from Python 3.12
    # The launcher imports the daemon package beside it (sys.path[0] is its own directory).
    own = {"execd_daemon"} if path.name == "execd.py" else set()
    bad = [name for level, name in _imports(path)
           if level == 0 and name not in stdlib and name not in own]
    assert not bad, f"{path.name} imports {bad}: execd runs on a task image's bare python3"


def test_the_daemon_package_imports_itself_relatively():
    """Relative imports inside execd_daemon: the package is `execd.execd_daemon` in this tree
    and `execd_daemon` in a pod, and an absolute `execd` import would reach the launcher."""
    for path in (EXECD / "execd_daemon").glob("*.py"):
        assert not [n for level, n in _imports(path) if level == 0 and n in ("execd", "execd_daemon")], path


def test_no_module_is_a_second_monolith():
    sizes = {p.name: len(p.read_text().splitlines()) for p in SHIPPED}
    assert max(sizes.values()) <= MAX_LINES, sizes
