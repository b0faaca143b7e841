"""execd vs SWE-ReX vs the bare limit, on loopback, in one invocation (`make bench-execd`:
`python -m bench.execd --write-docs`).

A script, not a test: it prints a markdown table of medians over --repeats runs (the machine is
noisy; targets are interleaved inside each repeat so they share its noise), and with
--write-docs replaces its section of docs/benchmarks.md with it. --smoke: a few calls, one
small flood, no SWE-ReX (tests/bench/test_smoke.py).

Targets, each a subprocess on 127.0.0.1:
  bare   a stdlib HTTP server that answers at once plus a persistent bash driven over pipes:
         the floor any HTTP-to-bash daemon in Python pays
  execd  execd/execd.py (token on, as in a pod)
  swerex SWE-ReX's server (swe-rex==1.4.0, bash session API) from its own venv .venv-bench,
         created here when missing (its pins may conflict with the main venv's)
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import os
import re
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import docs
from bench.interp import pod_python
from bench.stats import percentile
from sandman.podspec import EXECD_PYTHON_FLAGS
from testbed.procs import reserve_port

REPO = Path(__file__).resolve().parents[1]
EXECD = REPO / "execd" / "execd.py"
BENCH_VENV = REPO / ".venv-bench"
SWEREX_PIN = "swe-rex==1.4.0"
MIB = 1 << 20
SECTION = "## execd: `python -m bench.execd`"

BARE_SERVER = r'''
import http.server, json, os, subprocess, sys
bash = subprocess.Popen(["bash", "--noprofile", "--norc"], stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=0)
END = b"__BARE_END__"
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    def log_message(self, *a):
        pass
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        bash.stdin.write(req["command"].encode() + b"\necho " + END + b"$?\n")
        buf = bytearray()
        while True:
            buf += os.read(bash.stdout.fileno(), 1 << 20)
            i = buf.rfind(END)
            if i >= 0 and buf.endswith(b"\n"):
                break
        body = json.dumps({"exit_code": int(buf[i + len(END):]),
                           "output": buf[:i].decode("utf-8", "replace")}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
print("listening", srv.server_address[1], flush=True)
srv.serve_forever()
'''


def wait_port(port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"port {port} did not open in {timeout}s")


class Target:
    name = ""
    proc: subprocess.Popen | None = None

    def __init__(self) -> None:
        self.conn: http.client.HTTPConnection | None = None

    def request(self, path: str, body: dict) -> dict:
        raise NotImplementedError

    def _post(self, path: str, body: dict, headers: dict) -> dict:
        data = json.dumps(body)
        for attempt in (0, 1):
            try:
                self.conn.request("POST", path, data, {"Content-Type": "application/json",
                                                       **headers})
                r = self.conn.getresponse()
                raw = r.read()
                if r.status != 200:
                    raise RuntimeError(f"{self.name}: HTTP {r.status}: {raw[:300]!r}")
                return json.loads(raw)
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                if attempt:
                    raise
                self.reconnect()
        raise AssertionError("unreachable")

    def reconnect(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)

    def run(self, command: str, max_output: int) -> dict:
        raise NotImplementedError

    def stop(self) -> None:
        if self.conn is not None:
            self.conn.close()
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


class Bare(Target):
    name = "bare limit"

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", BARE_SERVER], stdout=subprocess.PIPE,
                                     start_new_session=True)
        line = self.proc.stdout.readline().decode()
        self.port = int(line.split()[1])
        self.reconnect()

    def run(self, command: str, max_output: int) -> dict:
        return self._post("/exec", {"command": command}, {})


class Execd(Target):
    name = "execd"

    def start(self) -> None:
        self.token = secrets.token_hex(16)
        env = dict(os.environ, SANDMAN_TOKEN_SHA256=hashlib.sha256(self.token.encode())
                   .hexdigest())
        self.proc = subprocess.Popen([sys.executable, str(EXECD), "--listen", "127.0.0.1:0"],
                                     stderr=subprocess.PIPE, env=env, start_new_session=True)
        line = self.proc.stderr.readline().decode()
        m = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
        if not m:
            raise RuntimeError(f"execd did not start: {line}")
        self.port = int(m.group(1))
        self.reconnect()

    def run(self, command: str, max_output: int, timeout: float = 300) -> dict:
        r = self._post("/exec", {"command": command, "max_output": max_output,
                                 "timeout": timeout},
                       {"Authorization": f"Bearer {self.token}"})
        if r["error"] is not None and r["exit_code"] != 124:
            raise RuntimeError(f"execd error: {r['error']}")
        return r

    def rss_kib(self, field: str) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
        raise RuntimeError(field)


def pod_install(d: Path, py: str, bytecode: bool = True) -> Path:
    """execd laid out as a pod has it (execd/install.py: the launcher and the daemon package),
    the package's bytecode compiled by the same interpreter (as `pip install` does in the
    image) unless `bytecode` is false; returns the launcher's path."""
    from execd.install import DAEMON, install

    d.mkdir(exist_ok=True)
    install(str(d))
    pkg = d / DAEMON
    for pyc in pkg.glob("__pycache__/*.pyc"):  # another interpreter's, copied from the tree
        pyc.unlink()
    if bytecode:
        subprocess.run([py, "-m", "compileall", "-q", str(pkg)], check=True, timeout=120)
    return d / "execd.py"


