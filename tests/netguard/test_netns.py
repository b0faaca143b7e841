"""netguard on a real kernel, in network namespaces these tests create and always delete.

Needs root, iproute2 and iptables (nft; legacy too where installed). Without them every test
here FAILS with the reason: a guard whose tests silently skipped is a guard nobody checked.
Every probe targets an address that exists only in the test's own namespaces (nslab.py).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

from tests.netguard import nslab
from tests.netguard.nslab import (
    METADATA_V4,
    METADATA_V6,
    OTHER_V4,
    OTHER_V6,
    PEER_V4,
    PEER_V6,
    POD_OTHER_V4,
    POD_OTHER_V6,
    POD_PEER_V4,
    POD_PEER_V6,
    REMOTE_V4,
)

pytestmark = [pytest.mark.netns, pytest.mark.timeout(120)]

FAST_MS = 200  # a REJECT answers in well under a millisecond; 200 ms leaves room for a busy VM
DROP_WAIT = 0.4  # how long an inbound probe waits before a DROP counts as dropped
EXECD_PORT = 9470

LEGACY = shutil.which("iptables-legacy-restore") and shutil.which("ip6tables-legacy-restore")
BACKENDS = ["nft", pytest.param("legacy", marks=pytest.mark.skipif(
    not LEGACY, reason="iptables-legacy-* not installed on this machine"))]


@pytest.fixture(scope="session", autouse=True)
def _prerequisites():
    missing = nslab.missing_prerequisites()
    if missing:
        pytest.fail(f"netguard netns tests need {', '.join(missing)}; install them "
                    f"(`make deps`) and run as root", pytrace=False)


@pytest.fixture
def lab(tmp_path):
    lab = nslab.Lab.create(tmp_path)
    try:
        yield lab
    finally:
        lab.destroy()
        assert not any(ns in nslab.sh("ip", "netns", "list").stdout
                       for ns in (lab.pod, lab.peer, lab.other))


def blocked_fast(o: nslab.Outcome) -> bool:
    return not o.through and o.what != "timeout" and o.ms < FAST_MS


def status(lab) -> dict:
    return json.loads(Path(lab.status_file).read_text())


# ------------------------------------------------------------------ egress


@pytest.mark.parametrize("backend", BACKENDS)
def test_deny_refuses_tcp_udp_icmp_dns_and_metadata_quickly(lab, backend, figures):
    web, dns, md = lab.serve(lab.peer, 8080), lab.serve(lab.peer, 53, udp=True), lab.serve(
        lab.peer, 80)
    # Positive control: without the guard, everything gets through (so the test can fail).
    assert nslab.tcp(lab.pod, PEER_V4, 8080, payload=b"x").through
    assert nslab.tcp(lab.pod, PEER_V6, 8080, payload=b"x").through
    assert nslab.udp(lab.pod, PEER_V4, 53).through
    assert nslab.icmp_echo(lab.pod, PEER_V4).through
    assert nslab.tcp(lab.pod, METADATA_V4, 80, payload=b"x").through
    assert nslab.tcp(lab.pod, METADATA_V6, 80, payload=b"x").through
    seen = (web.accepted, dns.datagrams, md.accepted)

    lab.apply("--backend", backend, "--verify-blocked", f"{PEER_V4}:8080",
              "--verify-blocked", f"[{PEER_V6}]:8080")
    probes = {
        "tcp v4": nslab.tcp(lab.pod, PEER_V4, 8080),
        "tcp v6": nslab.tcp(lab.pod, PEER_V6, 8080),
        "tcp other port": nslab.tcp(lab.pod, PEER_V4, 443),
        "tcp remote": nslab.tcp(lab.pod, REMOTE_V4, 443),
        "udp": nslab.udp(lab.pod, PEER_V4, 9999, payload=b"x"),
        "dns v4": nslab.udp(lab.pod, PEER_V4, 53),
        "dns v6": nslab.udp(lab.pod, PEER_V6, 53),
        "icmp": nslab.icmp_echo(lab.pod, PEER_V4),
        "metadata v4": nslab.tcp(lab.pod, METADATA_V4, 80),
        "metadata v6": nslab.tcp(lab.pod, METADATA_V6, 80),
        "metadata udp": nslab.udp(lab.pod, METADATA_V4, 80, payload=b"x"),
    }
    slow = {k: v for k, v in probes.items() if not blocked_fast(v)}
    assert not slow, f"not refused quickly: {slow}"
    assert probes["tcp v4"].what == "refused"  # tcp-reset: ECONNREFUSED, like a closed port
    assert (web.accepted, dns.datagrams, md.accepted) == seen  # nothing reached the peer
    st = status(lab)
    assert st["ok"] and st["verified"] and st["mode"] == "deny" and st["backend"] == backend
    assert st["families"] == ["ipv4", "ipv6"] and POD_PEER_V4 in st["pod_ips"]
    assert {p["outcome"] for p in st["probes"] if p["want"] == "blocked"} == {"refused"}
    assert lab.status_file.stat().st_mode & 0o777 == 0o644  # the sandbox (any uid) reads it
    assert nslab.tcp(lab.pod, "127.0.0.1", 1).what == "refused"  # loopback still answers
    worst = max(v.ms for v in probes.values())
    figures.add(f"netguard[{backend}]: slowest refused probe {worst:.2f} ms; "
                f"apply {st['timings_ms']}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_metadata_refused_in_allow_mode(lab, backend):
    web, md = lab.serve(lab.peer, 8080), lab.serve(lab.peer, 80)
    lab.serve(lab.peer, 53, udp=True)
    lab.apply("--egress", "allow", "--backend", backend)
    assert nslab.tcp(lab.pod, PEER_V4, 8080, payload=b"x").through  # egress allowed ...
    assert nslab.tcp(lab.pod, PEER_V6, 8080, payload=b"x").through
    assert nslab.udp(lab.pod, PEER_V4, 53).through
    for o in (nslab.tcp(lab.pod, METADATA_V4, 80), nslab.tcp(lab.pod, METADATA_V6, 80),
              nslab.udp(lab.pod, METADATA_V4, 80, payload=b"x"),
              nslab.udp(lab.pod, METADATA_V6, 80, payload=b"x")):
        assert blocked_fast(o), o  # ... but never to the metadata address
    assert md.accepted == 0 and web.accepted == 2
    assert status(lab)["mode"] == "allow"


def test_allow_egress_entries_open_exactly_themselves(lab):
    tcp53, udp53 = lab.serve(lab.peer, 8053), lab.serve(lab.peer, 8053, udp=True)
    lab.serve(lab.peer, 8054)
    lab.serve(lab.peer, 8055)  # also answers on REMOTE_V4, which lives in the peer
    lab.apply("--allow-egress", f"{PEER_V4}:8053/tcp", "--allow-egress", f"[{PEER_V6}]:8053",
              "--allow-egress", f"{REMOTE_V4}/32:8055/udp")
    assert nslab.tcp(lab.pod, PEER_V4, 8053, payload=b"q").through
    assert nslab.udp(lab.pod, PEER_V6, 8053).through  # a port without /proto: udp ...
    assert nslab.tcp(lab.pod, PEER_V6, 8053, payload=b"q").through  # ... and tcp
    for o in (nslab.udp(lab.pod, PEER_V4, 8053),  # v4 entry is tcp only
              nslab.tcp(lab.pod, PEER_V4, 8054),  # other port, same host
              nslab.tcp(lab.pod, PEER_V6, 8054),
              nslab.tcp(lab.pod, REMOTE_V4, 8053),  # other host, same port
              nslab.tcp(lab.pod, REMOTE_V4, 8055),  # udp-only entry
              nslab.tcp(lab.pod, METADATA_V4, 8053),
              nslab.icmp_echo(lab.pod, PEER_V4)):
        assert blocked_fast(o), o
    assert tcp53.accepted == 2 and udp53.datagrams == 1
    assert lab.netguard("check").returncode == 0


# ------------------------------------------------------------------ ingress


@pytest.mark.parametrize("backend", BACKENDS)
def test_execd_port_only_from_listed_sources_and_replies_get_out(lab, backend):
    execd, other_port = lab.serve(lab.pod, EXECD_PORT), lab.serve(lab.pod, 2222)
    lab.apply("--backend", backend, "--ingress-from", f"{PEER_V4}/32,{PEER_V6}/128")
    # The listed caller connects and gets its echo back: the reply left through the
    # established rule although egress is denied.
    assert nslab.tcp(lab.peer, POD_PEER_V4, EXECD_PORT, payload=b"run").through
    assert nslab.tcp(lab.peer, POD_PEER_V6, EXECD_PORT, payload=b"run").through
    assert execd.accepted == 2
    # An unlisted namespace, and the listed one on another port, are dropped.
    for o in (nslab.tcp(lab.other, POD_OTHER_V4, EXECD_PORT, timeout=DROP_WAIT),
              nslab.tcp(lab.peer, POD_PEER_V4, 2222, timeout=DROP_WAIT),
              nslab.tcp(lab.peer, POD_PEER_V6, 2222, timeout=DROP_WAIT)):
        assert o.what == "timeout", o
    assert execd.accepted == 2 and other_port.accepted == 0
    # The pod itself still reaches its execd over loopback.
    assert nslab.tcp(lab.pod, "127.0.0.1", EXECD_PORT, payload=b"x").through


def test_no_ingress_from_means_loopback_only(lab):
    execd = lab.serve(lab.pod, EXECD_PORT)
    assert nslab.tcp(lab.peer, POD_PEER_V4, EXECD_PORT, payload=b"x").through  # control
    lab.apply()
    assert nslab.tcp(lab.peer, POD_PEER_V4, EXECD_PORT, timeout=DROP_WAIT).what == "timeout"
    assert nslab.tcp(lab.other, POD_OTHER_V4, EXECD_PORT, timeout=DROP_WAIT).what == "timeout"
    assert nslab.tcp(lab.pod, "127.0.0.1", EXECD_PORT, payload=b"x").through
    assert nslab.tcp(lab.pod, "::1", EXECD_PORT, payload=b"x").through
    assert nslab.tcp(lab.pod, POD_PEER_V4, EXECD_PORT, payload=b"x").through  # own IP: via lo
    assert execd.accepted == 4


# ------------------------------------------------------------------ default install values
# kwok never ran an init container, so nothing noticed that the DEFAULT ingress (0.0.0.0/0)
# failed netguard's read-back: iptables-save prints no `-s` for a /0 source, the comparison
# saw a mismatch, and every guarded sandbox of a default install was locked down and never
# started. These tests apply exactly the arguments the webhook injects by default.


def _default_webhook_args(egress: str, node_ip: str) -> list[str]:
    """The netguard args the webhook gives a sandbox with the default policy (no annotation),
    with `$(SANDMAN_NODE_IP)` expanded the way the kubelet does (downward API status.hostIP)."""
    from sandman.contract import LABEL_EGRESS, LABEL_SANDBOX, SANDBOX_TRUE
    from sandman.podspec import NODE_IP_ENV, SandboxPolicy, netguard_args
    from webhook.__main__ import policy_from

    pod = {"metadata": {"labels": {LABEL_SANDBOX: SANDBOX_TRUE, LABEL_EGRESS: egress}},
           "spec": {"containers": [{"name": "sandbox", "image": "python:3.12-slim"}]}}
    policy = SandboxPolicy()
    # The webhook's own CLI default is the same policy (the chart leaves ingressFrom empty).
    assert policy_from(_webhook_parser().parse_args([])).ingress_from == policy.ingress_from
    args = netguard_args(pod, policy)
    assert "0.0.0.0/0" in args  # the default this test is about
    return [node_ip if a == f"$({NODE_IP_ENV})" else a for a in args]


def _webhook_parser():
    import argparse

    from webhook.__main__ import _policy_args
    p = argparse.ArgumentParser()
    _policy_args(p)
    return p


@pytest.mark.parametrize("egress", ["allow", "deny"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_default_install_ingress_applies_verifies_and_admits_any_source(lab, backend, egress):
    execd, other_port = lab.serve(lab.pod, EXECD_PORT), lab.serve(lab.pod, 2222)
    args = _default_webhook_args(egress, node_ip=PEER_V4)
    p = lab.netguard("apply", "--backend", backend, *args)
    assert p.returncode == 0, f"default install: apply failed: {p.stderr.strip()}"
    st = status(lab)
    assert st["ok"] and st["verified"] and st["backend"] == backend
    assert lab.netguard("check").returncode == 0  # re-renders from the status file
    # 0.0.0.0/0: an unlisted namespace reaches execd, and its echo gets back out.
    assert nslab.tcp(lab.other, POD_OTHER_V4, EXECD_PORT, payload=b"run").through
    assert nslab.tcp(lab.peer, POD_PEER_V4, EXECD_PORT, payload=b"run").through
    # Still only execd's port; and IPv6 sources stay loopback-only (no ::/0 was given).
    assert nslab.tcp(lab.other, POD_OTHER_V4, 2222, timeout=DROP_WAIT).what == "timeout"
    assert nslab.tcp(lab.peer, POD_PEER_V6, EXECD_PORT, timeout=DROP_WAIT).what == "timeout"
    assert execd.accepted == 2 and other_port.accepted == 0
    if egress == "deny":
        assert blocked_fast(nslab.tcp(lab.pod, PEER_V4, 8080))
    assert blocked_fast(nslab.tcp(lab.pod, METADATA_V4, 80))


# Every spelling iptables-save rewrites: /0 (omitted), host bits (cleared), a bare address
# (printed /32 or /128), IPv4-embedded IPv6 (glibc prints ::ffff:10.0.0.0, Python
# ::ffff:a00:0), a long zero spelling of ::/0 and upper case hex.
SPELLINGS_IN = ["0.0.0.0/0", "::/0", "10.251.2.2/16", "10.251.1.2", "0::0/0",
                "::ffff:10.0.0.0/104", "FD00:5A:1::2", "1.2.3.4/0"]
# An IPv4-mapped allow entry is refused (sandman/egress.py's never ranges); the /0 entries'
# carve-outs still put one in the egress chain (`-d ::ffff:0:0/96`, which glibc prints back as
# `::ffff:0.0.0.0/96`).
SPELLINGS_OUT = ["0.0.0.0/0:8053/tcp", "[::/0]:8053/udp", "10.251.1.2/24:8054",
                 "[FD00:5A:1::2]:8055/tcp", "10.251.9.9"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_cidr_spelling_iptables_save_canonicalises_reads_back(lab, backend):
    execd = lab.serve(lab.pod, EXECD_PORT)
    args = ["--backend", backend, "--ingress-from", ",".join(SPELLINGS_IN)]
    for a in SPELLINGS_OUT:
        args += ["--allow-egress", a]
    p = lab.netguard("apply", *args)
    assert p.returncode == 0, f"apply failed: {p.stderr.strip()}"
    assert lab.netguard("check").returncode == 0
    assert lab.netguard("check", *args[2:]).returncode == 0
    assert nslab.tcp(lab.other, POD_OTHER_V4, EXECD_PORT, payload=b"x").through
    assert nslab.tcp(lab.peer, POD_PEER_V6, EXECD_PORT, payload=b"x").through  # ::/0
    assert execd.accepted == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_read_back_still_fails_closed_on_a_narrowed_wildcard(lab, backend):
    """Normalising spellings must not hide a real difference: a live rule that admits less
    (or more) than the wildcard is a mismatch, and apply's read-back catches it."""
    lab.apply("--backend", backend, "--ingress-from", "0.0.0.0/0")
    ipt = ("ip", "netns", "exec", lab.pod, f"iptables-{backend}")
    comment = f"sandman: allow port {EXECD_PORT} from 0.0.0.0/0"
    nslab.sh(*ipt, "-D", "SANDMAN-IN", "-p", "tcp", "-m", "tcp", "--dport", str(EXECD_PORT),
             "-m", "comment", "--comment", comment, "-j", "ACCEPT")
    nslab.sh(*ipt, "-I", "SANDMAN-IN", "4", "-s", "10.0.0.0/1", "-p", "tcp", "-m", "tcp",
             "--dport", str(EXECD_PORT), "-m", "comment", "--comment", comment, "-j", "ACCEPT")
    bad = lab.netguard("check", "--backend", backend)
    assert bad.returncode == 1 and "SANDMAN-IN differs" in bad.stdout, bad.stdout


