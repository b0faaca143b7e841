"""Checked reuse against a hostile previous holder.

The grading verdict is a reward, so whoever held a grading pod before is an attacker against
the next holder: each test plants something in the sandbox, releases it (/restore) and checks
that the next holder's shell ran none of it, or that the restore refused (the controller then
retires the pod). All roots are flags into tmp_path; the shell binary is a wrapper script in a
temp bin dir (found through PATH), which stands in for bash and, where a test needs it, for the
dynamic loader reading ld.so.preload.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.execd.conftest import EXECD

REAL_BASH = shutil.which("bash")


def wrapper(path: Path, body: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!{REAL_BASH}\n{body}\nexec {REAL_BASH} \"$@\"\n")
    path.chmod(0o755)


@pytest.fixture
def hw(tmp_path):
    """A root with a repo, etc, home, usr/local, usr/bin and a site-packages; a marker path
    outside every watched root that the attacker's code creates when it runs."""
    r = tmp_path / "root"
    ws = r / "ws"
    ws.mkdir(parents=True)
    (ws / "f.py").write_text("x = 1\n")
    etc = r / "etc"
    etc.mkdir()
    (etc / "hosts").write_text("127.0.0.1 localhost\n")
    home = r / "home"
    home.mkdir()
    (home / ".bashenv").write_text("# declared by the image\n")
    sp = r / "usr" / "lib" / "python3" / "site-packages"
    sp.mkdir(parents=True)
    (sp / "mod.py").write_text("")
    for d in ("usr/local/bin", "usr/bin", "unwatched/bin"):
        (r / d).mkdir(parents=True)
    return {"root": r, "ws": ws, "etc": etc, "home": home, "sp": sp, "tmp": tmp_path,
            "mark": tmp_path / "pwned", "store": tmp_path / "store"}


