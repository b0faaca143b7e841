"""What a patch may write, and the base's pytest configuration as pytest reads it
(docs/grading.md, "What a patch may write" and "The base's configuration"). Each hostile
patch is graded through `grade()` on a real execd, as the attacker would send it: a patch
that writes an ignored path, goes through a tracked symbolic link or submodule, reaches into
`.git/`, makes a link or a submodule, or adds a module named like one of the standard library
at a directory on the import path is refused (failed, with one line saying why), never
passed and never no_verdict. Most of them carry the reference fix as well, so that only the
refusal can fail them. The base's configuration keeps its path options' meaning: a src
layout's `pythonpath`, a `--confcutdir` or `-p` in its addopts collect and pass as they do
under plain pytest in the repository."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sandman.client import Client, Sandbox
from sandman.client import grading as G
from sandman.client.grading import Task, Verdict
from testbed import taskimage

from .conftest import FAST_RETRY

PYTEST = f"{sys.executable} -m pytest -q -p no:cacheprovider"
_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t", "GIT_CONFIG_GLOBAL": "/dev/null",
        "GIT_CONFIG_SYSTEM": "/dev/null", "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
IGNORE = "__pycache__/\n*.pyc\n.venv/\nbuild/\nnode_modules\n"


def _git(repo: Path, *args: str, data: bytes | None = None) -> bytes:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          env={**_ENV, "HOME": str(repo)}, input=data).stdout


def _repo(dest: Path, files: dict[str, str], links: dict[str, str] = {},  # noqa: B006
          gitlinks: tuple[str, ...] = ()) -> str:
    """A task repository: `files`, tracked symbolic links (name -> target) and submodule
    entries (gitlinks), committed; returns the base commit."""
    dest.mkdir(parents=True)
    _git(dest, "init", "-q", "-b", "main")
    for rel, text in files.items():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_text(text)
    for name, target in links.items():
        os.symlink(target, dest / name)
    _git(dest, "add", "-A")
    _git(dest, "commit", "-q", "-m", "base")
    for g in gitlinks:
        _git(dest, "update-index", "--add", "--cacheinfo",
             f"160000,{_git(dest, 'rev-parse', 'HEAD').decode().strip()},{g}")
    if gitlinks:
        _git(dest, "commit", "-q", "-m", "submodules")
    return _git(dest, "rev-parse", "HEAD").decode().strip()


CALC = {**taskimage.FILES, ".gitignore": IGNORE}


def _task(tmp_path: Path, files: dict[str, str] | None = None, command: str | None = None,
          links: dict[str, str] | None = None, gitlinks: tuple[str, ...] = (),
          name: str = "repo") -> Task:
    repo = tmp_path / name
    base = _repo(repo, CALC if files is None else files,
                 {"link": ".venv", "pylink": "/usr/lib/python3/dist-packages"}
                 if links is None else links, gitlinks)
    return Task(name="calc-add", image="local/unused", repo=str(repo), base_commit=base,
                test_files=tuple(taskimage.TEST_FILES),
                test_command=command or f"PYTHONPATH=.venv/site:. {PYTEST} tests/test_calc.py",
                python=sys.executable, reference_patch=taskimage.REFERENCE_PATCH,
                time_limit_s=60)


def _diff(task: Task, tmp_path: Path, files: dict[str, str | bytes | None],
          links: dict[str, str] | None = None, renames: dict[str, str] | None = None,
          flags: tuple[str, ...] = ()) -> bytes:
    """The patch an agent's repository would give for these changes, ignored paths forced
    in (`git add -f`, as a commit of the agent's can carry them)."""
    probe = tmp_path / f"probe-{len(list(tmp_path.glob('probe-*')))}"
    _git(tmp_path, "clone", "-q", task.repo, str(probe))
    for old, new in (renames or {}).items():
        (probe / new).parent.mkdir(parents=True, exist_ok=True)
        _git(probe, "mv", "-f", old, new)
    for rel, content in files.items():
        p = probe / rel
        if content is None:
            p.unlink()
            continue
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            p.write_bytes(content)
        else:
            p.write_text(content)
    for name, target in (links or {}).items():
        if os.path.lexists(probe / name):
            (probe / name).unlink()
        os.symlink(target, probe / name)
    _git(probe, "add", "-A", "-f")
    return _git(probe, "diff", "--cached", "--binary", *flags)


def _add(path: str, text: str = "x = 1\n") -> bytes:
    lines = "".join("+" + line + "\n" for line in text.splitlines())
    return (f"diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n"
            f"+++ b/{path}\n@@ -0,0 +1,{len(text.splitlines())} @@\n{lines}").encode()


def _grade(make_controller, execd, task: Task, patch: bytes) -> G.GradeResult:
    url = make_controller(execd, Path(task.repo)).url
    with Client(url, retry=FAST_RETRY) as c:
        return G.grade(c, task, patch, attempts=2, retry_backoff_s=0.05)


def _src(code: str) -> str:
    return textwrap.dedent(code).lstrip()


FIXED_CALC = taskimage.FILES["calc/__init__.py"].replace("a - b", "a + b")
# Rewrites pytest's reports to passed, from a start-up hook (no fix of `add`).
PASS_ALL = _src("""
    import sys


    class _Pass:
        def find_spec(self, name, path=None, target=None):
            if name != "_pytest.reports":
                return None
            sys.meta_path.remove(self)
            import importlib.util
            spec = importlib.util.find_spec(name)
            real_exec = spec.loader.exec_module

            def exec_module(mod):
                real_exec(mod)
                orig = mod.TestReport.from_item_and_call.__func__

                def passed(cls, item, call):
                    rep = orig(cls, item, call)
                    rep.outcome, rep.longrepr = "passed", None
                    return rep
                mod.TestReport.from_item_and_call = classmethod(passed)
            spec.loader.exec_module = exec_module
            return spec


    sys.meta_path.insert(0, _Pass())
    """)
# A top-level `encodings` package: the interpreter imports it before site and pytest under
# PYTHONPATH=. (the real one is run inside it, so the interpreter still starts).
ENCODINGS = _src("""
    import sys
    __path__ = [p + "/encodings" for p in sys.path
                if p.endswith("/lib/python%d.%d" % sys.version_info[:2])]
    _f = __path__[0] + "/__init__.py"
    import _io
    with _io.open(_f, "rb") as _h:
        exec(compile(_h.read(), _f, "exec"))
    """) + PASS_ALL


# ---- 1. a patch writes tracked paths, or new files outside ignored paths


def _with_fix(*extra: bytes) -> bytes:
    return taskimage.REFERENCE_PATCH + b"".join(extra)


# name -> the patch, given the task and a scratch dir
PATH_CASES = {
    # A venv's site dir on the task's path (as a repo-local uv .venv is): a start-up hook
    # there passes every test; today's drop only names it.
    "sitecustomize in the ignored .venv": lambda t, d: _diff(
        t, d, {".venv/site/sitecustomize.py": PASS_ALL}),
    "the runner's own file in the ignored .venv": lambda t, d: _with_fix(_diff(
        t, d, {".venv/lib/python3.11/site-packages/_pytest/python.py": "x = 1\n"})),
    "a fixed copy of the package in the ignored .venv": lambda t, d: _diff(
        t, d, {".venv/site/calc/__init__.py": FIXED_CALC}),
    "ignored build/": lambda t, d: _with_fix(_add("build/lib/calc/__init__.py", FIXED_CALC)),
    "ignored node_modules": lambda t, d: _with_fix(_add("node_modules/x/index.js", "x\n")),
    "binary file into an ignored path": lambda t, d: _with_fix(_diff(
        t, d, {".venv/site/blob.bin": bytes(range(256)) * 4})),
    "through a tracked link to .venv": lambda t, d: _with_fix(_add("link/site/x.py")),
    "through a tracked link out of the repo": lambda t, d: _with_fix(
        _add("pylink/sandman_x.py")),
    "through a tracked submodule": lambda t, d: _with_fix(_add("vendor/calc/__init__.py")),
    "through a tracked file": lambda t, d: _with_fix(_add("README.md/x.py")),
    ".git/hooks": lambda t, d: _with_fix(_add(".git/hooks/pre-commit", "exit 0\n")),
    ".git/info/attributes": lambda t, d: _with_fix(_add(".git/info/attributes",
                                                        "* -diff\n")),
    "a nested .git": lambda t, d: _with_fix(_add("calc/.git/config", "[core]\n")),
    "rename into an ignored path": lambda t, d: _with_fix(_diff(
        t, d, {}, renames={"README.md": "build/README.md"}, flags=("-M",))),
    "copy into an ignored path": lambda t, d: _with_fix(
        b"diff --git a/README.md b/.venv/site/README.md\nsimilarity index 100%\n"
        b"copy from README.md\ncopy to .venv/site/README.md\n"),
    "rename from .git": lambda t, d: _with_fix(
        b"diff --git a/.git/HEAD b/HEAD.txt\nsimilarity index 100%\n"
        b"rename from .git/HEAD\nrename to HEAD.txt\n"),
    "copy from .git": lambda t, d: _with_fix(
        b"diff --git a/.git/config b/leak.txt\nsimilarity index 100%\n"
        b"copy from .git/config\ncopy to leak.txt\n"),
    "a tracked file made a symbolic link": lambda t, d: _with_fix(_diff(
        t, d, {}, links={"README.md": "/etc/passwd"})),
    "a new symbolic link": lambda t, d: _with_fix(_diff(t, d, {}, links={"site": ".venv"})),
    "a tracked link retargeted": lambda t, d: _with_fix(_diff(
        t, d, {}, links={"link": "/usr/lib/python3"})),
    "a new submodule": lambda t, d: _with_fix(
        b"diff --git a/sm b/sm\nnew file mode 160000\nindex 0000000..%s\n--- /dev/null\n"
        b"+++ b/sm\n@@ -0,0 +1 @@\n+Subproject commit %s\n"
        % ((t.base_commit.encode(),) * 2)),
}


@pytest.mark.parametrize("case", list(PATH_CASES))
def test_a_patch_writing_outside_the_base_is_refused(case, make_controller, execd,
                                                     tmp_path) -> None:
    task = _task(tmp_path, gitlinks=("vendor",))
    patch = PATH_CASES[case](task, tmp_path)
    r = _grade(make_controller, execd, task, patch)
    print(f"HOSTILE {case!r}: {r.verdict} ({r.reason})")
    assert r.verdict is Verdict.FAILED, r
    assert r.reason.startswith("patch refused: ") and "\n" not in r.reason, r.reason


def test_new_files_and_tracked_paths_are_allowed(make_controller, execd, tmp_path) -> None:
    """The rule's other side: a change to tracked files, a new file, a negated ignore
    pattern's file, a deleted link, a module under a package named like the stdlib."""
    files = {**CALC, ".gitignore": IGNORE + "out/*\n!out/keep.py\n"}
    task = _task(tmp_path, files=files)
    patch = _with_fix(_diff(task, tmp_path, {
        "calc/extra.py": "y = 2\n", "out/keep.py": "z = 3\n", "calc/json.py": "j = 1\n",
        "README.md": "changed\n", "link": None}))
    r = _grade(make_controller, execd, task, patch)
    assert r.verdict is Verdict.PASSED, r
    assert r.excluded == (), r.excluded


# ---- 2. names Python imports at start, added at a directory on the import path

IMPORT_CASES = {
    # The real attack: no fix, every test passes under PYTHONPATH=. before the fix.
    "encodings/ package at the top": lambda t, d: _diff(
        t, d, {"encodings/__init__.py": ENCODINGS}),
    "json.py at the top": lambda t, d: _with_fix(_add("json.py", "import sys\n")),
    "site.py at the top": lambda t, d: _with_fix(_add("site.py", "import sys\n")),
    "os.py at the top": lambda t, d: _with_fix(_add("os.py", "import sys\n")),
    "a scratch code.py at the top": lambda t, d: _with_fix(_add("code.py", "print(1)\n")),
    "xml/__init__.py under src/": lambda t, d: _with_fix(_add("src/xml/__init__.py")),
    "sourceless json.pyc at the top": lambda t, d: _with_fix(_diff(
        t, d, {"json.pyc": b"\x00\x01bytecode"})),
    "an extension named like the stdlib": lambda t, d: _with_fix(_diff(
        t, d, {"select.cpython-311-x86_64-linux-gnu.so": b"\x7fELF\x00"})),
    "a runner dependency under src/": lambda t, d: _with_fix(
        _add("src/packaging/__init__.py")),
    "a stdlib name in a directory outside any package": lambda t, d: _with_fix(
        _add("scripts/typing.py")),
}


@pytest.mark.parametrize("case", list(IMPORT_CASES))
def test_a_module_named_like_the_stdlib_on_the_import_path_is_refused(
        case, make_controller, execd, tmp_path) -> None:
    files = {**CALC, ".gitignore": IGNORE.replace("*.pyc\n", "")}
    task = _task(tmp_path, files=files, command=f"PYTHONPATH=. {PYTEST} tests/test_calc.py")
    r = _grade(make_controller, execd, task, IMPORT_CASES[case](task, tmp_path))
    print(f"HOSTILE {case!r}: {r.verdict} ({r.reason})")
    assert r.verdict is Verdict.FAILED, r
    assert r.reason.startswith("patch refused: ") and "standard library" in r.reason or (
        "runner" in r.reason), r.reason


def test_a_stdlib_named_module_the_base_ships_is_the_tasks_own(make_controller, execd,
                                                               tmp_path) -> None:
    """A base with a top-level `colorsys.py` of its own: a patch may change it."""
    task = _task(tmp_path, files={**CALC, "colorsys.py": "T = 1\n"},
                 command=f"PYTHONPATH=. {PYTEST} tests/test_calc.py")
    r = _grade(make_controller, execd, task, _with_fix(_diff(task, tmp_path,
                                                             {"colorsys.py": "T = 2\n"})))
    assert r.verdict is Verdict.PASSED, r


def test_capture_leaves_out_what_grade_would_refuse(execd, tmp_path) -> None:
    """The agent's side: a file of .venv (un-ignored by the agent's own .gitignore), a new
    link and a scratch code.py are left out of the captured patch and reported (the base's
    ignore rules count, not the work tree's); the rest of the change is kept."""
    task = _task(tmp_path)
    repo = Path(task.repo)
    (repo / "calc/__init__.py").write_text(FIXED_CALC)
    (repo / "code.py").write_text("print('scratch')\n")
    (repo / ".gitignore").write_text(IGNORE.replace(".venv/\n", ""))
    (repo / ".venv/site").mkdir(parents=True)
    (repo / ".venv/site/sitecustomize.py").write_text(PASS_ALL)
    os.symlink(".venv", repo / "site")
    with Sandbox.connect(execd.address, execd.port, execd.token, retry=FAST_RETRY) as sb:
        patch, excluded = G.capture_patch(sb, task.base_commit, repo=task.repo)
    reasons = dict(excluded)
    assert set(reasons) == {"code.py", ".venv/site/sitecustomize.py", "site"}, excluded
    assert "ignored" in reasons[".venv/site/sitecustomize.py"], reasons
    assert "standard library" in reasons["code.py"], reasons
    assert "symbolic link" in reasons["site"], reasons
    assert b"calc/__init__.py" in patch and b".gitignore" in patch, patch
    assert b"sitecustomize" not in patch and b"code.py" not in patch, patch


# ---- 3. the base's configuration, read as pytest reads it in the repository

# Without tests/__init__.py: pytest's rootdir insertion puts tests/, not the top, on the path.
FLAT = {k: v for k, v in CALC.items() if k != "tests/__init__.py"}
SRC_LAYOUT = {".gitignore": IGNORE, "README.md": "# calc\n",
              "src/calc/__init__.py": taskimage.FILES["calc/__init__.py"],
              "tests/test_calc.py": taskimage.FILES["tests/test_calc.py"]}
SRC_FIX = taskimage.REFERENCE_PATCH.replace(b"calc/__init__.py", b"src/calc/__init__.py")
BAD_ROOT_CONFTEST = _src("""
    import pytest


    @pytest.fixture(autouse=True)
    def _no():
        raise RuntimeError("a conftest above the base's --confcutdir")
    """)
PLUGIN = _src("""
    def pytest_configure(config):
        config.addinivalue_line("markers", "from_the_repo: a base plugin's marker")
    """)

# name -> (files of the base, the fix (None: the reference), the command's environment)
CONFIGS = {
    "pythonpath src (src layout)": (
        {**SRC_LAYOUT, "pyproject.toml": '[tool.pytest.ini_options]\npythonpath = ["src"]\n'},
        SRC_FIX, ""),
    "pythonpath . (flat)": (
        {**FLAT, "setup.cfg": "[metadata]\nname = calc\n",
         "pyproject.toml": '[tool.pytest.ini_options]\npythonpath = ["."]\n'}, None, ""),
    "pythonpath in setup.cfg": (
        {**FLAT, "setup.cfg": "[tool:pytest]\npythonpath = .\n"}, None, ""),
    "pythonpath in tests/pytest.ini": (
        {**FLAT, "setup.cfg": "[metadata]\n", "tests/pytest.ini": "[pytest]\npythonpath = ..\n"},
        None, ""),
    "addopts --confcutdir relative": (
        {**FLAT, "conftest.py": BAD_ROOT_CONFTEST, "setup.cfg": (
            "[tool:pytest]\npythonpath = .\naddopts = --confcutdir=tests\n")}, None, ""),
    "addopts -p a plugin of the repo": (
        {**FLAT, "calc_plugin.py": PLUGIN, "setup.cfg": (
            "[tool:pytest]\npythonpath = .\naddopts = -p calc_plugin --strict-markers\n")},
        None, ""),
    "addopts --import-mode=importlib": (
        {**FLAT, "setup.cfg": (
            "[tool:pytest]\npythonpath = .\naddopts = --import-mode=importlib\n")}, None, ""),
    "testpaths, python_files, norecursedirs": (
        {**FLAT, "setup.cfg": ("[tool:pytest]\npythonpath = .\ntestpaths = tests\n"
                               "python_files = test_*.py\nnorecursedirs = build .venv\n")},
        None, ""),
    "log_file and cache_dir relative": (
        {**FLAT, "setup.cfg": ("[tool:pytest]\npythonpath = .\nlog_file = logs/run.log\n"
                               "cache_dir = .cache/pytest\n")}, None, ""),
}


@pytest.mark.parametrize("case", list(CONFIGS))
def test_the_base_config_keeps_its_path_options(case, make_controller, execd,
                                                tmp_path) -> None:
    """Each base collects and passes under plain pytest in the repository (checked first,
    no PYTHONPATH), and so under the grader: the reference passes, the empty patch fails."""
    files, fix, env = CONFIGS[case]
    a = _task(tmp_path, files=files, command=f"{env}{PYTEST} tests/test_calc.py", links={},
              name="a")
    b = _task(tmp_path, files=files, command=f"{env}{PYTEST} tests/test_calc.py", links={},
              name="b")
    fix = fix or taskimage.REFERENCE_PATCH
    plain = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "tests/test_calc.py"], cwd=a.repo, capture_output=True, text=True,
                           env={**os.environ, "PYTHONSAFEPATH": "1",
                                "PYTHONPATH": "." if env else ""})
    assert "2 failed, 1 passed" in plain.stdout, plain.stdout + plain.stderr
    url = make_controller(execd, Path(a.repo), Path(b.repo)).url
    with Client(url, retry=FAST_RETRY) as c:
        ref = G.grade(c, a, fix, attempts=1)
        empty = G.grade(c, b, b"", attempts=1)
    print(f"CONFIG {case!r}: {ref.verdict} ({ref.reason}); {empty.verdict} ({empty.reason})")
    assert ref.verdict is Verdict.PASSED, ref
    assert empty.verdict is Verdict.FAILED and empty.summary == {"failed": 2, "passed": 1}, (
        empty)


