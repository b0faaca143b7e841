"""Fork against the test bed: the real controller, kwok pods and a real execd behind each
(testbed/standin.py). Each agent pod's execd is rooted at its own directory (the stand-in's
`snapshots`), which is the pod's "image": the same files, modes and mtimes in every pod, planted
before its execd starts, so every pod of the key records the same snapshot base.

The trees are compared from the host (the stand-in's pod directories are on this machine): what
the child's execd wrote, not what it says it wrote."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import json
import os
import stat
import threading
import time
from pathlib import Path

import httpx
import pytest

from sandman import api, contract
from sandman.client import AcquireTimeout, BadRequest, Client, ForkFailed
from testbed.procs import wait_for
from tests.controller.harness import pods, unowned

IMAGE = "registry.invalid/swe/task:1"  # kwok never pulls
SIZE = {"cpu": "1", "memory": "1Gi"}
IMAGE_FILES = {"img/keep.txt": b"kept\n", "img/drop.txt": b"dropped\n",
               "img/change.txt": b"before\n", "img/tool.sh": b"#!/bin/sh\necho tool\n"}
IMAGE_MTIME = 1_700_000_000


class Image:
    """Plants the pod's "image" before its execd starts; `poison` pods get one more file (a
    pod of another image: its execd refuses a snapshot taken elsewhere)."""

    def __init__(self) -> None:
        self.poison = 0
        self.lock = threading.Lock()
        self.poisoned: list[str] = []

    def __call__(self, pod: str, home: Path) -> None:
        files = dict(IMAGE_FILES)
        with self.lock:
            if self.poison:
                self.poison -= 1
                self.poisoned.append(pod)
                files["img/other-image"] = b"not the parent's image\n"
        for rel, data in files.items():
            p = home / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
            p.chmod(0o755 if rel.endswith(".sh") else 0o644)
            os.utime(p, (IMAGE_MTIME, IMAGE_MTIME))


def stack(cluster, namespace: str, tmp_path: Path, *flags: str):
    from testbed.controller import ControllerProc
    from testbed.standin import Standin

    image = Image()
    standin = Standin(cluster.core, namespace, tmp_path / "standin", snapshots=True,
                      before_start=image).start()
    ctl = ControllerProc(namespace, cluster.kubeconfig, tmp_path / "controller.log",
                         ["--lease-name", f"fork-{namespace}", *flags], ready_check="execd")
    return ctl, standin, image


@pytest.fixture
def bed(cluster, namespace, tmp_path, request):
    flags = getattr(request, "param", ())
    ctl, standin, image = stack(cluster, namespace, tmp_path, *flags)
    try:
        ctl.start()
        yield ctl, standin, image
    finally:
        ctl.kill()
        standin.stop()


def tree(home: Path) -> dict[str, tuple]:
    """Every entry under a pod's root: (kind, mode, sha256 or link target)."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(home):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(home))
            st = os.lstat(p)
            mode = stat.S_IMODE(st.st_mode)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", mode, os.readlink(p))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", mode, None)
            else:
                out[rel] = ("file", mode, hashlib.sha256(p.read_bytes()).hexdigest())
    return out


def live(cluster, namespace) -> set[str]:
    return {p.metadata.name for p in pods(cluster.core, namespace)
            if not p.metadata.deletion_timestamp and (p.metadata.labels or {}).get(
                contract.LABEL_STATE) != contract.STATE_DELETING}


