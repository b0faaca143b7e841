"""What the SDK's pages claim, checked against the code and client/pyproject.toml (no wheel
built, no bed): the `kind`s docs/sdk.md says `on_request` reports are the routes the SDK
calls, and the client distribution's Python, dependency, extras and shipped modules are what
the pages say. tests/test_docs_names.py checks names; tests/test_distributions.py checks the
built wheels themselves."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

from sandman import api, execd_api

REPO = Path(__file__).resolve().parents[1]
SDK_MD = REPO / "docs" / "sdk.md"
CLIENT_README = REPO / "client" / "README.md"
README = REPO / "README.md"
PYPROJECT = REPO / "client" / "pyproject.toml"
ASYNC = REPO / "sandman" / "client" / "_async"  # the source of both twins


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:] if end < 0 else text[start:end]


# ---- on_request's kinds -----------------------------------------------------------------------

def sdk_route_kinds(sources: list[tuple[str, str]]) -> set[str]:
    """The kinds of the routes the SDK's source names (`api.ACQUIRE`, `X.EXEC`): every call
    goes through one of them and is reported with its kind (_core.report)."""
    wires = {"api": api, "X": execd_api}
    kinds = set()
    for name, source in sources:
        for node in ast.walk(ast.parse(source, name)):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id in wires:
                route = getattr(wires[node.value.id], node.attr, None)
                if isinstance(route, api.Route):
                    kinds.add(route.kind)
    return kinds


def documented_kinds(sdk_md: str) -> set[str]:
    section = _section(sdk_md, "## Observing calls (`on_request`)")
    m = re.search(r"`kind` is the operation(.*?), `name`", section, re.S)
    assert m, "docs/sdk.md's \"Observing calls\" no longer lists on_request's kinds"
    return set(re.findall(r"`([A-Z][A-Z_]+)`", m.group(1)))


def test_on_request_kinds_documented_are_the_sdks():
    code = sdk_route_kinds([(p.name, p.read_text()) for p in sorted(ASYNC.glob("*.py"))])
    assert {"ACQUIRE", "EXEC", "SESSION_OPEN"} <= code, code
    docs = documented_kinds(SDK_MD.read_text())
    assert docs == code, (f"documented, never reported: {sorted(docs - code)}; reported, "
                          f"not documented: {sorted(code - docs)}")


# ---- the client distribution's dependencies ---------------------------------------------------

def client_project() -> dict:
    return tomllib.loads(PYPROJECT.read_text())


def _requirement(spec: str) -> tuple[str, str]:
    """("httpx", ">=0.27,<1") of "httpx>=0.27,<1" (a marker dropped)."""
    m = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*([^;]*?)\s*(?:;.*)?", spec)
    assert m, spec
    return m.group(1).lower(), m.group(2).replace(" ", "")


def dependency_findings(pages: dict[str, str], project: dict, shipped: set[str]) -> list[str]:
    """Each page's claims of the client distribution against its pyproject.toml: its Python,
    its dependencies (how many, which, the range), the extras' ranges, the modules it ships
    and marks typed."""
    proj = project["project"]
    python = proj["requires-python"].removeprefix(">=")
    deps = dict(_requirement(d) for d in proj["dependencies"])
    extras = {name: dict(_requirement(s) for s in specs)
              for name, specs in proj["optional-dependencies"].items()}
    numbers = {"one": 1, "two": 2, "three": 3, "no": 0}
    bad = []
    sdk, client_readme, readme = (pages["docs/sdk.md"], pages["client/README.md"],
                                  pages["README.md"])
    install = _section(sdk, "## Installation")
    for page, text in (("docs/sdk.md", install), ("client/README.md", client_readme)):
        m = re.search(r"Python >= ([\d.]+), (\w+)\s+dependenc(?:y|ies) \(([^)]*)\)", text)
        if not m:
            bad.append(f"{page}: no longer says its Python and dependencies")
            continue
        named = set(re.findall(r"\b([a-z][a-z0-9_-]+)\b", m.group(3).split(":")[0]))
        if m.group(1) != python:
            bad.append(f"{page}: Python >= {m.group(1)}, pyproject's requires-python >={python}")
        if numbers.get(m.group(2)) != len(deps) or named - {"as", "a", "range"} != set(deps):
            bad.append(f"{page}: {m.group(2)} dependency ({m.group(3)}), pyproject's "
                       f"{sorted(deps)}")
        for dep, rng in re.findall(r"\(([a-z][a-z0-9_-]*), as a\s+range: `([^`]+)`", text):
            if deps.get(dep) != rng:
                bad.append(f"{page}: {dep} `{rng}`, pyproject's {deps.get(dep)!r}")
    m = re.search(r"client SDK, its own\s+distribution \(Python >= ([\d.]+), ([^)]*)\)", readme)
    if not m or m.group(1) != python or set(m.group(2).split(", ")) != set(deps):
        bad.append(f"README.md: the client SDK's Python and dependencies are not "
                   f"Python >= {python}, {', '.join(sorted(deps))}")
    # Each extra's range as the pages give it, and each extra named where it is installed.
    for page, text in pages.items():
        for name, rng in re.findall(r"`([a-z][a-z0-9-]*)((?:[<>=!~]=?[\w.*]+,?)+)`", text):
            owner = [e for e, reqs in extras.items() if name in reqs]
            if owner and extras[owner[0]][name] != rng:
                bad.append(f"{page}: `{name}{rng}`, extra [{owner[0]}] says "
                           f"{name}{extras[owner[0]][name]}")
        for extra in re.findall(r"sandman-client\[([\w-]+)\]|\./client\[([\w-]+)\]", text):
            for e in filter(None, extra):
                if e not in extras:
                    bad.append(f"{page}: [{e}] is no extra of client/pyproject.toml")
    for extra in extras:
        if f"sandman-client[{extra}]" not in sdk:
            bad.append(f"docs/sdk.md: the extra [{extra}] is never shown installed")
    # What ships beside sandman.client, and what a type checker reads as typed.
    wire = {m for m in shipped if m != "sandman._version"}
    what = re.search(r"What ships \(client/pyproject\.toml\):(.*?)\.\s", install, re.S)
    listed = set(re.findall(r"`sandman/(\w+)\.py`", what.group(1))) if what else set()
    if {f"sandman.{m}" for m in listed} != shipped:
        bad.append(f"docs/sdk.md: what ships lists {sorted(listed)}, pyproject's py-modules "
                   f"{sorted(shipped)}")
    for page, text in (("docs/sdk.md", install), ("client/README.md", client_readme)):
        m = re.search(r"wire\s+modules\s+(?:beside it\s+)?\(?((?:`sandman\.\w+`,?\s*)+)", text)
        typed = set(re.findall(r"`(sandman\.\w+)`", m.group(1))) if m else set()
        if typed != wire:
            bad.append(f"{page}: typed wire modules {sorted(typed)}, shipped {sorted(wire)}")
    return bad


def _pages() -> dict[str, str]:
    return {"docs/sdk.md": SDK_MD.read_text(), "client/README.md": CLIENT_README.read_text(),
            "README.md": README.read_text()}


def test_the_pages_dependency_claims_are_client_pyprojects():
    project = client_project()
    shipped = set(project["tool"]["setuptools"]["py-modules"])
    assert "sandman.api" in shipped and project["project"]["dependencies"], project
    bad = dependency_findings(_pages(), project, shipped)
    assert not bad, "\n".join(bad)


# ---- the checks see wrong statements ----------------------------------------------------------

def test_the_checks_see_wrong_statements():
    src = "from sandman import api\nfrom sandman import execd_api as X\n" \
          "async def f(c):\n    await c._send(api.ACQUIRE)\n    await c._call(X.SESSION_OPEN)\n" \
          "    x = api.DEFAULT_CPU\n"
    assert sdk_route_kinds([("f.py", src)]) == {"ACQUIRE", "SESSION_OPEN"}
    assert documented_kinds("## Observing calls (`on_request`)\n\n`kind` is the operation "
                            "(`ACQUIRE`, `EXEC`), `name` the route's\n") == {"ACQUIRE", "EXEC"}
    project = client_project()
    shipped = set(project["tool"]["setuptools"]["py-modules"])
    pages = _pages()
    assert not dependency_findings(pages, project, shipped)
    for page, good, wrong in (
            ("docs/sdk.md", "one dependency (httpx, as a\nrange: `>=0.27,<1`",
             "one dependency (httpx, as a\nrange: `>=0.26,<1`"),
            ("client/README.md", "one\ndependency (httpx)", "two\ndependencies (httpx, anyio)"),
            ("README.md", "(Python >= 3.9, httpx)", "(Python >= 3.8, httpx)"),
            ("docs/sdk.md", "(`swe-rex>=1.4.0,<1.5`", "(`swe-rex>=1.3.0,<1.5`"),
            ("docs/sdk.md", " `sandman/egress.py`", " `sandman/nope.py`"),
            ("client/README.md", "`sandman.egress`, ", "")):
        assert good in pages[page], (page, good)
        broken = {**pages, page: pages[page].replace(good, wrong, 1)}
        assert dependency_findings(broken, project, shipped), (page, wrong)


# ---- the command line's verbs and options -----------------------------------------------------

def cli_options() -> tuple[set[str], dict[str, set[str]]]:
    """The `sandman` parser's own option strings (long and short) and each verb's."""
    import argparse

    from sandman.client import cli

    top: set[str] = set()
    verbs: dict[str, set[str]] = {}
    for action in cli.parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            verbs = {v: {s for a in sp._actions for s in a.option_strings}
                     for v, sp in action.choices.items()}
        else:
            top |= set(action.option_strings)
    return top, verbs


def _depth0_split(line: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for word in line.split():
        depth += word.count("(") + word.count("[") - word.count(")") - word.count("]")
        if word == "|" and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += f" {word}"
    return [*out, cur]


def command_line_findings(lines: list[tuple[str, str]]) -> list[str]:
    """Each `sandman ...` usage line: its verbs exist, every option before the command (`--`)
    is the verb's or a global one. A line is `sandman VERB ...`, alternatives after ` | `."""
    top, verbs = cli_options()
    bad = []
    for where, line in lines:
        line = line.split("  #")[0].strip()
        for part in _depth0_split(line.removeprefix("sandman")):
            words = [w.strip("[]()") for w in part.split()]
            verb, expect_value = None, False
            for w in words:
                if w == "--":
                    break  # the command, or `shell`'s
                if w.startswith("-"):
                    opt = w.split("=")[0]
                    allowed = top | verbs.get(verb or "", set())
                    if opt not in allowed:
                        bad.append(f"{where}: `sandman {verb or ''}` has no option {opt}")
                    expect_value = opt in ("-o", "--output", "--url", "--token-file",
                                           "--ca-file", "--request-timeout")
                    continue
                if verb is None and not expect_value:
                    verb = w
                    if verb not in verbs:
                        bad.append(f"{where}: `sandman {verb}`: no such command")
                        break
                expect_value = False
    return bad


