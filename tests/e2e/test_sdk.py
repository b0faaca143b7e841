"""The SDK as a trainer uses it: a pod running the sandman image with the trainer label runs a
small script with `sandman.client` against the controller's Service DNS name; the sandbox is a
real pod on the real node, reached over the pod network through the NetworkPolicy and netguard.
"""

from __future__ import annotations

import json
import time

from kubernetes import client

from tests.e2e.helpers import (
    SDK_TOKEN_MOUNT,
    SDK_TOKEN_VOLUME,
    TASK_IMAGE,
    TRAINER_LABEL,
    bind_trainer,
    placement,
    sdk_env,
)

MEMORY = 160 * 1024 * 1024

SCRIPT = r"""
import hashlib, json, os, sys, time
from sandman.client import Client
res = {}
with Client(timeout_s=60) as c:  # in-cluster config: SANDMAN_URL, SANDMAN_TOKEN_FILE
    with c.acquire(image=os.environ["TASK_IMAGE"], job="e2e-sdk", cpu="250m",
                   memory="160Mi", timeout_s=150) as sb:
        res["pod"] = sb.pod
        r = sb.exec("echo hello; echo err >&2; exit 3", timeout=30)
        res["exec"] = [r.exit_code, r.output]
        r = sb.exec("cd /tmp && export E2E=kept", timeout=30)
        r = sb.exec("pwd; echo $E2E", timeout=30)
        res["shell"] = r.output.split()
        data = bytes(range(256)) * 64 + os.urandom(65536) + b"\r\n\x00 end"
        w = sb.write("/tmp/blob.bin", data)
        res["write_sha"] = w.sha256 == hashlib.sha256(data).hexdigest()
        res["read_equal"] = sb.read("/tmp/blob.bin") == data
        r = sb.exec("sha256sum /tmp/blob.bin", timeout=30)
        res["sha_inside"] = r.output.split()[0] == hashlib.sha256(data).hexdigest()
        # Processes started by commands, one of them in its own session, die at reset.
        r = sb.exec("sleep 600 >/dev/null 2>&1 & echo $!", timeout=30)
        pid = r.output.strip()
        sb.exec("setsid sleep 601 >/dev/null 2>&1 < /dev/null &", timeout=30)
        count = ("for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done"
                 " | grep -c '^sleep 60[01]'")
        # `setsid` execs sleep a moment after the command returned: poll (bounded) for both.
        for _ in range(20):
            res["before_reset"] = sb.exec(count, timeout=30).output.strip()
            if res["before_reset"] == "2":
                break
            time.sleep(0.25)
        sb.reset()
        res["after_reset"] = sb.exec(count, timeout=30).output.strip()
        res["pid_gone"] = sb.exec(f"kill -0 {pid} 2>/dev/null && echo alive || echo gone",
                                  timeout=30).output.strip()
        res["shell_after_reset"] = sb.exec("pwd; echo ${E2E:-unset}", timeout=30).output.split()
        # Memory past the limit: the kernel's OOM killer ends the command, inside the cgroup.
        r = sb.exec("python3 -c 'a = bytearray(400 * 1024 * 1024); print(len(a))'; echo rc=$?",
                    timeout=60)
        res["oom"] = [r.exit_code, r.output]
        res["oom_cgroup"] = sb.exec(
            "cat /sys/fs/cgroup/memory/memory.limit_in_bytes "
            "/sys/fs/cgroup/memory/memory.max_usage_in_bytes /sys/fs/cgroup/memory/memory.failcnt;"
            " grep '^oom_kill ' /sys/fs/cgroup/memory/memory.oom_control", timeout=30).output.split()
        res["alive_after_oom"] = sb.exec("echo still-here", timeout=30).output.strip()
    res["released"] = sb.released
print("E2E-RESULT " + json.dumps(res))
"""


def trainer_pod(name: str, image: str, script: str, controller: str, **env: str) -> dict:
    """A trainer as docs/sdk.md sets one up: the namespace's `default` ServiceAccount (bound
    to sandman-user by `bind_trainer`), a projected token for the controller's audience, and
    the SDK's environment, so the script's `Client()` takes no arguments."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {TRAINER_LABEL: "true"}},
            "spec": {"restartPolicy": "Never", "automountServiceAccountToken": False,
                     "terminationGracePeriodSeconds": 1,
                     "containers": [{
                         "name": "trainer", "image": image, "imagePullPolicy": "Never",
                         "command": ["python3", "-c", script],
                         "env": [*sdk_env(controller),
                                 {"name": "TASK_IMAGE", "value": TASK_IMAGE},
                                 *({"name": k, "value": v} for k, v in env.items())],
                         "volumeMounts": [SDK_TOKEN_MOUNT],
                         "resources": {"limits": {"cpu": "200m", "memory": "192Mi"}}}],
                     "volumes": [SDK_TOKEN_VOLUME],
                     **placement()}}


def run_trainer(sandman, ns: str, name: str, script: str, timeout: float = 400, **env) -> dict:
    url = sandman.inst.controller_url_in_cluster()
    bind_trainer(sandman.cluster.api_client, ns)
    sandman.create(ns, trainer_pod(name, sandman.inst.image_ref, script, url, **env))
    pod = sandman.wait_done(ns, name, timeout=timeout)
    logs = sandman.logs(ns, name)
    lines = [ln for ln in logs.splitlines() if ln.startswith("E2E-RESULT ")]
    assert pod.status.phase == "Succeeded" and lines, (
        f"trainer {pod.status.phase}: {logs[-3000:]}\n{sandman.describe(ns, name)}")
    return json.loads(lines[-1][len("E2E-RESULT "):])


def test_trainer_pod_acquires_through_the_sdk(sandman, ns, figures):
    t0 = time.monotonic()
    res = run_trainer(sandman, ns, "trainer", SCRIPT)
    took = time.monotonic() - t0
    assert res["exec"] == [3, "hello\nerr\n"], res["exec"]
    assert res["shell"] == ["/tmp", "kept"], res["shell"]
    assert res["write_sha"] and res["read_equal"] and res["sha_inside"], res
    assert res["before_reset"] == "2", res
    assert res["after_reset"] == "0" and res["pid_gone"] == "gone", res
    assert res["shell_after_reset"][0] != "/tmp" and res["shell_after_reset"][1] == "unset", res
    code, output = res["oom"]
    assert "rc=137" in output and str(400 * 1024 * 1024) not in output, res["oom"]
    limit, max_usage, _failcnt, _, oom_kills = res["oom_cgroup"]
    assert int(limit) == MEMORY and int(max_usage) <= MEMORY, res["oom_cgroup"]
    assert int(oom_kills) >= 1, res["oom_cgroup"]  # the cgroup's own OOM killer did it
    assert res["alive_after_oom"] == "still-here", res
    assert res["released"] is True
    # Release deleted the sandbox pod.
    sbx_ns = sandman.inst.sandbox_namespace
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            sandman.core.read_namespaced_pod(res["pod"], sbx_ns)
        except client.ApiException as e:
            if e.status == 404:
                break
            raise
        time.sleep(0.5)
    else:
        raise AssertionError(f"sandbox pod {res['pod']} still there 60 s after release")
    figures.add(f"e2e: trainer pod acquire, exec, files, reset, OOM, release: {took:.1f}s")
