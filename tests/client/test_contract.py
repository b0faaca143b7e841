"""sandman/api.py is the one home of the controller's wire: the server serves exactly its
routes, sends only its error types (each one the SDK maps to a typed error), and the SDK's
answer models have its fields. No HTTP here except through FastAPI's own route table."""

from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path

import pytest

from controller import errors as controller_errors
from controller import pods
from controller import routes as capi
from sandman import api
from sandman.client import (
    AcquireTimings,
    ConditionsCheck,
    Lease,
    PoolStatus,
    SandboxInfo,
    SandmanError,
    errors,
)

ROOT = Path(__file__).resolve().parents[2]


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


def test_every_error_type_the_server_sends_is_in_the_contract():
    sent = {(c.status, c.kind) for c in [controller_errors.AcquireError,
                                        *_subclasses(controller_errors.AcquireError)]}
    assert sent <= set(api.ERRORS), sent - set(api.ERRORS)
    # controller/routes.py sends the rest itself: validation, gone, a caller that left, /readyz.
    text = (ROOT / "controller" / "routes.py").read_text()
    for e in (api.INVALID_BODY, api.SANDBOX_GONE, api.CLIENT_CLOSED, api.NOT_READY):
        assert f"api.{_name(e)}" in text


def _name(e: api.ErrorType) -> str:
    return next(k for k, v in vars(api).items() if v is e)


@pytest.mark.parametrize("err", api.ERRORS, ids=lambda e: f"{e.status}-{e.type}")
def test_the_sdk_maps_every_error_type_to_a_typed_error(err: api.ErrorType):
    cls = errors._CONTROLLER_TYPES[err.type]  # KeyError: an error type the SDK does not know
    assert issubclass(cls, SandmanError)
    ck = "t." + "0" * 64 if err is api.SANDBOX_PAUSED else None
    got = errors.controller_error(err.status, api.Error(err.type, "m", ["ev"], ck).to_json())
    assert type(got) is cls and got.status == err.status and got.type == err.type
    assert got.events == ["ev"]


def test_the_sdk_knows_no_error_type_the_contract_lacks():
    assert set(errors._CONTROLLER_TYPES) == api.ERROR_TYPES


def test_the_servers_routes_are_the_contracts():
    from fastapi.routing import APIRoute

    app = capi.build_app({})
    served = {(m, r.path) for r in app.routes if isinstance(r, APIRoute) for m in r.methods}
    assert served == {(r.method, r.path) for r in api.ROUTES}


@pytest.mark.parametrize("sdk,wire", [(Lease, api.Lease), (AcquireTimings, api.Timings),
                                      (ConditionsCheck, api.ConditionsCheck),
                                      (SandboxInfo, api.SandboxView),
                                      (PoolStatus, api.PoolStatus)],
                         ids=lambda c: c.__name__)
def test_sdk_answer_models_are_the_contracts(sdk, wire):
    # One definition per answer: the SDK's model is the wire's, or a subclass adding `raw`.
    assert issubclass(sdk, wire)
    wire_fields = dataclasses.fields(wire)
    assert dataclasses.fields(sdk)[:len(wire_fields)] == wire_fields
    assert [f.name for f in dataclasses.fields(sdk)[len(wire_fields):]] in ([], ["raw"])
    if sdk is not wire:  # and redefines none of the wire's fields
        assert not {f.name for f in wire_fields} & set(vars(sdk).get("__annotations__", {}))


def test_sdk_models_parse_what_the_contract_writes():
    lease = api.Lease("sb-1", "pod-1", "10.0.0.1", 9470, "tok", True, api.Timings(1, 2, 3))
    got = Lease.from_json(lease.to_json())
    assert (got.id, got.port, got.token, got.warm, got.timings.ready_ms) == (
        "sb-1", 9470, "tok", True, 3)
    view = api.SandboxView("sb-1", "pod-1", "j", "leased", None, 9470, "img", "2", "8Gi", "deny")
    assert SandboxInfo.from_json(view.to_json()).memory == "8Gi"
    pool = api.PoolStatus(target=3, warm=1, building=2, idle_timeout_s=None)
    assert PoolStatus.from_json(pool.to_json()).building == 2


def test_request_models_refuse_what_the_server_refuses():
    with pytest.raises(ValueError, match="timeout_s"):
        api.AcquireRequest(image="i", job="j", timeout_s=0)
    with pytest.raises(ValueError, match="egress"):
        api.AcquireRequest(image="i", job="j", egress="maybe")
    with pytest.raises(ValueError, match="count"):
        api.PrewarmRequest(image="i", count=-1)
    assert api.AcquireRequest(image="i", job="j").to_json()["memory"] == api.DEFAULT_MEMORY
    for cpu in ("two", "2 CPUs", "-1", "", "1.5.2", "500mi"):
        with pytest.raises(ValueError, match="cpu: must be a Kubernetes quantity"):
            api.AcquireRequest(image="i", job="j", cpu=cpu)
    with pytest.raises(ValueError, match="memory: must be a Kubernetes quantity"):
        api.AcquireRequest(image="i", job="j", memory="8 GB")
    for cpu, memory in (("2", "8Gi"), ("500m", "512Mi"), ("1.5", "1e9"), (".5", "128M"),
                        ("+1", "1G"), ("100u", "64Ki")):
        assert api.AcquireRequest(image="i", job="j", cpu=cpu, memory=memory).cpu == cpu


