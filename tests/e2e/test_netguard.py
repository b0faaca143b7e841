"""netguard in a real pod's network namespace, installed by the chart's webhook with its
DEFAULT values (guard always, ingress from anywhere) and with the `sandman.dev/egress: deny`
label. Every probe runs inside the pod's own network namespace (tests/e2e/probe.py), against
servers in the test bed's fake outside; an unguarded pod beside them is the positive control
that proves each block is the guard's. The sandboxes here live in a fresh namespace without
NetworkPolicy, so what blocks is netguard alone (test_ingress_layers tests the policy layer).
"""

from __future__ import annotations

import pytest

from sandman.contract import LABEL_EGRESS
from testbed import realnode
from tests.e2e.helpers import new_token, plain_pod, sandbox_pod

OUT, RESOLVER, METADATA = realnode.OUTSIDE_IP, realnode.OUTSIDE_IP2, realnode.METADATA_IP
NAME, NAME_IP = "api.example.test", "198.18.0.7"
UDP_PORT = 5353


@pytest.fixture
def outside(sandman):
    """TCP on the fake outside, a UDP echo, a DNS resolver (CoreDNS forwards to it) and a
    "metadata" server; all exit by themselves."""
    servers = [realnode.serve_outside("tcp", OUT, 8080, lifetime=300),
               realnode.serve_outside("udp", OUT, UDP_PORT, lifetime=300),
               realnode.serve_outside("dns", RESOLVER, 53, lifetime=300,
                                      records={NAME: NAME_IP}),
               realnode.serve_outside("tcp", METADATA, 80, lifetime=300)]
    try:
        yield servers
    finally:
        for s in servers:
            s.stop()


def _probes(e2e, ns: str, pod: str) -> dict:
    return {
        "tcp": e2e.probe(ns, pod, "tcp", OUT, "8080"),
        "udp": e2e.probe(ns, pod, "udp", OUT, str(UDP_PORT)),
        "icmp": e2e.probe(ns, pod, "icmp", OUT),
        "dns-outside": e2e.probe(ns, pod, "dns", RESOLVER, NAME),
        "dns-cluster": e2e.probe(ns, pod, "dns", realnode.CLUSTER_DNS, NAME),
        "metadata": e2e.probe(ns, pod, "tcp", METADATA, "80"),
    }


def test_egress_default_and_deny(sandman, ns, outside):
    t_allow, sha_allow = new_token()
    t_deny, sha_deny = new_token()
    sandman.create(ns, sandbox_pod("sbx-default", sha_allow))
    sandman.create(ns, sandbox_pod("sbx-deny", sha_deny, labels={LABEL_EGRESS: "deny"}))
    sandman.run_ready(ns, plain_pod("control"))
    sandman.wait_ready(ns, "sbx-default")
    sandman.wait_ready(ns, "sbx-deny")

    control = _probes(sandman, ns, "control")
    default = _probes(sandman, ns, "sbx-default")
    deny = _probes(sandman, ns, "sbx-deny")
    table = {k: (control[k], default[k], deny[k]) for k in control}

    # Positive control: without a guard every destination answers, so each block below is real.
    assert all(p.ok for p in control.values()), table
    assert control["dns-outside"].detail == NAME_IP and control["dns-cluster"].detail == NAME_IP
    # Default values (egress allowed): everything but the metadata address; refused at once
    # (REJECT with a reset), not a timeout.
    for k in ("tcp", "udp", "icmp", "dns-outside", "dns-cluster"):
        assert default[k].ok, (k, table[k])
    assert not default["metadata"].ok and default["metadata"].how in ("reset", "refused"), \
        table["metadata"]
    # egress: deny: nothing leaves, DNS included; TCP refused with a reset, the rest rejected.
    for k, p in deny.items():
        assert not p.ok, (k, table[k])
    assert deny["tcp"].how in ("reset", "refused"), table["tcp"]
    # A REJECT of a locally sent datagram fails the send itself (EPERM) or answers unreachable.
    assert deny["udp"].how in ("not-permitted", "refused", "unreachable"), table["udp"]

    # Replies work in deny mode: execd answers a connection made to it (the kubelet's probe
    # made it Ready; a client over the pod network gets its answers back).
    ip = sandman.ip(ns, "sbx-deny")
    reach = sandman.probe(ns, "control", "tcp", ip, "9470")
    assert reach.ok, reach
    out = sandman.execd(ns, "sbx-deny", t_deny, """
        r = sb.exec('echo replies-flow', timeout=10)
        out['r'] = [r.exit_code, r.output.strip()]
    """)
    assert out["r"] == [0, "replies-flow"]


def test_sandbox_cannot_change_its_rules(sandman, ns):
    """No NET_ADMIN, no NET_RAW in the sandbox container, even as uid 0 with iptables
    installed (the sandman image as the task image): the rules stay as netguard wrote them."""
    token, sha = new_token()
    sandman.create(ns, sandbox_pod("sbx", sha, image=sandman.inst.image_ref,
                                   labels={LABEL_EGRESS: "deny"},
                                   security={"runAsUser": 0, "runAsNonRoot": False}))
    sandman.wait_ready(ns, "sbx")
    before = sandman.netns(ns, "sbx", ["iptables-save", "-t", "filter"]).stdout
    assert "SANDMAN-OUT" in before and "egress denied" in before
    out = sandman.execd(ns, "sbx", token, r"""
        def sh(cmd):
            r = sb.exec(cmd, timeout=30)
            return [r.exit_code, r.output.strip()]
        out['id'] = sh('id -u')
        out['caps'] = sh("grep -E '^Cap(Eff|Bnd|Prm):' /proc/self/status")
        out['flush'] = sh('iptables -F 2>&1; echo rc=$?')
        out['flush_out'] = sh('iptables -F SANDMAN-OUT 2>&1; echo rc=$?')
        out['legacy'] = sh('iptables-legacy -F 2>&1; echo rc=$?')
        out['packet'] = sh('python3 -c "import socket; socket.socket(socket.AF_PACKET, '
                           'socket.SOCK_RAW)" 2>&1; echo rc=$?')
        out['raw'] = sh('python3 -c "import socket; socket.socket(socket.AF_INET, '
                        'socket.SOCK_RAW, socket.IPPROTO_ICMP)" 2>&1; echo rc=$?')
    """)
    assert out["id"] == [0, "0"], out["id"]
    caps = dict(line.split(":\t") for line in out["caps"][1].splitlines())
    for name, bit in (("NET_ADMIN", 12), ("NET_RAW", 13)):
        for k in ("CapEff", "CapPrm", "CapBnd"):
            assert not int(caps[k], 16) >> bit & 1, (name, k, caps)
    for k in ("flush", "flush_out", "legacy", "packet", "raw"):
        assert not out[k][1].endswith("rc=0"), (k, out[k])
    assert "Operation not permitted" in out["packet"][1], out["packet"]
    after = sandman.netns(ns, "sbx", ["iptables-save", "-t", "filter"]).stdout
    strip = lambda s: [ln for ln in s.splitlines() if not ln.startswith(("#", ":"))]  # noqa: E731
    assert strip(after) == strip(before)
