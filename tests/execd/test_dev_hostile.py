"""/dev as a root holder can change it: in a container /dev is a tmpfs the sandbox's root may
write. execd takes nothing from it after start that a later holder's commands would read:
the shell reads its requests from a socket, not a /dev/fd path, and every command, spawn and
probe gets execd's own /dev/null, opened once at start and checked to be the null device.

execd runs here in a private mount namespace whose /dev is a writable tmpfs laid out like a
container's (the null, zero and random devices bound in), and the holder is root."""

from __future__ import annotations

import base64
import os
import shutil

import pytest

from .conftest import wait_for

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                       reason="needs root and unshare for a private mount namespace"),
]

# A container's /dev: a tmpfs with the devices bound in, /dev/fd a link into /proc.
CONTAINER_DEV = r"""
set -e
d=$(mktemp -d)
mount -t tmpfs -o mode=755 sandbox-dev "$d"
for n in null zero random urandom; do touch "$d/$n"; mount --bind "/dev/$n" "$d/$n"; done
mkdir "$d/pts" "$d/shm"
mount --bind /dev/pts "$d/pts"
mount -t tmpfs sandbox-shm "$d/shm"
ln -s pts/ptmx "$d/ptmx"
ln -s /proc/self/fd "$d/fd"
mount --rbind "$d" /dev
umount -l "$d"
exec "$@"
"""
PREFIX = ("unshare", "-m", "--propagation", "private", "sh", "-c", CONTAINER_DEV, "sh")

# The holder's move: a file of its own where the null device was, and a script where the
# shell's /dev/fd/63 was.
PLANT = (
    "for i in 1 2 3 4; do umount -l /dev/null || break; done 2>&-; rm /dev/null && printf 'from-the-last-holder\\n' > /dev/null && "
    "rm /dev/fd && mkdir /dev/fd && printf 'echo hijacked > %s\\n' > /dev/fd/63 && echo planted"
)


def test_a_holder_who_rewrites_dev_reaches_no_later_command(execd_factory, tmp_path):
    d = execd_factory(prefix=PREFIX)
    assert d.exec("stat -c %t:%T /dev/null")["output"] == "1:3\n"  # the bed is as claimed
    marker = tmp_path / "hijacked"
    r = d.exec(PLANT % marker)
    assert r["output"] == "planted\n", r
    assert d.exec("cat /dev/null")["output"] == "from-the-last-holder\n"
    # The next holder's shell is a new one: the last one exits, execd starts another.
    assert "new shell" in d.exec("exit 0")["error"]
    # What every later command reads as stdin is the null device, not the holder's file
    # (which the shell's own `2>/dev/null` would truncate: compare the device, not the bytes).
    stdin = "stat -L -c '%F %t:%T' /proc/self/fd/0"
    assert d.exec(stdin)["output"] == "character special file 1:3\n"
    p = d.post("/processes/spawn", {"command": stdin}).json()
    assert wait_for(lambda: not d.get("/processes/info", params={"id": p["id"]}).json()[
        "output_open"], 10)
    out = d.get("/processes/output", params={"id": p["id"]}).json()
    assert base64.b64decode(out["data_b64"]) == b"character special file 1:3\n", out
    assert not marker.exists()
    assert d.exec("echo fine")["output"] == "fine\n"


def test_execd_refuses_to_start_where_dev_null_is_not_the_null_device(execd_factory):
    bad = ("unshare", "-m", "--propagation", "private", "sh", "-c",
           'f=$(mktemp) && mount --bind "$f" /dev/null && exec "$@"', "sh")
    with pytest.raises(AssertionError, match="not the null device.*refusing to start"):
        execd_factory(prefix=bad)


