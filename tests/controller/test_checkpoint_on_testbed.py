"""Checkpoints against the test bed: the real controller, kwok pods with a real execd behind
each (the stand-in's `snapshots` mode, as fork's tests: each pod's execd rooted at its own
directory, its "image"), and the bed's real local registry (testbed/registry.py: crane's
registry, over plain http on 127.0.0.1). The trees are compared from the host."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from sandman import api
from sandman.client import BadRequest, CheckpointFailed, CheckpointGone, Client
from testbed.procs import wait_for
from tests.controller.harness import unowned
from tests.controller.test_fork_on_testbed import IMAGE, SIZE, leased, live, metric, stack, tree

PREFIX = "sandman/checkpoints"
BOOKS_KEY = "<books key file>"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def registry(cluster):
    from testbed.registry import LocalRegistry

    reg = LocalRegistry(cluster.testbed).start()
    try:
        yield reg
    finally:
        reg.stop()


@pytest.fixture
def bed(cluster, namespace, tmp_path, registry, request):
    extra = list(getattr(request, "param", ()))
    if BOOKS_KEY in extra:  # a key file of this test's own
        key = tmp_path / "books.key"
        key.write_bytes(b"k" * 32)
        extra[extra.index(BOOKS_KEY)] = str(key)
    flags = ("--checkpoint-registry", f"{registry.host}/{PREFIX}", "--checkpoint-insecure",
             *extra)
    ctl, standin, image = stack(cluster, namespace, tmp_path, *flags)
    try:
        ctl.start()
        yield ctl, standin, image, registry
    finally:
        ctl.kill()
        standin.stop()


def shape(sb, n: int) -> None:
    """A sandbox's own changes: files, a deletion, a mode, a link, a cwd, an exported
    variable (and one that is not)."""
    r = sb.exec(f"set -e; mkdir -p work/d{n}; printf 'n={n}\\n' > work/d{n}/a.txt; "
                "rm img/drop.txt; chmod 600 img/keep.txt; ln -s a.txt work/d{n}/link; "
                f"cd work/d{n}; export WHO='sb {n}'; LOCAL=1".replace("{n}", str(n)))
    assert r.exit_code == 0, r


def shell_state(sb, home: Path) -> tuple[str, str]:
    """The shell's cwd (under the pod's root) and exported variable; a variable that was not
    exported is carried nowhere ("unset" in a restored sandbox)."""
    out = sb.exec('pwd; echo "${WHO-unset}"; echo "${LOCAL-unset}"').output.split("\n")
    if out[2] != "unset":
        assert out[2] == "1"  # the original shell's own
    return os.path.relpath(out[0], home), out[1]


def local_var(sb) -> str:
    return sb.exec('echo "${LOCAL-unset}"').output.strip()


def tags(reg) -> list[str]:
    r = httpx.get(f"http://{reg.host}/v2/{PREFIX}/local/tags/list", timeout=10)
    return [] if r.status_code == 404 else r.json().get("tags") or []


def test_a_jobs_checkpoint_restores_every_tree_cwd_and_env(cluster, namespace, bed):
    ctl, standin, _, reg = bed
    root = standin.workdir
    with Client(ctl.url) as cl:
        sbs = [cl.acquire(IMAGE, job="ck", timeout_s=60, **SIZE) for _ in range(3)]
        g = cl.acquire(IMAGE, job="ck", timeout_s=60, role="grading", **SIZE)
        for i, sb in enumerate(sbs):
            shape(sb, i)
        want = {sb.id: (tree(root / sb.pod), shell_state(sb, root / sb.pod)) for sb in sbs}
        ck = cl.checkpoint(job="ck", timeout_s=120)
        # The job's grading sandbox is left out; each sandbox is one artifact.
        assert {s.id for s in ck.sandboxes} == set(want) and g.id not in ck.id
        assert all(s.digest.startswith("sha256:") and s.bytes > 0 for s in ck.sandboxes)
        assert ck.id.startswith("local.") and len(tags(reg)) == 1
        got = cl.restore(ck.id, timeout_s=120)
        assert set(got) == set(want)
        for i, sb in enumerate(sbs):
            assert want[sb.id][1] == (f"work/d{i}", f"sb {i}")
        for old, new in got.items():
            assert new.id not in want and new.pod not in {sb.pod for sb in sbs}
            assert tree(root / new.pod) == want[old][0], old
            assert shell_state(new, root / new.pod) == want[old][1], old
            assert local_var(new) == "unset"
        # The originals run on, untouched by the restore.
        got[sbs[0].id].exec("printf mine > only-here")
        assert tree(root / sbs[0].pod) == want[sbs[0].id][0]
    wait_for(lambda: not live(cluster, namespace), 30, "every pod deleted")
    assert metric(ctl, 'sandman_controller_checkpoints_total{result="ok"}') == 1
    assert metric(ctl, 'sandman_controller_restores_total{result="ok"}') == 1
    assert metric(ctl, "sandman_controller_restored_sandboxes_total") == 3


TRAINER = textwrap.dedent("""
    import json, os, sys, time
    from sandman.client import Client
    url, n, out, image = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    cl = Client(url)
    sbs = [cl.acquire(image, job="crash", timeout_s=120, cpu="1", memory="1Gi")
           for _ in range(n)]
    for i, sb in enumerate(sbs):
        r = sb.exec(f"set -e; mkdir -p w/{i}; printf {i} > w/{i}/f; rm img/drop.txt; "
                    f"cd w/{i}; export STEP={i}")
        assert r.exit_code == 0, r
    ck = cl.checkpoint(job="crash", timeout_s=300)
    with open(out + ".tmp", "w") as f:
        json.dump({"id": ck.id, "pods": {sb.id: sb.pod for sb in sbs}}, f)
    os.rename(out + ".tmp", out)
    time.sleep(3600)  # killed here, its handles never released
