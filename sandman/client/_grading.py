"""The I/O-free half of grading (docs/grading.md), shared by the sync and async twins: the task
model, the verdicts, which files a patch may not carry, how a suite's exit status becomes a
verdict, and which failures are the infrastructure's (retried, never scored 0)."""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import json
import os
import posixpath
import re
import shlex
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import Any, NamedTuple

from sandman import api
from sandman.client.errors import (
    BadRequest,
    Forbidden,
    SandmanError,
    Unauthenticated,
)


class Verdict(str, Enum):  # noqa: UP042 - the client runs on python 3.9 too (StrEnum: 3.11)
    PASSED = "passed"
    FAILED = "failed"  # the agent's patch: tests failed, or it does not apply
    NO_VERDICT = "no_verdict"  # resample: the infrastructure or the task, never the agent

    def __str__(self) -> str:
        return self.value


# ---- what a patch may not carry

@dataclass(frozen=True)
class Exclusions:
    """Test configuration an agent's patch may not change (an agent once planted a
    conftest.py that made every test pass, paper §3). `files`: glob patterns matched against
    each path's base name (a pattern with a "/" against the whole path), at any depth.
    `sections`: base name -> section names; a change to any of those sections leaves the
    WHOLE file out (the other sections of it with it: one rule, easy to state)."""

    files: tuple[str, ...] = ("conftest.py", "pytest.ini", "tox.ini", ".coveragerc",
                              "noxfile.py")
    sections: tuple[tuple[str, tuple[str, ...]], ...] = (
        ("setup.cfg", ("tool:pytest", "pytest")),
        ("pyproject.toml", ("tool.pytest", "tool.pytest.ini_options")),
    )

    def file_excluded(self, path: str) -> bool:
        base = posixpath.basename(path)
        return any(fnmatch.fnmatchcase(path if "/" in p else base, p) for p in self.files)

    def section_names(self, path: str) -> tuple[str, ...]:
        base = posixpath.basename(path)
        for name, secs in self.sections:
            if name == base:
                return secs
        return ()

    def apply_args(self) -> list[str]:
        """`git apply --exclude=` options for the file patterns (git's wildmatch there lets
        `*` cross `/`, so `*/conftest.py` is any depth below the top)."""
        out = []
        for p in self.files:
            out.append(f"--exclude={p}")
            if "/" not in p:
                out.append(f"--exclude=*/{p}")
        return out


DEFAULT_EXCLUDE = Exclusions()
NO_EXCLUDE = Exclusions(files=(), sections=())

_HEADER = re.compile(r"^\s*\[\[?\s*([^\[\]]+?)\s*\]\]?\s*(?:[#;].*)?$")


def sections(text: str, wanted: tuple[str, ...]) -> dict[str, list[str]]:
    """The raw lines of each section named in `wanted` (or a subtable of one: `tool.pytest.x`)
    of an INI or TOML file, header line included. Line-based on purpose: the comparison is
    "did these lines change", not "does the parsed value differ"."""
    out: dict[str, list[str]] = {}
    current: str | None = None
    for line in text.splitlines():
        m = _HEADER.match(line)
        if m:
            name = m.group(1).strip().strip('"')
            current = name if any(name == w or name.startswith(w + ".") for w in wanted) else None
        if current is not None:
            out.setdefault(current, []).append(line.rstrip())
    return out


def sections_changed(before: bytes | None, after: bytes | None, wanted: tuple[str, ...]) -> bool:
    """True when the test sections differ (a file added or deleted counts by its sections)."""
    def read(data: bytes | None) -> dict[str, list[str]]:
        if data is None:
            return {}
        return sections(data.decode("utf-8", "replace"), wanted)
    return read(before) != read(after)


class Excluded(NamedTuple):
    path: str
    reason: str


class CapturedPatch(NamedTuple):
    """`patch, excluded = capture_patch(...)`: the binary-safe diff against the base commit
    and the paths left out of it."""

    patch: bytes
    excluded: list[Excluded]


# ---- what a patch may never carry: the runner's own files (not configurable)

# Names pytest reads as configuration (pytest 9 adds the .toml pair); setup.cfg and
# pyproject.toml are never read from the repository either: the grader hands pytest a copy
# of the base's configuration file (`-c`).
RUNNER_CONFIG_FILES = ("conftest.py", "pytest.ini", ".pytest.ini", "pytest.toml",
                       ".pytest.toml", "tox.ini")
STARTUP_HOOKS = ("sitecustomize.py", "usercustomize.py", "*.pth")
# The runner's own packages: a module of the patch with one of these names, at any depth
# (any directory may be on sys.path: PYTHONPATH, an editable install), is refused.
RUNNER_PACKAGES = ("pytest", "_pytest", "pluggy", "iniconfig")
# Further top-level modules pytest imports (its dependencies, optional ones included):
# refused at the repository's top level, the directory a task's PYTHONPATH=. puts first.
RUNNER_MODULES = RUNNER_PACKAGES + (
    "py", "packaging", "exceptiongroup", "tomli", "colorama", "pygments", "attr", "attrs",
    "more_itertools", "atomicwrites", "argcomplete", "readline", "typing_extensions")


def _module_name(component: str) -> str:
    return component.split(".", 1)[0]


