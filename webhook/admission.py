"""AdmissionReview (admission.k8s.io/v1) in, AdmissionReview out. No I/O: the HTTP layer and the
golden tests both call these functions.

Dry-run requests (`request.dryRun`) take the same path as real ones: the webhook has no side
effects (`sideEffects: None`), so there is nothing to skip.
"""

from __future__ import annotations

import base64
import functools
import json
import secrets

import jsonpatch

from sandman.contract import ANNOTATION_TOKEN_SHA256, is_token_sha256
from sandman.podspec import (
    INPUT_LABELS,
    Refusal,
    SandboxError,
    SandboxPolicy,
    check_sandbox,
    check_update,
    injected_token_volumes,
    is_input_annotation,
    is_judged,
    is_sandbox,
    make_sandbox,
)

API_VERSION = "admission.k8s.io/v1"
# Results are cached by what they depend on (spec, INPUT_LABELS, INPUT_ANNOTATIONS): a burst of
# pods from one job differs only in names, nonces and tokens, and the diff is most of a call's
# cost (jsonpatch: ~0.35 of ~0.5 ms). Bounded: a few KiB per entry.
CACHE_ENTRIES = 256
# Bigger pods are answered without the cache: 256 entries of at most 32 KiB keys (and their
# patches) stay far below the webhook's memory limit whatever clients send (etcd admits objects
# up to 1.5 MiB; 256 of those would be the paper's OOM-killed webhook again).
CACHE_MAX_KEY_BYTES = 32 * 1024
_PLACEHOLDER_TOKEN = "0" * 64
# The service-account plugin names its token volume kube-api-access-<random> in every pod, so
# the essence of a pod carries a fixed placeholder instead. make_sandbox removes that volume and
# its mounts, so the patch never holds the name; it is swapped back all the same.
_PLACEHOLDER_VOLUME = f"kube-api-access-placeholder-{secrets.token_hex(6)}"