def documented_command_lines() -> list[tuple[str, str]]:
    from sandman.client import cli

    lines = []
    section = _section(SDK_MD.read_text(), "## Command-line client")
    start = SDK_MD.read_text().index(section)
    base = SDK_MD.read_text()[:start].count("\n") + 1
    for n, line in enumerate(section.splitlines(), base):
        if line.startswith("sandman "):
            lines.append((f"docs/sdk.md:{n}", line))
    for n, line in enumerate((cli.__doc__ or "").splitlines(), 1):
        if line.startswith("    sandman "):
            lines.append((f"sandman/client/cli.py docstring line {n}", line.strip()))
    return lines


def test_the_documented_command_lines_are_the_clis():
    lines = documented_command_lines()
    assert len(lines) >= 20, lines
    bad = command_line_findings(lines)
    assert not bad, "\n".join(bad)
    # The global options the section lists are the parser's own.
    top, _ = cli_options()
    section = _section(SDK_MD.read_text(), "## Command-line client")
    m = re.search(r"the global ones \(([^)]*)\)", section)
    assert m, "docs/sdk.md's CLI section no longer lists the global options"
    listed = {o for span in re.findall(r"`([^`]+)`", m.group(1)) for o in span.split("/")}
    assert listed == top - {"--help", "-h", "--version"}, (listed, top)


