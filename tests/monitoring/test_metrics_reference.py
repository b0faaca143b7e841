"""docs/metrics.md lists exactly the metrics the components export: names, types, labels, and
every value of every label (the code's allow-lists)."""

from __future__ import annotations

import enum
import importlib
import re
from pathlib import Path

import pytest
from prometheus_client import REGISTRY, generate_latest

from tests.monitoring.exported import exported

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "metrics.md"


def _code_values(metric: str, label: str) -> tuple[str, ...] | None:
    """The allow-list the code applies to a label (None: one value per process)."""
    from controller import metrics as c
    from sandman import buildinfo, contract
    from webhook import metrics as w

    states = tuple(c.STATES) + ("other",)
    table = {
        ("sandman_build_info", "component"): buildinfo.COMPONENTS,
        ("sandman_build_info", "version"): None,
        ("sandman_build_info", "revision"): None,
        ("sandman_controller_acquires_total", "result"): c.ACQUIRE_RESULTS + ("other",),
        ("sandman_controller_acquires_total", "warm"): c.WARM,
        ("sandman_controller_acquire_seconds", "warm"): c.WARM,
        ("sandman_controller_creates_total", "result"): c.CREATE_RESULTS + ("other",),
        ("sandman_controller_deletes_total", "result"): c.DELETE_RESULTS + ("other",),
        ("sandman_controller_renews_total", "result"): c.RENEW_RESULTS + ("other",),
        ("sandman_controller_expired_total", "renewed"): c.WARM,
        ("sandman_controller_illegal_transitions_total", "from_state"): states,
        ("sandman_controller_illegal_transitions_total", "to_state"): states,
        ("sandman_controller_limit", "limit"): c.LIMITS,
        ("sandman_controller_retirements_total", "reason"): c.RETIRE_REASONS + ("other",),
        ("sandman_shadow_grading_total", "outcome"): contract.SHADOW_OUTCOMES + ("other",),
        ("sandman_controller_forks_total", "result"): c.FORK_RESULTS + ("other",),
        ("sandman_controller_groups_total", "result"): c.GROUP_RESULTS + ("other",),
        ("sandman_controller_checkpoints_total", "result"): c.CHECKPOINT_RESULTS + ("other",),
        ("sandman_controller_restores_total", "result"): c.RESTORE_RESULTS + ("other",),
        ("sandman_controller_idle_pauses_total", "result"): c.IDLE_PAUSE_RESULTS + ("other",),
        ("sandman_controller_restore_phase_seconds", "phase"): c.RESTORE_PHASES,
        ("sandman_controller_group_sandboxes_total", "warm"): ("true", "false"),
        ("sandman_controller_conditions_refused_total", "field"): c.CONDITION_LABELS + ("other",),
        ("sandman_controller_foreign_pods_total", "reason"): c.FOREIGN_REASONS,
        ("sandman_controller_leases_lost_total", "reason"): c.LOST_REASONS + ("other",),
        ("sandman_controller_queue_depth_by_role", "role"): contract.ROLES,
        ("sandman_controller_queued_acquires", "role"): contract.ROLES,
        ("sandman_controller_warm_lookups_total", "role"): contract.ROLES + ("other",),
        ("sandman_controller_warm_lookups_total", "result"): c.WARM_RESULTS,
        ("sandman_controller_warm_budget_use", "resource"): c.BUDGET_RESOURCES,
        ("sandman_controller_warm_budget", "resource"): c.BUDGET_RESOURCES,
        ("sandman_controller_create_to_ready_seconds", "role"): contract.ROLES,
        ("sandman_controller_pod_address_failures_total", "scope"): c.FAILURE_SCOPES,
        ("sandman_controller_images_prepulled_total", "result"): c.PREPULL_RESULTS,
        ("sandman_controller_http_requests_total", "route"): c.ROUTE_TEMPLATES,
        ("sandman_controller_http_requests_total", "method"): c.METHODS + ("other",),
        ("sandman_controller_http_requests_total", "code"): c.CODES,
        ("sandman_controller_http_request_duration_seconds", "route"): c.ROUTE_TEMPLATES,
        ("sandman_controller_http_request_duration_seconds", "method"): c.METHODS + ("other",),
        ("sandman_webhook_requests_total", "operation"): w.OPERATIONS + ("other",),
        ("sandman_webhook_requests_total", "decision"): w.DECISIONS + ("other",),
        ("sandman_webhook_requests_total", "reason"): w.REASONS + ("other",),
        ("sandman_webhook_handler_seconds", "operation"): w.OPERATIONS,
        ("sandman_webhook_certificate_reloads_total", "result"): ("loaded", "failed"),
    }
    if (metric, label) not in table:
        pytest.fail(f"{metric}{{{label}}}: no allow-list known to this test; add it here "
                    "(and bound the label in the code)", pytrace=False)
    return table[(metric, label)]