def runner_refusal(path: str) -> str | None:
    """Why the patch may not carry `path` whatever the task's exclusions say, or None: an
    interpreter start-up hook, a pytest configuration file, or a module shadowing the
    runner (docs/grading.md, "Threat model")."""
    parts = [p for p in path.split("/") if p]
    if not parts:
        return None
    base = parts[-1]
    if any(fnmatch.fnmatchcase(base, h) for h in STARTUP_HOOKS):
        return "interpreter start-up hook"
    if base in RUNNER_CONFIG_FILES:
        return "pytest configuration file"
    names = [*parts[:-1], _module_name(base)]
    if any(n in RUNNER_PACKAGES for n in names) or names[0] in RUNNER_MODULES:
        return "shadows a module of the test runner"
    return None


# The static scan: added lines that reach into the runner from code under test.
_SUSPICIOUS = (
    (re.compile(r"\b(_pytest|pluggy)\b"), "imports or names pytest's internals"),
    (re.compile(r"sys\.modules\s*(\[[^\]]*\]\s*=|\.(update|pop|setdefault|__setitem__)|=)"),
     "rewrites sys.modules"),
    (re.compile(r"\bPYTEST_[A-Z_]+|\bjunit", re.I), "names the runner's settings or report"),
    (re.compile(r"\bpytest_(collection|runtest|sessionfinish|configure|report|terminal|"
                r"make_collect|pycollect|itemcollected|deselected)\w*"),
     "defines a pytest hook outside a conftest"),
    (re.compile(r"\bos\._exit\b|\bos\.kill(pg)?\b|\bsignal\.SIGKILL\b"),
     "ends or signals processes"),
)


def scan_patch(patch: bytes) -> tuple[str, ...]:
    """What the patch's added lines do that a fix has no need to: "path: line N: why"."""
    out: list[str] = []
    path, n = "?", 0
    for raw in patch.split(b"\n"):
        if raw.startswith(b"+++ "):
            p = _unquote(raw[4:].split(b"\t")[0])
            path = p[2:] if p.startswith("b/") else p
            continue
        if raw.startswith(b"@@"):
            m = re.match(rb"@@ -\S+ \+(\d+)", raw)
            n = int(m.group(1)) - 1 if m else 0
            continue
        if raw.startswith(b"+"):
            n += 1
            line = raw[1:].decode("utf-8", "replace")
            for rx, why in _SUSPICIOUS:
                if rx.search(line):
                    out.append(f"{path}: line {n}: {why}: {line.strip()[:120]}")
        elif raw.startswith(b" "):
            n += 1
    return tuple(dict.fromkeys(out))


# ---- the base's pytest configuration (pytest's own discovery order, on the base's tree)

CONFIG_ORDER = ("pytest.toml", ".pytest.toml", "pytest.ini", ".pytest.ini", "pyproject.toml",
                "tox.ini", "setup.cfg")
_CONFIG_SECTIONS = {"pyproject.toml": ("tool.pytest.ini_options", "tool.pytest"),
                    "tox.ini": ("pytest",), "setup.cfg": ("tool:pytest",)}


def config_candidates(test_files: tuple[str, ...]) -> list[str]:
    """Where pytest would look for its configuration, first match wins: from the common
    directory of the test files up to the repository's top, each directory's names in
    pytest's order."""
    dirs = [posixpath.dirname(posixpath.normpath(f)) for f in test_files]
    common = posixpath.commonpath(dirs) if all(dirs) else ""
    out: list[str] = []
    d = common
    while True:
        out.extend(posixpath.join(d, name) if d else name for name in CONFIG_ORDER)
        if not d:
            return out
        d = posixpath.dirname(d)


def config_matches(path: str, data: bytes) -> bool:
    """Whether pytest would take this file as its configuration (a section for the shared
    files; pytest.ini and the .toml pair count even empty)."""
    secs = _CONFIG_SECTIONS.get(posixpath.basename(path))
    return secs is None or bool(sections(data.decode("utf-8", "replace"), secs))


# ---- what a patch may write (docs/grading.md, "What a patch may write")

LINK_MODE, GITLINK_MODE = "120000", "160000"


def parse_tree_z(data: bytes) -> dict[str, str]:
    """path -> mode from `git ls-tree -r -z --full-tree` (files, links and submodules)."""
    out: dict[str, str] = {}
    for entry in data.split(b"\0"):
        meta, tab, path = entry.partition(b"\t")
        if tab:
            out[path.decode("utf-8", "surrogateescape")] = meta.split(b" ", 1)[0].decode()
    return out


class Change(NamedTuple):
    status: str  # A, M, D, T
    old_mode: str
    new_mode: str
    path: str


def parse_raw_z(data: bytes) -> list[Change]:
    """`git diff-index --cached -z --no-renames` entries (":old new sha sha S" NUL path)."""
    parts, out, i = data.split(b"\0"), [], 0
    while i + 1 < len(parts):
        meta = parts[i].split(b" ")
        if parts[i].startswith(b":") and len(meta) >= 5:
            out.append(Change(meta[4][:1].decode(), meta[0][1:].decode(), meta[1].decode(),
                              parts[i + 1].decode("utf-8", "surrogateescape")))
            i += 2
        else:
            i += 1
    return out