def metric(ctl, name: str) -> float:
    for line in httpx.get(f"{ctl.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def shape(sb) -> None:
    """The parent's changes: added, changed and deleted files, a symlink, modes, a cwd and an
    exported variable (and one that is not exported)."""
    r = sb.exec("set -e; mkdir -p work/sub; printf 'new\\n' > work/sub/a.txt; "
                "printf 'after\\n' > img/change.txt; rm img/drop.txt; chmod 600 img/keep.txt; "
                "ln -s sub/a.txt work/link; chmod 750 work/sub; printf x > work/sub/run; "
                "chmod 711 work/sub/run; cd work/sub; export FORKED='a b'; LOCAL=1")
    assert r.exit_code == 0, r


def test_fork_carries_the_tree_cwd_and_env_and_children_are_independent(
        cluster, namespace, bed):
    ctl, standin, _ = bed
    root = standin.workdir
    with Client(ctl.url) as cl:
        parent = cl.acquire(IMAGE, job="search", timeout_s=60, **SIZE)
        shape(parent)
        want = tree(root / parent.pod)
        assert "img/drop.txt" not in want and want["work/link"] == ("link", 0o777, "sub/a.txt")
        kids = parent.fork(3, timeout_s=120)
        assert len(kids) == 3 and len({k.pod for k in kids} | {parent.pod}) == 4
        for k in kids:
            assert k.job == parent.job and k.image == parent.image
            assert tree(root / k.pod) == want, k.pod
            out = k.exec('pwd; echo "${FORKED-unset}|${LOCAL-unset}"').output.split("\n")
            assert out[0] == str(root / k.pod / "work/sub"), out
            assert out[1] == "a b|unset", out
        kids[0].exec("printf mine > only-here; printf changed > ../sub/a.txt")
        assert tree(root / parent.pod) == want
        for k in kids[1:]:
            assert tree(root / k.pod) == want, k.pod
        assert "work/sub/only-here" in tree(root / kids[0].pod)
        assert parent.exec("cat a.txt").output == "new\n"
        for k in kids:
            k.release()
        parent.release()
    wait_for(lambda: not live(cluster, namespace), 30, "every pod deleted")
    assert metric(ctl, 'sandman_controller_forks_total{result="ok"}') == 1
    assert metric(ctl, "sandman_controller_fork_children_total") == 3


def test_the_cli_forks_and_prints_the_children(cluster, namespace, bed, tmp_path):
    ctl, standin, _ = bed
    from sandman.client import cli

    with Client(ctl.url) as cl:
        parent = cl.acquire(IMAGE, job="cli", timeout_s=60, **SIZE)
        parent.exec("printf cli > marker")
        os.environ[cli.ENV_LEASE_DIR] = str(tmp_path / "leases")
        try:
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                assert cli.main(["--url", ctl.url, "-o", "json", "fork", parent.id,
                                 "-n", "2"]) == 0
            kids = json.loads(buf.getvalue())
            assert [sorted(k) for k in kids] == [["expires_at", "id", "lease_file", "pod"]] * 2
            for k in kids:
                assert (standin.workdir / k["pod"] / "marker").read_bytes() == b"cli"
                assert Path(k["lease_file"]).exists()
                assert cli.main(["--url", ctl.url, "release", k["id"]]) == 0
        finally:
            os.environ.pop(cli.ENV_LEASE_DIR, None)
        parent.release()


@pytest.mark.parametrize("bed", [("--job-max-live", "3")], indirect=True)
def test_a_child_that_cannot_be_had_fails_the_fork_and_leaves_no_child(cluster, namespace,
                                                                      bed):
    """The job's cap reached mid-fork: two children are had, the third waits for a slot until
    the fork's timeout; the two are released and the error is the acquire's, in one line."""
    ctl, standin, _ = bed
    with Client(ctl.url) as cl:
        parent = cl.acquire(IMAGE, job="capped", timeout_s=60, **SIZE)
        parent.exec("printf x > marker")
        with pytest.raises(AcquireTimeout) as err:
            parent.fork(3, timeout_s=8)
        msg = str(err.value)
        assert "\n" not in msg and "child" in msg and parent.id in msg, msg
        no_child_left(cluster, namespace, ctl, standin, parent)
        assert parent.exec("cat marker").output == "x"
        parent.release()
    assert metric(ctl, 'sandman_controller_forks_total{result="acquire"}') == 1


def no_child_left(cluster, namespace, ctl, standin, parent) -> None:
    """Only the parent is handed out; any other pod is a never-given-out one the pool kept (a
    create whose caller, the fork, had left: parked warm, ownerless) and holds none of the
    parent's state."""
    wait_for(lambda: leased(ctl) == {parent.id}, 30, "only the parent leased")
    assert unowned(cluster.core, namespace, ctl.url, {parent.pod}) == []
    for name in live(cluster, namespace) - {parent.pod}:
        assert not (standin.workdir / name / "marker").exists(), name


def leased(ctl) -> set[str]:
    items = httpx.get(f"{ctl.url}{api.LIST.path}", timeout=10).json()["items"]
    return {i["id"] for i in items if i["state"] == "leased"}


def test_a_child_whose_execd_refuses_fails_the_fork_and_leaves_no_child(cluster, namespace,
                                                                        bed):
    """One child is of another image (one more file in its base): its execd refuses the
    snapshot (409); the other children, which took it, are released too."""
    ctl, standin, image = bed
    with Client(ctl.url) as cl:
        parent = cl.acquire(IMAGE, job="refuse", timeout_s=60, **SIZE)
        parent.exec("printf x > marker")
        image.poison = 1
        with pytest.raises(ForkFailed) as err:
            parent.fork(3, timeout_s=60)
        msg = str(err.value)
        assert "\n" not in msg and "409" in msg and image.poisoned[0] in msg, msg
        no_child_left(cluster, namespace, ctl, standin, parent)
        parent.release()
    assert metric(ctl, 'sandman_controller_forks_total{result="apply"}') == 1


def test_a_grading_sandbox_is_never_forked(cluster, namespace, bed):
    ctl, _, _ = bed
    with Client(ctl.url) as cl:
        g = cl.acquire(IMAGE, job="grade", timeout_s=60, role="grading", **SIZE)
        with pytest.raises(BadRequest, match="never forked") as err:
            g.fork(1)
        assert "\n" not in str(err.value)
        assert live(cluster, namespace) == {g.pod}
        g.release()
    assert metric(ctl, 'sandman_controller_forks_total{result="refused"}') == 1


@pytest.mark.parametrize("bed", [("--snapshot-base", "off")], indirect=True)
def test_without_a_snapshot_base_fork_is_refused_before_any_pod(cluster, namespace, bed):
    """--snapshot-base off: agent pods carry no SANDMAN_SNAPSHOT (no stat walk at start), and a
    fork is refused in one line before a child is made: each child's execd would refuse the
    state only after the pods were had."""
    ctl, _, _ = bed
    with Client(ctl.url) as cl:
        parent = cl.acquire(IMAGE, job="nobase", timeout_s=60, **SIZE)
        pod = cluster.core.read_namespaced_pod(parent.pod, namespace)
        env = {e.name for c in pod.spec.containers for e in (c.env or [])}
        assert contract.EXECD_SNAPSHOT_ENV not in env, env
        with pytest.raises(BadRequest, match="--snapshot-base off") as err:
            parent.fork(2, timeout_s=30)
        assert "\n" not in str(err.value)
        assert live(cluster, namespace) == {parent.pod}
        parent.release()
    assert metric(ctl, 'sandman_controller_forks_total{result="refused"}') == 1


@pytest.mark.parametrize("bed", [("--rate", "1", "--burst", "1")], indirect=True)
def test_a_caller_that_leaves_mid_fork_leaves_no_child(cluster, namespace, bed):
    """Creates paced at 1/s: the caller gives up after 1.5 s, while children are still being
    made; the ones handed out are released, the rest withdrawn or cleaned up; no pod but the
    parent holds its state."""
    ctl, standin, _ = bed
    with Client(ctl.url) as cl:
        parent = cl.acquire(IMAGE, job="leave", timeout_s=60, **SIZE)
        parent.exec("printf secret > marker")
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{ctl.url}{api.FORK.url(id=parent.id)}", json={"n": 4},
                       timeout=httpx.Timeout(1.5))
        wait_for(lambda: metric(ctl, 'sandman_controller_forks_total{result="client_closed"}')
                 == 1, 30, "the fork saw its caller leave")
        time.sleep(2)  # creates already sent settle (parked warm, or deleted)
        no_child_left(cluster, namespace, ctl, standin, parent)
        parent.release()


