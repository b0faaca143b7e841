"""The chart's documentation is generated: README.md is what helm-docs renders from
values.yaml's `# --` comments, values.schema.json's descriptions are the same comments
(charts/gen_schema.py), and every key the schema declares is documented."""

from __future__ import annotations

import json
import re

import pytest

from charts import gen_schema
from testbed import build
from tests.charts.helm import CHART
from tools import helm_docs


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
