"""A pod created by a plain client (no controller) with the label and an unmodified task image
becomes a guarded sandbox on a real kubelet: netguard ran, execd runs from the read-only
/sandman mount as the task image's own python3 (from the bytecode the install copied), with the token from the downward API, and the
kubelet's readiness probe passes; the running cgroup has requests == limits; no service-account
token and no service-link environment reach the container."""

from __future__ import annotations

from kubernetes import client

from sandman.contract import EXECD_TOKEN_ENV, NETGUARD_CONTAINER
from tests.e2e.helpers import crictl_exec, new_token, plain_pod, sandbox_pod

CPU_M, MEMORY = 200, 192 * 1024 * 1024  # the pod asks 200m / 192Mi, limits only


def test_plain_client_pod_becomes_a_guarded_sandbox(sandman, ns):
    core = sandman.core
    # A Service in the namespace: with service links on, every container would get its env.
    core.create_namespaced_service(ns, client.V1Service(
        metadata=client.V1ObjectMeta(name="neighbour"),
        spec=client.V1ServiceSpec(ports=[client.V1ServicePort(port=80)])))
    token, sha = new_token()
    sandman.create(ns, sandbox_pod("sbx", sha, cpu=f"{CPU_M}m", memory="192Mi"))
    sandman.run_ready(ns, plain_pod("control", automount=True))
    pod = sandman.wait_ready(ns, "sbx", timeout=120)  # the kubelet's probe of execd /health

    # The admitted pod: guard first, requests == limits everywhere, no token, no links.
    spec = pod.spec
    assert spec.init_containers[0].name == NETGUARD_CONTAINER
    for st in pod.status.init_container_statuses:
        assert st.state.terminated and st.state.terminated.exit_code == 0, (st.name, st.state)
    assert pod.status.qos_class == "Guaranteed"
    task = spec.containers[0]
    assert task.resources.requests == task.resources.limits == {"cpu": f"{CPU_M}m",
                                                                 "memory": "192Mi"}
    env = {e.name: e for e in task.env}
    assert env[EXECD_TOKEN_ENV].value is None
    assert env[EXECD_TOKEN_ENV].value_from.field_ref.field_path.startswith("metadata.annotations")

    out = sandman.execd(ns, "sbx", token, r"""
        def sh(cmd):
            r = sb.exec(cmd, timeout=30)
            return r.exit_code, r.output.strip()
        out['exe'] = sh('readlink /proc/1/exe')
        out['cmdline'] = sh("tr '\\0' ' ' < /proc/1/cmdline")
        out['image_python'] = sh('readlink -f "$(command -v python3)"')
        out['mount'] = sh("grep ' /sandman ' /proc/mounts")
        # The daemon's code comes from the bytecode the install copied (a compile would fail).
        out['bytecode'] = sh("python3 -c \"import sys, importlib.machinery as m; "
                             "l = m.SourceFileLoader('execd_daemon.main', "
                             "'/sandman/execd_daemon/main.py'); "
                             "l.source_to_code = lambda *a, **k: sys.exit('compiled from source'); "
                             "l.get_code('execd_daemon.main'); print('bytecode')\" 2>&1")
        out['write'] = sh('touch /sandman/x 2>&1')
        out['token_env'] = sh("tr '\\0' '\\n' < /proc/1/environ | grep ^SANDMAN_TOKEN_SHA256=")
        out['cpu'] = sh('cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us /sys/fs/cgroup/cpu/cpu.cfs_period_us'
                        ' /sys/fs/cgroup/cpu/cpu.shares')
        out['memory'] = sh('cat /sys/fs/cgroup/memory/memory.limit_in_bytes')
        out['sa'] = sh('ls /var/run/secrets/kubernetes.io/serviceaccount 2>&1')
        out['env'] = sh("env | cut -d= -f1 | sort")
        c = sb.conditions()
        out['conditions'] = [c.cpu_quota_us, c.cpu_period_us, c.memory_limit_bytes]
        try:
            from sandman.client import Sandbox
            bad = Sandbox.connect('127.0.0.1', 9470, 'x' * 64)
            bad.exec('true')
            out['wrong_token'] = 'accepted'
        except Exception as e:
            out['wrong_token'] = type(e).__name__
    """)
    # execd is PID 1, the task image's own python3 (found on the image's PATH) running
    # /sandman/execd.py.
    assert out["cmdline"][1].startswith("python3 -I -S /sandman/execd.py"), out["cmdline"]
    assert out["image_python"][1].startswith("/usr/bin/python3"), out["image_python"]
    # It is not dumpable: the sandbox's processes, with its uid and no CAP_SYS_PTRACE, can
    # read neither its executable link nor its environment (nor its memory, which held the
    # holders' tokens).
    assert out["exe"][0] != 0 and out["token_env"][0] != 0, (out["exe"], out["token_env"])
    # Its daemon loads from compiled bytecode: the task image's python3 is the sandman image's
    # minor version (3.11), so no pod compiles execd at its start.
    assert out["bytecode"] == [0, "bytecode"], out["bytecode"]
    # /sandman is read-only in the sandbox container.
    assert " ro," in out["mount"][1] or " ro " in out["mount"][1], out["mount"]
    assert out["write"][0] != 0 and "Read-only file system" in out["write"][1], out["write"]
    # The token hash came through the downward API (the pod spec above; the right token was
    # accepted for every call here); a wrong token is refused.
    assert out["wrong_token"] == "Unauthorized", out["wrong_token"]
    # requests == limits in the running cgroup (v1): CFS quota, shares and the memory limit.
    quota, period, shares = (int(x) for x in out["cpu"][1].split())
    assert (quota, period) == (CPU_M * 100, 100_000), out["cpu"]  # 200m of 100 ms
    assert shares == CPU_M * 1024 // 1000, out["cpu"]  # requests.cpu -> shares
    assert int(out["memory"][1]) == MEMORY, out["memory"]
    assert out["conditions"] == [CPU_M * 100, 100_000, MEMORY], out["conditions"]
    # No service-account token file, no service-link environment.
    assert out["sa"][0] != 0 and "No such file" in out["sa"][1], out["sa"]
    names = set(out["env"][1].split())
    assert not {n for n in names if n.startswith("NEIGHBOUR_")}, names

    # Positive control: the same namespace's plain pod does get the Service's env and a token.
    res = crictl_exec(sandman, ns, "control", [
        "sh", "-c", "env; ls /var/run/secrets/kubernetes.io/serviceaccount 2>&1"])
    assert "NEIGHBOUR_SERVICE_HOST=" in res.stdout, res.stdout + res.stderr
    assert "token" in res.stdout.split(), res.stdout
