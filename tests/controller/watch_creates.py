"""`python -m tests.controller.watch_creates KUBECONFIG NAMESPACE SECONDS`: print
`<pod name> <CLOCK_MONOTONIC seconds>` when each pod of the namespace first appears (ADDED).

A separate process, so a busy test process (600 concurrent requests) cannot delay the watch
and bunch the observed creates."""

import json
import sys
import time

from kubernetes import client, config
from kubernetes.watch.watch import iter_resp_lines


def main() -> None:
    kubeconfig, ns, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    cfg = client.Configuration()
    config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    core = client.CoreV1Api(client.ApiClient(cfg))
    seen = set()
    deadline = time.monotonic() + seconds
    print("ready", time.monotonic(), flush=True)
    rv = core.list_namespaced_pod(ns).metadata.resource_version
    while time.monotonic() < deadline:
        resp = core.list_namespaced_pod(ns, watch=True, resource_version=rv, timeout_seconds=5,
                                        _preload_content=False)
        for line in iter_resp_lines(resp):
            ev = json.loads(line)
            meta = ev["object"]["metadata"]
            rv = meta.get("resourceVersion", rv)
            if ev["type"] == "ADDED" and meta["name"] not in seen:
                seen.add(meta["name"])
                print(meta["name"], time.monotonic(), flush=True)


if __name__ == "__main__":
    main()
