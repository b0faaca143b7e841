"""The sweep's list (controller/kube.py `list_pods_slim`) on the bed's API server: read a page
at a time (a list of thousands of whole pods decoded at once stalled every hand-out behind the
GIL), every page followed to the end, each pod slim."""

import asyncio

from controller import kube as K
from sandman import contract

IMAGE = "registry.invalid/swe/task:1"


def test_every_page_is_read_and_each_pod_is_slim(cluster, namespace, monkeypatch):
    monkeypatch.setattr(K, "LIST_PAGE", 3)
    sel = f"{contract.LABEL_MANAGED_BY}={contract.MANAGED_BY_CONTROLLER}"
    for i in range(7):
        cluster.core.create_namespaced_pod(namespace, {
            "metadata": {"name": f"paged-{i}", "labels": {
                contract.LABEL_MANAGED_BY: contract.MANAGED_BY_CONTROLLER}},
            "spec": {"containers": [{"name": "c", "image": IMAGE}]}})
    cluster.core.create_namespaced_pod(namespace, {  # not selected
        "metadata": {"name": "other"}, "spec": {"containers": [{"name": "c", "image": IMAGE}]}})
    k = K.KubeClient(K.load_api_client(str(cluster.kubeconfig), pool=4), namespace, threads=2)
    try:
        got = asyncio.run(k.list_pods_slim(sel))
    finally:
        k.shutdown()
    assert sorted(p["metadata"]["name"] for p in got) == [f"paged-{i}" for i in range(7)]
    assert all("managedFields" not in p["metadata"] and "status" in p for p in got)
