"""/ready (issue 15 item 4): a readiness route that notices a wedged pod. It forks and execs a
process and writes+fsyncs a file; /health only proves the HTTP thread runs. The wedges are real:
fork fails under RLIMIT_NPROC as an unprivileged user, the workspace is a full tmpfs in a private
mount namespace."""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from execd.execd_daemon import ready
from sandman import contract

from .conftest import TOKEN
from .test_budget import one_response

READY = contract.EXECD_READY_PATH
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (setuid, mounts)")


def get(s: socket.socket, path: str, auth: bool = False) -> int | None:
    extra = b"Authorization: Bearer %s\r\n" % TOKEN.encode() if auth else b""
    return one_response(s, b"GET %s HTTP/1.1\r\nHost: x\r\n%s\r\n" % (path.encode(), extra))


def ready_json(d) -> tuple[int, dict]:
    r = httpx.get(d.url + READY, timeout=10, trust_env=False)
    return r.status_code, r.json()


def wait_ready(d, want: int, within: float = 6.0) -> tuple[int, dict]:
    """/ready until it answers `want` (results are reused for READY_CACHE seconds)."""
    deadline = time.monotonic() + within
    while True:
        code, body = ready_json(d)
        if code == want or time.monotonic() > deadline:
            return code, body
        time.sleep(0.2)


def test_ready_without_token_forks_and_writes(execd):
    code, body = ready_json(execd)
    assert code == 200, body
    assert body["ok"] is True and body["error"] is None
    assert body["fork_ms"] > 0 and body["disk_ms"] > 0
    assert execd.others() == []  # the probe process is gone


def test_ready_that_carries_a_token_is_checked(execd):
    """The kubelet asks without a token; the controller asks with the pod's: a wrong one is 401,
    so another pod's execd still answering at a reused IP never passes for this pod's."""
    for headers, want in (({}, 200), ({"Authorization": f"Bearer {TOKEN}"}, 200),
                          ({"Authorization": "Bearer another-pods-token"}, 401),
                          ({"Authorization": "Basic x"}, 401), ({"Authorization": ""}, 401)):
        r = httpx.get(execd.url + READY, headers=headers, timeout=10, trust_env=False)
        assert r.status_code == want, (headers, r.text)
        if want == 401:
            assert "bearer token" in r.json()["error"]


@pytest.mark.slow
def test_ready_not_behind_a_busy_shell_and_concurrent_calls_share_one_check(execd):
    t = threading.Thread(target=execd.exec, args=("sleep 4",), kwargs={"timeout": 30})
    t.start()
    try:
        assert execd_mod_wait(lambda: execd.state()["busy"])
        time.sleep(ready.READY_CACHE + 0.1)  # no reusable result: this one must fork
        t0 = time.monotonic()
        code, body = ready_json(execd)
        took = time.monotonic() - t0
        assert code == 200 and took < ready.READY_BUDGET, (took, body)
        before = body["checks"]
        # 12 callers at once (under the pre-auth cap of 16, so none is shed), 3 calls each:
        # they share the in-flight check and the result of the last second.
        codes, checks = [], []

        def call():
            for _ in range(3):
                c, b = ready_json(execd)
                codes.append(c)
                checks.append(b["checks"])

        t1 = time.monotonic()
        ts = [threading.Thread(target=call) for _ in range(12)]
        for th in ts:
            th.start()
        for th in ts:
            th.join(30)
        assert codes == [200] * 36, codes
        ran = max(checks) - before
        assert ran <= 2 + int((time.monotonic() - t1) / ready.READY_CACHE), (ran, checks)
    finally:
        t.join(30)


def execd_mod_wait(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.netns
@ROOT_ONLY
@pytest.mark.skipif(not (shutil.which("setpriv") and shutil.which("prlimit")
                         and os.access("/usr/bin/python3", os.X_OK)),
                    reason="needs setpriv, prlimit and a python3 any user can run")
def test_ready_fails_when_fork_fails_while_health_stays_ok(execd_factory):
    ws = tempfile.mkdtemp(prefix="execfix-ready-")
    os.chmod(ws, 0o777)
    # execd as an unprivileged user (RLIMIT_NPROC does not bind root) whose process limit leaves
    # room for execd, then a filler of the same user takes every task left.
    nobody = sum(1 for p in os.listdir("/proc") if p.isdigit() and uid_of(int(p)) == 65534)
    limit = nobody + 64
    filler = ("import threading, time\n"
              "n = 0\n"
              "try:\n"
              "    while n < 10000:\n"
              "        threading.Thread(target=time.sleep, args=(1000,), daemon=True).start()\n"
              "        n += 1\n"
              "except RuntimeError:\n"
              "    pass\n"
              "print(n, flush=True)\n"
              "time.sleep(1000)\n")
    try:
        d = execd_factory("--workspace", ws, prefix=(
            "prlimit", f"--nproc={limit}", "setpriv", "--reuid=65534", "--regid=65534",
            "--clear-groups"), env={"PATH": "/usr/bin:/bin"})
        # One keep-alive connection opened before the wedge: under the limit execd cannot start
        # a thread for a new connection either (so a kubelet probe fails by connection too).
        with httpx.Client(base_url=d.url, headers={"Authorization": f"Bearer {TOKEN}"},
                          timeout=30, trust_env=False,
                          limits=httpx.Limits(max_connections=1)) as c:
            assert c.get(READY).status_code == 200
            r = c.post("/exec", json={"command": f"python3 -c {shlex.quote(filler)} "
                                                 f"> {ws}/n 2>&1 &"})
            assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text
            n = Path(ws) / "n"
            assert execd_mod_wait(lambda: n.exists() and n.read_text().strip(), 30)
            time.sleep(ready.READY_CACHE + 0.1)
            r = c.get(READY)
            assert r.status_code == 503 and "cannot fork" in r.json()["error"], (r.text, n.read_text())
            assert c.get("/health").status_code == 200
            # kill is a builtin: no fork needed to end the filler.
            assert c.post("/exec", json={"command": "kill -9 $!; wait $!"}).status_code == 200
            time.sleep(ready.READY_CACHE + 0.1)
            r = c.get(READY)
            assert r.status_code == 200, r.text
    finally:
        shutil.rmtree(ws, ignore_errors=True)


def uid_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Uid:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


@pytest.mark.netns
@ROOT_ONLY
@pytest.mark.skipif(not shutil.which("unshare"), reason="needs unshare")
def test_ready_fails_when_workspace_disk_full_while_health_stays_ok(execd_factory):
    ws = tempfile.mkdtemp(prefix="execfix-full-")
    try:
        # A 256 KiB tmpfs over the workspace, in execd's own private mount namespace.
        d = execd_factory("--workspace", ws, env={"TMPDIR": ws}, prefix=(
            "unshare", "-m", "--propagation", "private", "sh", "-c",
            'mount -t tmpfs -o size=256k execfix "$0" && exec "$@"', ws))
        code, body = ready_json(d)
        assert code == 200, body
        r = d.exec("df -k . | tail -1; head -c 1048576 /dev/zero > fill; echo $?")
        assert r["output"].rstrip().endswith("1"), r  # the write hit ENOSPC
        code, body = wait_ready(d, 503)
        assert code == 503 and "No space left" in body["error"], body
        assert httpx.get(d.url + "/health", trust_env=False).status_code == 200
        assert d.exec("rm fill")["exit_code"] == 0
        code, body = wait_ready(d, 200)
        assert code == 200, body
        assert os.listdir(ws) == []  # the tmpfs was private to execd's namespace
    finally:
        shutil.rmtree(ws, ignore_errors=True)


