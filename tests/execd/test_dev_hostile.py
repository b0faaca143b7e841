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
