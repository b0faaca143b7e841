"""The chart's documentation is generated and true: README.md is what helm-docs renders from
values.yaml's `# --` comments, values.schema.json's descriptions are the same comments
(charts/gen_schema.py), every key the schema declares is documented, and Chart.yaml's Artifact
Hub metadata agrees with LICENSE, CHANGELOG.md and the default render."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from charts import gen_schema
from sandman import contract
from testbed import build
from tests.charts.helm import CHART, Helm, objects
from tools import helm_docs

ROOT = Path(__file__).resolve().parents[2]
CHART_YAML = yaml.safe_load((CHART / "Chart.yaml").read_text())
ANNOTATIONS = CHART_YAML["annotations"]


def test_readme_is_what_helm_docs_renders():
    try:
        want = helm_docs.render()
    except build.BuildError as e:
        pytest.fail(str(e), pytrace=False)
    assert (CHART / "README.md").read_text() == want, (
        "charts/sandman/README.md is stale: run make chart-docs")


def test_schema_descriptions_are_the_values_comments():
    assert gen_schema.SCHEMA.read_text() == gen_schema.render(), (
        "values.schema.json's descriptions are stale: run make chart-docs")


def _properties(node: dict, path: tuple[str, ...] = ()):
    for name, sub in node.get("properties", {}).items():
        yield path + (name,), sub
        yield from _properties(sub, path + (name,))


def test_every_declared_values_key_has_a_comment_a_type_and_a_description():
    docs = gen_schema.comments(gen_schema.VALUES.read_text())
    schema = json.loads(gen_schema.SCHEMA.read_text())
    declared = dict(_properties(schema))
    values_keys = [p for p in docs if p in declared]
    assert len(values_keys) > 150
    for path in values_keys:
        node = declared[path]
        assert docs[path], f"{'.'.join(path)}: no `# --` comment in values.yaml"
        assert node.get("description") == docs[path], ".".join(path)
        assert "type" in node or "enum" in node, f"{'.'.join(path)}: no type in the schema"
    # Every key of values.yaml is the schema's, or data below a free-form map of it.
    for path in docs:
        if path not in declared:
            parent = declared[path[:-1]]
            assert "properties" not in parent, f"{'.'.join(path)}: not in the schema"


def test_a_key_without_a_comment_fails_the_generator():
    values = gen_schema.VALUES.read_text().replace(
        "  # -- Log level of the webhook process.\n", "")
    with pytest.raises(gen_schema.SchemaError, match=r"webhook\.logLevel"):
        gen_schema.render(values_text=values)


def test_the_readme_and_the_schema_say_the_same():
    """helm-docs and gen_schema read the comments alike: each README row's description is the
    schema's for that key (keys with dots in their names are data rows and skipped)."""
    schema = json.loads(gen_schema.SCHEMA.read_text())
    declared = {".".join(p): n for p, n in _properties(schema)}
    rows = re.findall(r"^\| `([^`]+)` \| [^|]* \| .*? \| (.*) \|$",
                      (CHART / "README.md").read_text(), flags=re.M)
    assert len(rows) > 150
    checked = 0
    for key, description in rows:
        if '"' in key:
            continue
        assert key in declared, key
        assert declared[key].get("description") == description, key
        checked += 1
    assert checked == len([r for r in rows if '"' not in r[0]])


# ------------------------------------------------------------------------ Artifact Hub


def test_artifacthub_license_links_and_icon_are_the_repositorys():
    assert ANNOTATIONS["artifacthub.io/license"] == "Apache-2.0"
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]
    assert "Version 2.0" in (ROOT / "LICENSE").read_text()[:200]
    home = CHART_YAML["home"]
    blob = f"{home}/blob/main/"
    for link in yaml.safe_load(ANNOTATIONS["artifacthub.io/links"]):
        assert link["name"] and link["url"].startswith(home), link
        if link["url"].startswith(blob):
            assert (ROOT / link["url"].removeprefix(blob)).is_file(), link
    raw = home.replace("https://github.com/", "https://raw.githubusercontent.com/") + "/main/"
    assert CHART_YAML["icon"].startswith(raw)
    icon = ROOT / CHART_YAML["icon"].removeprefix(raw)
    assert icon.suffix == ".svg" and icon.stat().st_size < 4096
    assert ET.parse(icon).getroot().tag == "{http://www.w3.org/2000/svg}svg"


def test_artifacthub_images_are_what_the_default_render_runs(tmp_path):
    listed = {i["image"] for i in yaml.safe_load(ANNOTATIONS["artifacthub.io/images"])}
    objs = objects(Helm(tmp_path).template().stdout)
    images = set()
    for o in objs:
        spec = o.get("spec", {})
        pod = spec if o["kind"] == "Pod" else spec.get("template", {}).get("spec") or \
            spec.get("jobTemplate", {}).get("spec", {}).get("template", {}).get("spec")
        for c in (pod or {}).get("containers", []) + (pod or {}).get("initContainers", []):
            images.add(c["image"])
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert images == {contract.SANDMAN_IMAGE}
    assert listed == images | {values["test"]["sandboxImage"]}


def _changelog_section(version: str) -> list[dict]:
    """CHANGELOG.md's entries for `version` as Artifact Hub changes: each bullet of an
    Added/Changed/... subsection, or the section's paragraph as one `added` entry."""
    text = (ROOT / "CHANGELOG.md").read_text()
    m = re.search(rf"^## \[{re.escape(version)}\][^\n]*\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"CHANGELOG.md has no section for {version}"
    body = m.group(1)
    kinds = {"Added": "added", "Changed": "changed", "Deprecated": "deprecated",
             "Removed": "removed", "Fixed": "fixed", "Security": "security"}
    subsections = re.findall(r"^### (\w+)\n(.*?)(?=^### |\Z)", body, re.M | re.S)
    if not subsections:
        return [{"kind": "added", "description": " ".join(body.split())}]
    out = []
    for name, entries in subsections:
        for bullet in re.split(r"^- ", entries, flags=re.M)[1:]:
            out.append({"kind": kinds[name], "description": " ".join(bullet.split())})
    return out


def test_artifacthub_changes_are_the_changelogs_and_prerelease_the_versions():
    version = CHART_YAML["version"]
    got = yaml.safe_load(ANNOTATIONS["artifacthub.io/changes"])
    want = _changelog_section(version)
    assert got == want, ("artifacthub.io/changes differs from CHANGELOG.md's section "
                         f"[{version}]; write:\n{yaml.safe_dump(want, sort_keys=False)}")
    assert ANNOTATIONS["artifacthub.io/prerelease"] == str("-" in version).lower()
    assert ANNOTATIONS["artifacthub.io/containsSecurityUpdates"] == str(
        any(c["kind"] == "security" for c in want)).lower()
