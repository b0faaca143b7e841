"""Checked reuse against a holder who changes execd's own process attributes or leaves SysV IPC
objects behind: state outside the file system that every later holder inherits.

The holder runs as execd's uid. Against execd's pid and its threads it can lower rlimits
(`prlimit --pid`), raise nice (`renice`), switch the scheduling policy (`chrt`), narrow the CPU
affinity (`taskset`) and change `oom_score_adj`: every shell execd starts later inherits them,
so the next holder's correct patch grades failed. Shared memory segments, message queues and
semaphore arrays outlive the holder's processes (a segment stays charged to the pod's memory).
Each test attacks through /exec, then does what the controller does before handing the pod on
(/restore, /diff, on a new connection: a new execd thread), and requires either a fresh shell of
the next holder with execd's original attributes and no object left, or a restore that says it
did not restore (`left`, each with a `why`) and a /diff that is not clean (the pod is retired).
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import sys
from pathlib import Path

import httpx
import pytest

from execd.execd_daemon import procattrs, sysvipc

from .conftest import AUTH, wait_for

HOLDER = Path(__file__).with_name("sysv_holder.py")
LIMITS = {n[7:].lower(): getattr(resource, n) for n in dir(resource)
          if n.startswith("RLIMIT_") and n != "RLIMIT_OFILE"}


def caps() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


# CAP_SYS_NICE (23) and CAP_SYS_RESOURCE (24): what putting nice, policy, hard limits and
# oom_score_adj back needs.
PRIVILEGED = caps() & (3 << 23) == 3 << 23
# execd without them, as a pod's non-root or capability-dropped execd runs.
UNPRIVILEGED = ("setpriv", "--bounding-set", "-sys_nice,-sys_resource") if os.geteuid() == 0 \
    else ()


IOPRIO_GET = {"x86_64": 252, "aarch64": 31}.get(os.uname().machine)


def ioprio(tid: int) -> int:
    """The thread's I/O priority (ionice): no stdlib call, a syscall through ctypes."""
    import ctypes

    return ctypes.CDLL(None, use_errno=True).syscall(IOPRIO_GET, 1, tid)


def autogroup(pid: int) -> int | None:
    """The nice of the process's autogroup (`/proc/<pid>/autogroup`: "/autogroup-7 nice 0"),
    None in a kernel without autogroups. A new session (each shell's setsid) has its own."""
    try:
        return int(Path(f"/proc/{pid}/autogroup").read_text().split()[-1])
    except FileNotFoundError:
        return None


def sigcaught(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return int(line.split()[1], 16)
    return 0


def attrs(tid: int) -> dict:
    """What a process started from this thread inherits (the autogroup's nice: what it starts
    in execd's session)."""
    return {"limits": {n: resource.prlimit(tid, r) for n, r in LIMITS.items()},
            "autogroup": autogroup(tid),
            "ioprio": ioprio(tid),
            "nice": os.getpriority(os.PRIO_PROCESS, tid),
            "sched": os.sched_getscheduler(tid),
            "cpus": os.sched_getaffinity(tid),
            "oom_score_adj": Path(f"/proc/{tid}/oom_score_adj").read_text().strip()}


def threads(pid: int) -> dict:
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(t)] = attrs(int(t))
        except (ProcessLookupError, FileNotFoundError):
            pass
    return out


def start(execd_factory, tmp_path, prefix=(), at_start="on", root=None):
    ws, etc, store = tmp_path / "ws", tmp_path / "etc", tmp_path / "store"
    ws.mkdir()
    etc.mkdir()
    (etc / "hosts").write_text("127.0.0.1 localhost\n")
    return execd_factory("--workspace", str(ws), "--kill-grace", "0.5",
                         "--baseline-at-start", at_start, "--baseline-store", str(store),
                         "--baseline-paths", str(etc), "--baseline-packages", str(etc / "none"),
                         "--baseline-localtime", str(etc / "localtime"),
                         *(("--root", str(root)) if root else ()), prefix=prefix)


def sh(d, cmd: str) -> str:
    r = d.exec(cmd, timeout=30)
    assert r["exit_code"] == 0, r
    return r["output"]


