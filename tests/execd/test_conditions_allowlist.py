"""The declared `egress_allow` condition read from a real execd: the status file netguard
writes (its own Config, serialised as netguard does) is what execd reports, and the
controller's Checker, over a real socket with the sandbox token, verifies a declared list
against it or refuses the pod. The egress probe is a real TCP connect to a loopback listener.
"""

from __future__ import annotations

import asyncio
import json
import socket

from controller.conditions import Checker
from netguard.config import Config
from sandman.client import Sandbox

from .conftest import TOKEN

ENTRY = "198.18.0.1/32:8181/tcp"


def _status(tmp_path, allow: list[str], ok: bool = True, mode: str = "deny") -> None:
    config = Config.from_strings(egress=mode, allow_egress=allow)
    (tmp_path / "netguard.json").write_text(json.dumps(
        {"ok": ok, "mode": mode, "options": config.to_dict()}))


def _check(d, declared: dict, probe: str | None = None):
    async def go():
        checker = Checker(d.port, timeout=5.0, egress_probe=probe)
        try:
            return await checker.check("127.0.0.1", TOKEN, declared)
        finally:
            await checker.close()
    return asyncio.run(go())


def test_the_applied_list_is_read_and_verified(execd_factory, tmp_path):
    _status(tmp_path, [ENTRY, "10.0.0.0/8:443/tcp"])
    d = execd_factory()
    got = d.get("/conditions").json()
    assert got["netguard_allow_egress"] == [ENTRY, "10.0.0.0/8:443/tcp"]  # as recorded
    with Sandbox.connect("127.0.0.1", d.port, TOKEN) as sb:  # the grader's own reading
        assert sb.conditions().netguard_allow_egress == [ENTRY, "10.0.0.0/8:443/tcp"]
    v = _check(d, {"egress": "deny", "egress_allow": ["10.0.0.0/8:443/tcp", ENTRY]})
    assert v.ok and v.verified["egress_allow"] == ["10.0.0.0/8:443/tcp", ENTRY], v
    # A pod whose guard applied another list is refused.
    v = _check(d, {"egress_allow": [ENTRY]})
    assert v.contradicted == [("egress_allow", [ENTRY], ["10.0.0.0/8:443/tcp", ENTRY])]


def test_a_failed_or_missing_guard_reads_nothing(execd_factory, tmp_path):
    d = execd_factory()
    assert d.get("/conditions").json()["netguard_allow_egress"] is None  # no status file
    assert _check(d, {"egress_allow": [ENTRY]}).unverified == ["egress_allow"]
    _status(tmp_path, [ENTRY], ok=False)
    assert d.get("/conditions").json()["netguard_allow_egress"] is None
    # The sandbox's own forgery needs write access to the guard's volume (read-only there);
    # one that is not a list of strings reads as nothing, never as an allowlist.
    (tmp_path / "netguard.json").write_text(json.dumps(
        {"ok": True, "mode": "deny", "options": {"allow_egress": [ENTRY, 7]}}))
    assert d.get("/conditions").json()["netguard_allow_egress"] is None


def test_a_reachable_probe_address_refuses_the_pod(execd_factory, tmp_path):
    _status(tmp_path, [ENTRY])
    d = execd_factory()
    # A second socket on the port, bound and never listening, holds it once the listener has
    # closed: no other process can be given it before the second probe.
    with socket.create_server(("127.0.0.1", 0), reuse_port=True) as srv, \
            socket.socket() as hold:
        port = srv.getsockname()[1]
        hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        hold.bind(("127.0.0.1", port))
        target = f"127.0.0.1:{port}"
        v = _check(d, {"egress_allow": [ENTRY]}, probe=target)
        assert not v.ok and f"{target} reachable" in v.message(), v
        srv.close()
        # Nothing listens there any more: the probe fails, the list verifies.
        assert _check(d, {"egress_allow": [ENTRY]}, probe=target).ok
