"""The kubelet's readiness probe is execd's /ready (issue 15 item 4): a sandbox gets Ready on a
real kubelet, and goes NotReady when it is wedged (its /tmp, a 2 MiB memory-backed emptyDir, is
full) while execd's /health still answers; it comes back once space is freed."""

from __future__ import annotations

import time

from sandman.contract import EXECD_READY_PATH
from tests.e2e.helpers import _ready, new_token, sandbox_pod

STATUS = f"""
import urllib.error
import urllib.request

def get(path):
    try:
        return urllib.request.urlopen('http://127.0.0.1:9470' + path, timeout=5).status
    except urllib.error.HTTPError as e:
        return e.code

out['health'] = get('/health')
out['ready'] = get({EXECD_READY_PATH!r})
"""


def test_ready_probe_notices_a_full_tmp(sandman, ns, figures):
    token, sha = new_token()
    pod = sandbox_pod("sbx", sha)
    pod["spec"]["volumes"] = [{"name": "tmp", "emptyDir": {"medium": "Memory",
                                                           "sizeLimit": "2Mi"}}]
    pod["spec"]["containers"][0]["volumeMounts"] = [{"name": "tmp", "mountPath": "/tmp"}]
    sandman.create(ns, pod)
    p = sandman.wait_ready(ns, "sbx", timeout=120)  # the kubelet's probe of execd /ready
    probe = p.spec.containers[0].readiness_probe
    assert probe.http_get.path == EXECD_READY_PATH, probe
    assert sandman.execd(ns, "sbx", token, STATUS) == {"health": 200, "ready": 200}

    code, out = sandman.sh(ns, "sbx", token,
                           "head -c 8388608 /dev/zero > /tmp/fill; echo rc=$?; df -k /tmp")
    assert "rc=1" in out, out  # ENOSPC: the 2 MiB tmpfs is full
    t0 = time.monotonic()
    sandman.wait_pod(ns, "sbx", lambda p: not _ready(p), "NotReady", timeout=60)
    to_not_ready = time.monotonic() - t0
    assert sandman.execd(ns, "sbx", token, STATUS) == {"health": 200, "ready": 503}

    code, out = sandman.sh(ns, "sbx", token, "rm -f /tmp/fill; echo rc=$?")
    assert "rc=0" in out, out
    t0 = time.monotonic()
    sandman.wait_ready(ns, "sbx", timeout=60)
    figures.add(f"e2e /ready: /tmp full -> NotReady {to_not_ready:.1f}s, freed -> Ready "
                f"{time.monotonic() - t0:.1f}s (probe every 1 s, 3 failures; API polled 0.5 s)")
    assert sandman.execd(ns, "sbx", token, STATUS) == {"health": 200, "ready": 200}
