"""Whole trees through one tar vs one request per file, on loopback, in one invocation
(`make bench-trees`: `python -m bench.trees --write-docs`).

A script, not a test: a real execd (testbed/execd.py) on 127.0.0.1 and the sync SDK. Two
trees: --files small files (1 KiB each, in 10 directories) and one --big-mib file. Each repeat
times, interleaved so they share the machine's noise: sb.upload_tree vs sb.write per file
(plus the one `mkdir -p` the per-file way needs), then sb.download_tree vs sb.read per file.
The table gives medians over --repeats (bench/stats.py). With --write-docs it replaces its
section of docs/benchmarks.md, only when the machine was quiet at the start and the end
(bench/docs.py's load gate). --smoke: 20 files, 1 MiB, one repeat, no docs
(tests/bench/test_smoke.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench import docs
from bench.stats import median
from sandman.client import Sandbox
from testbed.execd import start_execd

SECTION = "## Trees: `python -m bench.trees`"
KIB, MIB = 1 << 10, 1 << 20


def make_small(root: Path, n: int) -> list[str]:
    names = []
    for i in range(n):
        rel = f"d{i % 10}/f{i:05d}.txt"
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(os.urandom(KIB // 2).hex().encode())  # 1 KiB of text
        names.append(rel)
    return names


def make_big(root: Path, mib: int) -> list[str]:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "big.bin", "wb") as f:
        for _ in range(mib):
            f.write(os.urandom(MIB))
    return ["big.bin"]


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return (time.perf_counter() - t0) * 1000.0


def per_file_up(sb: Sandbox, src: Path, names: list[str], remote: str) -> None:
    dirs = sorted({os.path.dirname(n) for n in names if os.path.dirname(n)})
    sb.exec("mkdir -p " + " ".join([remote] + [f"{remote}/{d}" for d in dirs]))
    for n in names:
        sb.write(f"{remote}/{n}", (src / n).read_bytes())


def per_file_down(sb: Sandbox, remote: str, names: list[str], dst: Path) -> None:
    for n in names:
        p = dst / n
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(sb.read(f"{remote}/{n}"))


def check_same(a: Path, names: list[str], b: Path) -> None:
    for n in names:
        if (a / n).read_bytes() != (b / n).read_bytes():
            raise SystemExit(f"bench.trees: {b / n} differs from {a / n}")


def measure(work: Path, files: int, big_mib: int, repeats: int) -> dict[str, dict[str, list]]:
    small, big = work / "src-small", work / "src-big"
    cases = {f"{files} files of 1 KiB": (small, make_small(small, files)),
             f"one {big_mib} MiB file": (big, make_big(big, big_mib))}
    res: dict[str, dict[str, list]] = {c: {"tree_up": [], "file_up": [], "tree_down": [],
                                           "file_down": []} for c in cases}
    ex = start_execd(work / "execd", "--max-body", str((big_mib * 2 + 8) * MIB))
    try:
        with Sandbox.connect(ex.address, ex.port, ex.token, file_timeout_s=300.0) as sb:
            remote = work / "remote"
            for rep in range(repeats):
                for case, (src, names) in cases.items():
                    r = res[case]
                    r["tree_up"].append(timed(sb.upload_tree, src, f"{remote}/t"))
                    r["file_up"].append(timed(per_file_up, sb, src, names, f"{remote}/f"))
                    check_same(src, names, remote / "t")
                    check_same(src, names, remote / "f")
                    r["tree_down"].append(timed(sb.download_tree, f"{remote}/t",
                                                work / "down-t"))
                    r["file_down"].append(timed(per_file_down, sb, f"{remote}/f", names,
                                                work / "down-f"))
                    check_same(src, names, work / "down-t")
                    check_same(src, names, work / "down-f")
                    for p in (remote, work / "down-t", work / "down-f"):
                        shutil.rmtree(p)
                    print(f"repeat {rep + 1}/{repeats} {case}: tree up "
                          f"{r['tree_up'][-1]:.0f} ms, per file {r['file_up'][-1]:.0f} ms",
                          file=sys.stderr, flush=True)
    finally:
        ex.stop()
    return res


def render(res: dict[str, dict[str, list]], cmdline: str, repeats: int,
           load: tuple[float, float]) -> str:
    lines = [
        SECTION, "",
        f"Produced by `{cmdline}` (from the repo root, venv python) on "
        f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, Python "
        f"{sys.version.split()[0]}, loopback, the sync SDK against a real execd. Each figure "
        f"is the median over {repeats} repeats, the tree route and the per-file way "
        f"interleaved in each (per file up: one `mkdir -p`, then `sb.write` per file; down: "
        f"`sb.read` per file). Load average (1 min) {load[0]:.2f} at the start, "
        f"{load[1]:.2f} at the end.", "",
        "| tree | upload_tree ms | sb.write per file ms | speed-up | download_tree ms | "
        "sb.read per file ms | speed-up |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for case, r in res.items():
        m = {k: median(v) for k, v in r.items()}
        lines.append(f"| {case} | {m['tree_up']:.0f} | {m['file_up']:.0f} | "
                     f"{m['file_up'] / m['tree_up']:.1f}x | {m['tree_down']:.0f} | "
                     f"{m['file_down']:.0f} | {m['file_down'] / m['tree_down']:.1f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=1000, help="small files in the first tree")
    p.add_argument("--big-mib", type=int, default=50, help="size of the second tree's file")
    p.add_argument("--repeats", type=int, default=5, help="medians over this many repeats")
    docs.add_flags(p)
    args = p.parse_args(argv)
    docs.check_flags(p, args)
    cmdline = docs.command("bench.trees", sys.argv[1:] if argv is None else argv)
    if args.smoke:
        args.files, args.big_mib, args.repeats = 20, 1, 1
    if args.files < 1 or args.big_mib < 1 or args.repeats < 1:
        p.error("--files, --big-mib and --repeats must be at least 1")
    load0 = docs.settle() if args.write_docs else docs.load1()
    with tempfile.TemporaryDirectory(prefix="bench-trees-") as tmp:
        res = measure(Path(tmp), args.files, args.big_mib, args.repeats)
    load_end = docs.settle() if args.write_docs else docs.load1()
    section = render(res, cmdline, args.repeats, (load0, load_end))
    print(section)
    if args.write_docs:
        refusal = docs.docs_refusal(load0, load_end)
        if refusal:
            print(f"bench.trees: {refusal}", file=sys.stderr)
            return 1
        print(f"wrote {docs.write_section(section)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
