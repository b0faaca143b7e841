"""The egress allowlist at admission (sandman/podspec.py): the annotation becomes netguard's
--allow-egress/--never-egress args, and every way around the ceiling, the never ranges and the
API server is refused in one line. Pure logic over pod dicts; the webhook's own process is
started for its flags (a real `python3 -m webhook`)."""

from __future__ import annotations

import copy
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from sandman.contract import (
    ANNOTATION_EGRESS_ALLOW,
    ANNOTATION_TOKEN_SHA256,
    LABEL_EGRESS,
    LABEL_SANDBOX,
    NETGUARD_CONTAINER,
)
from sandman.podspec import (
    RULES,
    SandboxError,
    SandboxPolicy,
    check_sandbox,
    check_update,
    make_sandbox,
    netguard_args,
)

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
POLICY = SandboxPolicy(egress_ceiling=("10.0.0.0/8:*/tcp", "[fd00::/8]:443/tcp",
                                       "svc/*.infra:*/tcp", "svc/dns.kube-system:53/udp"),
                       egress_never=("10.100.0.0/16",), api_server=("10.96.0.1",))
ALLOW = "10.0.0.0/8:443/tcp,[fd00:1::/64]:443/tcp,svc/pypi.infra:3141/tcp"


def pod(allow: str | None = ALLOW, egress: str | None = "deny") -> dict:
    labels = {LABEL_SANDBOX: "true"}
    if egress is not None:
        labels[LABEL_EGRESS] = egress
    annotations = {ANNOTATION_TOKEN_SHA256: TOKEN}
    if allow is not None:
        annotations[ANNOTATION_EGRESS_ALLOW] = allow
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "labels": labels, "annotations": annotations},
            "spec": {"containers": [{"name": "task", "image": "swe-task:1"}]}}


def refusal(p: dict, policy: SandboxPolicy = POLICY) -> str:
    with pytest.raises(SandboxError) as e:
        make_sandbox(p, policy)
    msg = e.value.refusal.message()
    assert "\n" not in msg and e.value.refusal.rule in RULES
    # The validating check says the same about the pod as it arrives.
    assert msg in [r.message() for r in check_sandbox(p, policy)]
    return msg


def test_the_annotation_becomes_netguards_args_and_the_pod_passes():
    args = netguard_args(pod(), POLICY)
    i = args.index("--allow-egress")
    assert args[i:i + 8] == ["--allow-egress", "10.0.0.0/8:443/tcp",
                             "--allow-egress", "[fd00:1::/64]:443/tcp",
                             "--allow-egress", "svc/pypi.infra:3141/tcp",
                             "--never-egress", "10.100.0.0/16"]
    made = make_sandbox(pod(), POLICY)
    assert check_sandbox(made, POLICY) == []
    assert make_sandbox(made, POLICY) == made  # idempotent
    # netguard's own parser reads them as the same entries.
    from netguard.cli import build_parser
    from netguard.config import Config

    parsed = build_parser().parse_args(["apply", *made["spec"]["initContainers"][0]["args"]])
    cfg = Config.from_strings(parsed.egress, parsed.allow_egress, None, None, None, None,
                              parsed.never_egress)
    assert [str(a) for a in cfg.allow_egress] == ["10.0.0.0/8:443/tcp", "[fd00:1::/64]:443/tcp"]
    assert cfg.allow_services == ("svc/pypi.infra:3141/tcp",)


def test_without_the_annotation_nothing_changes():
    args = netguard_args(pod(None), POLICY)
    assert "--allow-egress" not in args and "--never-egress" not in args
    assert netguard_args(pod(None), POLICY) == netguard_args(pod(None), SandboxPolicy())


