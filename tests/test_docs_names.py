"""The docs' mechanical statements, checked against the code: every `make` target,
command-line flag, chart values key, metric name, repository path, Python name and SDK
signature that README.md, client/README.md and docs/*.md give exists (and a flag given on a
component's command line is that component's), and docs/testbed.md's e2e table is the suite's.
What a sentence claims beyond a name is not checked here; a name that no longer exists is the
usual way a page goes stale.

Where names are read: flags, values keys, Python names, signatures and `make` targets in inline
code and fenced blocks; paths under a top-level entry of the tree and metric names anywhere.
Each finding names the page and line.
"""

from __future__ import annotations

import ast
import functools
import glob
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests import docs_cli

REPO = docs_cli.REPO
DOCS = [REPO / "README.md", REPO / "client" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
VALUES = REPO / "charts" / "sandman" / "values.yaml"

# Findings in pages whose owners have the fix pending: (page, check, name). Each must still be
# found (a fixed one fails until it is removed here), so the list only shrinks.
KNOWN: set[tuple[str, str, str]] = set()


# ---- reading a page ---------------------------------------------------------------------------

@dataclass
class Code:
    text: str
    line: int
    fenced: bool


@dataclass
class Doc:
    path: Path
    text: str
    code: list[Code]  # inline spans and fenced blocks

    @property
    def name(self) -> str:
        return self.path.relative_to(REPO).as_posix()

    def where(self, line: int) -> str:
        return f"{self.name}:{line}"

    def lines(self):
        """(line number, line) of the whole page, fenced blocks included."""
        return enumerate(self.text.splitlines(), 1)


_FENCE = re.compile(r"^\s*(```+|~~~+)")
_SPAN = re.compile(r"(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)


def read_doc(path: Path, text: str | None = None) -> Doc:
    text = path.read_text() if text is None else text
    code: list[Code] = []
    prose: list[str] = []  # the page with fenced blocks blanked (line numbers kept)
    block: list[str] | None = None
    start = 0
    for n, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            if block is None:
                block, start = [], n + 1
            else:
                code.append(Code("\n".join(block), start, True))
                block = None
            prose.append("")
        elif block is not None:
            block.append(line)
            prose.append("")
        else:
            prose.append(line)
    flat = "\n".join(prose)
    for m in _SPAN.finditer(flat):
        if "\n\n" not in m.group(2):  # a stray backtick does not pair across paragraphs
            code.append(Code(m.group(2), flat.count("\n", 0, m.start()) + 1, False))
    return Doc(path, text, code)


@functools.cache
def docs() -> tuple[Doc, ...]:
    return tuple(read_doc(p) for p in DOCS)


def commands(doc: Doc):
    """(line, command text): each inline span, and each logical line of a fenced block
    (backslash continuations joined)."""
    for c in doc.code:
        if not c.fenced:
            yield c.line, c.text.replace("\n", " ")
            continue
        n = c.line
        for logical in re.split(r"(?<!\\)\n", c.text):
            yield n, logical.replace("\\\n", " ")
            n += logical.count("\n") + 1


def check(found: dict[tuple[str, str], list[str]], kind: str) -> None:
    """Fail on every finding not in KNOWN, and on every KNOWN entry of `kind` not found."""
    new = {k: v for k, v in found.items() if (k[0], kind, k[1]) not in KNOWN}
    fixed = {(p, n) for p, k, n in KNOWN if k == kind} - set(found)
    msg = [f"{w}: {why}" for where in new.values() for w, why in where]
    msg += [f"{p}: {n!r} is fixed: remove it from KNOWN" for p, n in sorted(fixed)]
    assert not msg, f"{len(msg)} {kind} finding(s):\n" + "\n".join(sorted(msg))


class Findings(dict):
    def add(self, doc: Doc, line: int, name: str, why: str) -> None:
        self.setdefault((doc.name, name), []).append((doc.where(line), why))


# ---- make targets -----------------------------------------------------------------------------

def makefile_targets() -> set[str]:
    targets = set()
    for line in (REPO / "Makefile").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.%-]+(?:\s+[A-Za-z0-9_.%-]+)*)\s*:(?![=:])", line)
        if m and not line.startswith((".PHONY", "\t")):
            targets |= set(m.group(1).split())
    return targets


_SEP = {"|", "||", "&&", ";", ">", ">>", "<", "2>&1", "&"}


def make_targets_named(doc: Doc):
    for line, cmd in commands(doc):
        toks = cmd.split()
        for i, t in enumerate(toks):
            if t != "make" or (i and toks[i - 1] not in _SEP and not toks[i - 1].endswith(";")):
                continue
            for a in toks[i + 1:]:
                if a in _SEP or a.startswith(("#", "(")):
                    break
                a = a.strip("`,.;:)[]")
                if a and "=" not in a and not a.startswith("-") and re.fullmatch(r"[a-z][\w-]*", a):
                    yield line, a


