"""Checked reuse on the real node: a grading sandbox (real pod, execd as PID 1 with the baseline
the controller gives grading pods: the whole root filesystem, copies of the workspace, /etc,
/usr/local, /opt, $HOME, /tmp and the package dirs) is changed, released with reuse, handed out
again with a new token and a clean /diff, 8 times, then deleted at the 9th release (--max-reuse
8, the controller's default); and a tampered one comes back clean, to its tenant only, or is
retired."""

from __future__ import annotations

from tests.e2e.test_sdk import run_trainer

SCRIPT = r"""
import json
from sandman.client import Client
res = {"rounds": []}
kw = dict(job="e2e-reuse", cpu="250m", memory="160Mi", timeout_s=150, role="grading",
          reused_ok=True)
import os
with Client(timeout_s=120) as c:
    sb = c.acquire(image=os.environ["TASK_IMAGE"], **kw)
    res["pod"] = sb.pod
    res["first_diff"] = sb._http.get("/diff").json()
    for i in range(9):
        sb.exec(f"echo {i} > /tmp/answer.py; echo 'x{i}' >> /etc/hostname.e2e; "
                f"chmod 600 /etc/passwd; ln -sfn /nowhere /opt/link{i}; export GRADED={i}; "
                "(setsid sleep 600 >/dev/null 2>&1 < /dev/null &)", timeout=60)
        dirty = sb._http.get("/diff").json()
        old_auth = sb._http.headers["authorization"]
        sb.release(reuse=True)
        rnd = {"dirty": len(dirty["changes"]), "reused": sb.reused}
        if not sb.reused:
            res["rounds"].append(rnd)
            break
        sb = c.acquire(image=os.environ["TASK_IMAGE"], **kw)
        d = sb._http.get("/diff").json()
        rnd.update(same_pod=sb.pod == res["pod"], warm=sb.warm, clean=d["clean"],
                   left=d["changes"][:5],
                   new_token=sb._http.headers["authorization"] != old_auth,
                   shell=sb.exec("echo ${GRADED-unset}; stat -c %a /etc/passwd; "
                                 "ls /tmp/answer.py /etc/hostname.e2e 2>&1 | wc -l").output.split())
        res["rounds"].append(rnd)
print("E2E-RESULT " + json.dumps(res))
"""


def test_grading_pod_reused_8_times_then_deleted(sandman, ns, figures):
    res = run_trainer(sandman, ns, "trainer-reuse", SCRIPT, timeout=600)
    assert res["first_diff"]["clean"] is True, res["first_diff"]["changes"][:10]
    rounds = res["rounds"]
    assert len(rounds) == 9, rounds
    for i, r in enumerate(rounds[:8]):
        assert r["reused"] is True and r["dirty"] >= 5, (i, r)
        assert r["same_pod"] and r["warm"] and r["new_token"], (i, r)
        assert r["clean"] is True, (i, r["left"])
        assert r["shell"] == ["unset", "644", "2"], (i, r["shell"])  # ls: 2 "No such" lines
    assert rounds[8]["reused"] is False
    figures.add("e2e: a grading pod reused 8 times, /diff clean after each, deleted at the 9th")


