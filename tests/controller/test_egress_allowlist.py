"""Egress allowlists in the controller, pure logic: its flags (checked at startup, one line),
its check of an acquire's list against the ceiling and never ranges, the pod it builds, the
books' reading of that pod (slim copy included), and the declared `egress_allow` condition
compared with what netguard recorded. The same through the real controller and Kubernetes:
tests/controller/test_egress_on_testbed.py; execd's reading: tests/execd/
test_conditions_allowlist.py."""

from __future__ import annotations

import argparse

import pytest

from controller import conditions as C
from controller import pods as P
from controller.__main__ import parse_args, settings_from
from controller.books import Entry
from controller.core import Controller
from controller.errors import BadRequest
from controller.pods import SandboxSpec
from sandman import contract
from sandman.podspec import SandboxError, check_sandbox, egress_allow
from webhook.__main__ import _policy_args, policy_from

from .fakekube import FakeKube

IMAGE = "registry.invalid/swe/task:1"
ENTRY = "198.18.0.1/32:8181/tcp"
SVC = "svc/pypi-mirror.infra:3141/tcp"


def _controller(*flags: str) -> Controller:
    return Controller(FakeKube(), settings_from(parse_args(["serve", "--namespace", "ns",
                                                            *flags])))


@pytest.mark.parametrize("flags,says", [
    (["--egress-ceiling", "10.0.0.1/8:443"], "has host bits set"),
    (["--egress-ceiling", "10.0.0.0/8"], "a port is required"),
    (["--egress-ceiling", "10.0.0.0/8:443,,bogus"], "'bogus'"),
    (["--egress-never", "10.0.0.0/8:443"], "egress never range '10.0.0.0/8:443'"),
    (["--egress-never", "10.0.0.1/8"], "egress never range '10.0.0.1/8'"),
])
def test_bad_flags_stop_the_controller_with_one_line(flags, says):
    with pytest.raises(ValueError, match=says) as e:
        settings_from(parse_args(["serve", "--namespace", "ns", *flags]))
    assert "\n" not in str(e.value)


def test_flags_repeat_or_take_commas(monkeypatch):
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    s = settings_from(parse_args(["serve", "--namespace", "ns", "--egress-ceiling",
                                  "10.0.0.0/8:443, svc/*.infra:*", "--egress-ceiling",
                                  "[fd00::/64]:53/udp", "--egress-never", "10.9.0.0/16"]))
    assert [e.text for e in s.ceiling.entries] == [
        "10.0.0.0/8:443/tcp", "[fd00::/64]:53/udp", "svc/*.infra:*/tcp"]
    # The API server's Service address is a never range of its own (the controller's only:
    # netguard reads it in the pod), the admin's go to netguard as --never-egress.
    assert [str(n) for n in s.never] == ["10.9.0.0/16", "10.96.0.1/32"]
    assert s.policy.egress_never == ("10.9.0.0/16",)


