"""Fill values.schema.json's `description`s from the `# --` comments of values.yaml.

A values key's documentation is written once, in values.yaml, in helm-docs' style:

    # -- Why the default is what it is,
    # continued on following comment lines.
    key: value

helm-docs renders those comments into charts/sandman/README.md (tools/helm_docs.py) and this
file writes them into the schema, so `helm install`'s editor integrations and the README say
the same. The schema's types and bounds stay hand-written; this writes `description` only, on
every property reached through `properties` from the root: the comment's text where values.yaml
has the key, nothing where it has not. Every key of values.yaml that the schema declares must
carry a `# --` comment (keys below a free-form map, such as labels or selectors' matchLabels,
are data, not the chart's keys). tests/charts/test_chart_readme.py fails when the schema is stale;
regenerate with `.venv/bin/python charts/gen_schema.py` (or `make chart-docs`).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VALUES = ROOT / "charts" / "sandman" / "values.yaml"
SCHEMA = ROOT / "charts" / "sandman" / "values.schema.json"

# helm-docs' own patterns (pkg/helm/chart_info.go): a description starts at `# --`; `# @...`
# lines annotate it (default, section, notation type) and are not part of its text.
_START = re.compile(r"^\s*# --\s?(.*)$")
_ANNOTATION = re.compile(r"^\s*# @(default|section|notationType|raw)\b")
_CONTINUED = re.compile(r"^\s*#\s?(.*)$")
_KEY = re.compile(r"^(?P<indent> *)(?P<key>[^\s#'\"\-{\[][^:#]*?|\"[^\"]+\"|'[^']+'):(\s|$)")


class SchemaError(Exception):
    pass


def _description(comments: list[str]) -> str | None:
    """The text of the last `# --` group of a key's head comment (as helm-docs reads it)."""
    starts = [i for i, line in enumerate(comments) if _START.match(line)]
    if not starts:
        return None
    group = comments[starts[-1]:]
    words = [_START.match(group[0]).group(1).strip()]
    for line in group[1:]:
        if _ANNOTATION.match(line):
            continue
        words.append(_CONTINUED.match(line).group(1).strip())
    return " ".join(w for w in words if w)


def comments(text: str) -> dict[tuple[str, ...], str | None]:
    """Path of every block-mapping key of values.yaml (outside lists) -> its `# --` text, or
    None when it has none. A blank line ends a comment block, as it does for helm-docs (the
    YAML parser then attaches the block to no key)."""
    out: dict[tuple[str, ...], str | None] = {}
    stack: list[tuple[int, str]] = []  # (indent, key) of the open mappings
    pending: list[str] = []
    in_list: int | None = None  # indent of the `- ` that opened a list item being skipped
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped:
            pending = []
            continue
        indent = len(line) - len(line.lstrip(" "))
        if stripped.startswith("#"):
            pending.append(line)
            continue
        if in_list is not None and indent > in_list:
            continue
        in_list = None
        if stripped.startswith("- "):
            in_list = indent
            pending = []
            continue
        m = _KEY.match(line)
        if not m:
            raise SchemaError(f"values.yaml: cannot read {line!r}")
        key = m.group("key").strip("\"'")
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = tuple(k for _, k in stack) + (key,)
        out[path] = _description(pending)
        pending = []
        stack.append((indent, key))
    return out


def _declared(schema: dict, path: tuple[str, ...]) -> dict | None:
    node = schema
    for key in path:
        node = node.get("properties", {}).get(key)
        if node is None:
            return None
    return node


def render(values_text: str | None = None, schema_text: str | None = None) -> str:
    """The schema with every property's description from values.yaml."""
    docs = comments(values_text if values_text is not None else VALUES.read_text())
    schema = json.loads(schema_text if schema_text is not None else SCHEMA.read_text())
    undocumented = [".".join(p) for p, d in docs.items()
                    if d is None and _declared(schema, p) is not None]
    if undocumented:
        raise SchemaError("values.yaml keys without a `# --` comment: " + ", ".join(undocumented))

    def fill(node: dict, path: tuple[str, ...]) -> dict:
        out = {}
        if path:
            text = docs.get(path)
            if text:
                out["description"] = text
        for k, v in node.items():
            if k == "description":
                continue
            if k == "properties":
                v = {name: fill(sub, path + (name,)) for name, sub in v.items()}
            out[k] = v
        return out

    return json.dumps(fill(schema, ()), indent=2) + "\n"


if __name__ == "__main__":
    try:
        SCHEMA.write_text(render())
    except SchemaError as e:
        print(e, file=sys.stderr)
        sys.exit(1)
    print(SCHEMA)