def path_refusal(path: str, tree: dict[str, str]) -> str | None:
    """Why no patch may name `path` at all, from the base's tree alone: a `.git` directory
    (any depth, any case: git refuses it too), or a new path below a tracked link, submodule
    or file (written through the link, or invisible to git)."""
    parts = path.split("/")
    if any(p.lower() == ".git" for p in parts):
        return "inside a .git directory"
    if path not in tree:
        for i in range(1, len(parts)):
            mode = tree.get("/".join(parts[:i]))
            if mode is not None:
                what = {LINK_MODE: "symbolic link", GITLINK_MODE: "submodule"}.get(mode, "file")
                return f"goes through {'/'.join(parts[:i])}, a {what} at the base"
    return None


def write_refusal(c: Change, tree: dict[str, str], ignored: set[str] | frozenset[str]
                  ) -> str | None:
    """Why a patch may not make change `c`: it may write paths tracked at the base, or new
    files outside the base's ignored paths, as regular files only."""
    why = path_refusal(c.path, tree)
    if why:
        return why
    if c.status != "D" and c.new_mode == LINK_MODE:
        return "makes a symbolic link"
    if c.status != "D" and c.new_mode == GITLINK_MODE:
        return "makes a submodule"
    if c.path not in tree and c.path in ignored:
        return "ignored at the base commit"
    return None


# Top-level module names of the standard library, Python 3.8 to 3.14: 3.11's
# sys.stdlib_module_names and the names other versions add or dropped. A fixed list, not
# the SDK's interpreter's nor the pod's: the rule is the same wherever it runs.
STDLIB_MODULES = frozenset("""
__future__ _abc _aix_support _ast _asyncio _bisect _blake2 _bootsubprocess _bz2 _codecs
_codecs_cn _codecs_hk _codecs_iso2022 _codecs_jp _codecs_kr _codecs_tw _collections
_collections_abc _compat_pickle _compression _contextvars _crypt _csv _ctypes _curses
_curses_panel _datetime _dbm _decimal _elementtree _frozen_importlib
_frozen_importlib_external _functools _gdbm _hashlib _heapq _imp _io _json _locale _lsprof
_lzma _markupbase _md5 _msi _multibytecodec _multiprocessing _opcode _operator _osx_support
_overlapped _pickle _posixshmem _posixsubprocess _py_abc _pydecimal _pyio _queue _random
_scproxy _sha1 _sha256 _sha3 _sha512 _signal _sitebuiltins _socket _sqlite3 _sre _ssl _stat
_statistics _string _strptime _struct _symtable _thread _threading_local _tkinter _tokenize
_tracemalloc _typing _uuid _warnings _weakref _weakrefset _winapi _zoneinfo abc aifc
antigravity argparse array ast asynchat asyncio asyncore atexit audioop base64 bdb binascii
bisect builtins bz2 cProfile calendar cgi cgitb chunk cmath cmd code codecs codeop
collections colorsys compileall concurrent configparser contextlib contextvars copy copyreg
crypt csv ctypes curses dataclasses datetime dbm decimal difflib dis distutils doctest email
encodings ensurepip enum errno faulthandler fcntl filecmp fileinput fnmatch fractions ftplib
functools gc genericpath getopt getpass gettext glob graphlib grp gzip hashlib heapq hmac
html http idlelib imaplib imghdr imp importlib inspect io ipaddress itertools json keyword
lib2to3 linecache locale logging lzma mailbox mailcap marshal math mimetypes mmap
modulefinder msilib msvcrt multiprocessing netrc nis nntplib nt ntpath nturl2path numbers
opcode operator optparse os ossaudiodev pathlib pdb pickle pickletools pipes pkgutil
platform plistlib poplib posix posixpath pprint profile pstats pty pwd py_compile pyclbr
pydoc pydoc_data pyexpat queue quopri random re readline reprlib resource rlcompleter runpy
sched secrets select selectors shelve shlex shutil signal site smtpd smtplib sndhdr socket
socketserver spwd sqlite3 sre_compile sre_constants sre_parse ssl stat statistics string
stringprep struct subprocess sunau symtable sys sysconfig syslog tabnanny tarfile telnetlib
tempfile termios textwrap this threading time timeit tkinter token tokenize tomllib trace
traceback tracemalloc tty turtle turtledemo types typing unicodedata unittest urllib uu uuid
venv warnings wave weakref webbrowser winreg winsound wsgiref xdrlib xml xmlrpc zipapp
zipfile zipimport zlib zoneinfo

_bootlocale binhex formatter parser symbol _dummy_thread dummy_threading macpath _peg_parser
_sha256 _sha512 _sha2 _wmi _tokenize _pydatetime _pylong _xxinterpchannels _xxinterpqueues
_interpreters _interpchannels _interpqueues _opcode_metadata _pyrepl _colorize _suggestions
_sysconfig _android_support _ios_support _apple_support annotationlib compression _zstd
_remote_debugging _hmac _types
""".split())
IMPORT_SUFFIXES = ("py", "pyc", "pyw", "so", "pyd")


