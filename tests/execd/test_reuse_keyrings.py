"""Checked reuse against a holder who leaves kernel keys behind.

A key added to the session keyring execd and every later shell share, or to the uid's user
keyring, outlives the holder's processes and is read by the next holder's. Each execd here runs
in a keyring session of its own (and, for the user keyring, a user namespace of its own), so a
test's keys never reach another test's execd. The holder adds keys with the add_key syscall
through ctypes (`keyctl` need not be installed).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from execd.execd_daemon import keyrings

from .test_reuse_process_state import hand_over, retired, sh, start

NUMS = {"x86_64": (248, 249, 250), "aarch64": (217, 218, 219)}.get(os.uname().machine)
# Joins a new anonymous session keyring (KEYCTL_JOIN_SESSION_KEYRING), then runs the rest.
OWN_SESSION = (sys.executable, "-c", "import ctypes, os, sys\n"
               f"assert ctypes.CDLL(None).syscall({NUMS and NUMS[2]}, 1, None) > 0\n"
               "os.execvp(sys.argv[1], sys.argv[1:])")
# The same behind a seccomp filter refusing add_key, request_key and keyctl with EPERM, as a
# pod's RuntimeDefault profile does.
SECCOMP = (sys.executable, "-c", f"""import ctypes, os, struct, sys
nums = {NUMS!r}
code = [(0x20, 0, 0, 0)] + [(0x15, 3 - i, 0, n) for i, n in enumerate(nums)] + [
    (0x06, 0, 0, 0x7fff0000), (0x06, 0, 0, 0x00050000 | 1)]
prog = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *c) for c in code))
fprog = struct.pack("HxxxxxxQ", len(code), ctypes.addressof(prog))
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(38, 1, 0, 0, 0) == 0
assert libc.prctl(22, 2, ctypes.c_char_p(fprog), 0, 0) == 0, ctypes.get_errno()
os.execvp(sys.argv[1], sys.argv[1:])""")
KEYS = pytest.mark.skipif(NUMS is None or not os.path.exists("/proc/keys"),
                          reason="no keyring syscall numbers or no /proc/keys")


def add_key(where: int, name: str = "planted") -> str:
    """A shell command adding a user key to a keyring (-3 session, -4 user); prints its id."""
    return (f"{sys.executable} -c \"import ctypes; print(ctypes.CDLL(None).syscall("
            f"{NUMS[0]}, b'user', b'{name}', b'secret', 6, {where}))\"")


def keyrings_of(diff: dict) -> list:
    return [c for c in diff["changes"] if c["kind"] == "keyring"]


@KEYS
def test_a_key_left_in_execds_session_keyring_retires(execd_factory, tmp_path):
    d = start(execd_factory, tmp_path, prefix=OWN_SESSION)
    # Another session of the same uid with a key of its own: listed in /proc/keys, out of
    # execd's reach, never a change.
    other = subprocess.Popen([*OWN_SESSION, "sh", "-c", add_key(-3, "other") + " && sleep 30"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert int(other.stdout.readline()) > 0
        assert keyrings_of(d.get("/diff").json()) == []
        assert int(sh(d, add_key(-3))) > 0
        changes = keyrings_of(d.get("/diff").json())
        assert any(c["change"] == "added" and c["name"].endswith(";planted")
                   for c in changes), changes
        got = hand_over(d)
        assert retired(got), got
        assert any(x["kind"] == "keyring" for x in got["restore"]["left"]), got
    finally:
        other.kill()
        other.wait()


@KEYS
@pytest.mark.skipif(not shutil.which("unshare") or subprocess.run(
    ["unshare", "--user", "--map-root-user", "true"], capture_output=True).returncode != 0,
    reason="no user namespaces here")
def test_a_key_left_in_the_uids_user_keyring_outlives_the_holder_and_retires(execd_factory,
                                                                              tmp_path):
    """The user keyring belongs to the uid, not to a process: the holder's processes are gone
    after the restore, the key is not. A user namespace of its own gives execd its own."""
    d = start(execd_factory, tmp_path,
              prefix=("unshare", "--user", "--map-root-user", *OWN_SESSION))
    assert keyrings_of(d.get("/diff").json()) == []
    assert int(sh(d, f"({add_key(-4)}) && sleep 0.1")) > 0
    assert any(c["change"] == "added" and c["name"].endswith(";planted")
               for c in keyrings_of(d.get("/diff").json()))
    got = hand_over(d)
    assert retired(got), got
    assert any(c["kind"] == "keyring" for c in got["diff"]["changes"]), got


@KEYS
def test_keyring_syscalls_refused_by_seccomp_are_no_change(execd_factory, tmp_path):
    """A pod's RuntimeDefault profile refuses the syscalls to execd and every process it starts,
    while /proc/keys stays readable (and lists keys of other sessions): nothing to vouch for,
    the restore succeeds."""
    d = start(execd_factory, tmp_path, prefix=SECCOMP)
    assert keyrings.read()[0] == "keys"  # this test process is not filtered
    out = sh(d, add_key(-3) + "; cat /proc/keys > /dev/null && echo readable")
    assert out == "-1\nreadable\n", out
    assert keyrings_of(d.get("/diff").json()) == []
    got = hand_over(d)
    assert got["restore"]["restored"] is True and got["diff"]["clean"] is True, got


def test_keyrings_that_cannot_be_read_are_a_refusal(monkeypatch, tmp_path):
    """No ctypes (python3-minimal) or /proc/keys unreadable where the syscalls work: /diff
    says execd cannot vouch for them, and the restore leaves them (the pod is retired)."""
    monkeypatch.setattr(keyrings, "_calls", lambda: "no ctypes: test")
    base = keyrings.read()
    assert base == ("refused", "no ctypes: test")
    assert keyrings.changes(base) == [{"kind": "keyring", "name": "keyrings",
                                       "why": "not read: no ctypes: test"}]
    assert keyrings.restore(base) == keyrings.changes(base)
    monkeypatch.undo()
    if NUMS is None or keyrings._blocked(*keyrings._calls()):
        pytest.skip("keyring syscalls refused here")
    monkeypatch.setattr(keyrings, "PROC_KEYS", str(tmp_path / "none"))
    base = keyrings.read()
    assert base[0] == "refused" and "cannot read" in base[1], base
    assert keyrings.changes(base)[0]["why"].startswith("not read: cannot read")
