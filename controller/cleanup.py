"""`python3 -m controller.cleanup`: what the controller made at run time, removed at uninstall.

The chart runs this as its post-delete hook Job (templates/cleanup-job.yaml), after Helm has
deleted the release's own objects. Helm never knew about these, so without it an uninstall
left them behind:
- the sandbox pods the controller created (label `app.kubernetes.io/managed-by=
  sandman-controller`, sandman/contract.py) and its per-job owner ConfigMaps (same label), in
  the sandbox namespace;
- the image pre-pull's puller pods (label `sandman.dev/prepull`), in the sandbox namespace;
- the controller's leader Lease (by name) in the sandbox namespace;
- the `helm test` pod (by name) in the release namespace: its hook policy keeps it until the
  next `helm test` so a failed run's logs can be read.

Order matters: the release's controller pods must be gone first (Helm deleted their
Deployment; they may still be shutting down), or a leader would renew the Lease and refill a
warm pool behind us. Every wait is bounded by `--timeout`; exit 0 only when nothing is left,
else exit 1 with one line saying what remains (the hook then fails, and Helm keeps its Job for
`kubectl logs`). Pods other clients labelled as sandboxes, without the controller's label, are
never touched.
"""

from __future__ import annotations

import argparse
import sys
import time

from kubernetes import client, config
from kubernetes.client.rest import ApiException

from sandman.contract import LABEL_MANAGED_BY, LABEL_PREPULL, MANAGED_BY_CONTROLLER

MANAGED = f"{LABEL_MANAGED_BY}={MANAGED_BY_CONTROLLER}"
PULLERS = LABEL_PREPULL  # every pod carrying the label (controller/prepull.py)
POLL = 1.0


class CleanupError(RuntimeError):
    """What is left, in one line."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python3 -m controller.cleanup", description=__doc__.split(
        "\n")[0])
    ap.add_argument("--namespace", required=True, help="the sandbox namespace")
    ap.add_argument("--lease-name", required=True, help="the controller's leader Lease")
    ap.add_argument("--release-namespace", required=True)
    ap.add_argument("--controller-selector", required=True,
                    help="label selector of the release's controller pods (waited out first)")
    ap.add_argument("--test-pod", default="", help="the helm test pod's name ('' for none)")
    ap.add_argument("--timeout", type=float, default=150.0,
                    help="seconds for the whole cleanup, every wait included")
    ap.add_argument("--kubeconfig", default=None, help="default: in-cluster config")
    return ap.parse_args(argv)


def _gone(call, *args) -> bool:
    """Run a delete; a 404 means it was already gone."""
    try:
        call(*args)
        return False
    except ApiException as e:
        if e.status == 404:
            return True
        raise


class Cleanup:
    def __init__(self, core: client.CoreV1Api, coord: client.CoordinationV1Api,
                 args: argparse.Namespace) -> None:
        self.core, self.coord, self.a = core, coord, args
        self.deadline = time.monotonic() + args.timeout

    def _wait(self, what: str, left) -> None:
        remaining = left()
        while remaining and time.monotonic() < self.deadline:
            time.sleep(POLL)
            remaining = left()
        if remaining:
            raise CleanupError(f"{what} still there after {self.a.timeout:.0f}s: "
                               f"{', '.join(remaining[:10])}")

    def _pods(self, ns: str, selector: str) -> list[str]:
        return [p.metadata.name for p in
                self.core.list_namespaced_pod(ns, label_selector=selector).items
                if p.metadata is not None and p.metadata.name]  # a stored pod has both

    def _test_pod(self) -> list[str]:
        if not self.a.test_pod:
            return []
        try:
            self.core.read_namespaced_pod(self.a.test_pod, self.a.release_namespace)
        except ApiException as e:
            if e.status == 404:
                return []
            raise
        return [f"{self.a.release_namespace}/{self.a.test_pod}"]

    def run(self) -> dict[str, int]:
        ns, rns = self.a.namespace, self.a.release_namespace
        # 1. Nothing may recreate what follows: the release's controllers are gone.
        self._wait("controller pods", lambda: self._pods(rns, self.a.controller_selector))
        done = {"pods": 0, "pullers": 0, "configmaps": 0, "lease": 0, "test pod": 0}
        # 2. Delete, one call per kind however many there are (a pool can hold thousands).
        # The ConfigMaps own their job's pods (the GC would remove those too); the pods are
        # deleted directly as well, so no owner-less or caller-owned one stays.
        done["pods"] = len(self._pods(ns, MANAGED))
        if done["pods"]:
            self.core.delete_collection_namespaced_pod(ns, label_selector=MANAGED)
        done["pullers"] = len(self._pods(ns, PULLERS))
        if done["pullers"]:
            self.core.delete_collection_namespaced_pod(ns, label_selector=PULLERS)
        done["configmaps"] = len(self.core.list_namespaced_config_map(
            ns, label_selector=MANAGED).items)
        if done["configmaps"]:
            self.core.delete_collection_namespaced_config_map(ns, label_selector=MANAGED)
        done["lease"] += not _gone(self.coord.delete_namespaced_lease, self.a.lease_name, ns)
        if self.a.test_pod:
            done["test pod"] += not _gone(self.core.delete_namespaced_pod, self.a.test_pod, rns)
        # 3. Bounded wait until the pods have really gone (their grace periods).
        self._wait("pods", lambda: [f"{ns}/{n}" for n in self._pods(ns, MANAGED)]
                   + [f"{ns}/{n}" for n in self._pods(ns, PULLERS)] + self._test_pod())
        return done


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    try:
        if args.kubeconfig:
            config.load_kube_config(config_file=args.kubeconfig)
        else:
            config.load_incluster_config()
        api = client.ApiClient()
        done = Cleanup(client.CoreV1Api(api), client.CoordinationV1Api(api), args).run()
    except (CleanupError, ApiException, config.ConfigException, OSError) as e:
        msg = (f"API {e.status} {e.reason}: {(e.body or '')[:300]}"
               if isinstance(e, ApiException) else str(e))
        print("controller.cleanup: " + " | ".join(msg.splitlines()), file=sys.stderr)
        return 1
    print(f"controller.cleanup: deleted {', '.join(f'{v} {k}' for k, v in done.items())} "
          f"in {args.namespace}/{args.release_namespace}; nothing left "
          f"({time.monotonic() - t0:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
