"""/dev for checked reuse: in a container it is a tmpfs the sandbox's root may write (the
null device made a file, the /dev/fd link a directory holding its own 63, other devices made
with CAP_MKNOD), and the next holder's commands open its names (`> /dev/null`, `<(...)`).

The baseline watches it in both scopes (area "dev"): every entry of /dev's own filesystem by
lstat, a device by its number (st_rdev), a link by its target; the filesystems mounted below
it (devpts, /dev/shm, /dev/mqueue) are not entered, their mount points are compared. The
restore deletes what was added; anything else changed is left, which retires the pod: execd
makes no device node. On the node's own device filesystem (devtmpfs: execd outside a pod, a
pod given the host's /dev) nothing is deleted, since the kernel adds nodes there: a change is
only reported. The cgroup v1 tmpfs at /sys/fs/cgroup is watched the same way (watched())."""

import os
import stat

NOT_PUT_BACK = "in /dev: only entries added are removed; a changed one is not made again"
NOT_REMOVED = "the node's device filesystem (devtmpfs): not removed"


def _unescape(field):
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n") \
        .replace("\\134", "\\")


def fs_type(path, mountinfo="/proc/self/mountinfo"):
    """The type of the filesystem mounted where `path` lives (the longest mount point above
    it), or None where mountinfo cannot be read."""
    best, kind = -1, None
    try:
        with open(mountinfo, "rb") as f:
            lines = f.read().decode("utf-8", "surrogateescape").splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(" ")
        try:
            point = _unescape(fields[4])
            fstype = fields[fields.index("-", 6) + 1]
        except (IndexError, ValueError):
            continue
        if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) > best:
            best, kind = len(point), fstype
    return kind


def mount_type(path, mountinfo="/proc/self/mountinfo"):
    """The type of the filesystem mounted exactly at `path`, or None (not a mount point, or
    mountinfo unreadable)."""
    try:
        with open(mountinfo, "rb") as f:
            lines = f.read().decode("utf-8", "surrogateescape").splitlines()
    except OSError:
        return None
    kind = None
    for line in lines:
        fields = line.split(" ")
        try:
            if _unescape(fields[4]) == path:
                kind = fields[fields.index("-", 6) + 1]  # the last mount there is the one seen
        except (IndexError, ValueError):
            continue
    return kind


def watched(root):
    """The pseudo filesystems watched like /dev: /dev itself and, on a cgroup v1 node, the
    tmpfs the runtime mounts at /sys/fs/cgroup to hold the controllers' (read-only) mounts:
    runc leaves that tmpfs writable, so a holder's files there (a fake `cpu.max` a runtime
    would read for its thread count) outlived it. A cgroup v2 mount is read-only: not walked."""
    out = [os.path.join(root, "dev")]
    cgroup = os.path.join(root, "sys/fs/cgroup")
    if mount_type(cgroup) == "tmpfs":
        out.append(cgroup)
    return out


def removable(path):
    """Whether the restore may delete what was added under `path` (not the node's devtmpfs;
    unknown counts as the node's)."""
    kind = fs_type(path)
    return kind is not None and kind != "devtmpfs"


def is_device(mode):
    return stat.S_ISCHR(mode) or stat.S_ISBLK(mode)


def device_change(path, ent, st, area):
    """/diff's entry for a device node that is another one now (number, kind or inode)."""
    def num(mode, rdev):
        return [os.major(rdev), os.minor(rdev)] if is_device(mode) else None

    if (stat.S_IFMT(st.st_mode), st.st_rdev, st.st_ino) == (stat.S_IFMT(ent.mode), ent.rdev,
                                                            ent.ino):
        return None
    return {"kind": "device", "path": path, "area": area, "old": num(ent.mode, ent.rdev),
            "new": num(st.st_mode, st.st_rdev)}