# ---- the pure parts (each behaviour above is also shown end to end)


def test_import_rule_by_directory() -> None:
    from sandman.client._grading import import_refusal, packages, shipped_modules

    tree = ["calc/__init__.py", "tests/test_calc.py", "lib/token.py", "src/app/__init__.py"]
    pkgs, shipped = packages(tree), shipped_modules(tree)
    refused = ["json.py", "encodings/__init__.py", "src/xml/__init__.py", "tests/os.py",
               "select.cpython-311-x86_64-linux-gnu.so", "json.pyc", "src/packaging/__init__.py",
               "sitepkg/colorama.py"]
    kept = ["calc/json.py", "src/app/json.py", "lib/token.py", "encodings/data.txt",
            "json.txt", "calc/x.py", "mymod.py", "src/app/types/__init__.py"]
    for p in refused:
        assert import_refusal(p, pkgs, shipped), p
    for p in kept:
        assert import_refusal(p, pkgs, shipped) is None, p
    # A pythonpath entry naming a package's directory is a root too.
    assert import_refusal("calc/json.py", pkgs, shipped, roots=("calc",))


def test_stdlib_names_cover_the_running_interpreter() -> None:
    from sandman.client._grading import STDLIB_MODULES

    assert set(getattr(sys, "stdlib_module_names", ())) <= STDLIB_MODULES
    assert {"encodings", "site", "json", "distutils", "asynchat", "annotationlib"} <= (
        STDLIB_MODULES)


