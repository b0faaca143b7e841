"""The rules that must survive the webhook, as a ValidatingAdmissionPolicy (CEL, evaluated inside
the API server) and its binding. The chart renders the same objects (a test compares them); the
validations come from here through the generated `charts/sandman/templates/_policy.tpl`.

Why: while the webhook is down, or its configurations were deleted during an outage
(docs/operations.md step 2), the API server still refuses an unguarded egress-deny pod, added
capabilities, privileged containers, host namespaces, volumes outside the allowlist (hostPath,
nfs, ...), containers that keep NET_RAW, Unconfined profiles, Secrets, requests != limits and
service-account tokens. The policy is a subset of `sandman.podspec.check_sandbox`: it never
refuses a pod that the Python check admits (tests/webhook/test_policy.py plays every golden
AdmissionReview through both on the test bed), and each validation names its rule like the
webhook does (`sandman <rule>: ...`, docs/webhook.md).

The policy's own inputs are the chart's sandbox values: the sandman image (the guard's image),
the default ingress sources (the guard's args when a pod has no ingress-from annotation) and the
guard mode. They are CEL variables rendered from values, so no params object is needed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from sandman import egress as egress_entries
from sandman.contract import (
    ANNOTATION_EGRESS_ALLOW,
    ANNOTATION_INGRESS_FROM,
    ANNOTATION_TOKEN_SHA256,
    EGRESS_ALLOW,
    EGRESS_DENY,
    EXECD_DIR,
    EXECD_INSTALL_CONTAINER,
    EXECD_PORT,
    LABEL_EGRESS,
    LABEL_SANDBOX,
    NETGUARD_CONTAINER,
    NETGUARD_FLAG_ALLOW_EGRESS,
    NETGUARD_FLAG_EGRESS,
    NETGUARD_FLAG_INGRESS_FROM,
    NETGUARD_FLAG_INGRESS_PORT,
    NETGUARD_FLAG_NEVER_EGRESS,
    SANDBOX_TRUE,
    SANDMAN_VOLUME,
)
from sandman.podspec import (
    APPARMOR_CONTAINER_PREFIX,
    APPARMOR_LOCALHOST_PREFIX,
    APPARMOR_RUNTIME_DEFAULT,
    APPARMOR_TYPES,
    BASELINE_SELINUX_TYPES,
    BASELINE_SYSCTLS,
    CORE_RESOURCES,
    GUARD_ALWAYS,
    GUARD_ARGS_TAIL,
    GUARD_CAPS,
    INPUT_ANNOTATION_PREFIXES,
    INPUT_ANNOTATIONS,
    INPUT_LABELS,
    INSTALL_EXECD_ARGS,
    INSTALL_FLAG_PREFIX,
    NET_RAW,
    NODE_IP_ENV,
    PROJECTED_SOURCES,
    RUN_DIR,
    SA_TOKEN_VOLUME_PREFIX,
    SECCOMP_CONTAINER_PREFIX,
    SECCOMP_POD_ANNOTATION,
    VOLUME_TYPES,
    SandboxPolicy,
    netguard_container,
)

API_VERSION = "admissionregistration.k8s.io/v1"


def _q(text: str) -> str:
    """A CEL string literal (JSON's escaping is valid CEL for these ASCII names)."""
    return json.dumps(text)


def _list(items) -> str:
    return "[" + ", ".join(_q(i) for i in items) + "]"


_GUARD_COMMAND = netguard_container({"metadata": {}}, SandboxPolicy())["command"]
_CAPS = sorted(GUARD_CAPS)

# Variables the chart renders from values (image, default ingress sources, guard mode, the
# webhook's --allow-secrets); the rest are fixed. Order matters: a variable may use the ones
# before it.
POLICY_VARIABLES = ("image", "defaultIngressFrom", "guardAlways", "allowSecrets", "gpuResource",
                    "gpuMax", "gpuTolerations", "egressCeiling", "egressNever", "egressNat64Never")


def _bool(b: bool) -> str:
    return "true" if b else "false"


def policy_variables(policy: SandboxPolicy) -> list[dict]:
    return [
        {"name": "image", "expression": _q(policy.image)},
        {"name": "defaultIngressFrom", "expression": _list(policy.ingress_from)},
        {"name": "guardAlways", "expression": _bool(policy.guard == GUARD_ALWAYS)},
        {"name": "allowSecrets", "expression": _bool(policy.allow_secrets)},
        {"name": "gpuResource", "expression": _q(policy.gpu_resource)},
        {"name": "gpuMax", "expression": str(policy.gpu_max)},
        # Helm's toJson spelling, so the chart's rendering is this one.
        {"name": "gpuTolerations",
         "expression": json.dumps(list(policy.gpu_tolerations), separators=(",", ":"))},
        {"name": "egressCeiling",
         "expression": json.dumps(list(policy.egress_ceiling), separators=(",", ":"))},
        {"name": "egressNever",
         "expression": json.dumps(list(policy.egress_never), separators=(",", ":"))},
        # The NAT64 images of the admin's IPv4 never ranges (CEL cannot compute them).
        {"name": "egressNat64Never", "expression": json.dumps(
            [str(egress_entries.nat64(n)) for n in egress_entries.parse_never(policy.egress_never)
             if n.version == 4], separators=(",", ":"))},
    ]


# Every capability name is compared like the webhook does (sandbox._cap): upper case, no CAP_.
def _norm(x: str) -> str:
    return (f"({x}.upperAscii().startsWith('CAP_') ? {x}.upperAscii().substring(4) "
            f": {x}.upperAscii())")


def _installs(inits: str) -> str:
    """podspec.installs_execd over the init containers `inits`."""
    return (f"{inits}.exists(c, c.name == {_q(EXECD_INSTALL_CONTAINER)} || "
            f"(c.name == {_q(NETGUARD_CONTAINER)} && c.?args.orValue([]).exists(a, "
            f"a.startsWith({_q(INSTALL_FLAG_PREFIX)}))))")


# Kubernetes' cidr() refuses IPv4-mapped IPv6 (::ffff:0:0/96): such an entry fails isCIDR in
# the shape rule instead.
_NEVER_CIDRS = tuple(str(n) for n in egress_entries.never_ranges()
                     if not (n.version == 6 and n.network_address.ipv4_mapped is not None))
# An entry of the canonical shape (podspec.egress_allow admits no other): what the CEL below
# can take apart without an error.
_ENTRY_SHAPE = (r"^(svc/[a-z]([-a-z0-9]{0,61}[a-z0-9])?\.[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
                r"|[0-9.]{7,15}/[0-9]{1,2}|\[[0-9a-f:]{2,39}/[0-9]{1,3}\]):[1-9][0-9]{0,4}/(tcp|udp)$")


def _host(x: str) -> str:
    return f"{x}.substring(0, {x}.lastIndexOf(':'))"


def _tail(x: str) -> str:
    return f"{x}.substring({x}.lastIndexOf(':') + 1)"


def _cidr_text(h: str) -> str:
    """A CIDR entry's host part without brackets, a bare address given its full prefix."""
    bare = f"({h}.startsWith('[') ? {h}.substring(1, {h}.size() - 1) : {h})"
    return (f"({bare}.contains('/') ? {bare} : ({bare}.contains(':') ? {bare} + '/128' : "
            f"{bare} + '/32'))")


def _within(c: str, e: str) -> str:
    """Ceiling entry `c` (protocol written) covers request entry `e` (egress.Ceiling.admits)."""
    hc, he, tc, te = _host(c), _host(e), _tail(c), _tail(e)
    port = (f"({tc} == {te} || ({tc}.startsWith('*/') && "
            f"{tc}.substring(1) == {te}.substring({te}.indexOf('/'))))")
    svc = (f"({hc}.startsWith('svc/') && {he}.startsWith('svc/') && ({hc} == {he} || "
           f"({hc}.startsWith('svc/*.') && {hc}.substring({hc}.indexOf('.')) == "
           f"{he}.substring({he}.indexOf('.')))))")
    net = (f"(!{hc}.startsWith('svc/') && !{he}.startsWith('svc/') && isCIDR({_cidr_text(hc)})"
           f" && {_contains(f'cidr({_cidr_text(hc)})', f'cidr({_cidr_text(he)})')})")
    return f"({port} && ({svc} || {net}))"


def _contains(outer: str, inner: str) -> str:
    """CIDR `outer` contains CIDR `inner`. Not containsCIDR: before Kubernetes 1.33 (and late
    1.31/1.32 patch releases) it refused every inner network whose address differs from the
    outer one's (10.5.0.0/16 in 10.0.0.0/8). containsIP and prefixLength are right in every
    version, so the rule does not depend on which patch release a cluster runs."""
    return (f"({outer}.containsIP({inner}.ip()) && "
            f"{outer}.prefixLength() <= {inner}.prefixLength())")


def _inside_never(e: str) -> str:
    he = _host(e)
    return (f"(!{he}.startsWith('svc/') && variables.egressNeverCidrs.exists(n, "
            f"{_contains('cidr(n)', f'cidr({_cidr_text(he)})')}))")


FIXED_VARIABLES: list[dict] = [
    {"name": "labels", "expression": "object.metadata.?labels.orValue({})"},
    {"name": "annotations", "expression": "object.metadata.?annotations.orValue({})"},
    {"name": "inits", "expression": "object.spec.?initContainers.orValue([])"},
    {"name": "labelledSandbox",
     "expression": f"variables.labels[?{_q(LABEL_SANDBOX)}].orValue('') == {_q(SANDBOX_TRUE)}"},
    # podspec.installs_execd: sandman's install init container, or a guard that installs execd,
    # makes a pod a sandbox whatever its labels say (init containers never change after create).
    {"name": "installed", "expression": _installs("variables.inits")},
    {"name": "sandbox", "expression": "variables.labelledSandbox || variables.installed"},
    {"name": "carriesGuard",
     "expression": f"variables.inits.exists(c, c.name == {_q(NETGUARD_CONTAINER)})"},
    {"name": "egress", "expression": f"variables.labels[?{_q(LABEL_EGRESS)}]"},
    {"name": "deny", "expression": f"variables.egress.orValue('') == {_q(EGRESS_DENY)}"},
    # The pod-level rules hold for sandboxes, for every pod that asks for egress deny and for
    # every pod carrying sandman's guard.
    {"name": "guarded",
     "expression": "variables.sandbox || variables.deny || variables.carriesGuard"},
    {"name": "ephemeral", "expression": "object.spec.?ephemeralContainers.orValue([])"},
    {"name": "guardFirst", "expression":
        f"variables.inits.size() > 0 && variables.inits[0].name == {_q(NETGUARD_CONTAINER)}"},
    {"name": "guardRequired", "expression":
        "variables.deny || (variables.sandbox && variables.guardAlways) || variables.carriesGuard"},
    # What sandbox.netguard_args renders: the annotation's CIDRs (split on commas, trimmed,
    # empties dropped) or the default sources, then the node's own address.
    {"name": "ingressFrom", "expression":
        f"variables.annotations[?{_q(ANNOTATION_INGRESS_FROM)}].hasValue() ? "
        f"variables.annotations[{_q(ANNOTATION_INGRESS_FROM)}].split(',')"
        ".map(p, p.trim()).filter(p, p != '') : variables.defaultIngressFrom"},
    # The egress allowlist (podspec.egress_allow): the annotation's entries as they are (the
    # webhook admits only sandman/egress.py's canonical text), each an --allow-egress, then the
    # admin's never CIDRs; nothing of either without the annotation.
    {"name": "egressAllow", "expression":
        f"variables.annotations[?{_q(ANNOTATION_EGRESS_ALLOW)}].hasValue() ? "
        f"variables.annotations[{_q(ANNOTATION_EGRESS_ALLOW)}].split(',') : []"},
    # The values as strings (an empty list literal is a list of dyn)...
    {"name": "egressNeverList", "expression": "variables.egressNever.map(n, string(n))"},
    # ...and the ceiling as the webhook reads it: a protocol left out is tcp.
    {"name": "egressCeilingTcp", "expression":
        "variables.egressCeiling.map(c, string(c)).map(c, "
        "c.substring(c.lastIndexOf(':')).contains('/') ? c : c + '/tcp')"},
    # Never ranges: sandman/egress.py's NEVER (and the NAT64 images of its IPv4 ones), the
    # admin's (a bare address is one address) and their NAT64 images.
    {"name": "egressNeverCidrs", "expression":
        f"{_list(_NEVER_CIDRS)} + variables.egressNeverList.map(n, n.contains('/') ? n : "
        "(n.contains(':') ? n + '/128' : n + '/32')) + "
        "variables.egressNat64Never.map(n, string(n))"},
    # ...and a sandbox's guard (labelled, or installing already) installs execd
    # (podspec.netguard_container). The args are head + flag/value pairs + tail, kept apart:
    # joining the pairs needs the lists extension's flatten(), which API servers before 1.35
    # refuse in a new expression ("undeclared reference to 'flatten'" on 1.33, `make
    # test-compat`); the validation below compares them index by index instead.
    {"name": "guardHead", "expression":
        f"['{NETGUARD_FLAG_EGRESS}', variables.deny ? {_q(EGRESS_DENY)} : {_q(EGRESS_ALLOW)}, "
        f"'{NETGUARD_FLAG_INGRESS_PORT}', {_q(str(EXECD_PORT))}]"},
    {"name": "guardPairs", "expression":
        f"variables.ingressFrom.map(c, ['{NETGUARD_FLAG_INGRESS_FROM}', c]) + "
        f"variables.egressAllow.map(e, ['{NETGUARD_FLAG_ALLOW_EGRESS}', e]) + "
        "(variables.egressAllow.size() > 0 ? "
        f"variables.egressNeverList.map(c, ['{NETGUARD_FLAG_NEVER_EGRESS}', c]) : [])"},
    {"name": "guardTail", "expression":
        f"[{', '.join(_q(a) for a in GUARD_ARGS_TAIL)}] + "
        f"(variables.sandbox ? {_list(INSTALL_EXECD_ARGS)} : [])"},
    # Every container but the guard at initContainers[0] (names are unique in a pod).
    {"name": "others", "expression":
        "variables.inits.filter(c, !(variables.guardFirst && "
        f"c.name == {_q(NETGUARD_CONTAINER)})) + object.spec.containers + variables.ephemeral"},
    {"name": "everyContainer",
     "expression": "variables.inits + object.spec.containers + variables.ephemeral"},
    {"name": "sized", "expression": "variables.inits + object.spec.containers"},
    # What sandbox.check_update judges. An UPDATE that makes the pod a sandbox or egress-deny
    # is judged whole (like a create); any other UPDATE only on the ephemeral containers it
    # adds, so a pod admitted under older rules can still be debugged and relabelled.
    {"name": "isUpdate", "expression": "request.operation == 'UPDATE' && oldObject != null"},
    {"name": "oldLabels",
     "expression": "variables.isUpdate ? oldObject.metadata.?labels.orValue({}) : {}"},
    {"name": "oldAnnotations",
     "expression": "variables.isUpdate ? oldObject.metadata.?annotations.orValue({}) : {}"},
    {"name": "oldSandbox", "expression":
        f"variables.isUpdate && (variables.oldLabels[?{_q(LABEL_SANDBOX)}].orValue('') == "
        f"{_q(SANDBOX_TRUE)} || {_installs('oldObject.spec.?initContainers.orValue([])')})"},
    {"name": "whole", "expression":
        "!variables.isUpdate || (variables.labelledSandbox && "
        f"variables.oldLabels[?{_q(LABEL_SANDBOX)}].orValue('') != {_q(SANDBOX_TRUE)}) || "
        f"(variables.deny && variables.oldLabels[?{_q(LABEL_EGRESS)}].orValue('') != "
        f"{_q(EGRESS_DENY)})"},
    {"name": "oldEphemeralNames", "expression":
        "variables.isUpdate ? oldObject.spec.?ephemeralContainers.orValue([]).map(c, c.name) "
        ": []"},
    {"name": "judged", "expression":
        "variables.whole ? variables.everyContainer : "
        "variables.ephemeral.filter(c, !(c.name in variables.oldEphemeralNames))"},
    # ...less the guard at initContainers[0] where the pod requires one (sandbox._is_guard_slot;
    # _check_guard judges its capabilities whole).
    {"name": "judgedNotGuard", "expression":
        "variables.whole ? variables.inits.filter(c, !(variables.guardRequired && "
        f"variables.guardFirst && c.name == {_q(NETGUARD_CONTAINER)})) + object.spec.containers "
        "+ variables.ephemeral : variables.judged"},
    {"name": "secretsRefused", "expression": "variables.sandbox && !variables.allowSecrets"},
    # podspec.toleration's key: "key[=value][:Effect]".
    {"name": "gpuTolerationKeys", "expression":
        "variables.gpuTolerations.map(t, t.split(':')[0].split('=')[0])"},
]


@dataclass(frozen=True)
class Validation:
    """One of the policy's validations: the CEL form of (part of) a webhook rule."""

    rule: str  # the webhook's rule name (docs/webhook.md), the message's prefix
    expression: str  # true: admit
    message: str  # CEL string expression; the caller prefixes "sandman <rule>: "


def _added(c: str) -> str:
    return f"{c}.?securityContext.?capabilities.?add.orValue([]).map(a, {_norm('a')})"


def _raw_dropped(c: str) -> str:
    return (f"{c}.?securityContext.?capabilities.?drop.orValue([]).exists(d, {_norm('d')} in "
            f"{_list([NET_RAW, 'ALL'])})")


def _unconfined_type(sc: str) -> str:
    """<sc> (a securityContext optional) sets seccompProfile Unconfined, or an appArmorProfile
    other than RuntimeDefault or Localhost."""
    return (f"{sc}.?seccompProfile.?type.orValue('').lowerAscii() == 'unconfined' || "
            f"({sc}.?appArmorProfile.hasValue() && "
            f"!({sc}.?appArmorProfile.?type.orValue('') in {_list(APPARMOR_TYPES)}))")


def _unconfined(c: str) -> str:
    return (f"({_unconfined_type(f'{c}.?securityContext')} || "
            f"{c}.?securityContext.?procMount.orValue('Default') != 'Default')")


# sandbox.profile_annotation_rules: seccomp's never unconfined, AppArmor's only runtime/default,
# localhost/<profile> or empty. On an UPDATE that is not judged whole, only annotations it adds
# or changes (a legacy profile for a container added later).
_UNCONFINED_ANNOTATION = (
    "(variables.whole || !(k in variables.oldAnnotations && "
    "variables.oldAnnotations[k] == variables.annotations[k])) && "
    f"(((k == {_q(SECCOMP_POD_ANNOTATION)} || k.startsWith({_q(SECCOMP_CONTAINER_PREFIX)})) && "
    "variables.annotations[k].lowerAscii() == 'unconfined') || "
    f"(k.startsWith({_q(APPARMOR_CONTAINER_PREFIX)}) && variables.annotations[k] != '' && "
    f"variables.annotations[k] != {_q(APPARMOR_RUNTIME_DEFAULT)} && "
    f"!variables.annotations[k].startsWith({_q(APPARMOR_LOCALHOST_PREFIX)})))")


def _selinux_ok(opts: str) -> str:
    """<opts> (a seLinuxOptions optional) within baseline: type allowed, user and role unset."""
    return (f"({opts}.?type.orValue('') in {_list(('', *BASELINE_SELINUX_TYPES))} && "
            f"{opts}.?user.orValue('') == '' && {opts}.?role.orValue('') == '')")


def _host_port(c: str) -> str:
    return f"{c}.?ports.orValue([]).exists(p, p.?hostPort.orValue(0) != 0)"


def _secret_env(c: str) -> str:
    return (f"({c}.?env.orValue([]).exists(e, e.?valueFrom.?secretKeyRef.hasValue()) || "
            f"{c}.?envFrom.orValue([]).exists(e, e.?secretRef.hasValue()))")


_SECRET_VOLUME = ("has(v.secret) || v.?projected.?sources.orValue([])"
                  ".exists(s, has(s.secret))")
_WHY_SECRET = ("a Secret of type service-account-token cannot be told from others at admission "
               "(the webhook\\'s --allow-secrets admits them)")


# API validation leaves exactly one source per volume and per projection, so "has one of the
# allowed fields" is sandbox._volume_rules' allowlist (a source Kubernetes adds later has none).
def _any_of(x: str, fields) -> str:
    return "(" + " || ".join(f"has({x}.{f})" for f in fields) + ")"


_VOLUME_OK = (f"{_any_of('v', VOLUME_TYPES)} && v.?projected.?sources.orValue([])"
              f".all(s, {_any_of('s', PROJECTED_SOURCES)})")


def _same(a: str, b: str) -> str:
    return f"({a}.hasValue() == {b}.hasValue() && {a}.orValue('') == {b}.orValue(''))"


def _guard(field: str) -> str:
    return f"variables.inits[0].{field}"


def _guard_args_are(args: str) -> str:
    """`args` is guardHead + guardPairs flattened + guardTail, compared index by index with
    the two-variable all() (Kubernetes 1.32's CEL: 1.33 API servers accept it in new
    expressions), not built with flatten() (1.35's)."""
    head, pairs = "variables.guardHead.size()", "variables.guardPairs.size()"
    return (f"{args}.size() == {head} + 2 * {pairs} + variables.guardTail.size() && "
            f"variables.guardHead.all(i, a, {args}[i] == a) && "
            f"variables.guardPairs.all(i, p, {args}[{head} + 2 * i] == p[0] && "
            f"{args}[{head} + 2 * i + 1] == p[1]) && "
            f"variables.guardTail.all(i, a, {args}[{head} + 2 * {pairs} + i] == a)")


_G = _q(f"container {NETGUARD_CONTAINER}: ")
_RES = ("cpu", "memory")


def _equal(base: str, name: str) -> str:
    """<base>'s resources: requests.<name> and limits.<name> both set and equal quantities."""
    req = f"{base}.?resources.?requests[?{_q(name)}]"
    lim = f"{base}.?resources.?limits[?{_q(name)}]"
    return (f"({req}.hasValue() && {lim}.hasValue() && "
            f"quantity({req}.value()).compareTo(quantity({lim}.value())) == 0)")


def _pod_level_equal(name: str) -> str:
    req = f"object.spec.?resources.?requests[?{_q(name)}]"
    lim = f"object.spec.?resources.?limits[?{_q(name)}]"
    return f"(!{req}.hasValue() && !{lim}.hasValue()) || {_equal('object.spec', name)}"


def _optional_equal(base: str, name: str) -> str:
    """Neither side sets <name>, or both do, equal (ephemeral-storage has no default)."""
    req = f"{base}.?resources.?requests[?{_q(name)}]"
    lim = f"{base}.?resources.?limits[?{_q(name)}]"
    return f"((!{req}.hasValue() && !{lim}.hasValue()) || {_equal(base, name)})"


def _sized_ok(c: str) -> str:
    return " && ".join([*(_equal(c, n) for n in _RES), _optional_equal(c, "ephemeral-storage")])


def _names(c: str) -> str:
    """The resource names container `c` asks for, requests and limits."""
    return (f"({c}.?resources.?requests.orValue({{}}).map(k, k) + "
            f"{c}.?resources.?limits.orValue({{}}).map(k, k))")


def _gpu_value(c: str, side: str) -> str:
    return f"{c}.?resources.?{side}[?variables.gpuResource]"


# A container with a GPU count above 0 (podspec._gpus; the API server keeps both sides equal).
def _has_gpu(c: str) -> str:
    return " || ".join(f"({_gpu_value(c, s)}.hasValue() && quantity({_gpu_value(c, s)}.value())"
                       ".isGreaterThan(quantity('0')))" for s in ("limits", "requests"))


def _over_max(c: str) -> str:
    return " || ".join(f"({_gpu_value(c, s)}.hasValue() && quantity({_gpu_value(c, s)}.value())"
                       ".isGreaterThan(quantity(string(variables.gpuMax))))"
                       for s in ("limits", "requests"))


_CORE_NAMES = _list(CORE_RESOURCES)
_ALLOWED_NAME = f"(k in {_CORE_NAMES} || k == variables.gpuResource)"
_GPU_TOLERATION = ("(t.?key.orValue('') in variables.gpuTolerationKeys || (t.?key.orValue('') == "
                   "'' && t.?operator.orValue('') == 'Exists'))")


RULES: list[Validation] = [
    # What makes the pod judged never changes (sandbox._identity_rules).
    # First: check_update judges these before anything else, and the API server reports
    # the first validation that fails.
    Validation("metadata-immutable",
         f"!variables.isUpdate || variables.oldLabels[?{_q(LABEL_SANDBOX)}].orValue('') != "
         f"{_q(SANDBOX_TRUE)} || variables.labelledSandbox",
         f"'label {LABEL_SANDBOX}={SANDBOX_TRUE} cannot be removed or changed; a new pod is "
         "needed'"),
    Validation("metadata-immutable",
         f"!variables.isUpdate || variables.oldLabels[?{_q(LABEL_EGRESS)}].orValue('') != "
         f"{_q(EGRESS_DENY)} || variables.deny",
         f"'label {LABEL_EGRESS}={EGRESS_DENY} cannot be removed or changed; a new pod is "
         "needed'"),
    Validation("metadata-immutable",
         "!variables.oldSandbox || "
         + _same(f"variables.annotations[?{_q(ANNOTATION_TOKEN_SHA256)}]",
                 f"variables.oldAnnotations[?{_q(ANNOTATION_TOKEN_SHA256)}]"),
         f"'annotation {ANNOTATION_TOKEN_SHA256} cannot change after create; a new pod is "
         "needed'"),
    Validation("metadata-immutable",
         "!variables.isUpdate || "
         + _same(f"variables.annotations[?{_q(ANNOTATION_EGRESS_ALLOW)}]",
                 f"variables.oldAnnotations[?{_q(ANNOTATION_EGRESS_ALLOW)}]"),
         f"'annotation {ANNOTATION_EGRESS_ALLOW} cannot change after create (netguard applied "
         "the list when the pod started); a new pod is needed'"),
    # podspec.egress_allow: with egress=deny only, in the canonical shape, within the ceiling,
    # never inside a never range. The webhook checks more (the exact canonical text, the API
    # server's addresses); the policy never refuses what it admits.
    Validation("egress-allow-invalid",
         f"!variables.annotations[?{_q(ANNOTATION_EGRESS_ALLOW)}].hasValue() || variables.deny",
         f"'annotation {ANNOTATION_EGRESS_ALLOW} needs label {LABEL_EGRESS}={EGRESS_DENY}'"),
    Validation("egress-allow-invalid",
         f"variables.annotations[?{_q(ANNOTATION_EGRESS_ALLOW)}].orValue('').size() <= "
         f"{egress_entries.MAX_ANNOTATION_CHARS} && variables.egressAllow.size() <= "
         f"{egress_entries.MAX_ENTRIES} && variables.egressAllow.all(e, e.matches("
         f"{_q(_ENTRY_SHAPE)}) && (e.startsWith('svc/') || isCIDR({_cidr_text(_host('e'))})))",
         f"'annotation {ANNOTATION_EGRESS_ALLOW} must be sandman\\'s canonical entries "
         "(CIDR:PORT/PROTO, [IPv6]:PORT/PROTO, svc/NAME.NAMESPACE:PORT/PROTO), at most "
         f"{egress_entries.MAX_ENTRIES}'"),
    # ...and a CIDR names its network: netguard would mask `10.1.2.3/8` to 10.0.0.0/8, so the
    # pod would run another list than its annotation (sandman/egress.py refuses host bits).
    Validation("egress-allow-invalid",
         "variables.egressAllow.filter(e, e.matches(" + _q(_ENTRY_SHAPE) + ") && "
         f"!e.startsWith('svc/')).map(e, {_cidr_text(_host('e'))}).all(x, !isCIDR(x) || "
         "string(cidr(x).masked()) == string(cidr(x)))",
         f"'annotation {ANNOTATION_EGRESS_ALLOW}: a CIDR entry has host bits set (write the "
         "network address)'"),
    Validation("egress-allow-refused",
         "variables.egressAllow.all(e, !e.matches(" + _q(_ENTRY_SHAPE) + ") || "
         "(!" + _inside_never("e") + " && variables.egressCeilingTcp.exists(c, "
         + _within("c", "e") + ")))",
         "'egress entries ' + variables.egressAllow.filter(e, e.matches(" + _q(_ENTRY_SHAPE)
         + ") && (" + _inside_never("e") + " || !variables.egressCeilingTcp.exists(c, "
         + _within("c", "e") + "))).join(', ') + ' are outside the cluster\\'s ceiling "
         "(sandbox.egressCeiling) or never allowed'"),
    # podspec._cluster_dns_only: netguard resolves svc/ entries through the pod's own resolver.
    Validation("egress-allow-refused",
         "!variables.egressAllow.exists(e, e.startsWith('svc/')) || "
         "(object.spec.?hostAliases.orValue([]).size() == 0 && "
         "!object.spec.?dnsConfig.hasValue() && "
         "object.spec.?dnsPolicy.orValue('ClusterFirst') == 'ClusterFirst')",
         f"'annotation {ANNOTATION_EGRESS_ALLOW} has svc/ entries, which netguard resolves "
         "through the cluster\\'s DNS: the pod must set no hostAliases, no dnsConfig and "
         "dnsPolicy ClusterFirst (or none)'"),
    Validation("egress-label-invalid",
         f"!variables.egress.hasValue() || variables.egress.value() in "
         f"{_list([EGRESS_DENY, EGRESS_ALLOW])}",
         f"'label {LABEL_EGRESS}=' + variables.egress.value() + ' is neither "
         f"{EGRESS_DENY} nor {EGRESS_ALLOW}; a mistyped deny would leave egress open'"),
    Validation("guard-missing",
         "!variables.guardRequired || variables.guardFirst",
         f"{_G} + (variables.deny ? 'egress is denied by label' : "
         "'the cluster guards every sandbox') + ' but initContainers[0] is ' + "
         "(variables.inits.size() > 0 ? variables.inits[0].name : 'absent') + "
         "', not netguard; a label alone is not enforcement'"),
    Validation("guard-misconfigured",
         f"!variables.guardRequired || !variables.guardFirst || {_guard('?image')}.orValue('') "
         "== variables.image",
         f"{_G} + 'image ' + {_guard('?image')}.orValue('') + ' is not ' + variables.image"),
    Validation("guard-misconfigured",
         "!variables.guardRequired || !variables.guardFirst || "
         f"({_guard('?command')}.orValue([]) == {_list(_GUARD_COMMAND)} && "
         f"{_guard_args_are('variables.inits[0].?args.orValue([])')})",
         f"{_G} + 'command and args must be exactly ' + "
         f"({_list(_GUARD_COMMAND)} + variables.guardHead).join(' ') + "
         "variables.guardPairs.map(p, ' ' + p[0] + ' ' + p[1]).join('') + ' ' + "
         "variables.guardTail.join(' ') + ' (the pod\\'s policy)'"),
    Validation("guard-misconfigured",
         "!variables.guardRequired || !variables.guardFirst || "
         f"(sets.equivalent({_added('variables.inits[0]')}, {_list(_CAPS)}) && "
         f"{_guard('?securityContext.?capabilities.?drop')}.orValue([])"
         f".exists(d, {_norm('d')} == 'ALL') && "
         f"{_guard('?securityContext.?readOnlyRootFilesystem')}.orValue(false) == true && "
         f"{_guard('?securityContext.?privileged')}.orValue(false) != true && "
         f"!{_guard('?restartPolicy')}.hasValue())",
         f"{_G} + 'capabilities must add exactly {'+'.join(_CAPS)} and drop ALL, with a "
         "read-only root filesystem, not privileged, and no restartPolicy (it must finish "
         "before the pod starts)'"),
    # The guard's environment, working directory and mounts (sandbox._check_guard): an env
    # var of its own expands into --ingress-from ($(SANDMAN_NODE_IP)=0.0.0.0/0 opens ingress),
    # PYTHONPATH or a working directory or mount over its code runs something else with
    # NET_ADMIN. API validation leaves one source per env var, so name + fieldPath is exact;
    # the service-account plugin's token mount is tolerated (an egress-deny pod is not mutated).
    Validation("guard-misconfigured",
         "!variables.guardRequired || !variables.guardFirst || ("
         f"{_guard('?env')}.orValue([]).size() == 1 && "
         f"{_guard('?env')}.orValue([])[0].name == {_q(NODE_IP_ENV)} && "
         f"{_guard('?env')}.orValue([])[0].?valueFrom.?fieldRef.?fieldPath.orValue('') == "
         "'status.hostIP' && "
         f"!{_guard('?envFrom')}.hasValue() && !{_guard('?workingDir')}.hasValue() && "
         f"{_guard('?volumeMounts')}.orValue([]).all(m, "
         f"(m.name == {_q(SANDMAN_VOLUME)} && !has(m.subPathExpr) && (variables.sandbox"
         f" ? (m.mountPath == {_q(EXECD_DIR)} && !has(m.subPath)) : (m.mountPath == "
         f"{_q(RUN_DIR)} && m.?subPath.orValue('') == 'run'))) || "
         f"(m.name.startsWith({_q(SA_TOKEN_VOLUME_PREFIX)}) && "
         "object.spec.?volumes.orValue([]).exists(v, v.name == m.name && "
         "v.?projected.?sources.orValue([]).exists(s, has(s.serviceAccountToken))))))",
         f"{_G} + 'env must be exactly {NODE_IP_ENV} from status.hostIP, with no envFrom, no "
         f"workingDir and only the {SANDMAN_VOLUME} volume mounted, at {EXECD_DIR} in a sandbox"
         f" (its guard installs execd), else at {RUN_DIR} (subPath run), as sandman renders "
         "it'"),
    Validation("guard-misconfigured",
         "!variables.sandbox || "
         f"!variables.others.exists(c, c.name == {_q(NETGUARD_CONTAINER)})",
         f"{_G} + 'netguard must be initContainers[0]'"),
    # podspec.RULES order: under hostNetwork the API server defaults hostPort to
    # containerPort, so host-namespace must be reported before host-port.
    Validation("host-namespace",
         "!variables.guarded || !(object.spec.?hostNetwork.orValue(false) || "
         "object.spec.?hostPID.orValue(false) || object.spec.?hostIPC.orValue(false))",
         "'hostNetwork, hostPID and hostIPC must not be set: host namespaces bypass the pod\\'s "
         "network guard and isolation'"),
    Validation("privileged",
         "!variables.guarded || !variables.everyContainer.exists(c, "
         "c.?securityContext.?privileged.orValue(false) == true)",
         "'containers ' + variables.everyContainer.filter(c, "
         "c.?securityContext.?privileged.orValue(false) == true).map(c, c.name).join(', ') + "
         "' are privileged; a privileged container can undo every guard'"),
    Validation("capability-added",
         f"!variables.guarded || variables.others.all(c, {_added('c')}.size() == 0)",
         "'containers ' + variables.others.filter(c, "
         f"{_added('c')}.size() > 0).map(c, c.name).join(', ') + ' add capabilities; only "
         f"netguard at initContainers[0] may add {'+'.join(_CAPS)} (every container shares "
         "the pod\\'s network and could undo the guard)'"),
    Validation("capability-added",
         f"!variables.guarded || !variables.guardFirst || {_added('variables.inits[0]')}"
         f".all(a, a in {_list(_CAPS)})",
         f"{_G} + 'adds more than {'+'.join(_CAPS)}'"),
    Validation("net-raw-not-dropped",
         f"!variables.guarded || variables.judgedNotGuard.all(c, {_raw_dropped('c')})",
         "'containers ' + variables.judgedNotGuard.filter(c, "
         f"!{_raw_dropped('c')}).map(c, c.name).join(', ') + ': add NET_RAW (or ALL) to "
         "securityContext.capabilities.drop: runtimes grant it by default and an AF_PACKET "
         "socket sends past the guard\\'s rules'"),
    Validation("unconfined",
         f"!variables.guarded || !variables.judged.exists(c, {_unconfined('c')})",
         "'containers ' + variables.judged.filter(c, "
         f"{_unconfined('c')}).map(c, c.name).join(', ') + ' set a seccomp or AppArmor "
         "profile Unconfined or an unmasked procMount'"),
    Validation("unconfined",
         "!variables.guarded || !variables.whole || "
         f"!({_unconfined_type('object.spec.?securityContext')})",
         "'the pod\\'s securityContext sets seccomp Unconfined or an AppArmor profile other "
         f"than {' or '.join(APPARMOR_TYPES)}'"),
    Validation("unconfined",
         f"!variables.guarded || !variables.annotations.exists(k, {_UNCONFINED_ANNOTATION})",
         f"'a legacy seccomp annotation is unconfined, or an AppArmor annotation is not "
         f"{APPARMOR_RUNTIME_DEFAULT} or {APPARMOR_LOCALHOST_PREFIX}<profile>'"),
    # Pod Security Standards baseline (docs/webhook.md's table), as sandbox._container_rules
    # and _pod_rules judge it.
    Validation("host-port",
         f"!variables.guarded || !variables.judged.exists(c, {_host_port('c')})",
         "'containers ' + variables.judged.filter(c, "
         f"{_host_port('c')}).map(c, c.name).join(', ') + ' set a hostPort, which opens the "
         "node\\'s port past the pod\\'s guard'"),
    Validation("selinux",
         "!variables.guarded || variables.judged.all(c, "
         f"{_selinux_ok('c.?securityContext.?seLinuxOptions')})",
         "'containers ' + variables.judged.filter(c, "
         f"!{_selinux_ok('c.?securityContext.?seLinuxOptions')}).map(c, c.name).join(', ') + "
         f"' set seLinuxOptions outside baseline (type {', '.join(BASELINE_SELINUX_TYPES)} or "
         "unset; no user, no role)'"),
    Validation("selinux",
         "!variables.guarded || !variables.whole || "
         f"{_selinux_ok('object.spec.?securityContext.?seLinuxOptions')}",
         f"'the pod sets seLinuxOptions outside baseline (type "
         f"{', '.join(BASELINE_SELINUX_TYPES)} or unset; no user, no role)'"),
    Validation("sysctl",
         "!variables.guarded || !variables.whole || "
         f"object.spec.?securityContext.?sysctls.orValue([]).all(s, s.name in "
         f"{_list(BASELINE_SYSCTLS)})",
         "'sysctls ' + object.spec.?securityContext.?sysctls.orValue([]).filter(s, "
         f"!(s.name in {_list(BASELINE_SYSCTLS)})).map(s, s.name).join(', ') + ' are not in "
         "Pod Security baseline\\'s safe set'"),
    Validation("sandbox-label",
         "variables.isUpdate || !variables.installed || variables.labelledSandbox",
         f"'the pod carries sandman\\'s execd install ({EXECD_INSTALL_CONTAINER}, or netguard\\'s "
         f"{INSTALL_EXECD_ARGS[0]}) but is not labelled {LABEL_SANDBOX}={SANDBOX_TRUE}'"),
    # inline csi, nfs, iscsi, cephfs, image, ...: mounted by the node, from the node's network
    # (an nfs server anywhere is a way out that netguard never sees) or exposing the node.
    Validation("volume-type",
         f"!variables.guarded || !variables.whole || object.spec.?volumes.orValue([])"
         f".all(v, {_VOLUME_OK})",
         "'volumes ' + object.spec.?volumes.orValue([]).filter(v, "
         f"!({_VOLUME_OK})).map(v, v.name).join(', ') + ' are not of an allowed type "
         f"({', '.join(VOLUME_TYPES)}; projected: {', '.join(PROJECTED_SOURCES)})'"),
    Validation("secret-refused",
         "!variables.secretsRefused || !variables.whole || "
         f"!object.spec.?volumes.orValue([]).exists(v, {_SECRET_VOLUME})",
         "'volumes ' + object.spec.?volumes.orValue([]).filter(v, "
         f"{_SECRET_VOLUME}).map(v, v.name).join(', ') + ' mount a Secret; {_WHY_SECRET}'"),
    Validation("secret-refused",
         f"!variables.secretsRefused || !variables.judged.exists(c, {_secret_env('c')})",
         "'containers ' + variables.judged.filter(c, "
         f"{_secret_env('c')}).map(c, c.name).join(', ') + ' take env from a Secret; "
         f"{_WHY_SECRET}'"),
    Validation("resources-unequal",
         f"!variables.sandbox || variables.sized.all(c, {_sized_ok('c')})",
         f"'containers ' + variables.sized.filter(c, !({_sized_ok('c')})).map(c, c.name)"
         ".join(', ') + ' need cpu and memory requests == limits (Guaranteed QoS), and "
         "ephemeral-storage requests == limits where either is set'"),
    # podspec._resource_rules. The webhook bounds the pod's total GPUs; CEL has no sum, so the
    # policy bounds each container (a subset: it never refuses what the webhook admits).
    Validation("extended-resource",
         f"!variables.sandbox || variables.everyContainer.all(c, {_names('c')}"
         f".all(k, {_ALLOWED_NAME}))",
         "'containers ' + variables.everyContainer.filter(c, "
         f"!{_names('c')}.all(k, {_ALLOWED_NAME})).map(c, c.name).join(', ') + ' ask for a "
         f"resource other than {', '.join(CORE_RESOURCES)} and ' + variables.gpuResource"),
    Validation("extended-resource",
         "!variables.sandbox || object.spec.?resources.?requests.orValue({}).all(k, k in "
         "['cpu', 'memory']) && object.spec.?resources.?limits.orValue({}).all(k, k in "
         "['cpu', 'memory'])",
         "'pod-level resources ask for more than cpu and memory'"),
    Validation("gpu-refused",
         "!variables.sandbox || !(variables.inits + variables.ephemeral).exists(c, "
         f"{_names('c')}.exists(k, k == variables.gpuResource))",
         "'init containers ' + (variables.inits + variables.ephemeral).filter(c, "
         f"{_names('c')}.exists(k, k == variables.gpuResource)).map(c, c.name).join(', ') + "
         "' ask for ' + variables.gpuResource + '; only the sandbox\\'s containers may'"),
    Validation("gpu-refused",
         "!variables.sandbox || variables.gpuMax > 0 || !object.spec.containers.exists(c, "
         f"{_names('c')}.exists(k, k == variables.gpuResource))",
         "'containers ask for ' + variables.gpuResource + '; this cluster grants sandboxes no "
         "GPUs (chart sandbox.gpu.enabled)'"),
    Validation("gpu-refused",
         f"!variables.sandbox || !object.spec.containers.exists(c, {_over_max('c')})",
         "'a container asks for more than ' + string(variables.gpuMax) + ' ' + "
         "variables.gpuResource + ' (chart sandbox.gpu.max)'"),
    Validation("gpu-toleration",
         "!variables.sandbox || variables.gpuTolerationKeys.size() == 0 || "
         f"object.spec.containers.exists(c, {_has_gpu('c')}) || "
         f"!object.spec.?tolerations.orValue([]).exists(t, {_GPU_TOLERATION})",
         "'the pod tolerates the GPU nodes\\' taints (' + variables.gpuTolerationKeys.join(', ')"
         " + ') without asking for ' + variables.gpuResource + ': GPU nodes are for GPU "
         "sandboxes'"),
    Validation("resources-unequal",
         "!variables.sandbox || !has(object.spec.resources) || ("
         + " && ".join(f"({_pod_level_equal(n)})" for n in _RES) + ")",
         "'pod-level resources need cpu and memory requests == limits'"),
    Validation("service-account-token",
         "!variables.sandbox || object.spec.?automountServiceAccountToken.orValue(true) == false",
         "'automountServiceAccountToken must be false'"),
    Validation("service-account-token",
         "!variables.sandbox || !object.spec.?volumes.orValue([]).exists(v, "
         "v.?projected.?sources.orValue([]).exists(s, has(s.serviceAccountToken)))",
         "'volumes ' + object.spec.?volumes.orValue([]).filter(v, "
         "v.?projected.?sources.orValue([]).exists(s, has(s.serviceAccountToken)))"
         ".map(v, v.name).join(', ') + ' project a service-account token'"),
    Validation("service-links",
         "!variables.sandbox || object.spec.?enableServiceLinks.orValue(true) == false",
         "'enableServiceLinks must be false (every Service in the namespace becomes environment "
         "variables in the sandbox)'"),
    Validation("token-hash",
         f"!variables.sandbox || variables.annotations[?{_q(ANNOTATION_TOKEN_SHA256)}]"
         ".orValue('').matches('^[0-9a-f]{64}$')",
         f"'annotation {ANNOTATION_TOKEN_SHA256} must be 64 lowercase hex characters'"),
    # A guarded sandbox's guard installs execd: an install container beside it is not sandman's
    # (it would write the volume after the guard, over sandman's execd).
    Validation("not-mutated",
         "!variables.sandbox || !variables.guardRequired || "
         f"!variables.inits.exists(c, c.name == {_q(EXECD_INSTALL_CONTAINER)})",
         f"'a guarded sandbox\\'s guard installs execd ({INSTALL_EXECD_ARGS[0]}); "
         f"{EXECD_INSTALL_CONTAINER} is not sandman\\'s here'"),
    Validation("not-mutated",
         "!variables.sandbox || variables.installed",
         "'sandman\\'s mutating webhook did not run on this pod (is its configuration "
         "missing?)'"),
]

# The rule names the policy enforces (docs/webhook.md lists each).
RULE_NAMES = tuple(dict.fromkeys(r.rule for r in RULES))


def validations() -> list[dict]:
    return [{"expression": r.expression,
             "messageExpression": f"'sandman {r.rule}: ' + {r.message}",
             "reason": "Forbidden"} for r in RULES]


def _inputs_same() -> str:
    """The UPDATE changes nothing the rules read (sandbox.INPUT_LABELS / INPUT_ANNOTATIONS and
    the spec)."""
    parts = ["object.spec == oldObject.spec"]
    for field, keys in (("labels", INPUT_LABELS), ("annotations", INPUT_ANNOTATIONS)):
        for k in keys:
            parts.append(_same(f"object.metadata.?{field}.orValue({{}})[?{_q(k)}]",
                               f"oldObject.metadata.?{field}.orValue({{}})[?{_q(k)}]"))
    # ...and no per-container legacy profile annotation added or changed.
    new, old = "object.metadata.?annotations.orValue({})", "oldObject.metadata.?annotations.orValue({})"
    prefixed = " || ".join(f"k.startsWith({_q(p)})" for p in INPUT_ANNOTATION_PREFIXES)
    parts.append(f"{new}.all(k, !({prefixed}) || (k in {old} && {old}[k] == {new}[k]))")
    return " && ".join(parts)


def _judged(obj: str) -> str:
    labels = f"{obj}.metadata.?labels.orValue({{}})"
    return (f"({labels}[?{_q(LABEL_SANDBOX)}].orValue('') == {_q(SANDBOX_TRUE)} || "
            f"{_q(LABEL_EGRESS)} in {labels} || "
            f"{obj}.spec.?initContainers.orValue([]).exists(c, c.name in "
            f"{_list((EXECD_INSTALL_CONTAINER, NETGUARD_CONTAINER))}))")


def match_conditions() -> list[dict]:
    """Sandboxes and pods carrying the egress label; on UPDATE only when the update changes
    an input of the rules. So a pod admitted under older rules (before an image upgrade, a
    narrowed ingress default, the policy itself) can still have its state labels or finalizers
    changed, while a relabel to egress=deny, a changed ingress-from annotation, a swapped guard
    image or an added ephemeral container is judged on the new pod as a whole."""
    return [
        # sandbox.is_judged on the new pod or, on UPDATE, the old one: stripping the labels
        # is judged too, and sandman's init containers count whatever the labels say.
        {"name": "sandman-pod", "expression":
            f"{_judged('object')} || (request.operation == 'UPDATE' && oldObject != null && "
            f"{_judged('oldObject')})"},
        {"name": "inputs-changed", "expression":
            f"request.operation != 'UPDATE' || !({_inputs_same()})"},
    ]


def admission_policy(name: str, policy: SandboxPolicy) -> dict:
    return {
        "apiVersion": API_VERSION, "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name},
        "spec": {
            # An expression that errors refuses (fail closed), like the webhook's Fail.
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [{
                "apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"],
                "resources": ["pods", "pods/ephemeralcontainers"], "scope": "Namespaced"}]},
            "matchConditions": match_conditions(),
            "variables": policy_variables(policy) + FIXED_VARIABLES,
            "validations": validations(),
        },
    }


