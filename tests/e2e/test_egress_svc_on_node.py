"""`svc/NAME.NAMESPACE:PORT` allowlist entries end to end on the real node: netguard resolves
them through the pod's cluster DNS (the bed's CoreDNS) when the pod starts and opens the
Service's ClusterIP, which kube-proxy translates on the node to the Service's endpoint.

The Services are selector-less with hand-made EndpointSlices pointing at the fake outside:
`egress-a` (port 80 to 198.18.0.1:8181, port 81 to :8182) is the one the sandboxes list,
`egress-b` (port 80 to :8182) the one they do not, and `egress-alias` an ExternalName Service
naming `egress-b`. testbed/values-realnode.yaml's ceiling admits any Service of
SVC_NS on TCP. A sandbox listing `svc/egress-a.SVC_NS:80/tcp` reaches egress-a's ClusterIP on
port 80 (the positive control), while egress-a's other port, egress-b, the endpoint itself
(198.18.0.1:8181, the same server behind the ClusterIP) and the metadata address stay blocked;
an unguarded pod reaches all of them, so each block is the guard's. An entry for a namespace
outside the ceiling is refused in one line; an entry naming the ExternalName Service fails the
pod closed in its guard (an alias: whoever may create Services in an admitted namespace could
point it anywhere), and the sandbox never runs.
"""

from __future__ import annotations

import json
import time

import pytest
from kubernetes import client

from sandman.contract import ANNOTATION_EGRESS_ALLOW, LABEL_EGRESS, NETGUARD_CONTAINER
from sandman.egress import parse_list, render
from testbed import realnode
from testbed.cluster import delete_namespace, new_namespace
from tests.e2e.helpers import (
    assert_only_allowed,
    guard_rules,
    new_token,
    plain_pod,
    refusal,
    sandbox_pod,
)
from tests.e2e.test_sdk import run_trainer

# Fixed: testbed/values-realnode.yaml's sandbox.egressCeiling names it.
SVC_NS = "sandman-e2e-egress"
OUT, METADATA = realnode.OUTSIDE_IP, realnode.METADATA_IP
PORT_A, PORT_B = 8181, 8182  # the fake outside's servers behind the Services
ALLOWED = f"svc/egress-a.{SVC_NS}:80/tcp"  # canonical: what the annotation and netguard carry
ALIAS = f"svc/egress-alias.{SVC_NS}:80/tcp"
OUTSIDE_CEILING = "svc/egress-a.default:80/tcp"
FQDN_B = f"egress-b.{SVC_NS}.svc.{realnode.CLUSTER_DOMAIN}"


def _service(name: str, ports: list[tuple[str, int, int]]) -> tuple[dict, dict]:
    """A selector-less Service and its EndpointSlice: (port name, port, the outside's port)."""
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name},
           "spec": {"ports": [{"name": n, "port": p, "targetPort": t, "protocol": "TCP"}
                              for n, p, t in ports]}}
    eps = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
           "metadata": {"name": name, "labels": {"kubernetes.io/service-name": name}},
           "addressType": "IPv4",
           "endpoints": [{"addresses": [OUT], "conditions": {"ready": True}}],
           "ports": [{"name": n, "port": t, "protocol": "TCP"} for n, _p, t in ports]}
    return svc, eps


def _gone(core: client.CoreV1Api, timeout: float = 90) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            core.read_namespace(SVC_NS)
        except client.ApiException as e:
            if e.status == 404:
                return True
            raise
        time.sleep(1)
    return False