def _resolve(token: str) -> list[str]:
    """`sandman.podspec.RULES` -> the tuple's entries; `controller.books.State` -> its names."""
    if "." not in token:
        return [token]
    module, _, attr = token.rpartition(".")
    value = getattr(importlib.import_module(module), attr)
    if isinstance(value, type) and issubclass(value, enum.Enum):
        return [m.name for m in value]
    return list(value)


def documented() -> dict[str, dict]:
    """Rows of the reference tables: name -> {type, labels: {label: [values] | None}}."""
    rows: dict[str, dict] = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"\| `(sandman_[a-z0-9_]+)` \| (\w+) \|([^|]*)\|", line)
        if not m:
            continue
        name, kind, cell = m.group(1), m.group(2), m.group(3).strip()
        assert name not in rows, f"{name} listed twice"
        labels: dict[str, list[str] | None] = {}
        for part in filter(None, (p.strip() for p in cell.split(";"))):
            lm = re.match(r"`([a-z_]+)`: (.*)", part)
            assert lm, f"{name}: cannot read label cell {part!r}"
            label, rest = lm.groups()
            if rest.startswith("one per process"):
                labels[label] = None
            else:
                tokens = re.findall(r"`([^`]+)`", rest)
                assert tokens and re.fullmatch(r"(`[^`]+`(, )?)+", rest.strip()), (
                    f"{name}{{{label}}}: values must be a list of `value`s: {rest!r}")
                labels[label] = [v for t in tokens for v in _resolve(t)]
        rows[name] = {"type": kind, "labels": labels}
    return rows


def test_reference_lists_exactly_the_exported_metrics():
    code = exported()
    doc = documented()
    assert len(code) >= 20 and len(doc) >= 20  # the collection and the parse found something
    assert sorted(set(code) - set(doc)) == [], "exported but not in docs/metrics.md"
    assert sorted(set(doc) - set(code)) == [], "in docs/metrics.md but not exported"
    for name, e in code.items():
        row = doc[name]
        assert row["type"] == e.type, f"{name}: documented {row['type']}, exported {e.type}"
        assert sorted(row["labels"]) == sorted(e.labels), f"{name}: labels"
        for label in e.labels:
            want = _code_values(name, label)
            got = row["labels"][label]
            if want is None:
                assert got is None, f"{name}{{{label}}}: documented as a list, code has none"
            else:
                assert got is not None and sorted(got) == sorted(want), (
                    f"{name}{{{label}}}: documented {got}, code allows {list(want)}")


# Units Prometheus' conventions reject (not base units) and words that, as a label's values,
# say the label splits one metric into different quantities.
NOT_BASE_UNITS = ("_ms", "_milliseconds", "_minutes", "_hours", "_days", "_kb", "_kib", "_mb",
                  "_mib", "_gb", "_percent")
QUANTITY_WORDS = {"pods", "cpu", "cores", "memory", "bytes", "seconds", "rate", "burst"}


def naming_faults(e) -> list[str]:
    """What in one exported metric breaks Prometheus' naming rules."""
    faults = []
    if (e.type == "counter") != e.name.endswith("_total"):
        faults.append("a counter ends in _total, and only a counter")
    if e.type == "histogram" and not e.name.endswith(("_seconds", "_bytes")):
        faults.append("a histogram names its base unit")
    if any(e.name.endswith(u) or f"{u}_" in e.name for u in NOT_BASE_UNITS):
        faults.append("not a base unit")
    if "_by_" in e.name:
        faults.append("a label in the name")
    for label in e.labels:
        if e.name.removesuffix("_total").endswith("_" + label):
            faults.append(f"label {label} repeats the name")
        values = _code_values(e.name, label) or ()
        if QUANTITY_WORDS & set(values):
            faults.append(f"label {label} mixes quantities: {sorted(values)}")
    return faults


