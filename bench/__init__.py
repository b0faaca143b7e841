"""Benchmarks of sandman, one module per bench, each run as `python -m bench.<name>`.

Every bench takes `--write-docs` (replace its own section of docs/benchmarks.md, through
bench/docs.py) and `--smoke` (its smallest configuration, nothing written: what
tests/bench/ runs so no bench rots). Percentiles come from bench/stats.py only. Product
packages never import this package (tests/test_layout.py); neither the wheel nor the image
ships it.
"""
