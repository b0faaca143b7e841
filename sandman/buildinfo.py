"""`sandman_build_info`: which build a process runs, as one gauge set to 1 (the Prometheus
convention for info metrics: join it on `instance` to label other series by version).

`version` is the package's (`sandman._version.__version__`); `revision` is what the image was built
from, baked in by images/Dockerfile as $SANDMAN_REVISION (`--build-arg REVISION=$(git rev-parse
HEAD)`), "unknown" otherwise; `component` is the process. One series per process, so every
label is bounded."""

from __future__ import annotations

import os
import re

from prometheus_client import REGISTRY, CollectorRegistry, Gauge

from sandman._version import __version__

NAME = "sandman_build_info"
ENV_REVISION = "SANDMAN_REVISION"
COMPONENTS = ("controller", "webhook")
# A revision is a commit id or a tag; anything else (a typo'd build arg with spaces, a
# 10 kB string) is not worth a label value.
_REVISION = re.compile(r"[0-9A-Za-z._-]{1,64}")


def revision() -> str:
    value = os.environ.get(ENV_REVISION, "")
    return value if _REVISION.fullmatch(value) else "unknown"


def register(component: str, registry: CollectorRegistry = REGISTRY) -> Gauge:
    if component not in COMPONENTS:
        raise ValueError(f"unknown component {component!r}; one of {', '.join(COMPONENTS)}")
    gauge = Gauge(NAME, "The build this process runs (always 1)",
                  ["version", "revision", "component"], registry=registry)
    gauge.labels(__version__, revision(), component).set(1)
    return gauge