def _module_at(rel: str) -> str | None:
    """The top-level module that `rel`, a path below a sys.path entry, defines: `name.py`
    (.pyc, an extension), or `name/__init__.py` (a regular package); else None."""
    parts = rel.split("/")
    if len(parts) > 2 or (len(parts) == 2 and parts[1].partition(".")[0] != "__init__"):
        return None
    name, dot, rest = parts[-1].partition(".")
    if not dot or rest.rsplit(".", 1)[-1] not in IMPORT_SUFFIXES:
        return None
    return parts[0] if len(parts) == 2 else name


def _module_roots(path: str) -> list[tuple[str, str]]:
    """(directory, module name) for each way `path` defines a top-level module."""
    parts = path.split("/")
    out = []
    for i in (len(parts) - 1, len(parts) - 2):
        if i >= 0:
            name = _module_at("/".join(parts[i:]))
            if name:
                out.append(("/".join(parts[:i]), name))
    return out


def packages(paths: Iterable[str]) -> set[str]:
    """The directories holding an `__init__` module (regular packages)."""
    return {posixpath.dirname(p) for p in paths
            if _module_at(posixpath.basename(p)) == "__init__"}


def shipped_modules(paths: Iterable[str]) -> set[tuple[str, str]]:
    """(directory, module name) of every top-level-style module the base ships."""
    return {m for p in paths for m in _module_roots(p)}


def import_refusal(path: str, pkgs: set[str], shipped: set[tuple[str, str]],
                   roots: Iterable[str] = ()) -> str | None:
    """Why `path`, added or changed by the patch, would shadow a module the interpreter or
    the runner imports: a module named like the standard library's or one of pytest's
    imports (RUNNER_MODULES) in a directory that may be on sys.path, i.e. the top, a
    `pythonpath` entry of the base's configuration (`roots`), or any directory outside a
    regular package (`pkgs`: src/, pytest's rootdir insertion, a path entry). A module the
    base already ships there is the task's own."""
    for d, name in _module_roots(path):
        if name not in STDLIB_MODULES and name not in RUNNER_MODULES:
            continue
        if d and d not in roots and d in pkgs:
            continue
        if (d, name) in shipped:
            continue
        whose = "the test runner's" if name in RUNNER_MODULES else "a standard library"
        return (f"adds module {name!r} at {d + '/' if d else 'the top'}, on the import "
                f"path, shadowing {whose} module")
    return None


def config_pythonpath(path: str, data: bytes) -> list[str]:
    """The base configuration's `pythonpath` entries as repository paths (pytest resolves
    them against the configuration file's directory); a loose read, which may find more."""
    secs = _CONFIG_SECTIONS.get(posixpath.basename(path), ("pytest",))
    lines = [ln for sec in sections(data.decode("utf-8", "replace"), secs).values()
             for ln in sec[1:]]
    out: list[str] = []
    for i, ln in enumerate(lines):
        m = re.match(r"\s*pythonpath\s*=(.*)", ln)
        if not m:
            continue
        value = [m.group(1)]
        for nxt in lines[i + 1:]:
            if re.match(r"\s*[\w.-]+\s*=", nxt) or not nxt.strip():
                break
            value.append(nxt)
        text = " ".join(value)
        toks = re.findall(r"\"([^\"]*)\"|'([^']*)'", text)
        entries = [a or b for a, b in toks] if toks else text.split()
        base = posixpath.dirname(path)
        for e in entries:
            p = posixpath.normpath(posixpath.join(base, e))
            if not p.startswith("/") and p != ".." and not p.startswith("../"):
                out.append("" if p == "." else p)
    return out


def config_copy_name(path: str, token: str) -> str | None:
    """The name of the base configuration's copy next to it (same directory: pytest
    resolves path options against it) with the suffix pytest reads the same way; None for
    the pytest.toml pair, whose reading depends on the name (passed as it is: a patch can
    never write a pytest configuration file)."""
    base = posixpath.basename(path)
    if base in ("pytest.toml", ".pytest.toml"):
        return None
    suffix = {"pyproject.toml": "toml", "setup.cfg": "cfg"}.get(base, "ini")
    return posixpath.join(posixpath.dirname(path), f".sandman-grading-{token}.{suffix}")


# ---- the verdict from the run's JUnit report

MAX_REPORT = 32 << 20


class ReportError(ValueError):
    """The JUnit report is missing, too large, not XML or not pytest's shape."""


def junit_key(nodeid: str) -> tuple[str, str]:
    """(classname, name) of a node id as pytest's junitxml writes it (mangle_test_address)."""
    path, bracket, params = nodeid.partition("[")
    names = path.split("::")
    names[0] = re.sub(r"\.py$", "", names[0].replace("/", "."))
    names[-1] += bracket + params
    return ".".join(names[:-1]), names[-1]


def parse_junit(data: bytes) -> list[tuple[str, str, str]]:
    """(classname, name, outcome) per testcase; outcome: passed, failed, error or skipped.
    Refuses a DOCTYPE (no entity tricks) and anything above MAX_REPORT bytes."""
    if len(data) > MAX_REPORT:
        raise ReportError(f"report too large ({len(data)} bytes)")
    if b"<!DOCTYPE" in data.upper() or b"<!ENTITY" in data.upper():
        raise ReportError("report has a DOCTYPE")
    try:
        root = ET.fromstring(data)
    except ET.ParseError as e:
        raise ReportError(f"report is not XML: {e}") from None
    if root.tag not in ("testsuites", "testsuite"):
        raise ReportError(f"report's root is <{root.tag}>, not a JUnit test suite")
    out = []
    for case in root.iter("testcase"):
        tags = {child.tag for child in case}
        outcome = ("error" if "error" in tags else "failed" if "failure" in tags
                   else "skipped" if "skipped" in tags else "passed")
        out.append((case.get("classname") or "", case.get("name") or "", outcome))
    return out


