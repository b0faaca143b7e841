"""The idle rule (--pause-idle-after) on the bed, with RBAC tenants: the real controller
(TokenReview, SubjectAccessReview), kwok pods with a real execd each (the stand-in's
snapshots mode) and the bed's local registry. One test walks the whole path as its holder
and as an attacker of another tenant."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from controller.paused import RECORD_NAME, PausedSandbox, encode
from sandman import api
from sandman.client import CheckpointFailed, Client, RetryPolicy, SandboxPaused
from testbed.procs import wait_for
from tests.controller.test_auth import bearer
from tests.controller.test_checkpoint_on_testbed import PREFIX, registry  # noqa: F401
from tests.controller.test_fork_on_testbed import IMAGE, SIZE

AFTER_S = 2


def _stack(cluster, namespace, tmp_path, registry, tenants, *flags: str):  # noqa: F811
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
                          f"{registry.host}/{PREFIX}", "--checkpoint-insecure", *flags],
                         ready_check="execd", auth="kubernetes", tls=local_tls_dir())
    try:
        ctl.start()
        yield ctl, standin, tenants.token(a, "trainer"), tenants.token(b, "trainer"), a, b
    finally:
        ctl.kill()
        standin.stop()


@pytest.fixture
def stack(cluster, namespace, tmp_path, registry, tenants):  # noqa: F811
    yield from _stack(cluster, namespace, tmp_path, registry, tenants,
                      "--pause-idle-after", str(AFTER_S))


def leased(h: httpx.Client, ctl, tok: str) -> set[str]:
    items = h.get(ctl.url + api.LIST.path, headers=bearer(tok)).json()["items"]
    return {i["id"] for i in items if i["state"] == "leased"}


def test_an_idle_sandbox_is_paused_and_only_its_tenant_learns_where_it_went(stack):
    ctl, _, tok_a, tok_b, _, _ = stack
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


KEY = b"p" * 32
RESTART_AFTER_S = 4  # long enough that the explicitly paused sandbox is not the rule's first


@pytest.fixture
def restartable(cluster, namespace, tmp_path, registry, tenants):  # noqa: F811
    key = tmp_path / "books.key"
    key.write_bytes(KEY)
    # A short lease: the restarted controller leads within seconds of the crash.
    yield from _stack(cluster, namespace, tmp_path, registry, tenants,
                      "--pause-idle-after", str(RESTART_AFTER_S), "--books-key-file", str(key),
                      "--lease-duration", "3", "--lease-renew", "1")


def paused_record(cluster, namespace) -> dict:
    from kubernetes.client import ApiException

    try:
        cm = cluster.core.read_namespaced_config_map(RECORD_NAME, namespace)
    except ApiException as ex:
        if ex.status == 404:
            return {}
        raise
    return dict(cm.data or {})


def test_a_paused_sandbox_is_still_found_by_its_holder_after_a_controller_crash(
        cluster, namespace, restartable):
    ctl, _, tok_a, tok_b, ns_a, ns_b = restartable
    ca = str(ctl.tls / "ca.crt")
    quick = RetryPolicy(attempts=2, budget_s=2.0, connect_timeout_s=2.0)

    def asked_by_b(h: httpx.Client, sid: str, cids: list[str]) -> None:
        # Another tenant: what an unknown id gets, and never a checkpoint's id.
        r = h.get(ctl.url + api.GET.url(id=sid), headers=bearer(tok_b))
        assert r.status_code == 404, r.text
        assert "aused" not in r.text and not any(c.split(".")[1] in r.text for c in cids)

    with Client(ctl.url, token=tok_a, ca_file=ca, retry=quick) as cl, \
            httpx.Client(verify=ctl.verify(), timeout=30) as h:
        held = cl.acquire(IMAGE, job="crash", timeout_s=60, **SIZE)
        # A record that cannot be written (the API server refuses to change an immutable
        # ConfigMap): the pause fails, naming its checkpoint, and the sandbox stays leased.
        cluster.core.create_namespaced_config_map(namespace, {
            "metadata": {"name": RECORD_NAME}, "immutable": True, "data": {}})
        with pytest.raises(CheckpointFailed, match="stays leased") as e:
            held.pause(timeout_s=60)
        assert "could not be recorded" in str(e.value) and "\n" not in str(e.value)
        cluster.core.delete_namespaced_config_map(RECORD_NAME, namespace)
        assert held.id in leased(h, ctl, tok_a)
        idle = cl.acquire(IMAGE, job="crash", timeout_s=60, **SIZE)
        # Grading: never paused, it stays a live sandbox of tenant a through the test.
        live = cl.acquire(IMAGE, job="crash", timeout_s=60, role="grading", **SIZE)
        assert held.exec("echo kept > note.txt").exit_code == 0
        cid = held.pause(timeout_s=60).id  # the holder's pause: the handle it may lose
        wait_for(lambda: idle.id not in leased(h, ctl, tok_a), 30, "the idle one paused")
        idle_cid = h.get(ctl.url + api.GET.url(id=idle.id),
                         headers=bearer(tok_a)).json()["error"]["checkpoint"]
        # Recorded in the API server before the pause was done.
        record = paused_record(cluster, namespace)
        assert {held.id, idle.id} <= set(record), record
        for sid in (held.id, idle.id):
            asked_by_b(h, sid, [cid, idle_cid])

        # Planted entries: tenant a's live sandbox claimed for tenant b with a valid proof (the
        # key's holder: only the live sandbox's own tenant decides), an id claimed for tenant
        # b without one, a checkpoint of tenant a under tenant b's job, garbage. None of them
        # makes an answer 410 for tenant b.
        until = int(time.time()) + 3600
        claim = PausedSandbox(f"{ns_b}.crash", f"{ns_b}." + "a" * 64, until)
        forged = {
            live.id: encode(live.id, claim, KEY, namespace),
            "sbx-forged-0123456789": encode("sbx-forged-0123456789", claim, None, namespace),
            "sbx-planted-0123456789": json.dumps(
                {"job": f"{ns_b}.crash", "checkpoint": cid, "until": until}),
            "sbx-garbage-0123456789": "{" * 2000,
        }
        cluster.core.patch_namespaced_config_map(RECORD_NAME, namespace, {"data": forged})

        ctl.kill()  # a crash: nothing of the leader's memory survives
        ctl.start(timeout=30)
        for sid, want in ((held.id, cid), (idle.id, idle_cid)):
            r = h.get(ctl.url + api.GET.url(id=sid), headers=bearer(tok_a))
            assert r.status_code == 410, r.text
            err = r.json()["error"]
            assert err["type"] == "SandboxPaused" and err["checkpoint"] == want, err
            with pytest.raises(SandboxPaused) as e:
                cl.get(sid)
            assert e.value.handle == want
            asked_by_b(h, sid, [cid, idle_cid])
        with pytest.raises(SandboxPaused) as e:  # the idle one's handle, its next command
            idle.exec("true")
        assert e.value.handle == idle_cid
        for sid in ("sbx-forged-0123456789", "sbx-planted-0123456789",
                    "sbx-garbage-0123456789"):
            r = h.get(ctl.url + api.GET.url(id=sid), headers=bearer(tok_b))
            assert r.status_code == 404, r.text
        r = h.get(ctl.url + api.GET.url(id=live.id), headers=bearer(tok_b))
        assert r.status_code in (403, 404) and "aused" not in r.text, r.text
        r = h.get(ctl.url + api.GET.url(id=live.id), headers=bearer(tok_a))
        assert r.status_code == 200 and r.json()["state"] == "leased", r.text
        # The planted entries were refused and deleted; the real ones (and the one with a
        # valid proof, which decides nothing) kept.
        record = paused_record(cluster, namespace)
        assert set(record) == {held.id, idle.id, live.id}, record

        back = cl.resume(cid, timeout_s=60)
        assert back.exec("cat note.txt").output == "kept\n"
        back.release()
        cl.release(live.id)
