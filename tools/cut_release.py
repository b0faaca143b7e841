"""Cut a version: step 1 of docs/releasing.md, done the same way every time.

    python3 tools/cut_release.py 0.2.0 [--date 2026-12-07]

- moves CHANGELOG.md's Unreleased entries under `## [VERSION] - DATE` (an empty Unreleased
  stays on top);
- puts VERSION wherever the last one is spelled as the current version: sandman/_version.py,
  execd's VERSION, the image sandman.contract names, the server's pin of the client, the
  chart's version, appVersion and image tag, the docs' and tests' examples of them (a word
  match: `0.1.0` in `10.1.0.0` is left alone); CHANGELOG.md's history and docs/releasing.md's
  example of a mismatch are left alone;
- writes the chart's Artifact Hub annotations from the new CHANGELOG section (its changes,
  and containsSecurityUpdates when it has a Security part), as
  tests/charts/test_chart_readme.py checks them.

Then regenerate what is derived and commit: `make lock chart-golden chart-docs`. The release
itself is `make release` from that commit (docs/releasing.md), and the tag `vVERSION` on it.
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
SEMVER = re.compile(r"(\d+)\.(\d+)\.(\d+)(?:-[0-9A-Za-z.-]+)?")
# Where the current version is spelled as such (globs from the repository root).
FILES = ("sandman/_version.py", "execd/execd_daemon/base.py", "sandman/contract.py",
         "pyproject.toml", "images/Dockerfile", "images/README.md", "charts/sandman/Chart.yaml",
         "charts/sandman/values.yaml", "docs/*.md", "tests/charts/test_chart.py",
         "tests/charts/testdata/values/*.yaml", "tests/webhook/testdata/*.json")
KEEP = {"docs/releasing.md"}  # its mismatch example names two versions on purpose
KINDS = {"Added": "added", "Changed": "changed", "Deprecated": "deprecated",
         "Removed": "removed", "Fixed": "fixed", "Security": "security"}


def current() -> str:
    m = re.search(r'__version__ = "([^"]+)"', (ROOT / "sandman/_version.py").read_text())
    if not m:
        raise SystemExit("cut_release: no __version__ in sandman/_version.py")
    return m.group(1)


def _key(v: str) -> tuple[int, ...]:
    m = SEMVER.fullmatch(v)
    assert m
    return tuple(int(x) for x in m.groups())


def cut_changelog(text: str, version: str, date: str) -> str:
    head = "## [Unreleased]\n"
    if head not in text:
        raise SystemExit("cut_release: CHANGELOG.md has no `## [Unreleased]` section")
    if f"## [{version}]" in text:
        raise SystemExit(f"cut_release: CHANGELOG.md already has a section for {version}")
    i = text.index(head) + len(head)
    j = text.find("\n## [", i)
    if not text[i:j].strip():
        raise SystemExit("cut_release: the Unreleased section is empty: nothing to release")
    return text[:i] + f"\n## [{version}] - {date}\n" + text[i:]


def changes(changelog: str, version: str) -> list[dict]:
    """The section's entries as Artifact Hub changes (one per bullet of each subsection)."""
    m = re.search(rf"^## \[{re.escape(version)}\][^\n]*\n(.*?)(?=^## |\Z)", changelog,
                  re.M | re.S)
    assert m
    out = []
    for name, entries in re.findall(r"^### (\w+)\n(.*?)(?=^### |\Z)", m.group(1), re.M | re.S):
        for bullet in re.split(r"^- ", entries, flags=re.M)[1:]:
            out.append({"kind": KINDS[name], "description": " ".join(bullet.split())})
    return out


def bump(text: str, old: str, new: str) -> str:
    return re.sub(rf"(?<![\w.]){re.escape(old)}(?![\w.])", new, text)


def annotate(chart_yaml: str, entries: list[dict]) -> str:
    """Chart.yaml with its changes and containsSecurityUpdates rewritten (the rest as is)."""
    block = yaml.safe_dump(entries, sort_keys=False, width=10**6, allow_unicode=True)
    body = "".join(f"    {ln}\n" for ln in block.splitlines())
    out = re.sub(r"(  artifacthub\.io/changes: \|\n)(?:    .*\n)+",
                 lambda m: m.group(1) + body, chart_yaml)
    security = str(any(e["kind"] == "security" for e in entries)).lower()
    return re.sub(r'(artifacthub\.io/containsSecurityUpdates: )"\w+"', rf'\1"{security}"', out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tools/cut_release.py", description=__doc__.split("\n")[0])
    ap.add_argument("version")
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    a = ap.parse_args(argv)
    old, new = current(), a.version
    if not SEMVER.fullmatch(new):
        raise SystemExit(f"cut_release: {new!r} is not a semantic version (MAJOR.MINOR.PATCH)")
    if _key(new) <= _key(old):
        raise SystemExit(f"cut_release: {new} is not after the current {old}")
    log = ROOT / "CHANGELOG.md"
    text = cut_changelog(log.read_text(), new, a.date)
    log.write_text(text)
    touched = ["CHANGELOG.md"]
    for pattern in FILES:
        for path in sorted(ROOT.glob(pattern)):
            rel = path.relative_to(ROOT).as_posix()
            if rel in KEEP:
                continue
            before = path.read_text()
            after = bump(before, old, new)
            if rel == "charts/sandman/Chart.yaml":
                after = annotate(after, changes(text, new))
            if after != before:
                path.write_text(after)
                touched.append(rel)
    print(f"cut {new} (was {old}): {len(touched)} files")
    for t in touched:
        print(f"  {t}")
    print(f"next: make lock chart-golden chart-docs, then commit; tag v{new} on that commit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