""")

RESTORER = textwrap.dedent("""
    import json, sys
    from sandman.client import Client
    url, cid = sys.argv[1], sys.argv[2]
    cl = Client(url)
    got = cl.restore(cid, timeout_s=300)
    out = {}
    for old, sb in got.items():
        r = sb.exec('pwd; echo "$STEP"')
        out[old] = {"pod": sb.pod, "id": sb.id, "shell": r.output}
        sb.detach()
    print(json.dumps(out))
""")


def test_a_killed_trainers_sixteen_sandboxes_are_restored_by_id_in_a_new_process(
        cluster, namespace, bed, tmp_path):
    """The trainer process acquires 16 sandboxes, changes each, checkpoints the job and is
    killed with SIGKILL; a new process restores by the id alone: every tree and shell state
    is the one its old sandbox had."""
    ctl, standin, _, _ = bed
    root = standin.workdir
    out = tmp_path / "checkpoint.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_PROXY": "127.0.0.1"}
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, ctl.url, "16", str(out), IMAGE],
                               env=env, cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    try:
        wait_for(lambda: out.exists() or trainer.poll() is not None, 400, "the checkpoint")
        assert out.exists(), trainer.communicate()[1].decode()[-2000:]
        os.kill(trainer.pid, signal.SIGKILL)
    finally:
        trainer.kill()
        trainer.wait()
    saved = json.loads(out.read_text())
    old_pods = saved["pods"]
    assert len(old_pods) == 16
    want = {old: tree(root / pod) for old, pod in old_pods.items()}
    r = subprocess.run([sys.executable, "-c", RESTORER, ctl.url, saved["id"]], env=env,
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(got) == set(want)
    for old, new in got.items():
        assert new["pod"] not in old_pods.values()
        assert tree(root / new["pod"]) == want[old], old
        cwd, step = new["shell"].split("\n")[:2]
        assert cwd == str(root / new["pod"] / "w" / step), new
        assert (root / old_pods[old] / "w" / step / "f").read_text() == step, new
    with Client(ctl.url) as cl:
        cl.drain("crash")
    wait_for(lambda: not live(cluster, namespace), 60, "every pod deleted")


def test_an_artifact_changed_in_the_registry_is_refused_and_nothing_is_made(
        cluster, namespace, bed):
    """A sandbox's manifest replaced in the registry (under its digest, by whoever may push
    there) by another sandbox's: the restore reads it by digest, sees other bytes and refuses
    before any pod is made. A state blob changed on the registry's disk is refused too (this
    registry itself will not serve it)."""
    ctl, standin, _, reg = bed
    with Client(ctl.url) as cl:
        a = cl.acquire(IMAGE, job="tamper", timeout_s=60, **SIZE)
        b = cl.acquire(IMAGE, job="tamper", timeout_s=60, **SIZE)
        shape(a, 7)
        shape(b, 8)
        ck = cl.checkpoint(ids=[a.id, b.id])
        da, db = (s.digest for s in ck.sandboxes)
        base = f"http://{reg.host}/v2/{PREFIX}/local/manifests/"
        accept = {"Accept": "application/vnd.oci.image.manifest.v1+json"}
        first = httpx.get(base + da, headers=accept, timeout=10).content
        second = httpx.get(base + db, headers=accept, timeout=10).content
        before = live(cluster, namespace)

        layer = json.loads(first)["layers"][0]["digest"].partition(":")[2]
        blob = reg.dir / "blobs" / "sha256" / layer
        kept = blob.read_bytes()
        blob.write_bytes(kept[:100] + bytes([kept[100] ^ 1]) + kept[101:])
        with pytest.raises(CheckpointFailed) as err:
            cl.restore(ck.id, timeout_s=60)
        assert "\n" not in str(err.value) and layer in str(err.value)
        assert live(cluster, namespace) == before and leased(ctl) == {a.id, b.id}
        blob.write_bytes(kept)

        r = httpx.put(base + da, content=second, timeout=10,
                      headers={"Content-Type": "application/vnd.oci.image.manifest.v1+json"})
        assert r.status_code == 201, r.text
        assert httpx.get(base + da, headers=accept, timeout=10).content == second
        with pytest.raises(CheckpointFailed, match="refused") as err:
            cl.restore(ck.id, timeout_s=60)
        assert "\n" not in str(err.value) and da in str(err.value)
        assert live(cluster, namespace) == before and leased(ctl) == {a.id, b.id}
        # An id whose digest names no index of this tenant is no checkpoint.
        with pytest.raises(CheckpointGone):
            cl.restore("local." + "0" * 64)
    assert metric(ctl, 'sandman_controller_restores_total{result="tampered"}') == 1
    assert metric(ctl, 'sandman_controller_restores_total{result="registry"}') == 1


def test_a_grading_sandbox_is_never_checkpointed_nor_paused(cluster, namespace, bed):
    ctl, _, _, reg = bed
    with Client(ctl.url) as cl:
        g = cl.acquire(IMAGE, job="grade", timeout_s=60, role="grading", **SIZE)
        with pytest.raises(BadRequest, match="never checkpointed"):
            cl.checkpoint(ids=[g.id])
        with pytest.raises(BadRequest, match="never checkpointed"):
            g.pause()
        assert tags(reg) == [] and leased(ctl) == {g.id}
        g.release()


@pytest.mark.parametrize("bed", [("--checkpoint-max-bytes", "20000")], indirect=True)
def test_a_checkpoint_over_the_size_bound_fails_and_keeps_nothing(cluster, namespace, bed):
    ctl, _, _, reg = bed
    with Client(ctl.url) as cl:
        small = cl.acquire(IMAGE, job="size", timeout_s=60, **SIZE)
        big = cl.acquire(IMAGE, job="size", timeout_s=60, **SIZE)
        big.exec("head -c 65536 /dev/urandom > blob")
        with pytest.raises(CheckpointFailed, match="bound") as err:
            cl.checkpoint(job="size", timeout_s=60)
        assert "\n" not in str(err.value)
        assert tags(reg) == []
        assert cl.checkpoint(ids=[small.id]).sandboxes[0].bytes < 20000
        assert leased(ctl) == {small.id, big.id}
    assert metric(ctl, 'sandman_controller_checkpoints_total{result="size"}') == 1


def test_a_restore_whose_one_sandbox_refuses_leaves_nothing(cluster, namespace, bed):
    """One new pod is of another image (one more file in its base): its execd refuses the
    state (409); the restore fails whole, every sandbox it had made is released."""
    ctl, standin, image, _ = bed
    with Client(ctl.url) as cl:
        sbs = [cl.acquire(IMAGE, job="half", timeout_s=60, **SIZE) for _ in range(3)]
        for i, sb in enumerate(sbs):
            shape(sb, i)
        ck = cl.checkpoint(job="half")
        image.poison = 1
        with pytest.raises(CheckpointFailed) as err:
            cl.restore(ck.id, timeout_s=60)
        msg = str(err.value)
        assert "\n" not in msg and "409" in msg and image.poisoned[0] in msg, msg
        mine = {sb.id for sb in sbs}
        wait_for(lambda: leased(ctl) == mine, 30, "only the originals leased")
        time.sleep(1)
        assert unowned(cluster.core, namespace, ctl.url, {sb.pod for sb in sbs}) == []
        for name in live(cluster, namespace) - {sb.pod for sb in sbs}:
            assert not (standin.workdir / name / "work").exists(), name
    assert metric(ctl, 'sandman_controller_restores_total{result="apply"}') == 1


@pytest.mark.parametrize("bed", [("--checkpoint-ttl", "3", "--checkpoint-sweep-interval",
                                  "1")], indirect=True)
def test_a_checkpoint_past_its_ttl_is_refused_and_swept_from_the_registry(
        cluster, namespace, bed):
    ctl, _, _, reg = bed
    with Client(ctl.url) as cl:
        sb = cl.acquire(IMAGE, job="ttl", timeout_s=60, **SIZE)
        shape(sb, 1)
        ck = cl.checkpoint(ids=[sb.id])
        assert len(tags(reg)) == 1
        digest = ck.sandboxes[0].digest
        wait_for(lambda: tags(reg) == [], 30, "the expired checkpoint swept")
        r = httpx.get(f"http://{reg.host}/v2/{PREFIX}/local/manifests/{digest}", timeout=10)
        assert r.status_code == 404
        with pytest.raises(CheckpointGone):
            cl.restore(ck.id)
        assert leased(ctl) == {sb.id}
    assert metric(ctl, "sandman_controller_checkpoints_expired_total") == 1


def test_pause_releases_and_resume_restores(cluster, namespace, bed):
    ctl, standin, _, _ = bed
    root = standin.workdir
    with Client(ctl.url) as cl:
        sb = cl.acquire(IMAGE, job="pause", timeout_s=60, **SIZE)
        shape(sb, 4)
        want = tree(root / sb.pod), shell_state(sb, root / sb.pod)
        handle = sb.pause()
        wait_for(lambda: leased(ctl) == set(), 30, "the paused sandbox released")
        back = cl.resume(handle, timeout_s=60)
        assert (tree(root / back.pod), shell_state(back, root / back.pod)) == want


def test_nemo_gym_makes_a_sandbox_from_a_checkpoint(cluster, namespace, bed, tmp_path):
    """NeMo Gym's Sandbox with sandman's provider option `checkpoint` (sandman.client.nemo_gym,
    run by its own code in .venv-frameworks): the paused sandbox's tree is in the new one; an
    id naming no checkpoint is NeMo Gym's SandboxCreateError in one line; nothing left."""
    from tests.client.test_nemo_gym import run_checks

    ctl = bed[0]
    with Client(ctl.url) as cl:
        sb = cl.acquire(IMAGE, job="nemo", timeout_s=60, **SIZE)
        assert sb.exec("echo from-before > note.txt").exit_code == 0
        handle = sb.pause()
    got = run_checks("resume", handle.id, env={"SANDMAN_URL": ctl.url, "HOME": str(tmp_path)})
    assert got["note"] == ["from-before\n", 0], got
    assert got["missing"].startswith("sandman provider: ") and "\n" not in got["missing"], got
    wait_for(lambda: leased(ctl) == set(), 30, "every sandbox released")


