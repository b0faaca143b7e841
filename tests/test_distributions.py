"""The two distributions of the tree, built as wheels (testbed/dist.py): `sandman-client`
(client/pyproject.toml) and `sandman` (pyproject.toml) share the `sandman` namespace without
sharing a file, together ship every file of it, and the client's files import nothing but the
standard library, httpx and each other. The bare-3.9 install is tests/client/test_py39_wheel.py.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from testbed.dist import REPO, build_wheel

CLIENT_DEPENDENCIES = {"httpx"}
# Top-level names of the tree's own first-party code: never importable from the client wheel
# (beyond the sandman modules it ships).
FIRST_PARTY = {"sandman", "controller", "webhook", "netguard", "execd", "testbed", "loadtest",
               "bench", "tools", "tests"}
# What the server wheel ships: the product packages; never the test bed, the benches or tests.
SERVER_TOPS = {"sandman", "controller", "webhook", "netguard", "execd", "loadtest"}


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("wheels")
    return {dist: build_wheel(dist, out / dist) for dist in ("client", "server")}


def _names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return {n for n in z.namelist() if ".dist-info/" not in n}


def _metadata(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as z:
        return z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()


@pytest.mark.slow
def test_the_namespace_is_split_without_overlap_or_gap(wheels):
    client = {n for n in _names(wheels["client"]) if n.startswith("sandman/")}
    server = {n for n in _names(wheels["server"]) if n.startswith("sandman/")}
    tree = {p.relative_to(REPO).as_posix() for p in (REPO / "sandman").rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}
    assert not client & server, f"shipped by both distributions: {sorted(client & server)}"
    assert client | server == tree, (
        f"in the tree but in no wheel: {sorted(tree - client - server)}; "
        f"in a wheel but not in the tree: {sorted((client | server) - tree)} "
        "(add a new sandman/ module to pyproject.toml's py-modules, or to the client's)")
    # A namespace package (PEP 420): neither may own sandman/__init__.py.
    assert "sandman/__init__.py" not in tree
    assert "sandman/client/py.typed" in client
    assert {"sandman/api.py", "sandman/execd_api.py", "sandman/contract.py",
            "sandman/_version.py"} <= client
    # The namespace root's marker is the client's: it covers the wire modules there.
    assert "sandman/py.typed" in client


def _install(wheel: Path, venv: Path, drop: tuple[str, ...] = ()) -> Path:
    """A venv (no pip) with the pure wheel unpacked into its site-packages, what pip does for
    it; `drop`: files left out."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=60)
    site = next((venv / "lib").glob("python3*/site-packages"))
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site, [n for n in z.namelist() if n not in drop])
    return venv / "bin" / "python"


# What a trainer's type-checked code imports from the wheel's own top (sandman.client also
# needs httpx, which the bare venv lacks).
_USER_CODE = """\
from sandman import api, contract
from sandman._version import __version__

conditions: api.Conditions = api.Conditions(tz="UTC")
size: str = api.DEFAULT_MEMORY
label: str = contract.LABEL_SANDBOX
version: str = __version__
"""