def test_every_make_target_named_exists():
    targets = makefile_targets()
    assert {"check", "test", "lint", "e2e"} <= targets, targets
    found = Findings()
    for doc in docs():
        for line, t in make_targets_named(doc):
            if t not in targets:
                found.add(doc, line, t, f"`make {t}`: no such target in the Makefile")
    check(found, "make")


# ---- command-line flags -----------------------------------------------------------------------

# Flags of other programs the docs name, which no parser of this tree knows. Each is one
# program's, so a sandman flag that loses its parser is never excused by it.
OTHER_TOOLS = {
    # kubectl
    "--all-containers": "kubectl logs", "--as": "kubectl auth can-i",
    "--clusterrole": "kubectl create rolebinding", "--serviceaccount": "kubectl create ...",
    "--dry-run": "kubectl", "--from": "kubectl create job", "--from-file": "kubectl create",
    "--ignore-not-found": "kubectl delete", "--for": "kubectl wait", "--timeout": "kubectl wait",
    "--audience": "kubectl create token", "--field-selector": "kubectl get",
    # bash (execd's fresh commands) and git init (capture's own git directory)
    "--noprofile": "bash", "--norc": "bash", "--bare": "git init", "--template": "git init",
    # helm
    "--wait": "helm install/upgrade/uninstall; iptables -w", "--force": "helm upgrade",
    "--reuse-values": "helm upgrade", "--no-hooks": "helm uninstall", "--logs": "helm test",
    "--set": "helm", "--set-json": "helm", "--version": "helm", "--plain-http": "helm install/show/push",
    # Kubernetes' own components and the test bed's other processes
    "--secure-port": "kube-controller-manager, kube-scheduler",
    "--endpoint-reconciler-type": "kube-apiserver", "--authorization-mode": "kube-apiserver",
    "--enable-aggregator-routing": "kube-apiserver", "--allow-privileged": "kube-apiserver",
    "--max-requests-inflight": "kube-apiserver",
    "--max-mutating-requests-inflight": "kube-apiserver",
    "--leader-elect": "kube-controller-manager, kube-scheduler",
    "--flex-volume-plugin-dir": "kube-controller-manager", "--unsafe-no-fsync": "etcd",
    "--kube-api-qps": "kube-scheduler, kube-controller-manager",
    "--kube-api-burst": "kube-scheduler, kube-controller-manager", "--event-ttl": "kube-apiserver",
    "--quota-backend-bytes": "etcd", "--node-lease-duration-seconds": "kwok",
    "--run-firewall": "kube-router", "--runtime-endpoint": "crictl",
    "--enable-certificate-owner-ref": "cert-manager's controller",
    # iptables
    "--noflush": "iptables-restore", "--comment": "iptables -m comment",
    "--ctstate": "iptables -m conntrack", "--dport": "iptables", "--reject-with": "iptables",
    # git
    "--binary": "git diff/apply", "--cached": "git diff", "--no-renames": "git diff",
    "--no-ext-diff": "git diff", "--no-textconv": "git diff", "--exclude": "git apply",
    "--ignored": "git status", "--porcelain": "git status", "--short": "git status",
    "--quiet": "git diff --quiet; pip", "--no-index": "git check-ignore",
    # pytest, pip, mypy
    "--collect-only": "pytest", "--junitxml": "pytest", "--rootdir": "pytest",
    "--confcutdir": "pytest", "--import-mode": "pytest", "--no-deps": "pip install/wheel", "--strict": "mypy --strict",
    # image builds, curl, cloud CLIs
    "--build-arg": "docker/buildah build", "--target": "docker build", "--platform": "docker",
    "--push": "docker buildx", "--cacert": "curl", "--resolve": "curl",
    "--query": "aws", "--format": "gcloud",
    # harbor trial start / harbor run (docs/sdk.md "Harbor")
    "--environment-kwarg": "harbor", "--cpus": "harbor", "--extra-docker-compose": "harbor",
    "--mounts": "harbor",
}
# Modules the docs run with `python -m` that are not this tree's.
EXTERNAL_MODULES = {"pytest", "pip", "venv", "locust", "mypy", "ruff", "vermin", "uv",
                    "http.server"}
_PY = re.compile(r"^(?:\S*/)?python3?(?:\.\d+)?$")
_FLAG = re.compile(r"^--[a-z0-9][a-z0-9-]*$")


@functools.cache
def clis() -> dict[str, docs_cli.Cli]:
    return docs_cli.component_clis()


@functools.cache
def locust_clis() -> dict[str, docs_cli.Cli]:
    return docs_cli.locust_clis()


@functools.cache
def tool_flags(rel: str) -> set[str]:
    path = REPO / rel
    return docs_cli.script_flags(path) if path.is_file() else set()


def flag_of(token: str) -> str | None:
    t = token.strip("[](){}'\",;:").split("=")[0]
    return t if _FLAG.match(t) else None