def judge(report: bytes | None, test_ids: tuple[str, ...], exit_code: int | None
          ) -> tuple[Verdict, str, dict[str, int]]:
    """passed only when the report names every official test id as passed, exactly once
    each, and the run exited 0; anything else is failed, with why. Neither stdout nor the
    exit status can make a pass: both are written by the code under test."""
    if report is None:
        return Verdict.FAILED, f"no JUnit report (exit {exit_code}): pytest did not finish", {}
    try:
        cases = parse_junit(report)
    except ReportError as e:
        return Verdict.FAILED, str(e), {}
    summary: dict[str, int] = {}
    for _, _, outcome in cases:
        key = {"error": "errors"}.get(outcome, outcome)
        summary[key] = summary.get(key, 0) + 1
    got: dict[tuple[str, str], list[str]] = {}
    for cls, name, outcome in cases:
        got.setdefault((cls, name), []).append(outcome)
    want: dict[tuple[str, str], int] = {}
    for tid in test_ids:
        want[junit_key(tid)] = want.get(junit_key(tid), 0) + 1
    missing = [tid for tid in test_ids if junit_key(tid) not in got]
    if missing:
        return (Verdict.FAILED, f"{len(missing)} official test(s) not in the report: "
                f"{', '.join(missing[:3])}", summary)
    if len(cases) != len(test_ids) or any(len(got[k]) != n for k, n in want.items()):
        return (Verdict.FAILED, f"the report has {len(cases)} test(s), the official tests "
                f"are {len(test_ids)}", summary)
    bad = [tid for tid in test_ids if got[junit_key(tid)] != ["passed"]]
    if bad:
        return Verdict.FAILED, f"official tests not passed ({_counts(summary)})", summary
    if exit_code != 0:
        return (Verdict.FAILED, f"the report says passed but the run exited {exit_code}",
                summary)
    return Verdict.PASSED, f"tests passed ({_counts(summary)})", summary


# ---- the task

DEFAULT_TIME_LIMIT_S = 1800.0  # the paper's suite limit: a value to declare, not a default


@dataclass(frozen=True)
class Task:
    """One grading task. `image`: the task image (pin it by digest in production: the image
    is set, not probed); `repo`: the repository's absolute path in it, checked out at
    `base_commit`; `test_files`: the official test files, paths relative to `repo`, restored
    from the base commit before every run; `test_command`: run in `repo` (default
    `python3 -m pytest -q -p no:cacheprovider <test_files>`), read as pytest's exit status;
    `reference_patch`: the known fix (preflight: must pass); `time_limit_s`: the suite's
    declared time limit; `conditions`: passed to acquire as declared run conditions when the
    SDK supports them; `python`: the task's interpreter (the official test ids are collected
    on the base with `<python> -m pytest --collect-only <test_files>`); `plugins`: the pytest
    plugins the suite needs, loaded by name (autoloading is off); `test_ids`: the official
    test ids (pytest node ids), recorded by preflight, collected on the base when None
    (docs/grading.md)."""

    name: str
    image: str
    repo: str
    base_commit: str
    test_files: tuple[str, ...]
    test_command: str | None = None
    reference_patch: bytes | None = None
    time_limit_s: float | None = None  # required: a task without one is refused
    cpu: str = api.DEFAULT_CPU
    memory: str = api.DEFAULT_MEMORY
    egress: str | dict[str, Any] = api.DEFAULT_EGRESS  # or {"allow": [entries]}
    conditions: Any = None
    exclude: Exclusions = field(default=DEFAULT_EXCLUDE)
    python: str = "python3"
    plugins: tuple[str, ...] = ()
    test_ids: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        def bad(msg: str) -> BadRequest:
            return BadRequest(f"task {self.name!r}: {msg}")
        if not self.name or not self.image:
            raise bad("name and image are required")
        if not self.repo.startswith("/"):
            raise bad(f"repo must be an absolute path, not {self.repo!r}")
        if not re.fullmatch(r"[0-9a-f]{7,64}", self.base_commit or ""):
            raise bad(f"base_commit must be a commit hash, not {self.base_commit!r}")
        files = (self.test_files,) if isinstance(self.test_files, str) else self.test_files
        files = tuple(files or ())
        if not files:
            raise bad("test_files: at least one official test file")
        for f in files:
            norm = posixpath.normpath(f)
            if f.startswith("/") or norm == ".." or norm.startswith("../"):
                raise bad(f"test file {f!r} must be relative to repo and inside it")
        object.__setattr__(self, "test_files", files)
        object.__setattr__(self, "plugins", tuple(self.plugins))
        for pl in self.plugins:
            if not re.fullmatch(r"[A-Za-z0-9_.:-]+", pl):
                raise bad(f"plugin {pl!r} must be a module or entry-point name")
        if self.test_ids is not None:
            if isinstance(self.test_ids, str):
                raise bad("test_ids: a list of pytest node ids, not one string")
            object.__setattr__(self, "test_ids", tuple(self.test_ids))
            if not self.test_ids:
                raise bad("test_ids: at least one official test id (or None: collected)")
        try:  # an allowlist canonical here: a bad entry fails before any sandbox
            object.__setattr__(self, "egress", api.canonical_egress(self.egress))
        except ValueError as e:
            raise bad(str(e)) from None
        if isinstance(self.reference_patch, str):
            object.__setattr__(self, "reference_patch", self.reference_patch.encode())
        if self.time_limit_s is None:
            # An undeclared limit let a grader send none: execd's default cut the suite.
            raise bad("time_limit_s: declare the suite's time limit in seconds (none given)")
        if isinstance(self.time_limit_s, bool) or not (
                isinstance(self.time_limit_s, (int, float)) and self.time_limit_s > 0):
            raise bad(f"time_limit_s must be > 0, not {self.time_limit_s!r}")

    @property
    def command(self) -> str:
        if self.test_command:
            return self.test_command
        return ("python3 -m pytest -q -p no:cacheprovider "
                + " ".join(shlex.quote(f) for f in self.test_files))

    def canonical(self) -> bytes:
        """Every field, as canonical JSON (sorted keys, no spaces; bytes as their SHA-256):
        what preflight records, so a field edited afterwards changes the task's hash."""
        return _canonical({f.name: getattr(self, f.name) for f in fields(self)})

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.canonical()).hexdigest()