# The previous holder as an attacker (tests/execd/test_reuse_hostile.py on a temp root, here on
# the real image in a real pod): a shell planted first on PATH, a hidden `.pth` in the system
# Python's package dir, an /etc/ld.so.preload and a library added under /usr/lib. All of it was
# added, so the restore removes it and the pod is handed out again, clean.
TAMPER_ADDED = r"""
set -e
printf '#!/usr/bin/bash\necho planted > /var/tmp/pwned-bash\nexec /usr/bin/bash "$@"\n' \
    > /usr/local/bin/bash
chmod 755 /usr/local/bin/bash
echo "import os; open('/var/tmp/pwned-pth', 'w').write('x')" \
    > /usr/lib/python3/dist-packages/.sandman-ready-x.pth
echo evil > /usr/lib/libsandman-evil.so
echo /usr/lib/libsandman-evil.so > /etc/ld.so.preload
"""
# Then the image's own shell replaced (in /usr/bin, outside every copied root): nothing to put
# back, so the release retires the pod.
TAMPER_IMAGE = r"""
set -e
cp /usr/bin/bash /var/tmp/bash.real
printf '#!/var/tmp/bash.real\necho planted > /var/tmp/pwned-usr-bash\nexec /var/tmp/bash.real "$@"\n' \
    > /var/tmp/bash.new
chmod 755 /var/tmp/bash.new
mv -f /var/tmp/bash.new /usr/bin/bash
"""
# What the next holder sees: no planted file, no marker, and its Python and shell ran none of it.
LOOK = ("ls /usr/local/bin/bash /etc/ld.so.preload /usr/lib/libsandman-evil.so "
        "/usr/lib/python3/dist-packages/.sandman-ready-x.pth /var/tmp/pwned-bash "
        "/var/tmp/pwned-pth 2>&1 | grep -c 'No such'; python3 -c 'print(1)' 2>&1; "
        "command -v bash")

TAMPER = r"""
import json, os
from sandman.client import Client
kw = dict(job="e2e-tamper", cpu="250m", memory="160Mi", timeout_s=150, role="grading",
          reused_ok=True)
res = {}
step = os.environ["STEP"]
with Client(timeout_s=120) as c:
    sb = c.acquire(image=os.environ["TASK_IMAGE"], **kw)
    res["pod"], res["warm"] = sb.pod, sb.warm
    if step == "plant":
        r = sb.exec(os.environ["TAMPER_ADDED"], timeout=60)
        res["planted"] = [r.exit_code, r.output[-500:]]
        res["dirty"] = len(sb._http.get("/diff").json()["changes"])
        sb.release(reuse=True)
        res["released_reused"] = sb.reused
    elif step == "other-tenant":
        sb.release()
    else:
        d = sb._http.get("/diff").json()
        res["clean"], res["left"] = d["clean"], d["changes"][:5]
        res["look"] = sb.exec(os.environ["LOOK"], timeout=60).output.split()
        r = sb.exec(os.environ["TAMPER_IMAGE"], timeout=60)
        res["replaced"] = [r.exit_code, r.output[-500:]]
        sb.release(reuse=True)
        res["released_reused"] = sb.reused
print("E2E-RESULT " + json.dumps(res))
"""


def test_tampered_grading_pod_is_clean_or_retired_and_stays_with_its_tenant(sandman, ns,
                                                                             figures):
    env = dict(TAMPER_ADDED=TAMPER_ADDED, TAMPER_IMAGE=TAMPER_IMAGE, LOOK=LOOK)
    plant = run_trainer(sandman, ns, "tamper-plant", TAMPER, timeout=400, STEP="plant", **env)
    assert plant["planted"][0] == 0, plant
    assert plant["dirty"] >= 4, plant  # the four files planted
    assert plant["released_reused"] is True, plant  # all of it was added: restorable

    # Another tenant's grading of the same image and shape never gets the tenant's pod.
    other = sandman.cluster.new_namespace("e2e-tamper-other")
    try:
        b = run_trainer(sandman, other, "tamper-other", TAMPER, timeout=400,
                        STEP="other-tenant", **env)
    finally:
        sandman.cluster.delete_namespace(other)
    assert b["pod"] != plant["pod"], (b, plant)

    nxt = run_trainer(sandman, ns, "tamper-next", TAMPER, timeout=400, STEP="next", **env)
    assert nxt["pod"] == plant["pod"] and nxt["warm"] is True, (nxt, plant)
    assert nxt["clean"] is True, nxt["left"]
    # 6 "No such file" lines, Python ran without the .pth or the preload, the image's bash.
    assert nxt["look"] == ["6", "1", "/usr/bin/bash"], nxt["look"]
    assert nxt["replaced"][0] == 0, nxt
    assert nxt["released_reused"] is False, nxt  # /usr/bin/bash has no copy: retired
    figures.add("e2e: a tampered grading pod (planted bash, .pth, ld.so.preload, library) came "
                "back clean to its tenant only; with /usr/bin/bash replaced it was retired")


