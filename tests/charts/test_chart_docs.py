"""What the docs say the chart installs, checked against `helm template` (no cluster): every
object name they give as `<fullname>-...` or `<release>-...` is one the chart renders, of the
kind the sentence names, and the controller's ClusterRole rules docs/install.md lists are
the rendered ones, no more and no fewer. A renamed template or a new rule fails here until
the page says so too (tests/test_docs_names.py checks the values keys, flags and paths)."""

from __future__ import annotations

import re

import pytest

from tests.charts.helm import ROOT, Helm, objects

DOCS = [ROOT / "README.md", ROOT / "client" / "README.md", ROOT / "charts" / "sandman" / "README.md",
        *sorted((ROOT / "docs").glob("*.md"))]
TESTDATA = ROOT / "tests" / "charts" / "testdata" / "values"
# A release name without "sandman" in it, so `<release>` and `<fullname>` render apart.
RELEASE, NAMESPACE = "rel", "ns"
FULLNAME = f"{RELEASE}-sandman"
# Renders that together hold every object a page names: the default, cert-manager's
# Certificates, the egress ceiling's NetworkPolicy.
CASES = ("default", "cert-manager", "egress-allowlist")

# Kinds as a sentence names them, next to the name ("ConfigMap `<fullname>-ca`",
# "the `<fullname>-sandbox-egress-ceiling` NetworkPolicy").
KINDS = ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration",
         "ValidatingAdmissionPolicyBinding", "ValidatingAdmissionPolicy",
         "PriorityLevelConfiguration", "FlowSchema", "ClusterRoleBinding", "ClusterRole",
         "RoleBinding", "Role", "ConfigMap", "Secret", "Certificate", "Issuer", "NetworkPolicy",
         "ServiceAccount", "Service", "Deployment", "CronJob", "Job", "PodDisruptionBudget",
         "PriorityClass")
_KIND = "|".join(KINDS)
_KIND_WORD = re.compile(rf"\b({_KIND})s?\b")
_AFTER = re.compile(rf"^\s*({_KIND})\b")
_PLACEHOLDER = re.compile(r"<(fullname|release)>((?:-(?:[a-z0-9]+|<release namespace>|<namespace>))*)")
_SPAN = re.compile(r"`([^`\n]+)`")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, set[str]]:
    helm = Helm(tmp_path_factory.mktemp("helm-home"))
    return names_by_kind([o for case in CASES for o in objects(helm.template(
        *([] if case == "default" else ["-f", str(TESTDATA / f"{case}.yaml")]),
        release=RELEASE, namespace=NAMESPACE).stdout)])


def names_by_kind(objs: list[dict]) -> dict[str, set[str]]:
    """{name: kinds} of every rendered object, and of the Secrets the chart names in a Role
    (the certificate Job creates them; no template renders them)."""
    out: dict[str, set[str]] = {}
    for o in objs:
        out.setdefault(o["metadata"]["name"], set()).add(o["kind"])
        if o["kind"] == "Role":
            for rule in o.get("rules", []):
                if rule.get("resources") == ["secrets"]:
                    for name in rule.get("resourceNames", []):
                        out.setdefault(name, set()).add("Secret")
    return out


def resolve(placeholder: str) -> str:
    return (placeholder.replace("<fullname>", FULLNAME).replace("<release namespace>", NAMESPACE)
            .replace("<namespace>", NAMESPACE).replace("<release>", RELEASE))


def names_given(page: str, text: str):
    """(where, name as written, kind the sentence gives or None) of every `<fullname>-...` or
    `<release>-...` object name in a code span of the page."""
    for n, line in enumerate(text.splitlines(), 1):
        for span in _SPAN.finditer(line):
            for m in _PLACEHOLDER.finditer(span.group(1)):
                if not m.group(2) or m.group() == "<release>-sandman":
                    continue  # `<release>-sandman` is what `<fullname>` stands for
                kind = None
                if m.group() == span.group(1):  # a name alone in its span: the kind beside it
                    before = line[:span.start()].rsplit("`", 1)[-1]
                    near = [k for k in _KIND_WORD.finditer(before)
                            if len(before) - k.end() <= 25 and "|" not in before[k.end():]]
                    after = _AFTER.match(line[span.end():])
                    kind = after.group(1) if after else near[-1].group(1) if near else None
                yield f"{page}:{n}", m.group(), kind


def name_findings(pages: dict[str, str], have: dict[str, set[str]]) -> list[str]:
    bad = []
    for page, text in pages.items():
        for where, name, kind in names_given(page, text):
            kinds = have.get(resolve(name))
            if not kinds:
                bad.append(f"{where}: `{name}` ({resolve(name)} for release {RELEASE!r}): the "
                           f"chart renders no object of that name")
            elif kind and kind not in kinds:
                bad.append(f"{where}: `{name}` is a {'/'.join(sorted(kinds))}, the page says "
                           f"{kind}")
    return bad


def _pages() -> dict[str, str]:
    return {p.relative_to(ROOT).as_posix(): p.read_text() for p in DOCS}


def test_every_object_name_the_docs_give_is_rendered_with_its_kind(rendered):
    pages = _pages()
    given = [x for page, text in pages.items() for x in names_given(page, text)]
    assert len(given) >= 10 and any(n == "<fullname>-ca" for _, n, _ in given), given
    bad = name_findings(pages, rendered)
    assert not bad, "\n".join(bad)