# A container's /dev under execd's --root, in a private mount namespace: a tmpfs with the
# device nodes made as runc makes them, devpts bound in (another filesystem, whose entries come
# and go with every pty of the machine), /dev/shm a tmpfs of its own, the usual links.
ROOT_DEV = r"""
set -e
d="$SANDMAN_TEST_ROOT/dev"
mount -t tmpfs -o mode=755 sandbox-dev "$d"
mknod -m 666 "$d/null" c 1 3; mknod -m 666 "$d/zero" c 1 5; mknod -m 666 "$d/tty" c 5 0
mknod -m 666 "$d/random" c 1 8; mknod -m 666 "$d/urandom" c 1 9
mkdir "$d/pts" "$d/shm"
mount --bind /dev/pts "$d/pts"
mount -t tmpfs sandbox-shm "$d/shm"
ln -s pts/ptmx "$d/ptmx"; ln -s /proc/self/fd "$d/fd"
ln -s /proc/self/fd/0 "$d/stdin"; ln -s /proc/self/fd/1 "$d/stdout"
exec "$@"
"""


def watched_dev(execd_factory, tmp_path, scope):
    """execd watching <root>/dev (a container's, as above) with a baseline from its start."""
    d, r = watched_root(execd_factory, tmp_path, scope, ROOT_DEV)
    return d, r / "dev"


def watched_root(execd_factory, tmp_path, scope, layout):
    """execd over a --root laid out by the shell script `layout` in a private mount
    namespace, with a baseline from its start, clean: (execd, the root)."""
    r = tmp_path / "root"
    for p in ("ws", "etc", "dev"):
        (r / p).mkdir(parents=True)
    (r / "ws" / "f.py").write_text("x = 1\n")
    (r / "etc" / "hosts").write_text("127.0.0.1 localhost\n")
    d = execd_factory(
        "--root", str(r), "--workspace", str(r / "ws"), "--kill-grace", "0.5",
        "--baseline-at-start", "on", "--baseline-store", str(tmp_path / "store"),
        "--baseline-paths", str(r / "etc"), "--baseline-packages", str(r / "none"),
        "--baseline-localtime", str(r / "etc" / "localtime"), "--baseline-scope", scope,
        prefix=("unshare", "-m", "--propagation", "private", "sh", "-c", layout, "sh"),
        env={"SANDMAN_TEST_ROOT": str(r)})
    assert d.get("/diff").json()["clean"] is True
    return d, r


@pytest.mark.parametrize("scope", ["listed", "root"])
def test_dev_rewritten_by_the_holder_retires_the_pod(execd_factory, tmp_path, scope):
    """The null device a file of the holder's, /dev/fd a directory holding its own 63 (what
    `<(...)` hands a command), /dev/stdout pointed elsewhere, /dev/tty and /dev/urandom other
    devices, /dev/random re-moded: none can be put back by execd, so the pod is retired and
    no later command reads any of it."""
    d, dev = watched_dev(execd_factory, tmp_path, scope)
    marker = tmp_path / "hijacked"
    r = d.exec(f"cd {dev} && rm null && printf 'from-the-last-holder\\n' > null && "
               f"rm fd && mkdir fd && printf 'echo hijacked > {marker}\\n' > fd/63 && "
               f"ln -sfn {tmp_path}/out stdout && rm tty && mknod -m 666 tty c 1 3 && "
               f"rm urandom && mknod -m 666 urandom c 1 5 && chmod 600 random && echo planted")
    assert r["output"] == "planted\n", r
    got = {(c["kind"], c.get("path")): c for c in d.get("/diff").json()["changes"]}
    for kind, name in (("type", "null"), ("type", "fd"), ("added", "fd/63"),
                       ("symlink", "stdout"), ("device", "tty"), ("device", "urandom"),
                       ("mode", "random")):
        assert (kind, str(dev / name)) in got, (kind, name, sorted(got))
        assert got[(kind, str(dev / name))]["area"] == "dev"
    assert got[("device", str(dev / "urandom"))]["old"] == [1, 9]
    assert got[("device", str(dev / "urandom"))]["new"] == [1, 5]
    assert not any("/pts/" in (p or "") for _, p in got), sorted(got)
    res = d.post("/restore", {}, timeout=60)
    assert res.status_code == 200 and res.json()["restored"] is False, res.text
    left = {x.get("path") for x in res.json()["left"]}
    assert str(dev / "null") in left and str(dev / "urandom") in left, res.json()
    r = d.post("/exec", {"command": f"bash {dev}/fd/63", "timeout": 10})
    assert r.status_code == 503 and r.json()["retired"] is True, r.text
    assert not marker.exists()
    assert d.get("/diff").json()["changes"][-1]["kind"] == "retired"


