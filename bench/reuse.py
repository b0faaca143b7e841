"""Checked reuse, in two parts (`make bench-reuse`: `python -m bench.reuse --write-docs`):
execd's cost vs `git status` on the same tree (here), and a reused grading pod vs a fresh one
through the controller on the test bed (bench/reuse_controller.py). `--part` runs one of them.

The execd part:
A script, not a test. It builds, deterministically in a temp dir, a SWE-bench-sized git
repository (--files files in nested packages, committed, plus untracked and ignored files) and a
Python environment (a venv with pip from ensurepip, offline, plus a few packages copied from this
project's venv), starts execd/execd.py on 127.0.0.1 with its baseline over both, and measures,
interleaved in each repeat so they share the machine's noise:

  git status    `git status --porcelain` on the repository (the peer: one stat per tracked file
                plus a walk for untracked ones)
  /diff repo    execd GET /diff, HTTP round trip included, with only the repository watched
  /diff all     the same with the repository AND the venv watched (what a grading pod checks)
  /restore      after an agent-like change (3 files edited, 2 added, 1 deleted, a package
                directory installed into the venv, an exported variable, a background process),
                then /diff must be clean again
  root arm      /diff and /restore with `--baseline-scope root` over a root filesystem (the
                grading task image's layers when cached in ~/.cache/sandman-testbed, else a
                generated debootstrap-like tree) holding the same repository, in the same run
                (what grading pods watch; the tree outside the repository is not copied)
  /baseline     the record a grading pod makes before it serves, repository + venv and root

--before REV adds revision REV's execd (its execd/ from git, installed as a pod lays it out)
on copies of the same trees, its calls interleaved with this revision's: a before/after of
/diff, /restore and /baseline in one run (`make bench-reuse BEFORE=REV`).

It prints medians over --repeats and the ratios; with --write-docs it replaces the two
sections of docs/benchmarks.md. --smoke: a 1,200-file repository, a venv without pip, a
500-file root tree, one repeat of two samples; one round through the controller (on --kubeconfig's cluster when given, else its own bed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench import bed, docs
from bench import reuse_controller as pool
from testbed.execd import execd_cmd, start_execd

REPO = Path(__file__).resolve().parents[1]
EXECD = REPO / "execd" / "execd.py"
SECTION = "## Checked reuse (execd): `python -m bench.reuse`"
COPY_PACKAGES = ("idna", "h11", "certifi", "sniffio", "anyio", "httpx", "httpcore")


def make_repo(root: Path, files: int, seed: int = 15) -> None:
    """`files` tracked files in nested packages, deterministic content, one commit."""
    rnd = random.Random(seed)
    root.mkdir(parents=True)
    per_dir = 40
    for i in range(files):
        d = root / "src" / f"pkg{i // (per_dir * 25):02d}" / f"mod{(i // per_dir) % 25:02d}"
        if i % per_dir == 0:
            d.mkdir(parents=True, exist_ok=True)
            (d / "__init__.py").write_text("")
        size = rnd.choice((200, 800, 2000, 6000, 16000))
        body = "".join(f"def f{j}(x):\n    return x * {rnd.randint(0, 999)}\n"
                       for j in range(size // 40))
        (d / f"m{i % per_dir:02d}.py").write_text(body)
    (root / ".gitignore").write_text("*.pyc\n__pycache__/\nbuild/\n")
    env = {**os.environ, "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z",
           "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z"}
    # Packed, as a cloned SWE-bench repository is (not 10k loose objects); no background gc.
    for cmd in (["init", "-q"], ["add", "-A"],
                ["-c", "user.email=b@b", "-c", "user.name=b", "commit", "-qm", "base"],
                ["repack", "-adq"], ["prune-packed"]):
        subprocess.run(["git", "-C", str(root), "-c", "gc.auto=0", *cmd], check=True, env=env)
    (root / "notes.txt").write_text("untracked\n")
    (root / "src" / "pkg00" / "mod00" / "m00.pyc").write_bytes(b"\0ignored")


IMAGE_GLOB = "images-grading-task-*/grading-task.tar"


def make_rootfs(root: Path, files: int, smoke: bool) -> str:
    """A root filesystem to watch whole: the cached grading task image's layers (an OCI
    archive with a docker manifest), else `files` generated files in a debootstrap-like
    layout. Returns what it is."""
    import tarfile

    cache = Path.home() / ".cache" / "sandman-testbed"
    tars = sorted(cache.glob(IMAGE_GLOB)) if not smoke else []
    root.mkdir(parents=True)
    if tars:
        with tarfile.open(tars[-1]) as outer:
            manifest = json.load(outer.extractfile("manifest.json"))
            for layer in manifest[0]["Layers"]:
                with tarfile.open(fileobj=outer.extractfile(layer)) as t:
                    members = [m for m in t.getmembers() if not m.isdev()
                               and ".wh." not in m.name and not m.name.startswith("/")
                               and ".." not in m.name.split("/")]
                    t.extractall(root, members)  # our own cached image, paths checked
        for d in ("proc", "sys", "dev/shm", "tmp", "root"):
            (root / d).mkdir(parents=True, exist_ok=True)
        return f"the grading task image ({tars[-1].parent.name})"
    rnd = random.Random(7)
    dirs = ["usr/bin", "usr/sbin", "usr/lib/x86_64-linux-gnu", "usr/lib/python3.11",
            "usr/lib/python3.11/email", "usr/share/doc", "usr/share/locale/de/LC_MESSAGES",
            "etc", "etc/apt", "var/lib/dpkg/info", "var/cache/debconf", "var/log", "run",
            "root", "tmp", "dev/shm", "proc", "sys", "opt"]
    for d in dirs:
        (root / d).mkdir(parents=True, exist_ok=True)
    for i in range(files):
        d = dirs[i % 11]
        sub = root / d / f"g{i // 400:03d}" if d.startswith("usr/") else root / d
        sub.mkdir(exist_ok=True)
        (sub / f"f{i:06d}").write_bytes(b"x" * rnd.choice((100, 1000, 4000, 20000)))
    for name in ("bin", "sbin", "lib"):
        os.symlink(f"usr/{name}", root / name)
    return f"a generated debootstrap-like tree of {files} files"


def make_venv(path: Path, pip: bool = True) -> Path:
    # --smoke leaves pip out: installing it is most of the smoke run's time.
    subprocess.run([sys.executable, "-m", "venv", *(() if pip else ("--without-pip",)),
                    str(path)], check=True)
    sp = next(path.glob("lib/python3*/site-packages"))
    import importlib.util
    for name in COPY_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec and spec.submodule_search_locations:
            src = Path(list(spec.submodule_search_locations)[0])
            shutil.copytree(src, sp / name, ignore=shutil.ignore_patterns("__pycache__"))
    return sp


class Execd:
    def __init__(self, work: Path, name: str, *flags: str, launcher: Path | None = None):
        self.token = secrets.token_urlsafe(24)
        sha = hashlib.sha256(self.token.encode()).hexdigest()
        self.log = work / f"{name}.log"
        # As root, PID 1 of its own PID namespace like in a pod: the process set it checks is
        # the sandbox's, not every process of this (shared) host.
        pod_like = os.geteuid() == 0 and shutil.which("unshare") is not None
        prefix = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child=SIGTERM"] \
            if pod_like else []
        self.pid1 = pod_like
        # The shared starter: port 0, the port execd reports, /health (the baseline taken at
        # start can take minutes on a big root).
        cmd = execd_cmd("127.0.0.1", 0, sha, "--baseline-at-start", "on",
                        "--baseline-store", str(work / f"{name}.store"),
                        "--baseline-paths", "", *flags)
        if launcher is not None:  # another revision's execd, as it lays itself out in a pod
            cmd[1] = str(launcher)
        ex = start_execd(work, token=self.token, timeout=300, log=self.log, cmd=[*prefix, *cmd])
        self.port = ex.port
        self.proc = ex.proc.proc

    def call(self, method: str, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data,
                                     method=method,
                                     headers={"Authorization": f"Bearer {self.token}"})
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(req, timeout=300) as r:
            return json.loads(r.read())

    def timed(self, method: str, path: str, body: dict | None = None) -> tuple[float, dict]:
        t0 = time.perf_counter()
        out = self.call(method, path, body)
        return time.perf_counter() - t0, out

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)


def agent_change(ex: Execd, repo: Path, sp: Path, i: int) -> None:
    cmd = (f"cd {repo} && echo '# edit {i}' >> src/pkg00/mod01/m03.py && "
           f"echo x{i} > src/pkg01/mod02/m04.py && sed -i 1d src/pkg00/mod03/m05.py && "
           f"echo new > src/pkg00/new{i}.py && mkdir -p build && echo b > build/out && "
           f"rm src/pkg01/mod04/m06.py && mkdir {sp}/evil_pkg && echo 1 > {sp}/evil_pkg/x.py && "
           f"export AGENT=1 && (setsid sleep 600 >/dev/null 2>&1 < /dev/null &)")
    r = ex.call("POST", "/exec", {"command": cmd, "timeout": 60})
    assert r["exit_code"] == 0, r


def med(xs: list[float]) -> float:
    return statistics.median(xs) * 1000


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.reuse", description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=("execd", "controller", "both"), default="both")
    ap.add_argument("--files", type=int, default=10000)
    ap.add_argument("--rootfs-files", type=int, default=30000,
                    help="root arm: files of the generated tree (without a cached image)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--samples", type=int, default=15, help="timed calls per repeat")
    ap.add_argument("--rounds", type=int, default=15, help="controller part: rounds")
    ap.add_argument("--before", metavar="REV", default=None,
                    help="execd part: also run execd as revision REV of this repository lays it "
                    "out (git archive), on copies of the same trees, interleaved: a before/after "
                    "in one run")
    ap.add_argument("--kubeconfig", default=None,
                    help="controller part: this cluster instead of a test bed of its own")
    docs.add_flags(ap)
    a = ap.parse_args(argv)
    docs.check_flags(ap, a)
    if a.smoke:
        # The agent-like change edits files of the second package: at least 1,200 files.
        a.files, a.repeats, a.samples, a.rounds, a.rootfs_files = 1200, 1, 2, 1, 500
    sections = []
    if a.part in ("execd", "both"):
        sections.append(execd_part(a))
    if a.part in ("controller", "both"):
        # Its own test bed of 2 kwok nodes, or --kubeconfig's cluster.
        res = bed.run("bench-reuse", 2, lambda c, workdir, a: pool.measure(c, workdir, a.rounds), a)
        sections.append(pool.render(res))
        print(sections[-1])
    if a.write_docs:
        for section in sections:
            print(f"wrote {docs.write_section(section)}", file=sys.stderr)
    return 0


# --before: measure -> the row of this revision it is compared with.
BEFORE_ROWS = {"b_diff_all": "diff_all", "b_diff_dirty": "diff_dirty", "b_restore": "restore",
               "b_diff_root": "diff_root", "b_restore_root": "restore_root",
               "b_record_all": "record_all", "b_record_root": "record_root"}
BEFORE_LABELS = {"diff_all": "`GET /diff`, repository + venv (clean)",
                 "diff_dirty": "`GET /diff` after the agent-like change",
                 "restore": "`POST /restore` of it",
                 "diff_root": "`GET /diff`, `--baseline-scope root` (clean)",
                 "restore_root": "`POST /restore` there",
                 "record_all": "`POST /baseline`, repository + venv",
                 "record_root": "`POST /baseline`, `--baseline-scope root`"}


def restored(ex: Execd, repo: Path, sp: Path, rep: int) -> float:
    """The agent-like change, then the timed /restore (ms) and a clean /diff."""
    agent_change(ex, repo, sp, rep)
    dt, res = ex.timed("POST", "/restore", {})
    assert res["restored"], res["left"]
    after = ex.call("GET", "/diff")
    assert after["clean"], after["changes"][:5]
    return dt * 1000


def restored_dirty(ex: Execd, repo: Path, sp: Path, rep: int) -> tuple[float, float]:
    """The agent-like change, the timed /diff that lists it, then the timed /restore (ms)."""
    agent_change(ex, repo, sp, rep)
    dt_diff, dirty = ex.timed("GET", "/diff")
    assert not dirty["clean"]
    dt, res = ex.timed("POST", "/restore", {})
    assert res["restored"], res["left"]
    after = ex.call("GET", "/diff")
    assert after["clean"], after["changes"][:5]
    return dt_diff * 1000, dt * 1000


def before_table(rev: str, rows: dict[str, list[float]], m: dict[str, float]) -> str:
    """This revision against revision `rev`, arm by arm, in the same run: medians and the
    median of the per-repeat ratios (each repeat's calls were interleaved)."""
    out = [f"Against revision `{rev}` in the same run (`--before {rev}`): the same arms as that "
           "revision's execd, each on its own copy of the trees, its calls interleaved with "
           "this revision's.", "",
           f"| measure | this revision ms | `{rev}` ms | this / `{rev}` |", "|---|---|---|---|"]
    for b, k in BEFORE_ROWS.items():
        if b not in rows:
            continue
        ratio = statistics.median([x / y for x, y in zip(rows[k], rows[b], strict=True)])
        out.append(f"| {BEFORE_LABELS[k]} | {m[k]:.1f} | {m[b]:.1f} | {ratio:.2f}x |")
    return "\n".join(out) + "\n"


def execd_part(a) -> str:
    """The execd part's section (printed too)."""
    work = Path(tempfile.mkdtemp(prefix="sandman-bench-reuse-"))
    execds: list[Execd] = []
    try:
        repo = work / "repo"
        t0 = time.perf_counter()
        make_repo(repo, a.files)
        sp = make_venv(work / "venv", pip=not a.smoke)
        n_venv = sum(len(f) for _, _, f in os.walk(work / "venv"))
        print(f"tree: {a.files} tracked files, venv {n_venv} files, built in "
              f"{time.perf_counter() - t0:.1f}s", file=sys.stderr)
        only = Execd(work, "repo", "--workspace", str(repo), "--baseline-packages", "",
                     "--baseline-rerecord")
        execds.append(only)
        full = Execd(work, "full", "--workspace", str(repo), "--baseline-packages", str(sp),
                     "--baseline-rerecord")
        execds.append(full)
        # The root arm: the same repository inside a root filesystem, watched whole.
        rootfs = work / "rootfs"
        what = make_rootfs(rootfs, a.rootfs_files, a.smoke)
        rrepo = rootfs / "bench-repo"  # beside the image's own /testbed, when it has one
        shutil.copytree(repo, rrepo, symlinks=True)
        n_root = sum(len(f) for _, _, f in os.walk(rootfs))
        whole = Execd(work, "root", "--workspace", str(rrepo), "--root", str(rootfs),
                      "--baseline-scope", "root", "--baseline-packages", "",
                      "--baseline-copy-cap", str(64 << 20), "--baseline-rerecord")
        execds.append(whole)
        # --before: the same two arms as revision REV's execd, each on its own copy of the
        # trees (a restore makes new inodes another arm would see as changes).
        old_arms: tuple[Execd, Path, Path, Execd, Path, Path] | None = None
        if a.before:
            from bench.execd import revision_install

            launcher = revision_install(work / f"execd-{a.before}", sys.executable, a.before)
            bw = work / "before"
            shutil.copytree(repo, bw / "repo", symlinks=True)
            shutil.copytree(work / "venv", bw / "venv", symlinks=True)
            shutil.copytree(rootfs, bw / "rootfs", symlinks=True)
            sp_b = bw / "venv" / sp.relative_to(work / "venv")
            full_b = Execd(work, "full-before", "--workspace", str(bw / "repo"),
                           "--baseline-packages", str(sp_b), "--baseline-rerecord",
                           launcher=launcher)
            execds.append(full_b)
            rrepo_b = bw / "rootfs" / "bench-repo"
            whole_b = Execd(work, "root-before", "--workspace", str(rrepo_b), "--root",
                            str(bw / "rootfs"), "--baseline-scope", "root",
                            "--baseline-packages", "", "--baseline-copy-cap", str(64 << 20),
                            "--baseline-rerecord", launcher=launcher)
            execds.append(whole_b)
            old_arms = (full_b, bw / "repo", sp_b, whole_b, rrepo_b,
                        bw / "rootfs" / "usr" / "lib")
        for arm in (whole, full) + ((old_arms[0], old_arms[3]) if old_arms else ()):
            base = arm.call("GET", "/diff")
            assert base["clean"], base["changes"][:5]
        rows: dict[str, list[float]] = {k: [] for k in (
            "git", "diff_repo", "diff_all", "diff_dirty", "restore", "git_dirty", "diff_root",
            "restore_root", "record_all", "record_root", *BEFORE_ROWS)}
        load0 = os.getloadavg()[0]
        entries = None
        parts: dict[str, list[float]] = {}
        for rep in range(a.repeats):
            g, d1, d2, d3, d2b, d3b = [], [], [], [], [], []
            for _ in range(a.samples):  # interleaved: the same noise for all three
                t = time.perf_counter()
                subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], check=True,
                               stdout=subprocess.DEVNULL)
                g.append(time.perf_counter() - t)
                d1.append(only.timed("GET", "/diff")[0])
                d3.append(whole.timed("GET", "/diff")[0])
                dt, got = full.timed("GET", "/diff")
                d2.append(dt)
                for k, v in got["parts_ms"].items():
                    parts.setdefault(k, []).append(v)
                if old_arms:
                    d2b.append(old_arms[0].timed("GET", "/diff")[0])
                    d3b.append(old_arms[3].timed("GET", "/diff")[0])
            rows["git"].append(med(g))
            rows["diff_repo"].append(med(d1))
            rows["diff_all"].append(med(d2))
            rows["diff_root"].append(med(d3))
            if old_arms:
                rows["b_diff_all"].append(med(d2b))
                rows["b_diff_root"].append(med(d3b))
                rows["b_restore_root"].append(restored(old_arms[3], old_arms[4], old_arms[5],
                                                       rep))
                dt, rest = restored_dirty(old_arms[0], old_arms[1], old_arms[2], rep)
                rows["b_diff_dirty"].append(dt)
                rows["b_restore"].append(rest)
            rsp = rootfs / "usr" / "lib"
            agent_change(whole, rrepo, rsp, rep)
            dt, res = whole.timed("POST", "/restore", {})
            assert res["restored"], res["left"]
            rows["restore_root"].append(dt * 1000)
            after = whole.call("GET", "/diff")
            assert after["clean"], after["changes"][:5]
            agent_change(full, repo, sp, rep)
            t = time.perf_counter()
            subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], check=True,
                           stdout=subprocess.DEVNULL)
            rows["git_dirty"].append((time.perf_counter() - t) * 1000)
            dt, dirty = full.timed("GET", "/diff")
            assert not dirty["clean"]
            rows["diff_dirty"].append(dt * 1000)
            dt, res = full.timed("POST", "/restore", {})
            assert res["restored"], res["left"]
            rows["restore"].append(dt * 1000)
            after = full.call("GET", "/diff")
            assert after["clean"], after["changes"][:5]
            entries = len(dirty["changes"])
            # `only` watches the same repository, whose restored files are new inodes now:
            # it records again (--baseline-rerecord) instead of restoring them once more.
            only.call("POST", "/baseline", {})
            assert only.call("GET", "/diff")["clean"]
            # What a grading pod does before it serves: record the baseline (a walk and the
            # copies; the root arm copies only the repository).
            records = [(full, "record_all"), (whole, "record_root")]
            if old_arms:
                records += [(old_arms[0], "b_record_all"), (old_arms[3], "b_record_root")]
            for arm, key in records:
                dt, rec = arm.timed("POST", "/baseline", {})
                assert rec["recorded"], rec
                rows[key].append(dt * 1000)
            print(f"repeat {rep + 1}/{a.repeats}: git {rows['git'][-1]:.1f} ms, /diff repo "
                  f"{rows['diff_repo'][-1]:.1f}, all {rows['diff_all'][-1]:.1f}, restore "
                  f"{rows['restore'][-1]:.1f}", file=sys.stderr)
        rows = {k: v for k, v in rows.items() if v}
        m = {k: statistics.median(v) for k, v in rows.items()}
        # The ratio of each repeat (its calls were interleaved), then the median of those.
        r = {k: statistics.median([x / g for x, g in zip(v, rows["git"], strict=True)])
             for k, v in rows.items()}
        cmd = f"make bench-reuse (python -m bench.reuse --files {a.files} " \
              f"--repeats {a.repeats} --samples {a.samples}" \
              + (f" --before {a.before})" if a.before else ")")
        table = "\n".join([
            SECTION, "",
            f"`{cmd}`: a generated repository of {a.files} tracked files (~10k like a "
            f"SWE-bench task) plus untracked and ignored files, committed, and a venv of "
            f"{n_venv} files; medians of {a.repeats} repeats, each the median of "
            f"{a.samples} interleaved calls (HTTP round trip included for execd; a baseline "
            f"record: one per repeat). Load average {load0:.2f} at the start, "
            f"{os.getloadavg()[0]:.2f} at the end; the ratios are what the run compares. "
            "execd ran "
            + ("as PID 1 of its own PID namespace, as in a pod." if full.pid1 else
               "as a plain process: its process check scans every process of the host, "
               "more than in a pod.") + " The repository is packed (`git gc`), as a cloned "
            "task repository is.", "",
            "| measure | median ms | vs clean `git status` (median of per-repeat ratios) |",
            "|---|---|---|",
            f"| `git status --porcelain` (clean tree) | {m['git']:.1f} | 1.00x |",
            f"| execd `GET /diff`, repository only | {m['diff_repo']:.1f} | "
            f"{r['diff_repo']:.2f}x |",
            f"| execd `GET /diff`, repository + venv | {m['diff_all']:.1f} | "
            f"{r['diff_all']:.2f}x |",
            f"| `git status` after the agent-like change | {m['git_dirty']:.1f} | "
            f"{r['git_dirty']:.2f}x |",
            f"| `GET /diff` after it ({entries} changes listed) | {m['diff_dirty']:.1f} | "
            f"{r['diff_dirty']:.2f}x |",
            f"| `POST /restore` of it (then `/diff` clean) | {m['restore']:.1f} | "
            f"{r['restore']:.2f}x |",
            f"| `GET /diff`, `--baseline-scope root` ({n_root} files) | {m['diff_root']:.1f} | "
            f"{r['diff_root']:.2f}x |",
            f"| `POST /restore` of the same change there | {m['restore_root']:.1f} | "
            f"{r['restore_root']:.2f}x |",
            f"| `POST /baseline` (what a grading pod records before serving), repository + "
            f"venv | {m['record_all']:.1f} | {r['record_all']:.2f}x |",
            f"| `POST /baseline`, `--baseline-scope root` (copies of the repository only) | "
            f"{m['record_root']:.1f} | {r['record_root']:.2f}x |", "",
            f"The root arm's root filesystem: {what}, the repository copied into it.", "",
            "Inside execd, `/diff` (repository + venv) spent a median of "
            + ", ".join(f"{statistics.median(v):.1f} ms on {k.replace('_', ' and ')}"
                        for k, v in parts.items()) + ".", "",
            "The agent-like change: 3 tracked files edited, one deleted, 2 files added (one "
            "ignored), a package directory added to the venv's site-packages, an exported "
            "variable and a background process. `/restore` includes killing the process and "
            "starting a fresh shell.", ""])
        if old_arms:
            table += "\n" + before_table(a.before, rows, m) + "\n"
        print(table)
    finally:
        for ex in execds:
            ex.stop()
        shutil.rmtree(work, ignore_errors=True)
    return table


if __name__ == "__main__":
    sys.exit(main())