@pytest.mark.parametrize("allow,egress,rule,why", [
    (ALLOW, "allow", "egress-allow-invalid", "needs label sandman.dev/egress=deny"),
    (ALLOW, None, "egress-allow-invalid", "needs label sandman.dev/egress=deny"),
    ("", "deny", "egress-allow-invalid", "canonically"),
    ("10.0.0.0/8:443", "deny", "egress-allow-invalid", "canonically ('10.0.0.0/8:443/tcp')"),
    ("svc/pypi.infra:3141/tcp,10.0.0.0/8:443/tcp", "deny", "egress-allow-invalid",
     "canonically"),  # unsorted
    ("10.0.0.0/8:443/tcp,10.0.0.0/8:443/tcp", "deny", "egress-allow-invalid", "canonically"),
    ("10.0.0.0/8:443/tcp, 10.1.0.0/16:80/tcp", "deny", "egress-allow-invalid", "canonically"),
    ("10.1.2.3/8:443/tcp", "deny", "egress-allow-invalid", "host bits"),
    ("10.0.0.0/8:1-1024/tcp", "deny", "egress-allow-invalid", "port must be"),
    ("10.0.0.0/8:*/tcp", "deny", "egress-allow-invalid", "port must be"),
    ("svc/*.infra:80/tcp", "deny", "egress-allow-invalid", "not a Service name"),
    (",".join(f"10.0.{i}.0/24:443/tcp" for i in range(33)), "deny", "egress-allow-invalid",
     "at most 32"),
    ("11.0.0.0/8:443/tcp", "deny", "egress-allow-refused", "outside the cluster's ceiling"),
    ("0.0.0.0/0:443/tcp", "deny", "egress-allow-refused", "outside"),  # widened
    ("10.0.0.0/7:443/tcp", "deny", "egress-allow-refused", "outside"),
    ("[fd00:1::/64]:80/tcp", "deny", "egress-allow-refused", "outside"),  # another port
    ("10.0.0.0/8:443/udp", "deny", "egress-allow-refused", "outside"),  # another protocol
    ("svc/pypi.other:3141/tcp", "deny", "egress-allow-refused", "outside"),  # namespace
    ("svc/coredns.kube-system:53/udp", "deny", "egress-allow-refused", "outside"),
    ("10.96.0.1/32:443/tcp", "deny", "egress-allow-refused", "never allowed"),  # API server
    ("10.100.5.0/24:443/tcp", "deny", "egress-allow-refused", "never allowed"),
])
def test_hostile_allowlists_are_refused_in_one_line(allow, egress, rule, why):
    msg = refusal(pod(allow, egress))
    assert msg.startswith(f"sandman {rule}: ") and why in msg, msg


def test_the_metadata_and_link_local_are_never_allowed_even_under_a_wide_ceiling():
    wide = dataclasses.replace(POLICY, egress_ceiling=("0.0.0.0/0:*", "[::/0]:*"))
    for entry in ("169.254.169.254/32:80/tcp", "169.254.0.0/16:80/tcp", "[fe80::/64]:80/tcp",
                  "[fd00:ec2::254/128]:80/tcp", "100.100.100.200/32:80/tcp"):
        assert "is never allowed" in refusal(pod(entry), wide)
    # ...while an entry containing them is admitted: netguard carves them out.
    assert "--allow-egress" in netguard_args(pod("0.0.0.0/0:443/tcp"), wide)


def test_an_empty_ceiling_refuses_every_allowlist():
    msg = refusal(pod(), dataclasses.replace(POLICY, egress_ceiling=()))
    assert "sandbox.egressCeiling is empty" in msg


def test_the_api_server_fails_closed_when_unknown_and_its_endpoints_must_be_carved():
    unknown = dataclasses.replace(POLICY, api_server=())
    assert "cannot tell the API server's address" in refusal(pod(), unknown)
    # An endpoint inside an entry that no never CIDR covers: netguard could not carve it out.
    endpoints = dataclasses.replace(POLICY, api_server=("10.96.0.1", "10.0.5.5"))
    msg = refusal(pod("10.0.0.0/8:443/tcp"), endpoints)
    assert "contains the API server's endpoint 10.0.5.5" in msg and "egressNever" in msg
    covered = dataclasses.replace(endpoints, egress_never=("10.0.5.0/24",))
    assert "--never-egress" in netguard_args(pod("10.0.0.0/8:443/tcp"), covered)
    assert "never allowed" in refusal(pod("10.0.5.5/32:443/tcp"), endpoints)
    # The controller (api_server None) leaves these checks to the webhook.
    controller = dataclasses.replace(POLICY, api_server=None)
    assert "--allow-egress" in netguard_args(pod(), controller)


def test_a_tampered_guard_is_refused():
    made = make_sandbox(pod(), POLICY)
    for edit in (lambda a: a + ["--allow-egress", "0.0.0.0/0:443/tcp"],  # extra netguard args
                 lambda a: [x for x in a if x not in ("--never-egress", "10.100.0.0/16")],
                 lambda a: [("0.0.0.0/0:443/tcp" if x == "10.0.0.0/8:443/tcp" else x)
                            for x in a]):
        p = copy.deepcopy(made)
        g = p["spec"]["initContainers"][0]
        assert g["name"] == NETGUARD_CONTAINER
        g["args"] = edit(g["args"])
        rules = {r.rule for r in check_sandbox(p, POLICY)}
        assert "guard-misconfigured" in rules, g["args"]


def test_the_annotation_cannot_change_after_create():
    made = make_sandbox(pod(), POLICY)
    for value in ("10.0.0.0/8:443/tcp", None):
        new = copy.deepcopy(made)
        if value is None:
            del new["metadata"]["annotations"][ANNOTATION_EGRESS_ALLOW]
        else:
            new["metadata"]["annotations"][ANNOTATION_EGRESS_ALLOW] = value
        refusals = check_update(new, made, POLICY)
        assert any(r.rule == "metadata-immutable" and ANNOTATION_EGRESS_ALLOW in r.detail
                   for r in refusals), refusals
    # Added later to a running pod without one: refused the same way.
    plain = make_sandbox(pod(None), POLICY)
    added = copy.deepcopy(plain)
    added["metadata"]["annotations"][ANNOTATION_EGRESS_ALLOW] = "10.0.0.0/8:443/tcp"
    assert any(r.rule == "metadata-immutable" for r in check_update(added, plain, POLICY))
    assert check_update(copy.deepcopy(made), made, POLICY) == []
    # The controller's state label on a running allowlisted sandbox: its guard applied deny
    # with exactly the pod's own list, so the update passes.
    leased = copy.deepcopy(made)
    leased["metadata"]["labels"]["sandman.dev/state"] = "leased"
    assert check_update(leased, made, POLICY) == []


