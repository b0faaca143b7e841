"""Layout rules of the repository, checked on the source with `ast`.

Product code, tools, benchmarks and the test bed never import the test suite: `make demo` and
the benches must run from a tree without tests/, and a test helper must not become a product
dependency by accident. The shared starters live in testbed/ (docs/testbed.md, "Starters").
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {"tests", ".venv", ".git"}


def python_files_outside_tests() -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        top = Path(dirpath) == ROOT
        # Any hidden directory (.venv*, .git, .testbed, caches) is not source, and is never
        # entered: a test bed running beside this test creates and removes state under it.
        dirnames[:] = [d for d in dirnames
                       if not d.startswith(".") and not (top and d in SKIP_DIRS)]
        out += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    return sorted(out)


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


# Product packages: what the wheel and the image ship. They import neither the test bed, the
# benches nor the tests (those import the product, never the reverse).
PRODUCT = ("sandman", "controller", "webhook", "netguard", "execd", "loadtest")
NOT_PRODUCT = ("testbed", "bench", "tests")


def imports_of(source: str, filename: str, tops: tuple[str, ...]) -> list[tuple[int, str]]:
    """(line, module) of every absolute import of one of `tops` (or below), at any depth."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        found += [(node.lineno, n) for n in names if n.split(".")[0] in tops]
    return found


def test_product_packages_import_neither_testbed_bench_nor_tests():
    files = [p for top in PRODUCT for p in sorted((ROOT / top).rglob("*.py"))]
    assert len(files) > 30, "walked nothing"
    bad = [f"{p.relative_to(ROOT)}:{line}: {mod}"
           for p in files for line, mod in imports_of(p.read_text(), str(p), NOT_PRODUCT)]
    assert not bad, "product code importing the test bed, a bench or the tests:\n" + \
        "\n".join(bad)


def test_the_import_check_finds_every_form():
    src = ("import testbed\nfrom bench.stats import percentile\ndef f():\n"
           "    import tests.conftest\nfrom . import bench\nimport benchmark\n"
           "from testbed import procs\n")
    assert sorted(line for line, _ in imports_of(src, "x.py", NOT_PRODUCT)) == [1, 2, 4, 7]


def test_every_bench_lives_in_bench():
    """No benchmark module left in a product package or the test bed: bench/ is the one place."""
    strays = [p.relative_to(ROOT).as_posix() for top in (*PRODUCT, "testbed")
              for p in (ROOT / top).rglob("*.py") if p.stem.startswith("bench")]
    assert not strays, f"benchmarks outside bench/: {strays}"
    names = {p.stem for p in (ROOT / "bench").glob("*.py")}
    assert {"execd", "swerex", "reuse", "netguard", "webhook", "controller", "loadtest",
            "realnode", "stats", "docs"} <= names, names


def test_one_percentile_definition():
    """Percentiles of docs/benchmarks.md come from bench/stats.py; the only other definition
    is loadtest/report.py's (shipped without bench/), checked equal in tests/bench."""
    import re

    defs = [f"{p.relative_to(ROOT)}: {m}" for p in python_files_outside_tests()
            for m in re.findall(r"^\s*def (pct|percentiles?|quantile)\(", p.read_text(), re.M)]
    assert sorted(defs) == ["bench/stats.py: percentile", "loadtest/report.py: pct"], defs


def test_the_image_copies_neither_testbed_nor_bench():
    dockerfile = (ROOT / "images" / "Dockerfile").read_text()
    copied = {line.split()[1].rstrip("/") for line in dockerfile.splitlines()
              if line.startswith("COPY ") and not line.startswith("COPY --from")}
    assert {"sandman", "controller", "execd"} <= copied, copied  # the check reads COPY lines
    assert not copied & {"testbed", "bench", "tests", "."}, copied


def test_nothing_the_chart_or_image_runs_needs_testbed_or_bench():
    """Commands in the chart and the image run product modules only."""
    import re

    texts = [p for d in ("charts", "images") for p in (ROOT / d).rglob("*")
             if p.is_file() and p.suffix in ("", ".yaml", ".tpl", ".sh", ".py", ".txt")]
    bad = [f"{p.relative_to(ROOT)}: {m}" for p in texts
           # a module (`testbed.cluster`), not a page (`docs/testbed.md` in a changelog text)
           for m in re.findall(r"\b(?:testbed|bench)\.(?!md\b)[a-z_]+\b|-m (?:testbed|bench)\b",
                               p.read_text(errors="replace"))]
    assert not bad, bad


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