def test_another_tenant_cannot_restore_my_checkpoint(tenants, authctl, registry):
    """With RBAC: tenant B may not restore an id of tenant A (403, before the registry is
    asked); A's own unknown id is CheckpointGone (404)."""
    from tests.controller.test_auth import bearer

    a, b = tenants.namespace("ca"), tenants.namespace("cb")
    for ns in (a, b):
        tenants.account(ns, "trainer")
        tenants.bind(ns, ns, "trainer")
    tok_a, tok_b = tenants.token(a, "trainer"), tenants.token(b, "trainer")
    ctl = authctl("--checkpoint-registry", f"{registry.host}/{PREFIX}", "--checkpoint-insecure")
    cid = f"{a}.{'ab' * 32}"
    with httpx.Client(verify=ctl.verify(), timeout=30) as h:
        r = h.post(ctl.url + api.RESTORE.url(id=cid), json={}, headers=bearer(tok_b))
        assert r.status_code == 403, r.text
        assert "another tenant" in r.json()["error"]["message"]
        r = h.post(ctl.url + api.RESTORE.url(id=cid), json={}, headers=bearer(tok_a))
        assert r.status_code == 404, r.text
        assert r.json()["error"]["type"] == api.CHECKPOINT_GONE.type


def test_the_cli_checkpoints_and_restores(cluster, namespace, bed, tmp_path):
    ctl, standin, _, _ = bed
    import contextlib
    import io

    from sandman.client import cli

    with Client(ctl.url) as cl:
        sb = cl.acquire(IMAGE, job="cli", timeout_s=60, **SIZE)
        sb.exec("printf cli > marker")
        os.environ[cli.ENV_LEASE_DIR] = str(tmp_path / "leases")
        try:
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                assert cli.main(["--url", ctl.url, "-o", "json", "checkpoint", "--job",
                                 "cli"]) == 0
            ck = json.loads(buf.getvalue())
            assert [s["id"] for s in ck["sandboxes"]] == [sb.id]
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                assert cli.main(["--url", ctl.url, "-o", "json", "restore", ck["id"]]) == 0
            got = json.loads(buf.getvalue())
            assert [sorted(g) for g in got] == [["expires_at", "id", "lease_file", "old",
                                                 "pod"]]
            assert got[0]["old"] == sb.id and Path(got[0]["lease_file"]).exists()
            assert (standin.workdir / got[0]["pod"] / "marker").read_bytes() == b"cli"
            assert cli.main(["--url", ctl.url, "release", got[0]["id"]]) == 0
            assert cli.main(["--url", ctl.url, "restore", "local." + "0" * 64]) == cli.EXIT_NOT_FOUND
        finally:
            os.environ.pop(cli.ENV_LEASE_DIR, None)
        sb.release()


