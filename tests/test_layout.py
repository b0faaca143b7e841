"""Layout rules of the repository, checked on the source with `ast`.

Product code, tools, benchmarks and the test bed never import the test suite: `make demo` and
the benches must run from a tree without tests/, and a test helper must not become a product
dependency by accident. The shared starters live in testbed/ (docs/testbed.md, "Starters").
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {"tests", ".venv", ".git"}


def python_files_outside_tests() -> list[Path]:
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        # Any hidden directory (.venv*, .git, .testbed, caches) is not source.
        if rel.parts[0] in SKIP_DIRS or any(p.startswith(".") for p in rel.parts[:-1]):
            continue
        out.append(path)
    return out


def imports_of_tests(source: str, filename: str) -> list[tuple[int, str]]:
    """(line, statement) of every import of `tests` or `tests.*`, at any depth (inside
    functions too). Relative imports stay in their own package and are not counted."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "tests" or alias.name.startswith("tests."):
                    found.append((node.lineno, f"import {alias.name}"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                node.module == "tests" or node.module.startswith("tests.")):
            found.append((node.lineno, f"from {node.module} import ..."))
    return found


def test_nothing_outside_tests_imports_tests():
    files = python_files_outside_tests()
    assert any(p.relative_to(ROOT).parts[0] == "testbed" for p in files), "walked nothing"
    bad = [f"{p.relative_to(ROOT)}:{line}: {stmt}"
           for p in files for line, stmt in imports_of_tests(p.read_text(), str(p))]
    assert not bad, "imports of the test suite outside tests/ (move the helper to testbed/):\n" \
        + "\n".join(bad)


def test_the_check_finds_every_form():
    src = ("import tests\nimport os, tests.conftest as c\nfrom tests.controller import harness\n"
           "def f():\n    from tests import x\nfrom testbed import procs\nimport testsuite\n"
           "from . import tests\n")
    assert [line for line, _ in imports_of_tests(src, "x.py")] == [1, 2, 3, 5]


def test_test_file_names_are_unique():
    # A basename names one test file in the whole suite, so a file named in a report, a doc or
    # a failure summary without its directory is still one file.
    seen: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        seen.setdefault(path.name, []).append(path.relative_to(ROOT).as_posix())
    assert len(seen) > 50, "walked nothing"
    dupes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not dupes, "test files sharing a name (rename each to what it tests):\n" + "\n".join(
        f"{name}: {', '.join(paths)}" for name, paths in sorted(dupes.items()))