@pytest.mark.parametrize("scope", ["listed", "root"])
def test_what_the_holder_only_added_to_dev_is_removed(execd_factory, tmp_path, scope):
    """Nodes made with CAP_MKNOD, a file, a directory and a link added to /dev are deleted by
    the restore and the pod is clean; a pty the holder holds open (an entry of devpts, another
    filesystem) is no change of /dev."""
    d, dev = watched_dev(execd_factory, tmp_path, scope)
    added = ("evil", ".hidden", "x", "x/y", "z")
    r = d.exec(f"cd {dev} && mknod -m 666 evil c 1 3 && echo hi > .hidden && mkdir x && "
               f"echo hi > x/y && ln -s /etc/passwd z && echo planted")
    assert r["output"] == "planted\n", r
    p = d.post("/processes/spawn", {"command": "exec python3 -c 'import os, time; "
                                              "m, s = os.openpty(); time.sleep(120)'"}).json()
    assert "id" in p, p
    got = {(c["kind"], c["path"], c["area"]) for c in d.get("/diff").json()["changes"]
           if "path" in c}  # the spawned process and the shell's `cd` (PWD) are no files
    assert got == {("added", str(dev / n), "dev") for n in added}, got
    res = d.post("/restore", {}, timeout=60)
    assert res.status_code == 200 and res.json()["restored"] is True, res.text
    assert not any(os.path.lexists(dev / n) for n in added)
    assert d.get("/diff").json()["clean"] is True
    assert d.exec(f"stat -c '%t:%T' {dev}/null")["output"] == "1:3\n"


# A cgroup v1 node's /sys/fs/cgroup as runc lays it out in a container: a tmpfs (left
# writable) holding each controller's cgroup mounted read-only. Here: a tmpfs under --root
# with read-only binds standing in for the controllers.
ROOT_CGROUP_V1 = ROOT_DEV.replace("exec \"$@\"\n", r"""c="$SANDMAN_TEST_ROOT/sys/fs/cgroup"
mkdir -p "$c"
mount -t tmpfs -o mode=755 sandbox-cgroup "$c"
for n in cpu memory pids; do
  mkdir "$c/$n"; mount --bind /sys/fs/cgroup "$c/$n"; mount -o remount,bind,ro "$c/$n"
done
exec "$@"
""")


@pytest.mark.parametrize("scope", ["listed", "root"])
def test_what_the_holder_planted_in_the_cgroup_tmpfs_is_seen_and_removed(execd_factory,
                                                                          tmp_path, scope):
    """A cgroup v2 file name planted at the top of a v1 node's /sys/fs/cgroup (`cpu.max`, which
    runtimes read for their thread count), a directory and a link: the tmpfs is writable, so
    they outlived the holder unseen (/sys is never walked). Now /diff lists them and the
    restore deletes them; the controllers' own mounts are not entered."""
    d, r = watched_root(execd_factory, tmp_path, scope, ROOT_CGROUP_V1)
    cg = r / "sys" / "fs" / "cgroup"
    assert d.exec(f"echo 1 > {cg}/pids/evil")["exit_code"] != 0  # the controllers: read-only
    added = ("cpu.max", "evil", "evil/x", "memory.max")
    out = d.exec(f"cd {cg} && echo '1000 100000' > cpu.max && mkdir evil && echo 1 > evil/x && "
                 "ln -s /etc/passwd memory.max && echo planted")
    assert out["output"] == "planted\n", out
    got = {(c["kind"], c["path"]) for c in d.get("/diff").json()["changes"] if "path" in c}
    assert got == {("added", str(cg / n)) for n in added}, got
    res = d.post("/restore", {}, timeout=60)
    assert res.status_code == 200 and res.json()["restored"] is True, res.text
    assert not any(os.path.lexists(cg / n) for n in added)
    assert d.get("/diff").json()["clean"] is True
