"""A trainer pod as docs/sdk.md sets one up against the default install: what an admin does
for a trainer namespace (label it for the controller's NetworkPolicy, bind the chart's user
ClusterRole, copy the controller's CA bundle) and what the pod carries (the trainer label, a
projected ServiceAccount token for the controller's audience, the CA, the SDK's environment).
Shared by the real-node tests (tests/e2e) and the real-node bench (bench/realnode.py).
"""

from __future__ import annotations

from kubernetes import client

TRAINER_LABEL = "sandman.dev/trainer"
# The namespace label the chart's networkPolicy.controllerCallers admits by default.
TRAINERS_NAMESPACE_LABEL = "sandman.dev/trainers"
# A trainer's identity for the controller (docs/sdk.md, "Before you start"): a projected token
# for the controller's audience, read by the SDK from $SANDMAN_TOKEN_FILE.
SDK_TOKEN_DIR = "/var/run/secrets/sandman"
SDK_TOKEN_VOLUME = {"name": "sandman-token", "projected": {"sources": [{"serviceAccountToken": {
    "audience": "sandman", "expirationSeconds": 3600, "path": "token"}}]}}
SDK_TOKEN_MOUNT = {"name": "sandman-token", "mountPath": SDK_TOKEN_DIR, "readOnly": True}
# The controller's CA bundle, copied by the admin into the trainer's namespace as ConfigMap
# `sandman-ca` (copy_ca; docs/install.md, "Trainers: the CA"), read from $SANDMAN_CA_FILE.
SDK_CA = "sandman-ca"
SDK_CA_DIR = "/etc/sandman/ca"
SDK_CA_VOLUME = {"name": SDK_CA, "configMap": {"name": SDK_CA}}
SDK_CA_MOUNT = {"name": SDK_CA, "mountPath": SDK_CA_DIR, "readOnly": True}


def sdk_env(controller: str) -> list[dict]:
    return [{"name": "SANDMAN_URL", "value": controller},
            {"name": "SANDMAN_TOKEN_FILE", "value": f"{SDK_TOKEN_DIR}/token"},
            {"name": "SANDMAN_CA_FILE", "value": f"{SDK_CA_DIR}/ca.crt"}]


def copy_ca(api_client, inst, ns: str) -> None:
    """The admin's copy of the controller's CA bundle into a trainer namespace (a ConfigMap
    cannot be mounted across namespaces): ConfigMap `sandman-ca`, key ca.crt."""
    core = client.CoreV1Api(api_client)
    body = {"metadata": {"name": SDK_CA}, "data": {"ca.crt": inst.ca_bundle()}}
    try:
        core.create_namespaced_config_map(ns, body)
    except client.ApiException as e:
        if e.status != 409:
            raise
        core.replace_namespaced_config_map(SDK_CA, ns, body)


def bind_trainer(api_client, ns: str, sa: str = "default", role: str = "sandman-user") -> None:
    """An admin's two steps for a trainer namespace: label it for the controller's
    NetworkPolicy (networkPolicy.controllerCallers' default namespaceSelector) and bind the
    chart's user ClusterRole to `sa` in `ns`, its tenant (409: already bound)."""
    client.CoreV1Api(api_client).patch_namespace(
        ns, {"metadata": {"labels": {TRAINERS_NAMESPACE_LABEL: "true"}}})
    try:
        client.RbacAuthorizationV1Api(api_client).create_namespaced_role_binding(ns, {
            "metadata": {"name": f"{role}-{sa}"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": role},
            "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns}]})
    except client.ApiException as e:
        if e.status != 409:
            raise


def prepare_namespace(api_client, inst, ns: str) -> None:
    """Everything an admin does for a trainer namespace: bind_trainer + copy_ca."""
    bind_trainer(api_client, ns)
    copy_ca(api_client, inst, ns)


def trainer_container(name: str, image: str, command: list[str], controller: str,
                      env: list[dict] | None = None, resources: dict | None = None) -> dict:
    """A container with the SDK's environment, token and CA mounted: `Client()` takes no
    arguments in it. The pod needs `trainer_volumes()` and the TRAINER_LABEL."""
    return {"name": name, "image": image, "imagePullPolicy": "Never", "command": command,
            "env": [*sdk_env(controller), *(env or [])],
            "volumeMounts": [SDK_TOKEN_MOUNT, SDK_CA_MOUNT],
            "resources": resources or {"limits": {"cpu": "200m", "memory": "192Mi"}}}


def trainer_volumes() -> list[dict]:
    return [SDK_TOKEN_VOLUME, SDK_CA_VOLUME]