def _essence(pod: dict, drop_token: bool) -> str | None:
    """The inputs of make_sandbox/check_sandbox as one string; None if not JSON-able or too big
    to cache. `drop_token`: the token hash is replaced by a valid placeholder (make_sandbox never
    reads it; check_sandbox only checks its form)."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    wanted = {k: v for k, v in annotations.items() if is_input_annotation(k)
              and not (drop_token and k == ANNOTATION_TOKEN_SHA256)}
    try:
        essence = json.dumps([{k: labels[k] for k in INPUT_LABELS if k in labels},
                              dict(sorted(wanted.items())),
                              drop_token, "spec" in pod, pod.get("spec")], separators=(",", ":"))
    except (TypeError, ValueError):
        return None
    return essence if len(essence) <= CACHE_MAX_KEY_BYTES else None


def _pod_from(essence: str) -> dict:
    labels, annotations, drop_token, has_spec, spec = json.loads(essence)
    if drop_token:
        annotations[ANNOTATION_TOKEN_SHA256] = _PLACEHOLDER_TOKEN
    pod = {"metadata": {"labels": labels, "annotations": annotations}}
    if has_spec:
        pod["spec"] = spec
    return pod


def _patch(pod: dict, policy: SandboxPolicy) -> tuple[bytes, Refusal | None]:
    """(JSON patch, b"" for none; or the refusal). make_sandbox never touches metadata, so the
    diff of the essence is the diff of the whole pod."""
    try:
        mutated = make_sandbox(pod, policy)
    except SandboxError as e:
        return b"", e.refusal
    ops = jsonpatch.make_patch(pod, mutated).patch
    return (json.dumps(ops, separators=(",", ":")).encode() if ops else b""), None


@functools.lru_cache(maxsize=CACHE_ENTRIES)
def _patch_cached(essence: str, policy: SandboxPolicy) -> tuple[bytes, Refusal | None]:
    return _patch(_pod_from(essence), policy)


@functools.lru_cache(maxsize=CACHE_ENTRIES)
def _refusals_cached(essence: str, policy: SandboxPolicy) -> tuple[Refusal, ...]:
    return tuple(check_sandbox(_pod_from(essence), policy))


def patch_for(pod: dict, policy: SandboxPolicy) -> tuple[bytes, Refusal | None]:
    essence = _essence(pod, drop_token=True)  # every sandbox has its own token
    if essence is None:
        return _patch(pod, policy)
    swaps = [(json.dumps(name), json.dumps(f"{_PLACEHOLDER_VOLUME}-{i}"))
             for i, name in enumerate(injected_token_volumes(pod.get("spec") or {}))]
    for real, placeholder in swaps:
        essence = essence.replace(real, placeholder)
    patch, refusal = _patch_cached(essence, policy)
    for real, placeholder in swaps:
        patch = patch.replace(placeholder.encode(), real.encode())
    return patch, refusal


def refusals_for(pod: dict, policy: SandboxPolicy) -> list[Refusal]:
    token = ((pod.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_TOKEN_SHA256)
    # An invalid token's refusal quotes it: only pods with a valid one share a cache entry.
    essence = _essence(pod, drop_token=True) if is_token_sha256(token) else None
    return list(_refusals_cached(essence, policy)) if essence else check_sandbox(pod, policy)


def clear_caches() -> None:
    _patch_cached.cache_clear()
    _refusals_cached.cache_clear()


class BadReview(ValueError):
    pass


def _request(review) -> dict:
    if not isinstance(review, dict) or review.get("kind") != "AdmissionReview":
        raise BadReview("body is not an AdmissionReview")
    if review.get("apiVersion") != API_VERSION:
        raise BadReview(f"apiVersion must be {API_VERSION}")
    request = review.get("request")
    if not isinstance(request, dict) or not request.get("uid"):
        raise BadReview("AdmissionReview has no request.uid")
    return request


def _review(uid: str, response: dict) -> dict:
    return {"apiVersion": API_VERSION, "kind": "AdmissionReview",
            "response": {"uid": uid, **response}}


def _denied(uid: str, message: str) -> dict:
    return _review(uid, {"allowed": False,
                         "status": {"code": 403, "reason": "Forbidden", "message": message}})


def _is_pod(request: dict) -> bool:
    kind = request.get("kind") or {}
    return kind.get("group", "") == "" and kind.get("kind") == "Pod"


def mutate(review, policy: SandboxPolicy) -> tuple[dict, str, int]:
    """Returns (response review, metric reason, patch size in bytes)."""
    request = _request(review)
    uid = request["uid"]
    pod = request.get("object")
    if request.get("operation") != "CREATE" or not _is_pod(request):
        return _review(uid, {"allowed": True}), "not-create", 0
    if not isinstance(pod, dict) or not is_sandbox(pod):
        # The configuration selects on the label; this is the handler's own check.
        return _review(uid, {"allowed": True}), "not-sandbox", 0
    patch, refusal = patch_for(pod, policy)
    if refusal is not None:
        return _denied(uid, refusal.message()), refusal.rule, 0
    if not patch:
        return _review(uid, {"allowed": True}), "ok", 0
    return (_review(uid, {"allowed": True, "patchType": "JSONPatch",
                          "patch": base64.b64encode(patch).decode()}),
            "patched", len(patch))


def validate(review, policy: SandboxPolicy) -> tuple[dict, str]:
    """Returns (response review, metric reason). An UPDATE (including the
    `pods/ephemeralcontainers` subresource, whose object is the whole pod) is judged by
    check_update on the new pod itself: never by comparing refusals with the old pod's, which
    let a relabel to egress=deny through once a policy change made the old pod fail anything."""
    request = _request(review)
    uid = request["uid"]
    operation = request.get("operation")
    pod = request.get("object")
    if operation not in ("CREATE", "UPDATE") or not _is_pod(request) or not isinstance(pod, dict):
        return _review(uid, {"allowed": True}), "not-create"
    old = request.get("oldObject")
    # The old pod counts too: an UPDATE that strips sandman's labels is still judged.
    if not is_judged(pod) and not (isinstance(old, dict) and is_judged(old)):
        return _review(uid, {"allowed": True}), "not-sandbox"
    if operation == "UPDATE":
        refusals = check_update(pod, old, policy)
    else:
        refusals = refusals_for(pod, policy)
    if not refusals:
        return _review(uid, {"allowed": True}), "ok"
    return _denied(uid, "; ".join(r.message() for r in refusals)), refusals[0].rule