def test_another_tenant_cannot_fork_my_sandbox(tenants, authctl):
    """With RBAC: tenant B may not fork tenant A's sandbox (403, one line), nor learn whether an
    id exists in A; A itself may be asked (its fork goes on to the snapshot)."""
    from tests.controller.test_auth import acquire, bearer

    a, b = tenants.namespace("fa"), tenants.namespace("fb")
    for ns in (a, b):
        tenants.account(ns, "trainer")
        tenants.bind(ns, ns, "trainer")
    tok_a, tok_b = tenants.token(a, "trainer"), tenants.token(b, "trainer")
    ctl = authctl()
    r = acquire(ctl.url, tok_a, job="mine")
    assert r.status_code == 201, r.text
    sid, token = r.json()["id"], r.json()["token"]
    with httpx.Client(verify=ctl.verify(), timeout=30) as h:
        # With or without A's very token (leaked to B): a token is learned back, never a right.
        for extra in ({}, {"tokens": {sid: token}}):
            for route in (api.FORK, api.PAUSE):
                body = {"n": 1} if route is api.FORK else {}
                r = h.post(ctl.url + route.url(id=sid), json={**body, **extra},
                           headers=bearer(tok_b))
                assert r.status_code == 403, r.text
                err = r.json()["error"]
                assert err["type"] == api.FORBIDDEN.type and "\n" not in err["message"]
                assert "another tenant" in err["message"]
        r = h.post(ctl.url + api.FORK.url(id=sid), json={"n": 0}, headers=bearer(tok_a))
        assert r.status_code == 422 and "n:" in r.json()["error"]["message"]
        r = h.delete(ctl.url + api.RELEASE.url(id=sid), headers=bearer(tok_a))
        assert r.status_code == 200


