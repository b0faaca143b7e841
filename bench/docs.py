"""The one writer of docs/benchmarks.md sections, and the flags every bench shares.

A section starts with its `## ` heading and runs to the next `## ` heading. `write_section`
replaces the section whose heading is the new text's first line, or appends it. Text of the
section below a `KEEP` line (earlier runs' notes, kept by hand) survives the rewrite.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "benchmarks.md"
KEEP = "<!-- earlier runs below: kept when the bench rewrites this section -->"
# docs/benchmarks.md takes figures from a quiet machine only: the 1-minute load at the start and
# at the end of a run must be at most this. A bench reads the end once what it started has
# stopped and its own load has had up to SETTLE_S to decay (the 1-minute average falls by half
# in ~42 s).
LOAD_MAX = 1.5
SETTLE_S = 180.0


def load1() -> float:
    return os.getloadavg()[0]


def settle(limit: float = LOAD_MAX, wait_s: float = SETTLE_S) -> float:
    """The 1-minute load once it is at most `limit`, or after `wait_s` (bounded; 5 s steps)."""
    deadline = time.monotonic() + wait_s
    while load1() > limit and time.monotonic() < deadline:
        time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))
    return load1()


def docs_refusal(load_start: float, load_end: float, limit: float = LOAD_MAX) -> str | None:
    """Why the run's figures may not go to docs/benchmarks.md (None: they may)."""
    busy = [f"{what} {v:.2f}" for what, v in (("start", load_start), ("end", load_end))
            if v > limit]
    if busy:
        return (f"the machine was not quiet (1-minute load above {limit} at the " +
                " and ".join(busy) + "): docs/benchmarks.md not written")
    return None


def write_section(section: str, path: Path | None = None) -> Path:
    """Replace (or append) the section of docs/benchmarks.md headed by `section`'s first line;
    every other section stays byte for byte."""
    path = path or DOCS
    heading = section.split("\n", 1)[0]
    if not heading.startswith("## "):
        raise ValueError(f"a section starts with its `## ` heading, not {heading[:80]!r}")
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if not text.startswith("# Benchmarks"):
        text = "# Benchmarks\n\n" + text
    section = section.rstrip("\n") + "\n\n"  # a blank line before the next heading
    m = re.search(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", text, flags=re.S | re.M)
    if m:
        old = m.group(0)
        kept = old.find("\n" + KEEP + "\n")
        if kept >= 0 and KEEP not in section:
            section = section.rstrip("\n") + "\n\n" + old[kept + 1:]
        text = text[:m.start()] + section + text[m.end():]
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text.rstrip("\n") + "\n")
    return path


def add_flags(ap: argparse.ArgumentParser) -> None:
    """--write-docs and --smoke, the same for every bench."""
    ap.add_argument("--write-docs", action="store_true",
                    help="replace this bench's section of docs/benchmarks.md")
    ap.add_argument("--smoke", action="store_true",
                    help="the smallest configuration, to see the bench still runs; writes no docs")


def check_flags(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.smoke and args.write_docs:
        ap.error("--smoke writes no docs: drop --write-docs")


def command(module: str, argv: list[str]) -> str:
    """The command line a section names: `python -m bench.<name> <args>`."""
    return " ".join(["python -m " + module, *(shlex.quote(a) for a in argv)])