def test_the_cli_pauses_and_resumes(cluster, namespace, bed, tmp_path):
    """`sandman pause ID` (a lease kept here by acquire): checkpoint, release, the lease file
    gone, the handle printed; `sandman resume HANDLE`: the sandbox made anew with its state,
    its lease kept here."""
    ctl, standin, _, _ = bed
    import contextlib
    import io

    from sandman.client import cli

    os.environ[cli.ENV_LEASE_DIR] = str(tmp_path / "leases")
    try:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert cli.main(["--url", ctl.url, "-o", "json", "acquire", IMAGE, "--job", "clip",
                             "--cpu", SIZE["cpu"], "--memory", SIZE["memory"]]) == 0
        held = json.loads(buf.getvalue())
        assert cli.main(["--url", ctl.url, "exec", held["id"], "--",
                         "printf paused > marker"]) == 0
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert cli.main(["--url", ctl.url, "-o", "json", "pause", held["id"]]) == 0
        handle = json.loads(buf.getvalue())
        assert [s["id"] for s in handle["sandboxes"]] == [held["id"]]
        assert not Path(held["lease_file"]).exists()
        wait_for(lambda: held["id"] not in leased(ctl), 30,
                 "the paused sandbox released")
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert cli.main(["--url", ctl.url, "-o", "json", "resume", handle["id"]]) == 0
        got = json.loads(buf.getvalue())
        assert len(got) == 1 and Path(got[0]["lease_file"]).exists()
        assert (standin.workdir / got[0]["pod"] / "marker").read_bytes() == b"paused"
        assert cli.main(["--url", ctl.url, "release", got[0]["id"]]) == 0
    finally:
        os.environ.pop(cli.ENV_LEASE_DIR, None)


