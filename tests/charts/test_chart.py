"""The chart without a cluster: lint, golden renders, the schema, and the contract.

Golden files: `helm template sandman charts/sandman -n sandman-system [-f values/<case>.yaml]`
is compared byte for byte with testdata/<case>.golden.yaml. Regenerate after a deliberate
change with `SANDMAN_GOLDEN_UPDATE=1 .venv/bin/pytest tests/charts/test_chart.py` and review
the diff.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from charts import gen_contract
from sandman import api, contract
from tests.charts.helm import CHART, NAMESPACE, RELEASE, Helm, objects
from webhook import policy as vap
from webhook.manifests import configurations

TESTDATA = Path(__file__).parent / "testdata"
CASES = ["default"] + sorted(p.stem for p in (TESTDATA / "values").glob("*.yaml"))
UPDATE = os.environ.get("SANDMAN_GOLDEN_UPDATE") == "1"


@pytest.fixture(scope="module")
def helm(tmp_path_factory) -> Helm:
    return Helm(tmp_path_factory.mktemp("helm-home"))


def _values_args(case: str) -> list[str]:
    return [] if case == "default" else ["-f", str(TESTDATA / "values" / f"{case}.yaml")]


def _render(helm: Helm, *args: str) -> list[dict]:
    return objects(helm.template(*args).stdout)


def _find(objs: list[dict], kind: str, suffix: str = "") -> dict:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"].endswith(suffix)]
    assert len(found) == 1, f"{kind} *{suffix}: {[o['metadata']['name'] for o in found]}"
    return found[0]


def test_lint_strict(helm):
    for case in CASES:
        res = helm.run("lint", "--strict", str(CHART), "--namespace", NAMESPACE,
                       *_values_args(case), check=False)
        assert res.returncode == 0, f"{case}: {res.stdout}{res.stderr}"
        assert "0 chart(s) failed" in res.stdout


@pytest.mark.parametrize("case", CASES)
def test_golden(helm, case):
    got = helm.template(*_values_args(case)).stdout
    golden = TESTDATA / f"{case}.golden.yaml"
    if UPDATE:
        golden.write_text(got)
    assert golden.exists(), f"no {golden.name}; run with SANDMAN_GOLDEN_UPDATE=1"
    assert got == golden.read_text(), (
        f"helm template differs from {golden.name}; if intended, regenerate with "
        "SANDMAN_GOLDEN_UPDATE=1 and review the diff")


def test_kube_version_is_what_the_chart_renders(helm):
    # The oldest minor `make test-compat` passed on (its policy's CEL needs 1.33): below it,
    # one line instead of an API error half-way.
    old = helm.template("--kube-version", "1.32.9", check=False)
    assert old.returncode != 0
    assert "chart requires kubeVersion: >=1.33.0-0" in old.stderr and "v1.32.9" in old.stderr
    new = helm.template("--kube-version", "1.33.0")
    kinds = {o["kind"]: o["apiVersion"] for o in objects(new.stdout)}
    assert kinds["ValidatingAdmissionPolicy"] == "admissionregistration.k8s.io/v1"


def test_one_resource_per_file_named_component_kind(helm):
    """The Gatekeeper layout: templates/<component>-<kind>.yaml holds one <kind>."""
    res = helm.template(*_values_args("custom-selectors"))
    sources = [line.split("# Source: ", 1)[1] for line in res.stdout.splitlines()
               if line.startswith("# Source: ")]
    assert len(sources) == len(set(sources)), "a template renders more than one object"
    docs = res.stdout.split("\n---\n")
    for doc in docs:
        if "# Source: " not in doc:
            continue
        src = doc.split("# Source: ", 1)[1].split("\n", 1)[0]
        kind = objects(doc)[0]["kind"].lower()
        assert Path(src).name.endswith(f"{kind}.yaml"), f"{src} holds a {kind}"


def test_contract_template_is_generated_from_the_contract():
    tpl = CHART / "templates" / "_contract.tpl"
    assert tpl.read_text() == gen_contract.render(), (
        "_contract.tpl is stale: run .venv/bin/python charts/gen_contract.py")
    assert gen_contract.POLICY_TPL.read_text() == gen_contract.render_policy(), (
        "_policy.tpl is stale: run .venv/bin/python charts/gen_contract.py")
    assert gen_contract.BOOKS_POLICY_TPL.read_text() == gen_contract.render_books_policy(), (
        "_books_policy.tpl is stale: run .venv/bin/python charts/gen_contract.py")


def test_contract_names_render_equal_to_sandman_contract(helm, tmp_path):
    """Every `sandman.contract.*` and `sandman.api.*` template renders exactly the value of
    sandman/contract.py and sandman/api.py."""
    chart = tmp_path / "sandman"
    shutil.copytree(CHART, chart)
    names = {f"contract.{n}": v for n, v in gen_contract.constants().items()}
    names |= {f"api.{n}": v for n, v in gen_contract.api_constants().items()}
    lines = ["apiVersion: v1", "kind: ConfigMap", "metadata:", "  name: contract-check", "data:"]
    lines += [f'  {n}: {{{{ include "sandman.{n}" . | quote }}}}' for n in names]
    (chart / "templates" / "zz-contract-check.yaml").write_text("\n".join(lines) + "\n")
    res = helm.run("template", RELEASE, str(chart), "--namespace", NAMESPACE,
                   "--show-only", "templates/zz-contract-check.yaml")
    data = objects(res.stdout)[0]["data"]
    assert data == {n: str(v) for n, v in names.items()}
    # The check above is not vacuous.
    assert data["contract.LABEL_SANDBOX"] == contract.LABEL_SANDBOX
    assert data["api.READYZ"] == api.READYZ.path == "/readyz"


def test_controller_probes_and_scrape_use_the_api_routes(helm):
    objs = _render(helm, "--set", "serviceMonitor.enabled=true")
    c = _find(objs, "Deployment", "-controller")["spec"]["template"]["spec"]["containers"][0]
    assert c["readinessProbe"]["httpGet"]["path"] == api.READYZ.path
    assert c["livenessProbe"]["httpGet"]["path"] == api.LIVEZ.path
    assert _find(objs, "ServiceMonitor", "-controller")["spec"]["endpoints"][0]["path"] == (
        api.METRICS.path)


def test_default_sandbox_size_is_the_api_default():
    """values.yaml cannot include a template: its defaults are checked against the contract."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())["sandbox"]
    assert (str(values["defaultCpu"]), str(values["defaultMemory"])) == (
        api.DEFAULT_CPU, api.DEFAULT_MEMORY)


def test_templates_spell_no_contract_name():
    """Nothing spells a contract name twice: templates include it from _contract.tpl."""
    spelled = {str(v) for k, v in gen_contract.constants().items()
               if isinstance(v, str) and contract.DOMAIN in v}
    assert spelled
    for path in (CHART / "templates").rglob("*"):
        # The generated files spell them from the contract (tested above to be current).
        if path.is_file() and path.name not in ("_contract.tpl", "_policy.tpl",
                                                    "_books_policy.tpl"):
            text = path.read_text()
            for name in spelled:
                assert name not in text, f"{path.name} spells {name}; include it instead"


def test_default_image_is_the_contract_image(helm):
    objs = _render(helm)
    dep = _find(objs, "Deployment", "-webhook")
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == contract.SANDMAN_IMAGE
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--image={contract.SANDMAN_IMAGE}" in args


def test_webhook_configurations_equal_webhook_manifests(helm):
    """The chart renders the objects webhook/manifests.py builds (service client config)."""
    assert not [o for o in _render(helm) if o["kind"] == "ValidatingWebhookConfiguration"], (
        "the validating webhook is off by default (docs/webhook.md: the policy replaces it)")
    objs = _render(helm, "--set", "webhook.validating.enabled=true")
    name = f"{RELEASE}-webhook-{NAMESPACE}"
    want_m, want_v = configurations(name, NAMESPACE, None,
                                    service=(NAMESPACE, f"{RELEASE}-webhook", 443))
    got_m = _find(objs, "MutatingWebhookConfiguration")
    got_v = _find(objs, "ValidatingWebhookConfiguration")
    assert got_m["metadata"]["name"] == got_v["metadata"]["name"] == name
    assert got_m["webhooks"] == want_m["webhooks"]
    assert got_v["webhooks"] == want_v["webhooks"]


