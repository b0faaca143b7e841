"""`make bench-netguard` (`python -m bench.netguard --write-docs`): how long apply + self-verify takes, in real network namespaces.

Builds a pod namespace joined by a veth to a peer namespace (which also holds the metadata
address, so the verify probes never leave the bench's own namespaces), then times, per backend:

- first apply: `ip netns exec POD python3 -I -S .../netguard.py apply ... --install-execd DIR`
  in a fresh namespace, as a sandbox's one injected init container runs it (podspec's
  NETGUARD_COMMAND, over a copy of this checkout's packages laid out and compiled as in the
  image): wall clock and CPU of the whole process (interpreter start, imports, detection,
  restore, read-back, probes, execd's install);
- re-apply: the same command again in the same namespace (a container restart);
- the in-process phases netguard records in its status file.

Beside it, same run and same interpreter flags: `python -c pass`, netguard's imports alone, and
the floor of any Python guard: the interpreter with the standard-library modules the apply
cannot do without.

Repeated (default 21 times), medians reported. Needs root, iproute2 and iptables.
`--write-docs` rewrites its section of docs/benchmarks.md; `--smoke`: one run, nft only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import docs
from bench.interp import pod_python
from bench.stats import median
from sandman.contract import NETGUARD_PATH
from sandman.podspec import NETGUARD_COMMAND

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## netguard: `python -m bench.netguard`"
GOAL_MS = 100
# CPU budget of netguard's own process (interpreter start included, the iptables-* children it
# runs not: they are reported beside it). Every guarded pod's start waits on this process.
CPU_BUDGET_MS = 30
APPLY_ARGS = ["--allow-egress", "10.250.1.2:53", "--ingress-from", "10.250.1.2/32",
              "--verify-blocked", "10.250.1.2:8080"]
# What any guard written in Python imports at the least: ipaddress (the CIDRs), and the C
# modules under socket (rtnetlink and the probes) and subprocess's pipes
# (iptables-*-restore/-save). Run with the guard's own interpreter flags (FLAGS).
FLOOR_IMPORTS = "import ipaddress, _socket, select, struct"
# The injected container's interpreter flags (podspec.NETGUARD_COMMAND: python3 FLAGS PATH).
FLAGS = NETGUARD_COMMAND[1:NETGUARD_COMMAND.index(NETGUARD_PATH)]
PACKAGES = ("netguard", "sandman", "execd")  # what the guard imports, as the image has them


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


class Netns:
    """pod <-veth-> peer; peer holds 169.254.169.254 and fd00:ec2::254, routed from the pod."""

    def __init__(self) -> None:
        sfx = secrets.token_hex(3)
        self.pod, self.peer = f"ngb-{sfx}", f"ngc-{sfx}"
        try:
            for ns in (self.pod, self.peer):
                _sh("ip", "netns", "add", ns)
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
            a, b = f"ngb{sfx}a", f"ngc{sfx}a"
            _sh("ip", "link", "add", a, "netns", self.pod, "type", "veth", "peer", "name", b,
                "netns", self.peer)
            for ns, dev, v4, v6 in ((self.pod, a, "10.250.1.1/24", "fd00:5b::1/64"),
                                    (self.peer, b, "10.250.1.2/24", "fd00:5b::2/64")):
                _sh("ip", "-n", ns, "addr", "add", v4, "dev", dev)
                _sh("ip", "-n", ns, "addr", "add", v6, "dev", dev, "nodad")
                _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", self.peer, "addr", "add", "169.254.169.254/32", "dev", b)
            _sh("ip", "-n", self.peer, "addr", "add", "fd00:ec2::254/128", "dev", b, "nodad")
            _sh("ip", "-n", self.pod, "route", "add", "169.254.169.254/32", "via", "10.250.1.2")
            _sh("ip", "-n", self.pod, "-6", "route", "add", "fd00:ec2::254/128", "via",
                "fd00:5b::2")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for ns in (self.pod, self.peer):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)

    def run(self, *cmd: str) -> float:
        """Wall-clock ms of `cmd` inside the pod namespace; raises if it fails."""
        return self.run_cpu(*cmd)[0]

    def run_cpu(self, *cmd: str) -> tuple[float, float]:
        """(wall-clock ms, CPU ms) of `cmd` inside the pod namespace. The CPU is user + sys of
        the whole process tree from getrusage(RUSAGE_CHILDREN) around the run: `ip netns exec`
        execs the command in its own process, whose waited-for children (iptables-*) roll up
        into it."""
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        p = subprocess.run(["ip", "netns", "exec", self.pod, *cmd], capture_output=True,
                           text=True, timeout=60, cwd=ROOT)
        ms = (time.perf_counter() - t0) * 1000
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {p.stderr.strip() or p.stdout.strip()}")
        cpu = (r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime) * 1000
        return ms, cpu

    def launcher_cpu(self) -> float:
        """CPU ms `ip netns exec` spends before it execs the command (it unshares a mount
        namespace and remounts /sys, in the process that becomes the command's): what
        `ip netns exec POD true` costs over `true`. A pod's process is exec'd by the runtime,
        which pays its own setup, so this is taken off netguard's figure."""
        true = shutil.which("true") or "/bin/true"
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run([true], check=True, timeout=30)
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        bare = (r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime) * 1000
        return self.run_cpu(true)[1] - bare


def stage(tmp: Path, python: str) -> list[str]:
    """The image's layout in `tmp`: this checkout's packages in a site directory, compiled as
    `pip install` leaves them (-I ignores a PYTHONPYCACHEPREFIX, and a PYTHONDONTWRITEBYTECODE
    checkout would make every run compile netguard's source, which no pod does), and a link in
    place of NETGUARD_PATH. Returns the guard's command with that link, as a pod runs it."""
    site = tmp / "site-packages"
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, site / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([python, "-I", "-m", "compileall", "-q", str(site)], check=True,
                   capture_output=True, timeout=120)
    link = tmp / "netguard.py"
    link.symlink_to(site / "netguard" / "__main__.py")
    return [python if a == "python3" else str(link) if a == NETGUARD_PATH else a
            for a in NETGUARD_COMMAND]


def bench_backend(backend: str, runs: int, tmp: Path, command: list[str]) -> dict:
    status = tmp / f"{backend}.json"
    apply = [*command, "--backend", backend, "--status-file", str(status), *APPLY_ARGS]
    first, again, phases, cpu_all, cpu_tools, launcher = [], [], {}, [], [], []
    for i in range(runs):
        volume = tmp / f"{backend}-volume-{i}"  # the pod's emptyDir, fresh per start
        volume.mkdir()
        ns = Netns()
        try:
            wall, cpu = ns.run_cpu(*apply, "--install-execd", str(volume))
            first.append(wall)
            st = json.loads(status.read_text())
            for k, v in st["timings_ms"].items():
                phases.setdefault(k, []).append(v)
            cpu_all.append(cpu)
            cpu_tools.append(st["cpu_ms"]["children"])
            launcher.append(ns.launcher_cpu())  # interleaved: a drift of the machine hits both
            if not (volume / "execd.py").is_file():
                raise RuntimeError(f"netguard apply --install-execd left no execd in {volume}")
            again.append(ns.run(*apply, "--install-execd", str(volume)))
        finally:
            ns.close()
    med = {k: median(v) for k, v in phases.items()}
    own = [a - t - n for a, t, n in zip(cpu_all, cpu_tools, launcher, strict=True)]
    return {
        "backend": backend, "runs": runs,
        "cpu_ms": median(cpu_all), "cpu_tools_ms": median(cpu_tools), "cpu_own_ms": median(own),
        "launcher_cpu_ms": median(launcher),
        "first_ms": median(first), "first_min_ms": min(first), "first_max_ms": max(first),
        "again_ms": median(again),
        "phases_ms": med,
        "apply_verify_ms": med.get("apply", 0) + med.get("readback", 0) + med.get("verify", 0),
    }


def bench_baseline(runs: int, python: str, tmp: Path) -> dict:
    """What the interpreter costs on its own, and with netguard's imports (same netns wrapper,
    same flags, same run, the same compiled bytecode): where the whole process's CPU goes."""
    site = str(tmp / "site-packages")
    imports = f"import sys; sys.path.insert(0, {site!r}); import netguard.cli, execd.install"
    ns = Netns()
    try:
        bare, imp, floor = [], [], []
        for _ in range(max(runs, 5)):  # interleaved: a drift of the machine hits all three
            n = ns.launcher_cpu()
            wall, cpu = ns.run_cpu(python, *FLAGS, "-c", "pass")
            bare.append((wall, cpu - n))
            imp.append(ns.run_cpu(python, *FLAGS, "-c", imports)[1] - n)
            floor.append(ns.run_cpu(python, *FLAGS, "-c", FLOOR_IMPORTS)[1] - n)
    finally:
        ns.close()
    return {"python_ms": median([w for w, _ in bare]), "python_cpu_ms": median([c for _, c in bare]),
            "import_cpu_ms": median(imp), "floor_cpu_ms": median(floor)}


def report(results: list[dict], base: dict, runs: int) -> str:
    cpu = platform.processor() or platform.machine()
    lines = [
        SECTION,
        "",
        "Apply + self-verify of the guard in a real network namespace (`make bench-netguard`,",
        "i.e. `.venv/bin/python -m bench.netguard --write-docs`, which rewrites this section).",
        f"Options: `apply {' '.join(APPLY_ARGS)} --install-execd DIR` (a sandbox's guard; a "
        "fresh DIR per run);",
        "IPv4 + IPv6, both applied, read back and probed. "
        f"{runs} runs per row, a fresh pod namespace per run;",
        "medians in milliseconds.",
        f"Machine: {os.cpu_count()} cores ({cpu}), kernel {platform.release()}, "
        f"the bench's Python {platform.python_version()}, {time.strftime('%Y-%m-%d')}.",
        "",
        "| backend | whole process, first apply (min-max) | whole process, re-apply "
        "| in-process: netinfo + backend detection | restore (both families) | read-back | probes "
        "| **apply + self-verify** | CPU: netguard's own process | CPU: its iptables-* children |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        p = r["phases_ms"]
        lines.append(
            f"| {r['backend']} | {r['first_ms']:.0f} ({r['first_min_ms']:.0f}-"
            f"{r['first_max_ms']:.0f}) | {r['again_ms']:.0f} | {p.get('detect', 0):.1f} "
            f"| {p.get('apply', 0):.1f} | {p.get('readback', 0):.1f} | {p.get('verify', 0):.1f} "
            f"| **{r['apply_verify_ms']:.1f}** | {r['cpu_own_ms']:.1f} | {r['cpu_tools_ms']:.1f} |")
    worst = max(r["apply_verify_ms"] for r in results)
    worst_cpu = max(r["cpu_own_ms"] for r in results)
    floor_note = (": the budget is below what the interpreter and those imports cost here, so no "
                  "Python guard meets it on this machine"
                  if base["floor_cpu_ms"] > CPU_BUDGET_MS else "")
    lines += [
        "",
        f"Load average (1 min) {base['load'][0]:.2f} at the start, {base['load'][1]:.2f} at the "
        f"end. Interpreter: `{base['python']}`. "
        f"Command: `{' '.join(NETGUARD_COMMAND)}` (the injected container's; a link to "
        "netguard/__main__.py, run as a file). "
        f"Baseline with the same flags under the same `ip netns exec`, same run: "
        f"`python {' '.join(FLAGS)} -c pass` "
        f"{base['python_ms']:.0f} ms wall, {base['python_cpu_ms']:.1f} ms CPU; "
        f"`import netguard.cli, execd.install` {base['import_cpu_ms']:.1f} ms CPU "
        "(the imports alone, the rest of the process is the apply and the install); "
        f"`{FLOOR_IMPORTS}` {base['floor_cpu_ms']:.1f} ms CPU, the floor of any "
        "Python guard (the CIDRs, and the C modules for rtnetlink and the probes and the "
        "iptables-* children's pipes), before any work.",
        "netguard's modules run from compiled bytecode, as the image's `pip install` leaves them",
        "(a copy of this checkout's packages, compiled before the runs).",
        "CPU is user + sys from `getrusage(RUSAGE_CHILDREN)` around each first apply (the whole",
        "process tree); the iptables-* children's share is what netguard's own `getrusage`",
        "reports in its status file (`cpu_ms.children`), and netguard's own is the rest, less",
        "what `ip netns exec` spent in the same process before its exec (measured beside each",
        "run as `ip netns exec POD true` over `true`: "
        + ", ".join(f"{r['backend']} {r['launcher_cpu_ms']:.1f} ms" for r in results)
        + "; a pod's runtime pays its own). The baselines are taken the same way.",
        "",
        f"Goal <= {GOAL_MS} ms for apply + self-verify (restore, read-back, probes): "
        f"{'met' if worst <= GOAL_MS else 'NOT met'} ({worst:.1f} ms worst median). "
        f"CPU budget <= {CPU_BUDGET_MS} ms for netguard's own process: "
        f"{'met' if worst_cpu <= CPU_BUDGET_MS else 'NOT met'} ({worst_cpu:.1f} ms worst median; "
        f"the interpreter alone {base['python_cpu_ms']:.1f} ms, the floor "
        f"{base['floor_cpu_ms']:.1f} ms{floor_note}). The detection `iptables-save` "
        "runs overlap the netlink read.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.netguard", description=__doc__)
    ap.add_argument("--runs", type=int, default=21)
    ap.add_argument("--python", default=None,
                    help="the interpreter to run netguard with (default: the pod's, see pod_python)")
    ap.add_argument("--backend", action="append", choices=("nft", "legacy"),
                    help="default: nft, and legacy when installed")
    docs.add_flags(ap)
    args = ap.parse_args(argv)
    docs.check_flags(ap, args)
    if args.smoke:
        args.runs, args.backend = 1, args.backend or ["nft"]
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("iptables-nft-restore"):
        print("bench.netguard: needs root, iproute2 and iptables (make deps)", file=sys.stderr)
        return 1
    args.python = args.python or pod_python()
    # For the docs, a machine still busy with an earlier step gets up to SETTLE_S to settle.
    load0 = docs.settle() if args.write_docs else docs.load1()
    if args.write_docs and load0 > docs.LOAD_MAX:
        print(f"bench.netguard: {docs.docs_refusal(load0, 0.0)}; run it with nothing else "
              "running", file=sys.stderr)
        return 1
    backends = args.backend or ["nft"] + (["legacy"] if shutil.which("iptables-legacy-restore")
                                          else [])
    with tempfile.TemporaryDirectory(prefix="netguard-bench-") as tmp:
        command = stage(Path(tmp), args.python)
        results = [bench_backend(b, args.runs, Path(tmp), command) for b in backends]
        base = bench_baseline(args.runs, args.python, Path(tmp))
    load_end = docs.load1()
    section = report(results, {**base, "python": args.python,
                               "load": (load0, load_end)}, args.runs)
    print(section)
    if args.write_docs:
        refusal = docs.docs_refusal(load0, load_end)
        if refusal:
            print(f"bench.netguard: {refusal}", file=sys.stderr)
            return 1
        print(f"wrote {docs.write_section(section)}", file=sys.stderr)
    worst = max(r["apply_verify_ms"] for r in results)
    worst_cpu = max(r["cpu_own_ms"] for r in results)
    return 0 if worst <= GOAL_MS and worst_cpu <= CPU_BUDGET_MS else 1


if __name__ == "__main__":
    sys.exit(main())