def test_without_a_ceiling_every_list_is_refused(monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    c = _controller()
    with pytest.raises(BadRequest, match="allowlists are off in this cluster") as e:
        c.validate(SandboxSpec(IMAGE, egress_allow=(ENTRY,)), "j", {}, None)
    assert "\n" not in str(e.value)
    c.validate(SandboxSpec(IMAGE), "j", {}, None)  # no list: nothing to refuse


def test_the_ceiling_never_ranges_and_the_api_server(monkeypatch):
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    c = _controller("--egress-ceiling", "10.0.0.0/8:*,198.18.0.0/15:8181",
                    "--egress-never", "10.200.0.0/16")

    def refused(*entries: str) -> str:
        with pytest.raises(BadRequest) as e:
            c.validate(SandboxSpec(IMAGE, egress_allow=entries), "j", {}, None)
        assert "\n" not in str(e.value)
        return str(e.value)

    c.validate(SandboxSpec(IMAGE, egress_allow=(ENTRY, "10.0.0.0/8:443/tcp")), "j", {}, None)
    assert "'10.96.0.1/32:443/tcp' is never allowed" in refused("10.96.0.1/32:443/tcp")
    assert "'10.200.1.0/24:80/tcp' is never allowed" in refused("10.200.1.0/24:80/tcp")
    assert "'198.18.0.1/32:22/tcp' is outside" in refused("198.18.0.1/32:22/tcp")
    # Each refused entry is named, in one line.
    both = refused("10.96.0.1/32:443/tcp", "11.0.0.0/8:80/tcp")
    assert "'10.96.0.1/32:443/tcp'" in both and "'11.0.0.0/8:80/tcp'" in both
    # A spec the wire never builds (a list without deny, a list not canonical): refused too.
    with pytest.raises(BadRequest, match="needs egress deny"):
        c.validate(SandboxSpec(IMAGE, egress="allow", egress_allow=(ENTRY,)), "j", {}, None)
    assert "'10.0.0.1/8:80'" in refused("10.0.0.1/8:80")


def test_the_pod_carries_deny_and_the_list_and_reads_back_as_its_key():
    c = _controller("--egress-ceiling", "198.18.0.0/15:*,svc/*.infra:*",
                    "--egress-never", "198.19.0.0/16")
    spec = SandboxSpec(IMAGE, egress=contract.EGRESS_DENY, egress_allow=(ENTRY, SVC))
    e = Entry("sbx-a", spec, "j", "n1", "t")
    pod = c.creator.build_pod(e, "0" * 64)
    meta = pod["metadata"]
    assert meta["labels"][contract.LABEL_EGRESS] == contract.EGRESS_DENY
    assert meta["annotations"][contract.ANNOTATION_EGRESS_ALLOW] == f"{ENTRY},{SVC}"
    # The pod function shared with the webhook gave netguard the list and the never range,
    # as the webhook does from the same values (the admission policy compares them).
    guard = next(x for x in pod["spec"]["initContainers"]
                 if x["name"] == contract.NETGUARD_CONTAINER)
    args = " ".join(guard["args"])
    assert f"--allow-egress {ENTRY} --allow-egress {SVC}" in args, args
    assert "--never-egress 198.19.0.0/16" in args, args
    assert check_sandbox(pod, c.s.policy) == []
    assert P.spec_of(pod) == spec
    assert P.spec_of(P.slim_pod(pod)) == spec  # the informer's copy keeps the key
    plain = c.creator.build_pod(Entry("sbx-b", SandboxSpec(IMAGE), "j", "n2", "t"), "0" * 64)
    assert contract.ANNOTATION_EGRESS_ALLOW not in plain["metadata"]["annotations"]
    assert P.spec_of(plain).egress_allow == () and P.spec_of(plain) != spec


# ---- the declared condition against execd's reading (netguard's status)

POD = {"netguard_mode": "deny", "netguard_allow_egress": ["198.18.0.1/32:8181/tcp", SVC],
       "egress": None}


def test_the_applied_list_verifies_the_declared_one():
    v = C.compare({"egress": "deny", "egress_allow": [ENTRY, SVC]}, POD)
    assert v.ok and v.verified == {"egress": "deny", "egress_allow": [ENTRY, SVC]}
    # netguard may record the same entries in another order or spelling.
    assert C.compare({"egress_allow": [ENTRY, SVC]},
                     {**POD, "netguard_allow_egress": [SVC, "198.18.0.1:8181"]}).ok


@pytest.mark.parametrize("applied", [
    [ENTRY],  # one entry short
    [ENTRY, SVC, "10.0.0.0/8:443/tcp"],  # one more
    ["198.18.0.0/24:8181/tcp", SVC],  # wider
    [],  # none
    ["bogus", SVC],  # not an entry at all
])
def test_another_applied_list_contradicts(applied):
    v = C.compare({"egress_allow": [ENTRY, SVC]}, {**POD, "netguard_allow_egress": applied})
    assert not v.ok and v.contradicted[0][0] == "egress_allow", v


def test_open_egress_contradicts_a_declared_allowlist():
    v = C.compare({"egress_allow": [ENTRY]}, {**POD, "netguard_mode": "allow"})
    assert v.contradicted == [("egress_allow", [ENTRY], "egress allow")]


def test_a_reachable_egress_probe_contradicts_the_allowlist():
    opened = {**POD, "egress": {"target": "198.18.0.2:80", "open": True}}
    v = C.compare({"egress_allow": [ENTRY, SVC]}, opened)
    assert not v.ok and "198.18.0.2:80 reachable" in v.message()
    closed = {**POD, "egress": {"target": "198.18.0.2:80", "open": False}}
    assert C.compare({"egress_allow": [ENTRY, SVC]}, closed).ok


@pytest.mark.parametrize("pod", [
    {**POD, "netguard_allow_egress": None},  # an execd that does not report it
    {**POD, "netguard_mode": None},  # no status, or a failed guard
])
def test_an_unreadable_allowlist_is_unverified_never_refused(pod):
    v = C.compare({"egress_allow": [ENTRY]}, pod)
    assert v.ok and v.unverified == ["egress_allow"]


# ---- the controller and the webhook agree on what they refuse

AGREEMENT = [
    ("198.18.0.1/32:8181/tcp",), ("198.18.0.0/15:443/tcp",), ("198.16.0.0/14:443/tcp",),
    ("198.18.0.1/32:8181/udp",), ("svc/pypi-mirror.infra:3141/tcp",),
    ("svc/pypi-mirror.other:3141/tcp",), ("svc/pypi-mirror.infra:80/tcp",),
    ("10.96.0.1/32:443/tcp",), ("10.96.0.0/12:443/tcp",), ("198.19.255.0/24:80/tcp",),
    ("198.19.255.7/32:80/tcp",), ("169.254.169.254/32:80/tcp",), ("[fd00:ec2::254]:80/tcp",),
    ("198.18.0.1/32:8181/tcp", "10.0.0.1/32:80/tcp"),
]


@pytest.mark.parametrize("entries", AGREEMENT, ids=",".join)
def test_the_controller_refuses_what_the_webhook_refuses(monkeypatch, entries):
    """Both judge with sandman/egress.py on the same values, so an acquire the controller
    admits is never a create the webhook then refuses (a PodFailed instead of a 400), and an
    acquire it refuses would have been refused anyway."""
    flags = ["--egress-ceiling", "198.18.0.0/15:*,svc/*.infra:3141,10.96.0.0/12:443",
             "--egress-never", "198.19.255.0/24"]
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    c = _controller(*flags)
    ap = argparse.ArgumentParser()
    _policy_args(ap)
    policy = policy_from(ap.parse_args(flags), api_server=("10.96.0.1",))
    try:
        c.validate(SandboxSpec(IMAGE, egress_allow=entries), "j", {}, None)
        controller_ok = True
    except BadRequest:
        controller_ok = False
    pod = {"metadata": {"labels": {contract.LABEL_EGRESS: contract.EGRESS_DENY},
                        "annotations": {contract.ANNOTATION_EGRESS_ALLOW: ",".join(entries)}}}
    try:
        egress_allow(pod, policy)
        webhook_ok = True
    except SandboxError:
        webhook_ok = False
    assert controller_ok == webhook_ok, (entries, controller_ok, webhook_ok)
