"""TLS of the controller API (controller/tls.py, docs/controller.md "TLS"): refusal of plain
http with authentication, certificate rotation without a restart, and standby-to-leader
forwarding that verifies the leader. Real files, real TLS sockets on 127.0.0.1, real
controller processes against the test bed (the fast forwarding cases without a cluster are in
tests/controller/test_forward.py)."""

from __future__ import annotations

import os
import socket
import ssl
import time
from pathlib import Path

import httpx
import pytest
from cryptography import x509

from controller import __main__ as controller_main
from sandman import api
from testbed.controller import ControllerProc
from testbed.procs import wait_for
from tests.cli import Ran, run_main, run_module
from webhook import certs as C

IMAGE = "registry.invalid/swe/task:1"  # kwok never pulls
SVC = "sandman-controller.sandman-system.svc"  # what the chart's certificate names


def kubelet_update(volume: Path, files: dict[str, bytes]) -> None:
    """Write `files` into `volume` as the kubelet updates a Secret volume: the files are
    symlinks `name -> ..data/name`, and an update swaps the `..data` symlink atomically to a
    new timestamped directory (so cert and key change together)."""
    volume.mkdir(exist_ok=True)
    ts = volume / f"..{time.time_ns()}"
    ts.mkdir()
    for name, data in files.items():
        (ts / name).write_bytes(data)
    tmp = volume / "..data_tmp"
    os.symlink(ts.name, tmp)
    os.replace(tmp, volume / "..data")
    for name in files:
        if not (volume / name).is_symlink():
            os.symlink(f"..data/{name}", volume / name)


def pair(ca: tuple[bytes, bytes], dns: list[str], ips: list[str] = ()) -> dict[str, bytes]:
    cert, key = C.new_serving(ca[0], ca[1], dns, list(ips))
    return {"tls.crt": cert, "tls.key": key}


def served(port: int, cadata: bytes, server_name: str = "127.0.0.1") -> x509.Certificate:
    """The certificate a fresh TLS handshake with 127.0.0.1:port gets, verified with `cadata`
    for `server_name`."""
    ctx = ssl.create_default_context(cadata=cadata.decode())
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            ctx.wrap_socket(raw, server_hostname=server_name) as tls:
        return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True))


def serves(port: int, cadata: bytes, files: dict[str, bytes]) -> bool:
    """True when a fresh handshake gets `files`' certificate (verified with `cadata`)."""
    try:
        return served(port, cadata).serial_number == serial(files)
    except ssl.SSLError:
        return False


def serial(files: dict[str, bytes]) -> int:
    return x509.load_pem_x509_certificate(files["tls.crt"]).serial_number


SERVE = ["serve", "--namespace", "x", "--kubeconfig", "/nonexistent"]


def serve(*extra: str) -> Ran:
    """`python -m controller serve ...` in-process (test_python_m_controller_is_main proves
    the module runs the same main)."""
    return run_main(controller_main.main, [*SERVE, *extra])


def test_python_m_controller_is_main():
    """The command line the chart runs reaches main: the first refusal, one line, exit 2."""
    p = run_module("controller", SERVE)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().count("\n") == 0 and "needs TLS" in p.stderr, p.stderr


def test_authentication_without_tls_refuses_to_start():
    """Fail closed: `--auth kubernetes` (the default) over plain http would send callers'
    ServiceAccount tokens and the sandbox tokens in clear text; it starts only when told so
    with --insecure-http. Each refusal is one line and exit 2, before anything else."""
    p = serve()
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().count("\n") == 0 and "needs TLS" in p.stderr, p.stderr
    for bad, says in ((["--tls-cert-file", "/x.crt"], "go together"),
                      (["--tls-key-file", "/x.key"], "go together"),
                      (["--insecure-http", "--tls-cert-file", "/a", "--tls-key-file", "/b"],
                       "contradicts"),
                      (["--insecure-http", "--ca-configmap", "ns/name"], "needs --tls-ca-file"),
                      (["--tls-cert-file", "/nonexistent.crt", "--tls-key-file", "/n.key"],
                       "cannot load the TLS certificate")):
        p = serve(*bad)
        assert p.returncode == 2 and says in p.stderr, (bad, p.stderr)
        assert p.stderr.strip().count("\n") == 0, p.stderr
    # --insecure-http gets past the check (and fails later, on the missing kubeconfig).
    p = serve("--insecure-http")
    assert p.returncode == 2 and "needs TLS" not in p.stderr, p.stderr
    p = serve("--auth", "none")  # no tokens at all: plain http is allowed (local use)
    assert p.returncode == 2 and "needs TLS" not in p.stderr, p.stderr


