"""Every metric the product's source declares is one the running components export, so the
reference in docs/metrics.md (held to the exported set both ways by test_metrics_reference.py,
and every name a page mentions to the source by tests/test_docs_names.py) misses none: a metric
declared in a module the entry points never import, in netguard or execd (which serve no
/metrics), or without the `sandman_` prefix would be in no scrape and in no table."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.monitoring.exported import exported

ROOT = Path(__file__).resolve().parents[2]
# Every package of the product; netguard and execd declare no metric today, and must not
# start to without a component that serves them.
SOURCES = ("controller", "webhook", "netguard", "execd", "sandman")
KINDS = {"Counter", "Gauge", "Histogram", "Summary", "Info", "Enum"}


def declared(path: Path, base: Path = ROOT) -> tuple[dict[str, str], list[str]]:
    """({name as declared: kind}, calls whose name cannot be read) of one file's
    prometheus-client metrics: calls to the metric classes it imports from prometheus_client
    (`Counter` of collections is not one) or reaches as `prometheus_client.<Kind>`."""
    tree = ast.parse(path.read_text(), str(path))
    local = {a.asname or a.name: a.name for n in ast.walk(tree)
             if isinstance(n, ast.ImportFrom) and n.module == "prometheus_client"
             for a in n.names if a.name in KINDS}
    consts = {n.targets[0].id: n.value.value for n in tree.body
              if isinstance(n, ast.Assign) and len(n.targets) == 1
              and isinstance(n.targets[0], ast.Name)
              and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)}
    found: dict[str, str] = {}
    unread: list[str] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id in local:
            kind = local[f.id]
        elif (isinstance(f, ast.Attribute) and f.attr in KINDS
              and isinstance(f.value, ast.Name) and f.value.id == "prometheus_client"):
            kind = f.attr
        else:
            continue
        arg = node.args[0] if node.args else next(
            (k.value for k in node.keywords if k.arg == "name"), None)
        name = (arg.value if isinstance(arg, ast.Constant) else
                consts.get(arg.id) if isinstance(arg, ast.Name) else None)
        if isinstance(name, str):
            found[name] = kind
        else:
            unread.append(f"{path.relative_to(base)}:{node.lineno}")
    return found, unread


def scraped(name: str, kind: str) -> str:
    """The name exported() files a declared metric under (prometheus-client's suffixes)."""
    if kind == "Counter":
        return name.removesuffix("_total") + "_total"
    return name + "_info" if kind == "Info" else name


def drift(roots: list[Path], exported_names: set[str], base: Path = ROOT) -> list[str]:
    out = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            found, unread = declared(path, base)
            out += [f"{where}: a metric whose name is not a literal" for where in unread]
            where = path.relative_to(base)
            for name, kind in found.items():
                if not name.startswith("sandman_"):
                    out.append(f"{where}: {name} lacks the sandman_ prefix")
                elif scraped(name, kind) not in exported_names:
                    out.append(f"{where}: {name} is declared but no component exports it")
    return out


def test_every_declared_metric_is_exported():
    names = set(exported())
    assert drift([ROOT / s for s in SOURCES], names) == []
    # The scan found the product's metrics (a broken scan finds none and passes).
    found = {n for s in SOURCES for p in (ROOT / s).rglob("*.py") for n in declared(p)[0]}
    assert {"sandman_controller_acquires_total", "sandman_webhook_requests",
            "sandman_controller_queued_acquires", "sandman_controller_limit"} <= found


def test_the_check_catches_a_metric_no_component_exports(tmp_path):
    """A netguard-like package declaring a metric of its own, one without the prefix, one
    whose name is computed, and a collections.Counter that is no metric."""
    bogus = tmp_path / "guard.py"
    bogus.write_text(
        "import collections\n"
        "import prometheus_client\n"
        "from prometheus_client import Gauge as G\n"
        "NAME = 'sandman_netguard_rules_applied'\n"
        "A = prometheus_client.Counter(NAME, 'rules applied')\n"
        "B = G('netguard_up', 'no prefix')\n"
        "C = G('sandman_' + 'x', 'computed')\n"
        "D = collections.Counter('abc')\n")
    got = drift([tmp_path], set(exported()), base=tmp_path)
    assert got == [
        "guard.py:7: a metric whose name is not a literal",
        "guard.py: sandman_netguard_rules_applied is declared but no component exports it",
        "guard.py: netguard_up lacks the sandman_ prefix"], got