# What /restore never looks at because a pod cannot change it: the kernel's own state. Tried
# as the holder would, as the image's root, in a real grading pod: each attempt must be refused
# and leave the value as it was, else a reused pod would carry it to the next holder unseen.
OUT_OF_REACH = r"""
set +e
try() { l=$1; shift; "$@" >/dev/null 2>&1; echo "$l $?"; }
echo "uid $(id -u)"
h0=$(cat /proc/sys/kernel/hostname)
try sysctl-hostname sh -c 'echo sandman-evil > /proc/sys/kernel/hostname'
try hostname hostname sandman-evil
try sysctl-forward sh -c 'echo 1 > /proc/sys/net/ipv4/ip_forward'
try sysctl-vm sh -c 'echo 1 > /proc/sys/vm/drop_caches'
cg=/sys/fs/cgroup; [ -d $cg/pids ] && cg=$cg/pids  # cgroup v1: the controller's own mount
try cgroup-limit sh -c "echo max > $cg/pids.max"
try cgroup-new mkdir $cg/evil
try mount mount -t tmpfs none /mnt
try unshare unshare -m true
try add_key python3 -c 'import ctypes, platform, sys; n = {"x86_64": 248, "aarch64": 217}[platform.machine()]; libc = ctypes.CDLL(None, use_errno=True); sys.exit(0 if libc.syscall(n, b"user", b"sandman-evil", b"x", 1, -3) >= 0 else 1)'
# cgroup v1: the tmpfs holding the controllers is writable; a planted name is state (watched).
touch /sys/fs/cgroup/cpu.max 2>/dev/null && echo "planted yes" || echo "planted no"
echo "hostname-same $([ "$(cat /proc/sys/kernel/hostname)" = "$h0" ] && echo yes || echo no)"
"""

KERNEL_SCRIPT = r"""
import json, os
from sandman.client import Client
with Client(timeout_s=120) as c:
    sb = c.acquire(image=os.environ["TASK_IMAGE"], job="e2e-kernel", cpu="250m",
                   memory="160Mi", timeout_s=150, role="grading", reused_ok=True)
    r = sb.exec(os.environ["OUT_OF_REACH"], timeout=60)
    d = sb._http.get("/diff").json()
    res = {"out": r.output.split("\n"), "clean": d["clean"],
           "changed": [c["path"] for c in d["changes"] if c.get("path")]}
    sb.release()
print("E2E-RESULT " + json.dumps(res))
"""


def test_kernel_state_is_out_of_a_grading_pods_reach(sandman, ns, figures):
    res = run_trainer(sandman, ns, "trainer-kernel", KERNEL_SCRIPT, timeout=400,
                      OUT_OF_REACH=OUT_OF_REACH)
    got = dict(ln.rsplit(" ", 1) for ln in res["out"] if " " in ln)
    assert got.pop("uid") == "0", res  # the task image's root: the strongest holder
    assert got.pop("hostname-same") == "yes", res
    # A cgroup v1 node (this machine's): the name planted in its tmpfs is seen, so restored.
    # util-linux's `mount` leaves its lock dir /run/mount even when refused: a file like any.
    want = {"/sys/fs/cgroup/cpu.max"} if got.pop("planted") == "yes" else set()
    assert set(res["changed"]) - {"/run/mount"} == want, res
    assert len(got) == 9, got
    assert not [k for k, code in got.items() if code == "0"], got
    figures.add("e2e: a grading pod's root could change none of /proc/sys, /sys, the hostname, "
                "mounts, namespaces or kernel keys (9 attempts refused)")
