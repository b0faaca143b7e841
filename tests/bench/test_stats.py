"""bench/stats.py: the one percentile definition, and loadtest/report.py's copy of it."""

from __future__ import annotations

import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.stats import percentile, summarize
from loadtest import report


def test_percentile_interpolates_between_closest_ranks():
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(xs, 50) == 3.0
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 100) == 5.0
    assert percentile(xs, 99) == pytest.approx(4.96)
    assert percentile([7.0], 99) == 7.0
    # 64 values: p99 lies between the two largest.
    assert percentile([float(i) for i in range(64)], 99) == pytest.approx(62.37)


@pytest.mark.parametrize("values,q", [([], 50), ([1.0], -1), ([1.0], 101)])
def test_percentile_refuses_bad_input(values, q):
    with pytest.raises(ValueError):
        percentile(values, q)


@given(st.lists(st.floats(-1e6, 1e6), min_size=2, max_size=60))
def test_it_is_statistics_quantiles_inclusive_and_loadtests_copy(xs):
    cuts = statistics.quantiles(xs, n=100, method="inclusive")
    for q in (1, 10, 50, 90, 99):
        assert percentile(xs, q) == pytest.approx(cuts[q - 1], abs=1e-6)
        assert report.pct(xs, q / 100) == pytest.approx(percentile(xs, q), abs=1e-6)
    assert percentile(xs, 50) == pytest.approx(statistics.median(xs), abs=1e-6)


def test_summarize():
    s = summarize([1.0, 2.0, 3.0])
    assert s == {"n": 3, "p50": 2.0, "p90": pytest.approx(2.8), "p99": pytest.approx(2.98),
                 "max": 3.0}
