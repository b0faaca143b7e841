"""The kubelet stand-in: a real execd behind every kwok pod of one namespace.

kwok nodes run no container, but the test bed hands out pod IPs from loopback (127.64.0.0/16).
The stand-in watches one namespace; for each pod that has an IP and a token-hash annotation
(`sandman.dev/token-sha256`) it starts the repository's `execd/execd.py` listening on
`<pod IP>:9470` with that hash, as the pod's own command would, and kills it, and everything it
started, when the pod is deleted or gets a deletionTimestamp. A pod IP outside 127.0.0.0/8 is
refused: nothing here listens on a real network. It is enough for the controller's
`--ready-check execd` and for SDK, locust and `helm test` traffic to reach a real execd.

What it does NOT reproduce (a test that depends on one of these needs a real node):
- the interpreter: execd runs on the host's Python (this process's `sys.executable`), not on
  the task image's `python3`; the task image is never pulled and no image's files are there;
- the read-only /sandman mount: execd.py is read from the repository checkout, not copied by
  the guard's init container (`--install-execd`) into a volume mounted read-only in the sandbox;
- netguard: no init container runs and there are no in-pod firewall rules; execd's
  `--netguard-status` points to a file that does not exist, so /state reports `guard: null`;
- PID 1: execd is a child of the stand-in in its own session, not PID 1 of a pod's PID
  namespace (it makes itself a child subreaper instead) and sees every process of the host;
- cgroups and limits: the pod's CPU and memory limits are not applied, nothing is OOM-killed,
  all execds share the host's CPUs;
- the pod network: the pod's loopback IP is an address of the host's own network namespace,
  so every "pod" can reach every other and the host, and no NetworkPolicy applies;
- the filesystem: commands run on the host's filesystem, as the user running the tests, in a
  per-pod directory under the stand-in's workdir; execd's file routes are confined to `root`
  (default /tmp). With `private_dirs=("logs", ...)` (root only: a mount namespace) each pod's
  execd sees its own empty /logs, ... (a directory of the pod's, bind-mounted over an empty
  mount point the stand-in makes on the host and removes at stop()), and its file routes may
  reach /: what a framework that writes fixed top-level paths (Harbor's /logs, /tests,
  /solution) needs, as each container has its own;
- $HOME: execd's, and so its commands', is the host's, unless `own_home=True` makes it the
  pod's own directory (as a container's is its image's): a login shell (`bash -l`) then reads
  no profile of the host's user, whose ~/.bashrc may run anything (pyenv, conda ...);
- checked reuse: execd's baseline covers the pod's own directory (its workspace) only, not
  /etc, /usr/local, /opt, $HOME or /tmp;
- snapshots (fork): only with `snapshots=True`, and then an agent pod's execd (its container
  sets SANDMAN_SNAPSHOT=on) is rooted at the pod's own directory, which stands for its image:
  its snapshot base, its file routes and its cwd are under it, never the host's root;
  `before_start(pod, dir)` plants that "image" before the execd starts;
- readiness: kwok marks the pod Ready on its own; the kubelet's probe of execd /health does
  not exist, and an execd that dies is not restarted.

Because no cgroup limits apply, `/conditions` would read the host's. A test that needs pods
with given limits passes `conditions_root(pod_name) -> dir | None`: that pod's execd reads its
cgroup files, mountinfo, passwd and zone under `dir` (execd's `--conditions-root`, a cgroup
tree the test built), so a contradiction with a declaration is staged for real; visible CPUs
still come from the real affinity of the pod's shell.

In-process (a watch thread): `Standin(core, namespace, workdir).start()`, `.alive()`, `.stop()`.
As a process (`start_standin`, used by testbed/stack.py):

    python -m testbed.standin --kubeconfig KC --namespace NS [--max-procs 200] [--max-s 3600]
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from sandman import contract
from testbed.execd import execd_cmd
from testbed.procs import Proc, descendants, parents


class Standin:
    """A real execd for every pod of `namespace` with an IP, while the pod exists."""

    def __init__(self, core, namespace: str, workdir: Path, max_procs: int = 200,
                 root: str = "/tmp", max_s: float = 3600.0, say=lambda msg: None,
                 conditions_root: Callable[[str], str | None] | None = None,
                 snapshots: bool = False, before_start: Callable[[str, Path], None] | None = None,
                 private_dirs: tuple[str, ...] = (), own_home: bool = False):
        self.core, self.namespace, self.workdir = core, namespace, Path(workdir)
        bad = [d for d in private_dirs if not d or "/" in d or d in (".", "..")]
        if bad:
            raise ValueError(f"standin: private_dirs are top-level names, not {bad}")
        if private_dirs and os.geteuid() != 0:
            raise PermissionError("standin: private_dirs needs root (a mount namespace per pod)")
        self.private_dirs = tuple(private_dirs)
        self.own_home = own_home
        self._made_dirs: list[Path] = []  # mount points made on the host, removed at stop()
        self.conditions_root = conditions_root
        # A pod whose container sets SANDMAN_SNAPSHOT=on (agent pods) gets an execd rooted at
        # its own directory, recording its snapshot base there: the host's /tmp is shared by
        # every pod, so a base over it would carry one pod's changes into another's fork.
        self.snapshots = snapshots
        self.before_start = before_start  # (pod name, its directory), before its execd starts
        self.max_procs, self.root, self.max_s, self.say = max_procs, root, max_s, say
        self.procs: dict[str, Proc] = {}
        self.ips: dict[str, str] = {}  # pod name -> the IP its execd listens on
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True, name="standin")
        self._refused: set[str] = set()

    def start(self) -> Standin:
        self.workdir.mkdir(parents=True, exist_ok=True)
        for d in self.private_dirs:
            point = Path("/") / d
            if not point.exists():
                point.mkdir()
                self._made_dirs.append(point)
            elif not point.is_dir():
                raise FileExistsError(f"standin: /{d} exists and is no directory")
        self._t.start()
        return self

    def alive(self) -> list[str]:
        """Names of the pods whose execd is running."""
        with self._lock:
            return [n for n, p in self.procs.items() if p.alive()]

    def stop(self) -> None:
        """Stop watching, then SIGKILL every execd and whatever each one started."""
        self._stop.set()
        if self._t.is_alive():
            self._t.join(15)
        with self._lock:
            names = list(self.procs)
        table = parents() if names else {}
        for name in names:
            self._kill(name, table)
        # The mount points only: each pod's files were in its namespace's bind mount, gone
        # with its processes. A point something else wrote into stays (rmdir refuses it).
        for point in self._made_dirs:
            try:
                point.rmdir()
            except OSError as e:
                self.say(f"standin: mount point {point} not removed: {e}")
        self._made_dirs = []

    def _run(self) -> None:
        from kubernetes import watch

        deadline = time.monotonic() + self.max_s
        rv = None  # the resourceVersion the next watch goes on from; None: list again
        while not self._stop.is_set() and time.monotonic() < deadline:
            try:
                if rv is None:
                    rv = self._resync()
                w = watch.Watch()
                for ev in w.stream(self.core.list_namespaced_pod, self.namespace,
                                   resource_version=rv, timeout_seconds=2,
                                   deserialize=False):
                    obj = ev["object"]
                    if ev["type"] == "ERROR":  # 410 Gone: too old, list again
                        rv = None
                        break
                    rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
                    self._on_event(ev["type"], obj)
                    if self._stop.is_set():
                        w.stop()
                        break
            except Exception as e:  # noqa: BLE001 - a broken watch restarts, bounded above
                self.say(f"standin: watch restarts: {e}")
                rv = None
                time.sleep(0.5)

    def _resync(self) -> str:
        """Every pod as listed now, and the execds of pods that are gone killed: a pod deleted
        while no watch ran sends no event, and its execd would go on holding its IP, which kwok
        gives the next pod (that pod's execd cannot bind, and its callers reach the old one's
        token: 401). Returns the list's resourceVersion, where the next watch starts."""
        raw = self.core.list_namespaced_pod(self.namespace, _preload_content=False)
        data = json.loads(raw.data)
        names = set()
        for pod in data.get("items") or []:
            names.add((pod.get("metadata") or {}).get("name"))
            self._on_event("ADDED", pod)
        with self._lock:
            gone = [n for n in self.procs if n not in names]
        for name in gone:
            self._kill(name)
        return data["metadata"]["resourceVersion"]

    def _on_event(self, kind: str, pod: dict) -> None:
        md, st = pod.get("metadata") or {}, pod.get("status") or {}
        name, ip = md.get("name"), st.get("podIP")
        if kind == "DELETED" or md.get("deletionTimestamp"):
            self._kill(name)
            return
        sha = (md.get("annotations") or {}).get(contract.ANNOTATION_TOKEN_SHA256)
        with self._lock:
            if not ip or not sha or name in self.procs or len(self.procs) >= self.max_procs:
                return
        if not ipaddress.ip_address(ip).is_loopback:
            if name not in self._refused:
                self._refused.add(name)
                self.say(f"standin: pod {name} has IP {ip}, not loopback: no execd started")
            return
        # kwok gives an IP to one live pod at a time: an execd still on it is a gone pod's
        # (its end unseen), and would answer this pod's callers with the old token.
        with self._lock:
            stale = [n for n, held in self.ips.items() if held == ip and n != name]
        for other in stale:
            self.say(f"standin: pod {name} has IP {ip}, still held by gone pod {other}'s execd")
            self._kill(other)
        home = self.workdir / name
        home.mkdir(parents=True, exist_ok=True)
        croot = self.conditions_root(name) if self.conditions_root else None
        if self.before_start is not None:
            self.before_start(name, home)
        root, base = self.root, ("--baseline-at-start", "on")
        if self.snapshots and _env(pod, contract.EXECD_SNAPSHOT_ENV) == "on":
            root, base = str(home), ("--baseline-at-start", "off", "--snapshot-at-start", "on")
        wrap: list[str] = []
        if self.private_dirs:
            root, wrap = "/", self._private_mounts(home)
        # The reuse baseline (execd's /diff, /restore) covers this pod's own directory only:
        # a stand-in must never restore, or delete additions in, the host's /etc or /tmp (nor
        # watch the host's whole root, whatever SANDMAN_BASELINE_SCOPE says).
        proc = Proc(f"execd-{name}", wrap + execd_cmd(
            ip, contract.EXECD_PORT, sha, "--netguard-status", str(self.workdir / "none.json"),
            "--root", root, "--workspace", str(home), *base,
            "--baseline-store", str(self.workdir / f"{name}.baseline"), "--baseline-paths", "",
            "--baseline-packages", "", "--baseline-scope", "listed",
            *(["--conditions-root", croot] if croot else [])),
            self.workdir / f"{name}.log", cwd=home,
            env={"HOME": str(home)} if self.own_home else None).start()
        with self._lock:
            self.procs[name] = proc
            self.ips[name] = ip

    def _private_mounts(self, home: Path) -> list[str]:
        """The argv prefix that runs execd in a mount namespace of its own where each of
        private_dirs is the pod's directory `home/private/NAME` (unshare execs sh, sh execs
        execd: one PID throughout, so killing it kills the namespace's last holder)."""
        binds = []
        for d in self.private_dirs:
            mine = home / "private" / d
            mine.mkdir(parents=True, exist_ok=True)
            binds.append(f"mount --bind {shlex.quote(str(mine))} {shlex.quote('/' + d)}")
        script = "set -e; " + "; ".join(binds) + '; exec "$@"'
        return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script,
                "standin-private"]

    def _kill(self, name: str, table: dict[int, int] | None = None) -> None:
        with self._lock:
            p = self.procs.pop(name, None)
            self.ips.pop(name, None)
        if p is None or p.pid is None:
            return
        kids = descendants(p.pid, table)
        p.kill()
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _env(pod: dict, name: str) -> str | None:
    """The sandbox container's value of `name` in the pod's spec (None when unset)."""
    for c in (pod.get("spec") or {}).get("containers") or []:
        for e in c.get("env") or []:
            if e.get("name") == name:
                return e.get("value")
    return None


