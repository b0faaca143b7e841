"""A real local Kubernetes control plane (etcd, kube-apiserver, controller-manager, scheduler,
kwok) for sandman's tests. See docs/testbed.md."""
