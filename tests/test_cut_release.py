"""tools/cut_release.py's pieces: the CHANGELOG cut, the version's word match, the chart's
Artifact Hub annotations (the full cut is checked by the tests of what it writes: the chart's
annotations against CHANGELOG.md, the versions equal across files, the locks current)."""

import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import cut_release as C  # noqa: E402

LOG = """# Changelog

## [Unreleased]

### Security
- a hole closed

### Added
- a thing
  on two lines

## [0.1.0]

The first version.
"""


def test_the_unreleased_entries_become_the_version_and_its_changes():
    out = C.cut_changelog(LOG, "0.2.0", "2026-12-07")
    assert out.startswith("# Changelog\n\n## [Unreleased]\n\n## [0.2.0] - 2026-12-07\n")
    assert "## [0.1.0]\n\nThe first version." in out
    assert C.changes(out, "0.2.0") == [{"kind": "security", "description": "a hole closed"},
                                       {"kind": "added", "description": "a thing on two lines"}]


@pytest.mark.parametrize("log, why", [
    (LOG.replace("## [Unreleased]\n", ""), "no `## [Unreleased]`"),
    (LOG.replace("## [0.1.0]", "## [0.2.0]"), "already has a section"),
    ("## [Unreleased]\n\n## [0.1.0]\n", "empty"),
])
def test_a_cut_that_cannot_be_made_says_why(log, why):
    with pytest.raises(SystemExit) as ei:
        C.cut_changelog(log, "0.2.0", "2026-12-07")
    assert why in str(ei.value)


def test_only_the_version_as_a_word_is_bumped():
    text = 'v = "0.1.0"; image: x:0.1.0-debug; cidr 10.1.0.0/16; 0.1.0.1; x0.1.0'
    assert C.bump(text, "0.1.0", "0.2.0") == \
        'v = "0.2.0"; image: x:0.2.0-debug; cidr 10.1.0.0/16; 0.1.0.1; x0.1.0'


def test_the_charts_annotations_follow_the_section():
    chart = ('annotations:\n  artifacthub.io/changes: |\n    - kind: added\n      description: '
             'old\n  artifacthub.io/containsSecurityUpdates: "false"\n  x: "y"\n')
    entries = [{"kind": "security", "description": "a: quoted # thing"}]
    out = yaml.safe_load(C.annotate(chart, entries))["annotations"]
    assert yaml.safe_load(out["artifacthub.io/changes"]) == entries
    assert out["artifacthub.io/containsSecurityUpdates"] == "true" and out["x"] == "y"