def binding(name: str, policy_name: str, namespace_selector: dict) -> dict:
    return {
        "apiVersion": API_VERSION, "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name},
        "spec": {"policyName": policy_name, "validationActions": ["Deny"],
                 "matchResources": {"namespaceSelector": namespace_selector}},
    }


# --- the chart ---------------------------------------------------------------------------------

# The values-dependent variables, as the chart renders them (CEL literals from values).
CHART_VARIABLES = {
    "image": '{{ include "sandman.image" . | toJson | quote }}',
    "defaultIngressFrom":
        '{{ default (list "0.0.0.0/0") .Values.sandbox.ingressFrom | toJson | quote }}',
    "guardAlways": '{{ eq .Values.sandbox.guard "always" | toString | quote }}',
    "allowSecrets": '{{ .Values.sandbox.allowSecrets | toString | quote }}',
    "gpuResource": '{{ .Values.sandbox.gpu.resource | toJson | quote }}',
    "gpuMax": '{{ ternary (int .Values.sandbox.gpu.max) 0 .Values.sandbox.gpu.enabled '
              '| toString | quote }}',
    "gpuTolerations": '{{ .Values.sandbox.gpu.tolerations | default list | toJson | quote }}',
    "egressCeiling": '{{ include "sandman.egressCeilingEntries" . | quote }}',
    "egressNever": '{{ .Values.sandbox.egressNever | default list | toJson | quote }}',
    "egressNat64Never": '{{ include "sandman.egressNeverNat64" . | quote }}',
}
_PLACEHOLDER = "SANDMAN_CHART_VARIABLE_{}"