def _plain(v: Any) -> Any:
    if isinstance(v, Enum):
        return v.value
    if isinstance(v, (bytes, bytearray)):
        return {"sha256": hashlib.sha256(v).hexdigest(), "size": len(v)}
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: _plain(getattr(v, f.name)) for f in fields(v)}
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if v is None or isinstance(v, (str, bool, int)):
        return v
    if isinstance(v, float):
        return int(v) if v.is_integer() else v  # 900 and 900.0 are one limit
    raise TypeError(f"no canonical form for {type(v).__name__}")


def _canonical(v: Any) -> bytes:
    return json.dumps(_plain(v), sort_keys=True, separators=(",", ":"),
                      ensure_ascii=True).encode()


class TaskRefused(BadRequest):
    """grade() or PreflightRecord.load() refused a task or a record (one line, why): a task
    changed since preflight, one preflight did not admit, a record whose SHA-256 is not the
    pinned one. Nothing was graded; never a reward."""


def image_digest_of(task: Task) -> str | None:
    """The task's image digest when known: a field the task carries, or its `@sha256:`."""
    d = getattr(task, "image_digest", None)
    if isinstance(d, str) and d:
        return d
    m = re.search(r"@(sha256:[0-9a-f]{64})$", task.image)
    return m.group(1) if m else None


@dataclass(frozen=True)
class TaskRecord:
    """One task in a preflight record: its name, the SHA-256 of its canonical bytes
    (`Task.sha256`), its image digest when known, whether preflight admitted it, the
    (reference, empty) verdicts of each run graded, and why it was dropped."""

    name: str
    sha256: str
    image_digest: str | None
    admitted: bool
    outcomes: tuple[tuple[str, str], ...] = ()
    reason: str = ""

    @classmethod
    def of(cls, task: Task, *, admitted: bool, outcomes: Iterable[tuple[str, str]] = (),
           reason: str = "") -> TaskRecord:
        return cls(task.name, task.sha256, image_digest_of(task), admitted,
                   tuple((str(r), str(e)) for r, e in outcomes), reason)


@dataclass(frozen=True)
class PreflightRecord:
    """What preflight found, chained by SHA-256: `sha256` is the hash of `canonical()`,
    the bytes `save()` writes. A job pins that hash (its config, next to its prompts) and
    `load(path, sha256)` refuses any other file; `grade(..., record=)` refuses a task the
    record does not hold as admitted with the same hash (docs/grading.md "The record")."""

    tasks: tuple[TaskRecord, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "tasks", tuple(self.tasks))
        names = [t.name for t in self.tasks]
        if len(set(names)) != len(names):
            raise TaskRefused("preflight record: a task name appears twice")

    def canonical(self) -> bytes:
        return _canonical({"version": 1, "tasks": list(self.tasks)})

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.canonical()).hexdigest()

    def save(self, path: str | os.PathLike[str]) -> str:
        """Write the canonical bytes (so `sha256sum path` is `self.sha256`); the hash."""
        Path(path).write_bytes(self.canonical())
        return self.sha256

    @classmethod
    def load(cls, path: str | os.PathLike[str], sha256: str) -> PreflightRecord:
        """The record at `path`, refused unless its bytes hash to `sha256` (the pinned one)."""
        data = Path(path).read_bytes()
        got = hashlib.sha256(data).hexdigest()
        if got != sha256.lower():
            raise TaskRefused(f"preflight record {path}: its SHA-256 is {got}, the job pinned "
                              f"{sha256}")
        try:
            d = json.loads(data)
            rec = cls(tuple(TaskRecord(t["name"], t["sha256"], t["image_digest"],
                                       t["admitted"], tuple(tuple(o) for o in t["outcomes"]),
                                       t["reason"]) for t in d["tasks"]))
        except (ValueError, KeyError, TypeError) as e:
            raise TaskRefused(f"preflight record {path}: unreadable ({e})") from None
        if d.get("version") != 1 or rec.canonical() != data:
            raise TaskRefused(f"preflight record {path}: not a canonical version 1 record")
        return rec

    def check(self, task: Task) -> str | None:
        """None when preflight admitted this very task; else why not (one line)."""
        got = next((t for t in self.tasks if t.name == task.name), None)
        if got is None:
            return f"task {task.name!r} is not in the preflight record {self.sha256[:12]}"
        if got.sha256 != task.sha256:
            return (f"task {task.name!r} changed since preflight: its definition hashes to "
                    f"{task.sha256[:12]}, the record {self.sha256[:12]} holds {got.sha256[:12]}")
        if not got.admitted:
            return (f"task {task.name!r} was not admitted by preflight "
                    f"({got.reason or 'dropped'})")
        return None