def _args(toks: list[str], i: int) -> list[str]:
    out = []
    for t in toks[i:]:
        if t in _SEP or t.startswith("#") or t.startswith("$("):
            break
        out.append(t)
        if t.endswith(";"):
            break
    return out


def _flags(args: list[str]) -> list[str]:
    out = []
    for a in args:
        if a == "--":
            break
        f = flag_of(a)
        if f:
            out.append(f)
    return out


def _locustfile(name: str) -> str:
    return name if name.endswith(".py") else f"loadtest/{name}.py"


def invocations(cmd: str):
    """(program, allowed flags or None when unknown, flags given) for every sandman command
    line in `cmd`: `python -m <module>`, `locust -f <file>`, execd.py, tools/*.py."""
    toks = cmd.split()
    for i, t in enumerate(toks):
        nxt = toks[i + 1] if i + 1 < len(toks) else ""
        if _PY.match(t) and nxt == "-m" and i + 2 < len(toks):
            mod = toks[i + 2].strip("`")
            args = _args(toks, i + 3)
            if mod in EXTERNAL_MODULES or mod.endswith(".") or "<" in mod:
                continue
            if mod == "loadtest":
                if args and not args[0].startswith(("-", "<")):
                    f = _locustfile(args[0])
                    yield f"python -m loadtest {args[0]}", _locust(f), _flags(args[1:])
                continue
            cli = clis().get(mod)
            verb = args[0] if args and cli and args[0] in cli.verbs else None
            yield (f"python -m {mod}" + (f" {verb}" if verb else ""),
                   cli.allowed(verb) | {"--help"} if cli else None, _flags(args))
            if mod == "loadtest.job" and "--" in args:
                # Everything after `--` goes to locust, running the Job's --locustfile.
                own = args[:args.index("--")]
                lf = own[own.index("--locustfile") + 1] if "--locustfile" in own[:-1] \
                    else "acquire_burst"
                yield (f"loadtest.job's locust ({lf})", _locust(_locustfile(lf)),
                       _flags(args[args.index("--") + 1:]))
        elif t == "locust" and nxt == "-f" and i + 2 < len(toks):
            f = toks[i + 2]
            yield f"locust -f {f}", _locust(f), _flags(_args(toks, i + 3))
        elif t.endswith("execd.py") and (i == 0 or _PY.match(toks[i - 1])):
            yield "execd.py", clis()["execd"].every() | {"--help"}, _flags(_args(toks, i + 1))
        elif re.fullmatch(r"(?:\S*/)?tools/\w+\.py", t):
            rel = t[t.index("tools/"):]
            yield rel, tool_flags(rel), _flags(_args(toks, i + 1))


def _locust(f: str) -> set[str] | None:
    cli = locust_clis().get(f)
    return cli.options if cli else None


def test_flags_given_on_a_command_line_are_that_programs():
    found = Findings()
    seen = set()
    for doc in docs():
        for line, cmd in commands(doc):
            for prog, allowed, flags in invocations(cmd):
                seen.update(prog.split())
                if allowed is None:
                    found.add(doc, line, prog, f"`{prog}`: not a command line this tree has "
                              "(a new entry point: add it to tests/docs_cli.py ENTRIES)")
                    continue
                for f in flags:
                    if f not in allowed:
                        found.add(doc, line, f"{prog} {f}", f"`{prog}` has no flag {f}")
    # The pages do name these; a parser that broke would otherwise pass silently.
    assert {"webhook", "serve", "netguard", "loadtest.job", "execd.py"} <= seen, seen
    check(found, "command-line flag")


@functools.cache
def known_flags() -> tuple[frozenset[str], tuple[frozenset[str], ...]]:
    """Every flag some program takes (this tree's parsers, its tools' hand-read flags,
    OTHER_TOOLS), and each of this tree's command lines' own options."""
    known = set(OTHER_TOOLS)
    parsers = []
    for cli in [*clis().values(), *locust_clis().values()]:
        known |= cli.every()
        parsers += [frozenset(cli.allowed(v)) for v in cli.verbs] or [frozenset(cli.options)]
    for tool in (REPO / "tools").glob("*.py"):
        known |= tool_flags(tool.relative_to(REPO).as_posix())
    return frozenset(known), tuple(parsers)


def flag_known(flag: str) -> bool:
    """Some program takes it; argparse also takes a unique prefix of an option
    (`--ins` for netguard's `--install-execd`)."""
    known, parsers = known_flags()
    return flag in known or any(len([o for o in opts if o.startswith(flag)]) == 1
                                for opts in parsers)


def test_every_flag_named_is_known_to_a_parser():
    found = Findings()
    for doc in docs():
        for c in doc.code:
            for n, text in enumerate(c.text.splitlines(), c.line):
                for m in re.finditer(r"(?<![\w-])--[a-z][a-z0-9-]*", text):
                    if not flag_known(m.group()):
                        found.add(doc, n, m.group(), f"{m.group()}: no parser of this tree "
                                  "knows it (another program's? add it to OTHER_TOOLS)")
    check(found, "flag")