def hand_over(d) -> dict:
    """/restore and /diff as the controller sends them: on a new connection, so on a thread
    execd starts after the holder's attack."""
    with httpx.Client(base_url=d.url, headers=AUTH, timeout=60) as c:
        r = c.post("/restore", json={})
        assert r.status_code == 200, r.text
        diff = c.get("/diff")
        assert diff.status_code == 200, diff.text
        return {"restore": r.json(), "diff": diff.json()}


def retired(got: dict) -> bool:
    """The restore refused: `left` names each thing with a why, /diff is not clean."""
    if got["restore"]["restored"]:
        return False
    left = got["restore"]["left"]
    assert left and all(x.get("why") for x in left), got
    assert got["diff"]["clean"] is False, got
    return True


def next_shell_is_original(d, before: dict) -> None:
    """A fresh shell (after /restore, and again after /reset on a new connection) and each of
    execd's threads have the attributes recorded before the attack."""
    for step in ("restore", "reset"):
        if step == "reset":
            with httpx.Client(base_url=d.url, headers=AUTH, timeout=60) as c:
                assert c.post("/reset", json={}).status_code == 200
        assert attrs(d.shell_pid()) == before, step
        assert sh(d, "cat /proc/self/oom_score_adj").strip() == before["oom_score_adj"]
    for tid, got in threads(d.pid).items():
        assert got == before, tid


ATTACKS = {
    "soft-limits": "prlimit --pid {pid} --nofile=64: --stack=1048576: --fsize=1048576: "
                   "--nproc=512: --core=0: --as=17179869184: --cpu=100000: --memlock=65536: "
                   "--locks=100: --sigpending=100: --msgqueue=4096: --data=17179869184:",
    "hard-limits": "prlimit --pid {pid} --nofile=64:64 --stack=1048576:1048576 "
                   "--fsize=1048576:1048576 --core=0:0",
    "nice-main-thread": "renice -n 10 -p {pid}",
    "nice-every-thread": "for t in /proc/{pid}/task/*; do renice -n 10 -p ${{t##*/}}; done",
    "sched-idle": "chrt -a -i -p 0 {pid}",
    "affinity": "taskset -a -p -c {cpu} {pid}",
    "oom_score_adj": "echo 900 > /proc/{pid}/oom_score_adj",
    "ionice-idle": "for t in /proc/{pid}/task/*; do ionice -c 3 -p ${{t##*/}}; done",
    # execd's session's scheduling group: a share of CPU below every other session's
    "autogroup": "echo 19 > /proc/{pid}/autogroup",
}
# What the kernel lets an execd without CAP_SYS_NICE and CAP_SYS_RESOURCE put back: a soft
# limit raised up to its hard limit, the affinity, and oom_score_adj down to the lowest value a
# privileged writer set (a holder without the capability cannot move that floor); the rest is
# reported.
PUT_BACK_UNPRIVILEGED = {"soft-limits", "affinity", "oom_score_adj", "ionice-idle", "autogroup"}


def attack(d, name: str) -> None:
    cpus = os.sched_getaffinity(d.pid)
    if name == "affinity" and len(cpus) < 2:
        pytest.skip("one CPU: no narrower affinity to set")
    if name == "autogroup" and autogroup(d.pid) is None:
        pytest.skip("no autogroups in this kernel")
    tool = ATTACKS[name].split()[0]
    if tool != "for" and tool != "echo" and not shutil.which(tool):
        pytest.skip(f"no {tool}")
    was = attrs(d.pid)
    sh(d, ATTACKS[name].format(pid=d.pid, cpu=min(cpus)))
    assert attrs(d.pid) != was, name


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_execds_own_attributes_lowered_by_the_holder(execd_factory, tmp_path, name):
    d = start(execd_factory, tmp_path)
    before = attrs(d.shell_pid())
    assert before == attrs(d.pid)
    attack(d, name)
    got = hand_over(d)
    if PRIVILEGED:  # root with CAP_SYS_NICE and CAP_SYS_RESOURCE puts everything back
        assert got["restore"]["restored"] is True, got
    if not retired(got):
        assert got["diff"]["clean"] is True, got
        next_shell_is_original(d, before)


