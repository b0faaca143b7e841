"""The I/O-free half of grading (docs/grading.md), shared by the sync and async twins: the task
model, the verdicts, which files a patch may not carry, how a suite's exit status becomes a
verdict, and which failures are the infrastructure's (retried, never scored 0)."""

from __future__ import annotations

import fnmatch
import posixpath
import re
import shlex
from dataclasses import dataclass, field
from enum import Enum
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


# ---- the task

DEFAULT_TIME_LIMIT_S = 1800.0


@dataclass(frozen=True)
class Task:
    """One grading task. `image`: the task image (pin it by digest in production: the image
    is set, not probed); `repo`: the repository's absolute path in it, checked out at
    `base_commit`; `test_files`: the official test files, paths relative to `repo`, restored
    from the base commit before every run; `test_command`: run in `repo` (default
    `python3 -m pytest -q -p no:cacheprovider <test_files>`), read as pytest's exit status;
    `reference_patch`: the known fix (preflight: must pass); `time_limit_s`: the suite's
    declared time limit; `conditions`: passed to acquire as declared run conditions when the
    SDK supports them (docs/grading.md)."""

    name: str
    image: str
    repo: str
    base_commit: str
    test_files: tuple[str, ...]
    test_command: str | None = None
    reference_patch: bytes | None = None
    time_limit_s: float = DEFAULT_TIME_LIMIT_S
    cpu: str = api.DEFAULT_CPU
    memory: str = api.DEFAULT_MEMORY
    egress: str = api.DEFAULT_EGRESS
    conditions: Any = None
    exclude: Exclusions = field(default=DEFAULT_EXCLUDE)

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
        if isinstance(self.reference_patch, str):
            object.__setattr__(self, "reference_patch", self.reference_patch.encode())
        if isinstance(self.time_limit_s, bool) or not (
                isinstance(self.time_limit_s, (int, float)) and self.time_limit_s > 0):
            raise bad(f"time_limit_s must be > 0, not {self.time_limit_s!r}")

    @property
    def command(self) -> str:
        if self.test_command:
            return self.test_command
        return ("python3 -m pytest -q -p no:cacheprovider "
                + " ".join(shlex.quote(f) for f in self.test_files))


# ---- results

@dataclass(frozen=True)
class GradeResult:
    """`verdict` with `reason` (one line). `exit_code`, `summary` (pytest's final counts,
    e.g. {"passed": 3}) and `output` (the run's tail) are from the last attempt that ran the
    suite. `attempts`: pods used; `infra_errors`: why earlier attempts gave no verdict;
    `excluded`: what was kept out of the patch when it was applied."""

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

    @property
    def passed(self) -> bool:
        return self.verdict is Verdict.PASSED


@dataclass(frozen=True)
class PreflightResult:
    """`kept`: the tasks whose reference patch passed and whose empty patch failed;
    `dropped`: (task, why) for the others; `results`: name -> (reference, empty)."""

    kept: list[Task]
    dropped: list[tuple[Task, str]]
    results: dict[str, tuple[GradeResult, GradeResult | None]]


# ---- verdicts from a suite's run

OUTPUT_TAIL = 4000
_SUMMARY_WORDS = re.compile(
    r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected|warnings?|rerun)\b")
_SUMMARY_TIME = re.compile(r"\bin \d+(?:\.\d+)?s\b")


def parse_summary(output: str) -> dict[str, int] | None:
    """pytest's final counts ("1 failed, 2 passed in 0.05s", with or without the `=` rule);
    {} for "no tests ran"; None when there is no summary line (not pytest, or cut off)."""
    for line in reversed(output.splitlines()):
        s = line.strip().strip("=").strip()
        if not _SUMMARY_TIME.search(s):
            continue
        counts: dict[str, int] = {}
        for n, word in _SUMMARY_WORDS.findall(s):
            key = {"error": "errors", "warning": "warnings"}.get(word, word)
            counts[key] = counts.get(key, 0) + int(n)
        if counts or s.startswith("no tests ran"):
            return counts
    return None