# ---- chart values -----------------------------------------------------------------------------

# Maps of the user's own keys (labels, selectors): any key below them is the user's.
FREE_FORM = {"matchLabels", "labels", "annotations", "nodeSelector", "matchExpressions"}
_FILE_EXT = re.compile(r"\.(py|md|ya?ml|json|toml|tpl|txt|lock|html|png|sh|cfg|ini|crt|key)$")


@functools.cache
def values() -> dict:
    return yaml.safe_load(VALUES.read_text())


def values_key(path: list[str]) -> bool:
    node: object = values()
    for part in path:
        if isinstance(node, list) or (isinstance(node, dict) and not node):
            return True  # a list, or an empty map: the user's entries
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


@functools.cache
def python_name(dotted: str) -> bool:
    """A module of the tree, or a name defined at the top of one (then one level into a class),
    found without importing anything but packages' __init__ files."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        mod = ".".join(parts[:i])
        try:
            spec = importlib.util.find_spec(mod)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            continue
        rest = parts[i:]
        if not rest:
            return True
        if not spec.origin or not spec.origin.endswith(".py"):
            return False
        return _defines(Path(spec.origin), rest)
    return False


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _names(body, imports: bool = True) -> dict[str, ast.AST]:
    """The names a module's (or class's) body binds; `imports`: those it imports too."""
    out: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        out[n.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)) and imports:
            for a in node.names:
                out[(a.asname or a.name).split(".")[0]] = node
        elif isinstance(node, (ast.If, ast.Try)):
            for part in (node.body, *(h.body for h in getattr(node, "handlers", [])),
                         node.orelse):
                out.update(_names(part, imports))
    return out


def _defines(path: Path, rest: list[str], imports: bool = True) -> bool:
    names = _names(_tree(path).body, imports)
    node = names.get(rest[0])
    if node is None:
        return False
    if len(rest) == 1:
        return True
    if isinstance(node, ast.ClassDef):
        return rest[1] in _names(node.body) or rest[1] in {
            a.target.id for a in node.body
            if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)}
    return True  # an attribute of a value: not followed


_DOTTED = re.compile(r"(?<![\w./$<{-])([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+)"
                     r"(?![\w/-]|\.[A-Za-z_])")


def values_yaml_blocks(doc: Doc):
    """(line, mapping) of each fenced YAML block that is a values file (its top-level keys are
    the chart's)."""
    top = set(values())
    for c in doc.code:
        if not c.fenced:
            continue
        try:
            data = yaml.safe_load(c.text)
        except yaml.YAMLError:
            continue
        if isinstance(data, dict) and data and set(data) <= top:
            yield c.line, data


def _key_paths(data: dict, prefix: tuple[str, ...] = ()):
    for k, v in data.items():
        path = (*prefix, str(k))
        yield path
        if isinstance(v, dict) and k not in FREE_FORM:
            yield from _key_paths(v, path)


# Dotted names that are not Python although they start like a package of the tree.
# OpenTelemetry span attributes (docs/metrics.md "Traces"), named like modules; each is set by
# the code (test_every_span_attribute_named_is_set).
SPAN_ATTRIBUTES = {"sandman.attempts", "sandman.execd.duration_ms", "sandman.image",
                   "sandman.job", "sandman.pod", "sandman.request_id", "sandman.role",
                   "sandman.sandbox_id", "sandman.shadow", "sandman.verdict", "sandman.warm"}
NOT_PYTHON = {"sandman.dev", "sandman.local",  # the API group / label domain; image registry
              *SPAN_ATTRIBUTES}
NOT_PYTHON_TOPS: set[str] = set()
PACKAGES = {"sandman", "controller", "webhook", "netguard", "execd", "loadtest", "testbed",
            "bench", "tools"}


def talks_about_values(doc: Doc) -> bool:
    return bool(re.search(r"values\.yaml|\bhelm\b|\bchart\b|chart's", doc.text))


def classify(doc: Doc, text: str, start: int, name: str) -> str | None:
    """What a dotted name in a span stands for: "values" (a chart values key, or a module of
    the same name: `controller.rate`, `controller.cleanup`), "python", or None (not checked:
    a method called on an object, `sandbox.release()`)."""
    parts = name.split(".")
    end = start + len(name)
    if parts[0] in NOT_PYTHON_TOPS or name in NOT_PYTHON:
        return None
    called = text[end:end + 1] == "("
    constant = any(re.fullmatch(r"[A-Z][A-Z0-9_]+", p) for p in parts[1:])
    if parts[0] in PACKAGES:
        return "python" if called or constant or parts[0] not in values() else "values"
    if parts[0] not in values() or called:
        return None
    if constant:
        return "python"  # `sandbox.INPUT_LABELS`: a module's constant, not a value
    return "values" if talks_about_values(doc) else None


def classified(doc: Doc):
    for c in doc.code:
        if c.fenced:
            continue
        for m in _DOTTED.finditer(c.text):
            name = m.group(1)
            if _FILE_EXT.search(name):
                continue
            kind = classify(doc, c.text, m.start(1), name)
            if kind:
                yield c.line + c.text.count("\n", 0, m.start()), name, kind


def test_every_values_key_named_is_in_values_yaml():
    top = set(values())
    assert {"webhook", "controller", "sandbox"} <= top, top
    found = Findings()
    for doc in docs():
        for line, name, kind in classified(doc):
            # `controller.cleanup` is a module, `webhook.replicas` a value: either must exist.
            if kind == "values" and not values_key(name.split(".")) and not python_name(name):
                found.add(doc, line, name, f"`{name}`: no such key in "
                          "charts/sandman/values.yaml (nor a module of that name)")
        for line, data in values_yaml_blocks(doc):
            for path in _key_paths(data):
                if not values_key(list(path)):
                    found.add(doc, line, ".".join(path), f"values block: {'.'.join(path)} is "
                              "not a key of charts/sandman/values.yaml")
    check(found, "values key")


def test_every_span_attribute_named_is_set():
    """A literal in the SDK or sandman/tracing.py, or a keyword of the controller's
    `tracing.attributes(...)` (which prefixes `sandman.`)."""
    sources = "".join(p.read_text() for top in ("sandman", "controller")
                      for p in sorted((REPO / top).rglob("*.py")))
    kwargs = set(re.findall(r"tracing\.attributes\(([^)]*)\)", sources))
    keys = {k for args in kwargs for k in re.findall(r"(\w+)=", args)}
    missing = sorted(a for a in SPAN_ATTRIBUTES
                     if f'"{a}"' not in sources and a.removeprefix("sandman.") not in keys)
    assert not missing, f"span attributes the docs name and no code sets: {missing}"


def test_every_python_name_named_exists():
    found = Findings()
    for doc in docs():
        for line, name, kind in classified(doc):
            if kind == "python" and not python_name(name):
                found.add(doc, line, name, f"`{name}`: no such module or name in the tree")
    check(found, "Python name")


# ---- metrics ----------------------------------------------------------------------------------

_METRIC_TYPES = {"Counter", "Gauge", "Histogram", "Summary", "Info", "Enum"}
METRIC_SOURCES = ("webhook", "controller", "sandman")


def metric_definitions() -> dict[str, str]:
    """{name as registered: type} of every prometheus-client metric the product defines."""
    out: dict[str, str] = {}
    for top in METRIC_SOURCES:
        for path in sorted((REPO / top).rglob("*.py")):
            tree = _tree(path)
            consts = {n.targets[0].id: n.value.value for n in tree.body
                      if isinstance(n, ast.Assign) and len(n.targets) == 1
                      and isinstance(n.targets[0], ast.Name)
                      and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)}
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Call) and node.args):
                    continue
                f = node.func
                kind = f.id if isinstance(f, ast.Name) else f.attr if isinstance(
                    f, ast.Attribute) else None
                if kind not in _METRIC_TYPES:
                    continue
                a = node.args[0]
                name = a.value if isinstance(a, ast.Constant) else consts.get(
                    a.id) if isinstance(a, ast.Name) else None
                if isinstance(name, str):
                    out[name] = kind
    return out


