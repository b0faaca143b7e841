"""A killed command on the real node: execd as a pod's PID 1 under the runtime's seccomp and
AppArmor profiles reads its shell's /proc (fd, fdinfo, syscall) while the call is stopped. The
shell reading a substitution the kill ended is replaced and the command it was expanding never
runs; a shell waiting for a program that reads a `<(...)` keeps its state (were
/proc/<shell>/syscall unreadable there, it would be replaced too)."""

from __future__ import annotations

from tests.e2e.helpers import new_token, sandbox_pod

BODY = r"""
from sandman.client import CommandTimeout

def killed(cmd):
    try:
        r = sb.exec(cmd, timeout=2)
    except CommandTimeout as e:
        r = e.result
    return [r.exit_code, r.error or ""]

def sh(cmd):
    return sb.exec(cmd, timeout=30).output.split()

sh('mkdir -p /tmp/k && cd /tmp/k && KEEP=1')
out['procsubst'] = killed('cat <(sleep 30); touch /tmp/k/x')
out['kept'] = sh('pwd; echo ${KEEP-unset}')
out['expansion'] = killed('echo > /tmp/k/y$(sleep 30)')
out['cd'] = killed('cd $(sleep 30; echo /usr)')
out['after'] = sh('sleep 1; pwd; echo ${KEEP-unset}; ls /tmp/k | wc -l')
"""


def test_a_killed_substitution_in_a_real_pod(sandman, ns, figures):
    token, sha = new_token()
    sandman.create(ns, sandbox_pod("sbx", sha))
    sandman.wait_ready(ns, "sbx", timeout=120)
    out = sandman.execd(ns, "sbx", token, BODY)
    assert out["procsubst"][0] == 124 and "state lost" not in out["procsubst"][1], out
    assert out["kept"] == ["/tmp/k", "1"], out
    for case in ("expansion", "cd"):
        assert out[case][0] == 124 and "killed too" in out[case][1], out
    pwd, keep, made = out["after"]
    assert pwd != "/usr" and keep == "unset" and made == "0", out
    figures.add("e2e: a killed $(...) in a real pod replaces the shell, nothing of its command "
                "runs; a killed <(...) reader keeps the shell's state")
