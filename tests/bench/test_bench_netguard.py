"""bench.netguard: one real run in its smallest configuration (netns, root). The section
writer is tests/bench/test_docs.py's."""

from __future__ import annotations

import pytest

from bench import netguard


@pytest.mark.netns
@pytest.mark.timeout(120)
def test_bench_runs_and_meets_the_goal(capsys):
    assert netguard.main(["--runs", "1", "--backend", "nft"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(netguard.SECTION) and "| nft |" in out and "met" in out


@pytest.mark.netns
@pytest.mark.timeout(120)
def test_smoke(capsys):
    assert netguard.main(["--smoke"]) == 0
    assert "| nft |" in capsys.readouterr().out