def start(execd_factory, w, bindir: str, body: str = "", env=None, extra=()):
    """execd whose shell is <root>/<bindir>/bash (a wrapper running `body` first)."""
    wrapper(w["root"] / bindir / "bash", body)
    e = {"HOME": str(w["home"]),
         "PATH": f"{w['root'] / bindir}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
    e.update(env or {})
    r = w["root"]
    return execd_factory(
        "--workspace", str(w["ws"]), "--root", str(r), "--kill-grace", "0.5",
        "--baseline-at-start", "on", "--baseline-store", str(w["store"]),
        "--baseline-paths", f"{w['etc']}:{w['home']}:{r}/usr/local:{r}/usr/bin",
        "--baseline-packages", str(w["sp"]), "--baseline-localtime", str(w["etc"] / "lt"),
        *extra, env=e)


def sh(d, cmd: str) -> dict:
    r = d.exec(cmd, timeout=30)
    assert r["exit_code"] == 0, r
    return r


def released(d, w) -> dict:
    """/restore as the controller calls it: the answer, and whether the attacker's code ran."""
    if w["mark"].exists():
        w["mark"].unlink()
    r = d.post("/restore", {})
    return {"status": r.status_code, "body": r.json() if r.status_code == 200 else r.text,
            "ran": w["mark"].exists()}


def next_holder_ok(d, w, got) -> None:
    """Either the restore refused (pod retired) or it is clean and nothing of the attack ran."""
    assert not got["ran"], got
    if got["status"] != 200 or got["body"]["restored"] is not True:
        return  # retired: the controller deletes the pod
    r = d.get("/diff")
    assert r.status_code == 200 and r.json()["clean"] is True, r.text
    sh(d, "true")
    assert not w["mark"].exists()


@pytest.mark.parametrize("bindir", ["usr/local/bin", "usr/bin"])
def test_shell_replaced_in_a_watched_bin_dir(execd_factory, hw, bindir):
    d = start(execd_factory, hw, bindir)
    bash = hw["root"] / bindir / "bash"
    sh(d, f"printf '#!{REAL_BASH}\\ntouch {hw['mark']}\\nexec {REAL_BASH} \"$@\"\\n' > {bash}")
    got = released(d, hw)
    next_holder_ok(d, hw, got)
    assert got["body"]["restored"] is True, got  # watched and copied: restored, not refused
    assert hw["mark"].exists() is False and "touch" not in bash.read_text()


def test_shell_replaced_outside_the_watched_set_is_refused(execd_factory, hw):
    d = start(execd_factory, hw, "unwatched/bin")
    bash = hw["root"] / "unwatched" / "bin" / "bash"
    sh(d, f"printf '#!{REAL_BASH}\\ntouch {hw['mark']}\\nexec {REAL_BASH} \"$@\"\\n' > {bash}")
    got = released(d, hw)
    assert not got["ran"], got
    assert got["status"] != 200 or got["body"]["restored"] is not True, got
    # Retired for good: no later call starts the replaced shell either.
    r = d.post("/exec", {"command": "true", "timeout": 10})
    assert r.status_code == 503 and r.json()["retired"] is True, r.text
    assert not hw["mark"].exists()
    got = d.get("/diff").json()
    assert got["clean"] is False and got["changes"][-1]["kind"] == "retired", got
    assert d.get("/ready").status_code != 200 and not hw["mark"].exists()


def test_hidden_ready_named_pth_in_site_packages(execd_factory, hw):
    d = start(execd_factory, hw, "usr/local/bin")
    pth = hw["sp"] / ".sandman-ready-x.pth"
    sh(d, f"echo 'import os; os.system(\"touch {hw['mark']}\")' > {pth}")
    got = d.get("/diff").json()
    assert {"kind": "added", "path": str(pth), "type": "file", "area": "packages"} \
        in got["changes"], got
    next_holder_ok(d, hw, released(d, hw))
    assert not pth.exists()


def test_ld_so_preload_is_gone_before_the_new_shell_starts(execd_factory, hw):
    # The baseline's shell reads <etc>/ld.so.preload at start, as the dynamic loader does.
    preload = hw["etc"] / "ld.so.preload"
    d = start(execd_factory, hw, "usr/local/bin", f"[ -f {preload} ] && . {preload}")
    sh(d, f"echo 'touch {hw['mark']}' > {preload}")
    next_holder_ok(d, hw, released(d, hw))
    assert not preload.exists()


@pytest.mark.parametrize("where", ["watched", "unwatched"])
def test_bash_env_target_planted(execd_factory, hw, where):
    target = hw["home"] / ".bashenv" if where == "watched" else hw["tmp"] / "bashenv"
    target.write_text("# declared by the image\n")
    d = start(execd_factory, hw, "usr/local/bin", env={"BASH_ENV": str(target),
                                                        "ENV": str(target)})
    sh(d, f"echo 'touch {hw['mark']}' >> {target}")
    got = released(d, hw)
    next_holder_ok(d, hw, got)
    # The declared variables stay the holder's environment.
    assert sh(d, "echo $BASH_ENV")["output"].strip() == str(target)


def test_whole_root_scope_watches_usr_var_run_dev_shm(execd_factory, hw):
    r = hw["root"]
    for p in ("usr/share/doc/x", "var/cache/x", "run/x", "dev/shm/x", "dev/null-ish",
              "proc/x", "sys/x", "root/.profile"):
        (r / p).parent.mkdir(parents=True, exist_ok=True)
        (r / p).write_text("base\n")
    d = start(execd_factory, hw, "usr/local/bin", extra=("--baseline-scope", "root"))
    sh(d, " && ".join(f"echo evil > {r / p}" for p in (
        "usr/share/doc/x", "var/cache/x", "run/x", "dev/shm/x", "dev/null-ish", "proc/x",
        "sys/x", "root/.profile")) + f" && echo new > {r}/var/new")
    got = {c["path"] for c in d.get("/diff").json()["changes"] if "path" in c}
    for p in ("usr/share/doc/x", "var/cache/x", "run/x", "dev/shm/x", "root/.profile",
              "var/new", "dev/null-ish"):  # /dev: watched as itself (devwatch.py)
        assert str(r / p) in got, (p, got)
    for p in ("proc/x", "sys/x"):
        assert str(r / p) not in got, (p, got)
    got = released(d, hw)
    next_holder_ok(d, hw, got)
    # The rest of the root has no copies: a changed file there retires the pod.
    assert got["status"] == 200 and got["body"]["restored"] is False, got
    why = {x["path"]: x["why"] for x in got["body"]["left"] if "path" in x}
    assert "outside the copied roots" in why.get(str(r / "var/cache/x"), ""), got["body"]


def test_whole_root_scope_restores_what_was_only_added(execd_factory, hw):
    """Files added under /usr, /var, /run, /dev/shm (a planted library, a hidden .pth) need no
    copy: the restore deletes them and the pod is clean for the next holder."""
    r = hw["root"]
    for p in ("usr/lib/x86_64-linux-gnu/libc.so.6", "var/lib/x", "dev/shm/.keep"):
        (r / p).parent.mkdir(parents=True, exist_ok=True)
        (r / p).write_text("base\n")
    planted = ("usr/lib/x86_64-linux-gnu/libevil.so", "usr/lib/python3/dist-packages/x.pth",
               "var/lib/new/y", "run/z", "dev/shm/w")
    d = start(execd_factory, hw, "usr/local/bin", extra=("--baseline-scope", "root"))
    sh(d, " && ".join(f"mkdir -p {(r / p).parent} && echo evil > {r / p}" for p in planted))
    got = {c["path"]: c["area"] for c in d.get("/diff").json()["changes"] if "path" in c}
    assert got.get(str(r / "var/lib/new/y")) == "rest", got
    res = released(d, hw)
    assert res["status"] == 200 and res["body"]["restored"] is True, res
    next_holder_ok(d, hw, res)
    assert not any((r / p).exists() for p in planted)
    assert (r / "usr/lib/x86_64-linux-gnu/libc.so.6").read_text() == "base\n"


def test_baseline_scope_from_the_environment_and_refused_when_garbled(execd_factory, hw):
    """SANDMAN_BASELINE_SCOPE (the controller sets root in grading pods) is the default scope;
    a value that is neither scope stops execd at start instead of watching less."""
    r = hw["root"]
    (r / "var").mkdir(exist_ok=True)
    d = start(execd_factory, hw, "usr/local/bin", env={"SANDMAN_BASELINE_SCOPE": "root"})
    sh(d, f"echo new > {r}/var/new")
    assert str(r / "var/new") in {c.get("path") for c in d.get("/diff").json()["changes"]}
    res = subprocess.run([sys.executable, str(EXECD), "--insecure-no-token", "--listen",
                          "127.0.0.1:0"], env={"SANDMAN_BASELINE_SCOPE": "everything",
                                               "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 2, res
    assert res.stderr == ("execd: SANDMAN_BASELINE_SCOPE='everything': must be listed or root; "
                          "refusing to start\n"), res.stderr


@pytest.mark.parametrize("plant", ["link", "fifo"])
def test_a_name_planted_in_the_store_is_never_followed(execd_factory, tmp_path, plant):
    """The store is the holder's uid's: a link planted where execd touches its clock probe
    after each restore truncated a file of the holder's choosing, after the restore's own
    check (and a FIFO there blocked the restore). execd opens it without following links and
    without blocking; the victim keeps its bytes and the next holder gets a clean pod."""
    ws, etc, store = tmp_path / "ws", tmp_path / "etc", tmp_path / "store"
    ws.mkdir()
    etc.mkdir()
    (etc / "hosts").write_text("127.0.0.1 localhost\n")
    victim = tmp_path / "victim"
    victim.write_text("the next holder's data\n")
    d = execd_factory("--workspace", str(ws), "--baseline-at-start", "on",
                      "--baseline-store", str(store), "--baseline-paths", str(etc),
                      "--baseline-packages", str(etc / "none"),
                      "--baseline-localtime", str(etc / "localtime"))
    make = f"ln -s {victim} .tick" if plant == "link" else "mkfifo .tick"
    r = d.exec(f"cd {store} && rm -f .tick && {make} && echo planted")
    assert r["output"] == "planted\n", r
    r = d.post("/restore", {}, timeout=60)
    assert r.status_code == 200 and r.json()["restored"] is True, r.text
    assert victim.read_text() == "the next holder's data\n"
    assert not (store / ".tick").is_symlink()
    assert d.get("/diff").json()["clean"] is True


@pytest.mark.parametrize("plant", ["fifo", "link", "dir"])
def test_a_stored_copy_replaced_in_the_store_fails_the_restore_without_blocking(
        execd_factory, tmp_path, plant):
    """The holder's uid owns the store: it replaces every stored copy by a FIFO (whose read
    blocked the restore until the controller gave up), a link to a file with the very bytes the
    copy had (the hash matched, so the restore wrote through a name of the holder's choosing),
    or a directory. Each copy is opened without following a link or blocking, and only a
    regular file is read: the restore answers, names the file and retires the pod."""
    ws, etc, store = tmp_path / "ws", tmp_path / "etc", tmp_path / "store"
    ws.mkdir()
    etc.mkdir()
    hosts = etc / "hosts"
    hosts.write_text("127.0.0.1 localhost\n")
    same = tmp_path / "same-bytes"
    same.write_text("127.0.0.1 localhost\n")
    d = execd_factory("--workspace", str(ws), "--baseline-at-start", "on",
                      "--baseline-store", str(store), "--baseline-paths", str(etc),
                      "--baseline-packages", str(etc / "none"),
                      "--baseline-localtime", str(etc / "localtime"))
    make = {"fifo": "mkfifo \"$b\"", "link": f"ln -s {same} \"$b\"", "dir": "mkdir \"$b\""}
    r = d.exec(f"echo changed > {hosts} && for b in {store}/blobs/*; do rm \"$b\" && "
               f"{make[plant]}; done && echo planted")
    assert r["output"] == "planted\n", r
    r = d.post("/restore", {}, timeout=60)
    assert r.status_code == 200 and r.json()["restored"] is False, r.text
    assert [x["path"] for x in r.json()["left"]] == [str(hosts)], r.json()
    assert "not a regular file" in r.json()["left"][0]["why"], r.json()
    r = d.post("/exec", {"command": "true", "timeout": 10})
    assert r.status_code == 503 and r.json()["retired"] is True, r.text


def execd_in_its_workspace(execd_factory, tmp_path):
    """execd started in its workspace, no --workspace (as in controller pods: the workspace is
    execd's cwd), with a baseline from its start: (execd, the workspace)."""
    ws, etc = tmp_path / "ws", tmp_path / "etc"
    ws.mkdir()
    etc.mkdir()
    (ws / "f.py").write_text("x = 1\n")
    d = execd_factory("--baseline-at-start", "on", "--baseline-store", str(tmp_path / "store"),
                      "--baseline-paths", str(etc), "--baseline-packages", str(etc / "none"),
                      "--baseline-localtime", str(etc / "localtime"), "--kill-grace", "0.5",
                      prefix=("sh", "-c", 'cd "$0" && exec "$@"', str(ws)))
    return d, ws


@pytest.mark.parametrize("how", ["recreated", "removed"])
def test_execds_cwd_removed_by_the_holder(execd_factory, tmp_path, how):
    """Without --workspace (as in controller pods) the workspace is execd's cwd. The holder
    removes it (and makes a new one of its own at the same path): /diff, /restore and the next
    holder's shell work from the path resolved at start, not from execd's deleted cwd."""
    d, ws = execd_in_its_workspace(execd_factory, tmp_path)
    assert d.exec("pwd")["output"] == f"{ws}\n"
    again = f" && mkdir {ws} && echo evil > {ws}/f.py && echo new > {ws}/g" \
        if how == "recreated" else ""
    sh(d, f"cd / && rm -rf {ws}{again}")
    r = d.get("/diff")
    assert r.status_code == 200, r.text
    assert str(ws / "f.py") in {c.get("path") for c in r.json()["changes"]}, r.json()
    r = d.post("/restore", {}, timeout=60)
    assert r.status_code == 200 and r.json()["restored"] is True, r.text
    assert sh(d, "pwd && cat f.py && ls")["output"] == f"{ws}\nx = 1\nf.py\n"
    assert d.get("/diff").json()["clean"] is True
    assert d.get("/ready").status_code == 200, d.get("/ready").text
    p = d.post("/processes/spawn", {"command": "pwd"}).json()
    assert "id" in p, p


@pytest.mark.parametrize("how", ["recreated", "removed"])
def test_shell_ended_after_execds_cwd_was_removed(execd_factory, tmp_path, how):
    """Within a holding: the holder removes execd's cwd (the workspace without --workspace)
    and ends its shell. The next /exec gets a shell at once: in the directory now at the
    workspace's path, or, where there is none, in / with an error naming the gone workspace.
    Relative file paths and spawns keep working; /diff and /restore still put it all back."""
    d, ws = execd_in_its_workspace(execd_factory, tmp_path)
    again = f" && mkdir {ws} && echo new > {ws}/g" if how == "recreated" else ""
    sh(d, f"cd / && rm -rf {ws}{again}")
    r = d.post("/exec", {"command": "kill -9 $$", "timeout": 10})
    assert r.status_code == 200, r.text
    assert "a new shell was started" in r.json()["error"], r.json()
    r = d.post("/exec", {"command": "pwd", "timeout": 10})
    assert r.status_code == 200, r.text
    if how == "recreated":
        assert r.json()["output"] == f"{ws}\n" and r.json()["exit_code"] == 0, r.json()
        r = d.get("/files", params={"path": "g"})
        assert r.status_code == 200 and r.content == b"new\n", r.text
    else:
        assert r.json()["output"] == "/\n" and r.json()["exit_code"] == 0, r.json()
        assert f"{ws} is gone" in r.json()["error"], r.json()
        # Said once: the next call in the same shell is plain.
        assert d.exec("true")["error"] is None
    p = d.post("/processes/spawn", {"command": "pwd"}).json()
    assert "id" in p, p
    r = d.get("/diff")
    assert r.status_code == 200 and r.json()["clean"] is False, r.text
    r = d.post("/restore", {}, timeout=60)
    assert r.status_code == 200 and r.json()["restored"] is True, r.text
    assert sh(d, "pwd && cat f.py && ls")["output"] == f"{ws}\nx = 1\nf.py\n"
    assert d.get("/diff").json()["clean"] is True
    assert d.get("/ready").status_code == 200, d.get("/ready").text


def test_dev_on_the_nodes_devtmpfs_is_reported_never_deleted(tmp_path, monkeypatch):
    """The kernel adds nodes to the node's own devtmpfs (execd outside a pod, a pod given the
    host's /dev): the restore must not delete what it finds added there. Which filesystem
    holds /dev is read from mountinfo (the longest mount point above it)."""
    from execd.execd_daemon import devwatch

    mi = tmp_path / "mountinfo"
    mi.write_text(
        "22 1 0:20 / / rw - ext4 /dev/vda1 rw\n"
        "23 22 0:5 / /dev rw,nosuid shared:2 - devtmpfs udev rw\n"
        "24 23 0:21 / /dev/pts rw - devpts devpts rw\n"
        "25 22 0:30 / /srv/with\\040space/dev rw - tmpfs sandbox-dev rw\n")
    assert devwatch.fs_type("/dev", str(mi)) == "devtmpfs"
    assert devwatch.fs_type("/dev/pts", str(mi)) == "devpts"
    assert devwatch.fs_type("/srv/with space/dev", str(mi)) == "tmpfs"
    assert devwatch.fs_type("/devx", str(mi)) == "ext4"
    assert devwatch.fs_type("/dev", str(tmp_path / "none")) is None
    # The restore deletes added entries only where the filesystem is known and not devtmpfs.
    for kind, ok in (("tmpfs", True), ("devtmpfs", False), (None, False)):
        monkeypatch.setattr(devwatch, "fs_type", lambda path, kind=kind: kind)
        assert devwatch.removable("/dev") is ok, kind
