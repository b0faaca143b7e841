"""The MutatingWebhookConfiguration and ValidatingWebhookConfiguration as dicts: the chart renders
the same objects, the tests apply them with the `kubernetes` client.

Blast radius is the design constraint (paper: one failing policy webhook rejected 6,126 creates
of other jobs): only pods carrying sandman's labels are sent here, never the webhook's own
namespace or kube-system, so `failurePolicy: Fail` can only refuse sandboxes. To recover from a
broken webhook, delete both configurations: admission webhooks are never called for
webhook-configuration objects, so the deletion cannot itself be blocked.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence

from sandman.contract import DOMAIN, LABEL_EGRESS, LABEL_SANDBOX, SANDBOX_TRUE

MUTATE_PATH = "/mutate"
VALIDATE_PATH = "/validate"
TIMEOUT_SECONDS = 5  # the handler takes ~1 ms; a pod create should not hang 10 s (the default)
NAMESPACE_LABEL = "kubernetes.io/metadata.name"  # set by the API server on every namespace


def client_config(path: str, ca_bundle: bytes | None, url: str | None = None,
                  service: tuple[str, str, int] | None = None) -> dict:
    """`url` is the base (https://host:port); `service` is (namespace, name, port)."""
    if (url is None) == (service is None):
        raise ValueError("give exactly one of url or service")
    cfg: dict = {}
    if url is not None:
        cfg["url"] = url.rstrip("/") + path
    else:
        assert service is not None, "a webhook is reached by url or by service"
        namespace, name, port = service
        cfg["service"] = {"namespace": namespace, "name": name, "port": port, "path": path}
    if ca_bundle:
        cfg["caBundle"] = base64.b64encode(ca_bundle).decode()
    return cfg


def namespace_selector(exclude: list[str], only: list[str] | None = None) -> dict:
    exprs = [{"key": NAMESPACE_LABEL, "operator": "NotIn", "values": sorted(set(exclude))}]
    if only:
        exprs.append({"key": NAMESPACE_LABEL, "operator": "In", "values": sorted(set(only))})
    return {"matchExpressions": exprs}


def _hook(name: str, path: str, operations: list[str], object_selector: dict, ns_selector: dict,
          ca_bundle: bytes | None, url: str | None, service, resources=("pods",)) -> dict:
    return {
        "name": name,
        "clientConfig": client_config(path, ca_bundle, url, service),
        "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": operations,
                   "resources": list(resources), "scope": "Namespaced"}],
        "objectSelector": object_selector,
        "namespaceSelector": ns_selector,
        # Fail: an unguarded "sandbox" is worse than a refused create; the selectors keep the
        # refusals to sandman's own pods.
        "failurePolicy": "Fail",
        "matchPolicy": "Equivalent",
        "sideEffects": "None",  # so dry-run requests are sent and answered like real ones
        "timeoutSeconds": TIMEOUT_SECONDS,
        "admissionReviewVersions": ["v1"],
    }


_SANDBOX = {"key": LABEL_SANDBOX, "operator": "In", "values": [SANDBOX_TRUE]}


def configurations(name: str, webhook_namespace: str, ca_bundle: bytes | None = None,
                   url: str | None = None, service: tuple[str, str, int] | None = None,
                   only_namespaces: list[str] | None = None,
                   extra_excluded_namespaces: Sequence[str] = ()) -> tuple[dict, dict]:
    """(mutating, validating) configuration objects named `name`.

    `only_namespaces` narrows them further (tests scope them to their own namespace)."""
    ns = namespace_selector([webhook_namespace, "kube-system", *extra_excluded_namespaces],
                            only_namespaces)
    mutate = _hook(f"mutate.{DOMAIN}", MUTATE_PATH, ["CREATE"],
                   {"matchExpressions": [_SANDBOX]}, ns, ca_bundle, url, service)
    # Re-run after later mutating webhooks changed the pod, so ours has the last word.
    mutate["reinvocationPolicy"] = "IfNeeded"
    # `kubectl debug` adds containers through pods/ephemeralcontainers (UPDATE of that
    # subresource, never of `pods`): without it a netadmin/sysadmin debug profile is unchecked.
    validated = ("pods", "pods/ephemeralcontainers")
    validate_sandbox = _hook(f"validate.{DOMAIN}", VALIDATE_PATH,
                             ["CREATE", "UPDATE"], {"matchExpressions": [_SANDBOX]}, ns,
                             ca_bundle, url, service, validated)
    # Egress label without the sandbox label: still validated, so a deny label never goes
    # unguarded (paper: 6 of 6 pods labelled egress-denied reached the internet).
    validate_egress = _hook(
        f"validate-egress.{DOMAIN}", VALIDATE_PATH, ["CREATE", "UPDATE"],
        {"matchExpressions": [{"key": LABEL_EGRESS, "operator": "Exists"},
                              {"key": LABEL_SANDBOX, "operator": "NotIn",
                               "values": [SANDBOX_TRUE]}]},
        ns, ca_bundle, url, service, validated)
    meta = {"name": name, "labels": {"app.kubernetes.io/name": "sandman-webhook"}}
    mutating = {"apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "MutatingWebhookConfiguration", "metadata": dict(meta),
                "webhooks": [mutate]}
    validating = {"apiVersion": "admissionregistration.k8s.io/v1",
                  "kind": "ValidatingWebhookConfiguration", "metadata": dict(meta),
                  "webhooks": [validate_sandbox, validate_egress]}
    return mutating, validating


class Registration:
    """Both configurations registered by `url:` with the CA, scoped to `namespaces` (a bed or a
    test, where the webhook runs outside the cluster). `create()` / `delete()` or a `with`
    block; a failed create removes what it made, and deleting what is gone is fine."""

    def __init__(self, admission_api, name: str, url: str, ca: bytes, namespaces: list[str],
                 webhook_namespace: str = "sandman-system"):
        self.api = admission_api
        self.name = name
        self.mutating, self.validating = configurations(
            name, webhook_namespace, ca, url=url, only_namespaces=namespaces)

    def create(self) -> Registration:
        try:
            self.api.create_mutating_webhook_configuration(self.mutating)
            self.api.create_validating_webhook_configuration(self.validating)
        except BaseException:
            self.delete()
            raise
        return self

    def delete(self) -> None:
        from kubernetes.client.rest import ApiException

        for delete in (self.api.delete_mutating_webhook_configuration,
                       self.api.delete_validating_webhook_configuration):
            try:
                delete(self.name)
            except ApiException as e:
                if e.status != 404:
                    raise

    def __enter__(self) -> Registration:
        return self.create()

    def __exit__(self, *exc) -> None:
        self.delete()
