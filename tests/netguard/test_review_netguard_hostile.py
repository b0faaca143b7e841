"""netguard's svc/ resolution against a pod whose own namespace shapes its resolv.conf.

The kubelet writes a ClusterFirst pod's search list as `<ns>.svc.<domain> svc.<domain>
<domain>` (then the node's). Taking the cluster domain from the first `svc.` entry would, in a namespace named `svc`, read
`svc.cluster.local` and ask `NAME.NS.svc.svc.cluster.local.`: CoreDNS reads that as the
endpoint NAME of Service NS in namespace `svc`, the pod's own namespace, where whoever may
create Services and EndpointSlices there picks the address the entry opens. Pure logic (the file is what the kubelet writes)."""

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


def test_a_pod_in_a_namespace_named_svc_gets_the_cluster_domain(tmp_path):
    assert resolve.cluster_domain(resolv_conf(tmp_path, "svc")) == "cluster.local"


def test_a_search_list_without_the_kubelets_triple_is_refused(tmp_path):
    """Only the kubelet's `<ns>.svc.<d> svc.<d> <d>` names the domain: a lone `svc.` entry
    (a node's search domain) is not taken for it."""
    path = tmp_path / "resolv.conf"
    for search in ("svc.corp.example corp.example", "a.svc.x svc.y y", "svc.svc.x"):
        path.write_text(f"search {search}\nnameserver 10.96.0.10\n")
        with pytest.raises(resolve.ConfigError, match="no svc.<cluster domain>"):
            resolve.cluster_domain(str(path))