# ---- results

@dataclass(frozen=True)
class GradeResult:
    """`verdict` with `reason` (one line). `exit_code`, `summary` (pytest's final counts,
    e.g. {"passed": 3}) and `output` (the run's tail) are from the last attempt that ran the
    suite (`summary` is counted from the run's JUnit report). `attempts`: pods used;
    `infra_errors`: why earlier attempts gave no verdict; `excluded`: what was kept out of the
    patch when it was applied; `suspicious`: what the static scan of the patch's added lines
    found (runner internals, `sys.modules` rewrites: audit or zero them); `test_ids`: the
    official test ids the verdict checked; `shadow`: see docs/grading.md "Shadow grading"."""

    verdict: Verdict
    reason: str
    exit_code: int | None = None
    summary: dict[str, int] = field(default_factory=dict)
    output: str = ""
    attempts: int = 0
    infra_errors: tuple[str, ...] = ()
    excluded: tuple[Excluded, ...] = ()
    pods: tuple[str, ...] = ()
    duration_s: float = 0.0
    suspicious: tuple[str, ...] = ()
    test_ids: tuple[str, ...] = ()
    # Graded again on a never-used pod after a reused pod's verdict: "agree" or "contradict"
    # (the reused pod retired; this result is the never-used pod's); None: not shadowed.
    shadow: str | None = None

    @property
    def passed(self) -> bool:
        return self.verdict is Verdict.PASSED


@dataclass(frozen=True)
class PreflightResult:
    """`kept`: the tasks whose reference patch passed and whose empty patch failed;
    `dropped`: (task, why) for the others; `results`: name -> (reference, empty) of the
    first run; `record`: every task's hash and outcomes, to save and pin by its SHA-256."""

    kept: list[Task]
    dropped: list[tuple[Task, str]]
    results: dict[str, tuple[GradeResult, GradeResult | None]]
    record: PreflightRecord = field(default_factory=lambda: PreflightRecord(()))


# ---- verdicts from a suite's run

OUTPUT_TAIL = 4000


def _counts(summary: dict[str, int]) -> str:
    return ", ".join(f"{v} {k}" for k, v in summary.items()) or "no tests ran"


# ---- which errors are the infrastructure's

# The caller's own configuration: retrying cannot help and no_verdict would hide it.
CALLER_ERRORS = (BadRequest, Unauthenticated, Forbidden)


def is_infra(exc: BaseException) -> bool:
    """Every SDK error but the caller's own (bad request, no token, no RBAC): a pod lost,
    execd unreachable or answering 401 as another pod, an acquire timeout, the controller's
    5xx, a broken frame."""
    return isinstance(exc, SandmanError) and not isinstance(exc, CALLER_ERRORS)


# git apply's messages for a patch that does not fit the base: the agent's fault, a failure.
APPLY_REFUSALS = ("patch failed", "does not apply", "corrupt patch", "No valid patches",
                  "already exists in working directory", "does not exist in index",
                  "patch fragment without header", "unrecognized input",
                  "git diff header lacks filename", "bad git-diff", "has type",
                  "No such file or directory", "while searching for", "garbage")


# git apply's refusals of a path a patch may not write (git checks them before the grader's
# own rule can): the patch is refused.
APPLY_PATH_REFUSALS = ("invalid path", "beyond a symbolic link", "appears as both a file",
                       "Not a directory", "invalid mode")


# A patch longer than this is failed before it is sent (execd's request cap, 96 MiB by default,
# would refuse it as the caller's error): real fixes are kilobytes; a generated blob is not one.
MAX_PATCH_BYTES = 32 << 20

# git apply's fatal refusals (exit 128) of input that is no readable patch: the agent's too.
# Only these: exit 128 is also git's for a broken repository, which is no verdict.
APPLY_UNREADABLE = ("corrupt patch", "No valid patches", "patch fragment without header",
                    "git diff header lacks filename", "unrecognized input")


def apply_refused(stderr: str, exit_code: int = 1) -> bool:
    """Whether git apply's exit and message say the patch is at fault (a failure)."""
    if exit_code == 1:
        return any(s in stderr for s in APPLY_REFUSALS)
    return exit_code == 128 and any(s in stderr for s in APPLY_UNREADABLE)


def tail(text: str, n: int = OUTPUT_TAIL) -> str:
    return text if len(text) <= n else text[-n:]