def start_standin(namespace: str, kubeconfig: Path, log: Path, max_procs: int = 100,
                  max_s: float = 3600.0) -> Proc:
    """`python -m testbed.standin` as a process (stop it with SIGTERM: it kills its execds)."""
    return Proc("standin", [sys.executable, "-m", "testbed.standin", "--kubeconfig",
                            str(kubeconfig), "--namespace", namespace, "--max-procs",
                            str(max_procs), "--max-s", str(max_s)], log).start()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m testbed.standin",
                                 description="a real execd behind every kwok pod of a namespace")
    ap.add_argument("--kubeconfig", required=True)
    ap.add_argument("--namespace", required=True)
    ap.add_argument("--max-procs", type=int, default=200,
                    help="execd processes at most (each is ~15 MB plus its bash)")
    ap.add_argument("--max-s", type=float, default=3600.0, help="stop watching after this")
    ap.add_argument("--root", default="/tmp", help="execd --root: where file routes may go")
    a = ap.parse_args(argv)
    from kubernetes import client, config

    cfg = client.Configuration()
    config.load_kube_config(config_file=a.kubeconfig, client_configuration=cfg)
    core = client.CoreV1Api(client.ApiClient(cfg))
    workdir = Path(tempfile.mkdtemp(prefix="sandman-standin-"))
    done = threading.Event()

    def on_term(*_):
        done.set()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    s = Standin(core, a.namespace, workdir, a.max_procs, a.root, a.max_s,
                say=lambda m: print(m, flush=True)).start()
    print(f"standin: watching {a.namespace}", flush=True)
    try:
        while not done.wait(0.5) and s._t.is_alive():
            pass
    finally:
        s.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    print("standin: stopped, every execd killed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
