"""The idle rule (--pause-idle-after) on the bed, with RBAC tenants: the real controller
(TokenReview, SubjectAccessReview), kwok pods with a real execd each (the stand-in's
snapshots mode) and the bed's local registry. One test walks the whole path as its holder
and as an attacker of another tenant."""

from __future__ import annotations

import threading

import httpx
import pytest

from sandman import api
from sandman.client import Client, RetryPolicy, SandboxPaused
from testbed.procs import wait_for
from tests.controller.test_auth import bearer
from tests.controller.test_checkpoint_on_testbed import PREFIX, registry  # noqa: F401
from tests.controller.test_fork_on_testbed import IMAGE, SIZE

AFTER_S = 2


@pytest.fixture
def stack(cluster, namespace, tmp_path, registry, tenants):  # noqa: F811
    from testbed.controller import ControllerProc, local_tls_dir
    from testbed.standin import Standin
    from tests.controller.test_fork_on_testbed import Image

    a, b = tenants.namespace("ia"), tenants.namespace("ib")
    for ns in (a, b):
        tenants.account(ns, "trainer")
        tenants.bind(ns, ns, "trainer")
    standin = Standin(cluster.core, namespace, tmp_path / "standin", snapshots=True,
                      before_start=Image()).start()
    ctl = ControllerProc(namespace, cluster.kubeconfig, tmp_path / "controller.log",
                         ["--lease-name", f"idle-{namespace}", "--checkpoint-registry",
                          f"{registry.host}/{PREFIX}", "--checkpoint-insecure",
                          "--pause-idle-after", str(AFTER_S)],
                         ready_check="execd", auth="kubernetes", tls=local_tls_dir())
    try:
        ctl.start()
        yield ctl, standin, tenants.token(a, "trainer"), tenants.token(b, "trainer")
    finally:
        ctl.kill()
        standin.stop()


def leased(h: httpx.Client, ctl, tok: str) -> set[str]:
    items = h.get(ctl.url + api.LIST.path, headers=bearer(tok)).json()["items"]
    return {i["id"] for i in items if i["state"] == "leased"}


def test_an_idle_sandbox_is_paused_and_only_its_tenant_learns_where_it_went(stack):
    ctl, _, tok_a, tok_b = stack
    ca = str(ctl.tls / "ca.crt")
    quick = RetryPolicy(attempts=2, budget_s=2.0, connect_timeout_s=2.0)
    with Client(ctl.url, token=tok_a, ca_file=ca, retry=quick) as cl, \
            httpx.Client(verify=ctl.verify(), timeout=30) as h:
        idle = cl.acquire(IMAGE, job="idle", timeout_s=60, **SIZE)
        busy = cl.acquire(IMAGE, job="idle", timeout_s=60, **SIZE)
        grading = cl.acquire(IMAGE, job="idle", timeout_s=60, role="grading", **SIZE)
        assert idle.exec("echo kept > note.txt").exit_code == 0
        old_addr, old_token = idle.url, f"Bearer {idle._token}"
        # A command far longer than the rule: its sandbox is never counted idle.
        ran: list = []
        t = threading.Thread(target=lambda: ran.append(busy.exec(f"sleep {4 * AFTER_S}")))
        t.start()
        # Only the controller's /activity reads reach the idle one: they keep nothing alive.
        wait_for(lambda: idle.id not in leased(h, ctl, tok_a), 30, "the idle sandbox paused")
        t.join(60)
        assert ran and ran[0].exit_code == 0, ran  # ran to its end, in a sandbox still held
        assert busy.id in leased(h, ctl, tok_a)
        busy.release()

        # Its holder: one line naming the checkpoint; the SDK's typed error carries it.
        r = h.get(ctl.url + api.GET.url(id=idle.id), headers=bearer(tok_a))
        assert r.status_code == 410, r.text
        err = r.json()["error"]
        cid = err["checkpoint"]
        assert err["type"] == "SandboxPaused" and f"checkpoint: {cid}" in err["message"]
        assert "\n" not in err["message"]
        with pytest.raises(SandboxPaused) as got:
            cl.get(idle.id)
        assert got.value.handle == cid
        with pytest.raises(SandboxPaused) as got:  # its next command, through the handle
            idle.exec("true")
        assert got.value.handle == cid

        # Another tenant: what an unknown id gets, and never the checkpoint's id.
        for method, url in (("GET", api.GET.url(id=idle.id)),
                            ("DELETE", api.RELEASE.url(id=idle.id)),
                            ("POST", api.RENEW.url(id=idle.id))):
            r = h.request(method, ctl.url + url, headers=bearer(tok_b),
                          json={} if method == "POST" else None)
            assert r.status_code in (200, 403, 404), (method, r.text)
            assert cid not in r.text and cid.split(".")[1] not in r.text, r.text
            assert "aused" not in r.text, r.text

        # The old token opens nothing: not the old pod's address, not the resumed one's.
        back = cl.resume(cid, timeout_s=60)
        assert back.exec("cat note.txt").output == "kept\n"
        for addr in (old_addr, back.url):
            try:
                r = httpx.post(addr + "/exec", json={"command": "id"},
                               headers={"Authorization": old_token}, timeout=5)
                assert r.status_code == 401, r.text
            except httpx.TransportError:
                pass  # the paused pod's execd is gone
        back.release()
        assert grading.id in leased(h, ctl, tok_a)  # grading sandboxes are never paused
        grading.release()
        text = h.get(ctl.url + "/metrics").text
    assert 'sandman_controller_idle_pauses_total{result="ok"} ' in text
    assert 'sandman_controller_idle_pauses_total{result="ok"} 0.0' not in text