def chart_template() -> str:
    """charts/sandman/templates/_policy.tpl: the policy's spec as a named template, the
    values-dependent variables filled in by Helm (charts/gen_contract.py writes it)."""
    import yaml

    spec = admission_policy("x", SandboxPolicy())["spec"]
    for v in spec["variables"]:
        if v["name"] in CHART_VARIABLES:
            v["expression"] = _PLACEHOLDER.format(v["name"])
    text = yaml.safe_dump(spec, sort_keys=False, width=10_000, default_flow_style=False)
    if "{{" in text or "}}" in text:
        raise ValueError("template delimiters in the policy's CEL")
    for name, action in CHART_VARIABLES.items():
        text = text.replace(_PLACEHOLDER.format(name), action)
    return ("{{- /* GENERATED by charts/gen_contract.py from webhook/policy.py: do not edit. */ -}}\n"
            '{{- define "sandman.policy.spec" -}}\n' + text.rstrip("\n") + "\n{{- end -}}\n")


# --- the controller's books labels --------------------------------------------------------------
# A policy of its own (not a validation of the one above): that one's matchConditions select
# sandboxes only, and the pods forged into the controller's books carry no sandbox label.
BOOKS_RULE = "books-labels"


def _books_labels_set() -> str:
    """The request sets the controller's labels: a create with managed-by=sandman-controller or
    a state label, or an update that adds, changes or removes either (managed-by only where
    either side is the controller's value: other tools use that standard label too)."""
    from sandman.contract import LABEL_MANAGED_BY, LABEL_STATE, MANAGED_BY_CONTROLLER

    new = "object.metadata.?labels.orValue({})"
    old = "oldObject.metadata.?labels.orValue({})"
    mb, st, ctl = _q(LABEL_MANAGED_BY), _q(LABEL_STATE), _q(MANAGED_BY_CONTROLLER)
    return (f"request.operation == 'CREATE' ? ({new}[?{mb}].orValue('') == {ctl} || {st} in {new})"
            f" : (oldObject != null && (!{_same(f'{new}[?{st}]', f'{old}[?{st}]')} || "
            f"(({new}[?{mb}].orValue('') == {ctl} || {old}[?{mb}].orValue('') == {ctl}) && "
            f"!{_same(f'{new}[?{mb}]', f'{old}[?{mb}]')})))")


