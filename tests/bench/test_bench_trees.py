"""bench/trees.py's smallest configuration (`--smoke`), so it does not rot: it runs against a
real execd, prints its section with both ways for both trees, and writes no docs."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import trees

DOCS = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"


@pytest.mark.timeout(120)
def test_trees_smoke(capsys):
    before = DOCS.read_text()
    assert trees.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(trees.SECTION)
    assert "| 20 files of 1 KiB |" in out and "| one 1 MiB file |" in out
    assert DOCS.read_text() == before, "a smoke run wrote docs/benchmarks.md"


def test_trees_smoke_never_writes_docs():
    with pytest.raises(SystemExit):
        trees.main(["--smoke", "--write-docs"])
