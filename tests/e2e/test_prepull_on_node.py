"""The image pre-pull on the real node, through the installed chart: an admin's trainer posts an
image of the bed's local registry (testbed/registry.py, 127.0.0.1 only) to `/v1/images`; the
controller's puller pulls it onto the node; a sandbox of that image then starts without a pull
(the kubelet's event says "already present on machine", the acquire's `pull_ms` is 0), while a
sandbox of an image that was not pre-pulled (the negative control) pulls it (Pulling, Pulled
"Successfully pulled", `pull_ms` > 0). Both images are removed from the node first (crictl
rmi), and the puller pods are gone afterwards."""

from __future__ import annotations

import json
import time

from kubernetes import client

from sandman import contract
from testbed.images import task_image
from testbed.registry import LocalRegistry
from tests.e2e.test_sdk import run_trainer

ADMIN_ROLE = "sandman-admin"  # the chart's rbac.adminClusterRole default

SCRIPT = r"""
import dataclasses, json, os, time
from sandman.client import Client
A, B = os.environ["IMAGE_A"], os.environ["IMAGE_B"]
res = {}
c = Client(timeout_s=60)
first = c.prepull([A])
res["posted"] = [[i.image, i.pending] for i in first.images]
deadline = time.monotonic() + 300
while True:
    st = c.images()
    [img] = [i for i in st.images if i.image == A]
    if img.pending == 0 and img.pulled + img.failed >= st.nodes > 0:
        break
    if time.monotonic() > deadline:
        break
    time.sleep(1)
res["status"] = {"nodes": st.nodes, "pulled": img.pulled, "pending": img.pending,
                 "failed": img.failed, "failures": img.failures}
for key, image in (("a", A), ("b", B)):
    sb = c.acquire(image, job="e2e-prepull", cpu="250m", memory="160Mi", timeout_s=240,
                   lifetime_s=300, renew=False, warm_ok=False)
    res[key] = {"pod": sb.pod, "timings": dataclasses.asdict(sb.timings),
                "echo": sb.exec("echo ok", timeout=30).output.strip()}
    sb.release()
print("E2E-RESULT " + json.dumps(res), flush=True)
os._exit(0)
"""


def _events(core, ns: str, pod: str) -> list[tuple[str, str]]:
    evs = core.list_namespaced_event(ns, field_selector=f"involvedObject.name={pod}").items
    return [(e.reason, e.message or "") for e in evs]


def _rmi(rn, *refs: str) -> list[str]:
    """Remove the images from the node; the refs that could not be (absent is fine). Refuses
    (AssertionError) an image that also carries a name outside the local registry: the CRI
    removes an image with all its names, and the bed's own images cannot be pulled again."""
    listed = rn.crictl("images", "-o", "json")
    assert listed.returncode == 0, listed.stderr
    for img in json.loads(listed.stdout).get("images", []):
        names = (img.get("repoTags") or []) + (img.get("repoDigests") or [])
        if any(ref in names for ref in refs):
            host = refs[0].split("/", 1)[0]
            others = [n for n in names if not n.startswith(host + "/")]
            assert not others, f"removing {refs} would remove the bed's image {others}"
    left = []
    for ref in refs:
        r = rn.crictl("rmi", ref)
        out = (r.stderr + r.stdout).lower()
        if r.returncode != 0 and "not found" not in out and "no such image" not in out:
            left.append(f"{ref}: {r.stderr.strip()[:200]}")
    return left


def _admin(api_client, ns: str, name: str):
    rbac = client.RbacAuthorizationV1Api(api_client)
    rbac.create_cluster_role_binding({
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": ADMIN_ROLE},
        "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": ns}]})
    return lambda: rbac.delete_cluster_role_binding(name)


def test_a_prepulled_image_starts_without_a_pull(sandman, ns, figures):
    rn = sandman.rn
    core = sandman.core
    sbx_ns = sandman.inst.sandbox_namespace
    reg = LocalRegistry(sandman.cluster.testbed).start()
    unbind = None
    image_a = image_b = ""
    try:
        _, archive = task_image()
        t0 = time.monotonic()
        # Variants only: the task image itself has the image id of the bed's
        # sandman.local/task, and removing a reference by id removes every name of it, so
        # the suite's later sandboxes would have no image (and nothing to pull it from).
        reg.push(archive, "swe/task:base")
        image_a = reg.variant("swe/task:base", "swe/task:prepulled",
                              "dev.sandman.test/variant=prepulled")
        image_b = reg.variant("swe/task:base", "swe/task:control",
                              "dev.sandman.test/variant=control")
        figures.add(f"prepull e2e: local registry up and 2 images pushed in "
                    f"{time.monotonic() - t0:.1f}s")
        assert image_a.startswith("127.0.0.1:") and image_a != image_b
        # Whatever an earlier run left: both must be pulled now.
        assert _rmi(rn, image_a, image_b) == []
        unbind = _admin(sandman.cluster.api_client, ns, f"e2e-prepull-{ns}")

        res = run_trainer(sandman, ns, "trainer-prepull", SCRIPT, timeout=700,
                          IMAGE_A=image_a, IMAGE_B=image_b)
        st = res["status"]
        assert st["nodes"] == 1 and st["pulled"] == 1, res  # the real node, the pool's one
        assert (st["pending"], st["failed"], st["failures"]) == (0, 0, {}), res
        assert res["a"]["echo"] == res["b"]["echo"] == "ok", res

        # The pre-pulled image: no pull for its sandbox (the kubelet's own word for it).
        ev_a = _events(core, sbx_ns, res["a"]["pod"])
        mine_a = [(r, m) for r, m in ev_a if image_a in m]
        assert mine_a and all(r == "Pulled" and "already present on machine" in m
                              for r, m in mine_a), ev_a
        assert res["a"]["timings"]["pull_ms"] == 0, res["a"]
        # The control: not pre-pulled, so its sandbox pulled it, and the acquire says so.
        ev_b = _events(core, sbx_ns, res["b"]["pod"])
        reasons_b = [r for r, m in ev_b if image_b in m]
        assert "Pulling" in reasons_b, ev_b
        assert any(r == "Pulled" and "Successfully pulled" in m for r, m in ev_b
                   if image_b in m), ev_b
        assert res["b"]["timings"]["pull_ms"] > 0, res["b"]
        figures.add(f"prepull e2e: pull_ms {res['a']['timings']['pull_ms']:g} (pre-pulled) vs "
                    f"{res['b']['timings']['pull_ms']:g} (not); ready_ms "
                    f"{res['a']['timings']['ready_ms']:g} vs {res['b']['timings']['ready_ms']:g}")

        # The puller was a real pull on the node, and it is gone.
        pullers = core.list_namespaced_pod(sbx_ns, label_selector=contract.LABEL_PREPULL).items
        assert [p.metadata.name for p in pullers if not p.metadata.deletion_timestamp] == []
        puller_events = [e for e in core.list_namespaced_event(sbx_ns).items
                         if e.involved_object.name.startswith("sandman-prepull-")
                         and image_a in (e.message or "")]
        assert any(e.reason == "Pulled" and "Successfully pulled" in e.message
                   for e in puller_events), [(e.reason, e.message) for e in puller_events]
    finally:
        if unbind is not None:
            unbind()
        reg.stop()
        _rmi(rn, *(r for r in (image_a, image_b) if r))  # nothing of the run stays on the node