@pytest.fixture(scope="module")
def services(e2e):
    """SVC_NS with egress-a, egress-b (selector-less, EndpointSlices to the fake outside) and
    egress-alias (ExternalName to egress-b); the ClusterIPs by name. The namespace (and so
    everything in it) is deleted afterwards, whatever happened."""
    if e2e.install_error:
        pytest.fail(f"helm install --wait failed: {e2e.install_error}", pytrace=False)
    core = e2e.core
    disc = client.DiscoveryV1Api(e2e.cluster.api_client)
    # A namespace left by an interrupted run: wait for its deletion to finish first.
    delete_namespace(core, SVC_NS)
    assert _gone(core), f"namespace {SVC_NS} still terminating"
    try:
        new_namespace(core, SVC_NS)
        ips = {}
        for name, ports in (("egress-a", [("a", 80, PORT_A), ("b", 81, PORT_B)]),
                            ("egress-b", [("b", 80, PORT_B)])):
            svc, eps = _service(name, ports)
            ips[name] = core.create_namespaced_service(SVC_NS, svc).spec.cluster_ip
            disc.create_namespaced_endpoint_slice(SVC_NS, eps)
        core.create_namespaced_service(SVC_NS, {
            "apiVersion": "v1", "kind": "Service", "metadata": {"name": "egress-alias"},
            "spec": {"type": "ExternalName", "externalName": FQDN_B}})
        yield ips
    finally:
        delete_namespace(core, SVC_NS)
        assert _gone(core), f"namespace {SVC_NS} not deleted"


@pytest.fixture
def outside(sandman):
    servers = [realnode.serve_outside("tcp", OUT, PORT_A, lifetime=400),
               realnode.serve_outside("tcp", OUT, PORT_B, lifetime=400),
               realnode.serve_outside("tcp", METADATA, 80, lifetime=400)]
    try:
        yield servers
    finally:
        for s in servers:
            s.stop()


def _targets(ips: dict) -> dict[str, tuple[str, int]]:
    return {"allowed": (ips["egress-a"], 80), "service-other-port": (ips["egress-a"], 81),
            "other-service": (ips["egress-b"], 80), "endpoint-direct": (OUT, PORT_A),
            "metadata": (METADATA, 80)}


def _probes(e2e, ns: str, pod: str, ips: dict) -> dict:
    return {k: e2e.probe(ns, pod, "tcp", host, str(port))
            for k, (host, port) in _targets(ips).items()}


def _control_reaches_all(e2e, ns: str, ips: dict) -> dict:
    """The unguarded pod's probes once kube-proxy has the Services' rules (bounded wait)."""
    deadline = time.monotonic() + 30
    while True:
        got = _probes(e2e, ns, "control", ips)
        if all(p.ok for p in got.values()) or time.monotonic() > deadline:
            return got
        time.sleep(1)


def _deny_pod(name: str, sha: str, allow: str) -> dict:
    return sandbox_pod(name, sha, labels={LABEL_EGRESS: "deny"},
                       annotations={ANNOTATION_EGRESS_ALLOW: allow})


def _guard_failure(pod) -> str:
    """The guard's termination message once it exited non-zero, or "" while it has not."""
    for c in pod.status.init_container_statuses or []:
        if c.name != NETGUARD_CONTAINER:
            continue
        for t in (c.state.terminated if c.state else None,
                  c.last_state.terminated if c.last_state else None):
            if t is not None and t.exit_code != 0:
                return t.message or "(no message)"
    return ""


