"""netguard.bench: its docs section rewrite, and one real run (netns, root)."""

from __future__ import annotations

import pytest

from netguard import bench


def test_update_docs_rewrites_only_its_own_section(tmp_path, monkeypatch):
    docs = tmp_path / "benchmarks.md"
    monkeypatch.setattr(bench, "DOCS", docs)
    bench.update_docs("## netguard\n\nfirst\n")
    assert docs.read_text() == "# Benchmarks\n\n## netguard\n\nfirst\n"
    docs.write_text("# Benchmarks\n\n## execd\n\nkeep me\n\n## netguard\n\nold\n\n"
                    "## webhook\n\nkeep me too\n")
    bench.update_docs("## netguard\n\nnew\n")
    assert docs.read_text() == ("# Benchmarks\n\n## execd\n\nkeep me\n\n## netguard\n\nnew\n\n"
                                "## webhook\n\nkeep me too\n")


@pytest.mark.netns
@pytest.mark.timeout(120)
def test_bench_runs_and_meets_the_goal(capsys):
    assert bench.main(["--runs", "1", "--backend", "nft"]) == 0
    out = capsys.readouterr().out
    assert "| nft |" in out and "met" in out