def _mypy(python: Path, tmp: Path) -> subprocess.CompletedProcess[str]:
    (tmp / "user.py").write_text(_USER_CODE)
    (tmp / "mypy.ini").write_text("[mypy]\n")  # not the tree's configuration
    return subprocess.run([sys.executable, "-m", "mypy", "--strict", "--config-file",
                           str(tmp / "mypy.ini"), "--cache-dir", str(tmp / "cache"),
                           "--python-executable", str(python), str(tmp / "user.py")],
                          cwd=tmp, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_type_checker_reads_the_client_wheels_wire_modules_as_typed(wheels, tmp_path):
    """mypy --strict on code that imports sandman.api and sandman.contract from the installed
    client wheel: typed through sandman/py.typed. Without that marker mypy refuses them as
    untyped (the control), as it did while only sandman/client carried one."""
    typed = _mypy(_install(wheels["client"], tmp_path / "typed"), tmp_path)
    assert typed.returncode == 0, typed.stdout + typed.stderr
    (tmp_path / "cache").rename(tmp_path / "cache-typed")
    bare = _mypy(_install(wheels["client"], tmp_path / "bare", drop=("sandman/py.typed",)),
                 tmp_path)
    assert bare.returncode == 1 and "import-untyped" in bare.stdout, bare.stdout + bare.stderr


@pytest.mark.slow
def test_the_client_wheel_has_only_the_client_and_its_wire(wheels):
    tops = {n.split("/")[0] for n in _names(wheels["client"])}
    assert tops == {"sandman"}, tops
    meta = _metadata(wheels["client"])
    assert "Name: sandman-client" in meta
    assert "Requires-Python: >=3.9" in meta
    requires = re.findall(r"^Requires-Dist: ([A-Za-z0-9_.-]+)(.*)$", meta, re.M)
    plain = {name.lower() for name, rest in requires if "extra ==" not in rest}
    assert plain == CLIENT_DEPENDENCIES, requires
    # A range, not a pin: trainers bring their own httpx.
    assert any(name == "httpx" and "<" in rest and ">=" in rest for name, rest in requires)


def _typing_only(tree: ast.AST) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:`: read by type checkers, never run."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) \
                and node.test.id == "TYPE_CHECKING" and not node.orelse:
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return out


def _imports(source: str, filename: str) -> set[str]:
    """What the file imports when it runs (`if TYPE_CHECKING:` blocks left out)."""
    found = set()
    tree = ast.parse(source, filename)
    typing_only = _typing_only(tree)
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            if node.module == "sandman":
                found |= {f"sandman.{a.name}" for a in node.names}
    return found


def _extras(wheel: Path) -> set[str]:
    return set(re.findall(r"^Provides-Extra: (\S+)$", _metadata(wheel), re.M))


@pytest.mark.slow
def test_client_files_import_only_stdlib_httpx_and_each_other(wheels):
    with zipfile.ZipFile(wheels["client"]) as z:
        py = {n: z.read(n).decode() for n in z.namelist() if n.endswith(".py")}
    shipped = {n[:-3].replace("/", ".").removesuffix(".__init__") for n in py}
    # An adapter, sandman/client/NAME.py with an extra NAME (hyphens dropped or made
    # underscores, as the framework's import name: mini-swe-agent's is minisweagent,
    # nemo-gym's nemo_gym), may import its framework (what the extra installs); still
    # nothing first-party it does not ship.
    adapters = {f"sandman/client/{e.replace('-', sep)}.py"
                for e in _extras(wheels["client"]) for sep in ("", "_")}
    bad = []
    for name, source in py.items():
        for mod in _imports(source, name):
            top = mod.split(".")[0]
            if top in sys.stdlib_module_names or top in CLIENT_DEPENDENCIES or top == "__future__":
                continue
            if name in adapters and top not in FIRST_PARTY:
                continue
            # The trainer's own OpenTelemetry, used when installed (an ImportError makes
            # every span a no-op): never a dependency of the client.
            if name == "sandman/tracing.py" and top == "opentelemetry" \
                    and "except ImportError:" in source:
                continue
            if mod in shipped or mod == "sandman":
                continue
            bad.append(f"{name}: {mod}")
    assert not bad, f"the client distribution imports what it does not ship: {bad}"


@pytest.mark.slow
def test_the_server_depends_on_the_client_at_the_same_version(wheels):
    from sandman._version import __version__

    meta = _metadata(wheels["server"])
    assert f"Version: {__version__}" in meta
    assert f"Version: {__version__}" in _metadata(wheels["client"])
    assert f"Requires-Dist: sandman-client=={__version__}" in meta
    server = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert f"sandman-client=={__version__}" in server["dependencies"]


def test_the_check_sees_a_server_module_in_the_client():
    src = "from sandman import podspec\nimport controller.routes\nfrom sandman.api import Route\n"
    assert _imports(src, "x.py") == {"sandman", "sandman.podspec", "controller.routes",
                                     "sandman.api"}


@pytest.mark.slow
def test_the_server_wheel_ships_the_product_only(wheels):
    """Neither the test bed nor the benches (nor tests, tools) are in the server wheel: the
    image installs it, and nothing it runs needs them (tests/test_layout.py)."""
    tops = {n.split("/")[0] for n in _names(wheels["server"])}
    assert tops == SERVER_TOPS, tops
    names = _names(wheels["server"])
    assert "execd/execd.py" in names and "execd/execd_daemon/main.py" in names
    assert "loadtest/acquire_burst.py" in names
    assert not [n for n in names if "/bench" in n or n.split("/")[-1].startswith("bench")]


@pytest.mark.parametrize("dist", ["client", "server"])
@pytest.mark.slow
def test_each_wheel_carries_its_license_and_where_the_project_lives(wheels, dist):
    meta = _metadata(wheels[dist])
    assert "License-Expression: Apache-2.0" in meta
    assert "License-File: LICENSE" in meta
    urls = dict(re.findall(r"^Project-URL: ([^,]+), (\S+)$", meta, re.M))
    assert {"Homepage", "Documentation", "Source", "Issues"} <= set(urls), urls
    assert all(u.startswith("https://github.com/sandman-dev/sandman") for u in urls.values())
    assert re.search(r"^Classifier: Programming Language :: Python :: 3$", meta, re.M)
    with zipfile.ZipFile(wheels[dist]) as z:
        lic = [n for n in z.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
        assert lic and z.read(lic[0]) == (REPO / "LICENSE").read_bytes()
    assert (REPO / "LICENSE").read_text().lstrip().startswith("Apache License")


def test_the_client_readme_links_work_on_a_package_index():
    # PyPI renders the README alone: a relative link points nowhere there.
    text = (REPO / "client" / "README.md").read_text()
    links = re.findall(r"\]\(([^)]+)\)", text)
    assert links and all(u.startswith(("https://", "#")) for u in links), links
