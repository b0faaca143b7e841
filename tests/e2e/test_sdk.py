"""The SDK as a trainer uses it: a pod running the sandman image with the trainer label runs a
small script with `sandman.client` against the controller's Service DNS name; the sandbox is a
real pod on the real node, reached over the pod network through the NetworkPolicy and netguard.
"""

from __future__ import annotations

import datetime
import json
import time

from kubernetes import client

from tests.e2e.helpers import (
    SDK_CA_MOUNT,
    SDK_CA_VOLUME,
    SDK_TOKEN_MOUNT,
    SDK_TOKEN_VOLUME,
    TASK_IMAGE,
    TRAINER_LABEL,
    bind_trainer,
    copy_ca,
    placement,
    sdk_env,
    sigkill_container,
)

MEMORY = 160 * 1024 * 1024

SCRIPT = r"""
import hashlib, json, os, sys, time
from sandman.client import Client
res = {}
# In-cluster config only: SANDMAN_URL (https), SANDMAN_TOKEN_FILE, SANDMAN_CA_FILE.
res["url"] = os.environ["SANDMAN_URL"]
with Client(timeout_s=60) as c:
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
    to sandman-user by `bind_trainer`), a projected token for the controller's audience, the
    controller's CA bundle (copied by `copy_ca`) and the SDK's environment, so the script's
    `Client()` takes no arguments."""
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
                         "volumeMounts": [SDK_TOKEN_MOUNT, SDK_CA_MOUNT],
                         "resources": {"limits": {"cpu": "200m", "memory": "192Mi"}}}],
                     "volumes": [SDK_TOKEN_VOLUME, SDK_CA_VOLUME],
                     **placement()}}


def run_trainer(sandman, ns: str, name: str, script: str, timeout: float = 400, **env) -> dict:
    url = sandman.inst.controller_url_in_cluster()
    bind_trainer(sandman.cluster.api_client, ns)
    copy_ca(sandman.cluster.api_client, sandman.inst, ns)
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
    assert res["url"].startswith("https://"), res["url"]  # verified with the copied CA
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


LIFETIME = r"""
import json, os, time
from sandman.client import Client
c = Client(timeout_s=60)  # in-cluster config only, over https
spec = dict(image=os.environ["TASK_IMAGE"], job="e2e-lifetime", cpu="100m", memory="128Mi",
            lifetime_s=30, timeout_s=150)
lone = c.acquire(**spec, renew=False)  # never renewed
kept = c.acquire(**spec)  # renewed in the background, every 10 s
print("E2E-LIFE " + json.dumps({"lone": lone.pod, "lone_expires": lone.expires_at,
                                "kept": kept.pod}), flush=True)
time.sleep(600)  # until the test SIGKILLs this pod: no release, no atexit
"""


def _gone(core, ns: str, pod: str) -> bool:
    try:
        p = core.read_namespaced_pod(pod, ns)
    except client.ApiException as e:
        if e.status == 404:
            return True
        raise
    return p.metadata.deletion_timestamp is not None


def _expires_at(core, ns: str, pod: str) -> float | None:
    from sandman.contract import ANNOTATION_EXPIRES_AT

    try:
        ann = core.read_namespaced_pod(pod, ns).metadata.annotations or {}
    except client.ApiException:
        return None
    text = ann.get(ANNOTATION_EXPIRES_AT)
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() if text \
        else None


def test_lifetime_30s_renewal_and_a_sigkilled_trainer(sandman, ns, figures):
    """Issue 14's lifetime, as the chart runs it (auth, https, the chart's minimum 30 s): a
    sandbox acquired with lifetime_s 30 and never renewed is gone within 30 s + one expiry
    pass (1 s) + API slack; its sibling, renewed by the SDK, lives on past that; after the
    trainer process is SIGKILLed (on the node: no release, no atexit) the renewed one is gone
    within its lifetime after its last renewal: nothing leaks."""
    slack = 5.0  # the delete call and this test's 0.5 s polling
    bind_trainer(sandman.cluster.api_client, ns)
    copy_ca(sandman.cluster.api_client, sandman.inst, ns)
    url = sandman.inst.controller_url_in_cluster()
    sandman.create(ns, trainer_pod("lifetime", sandman.inst.image_ref, LIFETIME, url))
    sbx = sandman.inst.sandbox_namespace
    core = sandman.core
    deadline = time.monotonic() + 240
    got = None
    while got is None and time.monotonic() < deadline:
        lines = [ln for ln in (sandman.logs(ns, "lifetime") or "").splitlines()  # None: empty
                 if ln.startswith("E2E-LIFE ")]
        got = json.loads(lines[0][len("E2E-LIFE "):]) if lines else None
        time.sleep(0.5)
    assert got, f"no sandboxes: {sandman.logs(ns, 'lifetime')[-3000:]}"
    lone_expires = datetime.datetime.fromisoformat(
        got["lone_expires"].replace("Z", "+00:00")).timestamp()
    # 1. The unrenewed one: alive until its expiry, gone within one pass + slack after it.
    while not _gone(core, sbx, got["lone"]):
        assert time.time() < lone_expires + 1.0 + slack, "not expired in 30 s + one pass"
        time.sleep(0.5)
    gone_at = time.time()
    assert gone_at > lone_expires - 1.0, f"deleted {lone_expires - gone_at:.1f}s early"
    # 2. The renewed one lives past 30 s after its acquire (same moment as the lone one's).
    while time.time() < lone_expires + 15:
        assert not _gone(core, sbx, got["kept"]), "the renewed sandbox expired"
        time.sleep(0.5)
    # 3. SIGKILL the trainer process on the node; nothing releases.
    last = _expires_at(core, sbx, got["kept"])
    assert last and last > lone_expires + 10, "no renewal moved the expiry"
    sigkill_container(sandman, ns, "lifetime")
    while not _gone(core, sbx, got["kept"]):
        last = _expires_at(core, sbx, got["kept"]) or last  # a renewal just before the kill
        assert time.time() < last + 1.0 + slack, "leaked past its lifetime"
        time.sleep(0.5)
    killed_gone = time.time() - last
    figures.add(f"e2e: lifetime 30 s: unrenewed gone {gone_at - lone_expires:+.1f}s after "
                f"expiry; renewed kept past it; after SIGKILL gone {killed_gone:+.1f}s after "
                f"its last expiry")