def _unquote(p: bytes) -> str:
    if p.startswith(b'"') and p.endswith(b'"'):  # git's C-style quoting
        p = p[1:-1].decode("unicode_escape").encode("latin-1")
    return p.decode("utf-8", "surrogateescape")


def patch_paths(patch: bytes) -> list[str]:
    """The paths a git patch touches (old and new names), for reporting what was excluded."""
    out: list[str] = []
    for line in patch.split(b"\n"):
        if line.startswith((b"--- ", b"+++ ")):
            p = line[4:].split(b"\t")[0]
            if p != b"/dev/null":
                q = _unquote(p)
                out.append(q[2:] if q[:2] in ("a/", "b/") else q)
        elif line.startswith((b"rename from ", b"rename to ", b"copy from ", b"copy to ")):
            out.append(_unquote(line.split(b" ", 2)[2]))
        elif line.startswith(b"diff --git "):
            rest = line[11:]
            n = (len(rest) - 5) // 2
            if not rest.startswith(b'"') and n > 0 and rest[2:2 + n] == rest[5 + n:]:
                out.append(_unquote(rest[2:2 + n]))
    return list(dict.fromkeys(out))


def parse_status_z(data: bytes) -> list[str]:
    """Paths from `git status --porcelain=v1 -z` (a rename's second field is its source;
    `!!` ignored files included when asked for)."""
    out, parts, i = [], data.split(b"\0"), 0
    while i < len(parts):
        entry = parts[i]
        i += 1
        if len(entry) < 4:
            continue
        out.append(entry[3:].decode("utf-8", "surrogateescape"))
        if entry[:1] in (b"R", b"C"):
            i += 1
    return out


def parse_name_status_z(data: bytes) -> list[tuple[str, str]]:
    """(status letter, path) from `git diff --name-status -z --no-renames`."""
    parts = data.split(b"\0")
    out = []
    for i in range(0, len(parts) - 1, 2):
        if parts[i]:
            out.append((parts[i][:1].decode(), parts[i + 1].decode("utf-8", "surrogateescape")))
    return out


def pytest_env(addopts: list[str]) -> str:
    """Shell commands setting the test process's environment, which the patch cannot touch:
    the grader's own PYTEST_ADDOPTS (the base's configuration, the report), plugin
    autoloading off, safe-path mode (3.11+: the current directory is not put on sys.path),
    no user site, no bytecode, and pytest's other environment knobs unset."""
    return ("export PYTEST_ADDOPTS=" + shlex.quote(" ".join(shlex.quote(a) for a in addopts))
            + " PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 PYTHONSAFEPATH=1 PYTHONNOUSERSITE=1"
            " PYTHONDONTWRITEBYTECODE=1; unset PYTEST_PLUGINS PYTHONSTARTUP PYTHONINSPECT"
            " PYTEST_THEME PYTEST_DEBUG")


GIT_VAR = "SANDMAN_GIT"  # the git binary, resolved once per sandbox (git_env sets it)
# Attributes that make `git add` or `git diff` convert, filter or reinterpret a file: back to
# git's defaults for every path ($GIT_DIR/info/attributes outranks every .gitattributes).
NEUTRAL_ATTRIBUTES = "* !text !eol !crlf !ident !filter !diff !merge !working-tree-encoding\n"


def git(*args: str) -> str:
    """A git command line for a grading step, run after `git_env` (a fresh process): the
    binary resolved once ($SANDMAN_GIT: unset, the step fails instead of finding a `git` on
    PATH), hooks and fsmonitor off, no attributes file of the user, plain paths, no color;
    and git's "dubious ownership" refusal off (the image's owner need not be the pod's
    user). Diffs add --no-ext-diff --no-textconv themselves."""
    return (f'"${GIT_VAR}" -c safe.directory=\'*\' -c core.quotepath=off -c color.ui=false '
            "-c core.hooksPath=/dev/null -c core.fsmonitor=false "
            "-c core.attributesFile=/dev/null -c core.autocrlf=false "
            + " ".join(args))


def git_env(git_bin: str) -> str:
    """Shell lines starting a grading step's git: every GIT_* variable unset, no system or
    global configuration (HOME too, for a git older than GIT_CONFIG_GLOBAL), no system
    attributes, and the resolved binary in $SANDMAN_GIT."""
    return ('for __v in ${!GIT_*}; do unset "$__v"; done; unset __v; '
            "export GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL=/dev/null GIT_ATTR_NOSYSTEM=1 "
            f"HOME=/nonexistent XDG_CONFIG_HOME=/nonexistent {GIT_VAR}={shlex.quote(git_bin)}")


__all__ = [
    "RUNNER_CONFIG_FILES", "RUNNER_MODULES", "RUNNER_PACKAGES", "STARTUP_HOOKS",
    "CALLER_ERRORS", "DEFAULT_EXCLUDE", "NO_EXCLUDE", "CapturedPatch", "Excluded",
    "Exclusions", "GradeResult", "PreflightRecord", "PreflightResult", "Task", "TaskRecord",
    "TaskRefused", "Verdict",
    "is_infra", "judge", "parse_junit", "runner_refusal",
    "scan_patch", "sections", "sections_changed",
]