def test_config_pythonpath_and_copy_name() -> None:
    from sandman.client._grading import config_copy_name, config_pythonpath

    assert config_pythonpath("pyproject.toml",
                             b'[tool.pytest.ini_options]\npythonpath = ["src", "."]\n') == [
        "src", ""]
    assert config_pythonpath("tests/setup.cfg", b"[tool:pytest]\npythonpath =\n  ..\n  lib\n"
                             ) == ["", "tests/lib"]
    assert config_pythonpath("tox.ini", b"[pytest]\npythonpath = ../../etc\n") == []
    assert config_copy_name("a/pyproject.toml", "x") == "a/.sandman-grading-x.toml"
    assert config_copy_name("setup.cfg", "x") == ".sandman-grading-x.cfg"
    assert config_copy_name("tox.ini", "x") == ".sandman-grading-x.ini"
    assert config_copy_name("pytest.toml", "x") is None


def test_path_rule_from_the_tree() -> None:
    from sandman.client._grading import Change, parse_raw_z, write_refusal

    tree = {"link": "120000", "sub": "160000", "README.md": "100644", "calc/a.py": "100644"}
    raw = (b":000000 100644 0000000 abc A\0link/x\0:100644 120000 abc def T\0README.md\0"
           b":100644 100644 abc def M\0calc/a.py\0:000000 100644 0 a A\0.venv/x\0")
    ch = parse_raw_z(raw)
    assert ch[1] == Change("T", "100644", "120000", "README.md")
    why = [write_refusal(c, tree, {".venv/x"}) for c in ch]
    assert why == ["goes through link, a symbolic link at the base", "makes a symbolic link",
                   None, "ignored at the base commit"]
    assert write_refusal(Change("A", "0", "100644", "sub/x"), tree, set()).endswith(
        "a submodule at the base")
    assert write_refusal(Change("A", "0", "100644", "a/.GIT/x"), tree, set())