def test_a_renewed_certificate_is_served_without_a_restart(cluster, namespace, tmp_path):
    """The Secret volume updated as the kubelet does it (same CA, then a new CA whose bundle
    holds both, then a broken write): new handshakes get the new pair within the check
    interval, the process is the same, a kept-alive connection keeps working, and a pair
    that does not load never replaces the one being served."""
    vol = tmp_path / "tls"
    ca1 = C.new_ca("test-ca-1")
    first = pair(ca1, ["localhost"], ["127.0.0.1"])
    kubelet_update(vol, {**first, "ca.crt": ca1[0]})
    ctl = ControllerProc(namespace, cluster.kubeconfig, tmp_path / "controller.log",
                         ["--lease-name", f"tls-{namespace}", "--tls-reload-interval", "0.5"],
                         tls=vol).start()
    try:
        pid = ctl.pid
        port = ctl.port
        assert served(port, ca1[0]).serial_number == serial(first)
        ca2 = C.new_ca("test-ca-2")
        both = ca2[0] + ca1[0]  # the bundle during a CA rotation: newest first
        with httpx.Client(verify=ssl.create_default_context(cadata=both.decode())) as kept:
            assert kept.get(ctl.url + api.READYZ.path).status_code == 200

            # 1. Renewed by the same CA.
            second = pair(ca1, ["localhost"], ["127.0.0.1"])
            kubelet_update(vol, {**second, "ca.crt": ca1[0]})
            wait_for(lambda: serves(port, ca1[0], second), 10,
                     "the renewed certificate to be served")

            # 2. A new CA: the Secret's bundle holds both CAs, the pair is the new CA's.
            third = pair(ca2, ["localhost"], ["127.0.0.1"])
            kubelet_update(vol, {**third, "ca.crt": both})
            wait_for(lambda: serves(port, ca2[0], third), 10,
                     "the certificate of the new CA to be served")
            with pytest.raises(ssl.SSLCertVerificationError):
                served(port, ca1[0])  # the old CA alone no longer verifies it

            # 3. A pair that does not load (a key of another certificate): the last good one
            # keeps serving, checked over several intervals.
            kubelet_update(vol, {"tls.crt": pair(ca2, ["localhost"])["tls.crt"],
                                 "tls.key": third["tls.key"], "ca.crt": both})
            for _ in range(4):
                time.sleep(0.5)
                assert served(port, ca2[0]).serial_number == serial(third)
            # The connection opened before all this still answers; no restart happened.
            assert kept.get(ctl.url + api.READYZ.path).status_code == 200
        assert ctl.alive() and ctl.pid == pid
        log = ctl.log.read_text()
        assert log.count("serving certificate loaded") == 3, log[-3000:]
        assert "reload failed, keeping the loaded pair" in log, log[-3000:]
    finally:
        ctl.stop()


class SNI(httpx.Client):
    """An https client to 127.0.0.1 that verifies the server as `name` (as a trainer that
    reaches the Service by its DNS name would)."""

    def __init__(self, cadata: bytes, name: str = SVC):
        super().__init__(verify=ssl.create_default_context(cadata=cadata.decode()), timeout=60)
        self.name = name

    def request(self, *a, **kw):
        kw["extensions"] = {**(kw.get("extensions") or {}), "sni_hostname": self.name}
        return super().request(*a, **kw)


def _start(proc: ControllerProc, cadata: bytes, role: str) -> ControllerProc:
    proc.start(wait_ready=False)
    with SNI(cadata) as h:
        def ready() -> bool:
            assert proc.alive(), proc.tail()
            try:
                r = h.get(proc.url + api.READYZ.path)
            except httpx.HTTPError:
                return False
            return r.status_code == 200 and r.json().get("role") == role
        wait_for(ready, 30, f"{role} ready")
    return proc


def test_a_standby_forwards_over_tls_and_verifies_the_leader(cluster, namespace, tmp_path):
    """Leader and standby serve a certificate naming only the Service (as the chart's does):
    the standby reaches the leader by its pod IP (127.0.0.1 here), verifies it against the
    CA for --tls-server-name, and the call is served. A standby that trusts another CA
    forwards nothing: the caller gets NotLeader (retryable), never an unverified hop."""
    ca = C.new_ca("test-ca")
    files = {**pair(ca, [SVC]), "ca.crt": ca[0]}  # no IP SAN, no localhost
    good = tmp_path / "tls"
    kubelet_update(good, files)
    stranger = C.new_ca("someone-else")
    wrong = tmp_path / "tls-wrong-ca"
    kubelet_update(wrong, {**files, "ca.crt": stranger[0]})
    lease = f"tls-ha-{namespace}"
    procs = []

    def replica(tls: Path, i: int) -> ControllerProc:
        p = ControllerProc(namespace, cluster.kubeconfig, tmp_path / f"controller-{i}.log",
                           ["--lease-name", lease, "--advertise-address", "127.0.0.1",
                            "--tls-server-name", SVC], tls=tls)
        procs.append(p)
        return p

    try:
        leader = _start(replica(good, 0), ca[0], "leader")
        standby = _start(replica(good, 1), ca[0], "standby")
        doubter = _start(replica(wrong, 2), ca[0], "standby")
        body = {"image": IMAGE, "cpu": "100m", "memory": "128Mi", "job": "via-standby",
                "timeout_s": 30}
        with SNI(ca[0]) as h:
            r = h.post(standby.url + api.ACQUIRE.path, json=body)
            assert r.status_code == 201, r.text
            sid = r.json()["id"]
            assert h.get(leader.url + api.GET.url(id=sid)).json()["state"] == "leased"
            r = h.post(doubter.url + api.ACQUIRE.path, json=body)
            assert r.status_code == 503 and r.json()["error"]["type"] == "NotLeader", r.text
            assert h.delete(standby.url + api.RELEASE.url(id=sid)).json()["released"] is True
            # Only the one acquire reached the leader's books.
            assert [s["id"] for s in h.get(leader.url + api.LIST.path).json()["items"]
                    if s["state"] == "leased"] == []
        log = doubter.log.read_text()
        assert "CERTIFICATE_VERIFY_FAILED" in log or "certificate verify failed" in log, \
            log[-3000:]
    finally:
        for p in procs:
            p.kill()
