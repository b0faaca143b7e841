"""Egress allowlists on the wire (sandman/api.py): `egress` is "deny", "allow" or
`{"allow": [entries]}` in an acquire, a prewarm spec and declared conditions. An allowlist is
canonicalised by sandman/egress.py (sorted, deduplicated, protocol written); anything else is
refused in one line quoting what was wrong, by the SDK before sending and by the controller's
body validation (FastAPI's) when a raw body bypasses the SDK. Plain strings keep their old body,
so an SDK that never uses allowlists still talks to a controller that predates them."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from controller.routes import build_app
from sandman import api
from sandman.client import BadRequest, Client, ProtocolError, SandboxInfo, cli

ENTRY = "10.1.2.0/24:443/tcp"


def _body(**kw: Any) -> dict[str, Any]:
    return api.AcquireRequest(image="img", job="j", **kw).to_json()


def test_an_allowlist_is_canonical_on_the_wire():
    got = _body(egress={"allow": ["10.1.2.0/24:443", "10.0.0.1:80/udp", "10.1.2.0/24:443/tcp",
                                  "svc/pypi-mirror.infra:3141"]})
    assert got["egress"] == {"allow": ["10.0.0.1/32:80/udp", ENTRY,
                                       "svc/pypi-mirror.infra:3141/tcp"]}
    # The same list in another order and spelling is the same key: one warm pool.
    a = api.Spec(egress={"allow": ["10.1.2.0/24:443", "10.0.0.1:80/udp"]})
    b = api.Spec(egress={"allow": ["10.0.0.1/32:80/udp", "10.1.2.0/24:443/tcp"]})
    assert a == b
    assert api.egress_parts(a.egress) == ("deny", ("10.0.0.1/32:80/udp", ENTRY))
    assert api.egress_parts("allow") == ("allow", ()) and api.egress_parts("deny") == ("deny", ())


def test_plain_egress_bodies_are_unchanged():
    for mode in ("deny", "allow"):
        body = _body(egress=mode)
        assert body["egress"] == mode
        assert "egress_allow" not in body
    conditions = _body(conditions=api.Conditions(egress="deny"))["conditions"]
    assert "egress_allow" not in conditions  # an older controller refuses unknown fields
    view = api.SandboxView("s", "p", "j", "leased", None, 9470, "img", "2", "8Gi", "deny")
    assert "egress_allow" not in view.to_json()
    assert "egress_allow" not in api.SandboxList([view]).to_json()["items"][0]


@pytest.mark.parametrize("bad,says", [
    ({"allow": []}, "egress.allow: must be a non-empty list"),
    ({"allow": "10.0.0.1:80"}, "egress.allow: must be a non-empty list"),
    ({"allow": [1]}, "egress.allow: must be a non-empty list"),
    ({"allow": ["10.0.0.1:80"], "deny": []}, "egress: must be deny or allow or"),
    ({"deny": ["10.0.0.1:80"]}, "egress: must be deny or allow or"),
    ({}, "egress: must be deny or allow or"),
    ("maybe", "egress: must be deny or allow or"),
    (["10.0.0.1:80"], "egress: must be deny or allow or"),
    ({"allow": ["10.0.0.1/8:80"]}, "'10.0.0.1/8:80': has host bits set"),
    ({"allow": ["10.0.0.1"]}, "'10.0.0.1': a port is required"),
    ({"allow": ["10.0.0.1:0"]}, "'10.0.0.1:0': port must be 1-65535"),
    ({"allow": ["10.0.0.1:*"]}, "'10.0.0.1:*': port must be 1-65535"),  # ceilings only
    ({"allow": ["10.0.0.1: 80"]}, "contains whitespace"),
    ({"allow": ["10.0.0.1:80,10.0.0.2:80"]}, "'10.0.0.1:80,10.0.0.2:80'"),  # one per item
    ({"allow": [""]}, "'': empty"),
    ({"allow": ["svc/a.b.c:80"]}, "is not a namespace name"),
    ({"allow": ["svc/*.infra:80"]}, "is not a Service name"),  # ceilings only
    ({"allow": ["http://10.0.0.1:80"]}, "'http://10.0.0.1:80'"),
    ({"allow": [f"10.0.{i // 250}.{i % 250}:80" for i in range(33)]}, "at most 32"),
    # 32 entries, each valid, whose annotation would pass the 2 KiB a pod may carry.
    ({"allow": [f"svc/{'m' * 40}{i}.{'n' * 20}:3141" for i in range(32)]}, "2048 characters"),
    ({"allow": ["10.0.0.1:\uff18\uff10"]}, "port must be 1-65535"),  # fullwidth digits
    ({"allow": ["010.0.0.1:80"]}, "'010.0.0.1:80'"),  # read as octal elsewhere
    ({"allow": None}, "egress.allow: must be a non-empty list"),
    ({"allow": [["10.0.0.1:80"]]}, "egress.allow: must be a non-empty list"),
    ({"allow": ["10.0.0.1:80\n"]}, "contains whitespace"),
])
def test_a_bad_egress_is_refused_in_one_line(bad, says):
    for build in (lambda: api.AcquireRequest(image="img", job="j", egress=bad),
                  lambda: api.Spec(egress=bad),
                  lambda: api.Conditions(egress=bad)):
        with pytest.raises(ValueError) as e:
            build()
        assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_declared_conditions_take_the_allowlist_either_way():
    a = api.Conditions(egress={"allow": ["10.1.2.0/24:443"]})
    b = api.Conditions(egress="deny", egress_allow=["10.1.2.0/24:443/tcp"])
    c = api.Conditions(egress_allow=["10.1.2.0/24:443"])
    assert a == b and a.declared() == {"egress": "deny", "egress_allow": [ENTRY]}
    assert c.declared() == {"egress_allow": [ENTRY]}
    with pytest.raises(ValueError, match="only exists with egress deny"):
        api.Conditions(egress="allow", egress_allow=[ENTRY])
    with pytest.raises(ValueError, match="differs from the allowlist"):
        api.Conditions(egress={"allow": [ENTRY]}, egress_allow=["10.0.0.1:80"])
    with pytest.raises(ValueError, match="conditions.egress_allow: must be a non-empty"):
        api.Conditions(egress_allow=[])


def test_sandbox_info_reads_the_allowlist():
    view = api.SandboxView("s", "p", "j", "leased", None, 9470, "img", "2", "8Gi", "deny",
                           egress_allow=[ENTRY])
    got = SandboxInfo.from_json(view.to_json())
    assert (got.egress, got.egress_allow) == ("deny", [ENTRY])
    assert SandboxInfo.from_json({**view.to_json(), "egress_allow": None}).egress_allow is None
    with pytest.raises(ProtocolError, match="egress_allow"):
        SandboxInfo.from_json({**view.to_json(), "egress_allow": [1]})


# ---- the controller's body validation: a raw body, no SDK in between

class _Capture:
    """What routes.py hands the controller: the SandboxSpec and the declared conditions."""

    ready = True

    def __init__(self) -> None:
        self.calls: list[tuple[Any, dict[str, Any]]] = []

    async def acquire(self, order: Any) -> dict[str, Any]:
        self.calls.append((order.spec, {"conditions": order.conditions}))
        return {"id": "sb-1", "pod": "p", "address": "127.0.0.1", "port": 9470, "token": "t",
                "warm": False, "timings": {}}

    async def pinned_spec(self, spec: Any) -> Any:
        return spec  # image pinning is the controller's (tests/controller), not the route's

    def prewarm(self, spec: Any, count: int, idle: float | None) -> Any:
        self.calls.append((spec, {"count": count}))
        raise RuntimeError("stop here")


@pytest.fixture
def app() -> tuple[TestClient, _Capture]:
    ctl = _Capture()
    return TestClient(build_app({"controller": ctl}), raise_server_exceptions=False), ctl


def test_the_controller_gets_the_label_and_the_list(app):
    http, ctl = app
    r = http.post(api.ACQUIRE.path, json={"image": "img", "job": "j", "egress": {
        "allow": ["10.1.2.0/24:443", "10.0.0.1:80/udp"]},
        "conditions": {"egress": {"allow": ["10.1.2.0/24:443"]}}})
    assert r.status_code == 201, r.text
    spec, kw = ctl.calls[-1]
    assert (spec.egress, spec.egress_allow) == ("deny", ("10.0.0.1/32:80/udp", ENTRY))
    assert kw["conditions"] == {"egress": "deny", "egress_allow": [ENTRY]}
    r = http.post(api.ACQUIRE.path, json={"image": "img", "job": "j", "egress": "allow"})
    assert r.status_code == 201 and ctl.calls[-1][0].egress_allow == ()
    r = http.post(api.PREWARM.path, json={"image": "img", "count": 1,
                                          "spec": {"egress": {"allow": [ENTRY]}}})
    assert ctl.calls[-1][1] == {"count": 1}, r.text  # the prewarm reached the controller
    assert ctl.calls[-1][0].egress_allow == (ENTRY,)


@pytest.mark.parametrize("egress,says", [
    ({"allow": []}, "egress.allow: must be a non-empty list"),
    ({"allow": ["10.0.0.1/8:80"]}, "egress.allow: egress entry '10.0.0.1/8:80': has host bits"),
    ({"allow": {"a": 1}}, "egress.allow: must be a non-empty list"),
    ({"allow": [ENTRY], "also": 1}, "egress: must be deny or allow or"),
    (5, "egress: must be deny or allow or"),
])
def test_a_raw_body_is_refused_in_one_line(app, egress, says):
    http, ctl = app
    for path, body in ((api.ACQUIRE.path, {"image": "img", "job": "j", "egress": egress}),
                       (api.PREWARM.path, {"image": "img", "count": 1,
                                           "spec": {"egress": egress}}),
                       (api.ACQUIRE.path, {"image": "img", "job": "j",
                                           "conditions": {"egress": egress}})):
        r = http.post(path, json=body)
        assert r.status_code == 422, r.text
        msg = r.json()["error"]["message"]
        assert says in msg and "\n" not in msg, msg
    assert ctl.calls == []


# ---- the SDK and the command-line client refuse before sending

def test_the_sdk_refuses_a_bad_allowlist_before_sending():
    # Nothing listens on port 9 of loopback: a request sent would fail differently.
    with Client("http://127.0.0.1:9") as c:
        with pytest.raises(BadRequest, match="'10.0.0.1/8:80': has host bits set") as e:
            c.acquire("img", job="j", egress={"allow": ["10.0.0.1/8:80"]})
        assert e.value.status is None
        with pytest.raises(BadRequest, match="egress.allow: must be a non-empty list"):
            c.prewarm("img", 1, egress={"allow": "10.0.0.1:80"})


def test_the_cli_builds_the_allowlist():
    ap = cli.parser()
    args = ap.parse_args(["--url", "http://127.0.0.1:9", "acquire", "img", "--job", "j",
                          "--egress-allow", "10.1.2.0/24:443,10.0.0.1:80/udp",
                          "--egress-allow", "svc/m.infra:3141"])
    assert cli._egress(args) == {"allow": ["10.1.2.0/24:443", "10.0.0.1:80/udp",
                                           "svc/m.infra:3141"]}
    args = ap.parse_args(["--url", "http://127.0.0.1:9", "acquire", "img", "--job", "j",
                          "--egress", "allow", "--egress-allow", ENTRY])
    with pytest.raises(BadRequest, match="--egress-allow needs --egress deny"):
        cli._egress(args)
    args = ap.parse_args(["--url", "http://127.0.0.1:9", "acquire", "img", "--job", "j"])
    assert cli._egress(args) == "deny"


def test_the_cli_refuses_a_bad_entry_in_one_line(capsys):
    code = cli.main(["--url", "http://127.0.0.1:9", "acquire", "img", "--job", "j",
                     "--egress-allow", "10.0.0.1:80,,10.0.0.2:80"])
    err = capsys.readouterr().err.strip()
    assert code == cli.EXIT_USAGE and "\n" not in err and "'': empty" in err, err


def test_the_swerex_deployment_takes_an_allowlist():
    pytest.importorskip("swerex")
    from sandman.client.swerex import SandmanDeploymentConfig

    cfg = SandmanDeploymentConfig.model_validate(
        {"type": "sandman", "image": "img", "job": "j", "egress": {"allow": [ENTRY]}})
    assert cfg.egress == {"allow": [ENTRY]}
    assert SandmanDeploymentConfig(image="img", job="j").egress == "deny"


def test_a_grading_task_takes_an_allowlist():
    from sandman.client.grading import Task

    def task(egress: Any) -> Task:
        return Task(name="t", image="img", repo="/repo", base_commit="abc1234",
                    test_files=("tests/test_x.py",), egress=egress, time_limit_s=60)

    assert task({"allow": ["10.1.2.0/24:443"]}).egress == {"allow": [ENTRY]}
    assert task("allow").egress == "allow"
    with pytest.raises(BadRequest, match="task 't': egress.allow: egress entry '10.1.2.3/24:443'"):
        task({"allow": ["10.1.2.3/24:443"]})
    with pytest.raises(BadRequest, match="task 't': egress: must be deny or allow or"):
        task("open")