def test_children_come_from_the_warm_pool_of_the_parents_key(cluster, namespace, bed):
    """A pool prewarmed for the parent's image and size hands the children out: no create."""
    ctl, standin, _ = bed
    with Client(ctl.url) as cl:
        parent = cl.acquire(IMAGE, job="warm", timeout_s=60, **SIZE)
        parent.exec("printf warm > marker")
        cl.prewarm(IMAGE, 2, **SIZE)
        wait_for(lambda: sum(i.state == "warm" for i in cl.list()) == 2, 60, "2 warm pods")
        kids = parent.fork(2, timeout_s=60)
        assert all(k.warm for k in kids), [k.warm for k in kids]
        for k in kids:
            assert (standin.workdir / k.pod / "marker").read_bytes() == b"warm"
            k.release()
        cl.prewarm(IMAGE, 0, **SIZE)
        parent.release()


def test_the_async_twin_forks_too(cluster, namespace, bed):
    ctl, standin, _ = bed
    from sandman.client import AsyncClient

    async def run() -> None:
        async with AsyncClient(ctl.url) as cl:
            parent = await cl.acquire(IMAGE, job="async", timeout_s=60, **SIZE)
            await parent.exec("printf async > marker; export ASYNC=1")
            (kid,) = await parent.fork(1, timeout_s=60)
            assert (standin.workdir / kid.pod / "marker").read_bytes() == b"async"
            assert (await kid.exec("echo $ASYNC")).output == "1\n"
            await kid.release()
            await parent.release()

    asyncio.run(run())


@pytest.mark.parametrize("bed", [("--lease-duration", "3", "--lease-renew", "1")],
                         indirect=True)
def test_after_a_controller_crash_the_holder_still_forks(cluster, namespace, bed):
    """A new leader has no sandbox's execd token (only its SHA-256, on the pod): it learns it
    back from the holder's next call that carries it (the SDK sends the tokens it holds), and
    from nothing else: no token, a wrong one or another sandbox's is refused as before.
    Checkpoint and pause: test_checkpoint_on_testbed.py."""
    ctl, standin, _ = bed
    with Client(ctl.url) as cl:
        parent = cl.acquire(IMAGE, job="crash", timeout_s=60, **SIZE)
        other = cl.acquire(IMAGE, job="crash", timeout_s=60, **SIZE)
        parent.exec("printf kept > marker")
        ctl.kill()  # a crash: the tokens were in the leader's memory only
        ctl.start(timeout=30)
        fork = ctl.url + api.FORK.url(id=parent.id)
        wrong = "A" * len(parent._token)
        for body in ({"n": 1}, {"n": 1, "tokens": {parent.id: wrong}},
                     {"n": 1, "tokens": {other.id: other._token}}):  # another sandbox's
            r = httpx.post(fork, json=body, timeout=60)
            assert r.status_code == 502 and "token" in r.json()["error"]["message"], r.text
        r = httpx.post(fork, json={"n": 1, "tokens": {parent.id: "x" * 300}}, timeout=60)
        assert r.status_code == 422 and "tokens:" in r.text, r.text

        kid, = parent.fork(1, timeout_s=60)  # its holder: the SDK sends the token it holds
        assert (standin.workdir / kid.pod / "marker").read_bytes() == b"kept"
        for sb in (kid, parent, other):
            sb.release()
