"""JSON schemas for kubeconform (tests/charts/test_kubeconform.py), in its file layout.

    .venv/bin/python tools/kubeschemas.py crds   # rewrite the vendored CRD schemas (commit them)
    .venv/bin/python tools/kubeschemas.py core DIR  # the built-in kinds into DIR (make deps)

Sources, every one a Go module zip from the Go module proxy (`go mod download`, so Go checks
each against the checksum database), at the versions pinned here:

- built-in kinds: k8s.io/kubernetes at testbed/versions.py's KUBERNETES (the test bed's API
  server), its api/openapi-spec/swagger.json. Generated into the test-bed cache, not vendored
  (about 190 kinds); `tools/kubeconform.py` does it on `make deps` and on the first test.
- CRDs the chart renders: cert-manager's deploy/crds (Certificate, Issuer) and
  prometheus-operator's example/prometheus-operator-crd (ServiceMonitor, PrometheusRule).
  Vendored under tests/charts/testdata/schemas/ (a test reads them without any network).

The conversion is what openapi2jsonschema's `--kubernetes --strict --stand-alone` produces for
kubeconform's default registry: every object schema with `properties` refuses other keys
(`additionalProperties: false`) unless it preserves unknown fields, int-or-string fields take
either, Quantity takes a string or a number (the API server accepts both), `nullable` adds
"null", and `apiVersion`/`kind` are pinned to the file's own. A file is standalone: the
definitions a kind references travel in its own `definitions` (references stay references, so
recursive types such as JSONSchemaProps need no cut-off). Descriptions are dropped (they are
most of the bytes and no validation reads them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CRD_DIR = ROOT / "tests" / "charts" / "testdata" / "schemas"

# module -> (version, {path in the module: kinds taken from it}). The versions the chart is
# written against (docs/operations.md): cert-manager v1 and prometheus-operator's v1 types.
CRD_SOURCES: dict[str, tuple[str, dict[str, set[str]]]] = {
    "github.com/cert-manager/cert-manager": ("v1.21.2", {
        "deploy/crds/cert-manager.io_certificates.yaml": {"Certificate"},
        "deploy/crds/cert-manager.io_issuers.yaml": {"Issuer"},
    }),
    "github.com/prometheus-operator/prometheus-operator": ("v0.85.0", {
        "example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml":
            {"ServiceMonitor"},
        "example/prometheus-operator-crd/monitoring.coreos.com_prometheusrules.yaml":
            {"PrometheusRule"},
    }),
}
SWAGGER = "api/openapi-spec/swagger.json"
DEFS_PREFIX = "#/definitions/"
QUANTITY = "io.k8s.apimachinery.pkg.api.resource.Quantity"
INT_OR_STRING = {"oneOf": [{"type": "string"}, {"type": "integer"}]}
# Keywords with one subschema / a list of them / a map of them; everything else is a keyword
# whose value is data (so a property named "description" is never mistaken for the keyword).
SUB = ("items", "additionalProperties", "not")
SUB_LIST = ("allOf", "anyOf", "oneOf")
SUB_MAP = ("properties", "patternProperties", "definitions")
DROP = ("description", "example", "externalDocs")


class SchemaError(RuntimeError):
    pass


def module_dir(module: str, version: str) -> Path:
    """The unpacked module from the Go module cache, downloaded through the proxy if absent."""
    with tempfile.TemporaryDirectory(prefix="sandman-kubeschemas-") as tmp:
        # `go mod download` of a module@version wants a main module around it.
        (Path(tmp) / "go.mod").write_text("module sandman.dev/kubeschemas\n\ngo 1.26\n")
        res = subprocess.run(["go", "mod", "download", "-json", f"{module}@{version}"],
                             cwd=tmp, capture_output=True, text=True, timeout=900,
                             env=dict(os.environ, GOFLAGS="-mod=mod"))
    try:
        info = json.loads(res.stdout)
    except json.JSONDecodeError:
        info = {}
    if res.returncode != 0 or "Dir" not in info:
        raise SchemaError(f"go mod download {module}@{version} failed: "
                          f"{info.get('Error') or res.stderr.strip()}")
    return Path(info["Dir"])


def convert(schema: Any) -> Any:
    """One OpenAPI schema (v2 definition or CRD openAPIV3Schema) as a strict JSON schema."""
    if not isinstance(schema, dict):
        return schema
    if schema.get("format") == "int-or-string" or schema.get("x-kubernetes-int-or-string"):
        out: dict[str, Any] = dict(INT_OR_STRING)
    else:
        out = {}
        for key, value in schema.items():
            if key in DROP or key.startswith("x-") or key == "nullable":
                continue
            if key in SUB:
                out[key] = convert(value)
            elif key in SUB_LIST:
                out[key] = [convert(v) for v in value]
            elif key in SUB_MAP:
                out[key] = {k: convert(v) for k, v in value.items()}
            else:
                out[key] = value
        if ("properties" in out and "additionalProperties" not in out
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
    if schema.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


def _pin(schema: dict[str, Any], api_version: str, kind: str) -> dict[str, Any]:
    props = schema.get("properties", {})
    for name, value in (("apiVersion", api_version), ("kind", kind)):
        if name in props:
            props[name] = {"type": "string", "enum": [value]}
    return schema


def kind_suffix(group: str, version: str) -> str:
    """kubeconform's {{ .KindSuffix }}: the group's first label and the version."""
    return f"-{group.split('.')[0]}-{version}" if group else f"-{version}"


def _refs(schema: Any) -> Iterator[str]:
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith(DEFS_PREFIX):
            yield ref[len(DEFS_PREFIX):]
        for value in schema.values():
            yield from _refs(value)
    elif isinstance(schema, list):
        for value in schema:
            yield from _refs(value)


def core_schemas(swagger: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """file name -> schema for every kind in a Kubernetes swagger.json."""
    defs = {name: convert(d) for name, d in swagger["definitions"].items()}
    defs[QUANTITY] = {"oneOf": [{"type": "string"}, {"type": "number"}]}
    out: dict[str, dict[str, Any]] = {}
    for name, raw in swagger["definitions"].items():
        for gvk in raw.get("x-kubernetes-group-version-kind", []):
            group, version, kind = gvk["group"], gvk["version"], gvk["kind"]
            api_version = f"{group}/{version}" if group else version
            root = _pin(json.loads(json.dumps(defs[name])), api_version, kind)
            needed: dict[str, Any] = {}
            todo = list(_refs(root))
            while todo:
                ref = todo.pop()
                if ref not in needed:
                    needed[ref] = defs[ref]
                    todo += _refs(defs[ref])
            if needed:
                root["definitions"] = dict(sorted(needed.items()))
            fname = f"{kind.lower()}{kind_suffix(group, version)}.json"
            if fname in out and out[fname] != root:
                raise SchemaError(f"{api_version} {kind}: {fname} is already another kind's")
            out[fname] = root
    return out


def crd_schemas(crd: dict[str, Any], kinds: set[str]) -> dict[str, dict[str, Any]]:
    """'<group>/<kind>_<version>.json' -> schema for every served version of a CRD."""
    spec = crd["spec"]
    group, kind = spec["group"], spec["names"]["kind"]
    if kind not in kinds:
        return {}
    out = {}
    for v in spec["versions"]:
        if not v.get("served", True):
            continue
        schema = convert(v["schema"]["openAPIV3Schema"])
        out[f"{group}/{kind.lower()}_{v['name']}.json"] = _pin(schema, f"{group}/{v['name']}",
                                                               kind)
    return out


def write(schemas: dict[str, dict[str, Any]], dest: Path) -> None:
    for name, schema in schemas.items():
        path = dest / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")


def write_core(kubernetes_version: str, dest: Path) -> int:
    src = module_dir("k8s.io/kubernetes", kubernetes_version) / SWAGGER
    schemas = core_schemas(json.loads(src.read_text()))
    write(schemas, dest)
    return len(schemas)


def write_crds(dest: Path = CRD_DIR) -> list[str]:
    import yaml  # the dev venv's; `core` stays stdlib-only

    written, found = [], set()
    for module, (version, files) in CRD_SOURCES.items():
        root = module_dir(module, version)
        for rel, kinds in files.items():
            for doc in yaml.safe_load_all((root / rel).read_text()):
                if doc and doc.get("kind") == "CustomResourceDefinition":
                    schemas = crd_schemas(doc, kinds)
                    if schemas:
                        found.add(doc["spec"]["names"]["kind"])
                    write(schemas, dest)
                    written += [f"{n} ({module}@{version} {rel})" for n in schemas]
    missing = {k for _, files in CRD_SOURCES.values() for ks in files.values() for k in ks}
    if missing - found:
        raise SchemaError(f"no CRD for {sorted(missing - found)} in the pinned sources")
    (dest / "SOURCES").write_text(
        "# Written by tools/kubeschemas.py crds: do not edit.\n"
        + "".join(f"{w}\n" for w in sorted(written)))
    return written


def main(argv: list[str]) -> int:
    try:
        if argv[:1] == ["crds"]:
            for w in write_crds():
                print(w)
            return 0
        if argv[:1] == ["core"] and len(argv) == 3:
            n = write_core(argv[1], Path(argv[2]))
            print(f"{n} schemas of Kubernetes {argv[1]} in {argv[2]}")
            return 0
    except SchemaError as e:
        print(f"kubeschemas: {e}", file=sys.stderr)
        return 1
    print(__doc__.split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
