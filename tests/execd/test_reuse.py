"""Checked reuse: POST /baseline, GET /diff, POST /restore against a temp root.

Every category is changed through the agent's own shell (or /env), listed by /diff, undone by
/restore, and compared byte for byte (content, mode, symlink target, type) with a snapshot taken
before the change. Nothing here touches the host's /etc: all roots are flags into tmp_path.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from .conftest import alive


def snapshot(root: Path) -> dict:
    """path -> (type, mode, content or link target, mtime_ns for files) for everything under
    root."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            if stat.S_ISLNK(st.st_mode):
                out[str(p)] = ("link", os.readlink(p))
            elif stat.S_ISDIR(st.st_mode):
                out[str(p)] = ("dir", stat.S_IMODE(st.st_mode))
            else:
                out[str(p)] = ("file", stat.S_IMODE(st.st_mode), p.read_bytes(),
                               st.st_mtime_ns)
    return out


def git(ws: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(ws), *args], check=True, capture_output=True,
                          text=True).stdout


@pytest.fixture
def world(tmp_path):
    """A workspace git repository, an /etc, a home, a site-packages and a dpkg status."""
    r = tmp_path / "root"
    ws = r / "ws"
    ws.mkdir(parents=True)
    (ws / "pkg").mkdir()
    (ws / "pkg" / "mod.py").write_bytes(b"def f():\r\n    return 1\n")
    (ws / "README").write_bytes(b"\xff\xfe not utf-8\n")
    (ws / ".gitignore").write_text("*.pyc\nbuild/\n")
    for cmd in (["init", "-q"], ["add", "-A"],
                ["-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "base"]):
        git(ws, *cmd)
    (ws / "untracked.txt").write_text("untracked\n")
    (ws / "pkg" / "mod.pyc").write_bytes(b"\x00ignored")
    etc = r / "etc"
    (etc / "conf.d").mkdir(parents=True)
    (etc / "hosts").write_text("127.0.0.1 localhost\n")
    (etc / "conf.d" / "a.conf").write_text("a=1\n")
    (etc / "secret").write_text("s\n")
    (etc / "secret").chmod(0o600)
    (etc / "zoneinfo").mkdir()
    (etc / "zoneinfo" / "UTC").write_bytes(b"TZif-utc")
    (etc / "zoneinfo" / "Tokyo").write_bytes(b"TZif-tokyo")
    os.symlink("zoneinfo/UTC", etc / "localtime")
    os.symlink("hosts", etc / "hosts.link")
    home = r / "home"
    home.mkdir()
    (home / ".bashrc").write_text("# rc\n")
    sp = r / "lib" / "site-packages"
    (sp / "requests").mkdir(parents=True)
    (sp / "requests" / "__init__.py").write_text("__version__ = '2.31.0'\n")
    (sp / "requests-2.31.0.dist-info").mkdir()
    (sp / "requests-2.31.0.dist-info" / "RECORD").write_text("requests/__init__.py,,\n")
    dpkg = r / "dpkg"
    dpkg.mkdir()
    (dpkg / "status").write_text("Package: bash\nStatus: install ok installed\n\n")
    (dpkg / "other").write_text("not watched\n")
    big = etc / "big.bin"
    big.write_bytes(b"x" * 5000)
    return {"root": r, "ws": ws, "etc": etc, "home": home, "sp": sp, "dpkg": dpkg,
            "store": tmp_path / "store", "big": big}


@pytest.fixture
def rd(execd_factory, world):
    w = world
    return execd_factory(
        "--workspace", str(w["ws"]), "--kill-grace", "0.5", "--baseline-at-start", "on",
        "--baseline-store", str(w["store"]),
        "--baseline-paths", f"{w['etc']}:{w['home']}",
        "--baseline-packages", f"{w['root']}/lib/site-*:{w['dpkg']}/status",
        "--baseline-localtime", str(w["etc"] / "localtime"),
        "--baseline-copy-cap", "4096", "--baseline-rerecord",
        env={"HOME": str(w["home"]), "KEEP_ME": "1"})


def diff(d) -> dict:
    r = d.get("/diff")
    assert r.status_code == 200, r.text
    return r.json()


def restore(d) -> dict:
    r = d.post("/restore", {})
    assert r.status_code == 200, r.text
    return r.json()


def kinds(changes: list, key: str = "path") -> set:
    return {(c["kind"], c.get(key)) for c in changes}


def sh(d, cmd: str) -> dict:
    r = d.exec(cmd, timeout=30)
    assert r["exit_code"] == 0, r
    return r


def test_clean_at_start_store_private_and_token_needed(rd, world):
    got = diff(rd)
    assert (got["clean"], got["changes"]) == (True, [])
    assert stat.S_IMODE(world["store"].stat().st_mode) == 0o700
    import httpx
    assert httpx.get(rd.url + "/diff").status_code == 401
    assert httpx.post(rd.url + "/restore", json={}).status_code == 401
    assert httpx.post(rd.url + "/baseline", json={}).status_code == 401


def test_files_content_modes_symlinks_deletions_additions(rd, world):
    etc, home = world["etc"], world["home"]
    before = snapshot(world["root"])
    sh(rd, f"cd {etc} && printf 'changed' > hosts && chmod 640 conf.d/a.conf && "
           f"ln -sfn conf.d hosts.link && rm secret && rm -r conf.d/../zoneinfo/Tokyo && "
           f"echo new > added && mkdir -p newdir/sub && echo x > newdir/sub/f && "
           f"rm {home}/.bashrc && mkdir {home}/.bashrc && chmod 700 conf.d")
    got = diff(rd)
    assert not got["clean"]
    k = kinds(got["changes"])
    for want in [("modified", str(etc / "hosts")), ("mode", str(etc / "conf.d" / "a.conf")),
                 ("symlink", str(etc / "hosts.link")), ("removed", str(etc / "secret")),
                 ("removed", str(etc / "zoneinfo" / "Tokyo")), ("added", str(etc / "added")),
                 ("added", str(etc / "newdir")), ("added", str(etc / "newdir" / "sub" / "f")),
                 ("type", str(home / ".bashrc")), ("mode", str(etc / "conf.d"))]:
        assert want in k, (want, got["changes"])
    # chmod alone is a mode change, not a content change
    assert ("modified", str(etc / "conf.d" / "a.conf")) not in k
    res = restore(rd)
    assert res["restored"] is True and res["left"] == [], res
    assert snapshot(world["root"]) == before
    assert diff(rd)["clean"] is True


def test_content_change_with_mtime_set_back_is_seen(rd, world):
    hosts = world["etc"] / "hosts"
    before = snapshot(world["root"])
    st = hosts.stat()
    sh(rd, f"printf '127.0.0.2 localhost\\n' > {hosts} && "
           f"touch -d @{st.st_mtime_ns // 10**9}.{st.st_mtime_ns % 10**9:09d} {hosts}")
    assert hosts.stat().st_mtime_ns == st.st_mtime_ns and hosts.stat().st_size == st.st_size
    assert ("modified", str(hosts)) in kinds(diff(rd)["changes"])
    assert restore(rd)["restored"] is True
    assert snapshot(world["root"]) == before


def test_repo_head_index_untracked_ignored(rd, world):
    ws = world["ws"]
    before = snapshot(world["root"])
    head = git(ws, "rev-parse", "HEAD")
    status = git(ws, "status", "--porcelain", "--ignored")
    sh(rd, "printf 'def f():\\n    return 2\\n' > pkg/mod.py && echo more >> untracked.txt && "
           "rm pkg/mod.pyc && mkdir build && echo b > build/out && git add -A && "
           "git -c user.email=a@a -c user.name=a commit -qm agent && echo planted > conftest.py")
    assert git(ws, "rev-parse", "HEAD") != head
    got = diff(rd)
    k = kinds(got["changes"], "name")
    assert ("repo", "HEAD") in k or ("repo", "index") in k, got["changes"]
    assert ("repo", "index") in k
    paths = kinds(got["changes"])
    assert ("added", str(ws / "conftest.py")) in paths
    assert ("removed", str(ws / "pkg" / "mod.pyc")) in paths
    assert ("modified", str(ws / "untracked.txt")) in paths
    res = restore(rd)
    assert res["restored"] is True, res
    assert snapshot(world["root"]) == before
    assert diff(rd)["clean"] is True
    assert git(ws, "rev-parse", "HEAD") == head
    # (git status may refresh .git/index itself: checked last)
    assert git(ws, "status", "--porcelain", "--ignored") == status


def test_packages_site_packages_and_dpkg_status(rd, world):
    sp, dpkg = world["sp"], world["dpkg"]
    before = snapshot(world["root"])
    sh(rd, f"builtin cd {sp} && rm -r requests requests-2.31.0.dist-info && mkdir requests "
           f"requests-2.32.0.dist-info && echo \"__version__ = '2.32.0'\" > requests/__init__.py"
           f" && printf 'Package: evil\\n\\n' >> {dpkg}/status && echo y > {dpkg}/other")
    got = diff(rd)
    areas = {c.get("area") for c in got["changes"] if "path" in c}
    assert areas == {"packages"}, [(c["path"][-40:], c["area"]) for c in got["changes"] if "path" in c and c["area"] != "packages"]
    assert {c["name"] for c in got["changes"] if "path" not in c} == {"PWD", "OLDPWD"}
    k = kinds(got["changes"])
    assert ("modified", str(dpkg / "status")) in k
    assert ("added", str(sp / "requests-2.32.0.dist-info")) in k
    assert ("removed", str(sp / "requests-2.31.0.dist-info" / "RECORD")) in k
    # dpkg/other is not a watched root
    assert not any(c.get("path") == str(dpkg / "other") for c in got["changes"])
    assert restore(rd)["restored"] is True
    after = snapshot(world["root"])
    other = str(dpkg / "other")
    assert after[other][2] == b"y\n"
    after.pop(other)
    before.pop(other)
    assert after == before
    assert diff(rd)["clean"] is True


def test_env_set_unset_changed_and_later_shells(rd):
    env0 = rd.post("/env", {}).json()["env"]
    assert env0["KEEP_ME"] == "1"
    rd.post("/env", {"set": {"PYTHONHASHSEED": "7"}, "unset": ["KEEP_ME"]})
    sh(rd, "export AGENT_VAR=x; export HOME=/nowhere")
    got = diff(rd)
    k = {(c["name"], c["change"]) for c in got["changes"] if c["kind"] == "env"}
    assert {("PYTHONHASHSEED", "set"), ("KEEP_ME", "unset"), ("AGENT_VAR", "set"),
            ("HOME", "changed")} <= k, got["changes"]
    assert restore(rd)["restored"] is True
    assert rd.post("/env", {}).json()["env"] == env0
    # /env's changes to later shells are undone too: a reset starts from the baseline env.
    assert rd.post("/reset", {}).status_code == 200
    env = rd.post("/env", {}).json()["env"]
    assert env.get("KEEP_ME") == "1" and "PYTHONHASHSEED" not in env
    assert diff(rd)["clean"] is True


def test_time_zone_var_and_localtime(rd, world):
    lt = world["etc"] / "localtime"
    rd.post("/env", {"set": {"TZ": "Asia/Tokyo"}})
    sh(rd, f"ln -sfn zoneinfo/Tokyo {lt}")
    got = diff(rd)
    k = {c["name"] for c in got["changes"] if c["kind"] == "tz"}
    assert k == {"TZ", "localtime"}, got["changes"]
    res = restore(rd)
    assert res["restored"] is True, res
    assert os.readlink(lt) == "zoneinfo/UTC"
    assert "TZ" not in rd.post("/env", {}).json()["env"]
    assert diff(rd)["clean"] is True


def test_processes_started_after_baseline_are_killed(rd):
    out = sh(rd, "setsid sleep 1000 > /dev/null 2>&1 < /dev/null & echo $!; "
                 "(trap '' TERM; exec sleep 999) > /dev/null 2>&1 & echo $!")["output"]
    pids = [int(x) for x in out.split()]
    assert all(alive(p) for p in pids)
    got = diff(rd)
    extra = {c["pid"] for c in got["changes"] if c["kind"] == "process"
             and c["change"] == "extra"}
    assert set(pids) <= extra, got["changes"]
    res = restore(rd)
    assert res["restored"] is True, res
    assert not any(alive(p) for p in pids)
    assert diff(rd)["clean"] is True


def test_shell_state_is_fresh_after_restore(rd, world):
    sh(rd, f"cd {world['etc']}; f() {{ echo hi; }}; LOCAL=1")
    assert restore(rd)["restored"] is True
    out = sh(rd, "pwd; type -t f; echo ${LOCAL-unset}")["output"].split()
    assert out == [str(world["ws"]), "unset"]


# What a shell carries that no file, variable or cwd shows: the next holder's commands would
# run under them (a `ls` that is the holder's alias, a DEBUG trap before each command, errexit,
# noclobber, 64 fds, a nice of 5).
SHELL_PROBE = ("umask; alias; trap -p; echo $-; set -o; shopt; ulimit -a; ulimit -Ha; "
               "cut -d' ' -f19 /proc/$$/stat")
SHELL_ATTACKS = {
    "umask": "umask 0027",
    "alias": "shopt -s expand_aliases; alias ls='echo planted'",
    "traps": "trap 'echo e' EXIT; trap 'echo d' DEBUG; trap 'echo r' ERR; set -T",
    "options": "set -o noclobber -o pipefail -o nounset -o errexit; shopt -s failglob dotglob",
    "limits": "ulimit -n 64; ulimit -S -s 1024; ulimit -S -c 0; ulimit -u 256",
    "nice": "renice -n 5 -p $$ >/dev/null",
}


@pytest.mark.parametrize("name", sorted(SHELL_ATTACKS))
def test_shell_state_outside_variables_is_fresh_after_restore(rd, name):
    fresh = sh(rd, SHELL_PROBE)["output"]
    r = rd.exec(SHELL_ATTACKS[name], timeout=30)
    assert r["exit_code"] == 0, r
    assert rd.exec(SHELL_PROBE, timeout=30)["output"] != fresh, "the attack did nothing"
    assert restore(rd)["restored"] is True
    assert sh(rd, SHELL_PROBE)["output"] == fresh
    assert diff(rd)["clean"] is True


def test_unrestorable_change_is_named_in_left(rd, world):
    big = world["big"]  # 5000 bytes, over the 4096-byte copy cap
    sh(rd, f"printf y >> {big} && echo ok > {world['etc']}/hosts")
    assert ("modified", str(big)) in kinds(diff(rd)["changes"])
    res = restore(rd)
    assert res["restored"] is False
    assert [x["path"] for x in res["left"]] == [str(big)], res
    assert "copy cap" in res["left"][0]["why"]
    # what could be undone was undone
    assert (world["etc"] / "hosts").read_text() == "127.0.0.1 localhost\n"
    assert ("modified", str(big)) in kinds(diff(rd)["changes"])


def test_unchanged_big_file_is_no_problem(rd):
    sh(rd, "true")
    res = restore(rd)
    assert (res["restored"], res["left"]) == (True, [])


def test_post_baseline_records_a_new_state(rd, world):
    hosts = world["etc"] / "hosts"
    sh(rd, f"echo v2 > {hosts}")
    assert not diff(rd)["clean"]
    r = rd.post("/baseline", {})
    assert r.status_code == 200 and r.json()["recorded"] is True, r.text
    assert diff(rd)["clean"] is True
    sh(rd, f"echo v3 > {hosts}")
    assert restore(rd)["restored"] is True
    assert hosts.read_text() == "v2\n"


def test_reuse_rounds_stay_clean(rd, world):
    before = snapshot(world["root"])
    for i in range(8):
        sh(rd, f"echo {i} > {world['ws']}/pkg/mod.py; touch {world['etc']}/n{i}; "
               f"pip_fake={world['sp']}/x{i}; mkdir $pip_fake")
        assert not diff(rd)["clean"]
        assert restore(rd)["restored"] is True
        assert diff(rd)["clean"] is True
    assert snapshot(world["root"]) == before


def test_no_baseline_is_a_409(execd_factory, tmp_path):
    d = execd_factory("--baseline-at-start", "off", "--baseline-store", str(tmp_path / "s"))
    assert d.get("/diff").status_code == 409
    assert d.post("/restore", {}).status_code == 409


def test_a_recorded_baseline_is_fixed_without_rerecord(execd_factory, world):
    """A holder must not make its own changes the state a restore goes back to."""
    d = execd_factory("--workspace", str(world["ws"]), "--baseline-at-start", "on",
                      "--baseline-store", str(world["store"]), "--baseline-paths", "",
                      "--baseline-packages", "")
    sh(d, "echo planted > conftest.py")
    r = d.post("/baseline", {})
    assert r.status_code == 409, r.text
    assert restore(d)["restored"] is True
    assert not (world["ws"] / "conftest.py").exists()


def test_a_stored_copy_altered_in_the_store_is_not_written_back(rd, world):
    hosts = world["etc"] / "hosts"
    blobs = list((world["store"] / "blobs").iterdir())
    for b in blobs:  # every stored copy of "127.0.0.1 localhost\n" becomes the agent's
        if b.read_bytes() == b"127.0.0.1 localhost\n":
            b.write_bytes(b"6.6.6.6 localhost\n")
    sh(rd, f"echo changed > {hosts}")
    res = restore(rd)
    assert res["restored"] is False
    assert [(x["path"], x["why"]) for x in res["left"]] == [
        (str(hosts), "the stored copy was altered since the baseline")], res
    assert hosts.read_text() == "changed\n"


def test_time_zone_outside_watched_roots(execd_factory, world, tmp_path):
    """/etc/localtime restored by the tz category itself when no watched root holds it."""
    lt = tmp_path / "localtime"
    os.symlink(str(world["etc"] / "zoneinfo" / "UTC"), lt)
    d = execd_factory("--baseline-at-start", "on", "--baseline-store", str(world["store"]),
                      "--baseline-paths", "", "--baseline-packages", "",
                      "--baseline-localtime", str(lt))
    sh(d, f"rm {lt} && cp {world['etc']}/zoneinfo/Tokyo {lt}")
    assert [c["name"] for c in diff(d)["changes"] if c["kind"] == "tz"] == ["localtime"]
    assert restore(d)["restored"] is True
    assert os.readlink(lt) == str(world["etc"] / "zoneinfo" / "UTC")
    assert diff(d)["clean"] is True


def test_env_exported_by_a_command_before_baseline_comes_back(rd):
    sh(rd, "export FROM_CMD='a b'")
    assert rd.post("/baseline", {}).status_code == 200
    sh(rd, "unset FROM_CMD")
    assert ("env", "FROM_CMD") in kinds(diff(rd)["changes"], "name")
    assert restore(rd)["restored"] is True
    assert rd.post("/env", {}).json()["env"]["FROM_CMD"] == "a b"
    assert diff(rd)["clean"] is True


def test_roots_outside_root_are_not_watched(execd_factory, world):
    d = execd_factory("--root", str(world["etc"]), "--workspace", str(world["ws"]),
                      "--baseline-at-start", "off", "--baseline-store", str(world["store"]),
                      "--baseline-paths", f"{world['etc']}:{world['home']}",
                      "--baseline-packages", "")
    r = d.post("/baseline", {}).json()
    assert [x["path"] for x in r["roots"]] == [str(world["etc"])]
    sh(d, f"echo x > {world['home']}/new")
    assert diff(d)["clean"] is True
    assert restore(d)["restored"] is True
    assert (world["home"] / "new").read_text() == "x\n"


def test_token_rotation_locks_the_old_holder_out(rd):
    import hashlib

    import httpx

    from .conftest import AUTH
    new = "next-holder-token"
    sha = hashlib.sha256(new.encode()).hexdigest()
    assert rd.post("/token", {"token_sha256": sha + "\n"}).status_code == 400
    assert rd.post("/token", {"token_sha256": "ab"}).status_code == 400
    assert httpx.post(rd.url + "/token", json={"token_sha256": sha}).status_code == 401
    assert rd.post("/token", {"token_sha256": sha}).status_code == 200
    assert httpx.get(rd.url + "/state", headers=AUTH).status_code == 401
    r = httpx.post(rd.url + "/exec", json={"command": "echo hi"},
                   headers={"Authorization": f"Bearer {new}"})
    assert r.status_code == 200 and r.json()["output"] == "hi\n"


def test_baseline_env_name_matches_contract_and_default_is_off(execd_factory, tmp_path):
    from execd.execd_daemon import reuse as mod
    from sandman import contract
    assert mod.EXECD_BASELINE_ENV == contract.EXECD_BASELINE_ENV
    assert mod.EXECD_BASELINE_SCOPE_ENV == contract.EXECD_BASELINE_SCOPE_ENV
    assert mod.BASELINE_SCOPES == contract.BASELINE_SCOPES
    store = tmp_path / "s1"
    d = execd_factory("--baseline-store", str(store), "--baseline-paths", "",
                      "--baseline-packages", "")
    assert d.get("/diff").status_code == 409 and not store.exists()
    store = tmp_path / "s2"
    ws = tmp_path / "ws"
    ws.mkdir()
    d = execd_factory("--baseline-store", str(store), "--baseline-paths", "",
                      "--baseline-packages", "", "--workspace", str(ws),
                      env={contract.EXECD_BASELINE_ENV: "on"})
    assert d.get("/diff").json()["clean"] is True and store.is_dir()
    sh(d, "touch x")
    assert ("added", str(ws / "x")) in kinds(diff(d)["changes"])
