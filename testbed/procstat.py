"""CPU-seconds and resident memory of the stack's processes while a load test runs, from /proc.

`Sampler` reads, every `every_s` seconds in one thread, each named process's utime + stime
(/proc/<pid>/stat) and VmRSS (/proc/<pid>/status), its descendants' too (a webhook's or a
locust's workers), and the machine's CPU-seconds from /proc/stat (every core, idle included).
The processes are named by the caller from the pids it started (the test bed's components,
the webhook, the controller, locust), never found by name among the machine's processes.
`stop()` takes a last sample and writes `<path>`: the file loadtest/report.py reads to say
where the CPU went per ramp step (the format is in `write`).

A process that exits keeps the CPU-seconds of its last sample (what it used after that is
lost: at most `every_s` of it); a pid is keyed with its start time, so a recycled pid is a new
process, never the old one's counter going back.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from testbed.procs import descendants

TICK = os.sysconf("SC_CLK_TCK")
DESCENDANTS_EVERY_S = 10.0  # walking a Go server's threads for children costs more than a sample


def machine_cpu_s(stat: str | None = None) -> tuple[float, float]:
    """(all cores' CPU-seconds since boot, of which idle + iowait) from /proc/stat's `cpu`
    line; guest time is already in user time, so only the first eight fields count."""
    text = stat if stat is not None else Path("/proc/stat").read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("cpu "))
    f = [int(x) for x in line.split()[1:9]]
    return sum(f) / TICK, (f[3] + f[4]) / TICK


def proc_cpu(pid: int) -> tuple[int, float] | None:
    """(start time in ticks, utime + stime in seconds) of `pid`, None when it is gone."""
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    f = data.rsplit(")", 1)[1].split()  # fields from the 3rd (state) on; comm may hold spaces
    if f[0] == "Z":
        return None
    return int(f[19]), (int(f[11]) + int(f[12])) / TICK


def proc_rss(pid: int) -> int:
    """VmRSS of `pid` in bytes (0 when it is gone or a kernel thread)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Group:
    """One named process and its descendants: CPU-seconds summed over every process seen
    (a gone one keeps its last reading), RSS summed over the live ones."""

    def __init__(self, pid: int, tree: bool = True):
        self.pid = pid
        self.tree = tree
        self.pids = [pid]
        self.cpu: dict[tuple[int, int], float] = {}  # (pid, start time) -> last CPU-seconds
        self.walked = 0.0

    def read(self, now: float, walk: bool) -> tuple[float, int]:
        if self.tree and (walk or now - self.walked >= DESCENDANTS_EVERY_S):
            self.pids = [self.pid, *descendants(self.pid)]
            self.walked = now
        rss = 0
        for pid in self.pids:
            got = proc_cpu(pid)
            if got is None:
                continue
            self.cpu[(pid, got[0])] = got[1]
            rss += proc_rss(pid)
        return round(sum(self.cpu.values()), 2), rss


class Sampler:
    """`add(name, pid)` the processes, `start()`, then `stop()` (in a finally): it joins the
    thread and writes the samples. Bounded: one sample per `every_s`, at most `max_s`."""

    def __init__(self, path: Path, every_s: float = 2.0, max_s: float = 6 * 3600):
        self.path = path
        self.every_s = max(1.0, every_s)  # the brief's bound: no busier than once a second
        self.max_s = max_s
        self.groups: dict[str, Group] = {}
        self.samples: list[list] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, name: str, pid: int | None, tree: bool = True) -> None:
        """A process to follow (with `tree`, its descendants too); None (not started) is
        ignored."""
        if pid is None:
            return
        with self._lock:
            self.groups[name] = Group(pid, tree)
            self._sample(walk=True)  # it counts from now, not from the next tick

    def _sample(self, walk: bool = False) -> None:
        now = time.time()
        total, idle = machine_cpu_s()
        procs = {n: list(g.read(now, walk)) for n, g in self.groups.items()}
        self.samples.append([round(now, 3), round(total, 2), round(idle, 2), procs])

    def _run(self) -> None:
        deadline = time.monotonic() + self.max_s
        while not self._stop.wait(self.every_s) and time.monotonic() < deadline:
            with self._lock:
                self._sample()

    def start(self) -> Sampler:
        # Itself without its descendants: the stack's processes are its children.
        self.add("bench process (sampler)", os.getpid(), tree=False)
        self._thread = threading.Thread(target=self._run, name="procstat", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> Path:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        with self._lock:
            self._sample(walk=True)
        self.write()
        return self.path

    def write(self) -> None:
        """{"cores": n, "every_s": s, "names": [...], "samples": [[unix time, machine
        CPU-seconds (all cores), of which idle, {name: [CPU-seconds, RSS bytes]}], ...]}:
        counters since boot / process start, so any two samples give the CPU in between."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps({
            "cores": os.cpu_count(), "every_s": self.every_s, "names": list(self.groups),
            "samples": self.samples}))
