"""What the components really export, read from their registries (not from a list kept here):
the controller's metrics live in prometheus-client's default registry once controller.metrics
is imported (the controller imports it at start); the webhook's in the registry of a
`webhook.metrics.Metrics`, which its app creates."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import REGISTRY
from prometheus_client.metrics import MetricWrapperBase


@dataclass(frozen=True)
class Exported:
    name: str  # as scraped: counters with _total, histograms without their suffixes
    type: str  # counter | gauge | histogram | summary | info | enum
    labels: tuple[str, ...]
    component: str


def _of(registry, component: str) -> list[Exported]:
    out = []
    # The wrappers of the registry (prometheus-client keeps collector -> names); only the
    # metric objects the code declared, not the client's process/platform/gc collectors.
    for collector in list(registry._collector_to_names):
        if not isinstance(collector, MetricWrapperBase):
            continue
        name, kind = collector._name, collector._type
        if kind == "counter":
            name += "_total"
        elif kind == "info":
            name += "_info"
        out.append(Exported(name, kind, tuple(collector._labelnames), component))
    return out


def exported() -> dict[str, Exported]:
    """Every sandman metric of every component, by scraped name."""
    # What `python3 -m controller|webhook serve` imports, so a metric declared in any module
    # they load is found.
    import controller.__main__  # noqa: F401
    import webhook.__main__  # noqa: F401
    from webhook.metrics import Metrics

    found = _of(REGISTRY, "controller") + _of(Metrics().registry, "webhook")
    out: dict[str, Exported] = {}
    for e in found:
        if not e.name.startswith("sandman_"):
            continue
        prev = out.get(e.name)
        if prev is not None and (prev.type, prev.labels) != (e.type, e.labels):
            raise AssertionError(f"{e.name} differs between components: {prev} vs {e}")
        out[e.name] = e if prev is None else Exported(e.name, e.type, e.labels, "both")
    return out


SUFFIXES = {"histogram": ("_bucket", "_sum", "_count", "_created"),
            "summary": ("_sum", "_count", "_created")}


def series_names(metrics: dict[str, Exported]) -> set[str]:
    """Every sample name a scrape can show for these metrics (what PromQL may name)."""
    out = set()
    for e in metrics.values():
        out.add(e.name)
        for s in SUFFIXES.get(e.type, ()):
            out.add(e.name + s)
        if e.type == "counter":
            out.add(e.name[: -len("_total")] + "_created")
    return out
