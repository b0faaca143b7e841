"""Every golden chart render validates with kubeconform against the test bed's Kubernetes
version, strictly (no unknown field anywhere) and with a schema for every kind: the built-in
kinds from that version's OpenAPI (tools/kubeconform.py), the CRDs the chart renders
(cert-manager, prometheus-operator) from the schemas vendored in testdata/schemas
(tools/kubeschemas.py). No helm and no cluster: the golden files are what test_chart.py keeps
equal to `helm template`."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from testbed import build, versions
from tools import kubeconform as kc
from tools import kubeschemas

TESTDATA = Path(__file__).parent / "testdata"
GOLDENS = sorted(TESTDATA.glob("*.golden.yaml"))
CRDS = TESTDATA / "schemas"


@pytest.fixture(scope="module")
def kubeconform() -> list[str]:
    try:
        binary, core = kc.ensure()
    except build.BuildError as e:
        pytest.fail(f"cannot install kubeconform: {e}", pytrace=False)
    return [str(binary), "-strict", "-output", "json",
            "-kubernetes-version", versions.KUBERNETES.lstrip("v"),
            "-schema-location",
            f"{core}/{{{{ .NormalizedKubernetesVersion }}}}-standalone{{{{ .StrictSuffix }}}}/"
            "{{ .ResourceKind }}{{ .KindSuffix }}.json",
            "-schema-location",
            f"{CRDS}/{{{{ .Group }}}}/{{{{ .ResourceKind }}}}_{{{{ .ResourceAPIVersion }}}}.json"]


def run(cmd: list[str], *files: Path) -> tuple[int, list[dict]]:
    """kubeconform's exit code and one result per resource (-verbose lists valid ones too)."""
    res = subprocess.run([*cmd, "-verbose", *map(str, files)], capture_output=True, text=True,
                         timeout=120)
    assert res.stdout, res.stderr
    return res.returncode, json.loads(res.stdout)["resources"]


@pytest.mark.parametrize("golden", GOLDENS, ids=[g.name.split(".")[0] for g in GOLDENS])
def test_golden_render_is_valid(kubeconform, golden):
    rc, resources = run(kubeconform, golden)
    bad = [f"{r['kind']} {r['name']}: {r['status']} {r.get('msg', '')}" for r in resources
           if r["status"] != "statusValid"]
    assert rc == 0 and not bad, "\n".join(bad)
    # Each object of the render was validated, none skipped or lost.
    assert len(resources) == len([d for d in yaml.safe_load_all(golden.read_text()) if d])


def test_every_chart_render_is_checked():
    values = sorted(p.stem for p in (TESTDATA / "values").glob("*.yaml"))
    assert [g.name.split(".")[0] for g in GOLDENS] == sorted(["default", *values])


BAD = """\
apiVersion: apps/v1
kind: Deployment
metadata: {name: unknown-field}
spec:
  selector: {matchLabels: {a: b}}
  template:
    metadata: {labels: {a: b}}
    spec:
      containers:
        - name: c
          image: x
          resources: {limits: {cpu: 1, memory: 64Mi}}
          livenessProbe: {httpGet: {port: http, path: /}}
          imagePullPolicy: IfNotPresent
          securityContext: {runAsNonRoot: true}
          env: [{name: A, value: b}]
          envv: []
---
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata: {name: crd-unknown-field}
spec:
  groups: [{name: g, rules: [{alert: A, expr: up, fro: 5m}]}]
---
apiVersion: v1
kind: ConfigMap
metadata: {name: wrong-type}
data: {a: 1}
---
apiVersion: cert-manager.io/v1
kind: Certificate
metadata: {name: missing-required}
spec: {dnsNames: [a.example]}
---
apiVersion: example.com/v1
kind: Unknown
metadata: {name: no-schema}
---
apiVersion: v1
kind: Service
metadata: {name: valid}
spec:
  ports: [{port: 443, targetPort: https}]
"""


def test_refuses_what_the_api_server_would(kubeconform, tmp_path):
    """The check can fail: unknown fields (built-in and CRD), a wrong type, a missing required
    field and a kind without a schema are each reported; int-or-string ports and numeric
    quantities pass, as the API server takes them."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD)
    rc, resources = run(kubeconform, bad)
    status = {r["name"]: r["status"] for r in resources}
    assert rc == 1
    assert status == {"unknown-field": "statusInvalid", "crd-unknown-field": "statusInvalid",
                      "wrong-type": "statusInvalid", "missing-required": "statusInvalid",
                      "no-schema": "statusError", "valid": "statusValid"}, resources
    msgs = {r["name"]: r.get("msg", "") for r in resources}
    assert "'envv' not allowed" in msgs["unknown-field"]
    assert "'fro' not allowed" in msgs["crd-unknown-field"]
    assert "could not find schema for Unknown" in msgs["no-schema"]


def test_vendored_crd_schemas_match_their_sources(tmp_path):
    """testdata/schemas is what tools/kubeschemas.py makes of the pinned CRDs (read through
    the Go module cache; downloaded from the Go module proxy when absent)."""
    try:
        kubeschemas.write_crds(tmp_path)
    except kubeschemas.SchemaError as e:
        pytest.fail(str(e), pytrace=False)
    want = {p.relative_to(tmp_path): p.read_text() for p in tmp_path.rglob("*") if p.is_file()}
    have = {p.relative_to(CRDS): p.read_text() for p in CRDS.rglob("*") if p.is_file()}
    assert have == want, "stale: run .venv/bin/python tools/kubeschemas.py crds"


def test_conversion_is_strict_where_kubernetes_is():
    got = kubeschemas.convert({
        "type": "object", "description": "dropped",
        "properties": {
            # A property may be called like a keyword: kept.
            "description": {"type": "string", "description": "dropped"},
            "port": {"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}]},
            "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                     "properties": {"a": {"type": "string"}}},
            "maybe": {"type": "string", "nullable": True},
            "map": {"type": "object", "additionalProperties": {"type": "string"}},
        }})
    assert got == {
        "type": "object", "additionalProperties": False,
        "properties": {
            "description": {"type": "string"},
            "port": {"oneOf": [{"type": "string"}, {"type": "integer"}]},
            "free": {"type": "object", "properties": {"a": {"type": "string"}}},
            "maybe": {"type": ["string", "null"]},
            "map": {"type": "object", "additionalProperties": {"type": "string"}},
        }}