def test_webhook_ha_defaults(helm):
    objs = _render(helm)
    dep = _find(objs, "Deployment", "-webhook")
    spec = dep["spec"]["template"]["spec"]
    assert dep["spec"]["replicas"] == 3
    res = spec["containers"][0]["resources"]
    assert res["requests"] == res["limits"] and res["limits"]["memory"] == "1Gi"
    assert spec["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert spec["priorityClassName"] == _find(objs, "PriorityClass")["metadata"]["name"]
    assert spec["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert _find(objs, "PodDisruptionBudget", "-webhook")["spec"]["maxUnavailable"] == 1
    # Never Helm's genCA, never a delete hook that removes the configurations: the only delete
    # hooks are the uninstall cleanup's (post-delete), whose RBAC has no admission objects.
    for obj in objs:
        hook = obj["metadata"].get("annotations", {}).get("helm.sh/hook", "")
        if "delete" in hook:
            assert hook == "post-delete", obj["metadata"]["name"]
            assert obj["metadata"]["labels"]["app.kubernetes.io/component"] == "cleanup"
            for rule in obj.get("rules", []):
                assert "admissionregistration.k8s.io" not in rule["apiGroups"], rule
    assert "genCA" not in "".join(p.read_text() for p in (CHART / "templates").rglob("*.*"))


UNNAMED_OK = [(["authentication.k8s.io"], ["tokenreviews"]),
              (["authorization.k8s.io"], ["subjectaccessreviews"]),
              ([contract.DOMAIN], ["sandboxes"]), ([contract.DOMAIN], ["sandboxes/prewarm"]),
              ([contract.DOMAIN], ["sandboxes/stats"]), ([contract.DOMAIN], ["sandboxes/images"]),
              # The capacity signals' event watch (other tenants' pod-address failures) and
              # the image pre-pull's node list: read-only, checked below.
              ([""], ["events"]), ([""], ["nodes"])]


def test_rbac_has_no_wildcards_and_nothing_cluster_wide_for_pods(helm):
    for case in CASES:
        objs = _render(helm, *_values_args(case))
        for obj in objs:
            if obj["kind"] not in ("Role", "ClusterRole"):
                continue
            for rule in obj["rules"]:
                for field in ("apiGroups", "resources", "verbs", "resourceNames"):
                    assert "*" not in rule.get(field, []), (case, obj["metadata"]["name"], rule)
                if obj["kind"] == "ClusterRole":
                    assert "pods" not in rule["resources"], (case, rule)
                    # Unnamed cluster-wide rules: only the controller's reviews (create-only,
                    # they change nothing) and the virtual sandboxes the controller checks.
                    if not rule.get("resourceNames"):
                        assert (rule["apiGroups"], rule["resources"]) in UNNAMED_OK, (
                            case, obj["metadata"]["name"], rule)
                    if rule["resources"] == ["events"]:
                        assert set(rule["verbs"]) <= {"list", "watch"}, (case, rule)
                    if rule["resources"] == ["nodes"]:
                        assert rule["verbs"] == ["list"], (case, rule)


def _not_hooks(objs: list[dict]) -> list[dict]:
    return [o for o in objs if "helm.sh/hook" not in o["metadata"].get("annotations", {})]


def test_cert_modes(helm):
    own = {o["kind"] for o in _not_hooks(_render(helm))}
    assert {"Job", "CronJob", "ClusterRole"} <= own and "Certificate" not in own
    cm = _render(helm, *_values_args("cert-manager"))
    kinds = {o["kind"] for o in _not_hooks(cm)}
    assert {"Certificate", "Issuer"} <= kinds and not kinds & {"Job", "CronJob"}
    # No ClusterRole for the webhook's certificates (the controller's reviews have theirs).
    assert not [o for o in cm if o["kind"] == "ClusterRole" and "-webhook" in
                o["metadata"]["name"]]
    m = _find(cm, "MutatingWebhookConfiguration")
    assert m["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == (
        f"{NAMESPACE}/{RELEASE}-webhook")
    dev = _render(helm, "--set", "webhook.development.url=https://127.0.0.1:9443",
                  "--set", "webhook.development.caBundle=Q0E=",
                  "--set", "webhook.validating.enabled=true")
    hook = _find(dev, "ValidatingWebhookConfiguration")["webhooks"][1]["clientConfig"]
    assert hook == {"url": "https://127.0.0.1:9443/validate", "caBundle": "Q0E="}


def test_certs_job_is_named_by_its_pod(helm):
    """Job pods are immutable: a changed image must give a new Job, an unchanged one the same."""
    def name(*args):
        return _find(_not_hooks(_render(helm, *args)), "Job")["metadata"]["name"]

    assert name() == name("--set", "controller.rate=5")
    assert name() != name("--set", "image.tag=0.1.1")
    assert name().startswith(f"{RELEASE}-webhook-certs-")


def test_network_policies(helm):
    objs = _render(helm)
    egress = _find(objs, "NetworkPolicy", "-sandbox-egress-deny")
    assert egress["spec"]["podSelector"]["matchLabels"] == {
        contract.LABEL_EGRESS: contract.EGRESS_DENY}
    assert egress["spec"]["egress"] == []
    ingress = _find(objs, "NetworkPolicy", "-sandbox-ingress")
    assert ingress["spec"]["ingress"][0]["ports"] == [{"port": contract.EXECD_PORT,
                                                       "protocol": "TCP"}]
    dns = _find(_render(helm, "--set", "networkPolicy.allowDNS=true"), "NetworkPolicy",
                "-sandbox-egress-deny")
    assert {p["port"] for p in dns["spec"]["egress"][0]["ports"]} == {53}
    assert not [o for o in _render(helm, *_values_args("netpol-off"))
                if o["kind"] == "NetworkPolicy"]


def test_the_egress_ceiling_network_policy_is_the_admins_bound(helm):
    """sandbox.egressCeiling becomes one more NetworkPolicy for egress=deny sandboxes: each
    entry an egress rule (never ranges inside it excepted), a Service by the pods
    behind it, DNS when a Service entry needs resolving; none without a ceiling."""
    assert not [o for o in _render(helm) if o["metadata"]["name"].endswith("-egress-ceiling")]
    objs = _render(helm, *_values_args("egress-allowlist"))
    pol = _find(objs, "NetworkPolicy", "-sandbox-egress-ceiling")
    assert pol["spec"]["podSelector"]["matchLabels"] == {
        contract.LABEL_EGRESS: contract.EGRESS_DENY}
    assert pol["spec"]["policyTypes"] == ["Egress"]
    rules = pol["spec"]["egress"]
    # 169.254.0.0/16, 0.0.0.0/32, 100.100.100.200/32 and 192.168.0.0/16 lie outside 10/8.
    assert rules[0] == {"to": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": [
        "10.96.0.1/32", "10.100.0.0/16"]}}], "ports": [{"protocol": "TCP"}]}
    assert rules[1] == {"to": [{"ipBlock": {"cidr": "fd00::/8", "except": [
        "fd00:ec2::254/128"]}}], "ports": [{"protocol": "TCP", "port": 443}]}
    assert rules[2] == {"to": [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "infra"}}}], "ports": [{"protocol": "TCP"}]}
    assert rules[3] == {"to": [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "mirrors"}}, "podSelector": {"matchLabels": {
            "app": "pypi-mirror"}}}], "ports": [{"protocol": "TCP", "port": 8080}]}
    assert rules[4]["ports"] == [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]
    assert len(rules) == 5
    # The webhook and the controller get the same ceiling and never list as flags.
    for name in ("-webhook", "-controller"):
        args = _find(objs, "Deployment", name)["spec"]["template"]["spec"]["containers"][0][
            "args"]
        assert [a for a in args if a.startswith("--egress-")] == [
            "--egress-ceiling=10.0.0.0/8:*", "--egress-ceiling=[fd00::/8]:443/tcp",
            "--egress-ceiling=svc/*.infra:*", "--egress-ceiling=svc/pypi-mirror.mirrors:3141",
            "--egress-never=10.96.0.1", "--egress-never=10.100.0.0/16",
            "--egress-never=192.168.0.0/16"], name


def test_the_ceiling_policys_except_lists_are_sandman_egress_carve_outs(helm):
    """Helm has no CIDR functions: the chart's prefix arithmetic (sandman.ipv4Inside,
    sandman.ipv6Inside) must except exactly what sandman/egress.py carves out of each entry
    (IPv4-mapped IPv6 aside, which no packet carries), on nibble-aligned and unaligned
    prefixes of both families."""
    import ipaddress

    from sandman import egress

    ceiling = ["0.0.0.0/0:*", "10.0.0.0/8:443", "10.96.0.0/11:443", "169.0.0.0/8:80",
               "100.64.0.0/10:80", "[::/0]:443", "[fd00::/8]:443", "[fe00::/7]:80",
               "[fe80::/9]:80", "[64:ff9b::/96]:443", "[fd00:ec0::/27]:443",
               "[2001:db8::/32]:443"]
    never = ["10.96.0.1", "10.100.0.0/16", "10.97.0.0/16", "fd00:abcd::/32", "2001:db8:8000::/33"]
    args = ["--set-json", f"sandbox.egressCeiling={json.dumps(ceiling)}",
            "--set-json", f"sandbox.egressNever={json.dumps(never)}"]
    pol = _find(_render(helm, *args), "NetworkPolicy", "-sandbox-egress-ceiling")
    got = {r["to"][0]["ipBlock"]["cidr"]: r["to"][0]["ipBlock"].get("except", [])
           for r in pol["spec"]["egress"]}
    extra = egress.parse_never(never)
    for text in ceiling:
        entry = egress.parse(text, ceiling=True)
        want = [n for n in egress.carve_outs(entry, extra)
                if not (n.version == 6 and n.network_address.ipv4_mapped is not None)]
        have = [ipaddress.ip_network(x) for x in got[str(entry.network)]]
        assert sorted(have, key=str) == sorted(want, key=str), text


@pytest.mark.parametrize("entry,why", [
    ("[fe80::/64]:80", "inside the never range fe80::/10"),
    ("[64:ff9b::a9fe:a9fe]:80", "inside the never range 64:ff9b::a9fe:0/112"),
    ("169.254.169.254/32:80", "inside the never range 169.254.0.0/16"),
    ("100.100.100.200:80", "inside the never range 100.100.100.200/32"),
    ("[2002:a9fe:a9fe::/48]:80", "inside the never range 2002::/16"),
    ("[64:ff9b:1::/48]:80", "lies inside the never range 64:ff9b:1::/48"),
    ("svc/pypi.infra:3141", "needs its object form"),
])
def test_an_egress_ceiling_entry_no_allowlist_could_use_fails_the_render(helm, entry, why):
    res = helm.template("--set", f"sandbox.egressCeiling[0]={entry}", check=False)
    assert res.returncode != 0 and why in res.stderr, res.stderr


