"""`make release` (tools/release.py) into the bed's OCI registry (crane's, testbed/registry.py),
then `helm install oci://...` of that release on the bed's real API server (kwok nodes run no
container: the installed objects' image fields and the registry's answers are what is checked).

- the release installs by name and version, every workload's image is `...@sha256:` of an image
  the registry serves by that digest, and `helm uninstall` leaves nothing of it;
- a chart running an image the registry does not serve, or one served but not released with it,
  is refused before its push: the registry never holds it.

The image is `make images`' cached sandman image (built once per source tree: the real-node
tier of `make test` builds the same one)."""

from __future__ import annotations

import json
import time

import pytest

from testbed.registry import LocalRegistry
from tests.charts.helm import Helm, kubectl, objects
from tests.charts.test_chart_on_testbed import CLUSTER_KINDS, _scoped, _values_file
from tools import release

pytestmark = pytest.mark.testbed

WORKLOADS = ("Deployment", "DaemonSet", "StatefulSet", "Job", "CronJob")
NAMESPACED_KINDS = ("deployments", "replicasets", "daemonsets", "statefulsets", "jobs", "cronjobs", "services",
                    "configmaps", "secrets", "serviceaccounts", "roles", "rolebindings",
                    "networkpolicies", "poddisruptionbudgets", "pods")


@pytest.fixture
def registry(cluster):
    if cluster.testbed is None:
        pytest.skip("needs the local test bed (its registry)")
    reg = LocalRegistry(cluster.testbed).start()
    yield reg
    reg.stop()


@pytest.fixture
def helm_home(tmp_path, monkeypatch):
    """Helm's homes in the test's directory, for the release tool's helm as for the test's."""
    home = tmp_path / "helm-home"
    for var, sub in (("HELM_CACHE_HOME", "cache"), ("HELM_CONFIG_HOME", "config"),
                     ("HELM_DATA_HOME", "data")):
        monkeypatch.setenv(var, str(home / sub))
    return home


def _images(obj: dict) -> list[str]:
    spec = release._pod_spec(obj) or {}
    return [c["image"] for key in ("initContainers", "containers")
            for c in spec.get(key) or []]


def _left(cluster, name: str, *namespaces: str) -> list[str]:
    """Every object still labelled with the release, in these namespaces and cluster-wide."""
    sel = f"app.kubernetes.io/instance={name}"
    out = [f"{ns}/{o}" for ns in namespaces
           for o in kubectl(cluster.kubeconfig, "get", ",".join(NAMESPACED_KINDS), "-n", ns,
                            "-l", sel, "-o", "name").stdout.split()]
    out += kubectl(cluster.kubeconfig, "get", ",".join(CLUSTER_KINDS), "-l", sel,
                   "-o", "name").stdout.split()
    return out


def test_a_release_installs_by_name_with_every_image_by_digest(cluster, namespace, registry,
                                                               helm_home, tmp_path, figures):
    t0 = time.monotonic()
    # allow_dirty: the suite runs on checkouts with edits; the refusal is tests/test_release.py's.
    done = release.release(f"{registry.host}/sandman-dev", plain_http=True, allow_dirty=True)
    t_release = time.monotonic() - t0
    assert done.chart == f"oci://{registry.host}/sandman-dev/charts/sandman"
    assert done.version == release.versions()
    assert set(done.images) == set(release.IMAGES)

    helm = Helm(helm_home, cluster.kubeconfig)
    name = f"rel{int(time.time() * 1000) % 100000}"
    sandboxes = cluster.new_namespace("rel-sandboxes")
    values = _values_file(tmp_path, "v", _scoped(sandboxes), {"sandboxNamespace": sandboxes})
    try:
        helm.run("install", name, done.chart, "--version", done.version, "--plain-http",
                 "--namespace", namespace, "-f", values)
        # What helm installed, and what the API server holds of it.
        shown = objects(helm.run("get", "manifest", name, "-n", namespace).stdout)
        hooks = objects(helm.run("get", "hooks", name, "-n", namespace).stdout)
        workloads = [o for o in shown + hooks if o["kind"] in WORKLOADS]
        assert {"Deployment", "Job"} <= {o["kind"] for o in workloads}
        live = json.loads(kubectl(cluster.kubeconfig, "get", "deployments,daemonsets,jobs",
                                  "-n", namespace, "-l", f"app.kubernetes.io/instance={name}",
                                  "-o", "json").stdout)["items"]
        assert live, "the release created no workload"
        refs = {ref for o in workloads + live for ref in _images(o)}
        assert refs == set(done.images.values()), refs
        for ref in refs:
            repo, digest = ref.split("@", 1)
            assert repo.startswith(f"{registry.host}/sandman-dev/")
            assert registry._crane("digest", ref) == digest
        # The chart itself: the registry serves the digest the tool printed.
        chart_ref = f"{done.chart.removeprefix('oci://')}:{done.version}"
        assert registry._crane("digest", chart_ref) == done.chart_digest
    finally:
        # --no-hooks: the post-delete cleanup Job never completes on kwok (no containers run).
        helm.run("uninstall", name, "--namespace", namespace, "--wait", "--timeout", "60s",
                 "--no-hooks", check=False)
    # Pods and ReplicaSets go by the garbage collector, after helm's --wait: a bounded wait.
    deadline = time.monotonic() + 30
    while (left := _left(cluster, name, namespace, sandboxes)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for kind in CLUSTER_KINDS:  # never leave admission behind, even when the assert fails
        kubectl(cluster.kubeconfig, "delete", kind, "-l", f"app.kubernetes.io/instance={name}",
                "--ignore-not-found", "--wait=false", check=False)
    cluster.delete_namespace(sandboxes)
    assert not left, f"helm uninstall left {left}"
    figures.add(f"make release into the bed's registry: {t_release:.1f}s; install, checks and "
                f"uninstall {time.monotonic() - t0 - t_release:.1f}s")


def test_a_chart_running_an_image_not_released_is_never_pushed(registry, helm_home, tmp_path):
    reg = f"{registry.host}/sandman-dev"
    version = release.versions()
    tools = release.Tools(reg, plain_http=True)
    # Small stand-ins for the sandman image: the check is about references, not contents.
    real = registry.scratch("sandman-dev/sandman:" + version, "release=this")
    other = registry.scratch("sandman-dev/elsewhere:1", "release=other")
    digest = real.split("@", 1)[1]
    absent = real.replace(digest, "sha256:" + ("0" if digest[-1] != "0" else "1") * 64)
    pushed = {"sandman": real}
    chart = f"{reg}/charts/sandman:{version}"

    for i, (runs, why) in enumerate(((absent, "which the registry does not serve"),
                                     (other, "not an image of this release"))):
        tgz = release.package_chart(tools, {"sandman": runs}, (tmp_path / str(i)))
        with pytest.raises(release.ReleaseError, match=why):
            release.push_chart(tools, tgz, reg, version, pushed
                               if runs == other else {"sandman": runs})
        assert tools.digest(chart) is None, "a refused chart reached the registry"

    # The same steps with the released image: pushed, and a second push of it refused.
    tgz = release.package_chart(tools, pushed, tmp_path / "ok")
    ref, chart_digest = release.push_chart(tools, tgz, reg, version, pushed)
    assert (ref, tools.digest(chart)) == (f"oci://{reg}/charts/sandman", chart_digest)
    with pytest.raises(release.ReleaseError, match="already released"):
        release.push_chart(tools, tgz, reg, version, pushed)
