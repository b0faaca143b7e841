"""/conditions readers against real cgroup v1 and v2 trees built in a temp dir.

Each case writes /proc/self/cgroup, /proc/self/mountinfo and the cgroup files of a whole
hierarchy (own cgroup and ancestors, the way kubelet lays them out) under a root directory,
with different values per case, so a reader that hard-codes, guesses or reads the wrong level
fails. execd reads them through `--conditions-root` (tests only); the same functions read "/"
in a pod. Visible CPUs come from the real affinity of execd's shell, so pinning is real too.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from execd.execd_daemon import conditions as X

GI = 1 << 30
V2_MOUNT = "30 25 0:26 {root} /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n"
V1_MOUNT = "3{n} 25 0:2{n} {root} /sys/fs/cgroup/{ctl} rw,nosuid - cgroup cgroup rw,{ctl}\n"


def put(root: Path, rel: str, text: str) -> None:
    p = root / rel.lstrip("/")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def v2_tree(root: Path, path: str, levels: dict[str, dict[str, str]],
            mount_root: str = "/", controllers: str = "cpuset cpu io memory pids") -> None:
    """A cgroup v2 hierarchy: `levels` maps a cgroup path (relative to the mount) to its
    files; the process lives in `path` (as /proc/self/cgroup shows it)."""
    put(root, "/proc/self/cgroup", f"0::{path}\n")
    put(root, "/proc/self/mountinfo",
        "22 1 8:1 / / rw - ext4 /dev/sda1 rw\n" + V2_MOUNT.format(root=mount_root))
    put(root, "/sys/fs/cgroup/cgroup.controllers", controllers + "\n")
    for rel, files in levels.items():
        for name, text in files.items():
            put(root, f"/sys/fs/cgroup/{rel.strip('/')}/{name}".replace("//", "/"), text + "\n")


def v1_tree(root: Path, path: str, ctls: dict[str, dict[str, dict[str, str]]],
            mount_root: str = "/") -> None:
    """A cgroup v1 layout: one hierarchy per controller group (e.g. "cpu,cpuacct")."""
    cg, mi = [], ["22 1 8:1 / / rw - ext4 /dev/sda1 rw\n"]
    for n, (ctl, levels) in enumerate(ctls.items()):
        cg.append(f"{n + 2}:{ctl}:{path}\n")
        mi.append(V1_MOUNT.format(n=n, root=mount_root, ctl=ctl))
        for rel, files in levels.items():
            for name, text in files.items():
                put(root, f"/sys/fs/cgroup/{ctl}/{rel.strip('/')}/{name}".replace("//", "/"),
                    text + "\n")
    put(root, "/proc/self/cgroup", "".join(cg) + "1:name=systemd:/\n0::/\n")
    put(root, "/proc/self/mountinfo", "".join(mi))


# ---- cgroup v2 --------------------------------------------------------------------------

POD = "/kubepods.slice/kubepods-pod1.slice"
CTR = POD + "/cri-containerd-abc.scope"


@pytest.mark.parametrize("pod_cpu,ctr_cpu,want_cores,pod_mem,ctr_mem,want_mem", [
    ("150000 100000", "max 100000", 1.5, str(3 * GI), "max", 3 * GI),  # pod-level limits
    ("max 100000", "250000 100000", 2.5, "max", str(5 * GI), 5 * GI),  # container-level
    ("400000 100000", "50000 50000", 1.0, str(2 * GI), str(7 * GI), 2 * GI),  # min of both
    ("70000 200000", "max 100000", 0.35, str(123456789 * 4096), "max", 123456789 * 4096),
])
def test_v2_nested_effective_is_min_up_the_tree(tmp_path, pod_cpu, ctr_cpu, want_cores,
                                                 pod_mem, ctr_mem, want_mem):
    v2_tree(tmp_path, CTR, {
        "/": {"cpu.max": "max 100000", "memory.max": "max"},  # the root cgroup has no files
        "/kubepods.slice": {"cpu.max": "max 100000", "memory.max": "max"},
        POD: {"cpu.max": pod_cpu, "memory.max": pod_mem},
        CTR: {"cpu.max": ctr_cpu, "memory.max": ctr_mem},
    })
    c = X.cpu_limits(str(tmp_path))
    assert c["cpu_cores"] == pytest.approx(want_cores) and c["cpu_unlimited"] is False
    assert c["cpu_quota_us"] / c["cpu_period_us"] == pytest.approx(want_cores)
    assert c["cpu_source"].startswith("/sys/fs/cgroup/kubepods.slice/kubepods-pod1.slice")
    m = X.memory_limit(str(tmp_path))
    assert m == {"memory_limit_bytes": want_mem, "memory_unlimited": False,
                 "memory_source": m["memory_source"]}
    assert m["memory_source"].endswith("/memory.max")


def test_v2_max_everywhere_is_unlimited(tmp_path):
    v2_tree(tmp_path, CTR, {POD: {"cpu.max": "max 100000", "memory.max": "max"},
                            CTR: {"cpu.max": "max 100000", "memory.max": "max"}})
    c, m = X.cpu_limits(str(tmp_path)), X.memory_limit(str(tmp_path))
    assert c["cpu_unlimited"] is True and c["cpu_quota_us"] is None and c["cpu_cores"] is None
    assert c["cpu_period_us"] == 100000 and c["cpu_source"] == f"/sys/fs/cgroup{CTR}/cpu.max"
    assert m["memory_unlimited"] is True and m["memory_limit_bytes"] is None


def test_v2_namespaced_sees_only_its_own_cgroup(tmp_path):
    # A private cgroup namespace: /proc/self/cgroup says "0::/" and the mount is the container's.
    v2_tree(tmp_path, "/", {"/": {"cpu.max": "300000 100000", "memory.max": str(6 * GI),
                                  "cpuset.cpus.effective": "0"}})
    assert X.cpu_limits(str(tmp_path))["cpu_cores"] == pytest.approx(3.0)
    assert X.memory_limit(str(tmp_path))["memory_limit_bytes"] == 6 * GI
    assert X.cpuset(str(tmp_path)) == ([0], "/sys/fs/cgroup/cpuset.cpus.effective")


def test_v2_bind_mounted_subtree(tmp_path):
    # No cgroup namespace, the container's cgroup bind-mounted at /sys/fs/cgroup: the path in
    # /proc/self/cgroup is the host's; mountinfo's root maps it onto the mount point.
    v2_tree(tmp_path, CTR, {"/": {"cpu.max": "120000 100000", "memory.max": str(GI)}},
            mount_root=CTR)
    assert X.cpu_limits(str(tmp_path))["cpu_cores"] == pytest.approx(1.2)
    assert X.memory_limit(str(tmp_path))["memory_source"] == "/sys/fs/cgroup/memory.max"


def test_v2_without_cpu_controller_is_unread(tmp_path):
    v2_tree(tmp_path, CTR, {CTR: {"cpu.max": "100000 100000"}}, controllers="memory pids")
    c = X.cpu_limits(str(tmp_path))
    assert c["cpu_cores"] is None and c["cpu_unlimited"] is None and c["cpu_source"] is None


def test_v2_malformed_files_are_skipped(tmp_path):
    v2_tree(tmp_path, CTR, {POD: {"cpu.max": "200000 100000", "memory.max": str(4 * GI)},
                            CTR: {"cpu.max": "garbage", "memory.max": "lots"}})
    assert X.cpu_limits(str(tmp_path))["cpu_cores"] == pytest.approx(2.0)
    assert X.memory_limit(str(tmp_path))["memory_limit_bytes"] == 4 * GI


# ---- cgroup v1 --------------------------------------------------------------------------

V1PATH = "/kubepods/burstable/pod1/abc"


@pytest.mark.parametrize("quota,period,mem,want_cores", [
    ("150000", "100000", str(3 * GI), 1.5), ("400000", "100000", str(GI), 4.0),
    ("25000", "50000", str(3 * GI + 4096), 0.5)])
def test_v1_container_view(tmp_path, quota, period, mem, want_cores):
    # The usual container: each hierarchy's mount root is the container's own cgroup.
    v1_tree(tmp_path, V1PATH, {
        "cpu,cpuacct": {"/": {"cpu.cfs_quota_us": quota, "cpu.cfs_period_us": period}},
        "memory": {"/": {"memory.limit_in_bytes": mem}},
        "cpuset": {"/": {"cpuset.cpus": "0-1", "cpuset.effective_cpus": "1"}},
    }, mount_root=V1PATH)
    c = X.cpu_limits(str(tmp_path))
    assert c["cpu_cores"] == pytest.approx(want_cores)
    assert c["cpu_source"] == "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us"
    assert X.memory_limit(str(tmp_path))["memory_limit_bytes"] == int(mem)
    assert X.cpuset(str(tmp_path))[0] == [1]  # effective_cpus before cpuset.cpus


def test_v1_host_view_hierarchy_min(tmp_path):
    # The whole hierarchy visible (mount root "/"): the pod level bounds the container.
    v1_tree(tmp_path, V1PATH, {
        "cpu,cpuacct": {
            "/": {"cpu.cfs_quota_us": "-1", "cpu.cfs_period_us": "100000"},
            "/kubepods": {"cpu.cfs_quota_us": "-1", "cpu.cfs_period_us": "100000"},
            "/kubepods/burstable/pod1": {"cpu.cfs_quota_us": "75000",
                                         "cpu.cfs_period_us": "100000"},
            V1PATH: {"cpu.cfs_quota_us": "-1", "cpu.cfs_period_us": "100000"}},
        "memory": {
            "/": {"memory.limit_in_bytes": str((1 << 63) - 4096)},
            "/kubepods/burstable/pod1": {"memory.limit_in_bytes": str(2 * GI)},
            V1PATH: {"memory.limit_in_bytes": str(9 * GI)}},
    })
    c = X.cpu_limits(str(tmp_path))
    assert c["cpu_cores"] == pytest.approx(0.75)
    assert c["cpu_source"] == "/sys/fs/cgroup/cpu,cpuacct/kubepods/burstable/pod1/cpu.cfs_quota_us"
    m = X.memory_limit(str(tmp_path))
    assert m["memory_limit_bytes"] == 2 * GI
    assert m["memory_source"] == "/sys/fs/cgroup/memory/kubepods/burstable/pod1/" \
                                 "memory.limit_in_bytes"


def test_v1_unlimited(tmp_path):
    v1_tree(tmp_path, "/", {
        "cpu,cpuacct": {"/": {"cpu.cfs_quota_us": "-1", "cpu.cfs_period_us": "100000"}},
        "memory": {"/": {"memory.limit_in_bytes": "9223372036854771712"}}})
    c, m = X.cpu_limits(str(tmp_path)), X.memory_limit(str(tmp_path))
    assert c["cpu_unlimited"] is True and c["cpu_cores"] is None
    assert m["memory_unlimited"] is True and m["memory_limit_bytes"] is None


def test_hybrid_host_reads_v1_not_the_empty_unified_tree(tmp_path):
    # Like this test machine: v1 controllers plus a controller-less v2 at .../unified, and a
    # decoy cpu.max where the old reader looked first.
    v1_tree(tmp_path, "/", {
        "cpu,cpuacct": {"/": {"cpu.cfs_quota_us": "90000", "cpu.cfs_period_us": "100000"}}})
    with open(tmp_path / "proc/self/mountinfo", "a") as f:
        f.write("41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n")
    put(tmp_path, "/sys/fs/cgroup/unified/cgroup.controllers", "\n")
    put(tmp_path, "/sys/fs/cgroup/cpu.max", "800000 100000\n")
    assert X.cpu_limits(str(tmp_path))["cpu_cores"] == pytest.approx(0.9)


def test_no_cgroups_at_all_reads_nothing(tmp_path):
    (tmp_path / "proc/self").mkdir(parents=True)
    c, m = X.cpu_limits(str(tmp_path)), X.memory_limit(str(tmp_path))
    assert c["cpu_cores"] is None and c["cpu_unlimited"] is None
    assert m["memory_limit_bytes"] is None and m["memory_unlimited"] is None
    assert X.cpuset(str(tmp_path)) == (None, None)


def test_cpu_list_parsing():
    assert X.parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert X.parse_cpu_list("") == []
    assert X.parse_cpu_list("3-1") is None and X.parse_cpu_list("a") is None


# ---- time zone, user ----------------------------------------------------------------------

def test_time_zone_sources(tmp_path):
    (tmp_path / "etc").mkdir()
    assert X.time_zone(str(tmp_path))["tz"] == "UTC"  # no /etc/localtime: glibc reads UTC
    os.symlink("../usr/share/zoneinfo/America/New_York", tmp_path / "etc/localtime")
    z = X.time_zone(str(tmp_path))
    assert z["tz"] == "America/New_York" and z["tz_utc"] is False
    assert z["tz_source"] == "/etc/localtime"
    z = X.time_zone(str(tmp_path), ":Europe/Paris")
    assert z["tz"] == "Europe/Paris" and z["tz_source"] == "TZ"
    assert z["localtime"] == "America/New_York"
    (tmp_path / "etc/localtime").unlink()
    (tmp_path / "etc/localtime").write_bytes(b"TZif2...")  # a copied file names no zone
    assert X.time_zone(str(tmp_path))["tz"] is None
    (tmp_path / "etc/timezone").write_text("Asia/Tokyo\n")
    assert X.time_zone(str(tmp_path))["tz"] == "Asia/Tokyo"
    assert X.time_zone(str(tmp_path), "Etc/UTC")["tz_utc"] is True


def test_user_from_the_roots_passwd(tmp_path):
    put(tmp_path, "/etc/passwd", f"root:x:0:0::/root:/bin/sh\n"
                                 f"grader7:x:{os.getuid()}:{os.getgid()}::/home:/bin/sh\n"
                                 if os.getuid() else
                                 "grader7:x:0:0::/root:/bin/sh\n")
    u = X.user_info(str(tmp_path))
    assert u == {"uid": os.getuid(), "gid": os.getgid(), "user": "grader7"}


# ---- through the route ------------------------------------------------------------------

def test_route_reads_the_configured_root(execd_factory, tmp_path):
    root = tmp_path / "root"
    v2_tree(root, CTR, {POD: {"cpu.max": "170000 100000", "memory.max": str(11 * GI)},
                        CTR: {"cpu.max": "max 100000", "memory.max": "max",
                              "cpuset.cpus.effective": "0"}})
    put(root, "/etc/passwd", f"probe-user:x:{os.getuid()}:0::/:/bin/sh\n")
    os.symlink("/usr/share/zoneinfo/Australia/Perth", root / "etc/localtime")
    (tmp_path / "netguard.json").write_text('{"ok": true, "mode": "deny"}')
    d = execd_factory("--conditions-root", str(root), env={"PYTHONHASHSEED": "1234"})
    c = d.get("/conditions").json()
    assert c["cpu_cores"] == pytest.approx(1.7) and c["cpu_quota_us"] == 170000
    assert c["memory_limit_bytes"] == 11 * GI
    assert c["cpuset_cpus"] == [0] and c["visible_cpus"] == [0] and c["visible_cpu_count"] == 1
    assert c["user"] == "probe-user" and c["tz"] == "Australia/Perth"
    assert c["pythonhashseed"] == "1234" and c["netguard_mode"] == "deny"
    (tmp_path / "netguard.json").write_text('{"ok": false, "mode": "deny"}')
    assert d.get("/conditions").json()["netguard_mode"] is None  # a failed guard says nothing


def test_visible_cpus_follow_the_shells_pinning(execd_factory):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs to pin to one")
    cpus = sorted(os.sched_getaffinity(0))
    d = execd_factory()
    assert d.get("/conditions").json()["visible_cpus"] == cpus
    # Pin the shell (what every test command inherits), not execd: the reading follows it.
    r = d.exec(f"taskset -p -c {cpus[-1]} $$ >/dev/null && echo ok")
    assert r["output"].strip() == "ok", r
    c = d.get("/conditions").json()
    assert c["visible_cpus"] == [cpus[-1]] and c["visible_cpu_count"] == 1
    assert c["affinity_cpus"] == [cpus[-1]]


def test_visible_cpus_of_execd_started_pinned(execd_factory):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs to pin to one")
    first = sorted(os.sched_getaffinity(0))[0]
    d = execd_factory(prefix=("taskset", "-c", str(first)))
    assert d.get("/conditions").json()["visible_cpus"] == [first]
    # What a command in the sandbox sees agrees with the reading.
    assert d.exec("nproc")["output"].strip() == "1"
