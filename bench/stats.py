"""The benches' statistics: one percentile definition for every figure in docs/benchmarks.md.

`percentile(values, q)` is linear interpolation between closest ranks: the values sorted as
x[0] <= ... <= x[n-1], position h = (n - 1) * q / 100, result x[floor(h)] + (h - floor(h)) *
(x[floor(h) + 1] - x[floor(h)]). It is numpy's default (`method="linear"`) and
`statistics.quantiles(method="inclusive")`; p0 is the minimum, p100 the maximum, p50 the
median, and with 64 values p99 lies between the two largest.
"""

from __future__ import annotations

import math
import statistics


def percentile(values, q: float) -> float:
    """The q-th percentile (q in [0, 100]) of `values`, as defined in the module docstring."""
    xs = sorted(values)
    if not xs:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside 0..100")
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def percentile_or_nan(values, q: float) -> float:
    """percentile(), or NaN for no values (a bench step where nothing succeeded)."""
    return percentile(values, q) if len(values) else float("nan")


def summarize(values) -> dict:
    """n, p50, p90, p99 and max of `values` (in their unit)."""
    return {"n": len(values), "p50": percentile(values, 50), "p90": percentile(values, 90),
            "p99": percentile(values, 99), "max": max(values)}


def median(values) -> float:
    """The median (== percentile(values, 50)); NaN for no values."""
    return statistics.median(values) if len(values) else float("nan")
