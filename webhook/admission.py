"""AdmissionReview (admission.k8s.io/v1) in, AdmissionReview out. No I/O: the HTTP layer and the
golden tests both call these functions.

Dry-run requests (`request.dryRun`) take the same path as real ones: the webhook has no side
effects (`sideEffects: None`), so there is nothing to skip.
"""

from __future__ import annotations

import base64
import json

import jsonpatch

from sandman.sandbox import (
    SandboxError,
    SandboxPolicy,
    check_sandbox,
    is_sandbox,
    make_sandbox,
)

API_VERSION = "admission.k8s.io/v1"


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
    try:
        mutated = make_sandbox(pod, policy)
    except SandboxError as e:
        return _denied(uid, e.refusal.message()), e.refusal.rule, 0
    ops = jsonpatch.make_patch(pod, mutated).patch
    if not ops:
        return _review(uid, {"allowed": True}), "ok", 0
    patch = json.dumps(ops, separators=(",", ":")).encode()
    return (_review(uid, {"allowed": True, "patchType": "JSONPatch",
                          "patch": base64.b64encode(patch).decode()}),
            "patched", len(patch))


def validate(review, policy: SandboxPolicy) -> tuple[dict, str]:
    """Returns (response review, metric reason). On UPDATE only new breakage is refused, so a pod
    admitted under older rules can still have its finalizers removed."""
    request = _request(review)
    uid = request["uid"]
    operation = request.get("operation")
    pod = request.get("object")
    if operation not in ("CREATE", "UPDATE") or not _is_pod(request) or not isinstance(pod, dict):
        return _review(uid, {"allowed": True}), "not-create"
    refusals = check_sandbox(pod, policy)
    if operation == "UPDATE" and refusals:
        old = request.get("oldObject")
        before = {(r.rule, r.container) for r in check_sandbox(old, policy)} if old else set()
        refusals = [r for r in refusals if (r.rule, r.container) not in before]
    if not refusals:
        return _review(uid, {"allowed": True}), "ok"
    return _denied(uid, "; ".join(r.message() for r in refusals)), refusals[0].rule