def test_the_command_line_check_sees_wrong_lines():
    assert command_line_findings([("x", "sandman exec ID --idle-timeout 60 -- ls --nope")]) == []
    assert command_line_findings([("x", "sandman -o json prewarm IMG 4 --role grading")]) == []
    assert command_line_findings([("x", "sandman list [--job JOB] | get ID | renew ID")]) == []
    assert command_line_findings([("x", "sandman checkpoint (--job JOB | ID ...) | restore C")]) \
        == []
    assert command_line_findings([("x", "sandman fork ID -n 4  # children")]) == []
    assert command_line_findings([("x", "sandman renew ID --count 3")]) == [
        "x: `sandman renew` has no option --count"]
    assert command_line_findings([("x", "sandman list | snapshot ID")]) == [
        "x: `sandman snapshot`: no such command"]


def test_the_clis_usage_names_every_command():
    """sandman/client/cli.py's docstring (its usage) names each command the parser has."""
    from sandman.client import cli

    _, verbs = cli_options()
    usage = " ".join(line for where, line in documented_command_lines() if "docstring" in where)
    named = set(re.findall(r"(?:sandman |\| )([a-z]+)", usage))
    assert set(verbs) <= named, f"{cli.__name__}'s usage lacks {sorted(set(verbs) - named)}"
