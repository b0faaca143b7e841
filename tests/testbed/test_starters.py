"""The starters' own guarantees, without a cluster: a stopped process leaves nothing behind,
nothing listens off loopback, and the stand-in's execd lives exactly as long as its pod."""

from __future__ import annotations

import hashlib
import json
import secrets
import sys
from types import SimpleNamespace

import httpx
import pytest

from sandman import contract
from testbed.execd import execd_cmd, start_execd
from testbed.procs import Proc, descendants, pid_runs, wait_for
from testbed.standin import Standin


def test_proc_stop_ends_the_whole_group_and_a_pid_only_proc_stops_too(tmp_path):
    p = Proc("sleeper", ["bash", "-c", "sleep 60 & sleep 60 & wait"], tmp_path / "p.log").start()
    kids = wait_for(lambda: descendants(p.pid), 5, "the two sleeps")
    p.stop(timeout=5)
    assert not p.alive() and p.exit_code() is not None
    assert not [k for k in kids if pid_runs(k, "sleep")], "a child outlived the stop"

    q = Proc("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"],
             tmp_path / "q.log").start()
    attached = Proc("sleeper", q.cmd, q.log, pid=q.pid)  # as `testbed down` sees it
    wait_for(attached.alive, 5, "the attached pid to run python (after its exec)")
    attached.stop(timeout=5)
    assert q.wait(5) is not None and not attached.alive()


def test_execd_is_refused_off_loopback():
    with pytest.raises(ValueError, match="loopback"):
        execd_cmd("10.0.0.1", 9470, "0" * 64)
    assert "127.0.0.1:9470" in execd_cmd("127.0.0.1", 9470, "0" * 64)


def test_start_execd_answers_with_its_token(tmp_path):
    ex = start_execd(tmp_path)
    try:
        r = httpx.post(f"{ex.url}/exec", json={"command": "echo hi"}, timeout=10,
                       headers={"Authorization": f"Bearer {ex.token}"})
        assert r.status_code == 200 and r.json()["output"] == "hi\n"
    finally:
        ex.stop()
    assert not ex.alive()


def _pod(name: str, ip: str, sha: str, deleting: bool = False) -> dict:
    md = {"name": name, "annotations": {contract.ANNOTATION_TOKEN_SHA256: sha}}
    if deleting:
        md["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": md, "status": {"podIP": ip}}


def test_standin_execd_follows_its_pod(tmp_path):
    token = "t0ken"
    sha = hashlib.sha256(token.encode()).hexdigest()
    # Not started (no watch): events are fed by hand, as the watch would deliver them.
    s = Standin(core=None, namespace="ns", workdir=tmp_path, say=lambda m: None)
    s.workdir.mkdir(parents=True, exist_ok=True)
    ip = f"127.64.{secrets.randbelow(250)}.{secrets.randbelow(250) + 2}"  # as kwok hands out
    try:
        s._on_event("ADDED", _pod("far", "10.1.2.3", sha))
        assert s.alive() == []
        s._on_event("ADDED", _pod("p1", ip, sha))
        url = f"http://{ip}:{contract.EXECD_PORT}"

        def health():
            try:
                return httpx.get(url + "/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False
        wait_for(health, 15, f"execd /health on {ip}")
        assert s.alive() == ["p1"]
        r = httpx.post(url + "/exec", json={"command": "pwd"}, timeout=10,
                       headers={"Authorization": f"Bearer {token}"})
        assert r.json()["output"].strip() == str(tmp_path / "p1")
        pid = s.procs["p1"].pid
        s._on_event("MODIFIED", _pod("p1", ip, sha, deleting=True))
        assert s.alive() == [] and not pid_runs(pid, sys.executable)
    finally:
        s.stop()


def test_standin_kills_the_execd_of_a_pod_deleted_while_no_watch_ran(tmp_path):
    """A pod that went between two watches sends no DELETED: the next list's resync kills its
    execd, which would otherwise go on holding the IP kwok gives the next pod (whose callers
    then reach the old token: 401)."""
    token = "t0ken"
    sha = hashlib.sha256(token.encode()).hexdigest()
    listed: list[dict] = []

    class Core:  # the list the resync reads, as the API server would answer it
        def list_namespaced_pod(self, namespace, _preload_content=True):
            return SimpleNamespace(data=json.dumps(
                {"metadata": {"resourceVersion": "42"}, "items": listed}).encode())

    s = Standin(core=Core(), namespace="ns", workdir=tmp_path, say=lambda m: None)
    s.workdir.mkdir(parents=True, exist_ok=True)
    ip = f"127.64.{secrets.randbelow(250)}.{secrets.randbelow(250) + 2}"
    try:
        s._on_event("ADDED", _pod("gone", ip, sha))
        keep = _pod("kept", f"127.65.{secrets.randbelow(250)}.{secrets.randbelow(250) + 2}", sha)
        s._on_event("ADDED", keep)
        assert sorted(s.procs) == ["gone", "kept"]
        pid = s.procs["gone"].pid
        listed.append(keep)  # "gone" was deleted while no watch ran
        assert s._resync() == "42"
        assert sorted(s.procs) == ["kept"] and not pid_runs(pid, sys.executable)
    finally:
        s.stop()
