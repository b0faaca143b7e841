"""The kernel keys execd's uid can reach, for checked reuse.

A holder running as execd's uid can add keys (`add_key`, `keyctl`) to the session keyring it
shares with execd and every later shell, to its uid's user and user-session keyrings (which
outlive every process of the uid) and to the uid's persistent keyring, change their payloads,
permissions and timeouts, or give execd another session keyring (KEYCTL_SESSION_TO_PARENT).
The baseline records every key reachable from those keyrings: the keyrings' ids, each key's
description (type, uid, gid, permissions), its /proc/keys flags and whether it expires, a
keyring's links and a readable key's payload hash. Any change retires the pod: a key cannot be
given back its serial.

Only what is reachable from execd's own keyrings: /proc/keys lists every key the uid may view,
which includes other sessions' keyrings (on a node, other containers' `_ses.*` of the same
uid), and those change without the holder. Where seccomp refuses all three syscalls (a pod's
RuntimeDefault profile) no process execd starts can make or change a key either: nothing to
record, and /diff stays clean. Where execd cannot tell (no ctypes, another architecture,
/proc/keys unreadable), /diff names the keyrings as not read: a refusal to vouch."""

import errno
import hashlib
import os
import sys

# add_key, request_key, keyctl
_CALLS = {"x86_64": (248, 249, 250), "aarch64": (217, 218, 219)}
KEYCTL_GET_KEYRING_ID = 0
KEYCTL_DESCRIBE = 6
KEYCTL_READ = 11
# execd's own keyrings (its threads' are its own, out of the holder's reach)
SPECS = (("process", -2), ("session", -3), ("user", -4), ("user-session", -5))
# The uid's persistent keyring (KEYCTL_GET_PERSISTENT) is nobody's until linked: by name.
PERSISTENT = "_persistent.%d"
PROC_KEYS = "/proc/keys"
MAX_KEYS = 4096
MAX_PAYLOAD = 1 << 20


def _calls():
    """(ctypes, syscall, numbers), or why not: a Python without ctypes (python3-minimal)."""
    nums = _CALLS.get(os.uname().machine)
    if nums is None:
        return "no keyring syscall numbers for %s" % os.uname().machine
    try:
        import ctypes

        return ctypes, ctypes.CDLL(None, use_errno=True).syscall, nums
    except (ImportError, OSError) as e:
        return "no ctypes: %s" % (e,)


def _blocked(ctypes, call, nums):
    """True where all three syscalls fail as seccomp (EPERM) or a kernel without keys (ENOSYS)
    fails them: calls with a NULL type or key 0 that would otherwise fail EFAULT or EINVAL.
    The filter binds every process execd starts, which cannot remove it."""
    for nr in nums:
        ctypes.set_errno(0)
        if call(nr, None, None, None, 0, 0) != -1:
            return False
        if ctypes.get_errno() not in (errno.EPERM, errno.ENOSYS):
            return False
    return True


def _proc_keys():
    """{id: (flags, expires, uid, type, description)} of /proc/keys (the usage count moves
    with every process sharing a keyring, a timeout with the clock: left out)."""
    out = {}
    with open(PROC_KEYS, "rb") as f:
        for line in f.read().decode("utf-8", "replace").splitlines():
            p = line.split(None, 8)
            if len(p) < 9:
                continue
            desc = p[8].split(":", 1)[0]
            out[int(p[0], 16)] = (p[1], p[3] != "perm", int(p[5]), p[7], desc)
    return out


def _keyctl(ctypes, call, nr, op, key, size):
    """(bytes, 0) of a DESCRIBE or READ, or (None, errno)."""
    n = call(nr, op, key, None, 0, 0)
    if n < 0:
        return None, ctypes.get_errno()
    for _ in range(3):  # a keyring may grow between the calls
        buf = ctypes.create_string_buffer(max(n, 1))
        got = call(nr, op, key, buf, n, 0)
        if got < 0:
            return None, ctypes.get_errno()
        if got <= n:
            return buf.raw[:got], 0
        if got > size:
            return None, errno.E2BIG
        n = got
    return None, errno.EAGAIN


def read():
    """("blocked",), ("refused", why) or ("keys", roots, keys): roots {name: id or None},
    keys {id: state}."""
    got = _calls()
    if isinstance(got, str):
        return ("refused", got)
    ctypes, call, nums = got
    if _blocked(ctypes, call, nums):
        return ("blocked",)
    nr = nums[2]
    roots = {}
    for name, spec in SPECS:
        # create 0: no process or session keyring made; the kernel makes the uid's user
        # keyrings on a first look-up all the same, so /proc/keys is read after.
        r = call(nr, KEYCTL_GET_KEYRING_ID, spec, 0, 0, 0)
        roots[name] = r if r > 0 else None
    try:
        listed = _proc_keys()
    except (OSError, ValueError) as e:
        return ("refused", "cannot read %s: %s" % (PROC_KEYS, e))
    name = PERSISTENT % os.geteuid()
    for kid, (_, _, owner, kind, desc) in listed.items():
        if owner == os.geteuid() and kind == "keyring" and desc == name:
            roots["%s %08x" % (name, kid)] = kid
    keys, todo = {}, [k for k in roots.values() if k]
    while todo and len(keys) < MAX_KEYS:
        kid = todo.pop()
        if kid in keys:
            continue
        desc, err = _keyctl(ctypes, call, nr, KEYCTL_DESCRIBE, kid, 4096)
        body, rerr = _keyctl(ctypes, call, nr, KEYCTL_READ, kid, MAX_PAYLOAD)
        if desc is not None and desc.startswith(b"keyring;"):
            links = [int.from_bytes(body[i:i + 4], sys.byteorder, signed=True)
                     for i in range(0, len(body or b"") - 3, 4)]  # key_serial_t, native
            todo.extend(links)
            content = tuple(sorted(links)) if body is not None else rerr
        else:
            content = hashlib.sha256(body).hexdigest() if body is not None else rerr
        keys[kid] = (desc.rstrip(b"\0").decode("utf-8", "replace") if desc is not None else err,
                     listed.get(kid, (None, None))[:2], content)
    return ("keys", roots, keys)


def changes(base, cur=None):
    """/diff's entries (kind "keyring")."""
    if base is None:
        return []
    if base[0] == "refused":
        return [{"kind": "keyring", "name": "keyrings", "why": "not read: %s" % base[1]}]
    cur = cur or read()
    if cur[0] != base[0]:
        return [{"kind": "keyring", "name": "keyrings", "change": "changed",
                 "why": "keyrings were %s at baseline, now %s" % (base[0], cur[0])}]
    if cur[0] != "keys":
        return []
    out = []
    for name in sorted(set(base[1]) | set(cur[1])):
        if base[1].get(name) != cur[1].get(name):
            out.append({"kind": "keyring", "name": name, "change": "replaced",
                        "old": base[1].get(name), "new": cur[1].get(name)})
    for kid in sorted(set(base[2]) | set(cur[2])):
        old, new = base[2].get(kid), cur[2].get(kid)
        if old != new:
            what = "added" if old is None else "removed" if new is None else "changed"
            desc = (new or old)[0]
            out.append({"kind": "keyring", "name": desc if isinstance(desc, str) else "",
                        "id": "%08x" % kid, "change": what})
    return out


def restore(base):
    """Nothing is put back (a key's serial cannot be given again): any change is `left`."""
    left = changes(base)
    for c in left:
        c.setdefault("why", "keys are not put back: the pod's keyrings differ from the "
                            "baseline's")
    return left
