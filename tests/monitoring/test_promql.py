"""The PromQL name extraction used to check the dashboard and the alert rules."""

from __future__ import annotations

import pytest

from tests.monitoring.promql import PromQLError, metric_names


@pytest.mark.parametrize("expr, names", [
    ('sum by (result) (rate(sandman_controller_acquires_total{namespace="$namespace"}'
     '[$__rate_interval]))', {"sandman_controller_acquires_total"}),
    ("histogram_quantile(0.99, sum without (instance) (rate(x_bucket{le!=\"+Inf\"}[5m])))",
     {"x_bucket"}),
    ("a / on (job) group_left (version) b > bool 1 unless c offset 5m", {"a", "b", "c"}),
    ("(sum(sandman_controller_leader) or vector(0)) < 1", {"sandman_controller_leader"}),
    ("min(expiry) - time() < 14 * 86400", {"expiry"}),
    ('max_over_time(sum(q{a=~"x|y", by="on"})[10m:1m]) > 2e3', {"q"}),
    ('{__name__="only_by_name", job="x"}', {"only_by_name"}),
    ("topk(5, sum by (reason) (increase(r_total[1h])))", {"r_total"}),
    ("a:recording:rule # a comment naming fake_metric\n+ 1", {"a:recording:rule"}),
    ("count(m) by (pod)", {"m"}),
    ("quantile(0.5, m @ end())", {"m"}),
])
def test_metric_names(expr, names):
    assert metric_names(expr) == names


def test_name_regex_is_refused():
    with pytest.raises(PromQLError, match="cannot be checked"):
        metric_names('{__name__=~"sandman_.*"}')


def test_unbalanced_is_refused():
    with pytest.raises(PromQLError, match="unbalanced"):
        metric_names("sum(rate(x[5m])")
