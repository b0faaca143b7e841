"""netguard's egress allowlists on a real kernel: never ranges carved out before the allow
rules, Service entries resolved through the pod's own resolver, every refusal fail-closed.

The pod's resolver is a tiny DNS server this test runs on 127.0.0.1:53 inside the pod's
namespace, named by /etc/netns/<pod>/resolv.conf (`ip netns exec` mounts it over
/etc/resolv.conf for netguard alone). Every answer is an address of the lab (nslab.py).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import threading
import time
from pathlib import Path

import pytest

from tests.netguard import nslab
from tests.netguard.nslab import METADATA_V4, PEER_V4, PEER_V6, REMOTE_V4

pytestmark = [pytest.mark.netns, pytest.mark.timeout(120)]

FAST_MS = 200


@pytest.fixture(scope="module", autouse=True)
def _prerequisites():
    missing = nslab.missing_prerequisites()
    if missing:
        pytest.fail(f"netguard netns tests need {', '.join(missing)}; install them "
                    f"(`make deps`) and run as root", pytrace=False)


@pytest.fixture
def lab(tmp_path):
    lab = nslab.Lab.create(tmp_path)
    etc = Path("/etc/netns") / lab.pod
    try:
        yield lab
    finally:
        shutil.rmtree(etc, ignore_errors=True)
        lab.destroy()
        assert not etc.exists()


def blocked_fast(o: nslab.Outcome) -> bool:
    return not o.through and o.what != "timeout" and o.ms < FAST_MS


def status(lab) -> dict:
    return json.loads(Path(lab.status_file).read_text())


def env(**extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
    return {**e, **extra}


def one_line_failure(p) -> str:
    assert p.returncode == 1, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    return lines[0]


def no_sandman_chains(lab) -> bool:
    return all("SANDMAN" not in lab.save(f) for f in (4, 6))


# ------------------------------------------------------------------ a resolver for the pod


class Dns:
    """Answers A and AAAA questions from `records` (name -> addresses) on 127.0.0.1:53 in the
    pod's namespace; an unknown name gets NXDOMAIN; `silent` answers nothing at all."""

    def __init__(self, lab: nslab.Lab, records: dict[str, list[str]], silent: bool = False):
        self.records, self.silent, self.asked = records, silent, []
        self._sock = nslab.sock(lab.pod, socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind(("127.0.0.1", 53))
        self._sock.settimeout(0.1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        etc = Path("/etc/netns") / lab.pod
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "resolv.conf").write_text(
            "nameserver 127.0.0.1\nsearch default.svc.cluster.local svc.cluster.local "
            "cluster.local\noptions ndots:5 timeout:1 attempts:1\n")

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                data, peer = self._sock.recvfrom(512)
            except (TimeoutError, OSError):
                continue
            if self.silent or len(data) < 12:
                continue
            with_answer = self._answer(data)
            if with_answer:
                self._sock.sendto(with_answer, peer)

    def _answer(self, query: bytes) -> bytes | None:
        qid, _flags, qd = struct.unpack("!HHH", query[:6])
        if qd != 1:
            return None
        labels, i = [], 12
        while i < len(query) and query[i]:
            n = query[i]
            labels.append(query[i + 1:i + 1 + n].decode())
            i += 1 + n
        qtype = struct.unpack("!H", query[i + 1:i + 3])[0]
        question = query[12:i + 5]
        name = ".".join(labels).lower()
        self.asked.append((name, qtype))
        if name not in self.records:
            return struct.pack("!HHHHHH", qid, 0x8183, 1, 0, 0, 0) + question  # NXDOMAIN
        values, owner, answers, count = self.records[name], b"\xc0\x0c", b"", 0
        if values and values[0].startswith("cname:"):  # an alias, then the target's records
            target = values[0][6:]
            wire = _name(target)
            answers += struct.pack("!HHIH", 5, 1, 30, len(wire)) + wire
            answers = owner + answers
            owner, values, count = wire, self.records.get(target, []), 1
        fam, size = (socket.AF_INET, 4) if qtype == 1 else (socket.AF_INET6, 16)
        rdata = [socket.inet_pton(fam, a) for a in values
                 if (":" in a) == (fam == socket.AF_INET6)] if qtype in (1, 28) else []
        answers += b"".join(owner + struct.pack("!HHIH", qtype, 1, 30, size) + r for r in rdata)
        return (struct.pack("!HHHHHH", qid, 0x8180, 1, count + len(rdata), 0, 0) + question
                + answers)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sock.close()


def _name(name: str) -> bytes:
    return b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"


@pytest.fixture
def dns(lab):
    servers: list[Dns] = []

    def start(records: dict[str, list[str]], silent: bool = False) -> Dns:
        d = Dns(lab, records, silent)
        servers.append(d)
        return d

    yield start
    for d in servers:
        d.close()


# ------------------------------------------------------------------ carve-outs


def test_a_never_range_inside_an_allow_entry_is_carved_out_and_verified(lab):
    web = lab.serve(lab.peer, 8080)  # the peer also holds REMOTE_V4
    # Positive control: the wide entry alone reaches both addresses of the peer.
    lab.apply("--allow-egress", "10.251.0.0/16:8080/tcp", env=env())
    assert nslab.tcp(lab.pod, PEER_V4, 8080, payload=b"x").through
    assert nslab.tcp(lab.pod, REMOTE_V4, 8080, payload=b"x").through
    # The admin's never range inside it: refused at once, before the allow rule.
    lab.apply("--allow-egress", "10.251.0.0/16:8080/tcp", "--never-egress", f"{REMOTE_V4}/32",
              env=env())
    assert nslab.tcp(lab.pod, PEER_V4, 8080, payload=b"x").through
    o = nslab.tcp(lab.pod, REMOTE_V4, 8080)
    assert blocked_fast(o) and o.what == "refused", o
    assert blocked_fast(nslab.udp(lab.pod, REMOTE_V4, 8080, payload=b"x"))
    st = status(lab)
    assert st["ok"] and st["verified"]
    never = [p for p in st["probes"] if p["target"].startswith("never ")]
    assert never == [{"target": f"never {REMOTE_V4}:8080", "want": "blocked",
                      "outcome": "refused", "ms": never[0]["ms"], "ok": True}]
    assert st["options"]["never_egress"] == [f"{REMOTE_V4}/32"]
    time.sleep(0.3)
    assert web.accepted == 3  # the two controls and the allowed connect; never the carve-out
    assert lab.netguard("check", env=env()).returncode == 0


def test_the_api_server_from_the_kubelets_env_is_carved_out(lab):
    lab.serve(lab.peer, 443)
    lab.apply("--allow-egress", "10.251.0.0/16:443/tcp", env=env(KUBERNETES_SERVICE_HOST=REMOTE_V4))
    assert blocked_fast(nslab.tcp(lab.pod, REMOTE_V4, 443))
    assert nslab.tcp(lab.pod, PEER_V4, 443, payload=b"x").through
    assert status(lab)["options"]["api_server"] == [REMOTE_V4]
    # `check` re-renders from the status file: the carve-out is part of what it compares.
    assert lab.netguard("check", env=env()).returncode == 0
    nslab.sh("ip", "netns", "exec", lab.pod, "iptables-nft", "-D", "SANDMAN-OUT", "-d",
             f"{REMOTE_V4}/32", "-p", "tcp", "-m", "comment", "--comment",
             f"sandman: never egress {REMOTE_V4}/32 (tcp reset)", "-j", "REJECT",
             "--reject-with", "tcp-reset")
    p = lab.netguard("check", env=env())
    assert p.returncode == 1 and "MISMATCH" in p.stdout + p.stderr


@pytest.mark.parametrize("entry,never,api,why", [
    (f"{METADATA_V4}/32:80/tcp", None, None, "link-local/metadata"),
    (f"{REMOTE_V4}/32:443/tcp", None, REMOTE_V4, "the API server"),
    ("10.251.9.0/24:443/tcp", "10.251.0.0/16", None, "--never-egress"),
])
def test_an_entry_inside_a_never_range_fails_closed_before_any_rule(lab, entry, never, api, why):
    args = ["apply", "--allow-egress", entry] + (["--never-egress", never] if never else [])
    p = lab.netguard(*args, env=env(**({"KUBERNETES_SERVICE_HOST": api} if api else {})))
    line = one_line_failure(p)
    assert "inside never range" in line and why in line
    assert no_sandman_chains(lab)


# ------------------------------------------------------------------ Service entries


def test_a_service_entry_opens_exactly_its_addresses_on_its_port(lab, dns):
    web, other = lab.serve(lab.peer, 3141), lab.serve(lab.peer, 3142)
    server = dns({"pypi.infra.svc.cluster.local": [PEER_V4, PEER_V6]})
    lab.apply("--allow-egress", "svc/pypi.infra:3141", env=env())
    assert ("pypi.infra.svc.cluster.local", 1) in server.asked  # absolute: no search walk
    assert all(name == "pypi.infra.svc.cluster.local" for name, _ in server.asked)
    assert nslab.tcp(lab.pod, PEER_V4, 3141, payload=b"x").through
    assert nslab.tcp(lab.pod, PEER_V6, 3141, payload=b"x").through
    for o in (nslab.tcp(lab.pod, PEER_V4, 3142),  # another port of the same address
              nslab.udp(lab.pod, PEER_V4, 3141, payload=b"x"),  # the entry is tcp
              nslab.tcp(lab.pod, REMOTE_V4, 3141),  # another address, same port
              nslab.tcp(lab.pod, METADATA_V4, 3141)):
        assert blocked_fast(o), o
    st = status(lab)
    assert st["ok"] and st["options"]["allow_egress"] == ["svc/pypi.infra:3141/tcp"]
    assert st["options"]["service_addresses"] == [
        ["svc/pypi.infra:3141/tcp", f"{PEER_V4}/32"], ["svc/pypi.infra:3141/tcp",
                                                       f"{PEER_V6}/128"]]
    time.sleep(0.3)
    assert web.accepted == 2 and other.accepted == 0
    # `check` needs no resolver: it compares with the recorded addresses.
    server.close()
    assert lab.netguard("check", env=env()).returncode == 0


@pytest.mark.parametrize("records,api,why", [
    ({}, None, "does not resolve"),  # NXDOMAIN
    ({"pypi.infra.svc.cluster.local": [METADATA_V4]}, None, "link-local/metadata"),
    ({"pypi.infra.svc.cluster.local": [PEER_V4, REMOTE_V4]}, REMOTE_V4, "is never allowed"),
])
def test_a_service_that_does_not_resolve_or_resolves_into_never_fails_closed(lab, dns, records,
                                                                           api, why):
    dns(records)
    p = lab.netguard("apply", "--allow-egress", "svc/pypi.infra:3141/tcp",
                     env=env(**({"KUBERNETES_SERVICE_HOST": api} if api else {})))
    line = one_line_failure(p)
    assert "svc/pypi.infra:3141/tcp" in line and why in line, line
    assert no_sandman_chains(lab)


def test_an_external_name_service_is_refused_whatever_it_points_at(lab, dns):
    """A Service of an admitted namespace that is an ExternalName (a CNAME) could point the
    entry at any host; here at the lab's peer, which the entry would otherwise open."""
    lab.serve(lab.peer, 3141)
    dns({"pypi.infra.svc.cluster.local": ["cname:mirror.example.test"],
         "mirror.example.test": [PEER_V4]})
    line = one_line_failure(lab.netguard("apply", "--allow-egress", "svc/pypi.infra:3141/tcp",
                                         env=env()))
    assert "an alias for mirror.example.test" in line, line
    assert no_sandman_chains(lab)
    # (The same address as the Service's own answer is admitted: the test above.)


def test_a_service_named_in_etc_hosts_is_refused(lab, dns):
    """The kubelet writes a pod's hostAliases into /etc/hosts of every container, netguard's
    too, and the resolver reads it before DNS: the pod's author would pick the address (the
    webhook refuses such pods first; this holds for a hand-written guard)."""
    lab.serve(lab.peer, 3141)
    dns({"pypi.infra.svc.cluster.local": [PEER_V4]})
    (Path("/etc/netns") / lab.pod / "hosts").write_text(
        f"127.0.0.1 localhost\n{REMOTE_V4}\tpypi.infra.svc.cluster.local  # hostAliases\n")
    line = one_line_failure(lab.netguard("apply", "--allow-egress", "svc/pypi.infra:3141/tcp",
                                         env=env()))
    assert "is named in /etc/hosts" in line, line
    assert no_sandman_chains(lab)


def test_a_service_answering_with_too_many_addresses_fails_closed(lab, dns):
    """A headless Service answers with its pods: past the bound, no rule is rendered."""
    from netguard.resolve import MAX_ADDRESSES

    many = [f"10.251.{i // 250}.{i % 250 + 1}" for i in range(MAX_ADDRESSES + 1)]
    dns({"pods.infra.svc.cluster.local": many})
    line = one_line_failure(lab.netguard("apply", "--allow-egress", "svc/pods.infra:80/tcp",
                                         env=env()))
    assert f"more than {MAX_ADDRESSES}" in line, line
    assert no_sandman_chains(lab)


def test_a_resolver_that_never_answers_fails_closed_within_the_bound(lab, dns):
    dns({}, silent=True)
    t0 = time.monotonic()
    p = lab.netguard("apply", "--allow-egress", "svc/pypi.infra:3141/tcp", env=env())
    took = time.monotonic() - t0
    line = one_line_failure(p)
    assert "did not resolve within" in line or "does not resolve" in line, line
    assert took < 30  # the resolve bound (5 s) plus the interpreter, not the resolver's retries
    assert no_sandman_chains(lab)


def test_a_service_entry_outside_a_pod_fails_closed(lab):
    etc = Path("/etc/netns") / lab.pod
    etc.mkdir(parents=True)
    (etc / "resolv.conf").write_text("nameserver 127.0.0.1\nsearch example.com\n")
    line = one_line_failure(lab.netguard("apply", "--allow-egress", "svc/pypi.infra:3141",
                                         env=env()))
    assert "no svc.<cluster domain>" in line
    assert no_sandman_chains(lab)