def test_a_labelled_pod_reaches_only_its_service(sandman, ns, services, outside):
    assert render(parse_list([ALLOWED, ALIAS])) == f"{ALLOWED},{ALIAS}"  # both canonical
    _token, sha = new_token()
    sandman.create(ns, _deny_pod("sbx-svc", sha, ALLOWED))
    sandman.create(ns, _deny_pod("sbx-alias", sha, ALIAS))
    sandman.run_ready(ns, plain_pod("control"))
    control = _control_reaches_all(sandman, ns, services)
    pod = sandman.wait_ready(ns, "sbx-svc")
    got = _probes(sandman, ns, "sbx-svc", services)
    assert_only_allowed(control, got, ("service-other-port", "other-service", "endpoint-direct",
                                       "metadata"))
    # The webhook gave netguard the entry; netguard opened the ClusterIP it resolved, only.
    rules = guard_rules(sandman, ns, pod, ALLOWED)
    assert f"-d {services['egress-a']}/32 -p tcp -m tcp --dport 80" in rules, rules
    assert f"allow egress {ALLOWED} at {services['egress-a']}/32:80/tcp" in rules, rules
    assert f"-d {services['egress-b']}/32" not in rules and f"-d {OUT}/32" not in rules, rules

    # The ExternalName entry: the guard fails closed naming the alias, the sandbox never runs.
    alias = sandman.wait_pod(ns, "sbx-alias", _guard_failure, "failed in its guard", 120)
    message = _guard_failure(alias)
    assert f"--allow-egress {ALIAS!r}" in message and f"an alias for {FQDN_B}" in message, (
        message)
    assert message.strip().count("\n") == 0, message
    assert alias.status.phase == "Pending", sandman.describe(ns, "sbx-alias", alias)
    assert not any(c.state.running for c in alias.status.container_statuses or []), (
        sandman.describe(ns, "sbx-alias", alias))


def test_a_service_outside_the_ceiling_is_refused(sandman, ns):
    _token, sha = new_token()
    message = refusal(sandman, ns, _deny_pod("sbx-refused", sha, OUTSIDE_CEILING))
    assert repr(OUTSIDE_CEILING) in message and "\n" not in message, message
    assert sandman.core.list_namespaced_pod(ns).items == []


SDK_SCRIPT = r"""
import json, os, shlex
from sandman.client import BadRequest, Client
res = {}
allowed = os.environ["ALLOWED"]
# One TCP connect from inside the sandbox: what the agent itself can reach.
probe = ("import socket, sys\n"
         "s = socket.socket(); s.settimeout(3)\n"
         "try:\n    s.connect((sys.argv[1], int(sys.argv[2]))); print('open')\n"
         "except OSError as e:\n    print('blocked', type(e).__name__)\n")
spec = dict(image=os.environ["TASK_IMAGE"], job="e2e-egress-svc", cpu="100m", memory="128Mi",
            timeout_s=150)
with Client(timeout_s=60) as c:
    try:
        c.acquire(**spec, egress={"allow": [os.environ["OUTSIDE_CEILING"]]}).release()
        res["refused"] = "ACQUIRED"
    except BadRequest as e:
        res["refused"] = e.message
    # Written without the protocol: the SDK canonicalises it.
    with c.acquire(**spec, egress={"allow": [allowed.rsplit("/", 1)[0]]},
                   conditions={"egress_allow": [allowed]}) as sb:
        res["pod"] = sb.pod
        res["info"] = [c.get(sb.id).egress, c.get(sb.id).egress_allow]
        check = sb.conditions_check
        res["verified"] = sorted(check.verified) if check else None
        for name, (host, port) in json.loads(os.environ["TARGETS"]).items():
            r = sb.exec(f"python3 -c {shlex.quote(probe)} {host} {port}", timeout=30)
            res[name] = r.output.strip()
print("E2E-RESULT " + json.dumps(res))
"""


def test_an_sdk_acquire_reaches_only_its_service(sandman, ns, services, outside):
    res = run_trainer(sandman, ns, "trainer-egress-svc", SDK_SCRIPT, ALLOWED=ALLOWED,
                      OUTSIDE_CEILING=OUTSIDE_CEILING, TARGETS=json.dumps(_targets(services)))
    assert res["refused"].startswith(f"egress entry {OUTSIDE_CEILING!r} is outside"), res
    assert "\n" not in res["refused"], res
    assert res["info"] == ["deny", [ALLOWED]], res
    assert res["verified"] is not None and "egress_allow" in res["verified"], res
    assert res["allowed"] == "open", res
    for k in ("service-other-port", "other-service", "endpoint-direct", "metadata"):
        assert res[k].startswith("blocked"), (k, res)