@pytest.mark.parametrize("key,value,bad", [
    ("egressCeiling", "10.1.2.3/8:443", True), ("egressCeiling", "10.0.0.0/8:443", False),
    ("egressCeiling", "[fd00::1/64]:443", True), ("egressCeiling", "[fd00::/64]:443", False),
    ("egressCeiling", "[fe00::/7]:443", False), ("egressCeiling", "[ff00::/7]:443", True),
    ("egressCeiling", "10.0.0.1:443", False), ("egressNever", "10.96.0.1/12", True),
    ("egressNever", "10.96.0.0/12", False), ("egressNever", "fd00:1:3::/47", True),
    ("egressNever", "fd00:1:2::/47", False), ("egressNever", "10.96.0.1", False),
])
def test_egress_cidrs_with_host_bits_fail_the_render_as_the_webhook_refuses_them(
        helm, key, value, bad):
    """The webhook and the controller would refuse the value at start (a crash-looping
    admission webhook); the chart says so at render, with the same verdict as sandman/egress.py."""
    from sandman import egress

    res = helm.template("--set", f"sandbox.{key}[0]={value}", check=False)
    assert (res.returncode != 0 and "has host bits set" in res.stderr) is bad, res.stderr
    parse = egress.parse_never if key == "egressNever" else egress.Ceiling.parse
    if bad:
        with pytest.raises(ValueError, match="host bits"):
            parse([value])
    else:
        parse([value])


def test_release_namespace_and_kube_system_always_excluded(helm):
    objs = _render(helm, "--set", "webhook.excludedNamespaces={monitoring}",
                   "--set", "webhook.namespaceSelector.matchLabels.team=rl",
                   "--set", "webhook.validating.enabled=true")
    selectors = [hook["namespaceSelector"]
                 for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")
                 for hook in _find(objs, kind)["webhooks"]]
    # The policy is bound where the webhooks look: the same selector.
    selectors.append(next(
        o for o in objs if o["kind"] == "ValidatingAdmissionPolicyBinding"
        and not o["metadata"]["name"].endswith("-books"))["spec"]["matchResources"][
        "namespaceSelector"])
    assert len(selectors) == 4
    for sel in selectors:
        assert sel["matchLabels"] == {"team": "rl"}
        assert sel["matchExpressions"][0] == {
            "key": "kubernetes.io/metadata.name", "operator": "NotIn",
            "values": ["kube-system", "monitoring", NAMESPACE]}


@pytest.mark.parametrize("case", CASES)
def test_policy_is_the_one_webhook_policy_builds(helm, case):
    """The rendered ValidatingAdmissionPolicy is webhook/policy.py's, for the values' image,
    default ingress sources and guard mode (so its rule names are docs/webhook.md's)."""
    from sandman.podspec import SandboxPolicy

    objs = _render(helm, *_values_args(case))
    got = next(o for o in objs if o["kind"] == "ValidatingAdmissionPolicy"
               and not o["metadata"]["name"].endswith("-books"))
    dep = _find(objs, "Deployment", "-webhook")["spec"]["template"]["spec"]["containers"][0]
    flags = [(a.split("=", 1) + [""])[:2] for a in dep["args"] if a.startswith("--")]
    pol = SandboxPolicy(image=next(v for k, v in flags if k == "--image"),
                        guard=next(v for k, v in flags if k == "--guard"),
                        ingress_from=tuple(v for k, v in flags if k == "--ingress-from")
                        or ("0.0.0.0/0",),
                        allow_secrets=any(k == "--allow-secrets" for k, _ in flags),
                        gpu_max=int(next((v for k, v in flags if k == "--gpu-max"), "0")),
                        gpu_resource=next(v for k, v in flags if k == "--gpu-resource"),
                        gpu_tolerations=tuple(v for k, v in flags if k == "--gpu-toleration"),
                        egress_ceiling=tuple(v for k, v in flags if k == "--egress-ceiling"),
                        egress_never=tuple(v for k, v in flags if k == "--egress-never"))
    want = vap.admission_policy(got["metadata"]["name"], pol)
    assert got["spec"] == want["spec"]
    binding = next(o for o in objs if o["kind"] == "ValidatingAdmissionPolicyBinding"
                   and not o["metadata"]["name"].endswith("-books"))
    assert binding["spec"]["policyName"] == got["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert not [o for o in _render(helm, "--set", "admissionPolicy.enabled=false")
                if o["kind"].startswith("ValidatingAdmissionPolicy")]


def test_books_policy_admits_only_the_controllers_service_account(helm):
    """The books policy is webhook/policy.py's, for the controller's own ServiceAccount, and
    binds the sandbox namespace."""
    objs = _render(helm)
    got = _find(objs, "ValidatingAdmissionPolicy", "-books")
    sa = _find(objs, "ServiceAccount", "-controller")["metadata"]
    want = vap.books_policy(got["metadata"]["name"],
                            vap.controller_user(sa["namespace"], sa["name"]))
    assert got["spec"] == want["spec"]
    binding = _find(objs, "ValidatingAdmissionPolicyBinding", "-books")
    assert binding["spec"]["policyName"] == got["metadata"]["name"]
    assert binding["spec"]["matchResources"]["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": "sandboxes"}}


def test_sandbox_namespace_is_separate_and_never_an_excluded_one(helm):
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["sandboxNamespace"] == "sandboxes"
    for ns, extra in ((NAMESPACE, []), ("kube-system", []),
                      ("monitoring", ["--set", "webhook.excludedNamespaces={monitoring}"])):
        res = helm.template("--set", f"sandboxNamespace={ns}", *extra, check=False)
        assert res.returncode != 0, ns
        assert f'sandboxNamespace "{ns}" is excluded from admission' in res.stderr, res.stderr
    assert helm.template("--set", "sandboxNamespace=", check=False).returncode != 0


def test_controller_rbac_lives_only_in_the_sandbox_namespace(helm):
    """The controller's ServiceAccount may create pods only in the sandbox namespace; nothing
    binds it in the release namespace, where the webhook's ServiceAccount (allowed to patch
    the webhook configurations and read the CA key) and its Secrets live."""
    for case in CASES:
        objs = _render(helm, *_values_args(case))
        sa = _find(objs, "ServiceAccount", "-controller")["metadata"]
        sandboxes = _find(objs, "Deployment", "-controller")["spec"]["template"]["spec"][
            "containers"][0]["args"]
        sandboxes = next(a.split("=", 1)[1] for a in sandboxes if a.startswith("--namespace="))
        assert sandboxes != NAMESPACE, case
        bound = [o for o in objs if o["kind"] in ("RoleBinding", "ClusterRoleBinding")
                 and {"kind": "ServiceAccount", "name": sa["name"],
                      "namespace": sa["namespace"]} in o["subjects"]]
        assert bound, case
        roles = {(o["kind"], o["metadata"]["name"]): o for o in objs
                 if o["kind"] in ("Role", "ClusterRole")}
        full = sa["name"].removesuffix("-controller")
        for b in bound:
            ref = b["roleRef"]
            role = roles[(ref["kind"], ref["name"])]
            if b["kind"] == "RoleBinding" and b["metadata"]["namespace"] == NAMESPACE:
                # The one exception in the release namespace: the CA bundle ConfigMap, by name.
                assert role["rules"] == [{"apiGroups": [""], "resources": ["configmaps"],
                                          "resourceNames": [f"{full}-ca"],
                                          "verbs": ["get", "patch"]}], (case, role)
                continue
            if b["kind"] == "RoleBinding":
                assert b["metadata"]["namespace"] == sandboxes, (case, b["metadata"])
                if ref["kind"] == "Role":
                    assert role["metadata"]["namespace"] == sandboxes, (case, role["metadata"])
            tpl = json.loads(_find(objs, "ConfigMap", "-pod-template")["data"][
                "pod-template.json"])
            pulls = [x["name"] for x in tpl.get("imagePullSecrets") or []]
            for rule in role["rules"]:
                if b["kind"] == "ClusterRoleBinding":  # cluster-wide: never pods or secrets
                    assert not {"pods", "secrets"} & set(rule["resources"]), (case, rule)
                if "secrets" in rule["resources"]:
                    # Image pinning: the sandboxes' pull secrets, by name, read only, in the
                    # sandbox namespace; nothing when the template names none.
                    assert pulls and b["kind"] == "RoleBinding" and rule == {
                        "apiGroups": [""], "resources": ["secrets"], "resourceNames": pulls,
                        "verbs": ["get"]}, (case, rule)