@pytest.mark.skipif(os.geteuid() == 0 and not shutil.which("setpriv"), reason="no setpriv")
@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_what_cannot_be_put_back_without_privilege_retires_the_pod(execd_factory, tmp_path,
                                                                    name):
    d = start(execd_factory, tmp_path, prefix=UNPRIVILEGED)
    before = attrs(d.shell_pid())
    attack(d, name)
    got = hand_over(d)
    if name in PUT_BACK_UNPRIVILEGED:
        assert got["restore"]["restored"] is True, got
        assert got["diff"]["clean"] is True, got
        next_shell_is_original(d, before)
    else:
        assert retired(got), got
        assert {c["kind"] for c in got["diff"]["changes"]} >= {"execd", "retired"}, got
        r = d.post("/exec", {"command": "true", "timeout": 10})
        assert r.status_code == 503, r.text


def test_diff_names_each_changed_attribute(execd_factory, tmp_path):
    d = start(execd_factory, tmp_path)
    sh(d, f"prlimit --pid {d.pid} --nofile=64: && renice -n 3 -p {d.pid} >/dev/null "
          f"&& echo 901 > /proc/{d.pid}/oom_score_adj")
    changes = d.get("/diff").json()["changes"]
    names = {c["name"] for c in changes if c["kind"] == "execd"}
    assert {"rlimit nofile", "nice", "oom_score_adj"} <= names, changes
    was = autogroup(d.pid)
    if was is not None:
        sh(d, f"echo 7 > /proc/{d.pid}/autogroup")
        changes = d.get("/diff").json()["changes"]
        assert {"kind": "execd", "name": "autogroup", "old": was, "new": 7} in changes, changes
    nofile = next(c for c in changes if c.get("name") == "rlimit nofile")
    assert nofile["new"][0] == 64 and nofile["old"][0] != 64, nofile


def test_autogroup_without_autogroups_is_not_recorded(monkeypatch, tmp_path):
    """A kernel without autogroups has no /proc/<pid>/autogroup: nothing to compare."""
    monkeypatch.setattr(procattrs, "AUTOGROUP", str(tmp_path / "absent"))
    base = procattrs.record()
    assert base["autogroup"] is None
    assert [c for c in procattrs.changes(base) if c["name"] == "autogroup"] == []


def test_autogroup_that_cannot_be_set_back_is_left(monkeypatch, tmp_path):
    """A negative nice cannot be written back without CAP_SYS_NICE, nor anything where /proc
    refuses: the restore names it (the pod is retired)."""
    fake = tmp_path / "autogroup"
    fake.write_text("/autogroup-7 nice -5\n")
    monkeypatch.setattr(procattrs, "AUTOGROUP", str(fake))
    base = procattrs.record()
    fake.write_text("/autogroup-7 nice 19\n")

    def refuse(nice):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(procattrs, "_set_autogroup", refuse)
    left = [c for c in procattrs.restore(base) if c["name"] == "autogroup"]
    assert left and left[0]["old"] == -5 and left[0]["new"] == 19, left
    assert "cannot go back" in left[0]["why"], left


def test_an_affinity_that_follows_the_cpuset_is_no_change(monkeypatch):
    """The kubelet's CPU manager moves a pod's cpuset (its shared pool shrinks) and the kernel
    moves every thread's affinity with it: not the holder's doing. One narrowed inside the
    cpuset is."""
    all4 = (0, 0, 0, frozenset({0, 1, 2, 3}), 0)
    base = {"rlimits": {}, "oom_score_adj": 0, "threads": {1: all4}, "main": all4,
            "cpuset": all4[3]}
    monkeypatch.setattr(procattrs, "cpuset", lambda root="/": ([0, 1], "cpuset.cpus"))
    two = all4[:3] + (frozenset({0, 1}), 0)
    assert procattrs.changes(base, dict(base, threads={1: two, 7: two})) == []
    one = all4[:3] + (frozenset({0}), 0)
    got = procattrs.changes(base, dict(base, threads={1: one, 7: two}))
    assert got == [{"kind": "execd", "name": "affinity", "old": [0, 1], "new": [0],
                    "tids": [1]}], got


# ---------------------------------------------------------------- SysV IPC


def test_sysv_ipc_objects_in_the_nodes_namespace_are_reported_not_removed(monkeypatch):
    """hostIPC, or execd outside a pod: the objects may be anyone's."""
    monkeypatch.setattr(sysvipc, "_own_namespace", lambda: False)
    monkeypatch.setattr(sysvipc, "read", lambda root=None, mq=None: {("shm", 5): ("0",)})
    monkeypatch.setattr(sysvipc, "_remove", lambda added: pytest.fail("removed"))
    left = sysvipc.restore({})
    assert left == [{"kind": "ipc", "name": "shm", "id": 5,
                     "why": "the IPC namespace is the node's, not the pod's: not removed"}]

