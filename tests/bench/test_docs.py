"""bench/docs.py: the one writer of docs/benchmarks.md sections, and the docs it writes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench import docs

REPO = Path(__file__).resolve().parents[2]


def test_write_section_rewrites_only_its_own_section(tmp_path):
    path = tmp_path / "benchmarks.md"
    docs.write_section("## netguard\n\nfirst\n", path)
    assert path.read_text() == "# Benchmarks\n\n## netguard\n\nfirst\n"
    path.write_text("# Benchmarks\n\n## execd\n\nkeep me\n\n## netguard\n\nold\n\n"
                    "## webhook\n\nkeep me too\n")
    docs.write_section("## netguard\n\nnew\n", path)
    assert path.read_text() == ("# Benchmarks\n\n## execd\n\nkeep me\n\n## netguard\n\nnew\n\n"
                                "## webhook\n\nkeep me too\n")
    with pytest.raises(ValueError):
        docs.write_section("no heading\n", path)


def test_text_below_the_keep_line_survives(tmp_path):
    path = tmp_path / "benchmarks.md"
    path.write_text(f"# Benchmarks\n\n## controller\n\nold run\n\n{docs.KEEP}\n\nnotes\n\n"
                    "## next\n\nx\n")
    docs.write_section("## controller\n\nnew run\n", path)
    assert path.read_text() == (f"# Benchmarks\n\n## controller\n\nnew run\n\n{docs.KEEP}\n\n"
                                "notes\n\n## next\n\nx\n")


def test_rewriting_every_section_with_its_own_text_changes_nothing(tmp_path):
    text = (REPO / "docs" / "benchmarks.md").read_text()
    path = tmp_path / "benchmarks.md"
    path.write_text(text)
    for m in re.finditer(r"^## .*?(?=^## |\Z)", text, flags=re.S | re.M):
        docs.write_section(m.group(0), path)
    assert path.read_text() == text


BENCHES = ("execd", "swerex", "minisweagent", "reuse", "netguard", "webhook", "controller",
           "loadtest", "realnode", "trees", "replay", "group", "fork", "warmburst")


def test_each_section_heading_names_its_command_and_percentiles_are_stated():
    text = (REPO / "docs" / "benchmarks.md").read_text()
    headings = re.findall(r"^## .*$", text, re.M)
    for h in headings:
        assert "`python -m bench." in h, f"a section without its command: {h}"
    named = {m for h in headings for m in re.findall(r"python -m bench\.(\w+)", h)}
    assert named == set(BENCHES), named
    assert "linear interpolation between closest ranks" in " ".join(text.split())


def test_make_bench_targets_run_the_benches_with_write_docs():
    make = (REPO / "Makefile").read_text()
    for name in BENCHES:
        recipe = re.search(rf"^bench-{name}:.*\n((?:\t.*\n)+)", make, re.M)
        assert recipe, f"no make bench-{name}"
        assert f"-m bench.{name} --write-docs" in recipe.group(1), recipe.group(1)