def test_names_follow_prometheus_naming_rules():
    """Every name but the deprecated ones; the deprecated ones are what the rules catch."""
    from controller.metrics import DEPRECATED

    code = exported()
    bad = {n: naming_faults(e) for n, e in code.items() if n not in DEPRECATED}
    assert {n: f for n, f in bad.items() if f} == {}
    # Two faults no rule here can see: a rate without its unit (no rule tells it from a count
    # of things), and a total kept beside the per-role series it is the sum of.
    unseen = {"sandman_controller_create_rate", "sandman_controller_queue_depth"}
    for old in set(DEPRECATED) - unseen:
        assert naming_faults(code[old]), old


# Each series of a deprecated name and the series of its replacement that must read the same
# (labels None: the sum of every series of that name).
ALIASES = [
    ("sandman_controller_limit", {"limit": "rate"},
     "sandman_controller_max_create_rate_per_second", {}),
    ("sandman_controller_limit", {"limit": "burst"}, "sandman_controller_max_create_burst", {}),
    ("sandman_controller_limit", {"limit": "max_creating"},
     "sandman_controller_max_creating_pods", {}),
    ("sandman_controller_limit", {"limit": "max_live"}, "sandman_controller_max_live_pods", {}),
    ("sandman_controller_create_rate", {}, "sandman_controller_create_rate_per_second", {}),
    ("sandman_controller_warm_budget_use", {"resource": "pods"},
     "sandman_controller_warm_budget_used_pods", {}),
    ("sandman_controller_warm_budget_use", {"resource": "cpu"},
     "sandman_controller_warm_budget_used_cpu_cores", {}),
    ("sandman_controller_warm_budget", {"resource": "pods"},
     "sandman_controller_warm_budget_pods", {}),
    ("sandman_controller_warm_budget", {"resource": "cpu"},
     "sandman_controller_warm_budget_cpu_cores", {}),
    ("sandman_controller_queue_depth_by_role", {"role": "agent"},
     "sandman_controller_queued_acquires", {"role": "agent"}),
    ("sandman_controller_queue_depth_by_role", {"role": "grading"},
     "sandman_controller_queued_acquires", {"role": "grading"}),
    ("sandman_controller_queue_depth", {}, "sandman_controller_queued_acquires", None),
]


def alias_readings(samples: dict[tuple[str, frozenset], float]) -> list[tuple]:
    """(old series, its value, its replacement's value) for every row of ALIASES, out of one
    scrape's samples ((name, labels) -> value); an old series the table misses reads against
    nothing, so a label value added to an old name without its new series fails too."""
    def series(name: str, labels: dict[str, str] | None) -> float | None:
        if labels is None:
            got = [v for (n, _), v in samples.items() if n == name]
            return sum(got) if got else None
        return samples.get((name, frozenset(labels.items())))

    from controller.metrics import DEPRECATED

    out = [((old, old_labels), series(old, old_labels), series(new, new_labels))
           for old, old_labels, new, new_labels in ALIASES]
    known = {(old, frozenset(labels.items())) for old, labels, _, _ in ALIASES}
    out += [((n, dict(labels)), v, None) for (n, labels), v in samples.items()
            if n in DEPRECATED and (n, labels) not in known]
    return out


def test_deprecated_names_carry_their_replacements_values():
    """Each old name is still exported, says it is deprecated and what replaces it, and reads
    what its replacements read."""
    from controller import metrics as c
    from controller.pacer import Limits

    c.pacing(Limits(rate=3.5, burst=11, max_creating=13, max_live=17), 2.5)
    c.warm_budget(4, 10, 6.0, 20.0)
    c.queued({"agent": 3, "grading": 2})
    samples = {(s.name, frozenset(s.labels.items())): s.value
               for fam in REGISTRY.collect() for s in fam.samples}
    readings = alias_readings(samples)
    assert [(old, a) for old, a, _ in readings] == [(old, b) for old, _, b in readings]
    assert {n for (n, _), _, _ in readings} == set(c.DEPRECATED)
    assert samples[("sandman_controller_queue_depth", frozenset())] == 5
    assert samples[("sandman_controller_limit", frozenset({("limit", "max_live")}))] == 17
    # The check sees a value set on one name only.
    c.MAX_LIVE.set(18)
    try:
        samples[("sandman_controller_max_live_pods", frozenset())] = 18
        assert any(a != b for _, a, b in alias_readings(samples))
    finally:
        c.MAX_LIVE.set(17)
    code, doc = exported(), DOC.read_text()
    helps = {m.name: m.documentation for m in REGISTRY.collect()}
    for old, new_names in c.DEPRECATED.items():
        assert old in code and all(n in code and n not in c.DEPRECATED for n in new_names)
        assert helps[old].startswith("Deprecated") and all(n in helps[old] for n in new_names)
        assert {new for o, _, new, _ in ALIASES if o == old} == set(new_names), old
        row = next(ln for ln in doc.splitlines() if ln.startswith(f"| `{old}` |"))
        assert "deprecated: " in row and all(n in row for n in new_names), row


