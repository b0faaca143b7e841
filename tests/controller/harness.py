"""Pod-ownership audit for the controller tests (the controller itself is started by
testbed/controller.py)."""

from __future__ import annotations

import time

import httpx

from sandman import contract


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