IPC_NS = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                            reason="needs root and unshare for a private IPC namespace")


def sysv(d) -> dict:
    """The objects the sandbox sees, read by a shell of execd's IPC namespace: kind -> ids."""
    out = {}
    for kind in ("shm", "msg", "sem"):
        rows = sh(d, f"cat /proc/sysvipc/{kind}").splitlines()[1:]
        out[kind] = {int(r.split()[1]) for r in rows if r.strip()}
    return out


@pytest.mark.netns
@IPC_NS
def test_sysv_ipc_objects_of_the_holder_do_not_outlive_restore(execd_factory, tmp_path):
    d, _ = mq_start(execd_factory, tmp_path)  # its queues mounted, as in a pod
    assert sysv(d) == {"shm": set(), "msg": set(), "sem": set()}
    made = sh(d, f"{sys.executable} {HOLDER} make; "
                 f"({sys.executable} {HOLDER} hold > held &) ; sleep 0.5; cat held")
    ids = sysv(d)
    assert sum(map(len, ids.values())) == 4, (made, ids)
    changes = d.get("/diff").json()["changes"]
    assert {(c["name"], c["id"]) for c in changes if c["kind"] == "ipc"} == {
        (k, i) for k, v in ids.items() for i in v}, changes
    got = hand_over(d)
    assert got["restore"]["restored"] is True and got["diff"]["clean"] is True, got
    assert sysv(d) == {"shm": set(), "msg": set(), "sem": set()}


@pytest.mark.netns
@IPC_NS
def test_sysv_ipc_objects_of_the_baseline_stay_and_their_removal_retires(execd_factory,
                                                                         tmp_path):
    d, _ = mq_start(execd_factory, tmp_path, at_start="off")
    sh(d, f"{sys.executable} {HOLDER} make")
    image = sysv(d)
    assert d.post("/baseline", {}).status_code == 200
    sh(d, f"{sys.executable} {HOLDER} make")
    got = hand_over(d)
    assert got["restore"]["restored"] is True and got["diff"]["clean"] is True, got
    assert sysv(d) == image
    # An object of the image removed cannot be made again: detected, the pod retired.
    sh(d, f"{sys.executable} {HOLDER} rm msg {min(image['msg'])}")
    changes = d.get("/diff").json()["changes"]
    assert {"kind": "ipc", "name": "msg", "id": min(image["msg"]), "change": "removed"} in \
        changes, changes
    assert retired(hand_over(d))


# ---------------------------------------------------------------- POSIX message queues

MQ_HOLDER = Path(__file__).with_name("mq_holder.py")
# The pod's IPC namespace with its queues mounted where a container has them (<root>/dev/mqueue),
# in a private mount namespace: the machine's /dev is never touched.
MQ_NS = ("unshare", "--ipc", "-m", "--propagation", "private", "sh", "-c",
         'mkdir -p "$0/dev/mqueue" && mount -t mqueue sandbox-mq "$0/dev/mqueue" && exec "$@"')


def mq_start(execd_factory, tmp_path, at_start="on", mount=True):
    root = tmp_path / "root"
    root.mkdir()
    prefix = MQ_NS if mount else ("unshare", "--ipc", "sh", "-c", 'exec "$@"')
    return start(execd_factory, tmp_path / "root", prefix=(*prefix, str(root)),
                 at_start=at_start, root=root), root / "dev" / "mqueue"


@pytest.mark.netns
@IPC_NS
def test_posix_message_queues_of_the_holder_do_not_outlive_restore(execd_factory, tmp_path):
    """A queue and its message outlive the process that made them: the restore removes it."""
    d, mq = mq_start(execd_factory, tmp_path)
    assert sh(d, f"{sys.executable} {MQ_HOLDER} make planted") == "make planted\n"
    assert sh(d, f"ls {mq}") == "planted\n"  # the mount is the namespace's: seen from it
    changes = d.get("/diff").json()["changes"]
    assert {"kind": "ipc", "name": "mq", "id": "planted", "change": "added"} in changes, changes
    got = hand_over(d)
    assert got["restore"]["restored"] is True and got["diff"]["clean"] is True, got
    assert sh(d, f"ls {mq}") == ""