class PodExecd(Execd):
    """execd as a sandbox runs it: the task image's python3 with the pod's flags, the
    launcher importing the daemon's bytecode (a script keeps what compiling its source took,
    ~1.2 MiB per 500 lines, which no pod pays)."""

    name = "execd (as in a pod)"

    def start(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="bench-execd-pod-"))
        launcher = pod_install(self.dir / "sandman", pod_python())
        self.token = secrets.token_hex(16)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        env["PYTHONDONTWRITEBYTECODE"] = "1"  # the pod's mount is read-only
        env["SANDMAN_TOKEN_SHA256"] = hashlib.sha256(self.token.encode()).hexdigest()
        self.proc = subprocess.Popen([pod_python(), *EXECD_PYTHON_FLAGS, "-B", str(launcher),
                                      "--listen", "127.0.0.1:0"], stderr=subprocess.PIPE,
                                     env=env, start_new_session=True)
        line = self.proc.stderr.readline().decode()
        m = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
        if not m:
            raise RuntimeError(f"execd (pod layout) did not start: {line}")
        self.port = int(m.group(1))
        self.reconnect()

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            import shutil

            if getattr(self, "dir", None) is not None:
                shutil.rmtree(self.dir, ignore_errors=True)


class SweRex(Target):
    name = "SWE-ReX 1.4.0"
    wrong = 0

    @staticmethod
    def ensure_venv() -> Path:
        exe = BENCH_VENV / "bin" / "swerex-remote"
        if not exe.exists():
            print(f"creating {BENCH_VENV} with {SWEREX_PIN} ...", file=sys.stderr)
            subprocess.run([sys.executable, "-m", "venv", str(BENCH_VENV)], check=True)
            subprocess.run([str(BENCH_VENV / "bin" / "pip"), "install", "--quiet",
                            "--disable-pip-version-check", SWEREX_PIN], check=True)
        return exe

    def start(self) -> None:
        exe = self.ensure_venv()
        self.token = secrets.token_hex(16)
        # swerex-remote takes its port on its command line and reports none: one no bind(0)
        # on the machine is given, held for this run (testbed/procs.py).
        self.port = reserve_port()
        self.proc = subprocess.Popen([str(exe), "--host", "127.0.0.1", "--port", str(self.port),
                                      "--auth-token", self.token], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        wait_port(self.port, self.proc, 60)
        self.reconnect()
        self._post("/create_session", {"session": "default", "session_type": "bash"},
                   {"X-API-Key": self.token})

    def run(self, command: str, max_output: int) -> dict:
        return self._post("/run_in_session", {"command": command, "session": "default",
                                              "action_type": "bash", "check": "silent",
                                              "timeout": 300},
                          {"X-API-Key": self.token})


def loop(target: Target, command: str, calls: int, max_output: int, expect: str | None,
         expect_len: int | None = None) -> list[float]:
    target.reconnect()  # one keep-alive connection per loop (uvicorn drops idle ones after 5 s)
    lat = []
    for _ in range(calls):
        t0 = time.perf_counter()
        r = target.run(command, max_output)
        lat.append(time.perf_counter() - t0)
        # SWE-ReX's pexpect session sometimes adds prompt residue; containment is enough.
        wrong = (expect is not None and expect not in r["output"]) or (
            expect_len is not None and r["output"].count("a") != expect_len)
        if wrong:
            # SWE-ReX occasionally answers with an empty output: counted, reported. Anywhere
            # else a wrong answer ends the run.
            if not isinstance(target, SweRex):
                raise RuntimeError(f"{target.name}: unexpected output {r['output'][:100]!r}")
            target.wrong += 1
    return lat


def summary(lat: list[float]) -> dict:
    return {"p50": percentile(lat, 50) * 1e3, "p90": percentile(lat, 90) * 1e3,
            "p99": percentile(lat, 99) * 1e3, "cps": len(lat) / sum(lat)}


def median_of(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def flood_figures(ex: Execd, sizes_mib=(16, 256, 1024), yes_timeout: float = 10
                  ) -> list[tuple[str, str]]:
    rows = [("execd RSS at rest (from the checkout, venv python)", f"{ex.rss_kib('VmRSS') / 1024:.1f} MiB")]
    for mib in sizes_mib:
        t0 = time.perf_counter()
        r = ex.run(f"head -c {mib * MIB} /dev/zero", 102400)
        took = time.perf_counter() - t0
        assert r["truncated"], r
        rows.append((f"{mib} MiB flood, 100 KiB cap", f"peak RSS {ex.rss_kib('VmHWM') / 1024:.1f}"
                     f" MiB, {took:.2f} s"))
    t0 = time.perf_counter()
    r = ex.run("yes", 102400, timeout=yes_timeout)
    took = time.perf_counter() - t0
    assert r["exit_code"] == 124, r
    rows.append((f"endless `yes`, {yes_timeout:g} s timeout", f"peak RSS {ex.rss_kib('VmHWM') / 1024:.1f} MiB,"
                 f" exit 124 after {took:.2f} s"))
    return rows


# CPU budget from exec to listening, as a sandbox starts execd (its own quota pays it; 50 ms is
# 0.5 s of a 100m pod's start).
STARTUP_BUDGET_MS = 50.0


def _listen_cpu_ms(argv: list[str], env: dict, rss: list | None = None) -> float:
    """CPU of a starting execd up to its listening line: its threads' on-CPU time from
    /proc/<pid>/task/*/schedstat (ns) read the moment the line arrives; with `rss`, its
    VmRSS (KiB) at that moment is appended there."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        line = proc.stderr.readline()
        if "listening" not in line:
            raise RuntimeError(f"execd did not start: {line.strip()}")
        ns = 0
        for t in os.listdir(f"/proc/{proc.pid}/task"):
            try:
                with open(f"/proc/{proc.pid}/task/{t}/schedstat") as f:
                    ns += int(f.read().split()[0])
            except (FileNotFoundError, ProcessLookupError):
                # A thread that ended meanwhile: execd starts one once it listens (its
                # dumpable flag), which is past what is measured here.
                continue
        if rss is not None:
            for ln in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                if ln.startswith("VmRSS:"):
                    rss.append(int(ln.split()[1]))
        return ns / 1e6
    finally:
        proc.kill()
        proc.wait(10)


def floods_sizes(args) -> tuple[int, ...]:
    return (1,) if args.smoke else (16, 256, 1024)


def revision_install(d: Path, py: str, rev: str) -> Path:
    """execd as revision `rev` of this repository lays it out in a pod: that revision's
    execd/ (git archive) installed by its own install.py, its bytecode compiled by `py`."""
    src = d.parent / f"src-{rev}"
    src.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "execd"],
                             capture_output=True, check=True, timeout=60).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True, timeout=60)
    d.mkdir()
    subprocess.run([py, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                    "from execd.install import install; install(sys.argv[2])", str(src), str(d)],
                   check=True, timeout=60)
    subprocess.run([py, "-m", "compileall", "-q", str(d)], check=True, timeout=120)
    return d / "execd.py"


def startup_figures(runs: int, tmp: Path, before: str | None = None) -> dict:
    """exec -> listening CPU of execd started through the pod's launcher without bytecode (the
    sources compiled at every start) and with the bytecode the install copies (execd/install.py;
    compiled by the same interpreter, as `pip install` does in the image), beside `python3 -c
    pass`; medians over `runs`, the three interleaved."""
    py = pod_python()
    with_pyc = pod_install(tmp / "sandman", py)
    without = pod_install(tmp / "sandman-source", py, bytecode=False)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # the pod's mount is read-only: nothing is cached
    env["SANDMAN_TOKEN_SHA256"] = "0" * 64
    listen = ["--listen", "127.0.0.1:0"]
    # -B: the pod's mount is read-only, so nothing is cached between starts (-I ignores
    # PYTHONDONTWRITEBYTECODE, and root writes into a read-only-moded directory anyway).
    arms = {"script": [py, *EXECD_PYTHON_FLAGS, "-B", str(without), *listen],
            "launcher + bytecode": [py, *EXECD_PYTHON_FLAGS, "-B", str(with_pyc), *listen],
            "python3 -c pass": [py, "-c", "import sys; sys.stderr.write('listening\\n'); "
                                "sys.stderr.flush(); sys.stdin.read()"]}
    if before:
        old = revision_install(tmp / f"sandman-{before}", py, before)
        arms["before"] = [py, *EXECD_PYTHON_FLAGS, "-B", str(old), *listen]
    got: dict[str, list[float]] = {k: [] for k in arms}
    rss: dict[str, list] = {k: [] for k in arms}
    for _ in range(runs):
        for k, argv in arms.items():
            got[k].append(_listen_cpu_ms(argv, env, rss[k]))
    med = {k: statistics.median(v) for k, v in got.items()}
    out = {"python": py, "runs": runs, "rss": {k: statistics.median(v) / 1024
                                                for k, v in rss.items()}, **med}
    if before:
        out["before_ms"], out["before"] = out.pop("before"), before
    return out


def startup_lines(st: dict) -> list[str]:
    ok = st["launcher + bytecode"] <= STARTUP_BUDGET_MS
    return [
        "", f"execd's start, exec -> listening, CPU ms (median of {st['runs']}; `{st['python']}`, "
        "the task image's interpreter; each process's own schedstat at its listening line):", "",
        "| how | CPU ms |", "|---|---:|",
        f"| the launcher, no bytecode (the sources compiled at every start) | {st['script']:.1f} |",
        f"| the pod's launcher (`python3 {' '.join(EXECD_PYTHON_FLAGS)}`), daemon from the "
        f"install's bytecode | {st['launcher + bytecode']:.1f} |",
        f"| `python3 -c pass` (the interpreter alone) | {st['python3 -c pass']:.1f} |",
    ] + ([f"| revision {st['before']}'s launcher and daemon, bytecode, same flags, interleaved "
          f"| {st['before_ms']:.1f} |"] if st.get("before") else []) + [
        "", f"- budget <= {STARTUP_BUDGET_MS:.0f} ms from exec to listening: "
        f"**{'met' if ok else 'NOT met'}** ({st['launcher + bytecode']:.1f} ms)",
    ] + ([f"- against revision {st['before']} in the same run: CPU "
          f"{st['launcher + bytecode']:.1f} ms vs {st['before_ms']:.1f} ms, RSS at the listening "
          f"line {st['rss']['launcher + bytecode']:.1f} MiB vs {st['rss']['before']:.1f} MiB"]
         if st.get("before") else [])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=1000, help="echo calls per target per repeat")
    p.add_argument("--repeats", type=int, default=3, help="medians over this many repeats")
    p.add_argument("--big-calls", type=int, default=20, help="1 MiB-output calls per repeat")
    p.add_argument("--skip-swerex", action="store_true")
    p.add_argument("--before", metavar="REV", help="also start execd as revision REV of this "
                   "repository lays it out (git archive), interleaved, for a before/after")
    docs.add_flags(p)
    args = p.parse_args(argv)
    docs.check_flags(p, args)
    cmdline = docs.command("bench.execd", sys.argv[1:] if argv is None else argv)
    floods = {}
    if args.smoke:
        args.calls, args.repeats, args.big_calls, args.skip_swerex = 5, 1, 2, True
        floods = {"sizes_mib": (1,), "yes_timeout": 1}

    load0 = os.getloadavg()[0]
    targets: list[Target] = [Bare(), Execd()] + ([] if args.skip_swerex else [SweRex()])
    try:
        for t in targets:
            t.start()
        small: dict[str, list[dict]] = {t.name: [] for t in targets}
        big: dict[str, list[dict]] = {t.name: [] for t in targets}
        for t in targets:  # warm-up
            loop(t, "echo hi", 20, 102400, "hi")
            if isinstance(t, SweRex):
                t.wrong = 0  # count wrong answers among the timed calls only
        for rep in range(args.repeats):
            for t in targets:
                lat = loop(t, "echo hi", args.calls, 102400, "hi")
                small[t.name].append(summary(lat))
                print(f"repeat {rep + 1}/{args.repeats} {t.name:14s} echo hi: "
                      f"p50 {small[t.name][-1]['p50']:.3f} ms", file=sys.stderr, flush=True)
                lat = loop(t, "head -c 1048576 /dev/zero | tr '\\0' a", args.big_calls,
                           2 * MIB, None, MIB)
                big[t.name].append(summary(lat))
        ex = next(t for t in targets if type(t) is Execd)
        floods = flood_figures(ex, **floods)
        pod = PodExecd()
        targets.append(pod)  # stopped with the others
        pod.start()
        loop(pod, "echo hi", 20, 102400, "hi")
        biggest = max(floods_sizes(args))
        floods.append(("execd RSS at rest, as the pod runs it (launcher, bytecode)",
                       f"{pod.rss_kib('VmRSS') / 1024:.1f} MiB"))
        t0 = time.perf_counter()
        r = pod.run(f"head -c {biggest * MIB} /dev/zero", 102400)
        assert r["truncated"], r
        floods.append((f"{biggest} MiB flood, 100 KiB cap, as the pod runs it",
                       f"peak RSS {pod.rss_kib('VmHWM') / 1024:.1f} MiB, "
                       f"{time.perf_counter() - t0:.2f} s"))
        with tempfile.TemporaryDirectory(prefix="bench-execd-start-") as tmp:
            startup = startup_figures(3 if args.smoke else 21, Path(tmp), args.before)
    finally:
        for t in targets:
            t.stop()

    load1 = os.getloadavg()[0]
    med = {name: median_of(runs) for name, runs in small.items()}
    medbig = {name: median_of(runs) for name, runs in big.items()}
    bare, exd = med["bare limit"], med["execd"]
    lines = [
        SECTION, "",
        f"Produced by `{cmdline}` (from the repo root, venv python) on "
        f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, Python "
        f"{sys.version.split()[0]}, loopback. Each figure is the median over {args.repeats} "
        f"repeats; per repeat {args.calls} sequential `echo hi` calls over one keep-alive "
        f"connection and {args.big_calls} calls printing 1 MiB, targets interleaved. Load "
        f"average (1 min) {load0:.2f} at the start, {load1:.2f} at the end.", "",
        "| target | echo p50 ms | p90 ms | p99 ms | calls/s | 1 MiB output p50 ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in med:
        s, b = med[name], medbig[name]
        lines.append(f"| {name} | {s['p50']:.3f} | {s['p90']:.3f} | {s['p99']:.3f} | "
                     f"{s['cps']:.0f} | {b['p50']:.2f} |")
    lines += ["", f"- execd p50 / bare-limit p50: **{exd['p50'] / bare['p50']:.2f}x** "
              "(goal: at most 4x)"]
    if "SWE-ReX 1.4.0" in med:
        sw = next(t for t in targets if isinstance(t, SweRex))
        lines.append(f"- SWE-ReX p50 / execd p50: **{med['SWE-ReX 1.4.0']['p50'] / exd['p50']:.0f}x**"
                     " (goal: at least 30x)")
        lines.append(f"- SWE-ReX answers with the wrong output (e.g. empty for `echo hi`): "
                     f"{sw.wrong} of {args.repeats * (args.calls + args.big_calls)} timed calls")
    lines += startup_lines(startup)
    lines += ["", "Memory under output floods (execd, default 100 KiB cap, peak RSS is VmHWM "
              "since start):", "", "| case | result |", "|---|---|"]
    lines += [f"| {a} | {b} |" for a, b in floods]
    section = "\n".join(lines) + "\n"
    print(section)
    if args.write_docs:
        print(f"wrote {docs.write_section(section)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