def exported_names(name: str, kind: str) -> set[str]:
    """The sample names a scrape shows (prometheus-client's suffixes); a histogram or summary
    is also named by its family."""
    if kind == "Counter":
        base = name.removesuffix("_total")
        return {f"{base}_total", f"{base}_created"}
    if kind in ("Histogram", "Summary"):
        return {name, f"{name}_count", f"{name}_sum", f"{name}_created"} | (
            {f"{name}_bucket"} if kind == "Histogram" else set())
    if kind == "Info":
        return {f"{name}_info"}
    return {name}


@pytest.mark.slow
def test_every_metric_named_is_defined():
    defined = metric_definitions()
    assert "sandman_build_info" in defined and "sandman_webhook_requests" in defined, defined
    exported = set().union(*(exported_names(n, k) for n, k in defined.items()))
    found = Findings()
    for doc in docs():
        for n, line in doc.lines():
            for m in re.finditer(r"(?<![\w./-])sandman_[a-z0-9_]+(?![\w.-])", line):
                if m.group() not in exported:
                    found.add(doc, n, m.group(), f"{m.group()}: no such metric is exported")
    check(found, "metric")


# ---- repository paths -------------------------------------------------------------------------

# Top-level entries that are run output, never the tree's (a page may name a file in them).
GENERATED = {".git", ".testbed", ".pytest_cache", ".ruff_cache", ".mypy_cache", "build", "dist"}
# Paths of other repositories the pages cite, which look like ours.
FOREIGN = {"tests/test_execution.py"}  # SWE-ReX's runtime tests (docs/sdk.md)
_PATH_EXT = r"(?:py|md|ya?ml|json|toml|tpl|txt|lock|sh|cfg|ini|png|tar\.gz|golden)"


