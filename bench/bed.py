"""A bench's cluster: `measure(cluster, workdir, args)` on a kwok test bed started for the run
and stopped after (its state dir is the workdir), or on the cluster `--kubeconfig` names (a
temporary workdir)."""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def run(name: str, nodes: int, measure: Callable[[Any, Path, argparse.Namespace], dict],
        a: argparse.Namespace) -> dict:
    from testbed.cluster import Cluster, Testbed, default_state_dir

    if getattr(a, "kubeconfig", None):
        with tempfile.TemporaryDirectory(prefix=f"sandman-{name}-") as tmp:
            return measure(Cluster.connect(Path(a.kubeconfig)), Path(tmp), a)
    state = default_state_dir(name)
    tb = Testbed(state, nodes=nodes)
    print(f"# starting the test bed in {state}", file=sys.stderr)
    tb.start()
    try:
        return measure(Cluster.connect(tb.kubeconfig, tb), state, a)
    finally:
        tb.stop()