@pytest.mark.slow
def test_a_bad_ceiling_or_never_flag_is_refused_in_one_line():
    for flags, why in ((["--egress-ceiling", "10.0.0.0/8"], "a port is required"),
                       (["--egress-ceiling", "10.0.0.0/8:*,svc/a.b.c:*"], "not a namespace"),
                       (["--egress-never", "10.0.0.1/8"], "egress never range")):
        p = subprocess.run([sys.executable, "-m", "webhook", "serve", "--self-signed-dir",
                            "/nonexistent/never-created", *flags], capture_output=True,
                           text=True, timeout=60, cwd=ROOT)
        assert p.returncode == 2, p.stderr
        last = p.stderr.strip().splitlines()[-1]
        assert why in last and "Traceback" not in p.stderr, p.stderr
    assert not Path("/nonexistent/never-created").exists()


def test_the_flags_make_the_policy(monkeypatch):
    import argparse

    from webhook import __main__ as cli
    from webhook.__main__ import api_server_addresses, policy_from

    parser = argparse.ArgumentParser()
    cli._policy_args(parser)
    args = parser.parse_args(["--egress-ceiling", "10.0.0.0/8:*, svc/*.infra:*",
                              "--egress-ceiling", "[fd00::/8]:443", "--egress-never",
                              "10.100.0.0/16,10.101.0.0/16"])
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    pol = policy_from(args, api_server_addresses())
    assert pol.egress_ceiling == ("10.0.0.0/8:*/tcp", "[fd00::/8]:443/tcp", "svc/*.infra:*/tcp")
    assert pol.egress_never == ("10.100.0.0/16", "10.101.0.0/16")
    assert pol.api_server == ("10.96.0.1",)
    for bad in ("", "kubernetes.default", "10.96.0.0/12"):
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", bad)
        assert api_server_addresses() == ()
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    assert api_server_addresses() == ()


@pytest.mark.parametrize("spec", [
    {"hostAliases": [{"ip": "203.0.113.7", "hostnames": ["pypi.infra.svc.cluster.local"]}]},
    {"dnsPolicy": "None", "dnsConfig": {"nameservers": ["203.0.113.53"]}},
    {"dnsConfig": {"searches": ["svc.attacker.example"]}},  # with ClusterFirst too
    {"dnsPolicy": "Default"},  # the node's resolver
])
def test_svc_entries_need_the_clusters_own_resolver(spec):
    p = pod()
    p["spec"].update(spec)
    assert "netguard resolves through the cluster's DNS" in refusal(p)
    # CIDR entries resolve nothing: the same pod with only those is admitted.
    q = pod("10.0.0.0/8:443/tcp")
    q["spec"].update(spec)
    assert "--allow-egress" in netguard_args(q, POLICY)


def test_the_webhook_process_judges_allowlists_by_its_flags_and_its_env(tmp_path, monkeypatch):
    """`python -m webhook serve` with the chart's egress flags, over HTTPS on 127.0.0.1: every
    egress golden case answers as pinned; started without KUBERNETES_SERVICE_HOST (it cannot
    tell the API server's address), the same allowlist is refused in one line."""
    from testbed.webhook import start_webhook
    from tests.webhook import golden_cases
    from tests.webhook.test_golden import decode, load

    pol = golden_cases.EGRESS_POLICY
    flags = [f"--egress-ceiling={','.join(pol.egress_ceiling)}",
             *(f"--egress-never={n}" for n in pol.egress_never)]
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", pol.api_server[0])
    server = start_webhook(tmp_path / "with-env", *flags)
    try:
        with server.client() as c:
            for name in golden_cases.EGRESS_CASES:
                review, expected = load(name)
                r = c.post("/mutate" if name.startswith("mutate-") else "/validate",
                           json=review)
                assert r.status_code == 200 and decode(r.json()) == expected, name
    finally:
        server.stop()
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    server = start_webhook(tmp_path / "without-env", *flags)
    try:
        with server.client() as c:
            review, _ = load("validate-egress-allow-within-ceiling-allowed")
            out = c.post("/validate", json=review).json()["response"]
        assert out["allowed"] is False
        msg = out["status"]["message"]
        assert msg.startswith("sandman egress-allow-refused: egress allowlists are refused: "
                              "the webhook cannot tell the API server's address"), msg
        assert "\n" not in msg
    finally:
        server.stop()
