"""testbed/procstat.py on real processes: a named process's CPU-seconds include its
descendants', a process that exits keeps what it used, and the file the report reads."""

from __future__ import annotations

import json
import sys

from testbed import procstat
from testbed.procs import Proc, wait_for

# Burns `cpu` CPU-seconds, starts a child that burns as much (with --child), says so in a file
# per process, then sleeps until stopped (at most a minute).
BURN = """
import subprocess, sys, time
cpu, out, child = float(sys.argv[1]), sys.argv[2], len(sys.argv) > 3
if child:
    subprocess.Popen([sys.executable, __file__, sys.argv[1], out + ".child"])
while time.process_time() < cpu:
    pass
open(out, "w").write("burnt")
time.sleep(60)
"""


def _burner(tmp_path, child: bool) -> tuple[Proc, list]:
    script = tmp_path / "burn.py"
    script.write_text(BURN)
    marks = [tmp_path / "burnt", tmp_path / "burnt.child"]
    p = Proc("burner", [sys.executable, str(script), "0.3", str(marks[0]),
                        *(["child"] if child else [])], tmp_path / "burn.log").start()
    return p, marks if child else marks[:1]


def test_a_process_counts_its_descendants_cpu_and_memory(tmp_path):
    p, marks = _burner(tmp_path, child=True)
    s = procstat.Sampler(tmp_path / "run_procs.json", every_s=1.0)
    try:
        s.add("burner", p.pid)
        s.start()
        wait_for(lambda: all(m.exists() for m in marks), 60, "both processes burnt 0.3 s")
    finally:
        path = s.stop()
        p.stop()
    doc = json.loads(path.read_text())
    assert doc["names"] == ["burner", "bench process (sampler)"] and doc["cores"] >= 1
    first, last = doc["samples"][0], doc["samples"][-1]
    cpu, rss = last[3]["burner"]
    # The parent's 0.3 s and its child's (/proc counts in ticks: a tick or two less).
    assert cpu >= 0.5, doc["samples"]
    assert rss > 2 * 5 * 2**20  # two live Python interpreters
    assert last[1] > first[1] >= first[2] and last[0] > first[0]
    assert "bench process (sampler)" in last[3]


def test_a_process_that_exits_keeps_what_it_used(tmp_path):
    p, marks = _burner(tmp_path, child=False)
    try:
        g = procstat.Group(p.pid)
        wait_for(lambda: marks[0].exists(), 60, "the process burnt 0.3 s")
        used, rss = g.read(0.0, walk=True)
        assert used >= 0.25 and rss > 0
    finally:
        p.stop()
    assert p.proc.poll() is not None
    assert g.read(100.0, walk=True) == (used, 0)  # gone: its CPU stays, its memory is 0


def test_machine_cpu_counts_every_field_once():
    # guest and guest_nice (the last two) are already inside user and nice.
    stat = "cpu  100 10 50 800 40 5 5 0 30 0\ncpu0 50 5 25 400 20 2 3 0 15 0\n"
    total, idle = procstat.machine_cpu_s(stat)
    assert (total, idle) == (1010 / procstat.TICK, 840 / procstat.TICK)