def test_scrape_names_agree_with_the_collection():
    """The public scrape output names the same metrics (no private-attribute surprise)."""
    import webhook.metrics

    text = generate_latest(REGISTRY).decode() + generate_latest(
        webhook.metrics.Metrics().registry).decode()
    scraped = {m.group(1): m.group(2) for m in re.finditer(
        r"^# TYPE (sandman_\S+) (\w+)$", text, re.M) if not m.group(1).endswith("_created")}
    assert scraped == {n: e.type for n, e in exported().items()}


def test_build_info_is_one_series_per_component(monkeypatch):
    from prometheus_client import CollectorRegistry

    from sandman import buildinfo
    from sandman._version import __version__

    monkeypatch.setenv(buildinfo.ENV_REVISION, "0123abc")
    reg = CollectorRegistry()
    buildinfo.register("webhook", reg)
    assert reg.get_sample_value(buildinfo.NAME, {
        "version": __version__, "revision": "0123abc", "component": "webhook"}) == 1
    # A revision that is not a commit id or tag is not worth a label value.
    monkeypatch.setenv(buildinfo.ENV_REVISION, "x" * 65)
    assert buildinfo.revision() == "unknown"
    monkeypatch.setenv(buildinfo.ENV_REVISION, "a b")
    assert buildinfo.revision() == "unknown"
    with pytest.raises(ValueError, match="unknown component"):
        buildinfo.register("execd", CollectorRegistry())
    # The controller's registry carries its one series.
    import controller.metrics  # noqa: F401

    samples = [s for fam in REGISTRY.collect() if fam.name == buildinfo.NAME
               for s in fam.samples]
    assert [(s.labels["component"], s.labels["version"], s.value) for s in samples] == [
        ("controller", __version__, 1.0)]


@pytest.mark.testbed
def test_running_controller_exports_build_info_and_its_pacing(cluster, namespace, tmp_path):
    """A controller process on the test bed: /metrics (no token) has its build series and the
    pacing and warm budget it was started with, set by its maintenance tick once it leads,
    under the new names and, with the same values, under the deprecated ones."""
    import time

    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from testbed.controller import start_controller

    ctl = start_controller(namespace, str(cluster.kubeconfig), tmp_path / "controller.log",
                           ["--lease-name", f"m-{namespace}", "--rate", "7", "--burst", "9",
                            "--max-creating", "13", "--max-live", "17",
                            "--warm-budget-pods", "5", "--warm-budget-cpu", "2.5",
                            "--log-level", "WARNING"], "pod")
    try:
        deadline = time.monotonic() + 30
        while True:
            text = httpx.get(f"{ctl.url}/metrics", timeout=5).text
            if ("sandman_controller_max_create_rate_per_second 7.0" in text
                    and "sandman_controller_warm_budget_pods 5.0" in text) or (
                    time.monotonic() > deadline):
                break
            time.sleep(0.5)
    finally:
        ctl.stop()
    lines = set(text.splitlines())
    for line in ("sandman_controller_max_create_rate_per_second 7.0",
                 "sandman_controller_max_create_burst 9.0",
                 "sandman_controller_max_creating_pods 13.0",
                 "sandman_controller_max_live_pods 17.0",
                 "sandman_controller_create_rate_per_second 7.0",
                 "sandman_controller_warm_budget_pods 5.0",
                 "sandman_controller_warm_budget_cpu_cores 2.5",
                 'sandman_controller_queued_acquires{role="agent"} 0.0',
                 "sandman_controller_leader 1.0"):
        assert line in lines, line
    # The deprecated names, for one more release: every series of each reads what its
    # replacement reads in the same scrape.
    samples = {(s.name, frozenset(s.labels.items())): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    readings = alias_readings(samples)
    assert [(old, a) for old, a, _ in readings] == [(old, b) for old, _, b in readings]
    assert None not in {a for _, a, _ in readings}
    assert 'sandman_controller_limit{limit="max_live"} 17.0' in lines
    from sandman import buildinfo
    from sandman._version import __version__

    assert [ln for ln in lines if ln.startswith("sandman_build_info{")] == [
        f'sandman_build_info{{component="controller",revision="{buildinfo.revision()}",'
        f'version="{__version__}"}} 1.0']  # the process inherits this environment