# docs/install.md narrows `sandbox.ingressFrom` to the trainers' pod CIDR. The controller
# (`--ready-check execd`) dials execd from its own pod IP, outside that CIDR: it must still get
# in on the pods it builds, and any other non-trainer must not. The pod and its netguard
# arguments come from the controller's own code path, configured as the chart configures it.


def _controller_built_args(controller_ip: str, node_ip: str, trainers: str,
                           volume: Path) -> list[str]:
    """The guard's args as the controller builds the pod, the node's address expanded and the
    install pointed at `volume` (the pod's emptyDir here) instead of /sandman."""
    from controller.__main__ import parse_args, settings_from
    from controller.books import Entry
    from controller.core import Controller
    from controller.pods import SandboxSpec
    from sandman.contract import NETGUARD_CONTAINER
    from sandman.podspec import NODE_IP_ENV

    args = parse_args(["serve", "--namespace", "sandboxes", "--listen", "0.0.0.0:8080",
                       f"--ingress-from={trainers}", f"--advertise-address={controller_ip}"])
    ctl = Controller(None, settings_from(args))
    pod = ctl.creator.build_pod(Entry("sbx-1", SandboxSpec("img"), "job", "nonce", "token"), "a" * 64)
    guard = next(c for c in pod["spec"]["initContainers"] if c["name"] == NETGUARD_CONTAINER)
    args = [node_ip if a == f"$({NODE_IP_ENV})" else a for a in guard["args"]]
    assert args[-2] == "--install-execd", args
    return [*args[:-1], str(volume)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_narrowed_ingress_admits_the_controller_that_built_the_pod_and_no_other(lab, backend,
                                                                               tmp_path):
    execd = lab.serve(lab.pod, EXECD_PORT)
    # peer = the controller's pod; other = any other pod, not a trainer; the node is elsewhere.
    volume = tmp_path / "volume"
    volume.mkdir()
    args = _controller_built_args(PEER_V4, node_ip="10.251.7.7", trainers="10.32.0.0/12",
                                  volume=volume)
    p = lab.netguard("apply", "--backend", backend, *args)
    assert p.returncode == 0, p.stderr
    assert (volume / "execd.py").is_file()
    assert lab.netguard("check").returncode == 0
    got = nslab.tcp(lab.peer, POD_PEER_V4, EXECD_PORT, payload=b"health")
    assert got.through, f"the controller's execd check is locked out: {got}"
    assert nslab.tcp(lab.other, POD_OTHER_V4, EXECD_PORT, timeout=DROP_WAIT).what == "timeout"
    assert nslab.tcp(lab.peer, POD_PEER_V6, EXECD_PORT, timeout=DROP_WAIT).what == "timeout"
    assert nslab.tcp(lab.peer, POD_PEER_V4, 2222, timeout=DROP_WAIT).what == "timeout"
    assert execd.accepted == 1


# ------------------------------------------------------------------ the pod's gateway
# On a bridge CNI the kubelet's probes come from the bridge's address, the pod's default
# gateway, not from status.hostIP (found on the test bed's real node: a sandbox with a narrowed
# ingress never became Ready). Here the "other" namespace plays the bridge: the pod's default
# routes go via it, and the node IP the webhook passes is an address elsewhere.

NARROW_ARGS = ("--ingress-from", "10.32.0.0/12", "--ingress-from", "10.251.7.7")


@pytest.mark.parametrize("backend", BACKENDS)
def test_ingress_from_gateway_admits_the_default_gateways_and_no_other(lab, backend):
    execd, other_port = lab.serve(lab.pod, EXECD_PORT), lab.serve(lab.pod, 2222)
    lab.ip(lab.pod, "route", "add", "default", "via", OTHER_V4)
    lab.ip(lab.pod, "-6", "route", "add", "default", "via", OTHER_V6)
    other_if = "ngr" + lab.other.removeprefix("ngr-") + "b"
    lab.ip(lab.other, "addr", "add", "10.251.2.3/24", "dev", other_if)  # not the gateway
    # Control: without the flag, the gateway is dropped like anyone outside the list.
    lab.apply("--backend", backend, *NARROW_ARGS)
    assert nslab.tcp(lab.other, POD_OTHER_V4, EXECD_PORT, timeout=DROP_WAIT).what == "timeout"

    p = lab.apply("--backend", backend, *NARROW_ARGS, "--ingress-from-gateway")
    assert "gateway admitted to port 9470: 10.251.2.2/32, fd00:5a:2::2/128" in p.stdout
    st = status(lab)
    assert st["ok"] and st["verified"]
    assert st["options"]["ingress_from_gateway"] is True
    assert st["options"]["ingress_gateways"] == [f"{OTHER_V4}/32", f"{OTHER_V6}/128"]
    assert lab.netguard("check").returncode == 0  # re-renders with the recorded gateways
    for family in (4, 6):
        gw = OTHER_V4 if family == 4 else OTHER_V6
        assert (f'-A SANDMAN-IN -s {gw}/{32 if family == 4 else 128} -p tcp -m tcp --dport '
                f'{EXECD_PORT} -m comment --comment "sandman: allow port {EXECD_PORT} from '
                f'gateway {gw}/{32 if family == 4 else 128}" -j ACCEPT') in lab.save(family,
                                                                                   backend)
    # The gateway reaches execd, both families, and its echo gets back out.
    assert nslab.tcp(lab.other, POD_OTHER_V4, EXECD_PORT, payload=b"health").through
    assert nslab.tcp(lab.other, POD_OTHER_V6, EXECD_PORT, payload=b"health").through
    # Only the gateway's address, only execd's port: a second address on the same link, the
    # unlisted peer and another port are still dropped.
    for o in (nslab.tcp(lab.other, POD_OTHER_V4, EXECD_PORT, src="10.251.2.3",
                        timeout=DROP_WAIT),
              nslab.tcp(lab.peer, POD_PEER_V4, EXECD_PORT, timeout=DROP_WAIT),
              nslab.tcp(lab.other, POD_OTHER_V4, 2222, timeout=DROP_WAIT)):
        assert o.what == "timeout", o
    assert execd.accepted == 2 and other_port.accepted == 0


def test_ingress_from_gateway_without_a_default_route_admits_nothing_more(lab):
    """A pod without a default route (the lab's pod has none) still applies and verifies: no
    gateway rule, the listed sources and the node as before."""
    execd = lab.serve(lab.pod, EXECD_PORT)
    p = lab.apply(*NARROW_ARGS, "--ingress-from", f"{PEER_V4}/32", "--ingress-from-gateway")
    assert "none found (no default route)" in p.stdout
    st = status(lab)
    assert st["ok"] and st["verified"] and st["options"]["ingress_gateways"] == []
    assert "gateway" not in lab.save(4) + lab.save(6)
    assert nslab.tcp(lab.peer, POD_PEER_V4, EXECD_PORT, payload=b"x").through
    assert nslab.tcp(lab.other, POD_OTHER_V4, EXECD_PORT, timeout=DROP_WAIT).what == "timeout"
    assert execd.accepted == 1


# ------------------------------------------------------------------ re-runs


@pytest.mark.parametrize("backend", BACKENDS)
def test_rerun_is_idempotent_and_never_opens_a_window(lab, backend, figures):
    web, md, _execd = lab.serve(lab.peer, 8080), lab.serve(lab.peer, 80), lab.serve(
        lab.pod, EXECD_PORT)
    args = ("--backend", backend, "--allow-egress", f"{PEER_V4}:8053",
            "--ingress-from", f"{PEER_V4}/32")
    lab.apply(*args)
    first = (lab.save(4, backend), lab.save(6, backend))
    # A caller with an open connection keeps it across re-runs (conntrack is untouched).
    held = nslab.sock(lab.peer, socket.AF_INET, socket.SOCK_STREAM)
    held.settimeout(2)
    held.connect((POD_PEER_V4, EXECD_PORT))

    stop, leaks, counts, rounds = threading.Event(), [], {"probes": 0}, 0

    def hammer():
        while not stop.is_set():
            for o in (nslab.tcp(lab.pod, PEER_V4, 8080, timeout=0.5),
                      nslab.tcp(lab.pod, PEER_V6, 8080, timeout=0.5),
                      nslab.tcp(lab.pod, METADATA_V4, 80, timeout=0.5),
                      nslab.udp(lab.pod, PEER_V4, 8080, timeout=0.5, payload=b"x"),
                      nslab.tcp(lab.other, POD_OTHER_V4, EXECD_PORT, timeout=0.05)):
                counts["probes"] += 1
                if o.through:
                    leaks.append(o)

    threads = [threading.Thread(target=hammer, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        # Rounds of three restarts, a changed ruleset and back, until the hammer has probed
        # through more than 50 times: a faster guard leaves it less time per run (bounded).
        while rounds < 8 and (rounds == 0 or counts["probes"] <= 50):
            for _ in range(3):
                lab.apply(*args)  # a container restart
            lab.apply(*args[:2], "--allow-egress", f"{PEER_V4}:8054")  # a changed ruleset
            lab.apply(*args)  # ... and back
            rounds += 1
    finally:
        stop.set()
        for t in threads:
            t.join(5)
    assert not leaks, f"{len(leaks)} of {counts['probes']} probes got through during re-runs"
    assert counts["probes"] > 50
    assert (web.accepted, md.accepted) == (0, 0)
    assert (lab.save(4, backend), lab.save(6, backend)) == first  # byte-identical
    assert first[0].count("-j SANDMAN-OUT") == 1 and first[0].count("-j SANDMAN-IN") == 1
    held.sendall(b"still here")
    assert held.recv(64) == b"still here"
    held.close()
    figures.add(f"netguard[{backend}]: {counts['probes']} probes during {5 * rounds} re-runs, "
                "0 through")


def test_rerun_repairs_duplicate_and_misplaced_jumps(lab):
    lab.apply()
    jump = ('-m comment --comment "sandman: netguard egress guard, first rule of OUTPUT" '
            '-j SANDMAN-OUT')
    sh_ipt = ("ip", "netns", "exec", lab.pod, "iptables-nft")
    nslab.sh(*sh_ipt, "-A", "OUTPUT", *shlex.split(jump))  # a duplicate, at the end
    nslab.sh(*sh_ipt, "-I", "OUTPUT", "1", "-m", "comment", "--comment", "not ours",
             "-j", "ACCEPT")  # someone else's rule ahead of ours
    assert lab.netguard("check").returncode == 1
    lab.apply()
    out = lab.save(4)
    assert out.count("-j SANDMAN-OUT") == 1
    output_rules = [x for x in out.splitlines() if x.startswith("-A OUTPUT")]
    assert output_rules[0] == f"-A OUTPUT {jump}"
    assert "not ours" in out  # other rules are never deleted
    assert lab.netguard("check").returncode == 0


def test_check_detects_a_tampered_ruleset(lab):
    lab.apply("--allow-egress", f"{PEER_V4}:8053")
    ok = lab.netguard("check")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    nslab.sh("ip", "netns", "exec", lab.pod, "iptables-nft", "-D", "SANDMAN-OUT", "-p", "tcp",
             "-m", "comment", "--comment", "sandman: egress denied (tcp reset)", "-j", "REJECT",
             "--reject-with", "tcp-reset")
    bad = lab.netguard("check")
    assert bad.returncode == 1 and "SANDMAN-OUT differs" in bad.stdout
    # Options given on the command line override the status file's.
    assert lab.netguard("check", "--egress", "allow").returncode == 1
    lab.apply("--allow-egress", f"{PEER_V4}:8053")
    assert lab.netguard("check").returncode == 0


# ------------------------------------------------------------------ failing closed


def _no_sandman_chains(lab) -> bool:
    return all("SANDMAN" not in lab.save(f) for f in (4, 6))


@pytest.mark.parametrize("path", ["empty", "all-but-restore"])
def test_missing_iptables_restore_fails_closed(lab, tmp_path, path):
    if path == "empty":
        d = tmp_path / "empty-path"
        d.mkdir()
    else:
        d = _fake_path(tmp_path, "iptables-nft-restore", None)
    p = lab.netguard("apply", "--allow-egress", f"{PEER_V4}:8053",
                     env=dict(os.environ, PATH=str(d)))
    assert p.returncode == 1
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "iptables-restore" in lines[0] and "not found" in lines[0], p.stderr
    assert _no_sandman_chains(lab)  # nothing half-installed
    st = status(lab)
    assert st["ok"] is False and st["verified"] is False and "not found" in st["error"]


def _fake_path(tmp_path: Path, broken: str, script: str | None) -> Path:
    """A PATH holding the real nft binaries, except `broken` (absent, or a failing script)."""
    d = tmp_path / f"path-{broken}"
    d.mkdir()
    for fam in ("iptables", "ip6tables"):
        for verb in ("save", "restore"):
            name = f"{fam}-nft-{verb}"
            if name == broken:
                if script is not None:
                    (d / name).write_text(script)
                    (d / name).chmod(0o755)
                continue
            (d / name).symlink_to(shutil.which(name))
    return d


def test_ipv6_restore_failure_fails_closed_and_locks_ipv4_down(lab, tmp_path):
    target = lab.serve(lab.peer, 8053)
    path = _fake_path(tmp_path, "ip6tables-nft-restore",
                      "#!/bin/sh\necho 'ip6tables-restore: line 3 failed' >&2\nexit 1\n")
    p = lab.netguard("apply", "--backend", "nft", "--allow-egress", f"{PEER_V4}:8053",
                     "--ingress-from", f"{PEER_V4}/32",
                     env=dict(os.environ, PATH=f"{path}:/usr/bin:/bin"))
    assert p.returncode == 1
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "ip6tables-nft-restore failed" in lines[0], p.stderr
    assert "ipv4 locked down" in lines[0]
    v4 = lab.save(4)
    assert "lockdown after a failed apply" in v4
    assert "allow egress" not in v4 and "allow port" not in v4  # no allow outlived the failure
    assert "SANDMAN" not in lab.save(6)
    assert blocked_fast(nslab.tcp(lab.pod, PEER_V4, 8053)) and target.accepted == 0
    assert status(lab)["ok"] is False


def test_ipv6_tools_missing_fails_before_anything_is_applied(lab, tmp_path):
    path = _fake_path(tmp_path, "ip6tables-nft-restore", None)
    p = lab.netguard("apply", "--backend", "nft", "--allow-egress", f"{PEER_V4}:8053",
                     env=dict(os.environ, PATH=f"{path}:/usr/bin:/bin"))
    assert p.returncode == 1 and "ipv6" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert _no_sandman_chains(lab)


def test_self_verify_failure_fails_closed(lab):
    target = lab.serve(lab.peer, 8053)
    # A target that must be blocked but is allowed: the guard is not what was asked for.
    p = lab.netguard("apply", "--allow-egress", f"{PEER_V4}:8053",
                     "--verify-blocked", f"{PEER_V4}:8053")
    assert p.returncode == 1 and "self-verify failed" in p.stderr
    assert f"{PEER_V4}:8053 should be blocked but was connected" in p.stderr
    assert "allow egress" not in lab.save(4)  # locked down
    assert blocked_fast(nslab.tcp(lab.pod, PEER_V4, 8053))
    time.sleep(0.3)  # the server thread counts the probe's connection asynchronously
    assert target.accepted == 1  # only the verify probe itself
    st = status(lab)
    assert st["ok"] is False and st["verified"] is False


def test_self_verify_catches_a_guard_that_does_not_answer(lab):
    """A blocked target that only times out did not meet our REJECT: apply must fail."""
    # Make the peer blackhole 10.251.9.9 so the probe can only time out, then ask netguard to
    # verify a target the ruleset *does* allow: connect times out instead of being refused.
    nslab.sh("ip", "netns", "exec", lab.peer, "iptables-nft", "-A", "INPUT", "-d", REMOTE_V4,
             "-j", "DROP")
    p = lab.netguard("apply", "--allow-egress", f"{REMOTE_V4}:9",
                     "--verify-blocked", f"{REMOTE_V4}:9", "--verify-timeout", "0.3")
    assert p.returncode == 1 and "was timeout" in p.stderr


# ------------------------------------------------------------------ environment


def test_backend_auto_joins_the_backend_that_already_has_rules(lab):
    # Someone (kube-proxy, a CNI) already uses legacy in this netns: netguard must join it.
    if not LEGACY:
        pytest.skip("iptables-legacy-* not installed on this machine")
    nslab.sh("ip", "netns", "exec", lab.pod, "iptables-legacy", "-t", "mangle", "-A",
             "PREROUTING", "-m", "comment", "--comment", "someone else", "-j", "RETURN")
    lab.apply()
    assert status(lab)["backend"] == "legacy"
    assert "SANDMAN" in lab.save(4, "legacy") and "SANDMAN" not in lab.save(4, "nft")
    assert blocked_fast(nslab.tcp(lab.pod, PEER_V4, 8080))


def test_backend_auto_reads_legacy_only_where_the_kernel_lists_its_tables(lab, tmp_path):
    """Auto detection skips iptables-legacy-save for a family whose x_tables list is empty in
    this netns (two processes fewer per start), and still joins legacy once it holds rules, both
    families guarded (the ipv6 side known empty without its save)."""
    if not LEGACY:
        pytest.skip("iptables-legacy-* not installed on this machine")
    d = tmp_path / "path"
    d.mkdir()
    calls = tmp_path / "legacy-saves"
    for name in ("iptables-legacy-save", "ip6tables-legacy-save"):
        (d / name).write_text(f"#!/bin/sh\necho {name} >> {calls}\n"
                              f"exec {shutil.which(name)} \"$@\"\n")
        (d / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{d}:{os.environ.get('PATH', '/usr/bin:/bin')}")
    p = lab.netguard("apply", env=env)
    assert p.returncode == 0, p.stderr
    assert status(lab)["backend"] == "nft" and not calls.exists()
    other = nslab.Lab.create(tmp_path / "legacy-lab")
    try:
        nslab.sh("ip", "netns", "exec", other.pod, "iptables-legacy", "-t", "mangle", "-A",
                 "PREROUTING", "-m", "comment", "--comment", "someone else", "-j", "RETURN")
        p = other.netguard("apply", env=env)
        assert p.returncode == 0, p.stderr
        # Detection reads ipv4 only (the kernel lists no ip6 legacy table there); the read-back
        # of what was applied reads both (the saves run in parallel: counted, not ordered).
        assert sorted(calls.read_text().split()) == ["ip6tables-legacy-save",
                                                     "iptables-legacy-save",
                                                     "iptables-legacy-save"]
        st = json.loads(Path(other.status_file).read_text())
        assert st["backend"] == "legacy" and st["families"] == ["ipv4", "ipv6"], st
        assert "SANDMAN" in other.save(6, "legacy") and "SANDMAN" not in other.save(6, "nft")
    finally:
        other.destroy()


def test_backend_auto_defaults_to_nft_in_an_empty_netns(lab):
    lab.apply()
    assert status(lab)["backend"] == "nft"
    if LEGACY:
        assert "SANDMAN" not in lab.save(4, "legacy")


def test_ipv4_only_pod(tmp_path):
    lab = nslab.Lab.create(tmp_path, ipv6=False)
    try:
        lab.serve(lab.peer, 8080)
        lab.apply()
        assert status(lab)["families"] == ["ipv4"]
        assert "SANDMAN" not in lab.save(6)
        assert blocked_fast(nslab.tcp(lab.pod, PEER_V4, 8080))
    finally:
        lab.destroy()


@pytest.mark.parametrize("backend", BACKENDS)
def test_runs_with_only_net_admin_and_net_raw_and_a_read_only_root(lab, backend):
    """The documented security context: every capability dropped but NET_ADMIN and NET_RAW, a
    read-only root filesystem (so no /run/xtables.lock), a writable emptyDir for the status
    file, and no XTABLES_LOCKFILE set. The mounts are made in a private mount namespace."""
    caps = "-all,+net_admin,+net_raw"
    run = lab.status_file.parent
    run.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k != "XTABLES_LOCKFILE"}
    script = (f"set -e; mount -o remount,ro,bind /; mount -t tmpfs tmpfs {run}; "
              "if touch /netguard-ro-probe 2>/dev/null; then rm /netguard-ro-probe; exit 99; fi; "
              f'set +e; "$@"; rc=$?; ls {run}; exit $rc')
    p = lab.netguard("apply", "--backend", backend, "--ingress-from", f"{PEER_V4}/32",
                     env=env,
                     prefix=("unshare", "--mount", "--propagation", "private", "sh", "-c",
                             script, "sh", "setpriv", f"--inh-caps={caps}",
                             f"--ambient-caps={caps}", f"--bounding-set={caps}"))
    assert p.returncode == 0, p.stderr
    assert "verified" in p.stdout and "netguard.json" in p.stdout
    if backend == "legacy":  # the lock went beside the status file
        assert "xtables.lock" in p.stdout
    assert lab.netguard("check", "--ingress-from", f"{PEER_V4}/32").returncode == 0
    assert blocked_fast(nslab.tcp(lab.pod, PEER_V4, 8080))


@pytest.mark.parametrize("backend", BACKENDS)
def test_only_own_chains_are_touched(lab, backend):
    """Rules, chains, tables and policies that are not netguard's survive apply and re-apply
    unchanged; the built-in chains gain exactly one line each, our jump, in first place."""
    ipt = ("ip", "netns", "exec", lab.pod, f"iptables-{backend}")
    nslab.sh(*ipt, "-N", "OTHER")
    nslab.sh(*ipt, "-A", "OTHER", "-m", "comment", "--comment", "someone else", "-j", "RETURN")
    nslab.sh(*ipt, "-A", "OUTPUT", "-j", "OTHER")
    nslab.sh(*ipt, "-A", "INPUT", "-p", "udp", "-j", "ACCEPT")
    nslab.sh(*ipt, "-t", "nat", "-A", "POSTROUTING", "-j", "RETURN")
    nslab.sh(*ipt, "-P", "FORWARD", "DROP")
    before = lab.save(4, backend).splitlines()
    lab.apply("--backend", backend)
    lab.apply("--backend", backend)
    after = lab.save(4, backend).splitlines()
    assert [x for x in after if "SANDMAN" not in x] == before
    added = [x for x in after if x not in before]
    assert sorted(x.split()[0] + " " + x.split()[1] for x in added if x.startswith("-A")) == [
        "-A INPUT", "-A OUTPUT"] + ["-A SANDMAN-IN"] * 4 + ["-A SANDMAN-OUT"] * 7
    assert all('--comment "sandman: ' in x for x in added if x.startswith("-A"))
    for base, chain in (("OUTPUT", "SANDMAN-OUT"), ("INPUT", "SANDMAN-IN")):
        first = next(x for x in after if x.startswith(f"-A {base} "))
        assert first.endswith(f"-j {chain}")
    # The udp ACCEPT placed in INPUT before us now sits behind our jump: our DROP wins.
    lab.serve(lab.pod, 5353, udp=True)
    assert nslab.udp(lab.peer, POD_PEER_V4, 5353, timeout=DROP_WAIT).what == "timeout"


def test_render_live_shows_the_repair_and_writes_nothing(lab):
    lab.apply()
    jump = ('-m comment --comment "sandman: netguard egress guard, first rule of OUTPUT" '
            '-j SANDMAN-OUT')
    nslab.sh("ip", "netns", "exec", lab.pod, "iptables-nft", "-A", "OUTPUT", *shlex.split(jump))
    before = lab.save(4)
    p = lab.netguard("render", "--live", "--family", "ipv4")
    assert p.returncode == 0, p.stderr
    assert p.stdout.count(f"-D OUTPUT {jump}") == 2 and f"-I OUTPUT 1 {jump}" in p.stdout
    assert "-I INPUT" not in p.stdout  # that jump is already right
    assert lab.save(4) == before


def test_check_without_a_status_file_uses_the_defaults(lab):
    lab.apply()
    lab.status_file.unlink()
    assert lab.netguard("check").returncode == 0
    assert lab.netguard("check", "--egress", "allow").returncode == 1


def test_works_with_only_unsuffixed_binaries(lab, tmp_path):
    """Images often ship just iptables-save/-restore (whatever backend they are built for):
    netguard asks them which backend they are and uses them."""
    d = tmp_path / "plain-path"
    d.mkdir()
    for name in ("iptables-save", "iptables-restore", "ip6tables-save", "ip6tables-restore"):
        (d / name).symlink_to(shutil.which(name))
    lab.serve(lab.peer, 8080)
    p = lab.netguard("apply", env=dict(os.environ, PATH=f"{d}:/usr/bin:/bin"))
    assert p.returncode == 0, p.stderr
    plain = nslab.sh(shutil.which("iptables-save"), "--version").stdout
    assert status(lab)["backend"] == ("nft" if "nf_tables" in plain else "legacy")
    assert blocked_fast(nslab.tcp(lab.pod, PEER_V4, 8080))


def test_json_log_lines_from_apply_and_check_in_the_pods_netns(lab):
    """`--log-format json`: every line netguard says is one object (time, level, logger,
    message); the failure line too, on stderr, still one line."""
    import json as _json

    p = lab.netguard("apply", "--log-format", "json")
    assert p.returncode == 0, p.stderr
    lines = [_json.loads(x) for x in p.stdout.splitlines()]
    assert lines and all(set(x) == {"time", "level", "logger", "message"} for x in lines)
    assert lines[-1]["level"] == "INFO" and lines[-1]["message"].startswith("netguard: egress")
    assert lines[-1]["time"].endswith("Z")
    ok = lab.netguard("check", "--log-format", "json")
    assert ok.returncode == 0 and _json.loads(ok.stdout)["message"].startswith("netguard check:")
    bad = lab.netguard("check", "--log-format", "json", "--egress", "allow")  # not what's live
    assert bad.returncode == 1
    assert all(_json.loads(x)["level"] == "ERROR" for x in bad.stdout.splitlines())
    failed = lab.netguard("apply", "--log-format", "json", "--verify-blocked", "not-an-address")
    assert failed.returncode == 1
    err = [_json.loads(x) for x in failed.stderr.splitlines()]
    assert len(err) == 1 and err[0]["level"] == "ERROR" and "netguard apply:" in err[0]["message"]


def test_install_execd_after_the_guard_in_the_pods_netns(lab, tmp_path):
    """A sandbox's one injected init container: `apply --install-execd DIR` guards the netns,
    then leaves in DIR what the sandbox container runs (the launcher, the daemon beside it, all
    read-only, and run/ for the status) and says so."""
    from execd.install import DAEMON, LAUNCHER

    d = tmp_path / "volume"
    d.mkdir()
    p = lab.apply("--install-execd", str(d))
    assert f"execd installed in {d}" in p.stdout
    assert status(lab)["ok"] is True and status(lab)["verified"] is True
    repo = Path(__file__).parents[2] / "execd"
    assert (d / "execd.py").read_bytes() == (repo / LAUNCHER).read_bytes()
    daemon = d / DAEMON / "main.py"
    assert daemon.read_bytes() == (repo / DAEMON / "main.py").read_bytes()
    for f in (d / "execd.py", daemon):
        assert f.stat().st_mode & 0o777 == 0o444, f
    assert (d / "run").is_dir()
    # The guard is in place whatever the install did: the live rules match.
    assert lab.netguard("check").returncode == 0


def test_install_execd_failure_exits_non_zero_with_one_line(lab, tmp_path):
    """An install that cannot write fails the init container (the sandbox never starts without
    sandman's execd) in one line, after the guard is already in place."""
    missing = tmp_path / "no-such-volume"
    p = lab.netguard("apply", "--install-execd", str(missing))
    assert p.returncode == 1, p.stdout
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "execd cannot be installed" in lines[0], p.stderr
    assert not missing.exists()
    assert lab.netguard("check").returncode == 0
