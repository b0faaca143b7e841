"""Who may connect to execd's port, on the real pod network: each layer tested alone.

- netguard alone: sandboxes in a namespace without NetworkPolicy, one with its ingress
  narrowed by the `sandman.dev/ingress-from` annotation to one pod's IP: a neighbour's connect
  times out (the guard drops it), the admitted pod connects, and the same neighbour connects to
  a sandbox whose guard is open (the default), so the block was the guard's.
- NetworkPolicy alone: a sandbox with the default (open) guard in the chart's sandbox
  namespace, where the chart's policy admits only trainers (label sandman.dev/trainer=true, any
  namespace), the controller and the helm test pod: a non-trainer is refused, a trainer
  connects.
"""

from __future__ import annotations

import time

from sandman.contract import ANNOTATION_INGRESS_FROM, EXECD_PORT, NETGUARD_CONTAINER
from testbed import realnode
from tests.e2e.helpers import TRAINER_LABEL, new_token, plain_pod, sandbox_pod

PORT = str(EXECD_PORT)


def test_guard_alone_refuses_a_neighbour(sandman, ns):
    pods = sandman.run_ready(ns, plain_pod("admitted"), plain_pod("neighbour"))
    admitted = pods["admitted"].status.pod_ip
    # Only the admitted pod is listed: the kubelet's probes (from the bridge's address here)
    # get in through the guard's own --ingress-from-gateway.
    _, sha = new_token()
    sandman.create(ns, sandbox_pod("narrow", sha, annotations={
        ANNOTATION_INGRESS_FROM: f"{admitted}/32"}))
    sandman.create(ns, sandbox_pod("open", sha))
    narrow = sandman.wait_ready(ns, "narrow").status.pod_ip
    open_ = sandman.wait_ready(ns, "open").status.pod_ip

    refused = sandman.probe(ns, "neighbour", "tcp", narrow, PORT)
    assert not refused.ok and refused.how == "timeout", refused  # netguard DROPs
    assert sandman.probe(ns, "admitted", "tcp", narrow, PORT).ok
    assert sandman.probe(ns, "neighbour", "tcp", open_, PORT).ok  # control: same pod, open guard


def test_network_policy_alone_refuses_a_non_trainer(sandman, ns):
    sbx_ns = sandman.inst.sandbox_namespace
    sandman.run_ready(ns, plain_pod("trainer", labels={TRAINER_LABEL: "true"}),
                      plain_pod("stranger"))
    _, sha = new_token()
    name = f"plain-{ns[-6:]}"
    sandman.create(sbx_ns, sandbox_pod(name, sha))  # default guard: ingress from anywhere
    _, sha2 = new_token()
    sandman.create(ns, sandbox_pod("same-guard", sha2))  # the same guard, no policy around it
    try:
        ip = sandman.wait_ready(sbx_ns, name).status.pod_ip
        ctl_ip = sandman.wait_ready(ns, "same-guard").status.pod_ip
        # kube-router programs a new pod's policy on its own sync: allow it 10 s to do so.
        deadline = time.monotonic() + 10
        stranger = sandman.probe(ns, "stranger", "tcp", ip, PORT)
        while stranger.ok and time.monotonic() < deadline:
            time.sleep(1)
            stranger = sandman.probe(ns, "stranger", "tcp", ip, PORT)
        assert not stranger.ok, stranger
        assert sandman.probe(ns, "trainer", "tcp", ip, PORT).ok
        # Control: the stranger gets through the very same guard where no policy applies.
        assert sandman.probe(ns, "stranger", "tcp", ctl_ip, PORT).ok
    finally:
        sandman.delete(sbx_ns, name)


def test_narrowed_guard_admits_the_kubelets_probes(sandman, ns):
    """Found on the real node: netguard admitted the node by status.hostIP only, but on a
    bridge CNI the kubelet's probes come from the bridge's address (the pod's default
    gateway), so a sandbox whose ingress was narrowed to the trainers' CIDR never became
    Ready. The guard now admits the gateway it finds in the pod's netns, and records it."""
    _, sha = new_token()
    sandman.create(ns, sandbox_pod("narrow", sha, annotations={
        ANNOTATION_INGRESS_FROM: realnode.OUTSIDE_NET}))  # a "trainers' CIDR" with no pod in it
    sandman.wait_ready(ns, "narrow", timeout=45)
    logs = sandman.logs(ns, "narrow", NETGUARD_CONTAINER)
    assert f"gateway admitted to port {PORT}: {sandman.rn.gateway}/32" in logs, logs
