"""netguard's svc/ resolution against a pod whose own namespace shapes its resolv.conf.

The kubelet writes a ClusterFirst pod's search list as `<ns>.svc.<domain> svc.<domain>
<domain>` (then the node's). netguard takes the cluster domain from the first `svc.` entry, so in
a namespace named `svc` it reads `svc.cluster.local` and asks `NAME.NS.svc.svc.cluster.local.`:
CoreDNS reads that as the endpoint NAME of Service NS in namespace `svc`, the pod's own
namespace, where whoever may create Services and EndpointSlices there picks the address the
entry opens. Pure logic (the file is what the kubelet writes)."""

from __future__ import annotations

import pytest

from netguard import resolve


def resolv_conf(tmp_path, namespace: str, node_search: str = "") -> str:
    path = tmp_path / "resolv.conf"
    path.write_text(f"search {namespace}.svc.cluster.local svc.cluster.local cluster.local"
                    f"{' ' + node_search if node_search else ''}\nnameserver 10.96.0.10\n"
                    "options ndots:5\n")
    return str(path)


def test_the_cluster_domain_of_an_ordinary_namespace(tmp_path):
    assert resolve.cluster_domain(resolv_conf(tmp_path, "tenant-a")) == "cluster.local"
    # A node search domain that looks like one comes after the kubelet's three.
    assert resolve.cluster_domain(resolv_conf(tmp_path, "tenant-a", "svc.corp.example")) == \
        "cluster.local"


@pytest.mark.xfail(strict=True, reason="netguard/resolve.py cluster_domain takes the first "
                   "search entry starting with 'svc.', which is '<ns>.svc.<domain>' in a "
                   "namespace named svc")
def test_a_pod_in_a_namespace_named_svc_gets_the_cluster_domain(tmp_path):
    assert resolve.cluster_domain(resolv_conf(tmp_path, "svc")) == "cluster.local"