@pytest.mark.netns
@IPC_NS
def test_posix_message_queues_of_the_baseline_changed_retire(execd_factory, tmp_path):
    """A message added to (or the removal of) a queue of the image cannot be undone."""
    d, mq = mq_start(execd_factory, tmp_path, at_start="off")
    sh(d, f"{sys.executable} {MQ_HOLDER} make image")
    assert d.post("/baseline", {}).status_code == 200
    sh(d, f"{sys.executable} {MQ_HOLDER} send image")
    changes = d.get("/diff").json()["changes"]
    assert {"kind": "ipc", "name": "mq", "id": "image", "change": "changed"} in changes, changes
    got = hand_over(d)
    assert retired(got)
    # The image's queue is left as it is (never unlinked) for the pod's deletion.
    assert [c["change"] for c in got["diff"]["changes"] if c.get("name") == "mq"] == [
        "changed"], got


@pytest.mark.netns
@IPC_NS
def test_posix_message_queues_that_cannot_be_listed_retire(execd_factory, tmp_path):
    """The pod's own IPC namespace without its queues mounted: execd cannot vouch for them."""
    d, _ = mq_start(execd_factory, tmp_path, mount=False)
    changes = d.get("/diff").json()["changes"]
    assert [c for c in changes if c.get("name") == "mq"] == [
        {"kind": "ipc", "name": "mq", "id": "", "change": "unlisted"}], changes
    assert retired(hand_over(d))


def test_ionice_unreadable_without_ctypes_is_a_refusal(monkeypatch):
    """Where execd's Python has no ctypes it cannot read its threads' I/O class: /diff says so,
    which retires the pod, rather than vouching for what it cannot see."""
    monkeypatch.setattr(procattrs, "_IOPRIO", "no ctypes: No module named '_ctypes'")
    base = procattrs.record()
    assert procattrs.changes(base) == [{"kind": "execd", "name": "ionice",
                                        "why": "not read: no ctypes: No module named '_ctypes'"}]


# ---------------------------------------------------------------- baseline processes

# What the holder does to a daemon the image started before the baseline ($D its pid); each
# is inherited by whatever the daemon starts for the next holder.
DAEMON_ATTACKS = {
    "rlimit": "prlimit --pid $D --nofile=64:64",
    "nice": "renice -n 7 -p $D",
    "affinity": f"taskset -p -c {min(os.sched_getaffinity(0))} $D",
    "oom_score_adj": "echo 700 > /proc/$D/oom_score_adj",
    # The daemon's own cd, on the holder's signal.
    "cwd": "kill -USR1 $D && for i in $(seq 100); do [ \"$(readlink /proc/$D/cwd)\" = /tmp ] "
           "&& break; sleep 0.05; done",
}


@pytest.mark.parametrize("name", sorted(DAEMON_ATTACKS))
def test_attributes_of_a_baseline_daemon_changed_by_the_holder_retire(execd_factory, tmp_path,
                                                                      name):
    if name == "affinity" and len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: no narrower affinity")
    d = start(execd_factory, tmp_path, at_start="off")
    # One process without children (a loop of `sleep`s would change the process set).
    daemon = sh(d, f"{sys.executable} -c 'import os, signal, time\n"
                   "signal.signal(signal.SIGUSR1, lambda *a: os.chdir(\"/tmp\"))\n"
                   "while True: time.sleep(1)' > /dev/null 2>&1 & echo $!").strip()
    # Its handler in place before anything is recorded (a loaded machine starts Python slowly).
    assert wait_for(lambda: sigcaught(int(daemon)) & 1 << (signal.SIGUSR1 - 1), 30)
    assert d.post("/baseline", {}).status_code == 200
    assert d.get("/diff").json()["clean"] is True
    sh(d, f"D={daemon}; {DAEMON_ATTACKS[name]}")
    changes = [c for c in d.get("/diff").json()["changes"] if c["kind"] == "process"]
    assert [(c["pid"], c["name"]) for c in changes] == [(int(daemon), name)], changes
    got = hand_over(d)
    assert retired(got), got
    assert any(x["kind"] == "process" and x["pid"] == int(daemon)
               for x in got["restore"]["left"]), got