@pytest.mark.parametrize("bed", [("--books-key-file", BOOKS_KEY)], indirect=True)
def test_an_index_rewritten_in_the_registry_fails_the_books_keys_proof(cluster, namespace,
                                                                        bed):
    """Whoever may push to the registry writes a new index (its own digest, so its own id):
    the set's expiry pushed a year out, every other byte kept, the old proof with it. Under a
    books key the proof binds the times, the tenant and the sandboxes: refused, nothing made."""
    ctl, _, _, reg = bed
    with Client(ctl.url) as cl:
        sb = cl.acquire(IMAGE, job="forge", timeout_s=60, **SIZE)
        shape(sb, 3)
        ck = cl.checkpoint(ids=[sb.id])
        base = f"http://{reg.host}/v2/{PREFIX}/local/manifests/"
        media = "application/vnd.oci.image.index.v1+json"
        index = httpx.get(base + "sha256:" + ck.id.partition(".")[2],
                          headers={"Accept": media}, timeout=10).json()
        key = "sandman.dev/checkpoint.expires"
        index["annotations"][key] = "2099" + index["annotations"][key][4:]
        body = json.dumps(index, sort_keys=True, separators=(",", ":")).encode()
        r = httpx.put(base + "forged", content=body, headers={"Content-Type": media},
                      timeout=10)
        assert r.status_code == 201, r.text
        forged = "local." + r.headers["Docker-Content-Digest"].partition(":")[2]
        before = live(cluster, namespace)
        with pytest.raises(CheckpointFailed, match="proof") as err:
            cl.restore(forged, timeout_s=60)
        assert "\n" not in str(err.value)
        assert live(cluster, namespace) == before and leased(ctl) == {sb.id}
        # The set as the controller wrote it restores.
        got = cl.restore(ck.id, timeout_s=60)
        assert list(got) == [sb.id]