def controller_user(namespace: str, service_account: str) -> str:
    return f"system:serviceaccount:{namespace}:{service_account}"


def books_policy(name: str, user: str) -> dict:
    """Only `user` (the controller's ServiceAccount) may create a pod with the controller's
    books labels or change them: the labels a restarted controller rebuilds its books from."""
    from sandman.contract import LABEL_MANAGED_BY, LABEL_STATE

    return {
        "apiVersion": API_VERSION, "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [{
                "apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"],
                "resources": ["pods"], "scope": "Namespaced"}]},
            "matchConditions": [{"name": "sets-books-labels", "expression": _books_labels_set()}],
            "variables": [{"name": "controllerUser", "expression": _q(user)}],
            "validations": [{
                "expression": "request.userInfo.username == variables.controllerUser",
                "messageExpression": (
                    f"'sandman {BOOKS_RULE}: only the controller (' + variables.controllerUser "
                    f"+ ') may set or change the labels {LABEL_MANAGED_BY} and {LABEL_STATE}; "
                    "request from ' + request.userInfo.username"),
                "reason": "Forbidden"}],
        },
    }


BOOKS_CHART_USER = ('{{ printf "system:serviceaccount:%s:%s" .Release.Namespace '
                    '(include "sandman.controller.fullname" .) | toJson | quote }}')


def books_chart_template() -> str:
    """charts/sandman/templates/_books_policy.tpl: books_policy's spec, the controller's
    ServiceAccount filled in by Helm (charts/gen_contract.py writes it)."""
    import yaml

    spec = books_policy("x", _PLACEHOLDER.format("controllerUser"))["spec"]
    spec["variables"][0]["expression"] = _PLACEHOLDER.format("controllerUser")
    text = yaml.safe_dump(spec, sort_keys=False, width=10_000, default_flow_style=False)
    if "{{" in text or "}}" in text:
        raise ValueError("template delimiters in the policy's CEL")
    text = text.replace(_PLACEHOLDER.format("controllerUser"), BOOKS_CHART_USER)
    return ("{{- /* GENERATED by charts/gen_contract.py from webhook/policy.py: do not edit. */ -}}\n"
            '{{- define "sandman.booksPolicy.spec" -}}\n' + text.rstrip("\n") + "\n{{- end -}}\n")