def test_webhook_network_policy_admits_only_the_configured_cidrs_and_prometheus(helm):
    objs = _render(helm)
    pol = _find(objs, "NetworkPolicy", "-webhook")
    peers = [p for r in pol["spec"]["ingress"] for p in r["from"]]
    cidrs = [p["ipBlock"]["cidr"] for p in peers if "ipBlock" in p]
    assert cidrs and "0.0.0.0/0" not in cidrs and "::/0" not in cidrs, cidrs
    all_values = yaml.safe_load((CHART / "values.yaml").read_text())
    values = all_values["webhook"]
    assert cidrs == values["apiServerCIDRs"]
    prometheus = all_values["networkPolicy"]["prometheus"]
    assert [p for p in peers if "ipBlock" not in p] == prometheus and prometheus
    # Narrowed as docs/install.md says: the API server's CIDR, and Prometheus still scrapes
    # (before, the narrowed policy cut it off and the webhook's alerts went silent).
    eks = _find(_render(helm, "--set", "webhook.apiServerCIDRs={10.20.0.0/16}"),
                "NetworkPolicy", "-webhook")
    assert eks["spec"]["ingress"][0]["from"] == [{"ipBlock": {"cidr": "10.20.0.0/16"}},
                                                 *prometheus]
    none = _find(_render(helm, "--set", "webhook.apiServerCIDRs={10.20.0.0/16}", "--set",
                         "networkPolicy.prometheus=null"), "NetworkPolicy", "-webhook")
    assert none["spec"]["ingress"][0]["from"] == [{"ipBlock": {"cidr": "10.20.0.0/16"}}]
    assert helm.template("--set", "webhook.apiServerCIDRs=null", check=False).returncode != 0
    # The webhook process gets the per-connection bounds.
    args = _find(objs, "Deployment", "-webhook")["spec"]["template"]["spec"]["containers"][0][
        "args"]
    assert f"--max-body-bytes={values['maxBodyBytes']}" in args
    assert f"--request-read-seconds={values['requestReadSeconds']}" in args


def test_schema_rejects_a_misspelt_key(helm):
    res = helm.template("--set", "webhook.replicaz=3", check=False)
    assert res.returncode != 0
    assert "replicaz" in res.stderr and "additional properties" in res.stderr.lower(), res.stderr


def test_schema_rejects_a_wrong_type(helm):
    res = helm.template("--set-string", "webhook.replicas=three", check=False)
    assert res.returncode != 0
    assert "replicas" in res.stderr and "integer" in res.stderr, res.stderr
    res = helm.template("--set", "webhook.failurePolicy=fail", check=False)
    assert res.returncode != 0 and "failurePolicy" in res.stderr, res.stderr


def test_prepull_images_are_refused_without_a_digest(helm):
    ok = "registry.example.com/swe/task@sha256:" + "0" * 64
    for bad in ("registry.example.com/swe/task:v1", ok.replace("sha256:0", "sha256:A"),
                ok + "\n"):
        res = helm.template("--set-json", f'controller.prepull.images=["{bad!s}"]'.replace(
            "\n", "\\n"), check=False)
        assert res.returncode != 0 and "prepull" in res.stderr, (bad, res.stderr)
    objs = _render(helm, "--set-json", f'controller.prepull.images=["{ok}"]')
    args = _find(objs, "Deployment", "-controller")["spec"]["template"]["spec"]["containers"][
        0]["args"]
    assert f"--prepull-image={ok}" in args


def test_checkpoints_are_off_by_default_and_their_secret_is_mounted_when_named(helm):
    def controller(objs):
        return _find(objs, "Deployment", "-controller")["spec"]["template"]["spec"]

    pod = controller(_render(helm))
    assert not [a for a in pod["containers"][0]["args"] if a.startswith("--checkpoint")]
    reg = "123456789012.dkr.ecr.us-east-1.amazonaws.com/sandman-checkpoints"
    pod = controller(_render(helm, "--set", f"controller.checkpoints.registry={reg}",
                             "--set", "controller.checkpoints.authSecret=ecr-login",
                             "--set", "controller.checkpoints.ttl=3600"))
    args = pod["containers"][0]["args"]
    assert f"--checkpoint-registry={reg}" in args and "--checkpoint-ttl=3600" in args
    assert "--checkpoint-insecure" not in args
    assert "--checkpoint-auth-file=/etc/sandman/checkpoint-auth/config.json" in args
    vol = [v for v in pod["volumes"] if v["name"] == "checkpoint-auth"]
    assert vol and vol[0]["secret"]["secretName"] == "ecr-login"
    assert vol[0]["secret"]["items"] == [{"key": ".dockerconfigjson", "path": "config.json"}]
    bad = helm.template("--set", "controller.checkpoints.registry=no-prefix", check=False)
    assert bad.returncode != 0 and "registry" in bad.stderr


# ------------------------------------------------------------------ traces


def test_tracing_is_off_by_default_and_on_changes_only_the_controllers_flags(helm):
    """Off: no trace flag anywhere. On: the controller gets the receiver and the ratio, and
    nothing else in the release changes: no NetworkPolicy opens egress (sandboxes get none
    for traces; the controller's egress is not restricted), no sandbox template, webhook or
    test pod learns of the receiver (execd exports nothing, by design)."""
    off = _render(helm)
    assert "--otlp-endpoint" not in json.dumps(off) and "trace-sample" not in json.dumps(off)
    on = _render(helm, *_values_args("tracing"))
    args = _find(on, "Deployment", "-controller")["spec"]["template"]["spec"]["containers"][
        0]["args"]
    assert "--otlp-endpoint=http://otel-collector.observability:4318" in args
    assert "--trace-sample-ratio=0.1" in args
    # The flags parse as the controller's own argparse reads them.
    from controller.__main__ import parse_args
    parsed = parse_args(["serve", *args])
    assert parsed.otlp_endpoint == "http://otel-collector.observability:4318"
    assert parsed.trace_sample_ratio == 0.1

    def key(o):
        return (o["kind"], o["metadata"]["name"])

    assert [key(o) for o in on] == [key(o) for o in off]
    changed = [key(o) for o, was in zip(on, off, strict=True) if o != was]
    assert changed == [("Deployment", f"{RELEASE}-controller")]
    dep_on, dep_off = (_find(objs, "Deployment", "-controller") for objs in (on, off))
    c_on, c_off = (d["spec"]["template"]["spec"]["containers"][0] for d in (dep_on, dep_off))
    assert [a for a in c_on["args"] if a not in c_off["args"]] == [
        "--otlp-endpoint=http://otel-collector.observability:4318", "--trace-sample-ratio=0.1"]
    c_on["args"] = c_off["args"]
    assert dep_on == dep_off


@pytest.mark.parametrize("endpoint", [
    "http://collector:s3cret@otel-collector.observability:4318",  # credentials in the URL
    "http://otel-collector.observability:4318/?token=s3cret",  # a query
    "http://otel-collector.observability:4318#x",  # a fragment
    "http://otel-collector.observability:4318/v1/traces",  # a path: /v1/traces is appended
    "otel-collector.observability:4318",  # no scheme
    "grpc://otel-collector.observability:4317",  # OTLP/gRPC is not what the controller sends
    # A second argument smuggled into the controller's args (without the pattern it renders
    # as one: `--auth=none` after the chart's `--auth=kubernetes`).
    "http://otel-collector:4318\n            - --auth=none",
])
def test_a_tracing_endpoint_with_credentials_a_query_or_a_path_fails_the_render(helm, endpoint):
    res = helm.template("--set-json", f"tracing.otlpEndpoint={json.dumps(endpoint)}",
                        check=False)
    assert res.returncode != 0, endpoint
    assert "/tracing/otlpEndpoint" in res.stderr and "pattern" in res.stderr, res.stderr
    assert "--auth=none" not in res.stdout


@pytest.mark.parametrize("ratio", ["1.5", "-0.1", '"0.5"'])
def test_a_sample_ratio_outside_0_to_1_fails_the_render(helm, ratio):
    res = helm.template("--set-json", f"tracing.sampleRatio={ratio}", check=False)
    assert res.returncode != 0 and "/tracing/sampleRatio" in res.stderr, res.stderr


# ------------------------------------------------------------------ readiness of replicas
# kwok marks pods Ready without probing them, so a readiness probe that only the leader
# passes (the controller's /readyz answered 503 on its standby) kept a 2-replica Deployment
# at 1/2 Ready unnoticed: `helm install --wait` timed out and a rolling update (maxUnavailable
# 0, surge 1) never scaled the old leader down. Every Deployment with replicas > 1 must probe
# an endpoint that a non-leader replica passes; below, each component's rendered probe path is
# called on a real app instance in its non-leader state.


class _Standby:
    """A LeaderElector as a connected standby sees itself (another replica leads)."""

    identity, holder, leader_url, duration, is_leader = "standby", "leader", None, 10.0, False

    def __init__(self, connected: bool = True):
        self._connected = connected

    def connected(self) -> bool:
        return self._connected


def _controller_standby_get(path: str, connected: bool = True) -> int:
    from fastapi.testclient import TestClient

    from controller.routes import build_app
    return TestClient(build_app({"elector": _Standby(connected)})).get(path).status_code


def _webhook_replica_get(path: str) -> int:
    from fastapi.testclient import TestClient

    from sandman.podspec import SandboxPolicy
    from webhook.app import create_app
    return TestClient(create_app(SandboxPolicy())).get(path).status_code


# component label -> how to GET a path on a replica that does not lead. The webhook has no
# leader at all (every replica serves admission); the controller's standby forwards to its
# leader (docs/controller.md, "Two replicas").
NON_LEADER_REPLICA = {"controller": _controller_standby_get, "webhook": _webhook_replica_get}