@functools.cache
def top_level() -> set[str]:
    return {p.name for p in REPO.iterdir()
            if p.name not in GENERATED and not p.name.startswith(".venv")}


def _glob_of(path: str) -> str:
    """A path with placeholders (`<name>`, `NAME`, `*`, `{a,b}`) as a glob."""
    p = re.sub(r"<[^>]*>", "*", path)
    p = re.sub(r"(?<![A-Za-z])[A-Z][A-Z0-9_]{2,}(?![A-Za-z])", "*", p)
    return p.replace("...", "*")


def _exists(path: str) -> bool:
    for alt in _braces(path):
        pattern = _glob_of(alt)
        if "*" in pattern or "?" in pattern:
            if glob.glob(str(REPO / pattern)):
                continue
            return False
        if not (REPO / alt).exists():
            return False
    return True


def _braces(path: str) -> list[str]:
    m = re.search(r"\{([^{}]*,[^{}]*)\}", path)
    if not m:
        return [path]
    return [x for opt in m.group(1).split(",")
            for x in _braces(path[:m.start()] + opt + path[m.end():])]


_PATH = re.compile(r"(?<![\w./~$:-])((?:[A-Za-z0-9_.<>{}*-]+/)+[A-Za-z0-9_.<>{},*-]*)")


def paths_named(doc: Doc):
    """(line, path) of every path under a top-level entry of the tree: in code, any such token
    (a folder too); in prose, files with an extension."""
    tops = top_level()
    prose = re.compile(rf"(?<![\w./~$:-])((?:{'|'.join(map(re.escape, sorted(tops)))})"
                       rf"/[\w./<>{{}},*-]*?\.{_PATH_EXT})(?![\w/])")
    for c in doc.code:
        for n, text in enumerate(c.text.splitlines(), c.line):
            for m in _PATH.finditer(text):
                p = m.group(1).rstrip(".,;:")
                if p.split("/")[0] in tops:
                    yield n, p
    for n, line in doc.lines():
        for m in prose.finditer(line):
            yield n, m.group(1)


def _check_path(p: str) -> str | None:
    """Why `p` names nothing, or None."""
    if p in FOREIGN or p.split("/")[-1] in ("", "..."):
        return None if p in FOREIGN or _exists(p.rstrip("/")) else "no such folder"
    name = p.split("/")[-1]
    stem, dot, attr = name.partition(".")
    if dot and not re.fullmatch(_PATH_EXT, attr) and "." not in attr and attr.islower() \
            and "{" not in name and "*" not in name and (REPO / p).with_name(f"{stem}.py").is_file():
        # `webhook/policy.books_policy`: a module and a name in it.
        return None if _defines((REPO / p).with_name(f"{stem}.py"), [attr]) \
            else f"{stem}.py defines no {attr}"
    return None if _exists(p) else "no such file or folder"


def test_every_repository_path_named_exists():
    found = Findings()
    count = 0
    for doc in docs():
        for line, p in paths_named(doc):
            count += 1
            why = _check_path(p)
            if why:
                found.add(doc, line, p, f"{p}: {why}")
    assert count > 100, count
    check(found, "path")