class Outcome(NamedTuple):
    verdict: Verdict
    reason: str
    infra: bool  # True: retry on another pod (no_verdict for now)


def classify(exit_code: int, error: str | None, output: str) -> Outcome:
    """pytest's exit status as a verdict (paper, misread exit codes). Only statuses that
    the agent's change decides are verdicts; everything else is no verdict:
    0 passed (with a summary that has a passed test and no failure), 1 tests failed and 2
    interrupted (pytest ends a session with collection errors so: the patch broke an import)
    are failures only with pytest's summary line present (else `python3 -m pytest` itself
    failed, e.g. no pytest); 5 no tests collected from the restored official tests is a
    failure (the patch made them uncollectable or skipped; preflight has shown they collect);
    3 internal error, 4 usage error (the task's command or files), -1 and 128+N (a killed
    pod, a killed process) and execd's errors are no verdict."""
    summary = parse_summary(output)
    if error:
        return Outcome(Verdict.NO_VERDICT, f"execd: {error}", True)
    if exit_code == 0:
        if summary is None:
            return Outcome(Verdict.NO_VERDICT, "exit 0 without a pytest summary line", True)
        if summary.get("failed", 0) or summary.get("errors", 0):
            return Outcome(Verdict.NO_VERDICT, f"exit 0 but the summary has failures: "
                           f"{summary}", True)
        if not summary.get("passed", 0):
            return Outcome(Verdict.FAILED, f"no test passed ({_counts(summary)})", False)
        return Outcome(Verdict.PASSED, f"tests passed ({_counts(summary)})", False)
    if exit_code in (1, 2):
        if summary is None:
            return Outcome(Verdict.NO_VERDICT, f"exit {exit_code} without a pytest summary "
                           "line: the test command did not run pytest", True)
        what = "tests failed" if exit_code == 1 else "interrupted (collection errors)"
        return Outcome(Verdict.FAILED, f"{what} ({_counts(summary)})", False)
    if exit_code == 5:
        return Outcome(Verdict.FAILED, "no tests collected from the official test files",
                       False)
    if exit_code == 3:
        return Outcome(Verdict.NO_VERDICT, "pytest internal error (exit 3)", True)
    if exit_code == 4:
        return Outcome(Verdict.NO_VERDICT, "pytest usage error (exit 4): the task's test "
                       "command or files are wrong", False)
    if exit_code < 0 or exit_code > 128:
        return Outcome(Verdict.NO_VERDICT, f"killed (exit {exit_code})", True)
    return Outcome(Verdict.NO_VERDICT, f"exit {exit_code} is not a pytest status", True)


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


def apply_refused(stderr: str) -> bool:
    return any(s in stderr for s in APPLY_REFUSALS)


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
        elif line.startswith(b"diff --git "):
            rest = line[11:]
            n = (len(rest) - 5) // 2
            if not rest.startswith(b'"') and n > 0 and rest[2:2 + n] == rest[5 + n:]:
                out.append(_unquote(rest[2:2 + n]))
    return list(dict.fromkeys(out))


def parse_status_z(data: bytes) -> list[str]:
    """Paths from `git status --porcelain=v1 -z` (a rename's second field is its source)."""
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


def git(*args: str) -> str:
    """A git command line that ignores the repository's config tricks that change output:
    an external diff driver, textconv, quoted paths, color; and git's "dubious ownership"
    refusal (the image's owner need not be the pod's user)."""
    return ("git -c safe.directory='*' -c core.quotepath=off -c color.ui=false "
            + " ".join(args))


__all__ = [
    "CALLER_ERRORS", "DEFAULT_EXCLUDE", "NO_EXCLUDE", "CapturedPatch", "Excluded",
    "Exclusions", "GradeResult", "Outcome", "PreflightResult", "Task", "Verdict",
    "classify", "is_infra", "parse_summary", "sections", "sections_changed",
]
