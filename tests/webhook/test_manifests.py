"""The webhook configuration objects: the fields that keep the blast radius small."""

from __future__ import annotations

import base64
import json
import subprocess
import sys

from sandman.contract import LABEL_EGRESS, LABEL_SANDBOX
from tests.webhook.conftest import ROOT
from webhook.manifests import configurations


def test_configurations_fields():
    m, v = configurations("sm", "sandman-system", b"PEM", service=("sandman-system", "wh", 443))
    hooks = m["webhooks"] + v["webhooks"]
    assert [h["name"] for h in hooks] == ["mutate.sandman.dev", "validate.sandman.dev",
                                          "validate-egress.sandman.dev"]
    for h in hooks:
        assert h["failurePolicy"] == "Fail"
        assert h["timeoutSeconds"] == 5
        assert h["sideEffects"] == "None"
        assert h["admissionReviewVersions"] == ["v1"]
        assert h["clientConfig"]["caBundle"] == base64.b64encode(b"PEM").decode()
        assert h["clientConfig"]["service"]["namespace"] == "sandman-system"
        ns = h["namespaceSelector"]["matchExpressions"]
        assert ns == [{"key": "kubernetes.io/metadata.name", "operator": "NotIn",
                       "values": ["kube-system", "sandman-system"]}]
    # kubectl debug's UPDATE of pods/ephemeralcontainers is validated too (issue 13).
    assert m["webhooks"][0]["rules"][0]["resources"] == ["pods"]
    for h in v["webhooks"]:
        assert h["rules"][0]["resources"] == ["pods", "pods/ephemeralcontainers"]
    assert m["webhooks"][0]["reinvocationPolicy"] == "IfNeeded"
    assert m["webhooks"][0]["rules"][0]["operations"] == ["CREATE"]
    assert m["webhooks"][0]["clientConfig"]["service"]["path"] == "/mutate"
    assert v["webhooks"][0]["objectSelector"] == {"matchExpressions": [
        {"key": LABEL_SANDBOX, "operator": "In", "values": ["true"]}]}
    # Dropping the sandbox label while keeping the egress label still gets validated.
    assert v["webhooks"][1]["objectSelector"] == {"matchExpressions": [
        {"key": LABEL_EGRESS, "operator": "Exists"},
        {"key": LABEL_SANDBOX, "operator": "NotIn", "values": ["true"]}]}


def test_url_config_scoped_to_namespaces():
    m, _ = configurations("sm", "sandman-system", None, url="https://127.0.0.1:8443/",
                          only_namespaces=["t1"])
    hook = m["webhooks"][0]
    assert hook["clientConfig"] == {"url": "https://127.0.0.1:8443/mutate"}
    assert {"key": "kubernetes.io/metadata.name", "operator": "In",
            "values": ["t1"]} in hook["namespaceSelector"]["matchExpressions"]


def test_manifests_cli_prints_both(tmp_path):
    ca = tmp_path / "ca.crt"
    ca.write_bytes(b"PEM")
    out = subprocess.run([sys.executable, "-m", "webhook", "manifests", "--url",
                          "https://127.0.0.1:9443", "--ca-file", str(ca)], cwd=ROOT,
                         capture_output=True, check=True, timeout=60).stdout
    kinds = [i["kind"] for i in json.loads(out)["items"]]
    assert kinds == ["MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"]
