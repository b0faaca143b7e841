"""Egress allowlists on the real node, installed with testbed/values-realnode.yaml, whose
ceiling (`sandbox.egressCeiling`) is the fake outside on TCP. A sandbox that asks for one
port of one fake-outside address reaches it (the positive control that proves the allowlist
opens something), while the same address on another port, another fake-outside address on the
same port, the same port over UDP and the metadata address stay blocked (the negative
controls). An unguarded pod beside it reaches every one of those servers, so each block is the
guard's. Two ways in: a labelled pod written by a plain client (the webhook renders netguard's
args from its annotation) and an SDK acquire through the controller (which validates the list,
builds the pod, and probes the declared allowlist). Entries outside the ceiling are refused
with one line naming them, before any pod exists.
"""

from __future__ import annotations

import json

import pytest

from sandman.contract import ANNOTATION_EGRESS_ALLOW, LABEL_EGRESS
from testbed import realnode
from tests.e2e.helpers import (
    assert_only_allowed,
    guard_rules,
    new_token,
    plain_pod,
    refusal,
    sandbox_pod,
)
from tests.e2e.test_sdk import run_trainer

OUT, OUT2, METADATA = realnode.OUTSIDE_IP, realnode.OUTSIDE_IP2, realnode.METADATA_IP
PORT_A, PORT_B = 8181, 8182
ALLOWED = f"{OUT}/32:{PORT_A}/tcp"  # canonical: what the annotation and netguard carry


@pytest.fixture
def outside(sandman):
    servers = [realnode.serve_outside("tcp", OUT, PORT_A, lifetime=400),
               realnode.serve_outside("tcp", OUT, PORT_B, lifetime=400),
               realnode.serve_outside("tcp", OUT2, PORT_A, lifetime=400),
               realnode.serve_outside("udp", OUT, PORT_A, lifetime=400),
               realnode.serve_outside("tcp", METADATA, 80, lifetime=400)]
    try:
        yield servers
    finally:
        for s in servers:
            s.stop()


def _probes(e2e, ns: str, pod: str) -> dict:
    return {
        "allowed": e2e.probe(ns, pod, "tcp", OUT, str(PORT_A)),
        "other-port": e2e.probe(ns, pod, "tcp", OUT, str(PORT_B)),
        "other-host": e2e.probe(ns, pod, "tcp", OUT2, str(PORT_A)),
        "udp-same-port": e2e.probe(ns, pod, "udp", OUT, str(PORT_A)),
        "metadata": e2e.probe(ns, pod, "tcp", METADATA, "80"),
    }


def _deny_pod(name: str, sha: str, allow: str, egress: str = "deny") -> dict:
    return sandbox_pod(name, sha, labels={LABEL_EGRESS: egress},
                       annotations={ANNOTATION_EGRESS_ALLOW: allow})


def test_a_labelled_pod_reaches_only_its_allowlist(sandman, ns, outside):
    _token, sha = new_token()
    sandman.create(ns, _deny_pod("sbx-allow", sha, ALLOWED))
    sandman.run_ready(ns, plain_pod("control"))
    pod = sandman.wait_ready(ns, "sbx-allow")
    control = _probes(sandman, ns, "control")
    got = _probes(sandman, ns, "sbx-allow")
    assert_only_allowed(control, got, ("other-port", "other-host", "udp-same-port", "metadata"))
    # The webhook gave netguard exactly the annotation's entry.
    rules = guard_rules(sandman, ns, pod, ALLOWED)
    assert f"-d {OUT}/32 -p tcp -m tcp --dport {PORT_A}" in rules, rules


# Each refused create: (annotation, egress label, what the one-line refusal must say).
REFUSED = [
    ("10.0.0.0/8:22/tcp", "deny", "'10.0.0.0/8:22/tcp'"),  # outside the ceiling
    (f"{OUT}/32:{PORT_A}/udp", "deny", f"'{OUT}/32:{PORT_A}/udp'"),  # the ceiling is TCP
    (f"{OUT}/31:{PORT_A}/tcp", "deny", f"'{OUT}/31:{PORT_A}/tcp'"),  # host bits: not canonical
    (f"{METADATA}/32:80/tcp", "deny", f"'{METADATA}/32:80/tcp'"),  # never allowed
    (ALLOWED, "allow", LABEL_EGRESS),  # a list means nothing without the deny
]


def test_a_labelled_pod_outside_the_ceiling_is_refused(sandman, ns):
    _token, sha = new_token()
    for i, (allow, egress, says) in enumerate(REFUSED):
        message = refusal(sandman, ns, _deny_pod(f"sbx-refused-{i}", sha, allow, egress))
        assert says in message, (allow, message)
    assert sandman.core.list_namespaced_pod(ns).items == []


SDK_SCRIPT = r"""
import json, os, shlex
from sandman.client import BadRequest, Client
res = {"refused": []}
allowed = os.environ["ALLOWED"]
# One TCP connect from inside the sandbox: what the agent itself can reach.
probe = ("import socket, sys\n"
         "s = socket.socket(); s.settimeout(3)\n"
         "try:\n    s.connect((sys.argv[1], int(sys.argv[2]))); print('open')\n"
         "except OSError as e:\n    print('blocked', type(e).__name__)\n")
spec = dict(image=os.environ["TASK_IMAGE"], job="e2e-egress", cpu="100m", memory="128Mi",
            timeout_s=150)
with Client(timeout_s=60) as c:
    for bad in (["10.0.0.0/8:22"], ["169.254.169.254:80"]):
        try:
            c.acquire(**spec, egress={"allow": bad}).release()
            res["refused"].append("ACQUIRED " + bad[0])
        except BadRequest as e:
            res["refused"].append(e.message)
    with c.acquire(**spec, egress={"allow": [allowed.rsplit("/", 1)[0]]},
                   conditions={"egress_allow": [allowed]}) as sb:
        res["pod"] = sb.pod
        res["info"] = [c.get(sb.id).egress, c.get(sb.id).egress_allow]
        check = sb.conditions_check
        res["verified"] = sorted(check.verified) if check else None
        for name, target in json.loads(os.environ["TARGETS"]).items():
            host, port = target.rsplit(":", 1)
            r = sb.exec(f"python3 -c {shlex.quote(probe)} {host} {port}", timeout=30)
            res[name] = r.output.strip()
print("E2E-RESULT " + json.dumps(res))
"""


def test_an_sdk_acquire_reaches_only_its_allowlist(sandman, ns, outside):
    targets = {"allowed": f"{OUT}:{PORT_A}", "other-port": f"{OUT}:{PORT_B}",
               "other-host": f"{OUT2}:{PORT_A}", "metadata": f"{METADATA}:80"}
    res = run_trainer(sandman, ns, "trainer-egress", SDK_SCRIPT, ALLOWED=ALLOWED,
                      TARGETS=json.dumps(targets))
    assert res["refused"][0].startswith("egress entry '10.0.0.0/8:22/tcp' is outside"), res
    assert "is never allowed" in res["refused"][1], res
    assert all("\n" not in m for m in res["refused"]), res
    assert res["info"] == ["deny", [ALLOWED]], res
    assert res["verified"] is not None and "egress_allow" in res["verified"], res
    assert res["allowed"] == "open", res
    for k in ("other-port", "other-host", "metadata"):
        assert res[k].startswith("blocked"), (k, res)
