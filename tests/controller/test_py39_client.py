"""The `sandman-client` wheel on a bare Python 3.9 (testbed/dist.py `Py39Venv`) against the
real controller on the test bed: acquire, a command and a byte-exact file round trip in the
real execd the kubelet stand-in started for the pod, release; the pod goes. The same calls as
tests/controller/test_sdk_e2e.py, from the installed wheel instead of the tree.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from testbed import dist
from testbed.procs import wait_for
from tests.controller.harness import pods, standin_stack

IMAGE = "registry.invalid/swe/task:1"

SCRIPT = textwrap.dedent('''
    import json, sys
    from sandman.client import Client

    out = {"python": list(sys.version_info[:2])}
    with Client(sys.argv[1]) as client:
        with client.acquire(sys.argv[2], job="py39", cpu="1", memory="1Gi",
                            timeout_s=60) as sb:
            out["pod"] = sb.pod
            out["exec"] = sb.exec("export X=41 && echo $((X+1))", timeout=30).output
            data = bytes(range(256)) * 3
            sb.write("/tmp/sandman-py39-" + sb.pod, data)
            out["read_ok"] = sb.read("/tmp/sandman-py39-" + sb.pod) == data
            sb.exec("rm -f /tmp/sandman-py39-" + sb.pod)
    print("RESULT " + json.dumps(out))
''')


@pytest.fixture
def stack(cluster, namespace, tmp_path):
    with standin_stack(cluster, namespace, tmp_path, "py39") as got:
        yield got


@pytest.mark.timeout(1200)  # a first run debootstraps bullseye (196 s here)
def test_python39_wheel_against_the_real_controller(cluster, namespace, stack, tmp_path):
    why = dist.missing()
    if why:
        pytest.skip(f"bare Python 3.9 from Debian bullseye: {why}")
    ctl, standin = stack
    with dist.Py39Venv(dist.rootfs(), tmp_path) as venv:
        out = venv.check([venv.python, venv.put("e2e.py", SCRIPT), ctl.url, IMAGE],
                         timeout=180)
    result = json.loads(next(ln for ln in out.splitlines()
                             if ln.startswith("RESULT "))[len("RESULT "):])
    assert result["python"] == [3, 9]
    assert result["exec"] == "42\n" and result["read_ok"]
    # Leaving the block released it: the pod goes.
    wait_for(lambda: result["pod"] not in {p.metadata.name for p in pods(cluster.core, namespace)
                                           if not p.metadata.deletion_timestamp}, 20, "release")
