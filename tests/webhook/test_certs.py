"""Certificates: chain validity, renewal decisions, and the rotation order against a recording
fake of the two Kubernetes APIs (the test bed test runs the same code against a real one)."""

from __future__ import annotations

import base64
import datetime
from types import SimpleNamespace

from cryptography import x509
from kubernetes.client.rest import ApiException

from webhook import certs


def test_serving_certificate_chains_to_its_ca_with_the_names():
    ca, ca_key = certs.new_ca()
    cert, _ = certs.new_serving(ca, ca_key, ["svc.ns.svc"], ["127.0.0.1"])
    leaf = x509.load_pem_x509_certificate(cert)
    assert certs.signed_by(leaf, certs.split_bundle(ca)[0])
    assert not certs.signed_by(leaf, certs.split_bundle(certs.new_ca()[0])[0])
    assert certs._sans(leaf) == ({"svc.ns.svc"}, {"127.0.0.1"})
    assert not certs.needs_renewal(leaf)
    late = leaf.not_valid_after_utc - datetime.timedelta(days=1)
    assert certs.needs_renewal(leaf, late)


def test_self_signed_dir_is_reused_until_names_change(tmp_path):
    d = str(tmp_path)
    certs.self_signed_dir(d, ["localhost"], ["127.0.0.1"])
    first = (tmp_path / "tls.crt").read_bytes()
    certs.self_signed_dir(d, ["localhost"], ["127.0.0.1"])
    assert (tmp_path / "tls.crt").read_bytes() == first
    certs.self_signed_dir(d, ["localhost", "other"], ["127.0.0.1"])
    assert (tmp_path / "tls.crt").read_bytes() != first


class FakeCore:
    def __init__(self, events):
        self.secrets, self.events = {}, events

    def read_namespaced_secret(self, name, namespace):
        if name not in self.secrets:
            raise ApiException(status=404)
        return SimpleNamespace(data=self.secrets[name]["data"])

    def replace_namespaced_secret(self, name, namespace, body):
        if name not in self.secrets:
            raise ApiException(status=404)
        self.secrets[name] = body
        self.events.append(("secret", name, body))

    def create_namespaced_secret(self, namespace, body):
        self.secrets[body["metadata"]["name"]] = body
        self.events.append(("secret", body["metadata"]["name"], body))


class FakeAdmission:
    def __init__(self, events):
        self.events = events
        self.objs = {kind: SimpleNamespace(
            metadata=SimpleNamespace(resource_version="1"),
            webhooks=[SimpleNamespace(client_config=SimpleNamespace(ca_bundle=None))
                      for _ in range(n)]) for kind, n in (("m", 1), ("v", 2))}

    def _patch(self, kind, ops):
        obj = self.objs[kind]
        assert ops[0] == {"op": "test", "path": "/metadata/resourceVersion",
                          "value": obj.metadata.resource_version}
        for op in ops[1:]:
            i = int(op["path"].split("/")[2])
            obj.webhooks[i].client_config.ca_bundle = op["value"]
        obj.metadata.resource_version = str(int(obj.metadata.resource_version) + 1)
        self.events.append(("caBundle", kind, ops[1]["value"]))

    def read_mutating_webhook_configuration(self, name):
        return self.objs["m"]

    def read_validating_webhook_configuration(self, name):
        return self.objs["v"]

    def patch_mutating_webhook_configuration(self, name, ops):
        self._patch("m", ops)

    def patch_validating_webhook_configuration(self, name, ops):
        self._patch("v", ops)


def _bundle(event) -> list[x509.Certificate]:
    if event[0] == "caBundle":
        return certs.split_bundle(base64.b64decode(event[2]))
    return certs.split_bundle(base64.b64decode(event[2]["data"]["ca.crt"]))


def test_rotation_order_new_ca_trusted_before_its_certificate_is_served():
    events: list = []
    core, adm = FakeCore(events), FakeAdmission(events)
    kw = dict(namespace="ns", secret="tls", dns_names=["svc.ns.svc"], mutating=["m"],
              validating=["v"], propagation_seconds=0)
    first = certs.ensure(core, adm, **kw)
    assert (first.ca_rotated, first.bundle_patched, first.leaf_issued) == (True, True, True)
    assert [e[:2] for e in events] == [("secret", "tls-ca"), ("caBundle", "m"),
                                       ("caBundle", "v"), ("secret", "tls")]
    old_ca = _bundle(events[0])[0]

    events.clear()
    same = certs.ensure(core, adm, **kw)
    assert (same.ca_rotated, same.bundle_patched, same.leaf_issued) == (False, False, False)
    assert events == []

    rotated = certs.ensure(core, adm, **kw, force_ca_rotation=True)
    kinds = [e[:2] for e in events]
    assert kinds == [("secret", "tls-ca"), ("caBundle", "m"), ("caBundle", "v"), ("secret", "tls")]
    new_ca = _bundle(events[0])[0]
    # New CA first, the old one kept, in the Secret and in both configurations, before the
    # serving certificate of the new CA is written.
    for event in events[:3]:
        assert [c.subject for c in _bundle(event)] == [new_ca.subject, old_ca.subject]
    leaf = x509.load_pem_x509_certificate(base64.b64decode(events[3][2]["data"]["tls.crt"]))
    assert certs.signed_by(leaf, new_ca) and not certs.signed_by(leaf, old_ca)
    assert rotated.bundle_pem == certs.join_bundle([new_ca, old_ca])
