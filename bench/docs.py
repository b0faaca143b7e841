"""The one writer of docs/benchmarks.md sections, and the flags every bench shares.

A section starts with its `## ` heading and runs to the next `## ` heading. `write_section`
replaces the section whose heading is the new text's first line, or appends it. Text of the
section below a `KEEP` line (earlier runs' notes, kept by hand) survives the rewrite.
"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "benchmarks.md"
KEEP = "<!-- earlier runs below: kept when the bench rewrites this section -->"


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