def test_replicated_deployments_probe_readiness_that_does_not_depend_on_leadership(helm):
    renders = [_render(helm, *_values_args(c)) for c in CASES]
    renders.append(_render(helm, "--set", "controller.replicas=3,webhook.replicas=2"))
    seen = set()
    for objs in renders:
        for dep in (o for o in objs if o["kind"] == "Deployment"):
            if dep["spec"].get("replicas", 1) <= 1:
                continue
            comp = dep["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
            assert comp in NON_LEADER_REPLICA, (
                f"{dep['metadata']['name']} has {dep['spec']['replicas']} replicas: add how its "
                "readiness endpoint behaves on a replica that does not lead")
            for c in dep["spec"]["template"]["spec"]["containers"]:
                probe = c.get("readinessProbe")
                assert probe and probe.get("httpGet"), f"{comp}/{c['name']}: no readiness probe"
                path = probe["httpGet"]["path"]
                assert NON_LEADER_REPLICA[comp](path) == 200, (
                    f"{comp}: readiness {path} fails on a non-leader replica")
                live = (c.get("livenessProbe") or {}).get("httpGet", {}).get("path")
                assert live and NON_LEADER_REPLICA[comp](live) == 200, f"{comp}: liveness {live}"
                seen.add(comp)
    assert seen == set(NON_LEADER_REPLICA)
    # The controller's liveness never depends on the API server either (its readiness does).
    ctl = _find(renders[0], "Deployment", "-controller")["spec"]["template"]["spec"]
    c0 = ctl["containers"][0]
    assert _controller_standby_get(c0["livenessProbe"]["httpGet"]["path"], connected=False) == 200
    assert _controller_standby_get(c0["readinessProbe"]["httpGet"]["path"], connected=False) == 503
    # The standby learns where the leader serves from the Lease: the pod IP is advertised.
    assert "--advertise-address=$(SANDMAN_POD_IP)" in c0["args"]
    assert {"name": "SANDMAN_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} \
        in c0["env"]


def test_narrowed_ingress_admits_the_controller_and_the_helm_test_knows_its_place(helm,
                                                                                 tmp_path):
    """docs/install.md narrows sandbox.ingressFrom to the trainers' CIDR (custom-selectors
    case). The chart's controller args, run through the controller's own code, must build pods
    whose guard admits that replica's pod IP; the `helm test` pod gets the same CIDRs and its
    own IP, so outside them it checks that execd refuses it instead of failing to exec."""
    from controller.__main__ import parse_args, settings_from
    from controller.books import Entry
    from controller.core import Controller
    from controller.pods import SandboxSpec

    objs = _render(helm, *_values_args("custom-selectors"))
    c0 = _find(objs, "Deployment", "-controller")["spec"]["template"]["spec"]["containers"][0]
    pod_ip_env = {"name": "SANDMAN_POD_IP",
                  "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    assert pod_ip_env in c0["env"] and "--ingress-from=10.32.0.0/12" in c0["args"]
    # The rendered pod template, as the controller reads it from the mounted ConfigMap.
    tpl = _find(objs, "ConfigMap", "-controller-pod-template")["data"]["pod-template.json"]
    tpl_file = tmp_path / "pod-template.json"
    tpl_file.write_text(tpl)
    args = [a.replace("$(SANDMAN_POD_IP)", "10.200.0.7") for a in c0["args"]]
    args = [f"--pod-template-file={tpl_file}" if a.startswith("--pod-template-file=") else a
            for a in args]
    ctl = Controller(None, settings_from(parse_args(["serve", *args])))
    pod = ctl.creator.build_pod(Entry("sbx-1", SandboxSpec("img"), "job", "nonce", "token"), "a" * 64)
    guard = pod["spec"]["initContainers"][0]
    assert guard["name"] == contract.NETGUARD_CONTAINER
    sources = [guard["args"][i + 1] for i, a in enumerate(guard["args"]) if a == "--ingress-from"]
    assert sources == ["10.32.0.0/12", "10.200.0.7/32", "$(SANDMAN_NODE_IP)"]

    test_pod = next(o for o in objs if o["kind"] == "Pod"
                    and o["metadata"]["annotations"].get("helm.sh/hook") == "test")
    tc = test_pod["spec"]["containers"][0]
    assert tc["command"] == ["python3", "-m", "sandman.selftest"]
    assert pod_ip_env in tc["env"] and "--ingress-from=10.32.0.0/12" in tc["args"]
    # Default values: no --ingress-from for either (0.0.0.0/0: the test pod runs `echo ok`).
    dflt = _render(helm)
    tc = next(o for o in dflt if o["kind"] == "Pod")["spec"]["containers"][0]
    assert not [a for a in tc["args"] if a.startswith("--ingress-from")]


def test_controller_disruption_budget_priority_and_sandbox_pod_template(helm, tmp_path):
    """Two replicas get a PDB (minAvailable 1) and the webhook's class; one replica gets no
    PDB (it would block every drain). The values' pod template reaches the controller, which
    checks it and puts it on the pods it builds."""
    from controller.__main__ import parse_args, settings_from
    from controller.books import Entry
    from controller.core import Controller
    from controller.pods import SandboxSpec

    objs = _render(helm)
    pdb = _find(objs, "PodDisruptionBudget", "-controller")
    dep = _find(objs, "Deployment", "-controller")
    assert pdb["spec"] == {"minAvailable": 1, "selector": dep["spec"]["selector"]}
    assert dep["spec"]["template"]["spec"]["priorityClassName"] == \
        _find(objs, "PriorityClass")["metadata"]["name"]

    objs = _render(helm, *_values_args("sandbox-pool"))
    assert not [o for o in objs if o["kind"] == "PodDisruptionBudget"
                and o["metadata"]["name"].endswith("-controller")]
    dep = _find(objs, "Deployment", "-controller")
    spec = dep["spec"]["template"]["spec"]
    assert spec["priorityClassName"] == "platform-critical"
    c0 = spec["containers"][0]
    for flag in ("--default-lifetime=900", "--min-lifetime=60", "--max-lifetime=14400"):
        assert flag in c0["args"]
    mount = next(m for m in c0["volumeMounts"] if m["name"] == "pod-template")
    arg = next(a for a in c0["args"] if a.startswith("--pod-template-file="))
    assert arg.split("=", 1)[1].startswith(mount["mountPath"] + "/")
    tpl_file = tmp_path / "pod-template.json"
    tpl_file.write_text(_find(objs, "ConfigMap", "-controller-pod-template")["data"][
        "pod-template.json"])
    args = [f"--pod-template-file={tpl_file}" if a == arg else a for a in c0["args"]]
    ctl = Controller(None, settings_from(parse_args(["serve", *args])))
    pod = ctl.creator.build_pod(Entry("sbx-1", SandboxSpec("img"), "job", "nonce", "token"),
                                "a" * 64)
    assert pod["spec"]["priorityClassName"] == "sandbox-standard"
    assert pod["spec"]["runtimeClassName"] == "gvisor"
    assert pod["spec"]["tolerations"][0]["key"] == "dedicated"
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["metadata"]["annotations"]["karpenter.sh/do-not-disrupt"] == "true"
    assert pod["metadata"]["labels"]["team"] == "rl"
    assert "nodeAffinity" in pod["spec"]["affinity"]
    # sandbox.gpu (on, at most 2): only a GPU sandbox gets the resource (limits) and the GPU
    # nodes' tolerations after the template's; what the controller builds passes the webhook
    # as the chart configures it, and reads back as the same warm key.
    from controller.core import BadRequest
    from controller.pods import spec_of
    from sandman.podspec import check_sandbox, make_sandbox
    from webhook.__main__ import _policy_args, policy_from

    assert [t.get("key") for t in pod["spec"]["tolerations"]] == ["dedicated"]
    gspec = SandboxSpec("img", "1", "1Gi", ephemeral_storage="5Gi", gpu=2)
    gpod = ctl.creator.build_pod(Entry("sbx-2", gspec, "job", "nonce", "token"), "a" * 64)
    res = gpod["spec"]["containers"][0]["resources"]
    assert res["limits"]["nvidia.com/gpu"] == "2" and "nvidia.com/gpu" not in res["requests"]
    assert res["requests"]["ephemeral-storage"] == res["limits"]["ephemeral-storage"] == "5Gi"
    assert gpod["spec"]["tolerations"][1:] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "gpu", "operator": "Equal", "value": "true", "effect": "NoSchedule"}]
    wdep = _find(objs, "Deployment", "-webhook")["spec"]["template"]["spec"]["containers"][0]
    wp = argparse.ArgumentParser()
    _policy_args(wp)
    wpolicy = policy_from(wp.parse_known_args(wdep["args"])[0])
    assert wpolicy.gpu_max == 2
    for built in (pod, gpod):
        assert make_sandbox(built, wpolicy) == built and check_sandbox(built, wpolicy) == []
    # The API server copies an extended resource's limit into the request: the stored pod.
    stored = copy.deepcopy(gpod)
    stored["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] = "2"
    assert spec_of(stored) == gspec
    with pytest.raises(BadRequest, match="at most 2 per sandbox"):
        ctl.validate(SandboxSpec("img", gpu=3), "job", {}, None)


def test_controller_auth_rbac_and_the_helm_test_identity(helm):
    """The controller always runs --auth kubernetes and may create the reviews it needs; the
    user/admin ClusterRoles carry the verbs controller/auth.py checks; the helm test pod
    authenticates with a projected token for the controller's audience and is bound to the
    user role in the release namespace."""
    from controller import auth as A

    objs = _render(helm)
    dep = _find(objs, "Deployment", "-controller")
    full = dep["metadata"]["name"].removesuffix("-controller")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--auth=kubernetes" in args and f"--auth-audience={A.DEFAULT_AUDIENCE}" in args
    rules = {r["resources"][0]: r["verbs"] for r in _find(objs, "ClusterRole",
                                                          f"-controller-{NAMESPACE}")["rules"]}
    assert rules == {"tokenreviews": ["create"], "subjectaccessreviews": ["create"],
                     "events": ["list", "watch"],  # read-only: the capacity signals
                     "nodes": ["list"]}  # read-only: the image pre-pull's node pool
    crb = _find(objs, "ClusterRoleBinding", f"-controller-{NAMESPACE}")
    assert crb["subjects"][0]["name"] == dep["spec"]["template"]["spec"]["serviceAccountName"]
    user = _find(objs, "ClusterRole", "sandman-user")["rules"]
    assert user == [{"apiGroups": [A.GROUP], "resources": [A.RESOURCE],
                     "verbs": [A.CREATE, A.GET, A.LIST, A.UPDATE, A.DELETE]}]
    admin = {r["resources"][0]: r["verbs"] for r in _find(objs, "ClusterRole",
                                                          "sandman-admin")["rules"]}
    assert A.DELETECOLLECTION in admin[A.RESOURCE]
    assert admin[f"{A.RESOURCE}/{A.PREWARM_SUB}"] == [A.CREATE]
    assert admin[f"{A.RESOURCE}/{A.STATS_SUB}"] == [A.GET]
    assert admin[f"{A.RESOURCE}/{A.IMAGES_SUB}"] == [A.CREATE, A.GET]
    pod = _find(objs, "Pod", "-test")["spec"]
    assert pod["serviceAccountName"] == f"{full}-test"
    assert pod["automountServiceAccountToken"] is False
    src = pod["volumes"][0]["projected"]["sources"][0]["serviceAccountToken"]
    assert src["audience"] == A.DEFAULT_AUDIENCE
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert env["SANDMAN_TOKEN_FILE"] == f"{mounts[pod['volumes'][0]['name']]}/{src['path']}"
    assert env["SANDMAN_URL"].startswith(f"https://{full}-controller.{NAMESPACE}.svc:")
    # The CA bundle ConfigMap, mounted: `Client()` verifies the controller with it.
    (ca_vol,) = [n for n, v in volumes.items() if "configMap" in v]
    assert volumes[ca_vol]["configMap"]["name"] == f"{full}-ca"
    assert env["SANDMAN_CA_FILE"] == f"{mounts[ca_vol]}/ca.crt"
    rb = _find(objs, "RoleBinding", "-test")
    assert rb["roleRef"]["name"] == "sandman-user" and rb["metadata"]["namespace"] == NAMESPACE


def test_controller_network_policy_admits_only_the_selected_callers(helm):
    """Trainers only through an admin's namespaceSelector (the default needs a namespace
    label), the controller's own pods (forwarding), the helm test pod and Prometheus; a peer
    without a namespaceSelector is refused by the schema."""
    objs = _render(helm)
    dep = _find(objs, "Deployment", "-controller")
    pol = _find(objs, "NetworkPolicy", "-controller")
    assert pol["spec"]["podSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    (rule,) = pol["spec"]["ingress"]
    assert rule["ports"] == [{"port": "https", "protocol": "TCP"}]
    assert dep["spec"]["template"]["spec"]["containers"][0]["ports"][0]["name"] == "https"
    peers = rule["from"]
    assert peers[0] == {"namespaceSelector": {"matchLabels": {"sandman.dev/trainers": "true"}},
                        "podSelector": {"matchLabels": {contract.DOMAIN + "/trainer": "true"}}}
    assert peers[1] == {"podSelector": {"matchLabels": dep["spec"]["selector"]["matchLabels"]}}
    assert peers[2]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "helm-test"
    assert peers[3]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
    assert len(peers) == 4
    # No empty peer (which would admit everything), and a bare podSelector is refused.
    assert all(p for p in peers)
    bad = helm.run("template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--set",
                   "networkPolicy.controllerCallers[0].podSelector.matchLabels.a=b",
                   "--set", "networkPolicy.controllerCallers[0].namespaceSelector=null",
                   check=False)
    assert bad.returncode != 0 and "namespaceSelector" in bad.stderr, bad.stderr
    none = _render(helm, "--set", "networkPolicy.prometheus=null")
    assert len(_find(none, "NetworkPolicy", "-controller")["spec"]["ingress"][0]["from"]) == 3


# ---------------------------------------------------------------- uninstall cleanup hook


@pytest.mark.parametrize("case", CASES)
def test_uninstall_cleanup_hook_is_bounded_minimal_and_points_at_this_release(helm, case):
    """`helm uninstall` leaves nothing: a post-delete Job removes the controller's run-time
    objects. Its RBAC is the minimum (only the sandbox namespace's pods/ConfigMaps, the Lease by
    name, the helm test pod by name), it is bounded, and its args name this release's objects."""
    from controller.cleanup import parse_args

    objs = _render(helm, *_values_args(case))
    hooks = [o for o in objs if o["metadata"].get("annotations", {}).get("helm.sh/hook")
             == "post-delete"]
    assert sorted((o["kind"], o["metadata"]["name"]) for o in hooks) == sorted([
        ("ServiceAccount", f"{RELEASE}-cleanup"), ("Role", f"{RELEASE}-cleanup"),
        ("RoleBinding", f"{RELEASE}-cleanup"), ("Role", f"{RELEASE}-cleanup-sandboxes"),
        ("RoleBinding", f"{RELEASE}-cleanup-sandboxes"), ("Job", f"{RELEASE}-cleanup")])
    for o in hooks:
        ann = o["metadata"]["annotations"]
        # Deleted when they succeed; a failed run keeps them for `kubectl logs`.
        assert ann["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-succeeded"
        # The account and its rights exist before the Job starts.
        assert ann["helm.sh/hook-weight"] == ("0" if o["kind"] == "Job" else "-10")
    ctl = _find(objs, "Deployment", "-controller")
    ctl_args = ctl["spec"]["template"]["spec"]["containers"][0]["args"]
    sbx = next(a.split("=", 1)[1] for a in ctl_args if a.startswith("--namespace="))
    lease = next(a.split("=", 1)[1] for a in ctl_args if a.startswith("--lease-name="))
    roles = {o["metadata"]["name"]: o for o in hooks if o["kind"] == "Role"}
    test_pod = next(o for o in objs if o["kind"] == "Pod"
                    and o["metadata"]["annotations"].get("helm.sh/hook") == "test")
    assert roles[f"{RELEASE}-cleanup"]["metadata"]["namespace"] == NAMESPACE
    assert roles[f"{RELEASE}-cleanup"]["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
        {"apiGroups": [""], "resources": ["pods"],
         "resourceNames": [test_pod["metadata"]["name"]], "verbs": ["get", "delete"]}]
    assert roles[f"{RELEASE}-cleanup-sandboxes"]["metadata"]["namespace"] == sbx
    assert roles[f"{RELEASE}-cleanup-sandboxes"]["rules"] == [
        {"apiGroups": [""], "resources": ["pods", "configmaps"],
         "verbs": ["list", "deletecollection"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
         "resourceNames": [lease], "verbs": ["delete"]}]
    for b in (o for o in hooks if o["kind"] == "RoleBinding"):
        assert b["roleRef"]["name"] == b["metadata"]["name"]
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": f"{RELEASE}-cleanup",
                                  "namespace": NAMESPACE}]

    job = next(o for o in hooks if o["kind"] == "Job")
    assert job["spec"]["backoffLimit"] <= 1 and job["spec"]["activeDeadlineSeconds"] <= 300
    pod = job["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == f"{RELEASE}-cleanup"
    c = pod["containers"][0]
    assert c["command"] == ["python3", "-m", "controller.cleanup"]
    # The controller's image, unless the case gives either its own.
    case_values = yaml.safe_load((TESTDATA / "values" / f"{case}.yaml").read_text()) \
        if case != "default" else {}
    if not any((case_values.get(c) or {}).get("image") for c in ("cleanup", "controller")):
        assert c["image"] == ctl["spec"]["template"]["spec"]["containers"][0]["image"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    args = parse_args(c["args"])
    assert (args.namespace, args.lease_name, args.release_namespace, args.test_pod) == (
        sbx, lease, NAMESPACE, test_pod["metadata"]["name"])
    assert args.timeout < job["spec"]["activeDeadlineSeconds"]
    # It waits for exactly the release's controller pods, never for itself.
    want = dict(x.split("=") for x in args.controller_selector.split(","))
    ctl_labels = ctl["spec"]["template"]["metadata"]["labels"]
    assert want.items() <= ctl_labels.items()
    assert not want.items() <= job["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize("case", CASES)
def test_controller_is_rendered_for_https_with_the_chart_certificate(helm, case):
    """The render, in both certificate modes: a serving certificate naming the controller
    Service is issued into the Secret the controller mounts (tls.crt, tls.key, ca.crt); the
    controller's args serve https with it, verify the leader as the Service's name, and
    publish the CA bundle in the ConfigMap the helm test pod (and trainers' copies) read;
    probes, Service and ServiceMonitor speak https. That the installed controller really
    serves that certificate (verified with the published CA, for the Service's name) is
    tests/e2e/test_lifecycle.py's check on the real node."""
    objs = _render(helm, *_values_args(case), "--set", "serviceMonitor.enabled=true")
    dep = _find(objs, "Deployment", "-controller")
    name = dep["metadata"]["name"]
    full = name.removesuffix("-controller")
    host = f"{name}.{NAMESPACE}.svc"
    spec = dep["spec"]["template"]["spec"]
    c = spec["containers"][0]
    args = dict(a.split("=", 1) for a in c["args"] if "=" in a)
    mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "tls")
    secret = next(v["secret"]["secretName"] for v in spec["volumes"] if v["name"] == "tls")
    assert secret == f"{name}-tls"
    assert (args["--tls-cert-file"], args["--tls-key-file"], args["--tls-ca-file"]) == (
        f"{mount}/tls.crt", f"{mount}/tls.key", f"{mount}/ca.crt")
    assert args["--tls-server-name"] == host and "--insecure-http" not in c["args"]
    assert args["--ca-configmap"] == f"{NAMESPACE}/{full}-ca"
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["scheme"] == "HTTPS" and c[probe]["httpGet"]["port"] == "https"
    svc = _find(objs, "Service", "-controller")
    assert svc["spec"]["ports"][0]["name"] == "https" == svc["spec"]["ports"][0]["targetPort"]
    cm = _find(objs, "ConfigMap", f"{full}-ca")
    assert "data" not in cm  # the controller writes ca.crt; Helm upgrades leave it alone
    sm = _find(objs, "ServiceMonitor", "-controller")["spec"]["endpoints"][0]
    assert sm["scheme"] == "https" and sm["tlsConfig"]["serverName"] == host
    assert sm["tlsConfig"]["ca"]["configMap"] == {"name": f"{full}-ca", "key": "ca.crt"}
    dns = [name, f"{name}.{NAMESPACE}", host, f"{host}.cluster.local"]
    if case == "cert-manager":
        cert = _find(objs, "Certificate", "-controller")["spec"]
        assert cert["secretName"] == secret and cert["dnsNames"] == dns
        # Signed by a CA of its own (stable across renewals), not self-signed.
        issuer = _find(objs, "Issuer", f"{name}-ca")["spec"]
        assert cert["issuerRef"]["name"] == f"{name}-ca"
        ca = _find(objs, "Certificate", f"{name}-ca")["spec"]
        assert ca["isCA"] is True and issuer == {"ca": {"secretName": ca["secretName"]}}
        certs = [o for o in objs if o["kind"] in ("Job", "CronJob")
                 and "-certs" in o["metadata"]["name"]]
        assert not certs
    else:
        (certs,) = [o for o in objs if o["kind"] == "Job" and "-certs-" in o["metadata"]["name"]]
        for job in (certs, _find(objs, "CronJob")["spec"]["jobTemplate"]):
            pod = job["spec"]["template"]["spec"]
            init = {i["name"]: i for i in pod["initContainers"]}["controller-certs"]
            assert init["command"] == ["python3", "-m", "webhook", "certs", "ensure"]
            assert f"--service={name}" in init["args"] and f"--secret={secret}" in init["args"]
            owned = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}["SECRETS"]
            assert {secret, f"{secret}-ca"} <= set(owned.split(","))
        role = _find(objs, "Role", "-webhook")
        assert {secret, f"{secret}-ca"} <= set(role["rules"][0]["resourceNames"])


# --------------------------------------------------------- labels and per-component knobs

# The Deployments' selectors as every release so far rendered them. spec.selector of a
# Deployment is immutable: a changed one fails `helm upgrade` of every existing install
# ("field is immutable"), so no value and no chart change may move them.
SELECTORS = {
    component: {"app.kubernetes.io/name": "sandman", "app.kubernetes.io/instance": RELEASE,
                "app.kubernetes.io/component": component}
    for component in ("webhook", "controller")}
CHART_META = yaml.safe_load((CHART / "Chart.yaml").read_text())
KNOBS = ["component-knobs"]
# values path of each component's knobs -> the component label of its pods.
COMPONENTS = {"webhook": "webhook", "controller": "controller", "webhook.certs": "webhook-certs",
              "cleanup": "cleanup", "test": "helm-test"}


def _pods(objs: list[dict]) -> list[tuple[dict, dict]]:
    """(object, pod template or pod) of every pod the render makes."""
    out = []
    for o in objs:
        if o["kind"] == "Pod":
            out.append((o, o))
        elif o["kind"] in ("Deployment", "Job"):
            out.append((o, o["spec"]["template"]))
        elif o["kind"] == "CronJob":
            out.append((o, o["spec"]["jobTemplate"]["spec"]["template"]))
    return out


@pytest.mark.parametrize("case", CASES)
def test_deployment_selectors_never_change(helm, case):
    """The selectors in every render, the golden files (the releases' renders) included, are
    SELECTORS; the Services, disruption budgets and NetworkPolicies select the same pods,
    which carry those labels whatever podLabels says."""
    golden = objects((TESTDATA / f"{case}.golden.yaml").read_text())
    for objs in (golden, _render(helm, *_values_args(case))):
        for component, want in SELECTORS.items():
            dep = _find(objs, "Deployment", f"-{component}")
            assert dep["spec"]["selector"] == {"matchLabels": want}, (case, component)
            assert want.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
            assert _find(objs, "Service", f"-{component}")["spec"]["selector"] == want
            pdbs = [o for o in objs if o["kind"] == "PodDisruptionBudget"
                    and o["metadata"]["name"].endswith(f"-{component}")]
            for pdb in pdbs:
                assert pdb["spec"]["selector"] == {"matchLabels": want}, (case, component)
            pols = [o for o in objs if o["kind"] == "NetworkPolicy"
                    and o["metadata"]["name"].endswith(f"-{component}")]
            for pol in pols:
                assert pol["spec"]["podSelector"] == {"matchLabels": want}, (case, component)


@pytest.mark.parametrize("case", CASES)
def test_every_pod_carries_the_full_app_kubernetes_io_set(helm, case):
    objs = _render(helm, *_values_args(case))
    pods = _pods(objs)
    assert len(pods) >= 4  # webhook, controller, cleanup, test (+ certs Job, CronJob)
    components = set()
    for obj, pod in pods:
        labels = pod["metadata"]["labels"]
        component = labels.get("app.kubernetes.io/component")
        components.add(component)
        assert {k: v for k, v in labels.items() if k.startswith("app.kubernetes.io/")} == {
            "app.kubernetes.io/name": "sandman", "app.kubernetes.io/instance": RELEASE,
            "app.kubernetes.io/version": CHART_META["appVersion"],
            "app.kubernetes.io/component": component,
            "app.kubernetes.io/part-of": "sandman", "app.kubernetes.io/managed-by": "Helm",
        }, (case, obj["kind"], obj["metadata"]["name"])
    assert components <= set(COMPONENTS.values())
    assert {"webhook", "controller", "cleanup", "helm-test"} <= components


@pytest.mark.parametrize("path", COMPONENTS)
def test_pod_labels_cannot_override_the_charts_labels(helm, path):
    """A podLabels entry for app.kubernetes.io/name (which would move the pods out of their
    selector) fails the render with one line naming the value and the key; another key
    renders."""
    for key in ("app.kubernetes.io/name", "app.kubernetes.io/component",
                "app.kubernetes.io/anything"):
        escaped = key.replace(".", r"\.")
        res = helm.template("--set", f"{path}.podLabels.{escaped}=other", check=False)
        assert res.returncode != 0, (path, key)
        errors = [line for line in res.stderr.splitlines() if line.startswith("Error:")]
        assert len(errors) == 1 and f'{path}.podLabels sets "{key}", which the chart reserves' \
            in errors[0], res.stderr
    objs = _render(helm, "--set", f"{path}.podLabels.team=rl")
    (labels,) = [p["metadata"]["labels"] for _, p in _pods(objs)
                 if p["metadata"]["labels"]["app.kubernetes.io/component"] == COMPONENTS[path]
                 and p is not None][:1]
    assert labels["team"] == "rl" and labels["app.kubernetes.io/name"] == "sandman"


def test_chart_annotations_cannot_be_overridden(helm):
    """The controller's pod-template checksum and Helm's hook annotations (the test pod's, the
    cleanup account's) are the chart's: setting one fails the render."""
    for setting, path, key in (
            ("controller.podAnnotations.checksum/pod-template=x", "controller.podAnnotations",
             "checksum/pod-template"),
            (r"test.podAnnotations.helm\.sh/hook=pre-install", "test.podAnnotations",
             "helm.sh/hook"),
            (r"cleanup.serviceAccount.annotations.helm\.sh/hook-weight=x",
             "cleanup.serviceAccount.annotations", "helm.sh/hook-weight")):
        res = helm.template("--set", setting, check=False)
        assert res.returncode != 0 and f'{path} sets "{key}", which the chart reserves' in \
            res.stderr, res.stderr


def _container(obj: dict, name: str | None = None) -> dict:
    pod = obj if obj["kind"] == "Pod" else obj["spec"]["template"]
    containers = pod["spec"]["containers"]
    return containers[0] if name is None else next(c for c in containers if c["name"] == name)


def test_component_knobs_render_where_they_belong(helm):
    """Each component's knobs reach its own pods: annotations, labels, args appended after the
    chart's, env after the chart's, zone spread, its image; the netguard image of sandboxes
    (--image, and so the policy) stays the global one; each ServiceAccount gets its
    annotations (IRSA)."""
    values = yaml.safe_load((TESTDATA / "values" / "component-knobs.yaml").read_text())
    base = _render(helm)
    objs = _render(helm, *_values_args("component-knobs"))
    deps = {c: _find(objs, "Deployment", f"-{c}") for c in ("webhook", "controller")}
    for comp, dep in deps.items():
        v = values[comp]
        pod = dep["spec"]["template"]
        assert v["podAnnotations"].items() <= pod["metadata"].get("annotations", {}).items()
        assert pod["metadata"]["labels"]["team"] == "platform"
        assert pod["spec"]["topologySpreadConstraints"] == v["topologySpreadConstraints"]
        c = _container(dep)
        was = _container(_find(base, "Deployment", f"-{comp}"))
        assert c["args"] == was["args"] + v["extraArgs"], comp
        assert c.get("env", []) == was.get("env", []) + v["extraEnv"], comp
        assert f"--image={contract.SANDMAN_IMAGE}" in c["args"], comp
    assert _container(deps["webhook"])["image"] == "mirror.example.com/sandman/sandman:0.2.0"
    assert _container(deps["controller"])["image"] == "ghcr.io/sandman-dev/sandman:0.2.0-debug"
    # The webhook keeps its anti-affinity beside the spread.
    assert deps["webhook"]["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    # The certificate pods (Job and CronJob): digest and pull policy of their own.
    certs = values["webhook"]["certs"]
    jobs = [o for o in objs if o["kind"] in ("Job", "CronJob") and "-certs" in
            o["metadata"]["name"]]
    assert len(jobs) == 2
    for job in jobs:
        pod = (job["spec"]["jobTemplate"]["spec"] if job["kind"] == "CronJob" else
               job["spec"])["template"]
        assert pod["metadata"]["annotations"] == certs["podAnnotations"]
        for c in pod["spec"]["initContainers"] + pod["spec"]["containers"]:
            assert c["image"] == (f"{certs['image']['repository']}@"
                                  f"{certs['image']['digest']}"), c["name"]
            assert c["imagePullPolicy"] == "Always"
            assert c["env"][-1] == certs["extraEnv"][0], c["name"]
    for comp, obj in (("cleanup", _find(objs, "Job", "-cleanup")),
                      ("test", _find(objs, "Pod", "-test"))):
        was = _container(_find(base, obj["kind"], f"-{comp}"))
        c = _container(obj)
        assert c["args"] == was["args"] + values[comp]["extraArgs"], comp
        assert c["env"][-1] == values[comp]["extraEnv"][0], comp
        assert c["image"] == "mirror.example.com/sandman/sandman:0.2.0", comp
    test_pod = _find(objs, "Pod", "-test")["metadata"]["annotations"]
    assert test_pod["helm.sh/hook"] == "test"
    assert test_pod["sidecar.istio.io/inject"] == "false"
    for comp, suffix in (("webhook", "-webhook"), ("controller", "-controller"),
                         ("cleanup", "-cleanup"), ("test", "-test")):
        sa = _find(objs, "ServiceAccount", suffix)["metadata"]["annotations"]
        assert values[comp]["serviceAccount"]["annotations"].items() <= sa.items(), comp
    assert _find(objs, "ServiceAccount", "-cleanup")["metadata"]["annotations"][
        "helm.sh/hook"] == "post-delete"


def test_extra_args_come_last_and_argparse_decides(helm):
    """Appended args are parsed by the binary's own argparse: the last of a single-value flag
    wins (so `--rate` in extraArgs overrides controller.rate), an append flag adds to the
    chart's values. That is why values.yaml says to review them like the chart's flags."""
    from controller.__main__ import parse_args

    objs = _render(helm, "--set", "controller.extraArgs={--rate=5,--caller-label-prefix=b/}",
                   "--set", "controller.auth.callerLabelPrefixes={a/}")
    args = parse_args(["serve", *_container(_find(objs, "Deployment", "-controller"))["args"]])
    assert args.rate == 5
    assert args.caller_label_prefix == ["a/", "b/"]


def test_warm_budget_flags_only_when_demand_sizing_is_on(helm):
    """controller.warmBudget: off at pods 0 (no flag: the controller's own default, prewarm
    floors only); on, its four flags reach the controller's parser as the values say."""
    from controller.__main__ import parse_args, settings_from

    def ctl_args(*sets: str) -> list[str]:
        objs = _render(helm, *[a for s in sets for a in ("--set", s)])
        return _container(_find(objs, "Deployment", "-controller"))["args"]

    assert not [a for a in ctl_args() if a.startswith("--warm-")]
    args = ctl_args("controller.warmBudget.pods=96", "controller.warmBudget.cpu=192",
                    "controller.warmBudget.maxPerKey=4",
                    "controller.warmBudget.roles={grading,agent}")
    args = [a for a in args if not a.startswith("--pod-template-file=")]  # read in the pod
    budget = settings_from(parse_args(["serve", *args])).warm_budget
    assert (budget.pods, budget.cpu, budget.per_key, budget.roles) == (
        96, 192.0, 4, ("grading", "agent"))
    with pytest.raises(Exception, match="roles"):
        helm.template("--set", "controller.warmBudget.roles={judge}")


@pytest.mark.slow
def test_component_image_falls_back_to_the_global_image(helm):
    def image(*sets: str) -> tuple[str, str]:
        args = [a for s in sets for a in ("--set", s)]
        c = _container(_find(_render(helm, *args), "Deployment", "-webhook"))
        return c["image"], c["imagePullPolicy"]

    digest = "sha256:" + "2" * 64
    assert image() == (contract.SANDMAN_IMAGE, "IfNotPresent")
    # Nothing of its own: the global reference, its digest included.
    assert image(f"image.digest={digest}", "image.pullPolicy=Always") == (
        f"ghcr.io/sandman-dev/sandman@{digest}", "Always")
    # A tag of its own: the global repository with it (the global digest is another image's).
    assert image(f"image.digest={digest}", "webhook.image.tag=0.2.0") == (
        "ghcr.io/sandman-dev/sandman:0.2.0", "IfNotPresent")
    assert image("webhook.image.repository=r.example/s") == ("r.example/s:0.2.0",
                                                               "IfNotPresent")
    assert image("webhook.image.repository=r.example/s", f"webhook.image.digest={digest}",
                 "webhook.image.tag=9", "webhook.image.pullPolicy=Never") == (
        f"r.example/s@{digest}", "Never")
    # The sandboxes' netguard image never follows a component's.
    c = _container(_find(_render(helm, "--set", "webhook.image.repository=r.example/s"),
                         "Deployment", "-webhook"))
    assert f"--image={contract.SANDMAN_IMAGE}" in c["args"]


def test_sandbox_snapshots_reach_the_controller_as_its_flag(helm):
    """sandbox.snapshots: the controller's --snapshot-base (agent pods' snapshot base, which
    fork, checkpoints and pause need); on unless the admin turns it off."""
    for extra, want in (((), "on"), (("--set", "sandbox.snapshots=false"), "off")):
        args = _container(_find(_render(helm, *extra), "Deployment", "-controller"))["args"]
        assert [a for a in args if a.startswith("--snapshot-base")] == [
            f"--snapshot-base={want}"], extra


def test_flow_control_puts_the_charts_api_clients_in_their_own_priority_level(helm):
    """API Priority and Fairness, on by default: one FlowSchema for the controller's and the
    webhook's ServiceAccounts (every verb, resource and URL), ahead of the built-in
    `service-accounts` schema (9000) that would put them in the shared workload-low level,
    pointing at the chart's own PriorityLevelConfiguration, which lends and borrows nothing."""
    objs = _render(helm)
    fs = _find(objs, "FlowSchema")
    plc = _find(objs, "PriorityLevelConfiguration")
    assert fs["apiVersion"] == plc["apiVersion"] == "flowcontrol.apiserver.k8s.io/v1"
    assert fs["metadata"]["name"] == plc["metadata"]["name"] == f"{RELEASE}-{NAMESPACE}"
    assert fs["spec"]["priorityLevelConfiguration"] == {"name": plc["metadata"]["name"]}
    assert fs["spec"]["matchingPrecedence"] < 9000
    accounts = {(s["serviceAccount"]["namespace"], s["serviceAccount"]["name"])
                for r in fs["spec"]["rules"] for s in r["subjects"]}
    sas = {(o["metadata"]["namespace"], o["metadata"]["name"]) for o in objs
           if o["kind"] == "ServiceAccount"}
    assert accounts == {(NAMESPACE, f"{RELEASE}-controller"), (NAMESPACE, f"{RELEASE}-webhook")}
    assert accounts <= sas
    [rule] = fs["spec"]["rules"]
    assert rule["resourceRules"] == [{"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"],
                                      "clusterScope": True, "namespaces": ["*"]}]
    assert rule["nonResourceRules"] == [{"nonResourceURLs": ["*"], "verbs": ["*"]}]
    limited = plc["spec"]["limited"]
    assert plc["spec"]["type"] == "Limited"
    assert (limited["lendablePercent"], limited["borrowingLimitPercent"]) == (0, 0)
    assert limited["limitResponse"]["type"] == "Queue"
    # Off: neither object; Reject: no queuing block (the API server refuses one); borrowing
    # null: the field is left out (unlimited), not rendered as 0.
    off = _render(helm, "--set", "apiPriorityAndFairness.enabled=false")
    assert not [o for o in off if o["kind"] in ("FlowSchema", "PriorityLevelConfiguration")]
    rej = _find(_render(helm, "--set", "apiPriorityAndFairness.limitResponse.type=Reject",
                        "--set", "apiPriorityAndFairness.borrowingLimitPercent=null"),
                "PriorityLevelConfiguration")["spec"]["limited"]
    assert rej["limitResponse"] == {"type": "Reject"}
    assert "borrowingLimitPercent" not in rej


@pytest.mark.parametrize("setting", ["apiPriorityAndFairness.matchingPrecedence=9000",
                                     "apiPriorityAndFairness.matchingPrecedence=1",
                                     "apiPriorityAndFairness.limitResponse.type=Drop",
                                     "apiPriorityAndFairness.lendablePercent=101",
                                     "apiPriorityAndFairness.queueLength=5"])
def test_flow_control_values_that_cannot_work_fail_the_install(helm, setting):
    """A precedence at or past the built-in service-accounts schema would never match, 1 is
    the API server's exempt schema: the schema refuses them, as it refuses unknown keys."""
    res = helm.template("--set", setting, check=False)
    assert res.returncode != 0 and "apiPriorityAndFairness" in res.stderr, res.stderr