def test_fullname_is_what_the_docs_say(tmp_path):
    """docs/install.md: `<fullname>` is the release name, or `<release>-sandman` when the
    release name does not contain `sandman`."""
    helm = Helm(tmp_path)
    for release, fullname in (("rel", "rel-sandman"), ("my-sandman-2", "my-sandman-2")):
        have = names_by_kind(objects(helm.template(release=release, namespace=NAMESPACE).stdout))
        assert "Deployment" in have.get(f"{fullname}-controller", set()), (release, have)
        assert "ConfigMap" in have.get(f"{fullname}-ca", set()), (release, have)


# ---- the controller's ClusterRole -------------------------------------------------------------

def documented_cluster_role(text: str) -> tuple[str, set[tuple[str, str]]]:
    """docs/install.md's "What gets installed": the controller's ClusterRole's name and its
    (resource, verb) pairs, written "`create` tokenreviews and subjectaccessreviews (...),
    `list/watch` events (...)"."""
    m = re.search(r"ClusterRole `(<fullname>-controller[^`]*)`: (.*?); webhook", text)
    assert m, "docs/install.md no longer lists the controller's ClusterRole's rules"
    pairs = set()
    for verbs, resources in re.findall(r"`([a-z/]+)` ([a-z]+(?: and [a-z]+)*)",
                                       re.sub(r"\([^()]*\)", "", m.group(2))):
        pairs |= {(r, v) for r in resources.split(" and ") for v in verbs.split("/")}
    return m.group(1), pairs


def rendered_cluster_role(objs: list[dict], name: str) -> set[tuple[str, str]]:
    (role,) = [o for o in objs if o["kind"] == "ClusterRole" and o["metadata"]["name"] == name]
    return {(r, v) for rule in role["rules"] for r in rule["resources"] for v in rule["verbs"]}


def test_the_controllers_cluster_role_is_what_install_md_lists(tmp_path):
    name, documented = documented_cluster_role((ROOT / "docs" / "install.md").read_text())
    objs = objects(Helm(tmp_path).template(release=RELEASE, namespace=NAMESPACE).stdout)
    assert rendered_cluster_role(objs, resolve(name)) == documented


# ---- the checks see wrong statements ----------------------------------------------------------

def test_the_checks_see_wrong_statements():
    have = {f"{FULLNAME}-ca": {"ConfigMap"}, f"{FULLNAME}-controller-ns": {"ClusterRole"}}
    page = ("copies it into **ConfigMap `<release>-ca`** (key `ca.crt`); the\n"
            "`<fullname>-ca` Secret, ClusterRole `<fullname>-controller-<release namespace>`,\n"
            "`<release>-sandman` and `app.kubernetes.io/instance=<release>`.\n")
    assert [(n, k) for _, n, k in names_given("x.md", page)] == [
        ("<release>-ca", "ConfigMap"), ("<fullname>-ca", "Secret"),
        ("<fullname>-controller-<release namespace>", "ClusterRole")]
    bad = name_findings({"x.md": page}, have)
    assert len(bad) == 2 and "x.md:1: `<release>-ca`" in bad[0] and "says Secret" in bad[1], bad
    _, pairs = documented_cluster_role(
        "ClusterRole `<fullname>-controller-<ns>`: `create` tokenreviews and subjectaccessreviews"
        " (neither by name), `list/watch` events (read-only) and `list` nodes; webhook: ...")
    assert pairs == {("tokenreviews", "create"), ("subjectaccessreviews", "create"),
                     ("events", "list"), ("events", "watch"), ("nodes", "list")}


# ---- the user and admin ClusterRoles ----------------------------------------------------------

def documented_user_roles(text: str) -> tuple[set[str], set[str]]:
    """docs/controller.md: "`sandman-user` (create, get, ...) and `sandman-admin`
    (+ deletecollection, prewarm, ...)": the user's verbs on `sandboxes`, and what the admin
    adds, each a verb on `sandboxes` or a subresource of it (`prewarm`: sandboxes/prewarm)."""
    m = re.search(r"`sandman-user` \(([^)]*)\) and `sandman-admin` \(\+ ([^)]*)\)",
                  re.sub(r"\s+", " ", text))
    assert m, "docs/controller.md no longer lists what sandman-user and sandman-admin grant"
    return set(m.group(1).split(", ")), set(m.group(2).split(", "))


def _grants(objs: list[dict], name: str) -> tuple[set[str], set[str]]:
    """(verbs on sandboxes, subresources of sandboxes) of a rendered ClusterRole."""
    pairs = rendered_cluster_role(objs, name)
    return ({v for r, v in pairs if r == "sandboxes"},
            {r.split("/", 1)[1] for r, _ in pairs if r.startswith("sandboxes/")})


def test_the_user_and_admin_cluster_roles_are_what_controller_md_lists(tmp_path):
    user, extra = documented_user_roles((ROOT / "docs" / "controller.md").read_text())
    objs = objects(Helm(tmp_path).template(release=RELEASE, namespace=NAMESPACE).stdout)
    assert _grants(objs, "sandman-user") == (user, set())
    verbs, subs = _grants(objs, "sandman-admin")
    assert user <= verbs and verbs | subs == user | extra, (verbs, subs, user, extra)
