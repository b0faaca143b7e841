"""The chart's alert rules under `promtool test rules` (testdata/alerts.test.yaml): each alert
fires on the series it watches, with the labels and annotations an operator gets, and stays
silent on a healthy one. The rules are the PrometheusRule of the golden render with monitoring
on (tests/charts/test_chart.py keeps it equal to `helm template`), so no helm is needed.

promtool is Debian's `prometheus` package (tools/sysdeps.py, `make deps`)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.monitoring.exported import exported

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "charts" / "testdata" / "monitoring.golden.yaml"
UNIT_TESTS = Path(__file__).parent / "testdata" / "alerts.test.yaml"
ABSENT = "SandmanWebhookMetricsAbsent"


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is missing: install Debian's prometheus package (make deps)",
                    pytrace=False)
    return path


def rule_groups() -> list[dict]:
    rules = [d for d in yaml.safe_load_all(GOLDEN.read_text())
             if d and d["kind"] == "PrometheusRule"]
    assert len(rules) == 1, f"{GOLDEN.name} renders {len(rules)} PrometheusRules"
    return rules[0]["spec"]["groups"]


def alerts(groups: list[dict]) -> dict[str, dict]:
    return {r["alert"]: r for g in groups for r in g["rules"]}


def run_tests(promtool: str, groups: list[dict], where: Path) -> subprocess.CompletedProcess:
    """promtool test rules on the given groups, written as rules.yaml next to the tests."""
    where.mkdir(parents=True, exist_ok=True)
    (where / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    shutil.copy(UNIT_TESTS, where / UNIT_TESTS.name)
    return subprocess.run([promtool, "test", "rules", UNIT_TESTS.name], cwd=where,
                          capture_output=True, text=True, timeout=120)


def test_rules_pass_promtool_check(promtool, tmp_path):
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule_groups()}, sort_keys=False))
    res = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.slow
def test_alert_unit_tests(promtool, tmp_path):
    res = run_tests(promtool, rule_groups(), tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr


def _cases() -> list[tuple[set[str], dict]]:
    """(metric names of the input series, alert_rule_test entry) of every unit test."""
    out = []
    for t in yaml.safe_load(UNIT_TESTS.read_text())["tests"]:
        names = {re.match(r"[a-zA-Z_:][\w:]*", s["series"]).group(0) for s in t["input_series"]}
        out += [(names, case) for case in t["alert_rule_test"]]
    return out


def test_every_alert_is_tested_firing_and_silent():
    cases = _cases()
    for name in alerts(rule_groups()):
        runs = [c for _, c in cases if c["alertname"] == name]
        assert any(c.get("exp_alerts") for c in runs), f"no test where {name} fires"
        assert any(not c.get("exp_alerts") for c in runs), f"no test where {name} is silent"


def test_an_unscraped_webhook_alerts():
    """Every webhook alert reads the webhook's own series, so none fires while no replica is
    scraped: the unit tests hold one where no webhook series exists, every webhook alert is
    silent there and SandmanWebhookMetricsAbsent fires. Its series is one each replica exports
    from its start (no labels to wait for), so an idle webhook never looks absent."""
    webhook = {r["alert"] for g in rule_groups() if g["name"] == "sandman-webhook"
               for r in g["rules"]}
    unscraped = [c for names, c in _cases()
                 if not any(n.startswith("sandman_webhook_") for n in names)]
    assert {c["alertname"] for c in unscraped if not c.get("exp_alerts")} >= webhook - {ABSENT}
    assert any(c["alertname"] == ABSENT and c.get("exp_alerts") for c in unscraped)

    absent = re.fullmatch(r"absent\((\w+)\{[^}]*\}\)", alerts(rule_groups())[ABSENT]["expr"])
    assert absent, alerts(rule_groups())[ABSENT]["expr"]
    metric = exported()[absent.group(1)]
    assert (metric.component, metric.type, metric.labels) == ("webhook", "gauge", ())


@pytest.mark.slow
def test_the_unit_tests_catch_a_missing_or_broken_alert(promtool, tmp_path):
    """The same unit tests fail without the absent() alert, and with an Errors threshold of
    50% instead of 1%."""
    groups = rule_groups()
    for g in groups:
        g["rules"] = [r for r in g["rules"] if r["alert"] != ABSENT]
    res = run_tests(promtool, groups, tmp_path / "no-absent")
    assert res.returncode != 0 and f"alertname: {ABSENT}," in res.stderr, res.stderr

    groups = rule_groups()
    errors = alerts(groups)["SandmanWebhookErrors"]
    errors["expr"] = errors["expr"].replace("> 0.01", "> 0.5")
    res = run_tests(promtool, groups, tmp_path / "threshold")
    assert res.returncode != 0 and "alertname: SandmanWebhookErrors," in res.stderr, res.stderr
