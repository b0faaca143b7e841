"""Pod-ownership audit for the controller tests (the controller itself is started by
testbed/controller.py), and the stand-in stack several of them drive."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from sandman import contract


@contextlib.contextmanager
def standin_stack(cluster, namespace: str, tmp_path: Path, lease: str,
                  *args: str, private_dirs: tuple[str, ...] = (),
                  own_home: bool = False) -> Iterator[tuple]:
    """(controller, stand-in): kwok pods with a real execd behind each (testbed/standin.py)
    and the real controller with its default readiness check (Ready AND execd /ready from the
    pod IP); both stopped on the way out, whatever happened. `private_dirs`, `own_home`: the
    stand-in's (each pod's own /NAME, root only; each execd's $HOME its pod's directory)."""
    from testbed.controller import ControllerProc
    from testbed.standin import Standin

    standin = Standin(cluster.core, namespace, tmp_path / "standin",
                      private_dirs=private_dirs, own_home=own_home).start()
    ctl = ControllerProc(namespace, cluster.kubeconfig, tmp_path / "controller.log",
                         ["--lease-name", f"{lease}-{namespace}", *args], ready_check="execd")
    try:
        ctl.start()
        yield ctl, standin
    finally:
        ctl.kill()
        standin.stop()


def pods(core, ns: str) -> list:
    return core.list_namespaced_pod(ns).items


def unowned(core, ns: str, ctl_url: str, handed: set[str], settle: float = 15.0) -> list[str]:
    """Pods nothing owns, after up to `settle` s for transient states to finish.

    Owned: leased and handed to a caller (`handed`), warm in the controller's books, or being
    deleted (deletionTimestamp or the deleting label)."""
    deadline = time.monotonic() + settle
    bad: list[str] = []
    while True:
        warm = set()
        try:
            items = httpx.get(ctl_url + "/v1/sandboxes", timeout=5).json()["items"]
            warm = {i["id"] for i in items if i["state"] in ("warm", "checking")}
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        bad = []
        for p in pods(core, ns):
            labels = p.metadata.labels or {}
            if labels.get(contract.LABEL_MANAGED_BY) != contract.MANAGED_BY_CONTROLLER:
                continue  # another tenant's pod: not ours to own
            if p.metadata.deletion_timestamp or labels.get(contract.LABEL_STATE) == \
                    contract.STATE_DELETING:
                continue
            if p.metadata.name in handed and labels.get(contract.LABEL_STATE) == \
                    contract.STATE_LEASED:
                continue
            if p.metadata.name in warm:
                continue
            bad.append(p.metadata.name)
        if not bad or time.monotonic() > deadline:
            return bad
        time.sleep(0.25)