@pytest.mark.parametrize("bed", [("--rate", "1", "--burst", "1")], indirect=True)
def test_a_caller_that_leaves_mid_restore_leaves_no_sandbox(cluster, namespace, bed):
    """Creates paced at 1/s: the caller of a restore of 3 gives up after 1.5 s, while its pods
    are still being made; the ones handed out are released, the rest withdrawn or parked
    never handed out; no pod but the originals holds their state."""
    ctl, standin, _, _ = bed
    with Client(ctl.url) as cl:
        sbs = [cl.acquire(IMAGE, job="leave", timeout_s=60, **SIZE) for _ in range(3)]
        for i, sb in enumerate(sbs):
            shape(sb, i)
        ck = cl.checkpoint(job="leave")
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{ctl.url}{api.RESTORE.url(id=ck.id)}", json={},
                       timeout=httpx.Timeout(1.5))
        wait_for(lambda: metric(ctl, 'sandman_controller_restores_total{result='
                                     '"client_closed"}') == 1, 30, "the restore saw it")
        mine = {sb.id for sb in sbs}
        wait_for(lambda: leased(ctl) == mine, 30, "only the originals leased")
        time.sleep(2)  # creates already sent settle (parked warm, or deleted)
        assert leased(ctl) == mine
        pods = {sb.pod for sb in sbs}
        assert unowned(cluster.core, namespace, ctl.url, pods) == []
        for name in live(cluster, namespace) - pods:
            assert not (standin.workdir / name / "work").exists(), name


@pytest.mark.parametrize("bed", [("--lease-duration", "3", "--lease-renew", "1")],
                         indirect=True)
def test_after_a_controller_crash_the_holder_still_checkpoints_and_pauses(cluster, namespace,
                                                                          bed):
    """As fork (test_fork_on_testbed.py): the new leader learns each token back from the
    holder's call, checkpoint by ids and by job, and pause; a caller without the tokens is
    refused as before."""
    ctl, standin, _, _ = bed
    with Client(ctl.url) as cl:
        a = cl.acquire(IMAGE, job="crash", timeout_s=60, **SIZE)
        b = cl.acquire(IMAGE, job="crash", timeout_s=60, **SIZE)
        a.exec("printf kept > marker")
        ctl.kill()
        ctl.start(timeout=30)
        r = httpx.post(ctl.url + api.CHECKPOINT.path, json={"job": "crash"}, timeout=60)
        assert r.status_code == 502 and "token" in r.json()["error"]["message"], r.text
        assert cl.checkpoint(job="crash", timeout_s=60).id  # the SDK sends both tokens
        handle = a.pause(timeout_s=60)
        back = cl.resume(handle, timeout_s=60)
        assert back.exec("cat marker").output == "kept"
        for sb in (back, b):
            sb.release()
