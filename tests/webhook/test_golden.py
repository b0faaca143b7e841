"""Golden AdmissionReview pairs (istio injector style): testdata/<case>.json is the request,
testdata/<case>.golden.json the expected response with its patch decoded. Compared exactly."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import jsonpatch
import pytest

from sandman.podspec import SandboxPolicy, check_sandbox, make_sandbox
from tests.webhook import golden_cases
from webhook import admission

TESTDATA = Path(__file__).parent / "testdata"
UPDATE = os.environ.get("SANDMAN_GOLDEN_UPDATE") == "1"


def policy_for(name: str) -> SandboxPolicy:
    return golden_cases.POLICIES.get(name, SandboxPolicy())


def answer(name: str, review: dict) -> dict:
    """The handler's response in golden form: the patch decoded for review."""
    if name.startswith("mutate-"):
        out, _, _ = admission.mutate(review, policy_for(name))
    else:
        out, _ = admission.validate(review, policy_for(name))
    return decode(out)


def decode(out: dict) -> dict:
    out = json.loads(json.dumps(out))
    patch = out["response"].get("patch")
    if patch:
        out["response"]["patch"] = json.loads(base64.b64decode(patch))
    return out


def _dump(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


if UPDATE:
    TESTDATA.mkdir(exist_ok=True)
    for old in TESTDATA.glob("*.json"):
        old.unlink()
    for _name, _review in golden_cases.cases().items():
        _dump(TESTDATA / f"{_name}.json", _review)
        # From the file as read back: the patch depends on the key order of the input.
        _stored = json.loads((TESTDATA / f"{_name}.json").read_text())
        _dump(TESTDATA / f"{_name}.golden.json", answer(_name, _stored))

CASES = sorted(p.name[: -len(".json")] for p in TESTDATA.glob("*.json")
               if not p.name.endswith(".golden.json"))


def load(name: str) -> tuple[dict, dict]:
    return (json.loads((TESTDATA / f"{name}.json").read_text()),
            json.loads((TESTDATA / f"{name}.golden.json").read_text()))


def test_testdata_matches_the_case_list():
    assert CASES == sorted(golden_cases.cases()), "regenerate with SANDMAN_GOLDEN_UPDATE=1"
    for name, review in golden_cases.cases().items():
        assert load(name)[0] == json.loads(json.dumps(review)), name


@pytest.mark.parametrize("name", CASES)
def test_golden(name):
    review, expected = load(name)
    assert answer(name, review) == expected


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("mutate-")])
def test_mutated_pod_is_a_fixed_point_and_valid(name):
    """Applying a golden patch gives a pod that mutates to an empty patch and validates."""
    review, expected = load(name)
    patch = expected["response"].get("patch")
    if not patch:
        return
    pod = jsonpatch.apply_patch(review["request"]["object"], patch)
    policy = policy_for(name)
    assert make_sandbox(pod, policy) == pod
    assert check_sandbox(pod, policy) == []


def test_every_rule_has_a_refusing_case():
    from sandman.podspec import RULES

    seen = set()
    for name in CASES:
        _, expected = load(name)
        message = (expected["response"].get("status") or {}).get("message", "")
        seen |= {r for r in RULES if f"sandman {r}:" in message}
    assert seen == set(RULES) - {"sandbox-container-missing", "ingress-from-invalid"} | (
        seen & {"sandbox-container-missing", "ingress-from-invalid"})
    assert {"sandbox-container-missing", "ingress-from-invalid"} <= seen