def test_ephemeral_storage_and_gpu_are_appended_and_checked():
    # Appended last with defaults: positional use of Spec keeps its meaning.
    spec = api.Spec("1", "1Gi", "/w", "allow", "grading")
    assert (spec.ephemeral_storage, spec.gpu) == (None, 0)
    assert list(api.Spec.__dataclass_fields__)[-2:] == ["ephemeral_storage", "gpu"]
    # At their defaults they are left out of the body: a controller that predates them
    # refuses unknown fields, and this SDK must still talk to it.
    plain = api.AcquireRequest(image="i", job="j").to_json()
    assert "ephemeral_storage" not in plain and "gpu" not in plain
    prewarm = api.PrewarmRequest(image="i", count=1, spec=api.Spec()).to_json()
    assert "gpu" not in prewarm["spec"] and "ephemeral_storage" not in prewarm["spec"]
    req = api.AcquireRequest(image="i", job="j", ephemeral_storage="10Gi", gpu=2)
    assert req.spec == api.Spec(ephemeral_storage="10Gi", gpu=2)
    assert req.to_json()["ephemeral_storage"] == "10Gi" and req.to_json()["gpu"] == 2
    for bad in ("ten", "-1Gi", "0", "", "10 Gi", 10):
        with pytest.raises(ValueError, match="ephemeral_storage: must be a positive") as e:
            api.AcquireRequest(image="i", job="j", ephemeral_storage=bad)
        assert "\n" not in str(e.value)
        with pytest.raises(ValueError, match="ephemeral_storage"):
            api.Spec(ephemeral_storage=bad)
    for bad in (-1, api.MAX_GPU + 1, True, 1.0, "1"):
        with pytest.raises(ValueError, match="gpu: must be an integer"):
            api.AcquireRequest(image="i", job="j", gpu=bad)
        with pytest.raises(ValueError, match="gpu"):
            api.Spec(gpu=bad)


def test_route_urls_quote_one_segment():
    assert api.GET.url(id="a/b c") == "/v1/sandboxes/a%2Fb%20c"
    assert api.DRAIN.url(job="j") == "/v1/jobs/j/drain"


def test_one_default_size():
    """The webhook's default for containers that set none, the controller's spec and the pod
    it reads back after a restart (which decides the warm pool the pod joins): all the
    contract's."""
    from sandman.podspec import SandboxPolicy

    assert (SandboxPolicy().default_cpu, SandboxPolicy().default_memory) == (
        api.DEFAULT_CPU, api.DEFAULT_MEMORY)
    spec = pods.spec_of({"spec": {"containers": [{"image": "img"}]}})
    assert (spec.cpu, spec.memory, spec.egress) == (api.DEFAULT_CPU, api.DEFAULT_MEMORY,
                                                    api.DEFAULT_EGRESS)
    assert spec == pods.SandboxSpec("img")


def test_no_python_outside_the_contract_spells_the_wire():
    """`/v1/...` paths and the default size live in sandman/api.py; tests may spell the wire
    on purpose."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard",
                            "*.py"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    spelled = re.compile(r"""["'](/v1/[a-z]|8Gi["'])""")
    bad = [f for f in files
           if not f.startswith("tests/") and f != "sandman/api.py"
           and spelled.search((ROOT / f).read_text())]
    assert bad == []


# ---- Kubernetes name syntax: one spelling (sandman/contract.py), fullmatch everywhere

@pytest.mark.parametrize("value,ok", [
    ("job-1", True), ("a", True), ("A.b_c-9", True), ("x" * 63, True),
    ("x" * 64, False), ("-a", False), ("a-", False), ("a b", False),
    ("job\n", False),  # `re.match("...$")` accepted it; the API server refuses it
])
def test_label_value_syntax(value, ok):
    from sandman import contract

    assert contract.is_label_value(value) is ok
    assert contract.is_label_name(value) is ok


def test_the_empty_label_value_is_a_value_but_not_a_name():
    from sandman import contract

    assert contract.is_label_value("") and not contract.is_label_value("", allow_empty=False)
    assert not contract.is_label_name("")


@pytest.mark.parametrize("name,label,subdomain", [
    ("team-a", True, True), ("a.b", False, True), ("Team", False, False),
    ("team\n", False, False), ("x" * 64, False, True), ("a..b", False, False),
])
def test_dns_names(name, label, subdomain):
    from sandman import contract

    assert contract.is_dns_label(name) is label
    assert contract.is_dns_subdomain(name) is subdomain


def test_the_controller_refuses_a_label_or_tenant_with_a_trailing_newline():
    from controller.auth import LabelPolicy, check_tenant
    from controller.errors import BadRequest

    with pytest.raises(BadRequest, match="not a valid label key"):
        LabelPolicy().check({"team\n": "a"})
    with pytest.raises(BadRequest, match="not a namespace name"):
        check_tenant("team-a\n")
    check_tenant("team-a")
    LabelPolicy(prefixes=("example.com",)).check({"example.com/team": "a", "run": "1"})
