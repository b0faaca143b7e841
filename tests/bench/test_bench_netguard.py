"""bench.netguard: one real run in its smallest configuration (netns, root). The section
writer is tests/bench/test_docs.py's."""

from __future__ import annotations

import re

import pytest

from bench import netguard


def _cpu_verdict(out: str) -> bool:
    m = re.search(r"CPU budget <= \d+ ms for netguard's own process: (met|NOT met) "
                  r"\((\d+\.\d) ms worst median; the interpreter alone (\d+\.\d) ms, the floor "
                  r"(\d+\.\d) ms(: the budget is below [^)]*)?\)", out)
    assert m, out
    own, interpreter, floor = float(m.group(2)), float(m.group(3)), float(m.group(4))
    assert own > 0 and interpreter > 0 and floor > 0  # all measured, in the same run
    # The floor note is there exactly when the floor is above the budget.
    assert (m.group(5) is not None) == (floor > netguard.CPU_BUDGET_MS)
    assert (m.group(1) == "met") == (own <= netguard.CPU_BUDGET_MS)
    return m.group(1) == "met"


def _goal_verdict(out: str) -> bool:
    m = re.search(r"apply \+ self-verify \(restore, read-back, probes\): (met|NOT met) "
                  r"\((\d+\.\d) ms worst median\)", out)
    assert m, out
    assert float(m.group(2)) > 0  # measured
    assert (m.group(1) == "met") == (float(m.group(2)) <= netguard.GOAL_MS)
    return m.group(1) == "met"


@pytest.mark.netns
@pytest.mark.timeout(120)
def test_bench_runs_and_reports_its_verdicts(capsys):
    """One run of the real bench: its table, and verdicts that agree with its own figures.
    Whether the goals are met is the bench's business on a quiet machine (make bench-netguard),
    not a unit test's on a loaded one."""
    rc = netguard.main(["--runs", "1", "--backend", "nft"])
    out = capsys.readouterr().out
    assert out.startswith(netguard.SECTION) and "| nft |" in out
    assert rc == (0 if _goal_verdict(out) and _cpu_verdict(out) else 1)


@pytest.mark.netns
@pytest.mark.timeout(120)
def test_smoke(capsys):
    rc = netguard.main(["--smoke"])
    out = capsys.readouterr().out
    assert "| nft |" in out
    assert rc == (0 if _goal_verdict(out) and _cpu_verdict(out) else 1)