def test_every_markdown_link_to_a_file_resolves():
    found = Findings()
    for doc in docs():
        for n, line in doc.lines():
            for m in re.finditer(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", line):
                target = m.group(1)
                if re.match(r"[a-z]+:", target):
                    continue
                if not (doc.path.parent / target).exists():
                    found.add(doc, n, target, f"link to {target}: no such file")
    check(found, "link")


def _defined_in(path: Path, name: str) -> bool:
    """`name` (or `Class::method`) is defined in the file, not only imported there."""
    return _defines(path, name.replace("::", ".").split("."), imports=False)


def test_every_path_and_name_pair_names_a_definition():
    """`file.py:name`, `file.py::test_x` (a pytest node id) and `file.py: name` name something
    that file defines."""
    found = Findings()
    pair = re.compile(r"((?:[\w.-]+/)+[\w.-]+\.py)(?:::?)([A-Za-z_]\w*(?:(?:::|\.)\w+)?)")
    spaced = re.compile(r"((?:[\w.-]+/)+[\w.-]+\.py): ([A-Za-z_]\w*)")  # a span `f.py: name`
    for doc in docs():
        texts = [*doc.lines(), *((c.line, c.text) for c in doc.code
                                 if not c.fenced and spaced.fullmatch(c.text))]
        for n, line in texts:
            for m in [*pair.finditer(line), *([spaced.fullmatch(line)] if spaced.fullmatch(
                    line) else [])]:
                path, name = REPO / m.group(1), m.group(2)
                if m.group(1).split("/")[0] not in top_level() or not path.is_file():
                    continue  # the path check reports a missing file
                if not _defined_in(path, name):
                    found.add(doc, n, f"{m.group(1)}:{name}",
                              f"{m.group(1)} defines no {name}")
    check(found, "definition")


# ---- what docs/testbed.md says about the e2e suite --------------------------------------------

def _test_functions(path: Path) -> int:
    tree = _tree(path)
    n = sum(1 for x in tree.body
            if isinstance(x, (ast.FunctionDef, ast.AsyncFunctionDef)) and x.name.startswith("test"))
    for cls in (x for x in tree.body if isinstance(x, ast.ClassDef) and x.name.startswith("Test")):
        n += sum(1 for x in cls.body if isinstance(x, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and x.name.startswith("test"))
    return n


def test_the_e2e_table_lists_every_e2e_file_and_the_count_is_right():
    doc = next(d for d in docs() if d.name == "docs/testbed.md")
    section = doc.text.split("## sandman on the real node", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `(test_\w+\.py)` \|", section, re.M))
    files = sorted((REPO / "tests" / "e2e").glob("test_*.py"))
    assert listed == {f.name for f in files}, (
        f"docs/testbed.md's e2e table: missing {sorted({f.name for f in files} - listed)}, "
        f"not in tests/e2e {sorted(listed - {f.name for f in files})}")
    # A test function is one test there: the suite has no parametrized tests.
    assert not any("parametrize" in f.read_text() for f in files)
    tests = sum(_test_functions(f) for f in files)
    m = re.search(r"(\d+) files, (\d+) tests", section)
    assert m, "docs/testbed.md's e2e section no longer says how many files and tests it has"
    assert (int(m.group(1)), int(m.group(2))) == (len(files), tests), (
        f"docs/testbed.md says {m.group()}; tests/e2e has {len(files)} files, {tests} tests")


# ---- the checks catch what they are for -------------------------------------------------------

def test_the_checks_see_wrong_statements():
    doc = read_doc(REPO / "docs" / "x.md", (
        "Run `make chek`, then `python3 -m webhook serve --drain-secs 5` and\n"
        "`python3 -m controller serve --rate 20 --burst\n40`.\n"
        "```\npython -m loadtest.job --namespace t \\\n    -- --shape ramp --no-such 1\n```\n"
        "Set `webhook.replicaz`, keep `controller.cleanup`; see `sandman.api.Nope`,\n"
        "`sandman_webhook_requests` and sandman_webhook_requests_total, and\n"
        "controller/no_such.py or `tests/e2e/test_faults.py`.\n"))
    assert [t for _, t in make_targets_named(doc)] == ["chek"]
    bad = sorted((prog, f) for _, cmd in commands(doc) for prog, allowed, flags in invocations(cmd)
                 for f in flags if f not in allowed)
    assert bad == [("loadtest.job's locust (acquire_burst)", "--no-such"),
                   ("python -m webhook serve", "--drain-secs")], bad
    names = {n: kind for _, n, kind in classified(doc)}
    assert names["webhook.replicaz"] == names["controller.cleanup"] == "values"
    assert names["sandman.api.Nope"] == "python"
    assert classify(doc, "`sandbox.INPUT_LABELS`", 1, "sandbox.INPUT_LABELS") == "python"
    assert classify(doc, "sandbox.release()", 0, "sandbox.release") is None
    assert not values_key(["webhook", "replicaz"]) and values_key(["webhook", "replicas"])
    block = read_doc(REPO / "docs" / "x.md", "```yaml\nwebhook:\n  replicaz: 3\nsandbox:\n"
                     "  podTemplate:\n    labels: {team: rl}\n```\n")
    (_, data), = values_yaml_blocks(block)
    assert [p for p in _key_paths(data) if not values_key(list(p))] == [("webhook", "replicaz")]
    assert python_name("controller.cleanup") and not python_name("sandman.api.Nope")
    assert python_name("sandman.api.Conditions") and python_name("controller.books.State")
    assert python_name("sandman._version.__version__")
    assert python_name("sandman.client.__version__")
    assert not python_name("sandman.__version__")  # a namespace package has no attributes
    assert flag_known("--drain-seconds") and flag_known("--ins") and flag_known("--wait")
    assert not flag_known("--drain-secs") and not flag_known("--no-such-flag")
    from sandman.client import Client, RetryPolicy
    assert signature_mismatches(["id"], Client.get)
    assert signature_mismatches(["attempts=4"], RetryPolicy)
    assert not signature_mismatches(["sandbox_id"], Client.get)
    exported = set().union(*(exported_names(n, k) for n, k in metric_definitions().items()))
    assert "sandman_webhook_requests_total" in exported
    assert "sandman_webhook_requests" not in exported  # a counter is read as _total
    assert "sandman_controller_acquire_seconds_bucket" in exported
    paths = {p: _check_path(p) for _, p in paths_named(doc)}
    assert paths["controller/no_such.py"] and paths["tests/e2e/test_faults.py"] is None
    assert _check_path("webhook/policy.books_policy") is None
    assert _check_path("controller/kube.py") is None and not _defined_in(
        REPO / "controller" / "kube.py", "slim_pod")
    assert _check_path("sandman/client/NAME.py") is None  # a placeholder
    assert _check_path("tests/e2e/{test_faults,test_nope}.py")


# ---- the SDK's documented signatures ----------------------------------------------------------

# Name as the SDK pages write it -> (module, attribute path). The sync twin is the reference
# (tests/client/test_gen_sync.py keeps the async one the same).
SIGNATURES = {
    "Client": ("sandman.client", "Client"),
    "RetryPolicy": ("sandman.client", "RetryPolicy"),
    "Sandbox.connect": ("sandman.client", "Sandbox.connect"),
    **{f"client.{m}": ("sandman.client", f"Client.{m}")
       for m in ("acquire", "renew", "release", "retire", "get", "list", "prewarm", "drain")},
    **{f"sb.{m}": ("sandman.client", f"Sandbox.{m}")
       for m in ("renew", "exec", "read", "read_file", "write", "edit", "env", "reset", "state",
                 "conditions", "health", "release", "retire", "spawn", "processes", "process",
                 "upload_tree", "download_tree", "session", "sessions")},
    **{f"session.{m}": ("sandman.client", f"Session.{m}")
       for m in ("write", "read", "expect", "resize", "signal", "close")},
    **{f"proc.{m}": ("sandman.client", f"Process.{m}")
       for m in ("poll", "status", "output", "signal", "wait")},
    **{n: ("sandman.client", n) for n in ("ExecResult", "FileContent", "WriteResult",
                                          "EditResult", "PoolStatus", "TreeResult")},
    **{n: ("sandman.client.grading", n) for n in ("Task", "capture_patch", "grade", "preflight",
                                                  "GradeResult")},
}
# What the SDK's answer types add to the contract's, which the pages name apart ("adding only
# `raw`").
UNLISTED = {"raw"}
_SIG = re.compile(r"^([A-Za-z_][\w.]*)\((.*)\)$", re.S)


def _split_args(text: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [a for a in [*out, cur.strip()] if a]


def signature_mismatches(doc_args: list[str], obj) -> list[str]:
    import inspect

    params = [p for p in inspect.signature(obj).parameters.values()
              if p.name != "self" and p.kind is not p.VAR_KEYWORD and p.name not in UNLISTED]
    named, keyword_only, bad = [], False, []
    for a in doc_args:
        if a == "*":
            keyword_only = True
            continue
        if a.startswith("**"):
            continue
        name, eq, default = a.partition("=")
        named.append((name.strip(), keyword_only, default.strip() if eq else None))
    if [n for n, _, _ in named] != [p.name for p in params]:
        return [f"parameters {[n for n, _, _ in named]}, the code's {[p.name for p in params]}"]
    for (name, kw, default), p in zip(named, params, strict=True):
        if kw != (p.kind is p.KEYWORD_ONLY):
            bad.append(f"{name} is {'' if p.kind is p.KEYWORD_ONLY else 'not '}keyword-only")
        if default is not None:
            try:
                value = ast.literal_eval(default)
            except ValueError:
                continue  # a name (DEFAULT_EXCLUDE): not compared
            if p.default is p.empty or p.default != value:
                bad.append(f"{name}={default}, the code's default is "
                           f"{'none' if p.default is p.empty else repr(p.default)}")
    return bad


def test_documented_signatures_are_the_codes():
    found = Findings()
    checked = set()
    for doc in docs():
        for c in doc.code:
            m = _SIG.match(c.text.strip()) if not c.fenced else None
            if not m or m.group(1) not in SIGNATURES or "..." in m.group(2):
                continue
            args = _split_args(m.group(2))
            row = doc.text.splitlines()[c.line - 1]
            first_cell = row.startswith("|") and f"`{c.text}`" in row.split("|")[1]
            defaults = all(re.fullmatch(r"\w+=[\w.\"']+", a) for a in args)
            if not args or not (first_cell or defaults):
                continue  # a call (`Client()`, `grade(client, task, patch)`), not a signature
            module, attr = SIGNATURES[m.group(1)]
            obj = importlib.import_module(module)
            for part in attr.split("."):
                obj = getattr(obj, part)
            checked.add(m.group(1))
            for why in signature_mismatches(args, obj):
                found.add(doc, c.line, m.group(1), f"`{m.group(1)}(...)`: {why}")
    assert {"Client", "client.acquire", "RetryPolicy", "Task", "grade"} <= checked, checked
    check(found, "signature")
