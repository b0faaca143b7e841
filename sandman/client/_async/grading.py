"""Grading: capture an agent's patch, grade it on a never-used grading pod, preflight a task set.

`sandman/client/_async/grading.py` is the source of both twins (`tools/gen_sync.py`);
the I/O-free half (task model, verdicts, exclusions, exit statuses) is `_grading.py`.
docs/grading.md has the model and the invariants."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import logging
import posixpath
import random
import shlex
import time
import uuid
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from sandman import contract, tracing
from sandman.client._grading import (
    APPLY_PATH_REFUSALS,
    DEFAULT_EXCLUDE,
    MAX_PATCH_BYTES,
    MAX_REPORT,
    NEUTRAL_ATTRIBUTES,
    CapturedPatch,
    Excluded,
    Exclusions,
    GradeResult,
    PreflightRecord,
    PreflightResult,
    Task,
    TaskRecord,
    TaskRefused,
    Verdict,
    apply_refused,
    config_candidates,
    config_copy_name,
    config_matches,
    config_pythonpath,
    git,
    git_env,
    import_refusal,
    is_infra,
    judge,
    packages,
    parse_name_status_z,
    parse_raw_z,
    parse_status_z,
    parse_tree_z,
    patch_paths,
    path_refusal,
    pytest_env,
    runner_refusal,
    scan_patch,
    sections_changed,
    shipped_modules,
    tail,
    write_refusal,
)
from sandman.client.errors import CommandTimeout, FileNotFound, ImageChanged, SandmanError

if TYPE_CHECKING:
    from sandman.client.models import ExecResult

    from .client import AsyncClient
    from .sandbox import AsyncSandbox

log = logging.getLogger("sandman.client.grading")

GRADING_ROLE = "grading"
COLLECT_PLUGIN = "sandman_grading_collect"
HEALTH_WAIT_S = 1.0  # after a dead shell: a deleted pod's execd is gone by then
STEP_TIMEOUT_S = 120.0  # git steps; the suite has the task's own time limit
MAX_OUTPUT = 1 << 20
# The share of verdicts on reused grading pods graded again on a never-used pod (0: none).
SHADOW_SHARE = 0.03


def _takes(fn: Any, name: str) -> bool:
    """Whether a call accepts keyword `name` (the SDK grows role=, conditions=, reuse=)."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _tmpdir() -> str:
    return f"/tmp/sandman-grading-{uuid.uuid4().hex[:12]}"


# The git binary of each sandbox, resolved once by its first grading step.
_GIT_BINS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


async def _git_bin(sb: AsyncSandbox) -> str:
    got = _GIT_BINS.get(sb)
    if got is None:
        # A fresh process: PATH is execd's start environment's, never the holder's.
        r = await sb.exec("command -v git", fresh=True, cwd="/", timeout=STEP_TIMEOUT_S)
        got = r.output.strip()
        if r.error or r.exit_code != 0 or not got.startswith("/") or "\n" in got:
            raise _StepFailed(f"no git on the image's PATH: exit {r.exit_code}: "
                              f"{tail(r.output, 300).strip()}")
        _GIT_BINS[sb] = got
    return got


async def _step(sb: AsyncSandbox, cmd: str, *, cwd: str = "/",
                timeout: float = STEP_TIMEOUT_S, uses_git: bool = True) -> ExecResult:
    """One grading step, in a process execd starts fresh for it (never the holder's shell:
    docs/grading.md, "Where each step runs"), stderr with stdout; with `uses_git`, after
    git_env. The ExecResult; CommandTimeout raises."""
    pre = f"{git_env(await _git_bin(sb))}; " if uses_git else ""
    return await sb.exec(f"{pre}{{ {cmd}\n}} 2>&1", fresh=True, cwd=cwd, timeout=timeout,
                         max_output=MAX_OUTPUT)


async def _run(sb: AsyncSandbox, cmd: str, what: str, timeout: float = STEP_TIMEOUT_S,
               *, cwd: str = "/") -> str:
    """A grading step that must succeed; its failure is the infrastructure's (or the task's)."""
    r = await _step(sb, cmd, cwd=cwd, timeout=timeout)
    if r.error or r.exit_code != 0:
        raise _StepFailed(f"{what}: exit {r.exit_code}"
                          f"{', ' + r.error if r.error else ''}: {tail(r.output, 600).strip()}")
    return r.output


def _limit(task: Task) -> float:
    """The suite's declared time limit: execd's timeout of its run (Task refuses none)."""
    assert task.time_limit_s is not None
    return float(task.time_limit_s)


class _StepFailed(SandmanError):
    """A setup step of a grading failed without being the agent's fault: no verdict."""


# ---- capture

async def capture_patch(sandbox: AsyncSandbox, base_commit: str, *, repo: str = ".",
                        exclude: Exclusions = DEFAULT_EXCLUDE) -> CapturedPatch:
    """The agent's change in `repo` against `base_commit`, as `git diff --binary` bytes
    (new files included, ignored files not), without test configuration (`exclude`).

    Every git step runs in a fresh process (not the agent's shell) with a git directory of
    the grader's own: the repository's objects borrowed through alternates, its config,
    hooks and attributes files never read. The index is set to the base there, everything
    is staged and diffed: commits the agent made count, and the agent's own index and HEAD
    are left as they were. A relative `repo` is the shell's cwd's. Returns (patch,
    excluded)."""
    t = _tmpdir()
    q = shlex.quote
    base = q(base_commit)
    g = f"{t}/git"
    if not repo.startswith("/"):
        cwd = (await sandbox.state()).cwd
        if not cwd:
            raise _StepFailed(f"capture: repo {repo!r} is relative and the shell has no cwd")
        repo = posixpath.normpath(posixpath.join(cwd, repo))
    # After the set-up: the grader's git directory over the agent's work tree.
    env = (f"set -e; export GIT_DIR={q(g)} GIT_INDEX_FILE={q(g + '/index')} "
           f"GIT_WORK_TREE=\"$(<{q(t + '/top')})\"; cd -- \"$GIT_WORK_TREE\"")
    try:
        await _run(sandbox, (
            f"set -e; rm -rf -- {q(t)}; mkdir -p -- {q(t)}; "
            f"top=$({git('rev-parse', '--show-toplevel')}); "
            f"objs=$(cd -- \"$({git('rev-parse', '--git-path', 'objects')})\" && pwd -P); "
            f"excl=$({git('rev-parse', '--git-path', 'info/exclude')}"
            f" 2>/dev/null || true); "
            f"{git('init', '-q', '--bare', '--template=', q(g))} >/dev/null; "
            f"printf '%s\\n' \"$objs\" > {q(g + '/objects/info/alternates')}; "
            f"mkdir -p -- {q(g + '/info')}; "
            f"printf %s {q(NEUTRAL_ATTRIBUTES)} > {q(g + '/info/attributes')}; "
            # The agent's own ignore list is patterns, nothing that runs: kept.
            f"if [ -n \"$excl\" ] && [ -f \"$excl\" ] && [ ! -L \"$excl\" ]; then "
            f"cat -- \"$excl\" > {q(g + '/info/exclude')}; fi; "
            f"printf %s \"$top\" > {q(t + '/top')}; {env}; "
            f"{git('rev-parse', '-q', '--verify', q(base_commit + '^{commit}'))} >/dev/null "
            f"|| {{ echo 'base commit {base_commit} is not in this repository'; exit 3; }}; "
            f"{git('read-tree', base)}; {git('add', '-A')}; "
            f"{git('diff', '--cached', '--name-status', '-z', '--no-renames', base)} "
            f"> {q(t + '/names')}"), "capture: stage the changes", cwd=repo)
        names = parse_name_status_z(await sandbox.read(f"{t}/names"))
        excluded: list[Excluded] = []
        candidates: list[tuple[int, str, str]] = []
        for status, path in names:
            if exclude.file_excluded(path):
                excluded.append(Excluded(path, "test configuration file"))
            elif exclude.section_names(path):
                candidates.append((len(candidates), status, path))
        if candidates:
            cmds = []
            for i, status, path in candidates:
                if status != "A":
                    cmds.append(f"{git('show', q(base_commit + ':' + path))} > {q(f'{t}/base.{i}')}")
                if status != "D":
                    cmds.append(f"{git('show', q(':' + path))} > {q(f'{t}/new.{i}')}")
            await _run(sandbox, f"{env}; " + "; ".join(cmds),
                       "capture: read configuration files")
            for i, status, path in candidates:
                before = None if status == "A" else await sandbox.read(f"{t}/base.{i}")
                after = None if status == "D" else await sandbox.read(f"{t}/new.{i}")
                secs = exclude.section_names(path)
                if sections_changed(before, after, secs):
                    excluded.append(Excluded(path, f"changes its test section(s) "
                                                   f"{', '.join('[' + s + ']' for s in secs)}"))
        # What grade() would refuse is left out here, so the agent's side says so.
        tree = await _base_tree(sandbox, env, base_commit, t)
        left = {e.path for e in excluded}
        excluded.extend(Excluded(p, why) for p, why in
                        await _write_refusals(sandbox, env, base_commit, t, tree)
                        if p not in left)
        resets = [f"{git('reset', '-q', base, '--', q(':(literal)' + e.path))}"
                  for e in excluded]
        for chunk in _chunks(resets):
            await _run(sandbox, f"{env}; {chunk}", "capture: leave out excluded files")
        await _run(sandbox, (
            f"{env}; "
            f"{git('diff', '--cached', '--binary', '--no-renames', '--no-ext-diff', '--no-textconv', '--no-color', base)}"
            f" > {q(t + '/patch')}"), "capture: diff")
        patch = await sandbox.read(f"{t}/patch")
    finally:
        try:
            await _step(sandbox, f"rm -rf -- {q(t)}", timeout=60, uses_git=False)
        except SandmanError as e:
            log.info("capture: could not remove %s: %s", t, e)
    return CapturedPatch(patch, excluded)


def _chunks(cmds: list[str], limit: int = 32 << 10) -> list[str]:
    """Commands joined with "; " into lines of at most about `limit` bytes (a fresh
    command is one argument of bash -c)."""
    out: list[str] = []
    for c in cmds:
        if out and len(out[-1]) + len(c) + 2 <= limit:
            out[-1] += "; " + c
        else:
            out.append(c)
    return out


# ---- grade

async def _acquire(client: AsyncClient, task: Task, job: str, timeout_s: float,
                   namespace: str | None, reuse: bool = False) -> AsyncSandbox:
    kw: dict[str, Any] = {"job": job, "cpu": task.cpu, "memory": task.memory,
                          "egress": task.egress, "timeout_s": timeout_s,
                          "namespace": namespace}
    if _takes(client.acquire, "role"):
        kw["role"] = GRADING_ROLE
        # Without reuse=True a grading runs on a never-used pod, never one a grading ran in.
        if reuse and _takes(client.acquire, "reused_ok"):
            kw["reused_ok"] = True
    if task.conditions is not None:
        if not _takes(client.acquire, "conditions"):
            raise SandmanError(f"task {task.name!r} declares run conditions, but this SDK's "
                               "acquire() takes no conditions: they would not be checked")
        kw["conditions"] = task.conditions
    return await client.acquire(task.image, **kw)


# The digest each task's image had at its first grading through a client (preflight's
# included): a later grading pod of another digest (the tag moved) is refused, never graded.
_DIGESTS: weakref.WeakKeyDictionary[Any, dict[tuple[str, str], str]] = \
    weakref.WeakKeyDictionary()


def _check_image(client: AsyncClient, task: Task, sb: AsyncSandbox) -> None:
    """ImageChanged (one line) when the grading pod's digest is not the task's: the digest of
    `task.image` when pinned, else the one recorded at the task's first grading."""
    pinned = task.image.partition("@")[2] or None
    # A controller that does not say runs a digest reference as given.
    got = getattr(sb, "image_digest", None) or pinned
    seen = _DIGESTS.setdefault(client, {})
    want = pinned or seen.get((task.name, task.image))
    if want is None:
        if got is not None:
            seen[(task.name, task.image)] = got
        return
    if got != want:
        raise ImageChanged(
            f"task {task.name!r}: the grading pod's image {task.image} is "
            f"{got or 'of an unknown digest'}, not {want} as at the task's preflight or first "
            "grading (the tag moved): refused, not graded; preflight the task again")


async def _finish(client: AsyncClient, sb: AsyncSandbox, verdict: Verdict, reuse: bool) -> None:
    """Give the pod back: a verdict on a reuse request returns it to its pool (checked
    reuse); no verdict retires it (paper: a pod with a grading without verdict may be
    defective); otherwise it is deleted. Never raises: the verdict stands."""
    try:
        if verdict is Verdict.NO_VERDICT and reuse and hasattr(sb, "retire"):
            await sb.retire()
        elif reuse and verdict is not Verdict.NO_VERDICT and _takes(sb.release, "reuse"):
            await sb.release(reuse=True)
        else:
            await sb.release()
    except SandmanError as e:
        log.info("grading: releasing sandbox %s failed: %s", sb.id, e)


class _Config(NamedTuple):
    path: str  # for -c
    rootdir: str | None  # None: pytest's own (the configuration's directory)
    original: str | None  # the repository path passed as it is (the pytest.toml pair)
    roots: tuple[str, ...]  # its pythonpath entries, repository paths


async def _base_config(sb: AsyncSandbox, task: Task, t: str) -> _Config:
    """The base's pytest configuration, as pytest would find it for the official tests, read
    from the base commit and written next to the original under a name of the grader's (a
    patch cannot know or write it): pytest resolves its path options (pythonpath, the
    default rootdir and confcutdir) against that directory, as it does in the repository.
    Without one, an empty pytest.ini outside it and the repository as the rootdir."""
    q = shlex.quote
    cands = config_candidates(task.test_files)
    cmds = "; ".join(f"{git('show', q(task.base_commit + ':' + c))} > {q(f'{t}/cand.{i}')}"
                     f" 2>/dev/null && echo {i}" for i, c in enumerate(cands))
    out = await _run(sb, f"cd -- {q(task.repo)}; {cmds}; true", "find the base's configuration")
    for i in sorted(int(x) for x in out.split() if x.isdigit()):
        data = await sb.read(f"{t}/cand.{i}")
        if config_matches(cands[i], data):
            roots = tuple(config_pythonpath(cands[i], data))
            name = config_copy_name(cands[i], uuid.uuid4().hex[:12])
            if name is None:
                return _Config(posixpath.join(task.repo, cands[i]), None, cands[i], roots)
            await sb.write(posixpath.join(task.repo, name), data)
            return _Config(posixpath.join(task.repo, name), None, None, roots)
    await sb.write(f"{t}/cfg/pytest.ini", b"[pytest]\n")
    return _Config(f"{t}/cfg/pytest.ini", task.repo, None, ())


def _addopts(task: Task, cfg: _Config) -> list[str]:
    plugins = [a for p in task.plugins for a in ("-p", p)]
    where = ([] if cfg.rootdir is None else
             [f"--rootdir={cfg.rootdir}", f"--confcutdir={cfg.rootdir}"])
    return ["-p", "no:cacheprovider", "-c", cfg.path, *where, *plugins]


async def _base_tree(sb: AsyncSandbox, prefix: str, base: str, t: str) -> dict[str, str]:
    await _run(sb, f"{prefix}; {git('ls-tree', '-r', '-z', '--full-tree', shlex.quote(base))}"
                   f" > {shlex.quote(t + '/tree')}", "list the base's tree")
    return parse_tree_z(await sb.read(f"{t}/tree"))


async def _ignored(sb: AsyncSandbox, prefix: str, base: str, t: str, tree: dict[str, str],
                   paths: list[str]) -> set[str]:
    """Which of `paths` the base's ignore rules ignore, as git computes them: the base
    commit's .gitignore files (never the work tree's, which the agent may have changed),
    the repository's info/exclude."""
    if not paths:
        return set()
    q = shlex.quote
    ign = f"{t}/ign"
    script = [f"mkdir -p -- {q(ign)}"]
    for p, mode in tree.items():
        if posixpath.basename(p) == ".gitignore" and mode in ("100644", "100755"):
            script.append(f"mkdir -p -- {q(posixpath.dirname(f'{ign}/{p}'))} && "
                          f"{git('show', q(base + ':' + p))} > {q(f'{ign}/{p}')}")
    await sb.write(f"{t}/ign.sh", ("\n".join(script) + "\n").encode("utf-8", "surrogateescape"))
    await sb.write(f"{t}/added", b"".join(p.encode("utf-8", "surrogateescape") + b"\0"
                                          for p in paths))
    await _run(sb, (
        f"{prefix}; gd=$({git('rev-parse', '--absolute-git-dir')}); . {q(t + '/ign.sh')}; "
        f"cd -- {q(ign)}; GIT_DIR=\"$gd\" GIT_WORK_TREE=. "
        f"{git('check-ignore', '--no-index', '-z', '--stdin')} < {q(t + '/added')} "
        f"> {q(t + '/ignored')} || [ $? -eq 1 ]"), "check the base's ignore rules")
    return {p.decode("utf-8", "surrogateescape")
            for p in (await sb.read(f"{t}/ignored")).split(b"\0") if p}


async def _write_refusals(sb: AsyncSandbox, prefix: str, base: str, t: str,
                          tree: dict[str, str], roots: tuple[str, ...] = ()
                          ) -> list[tuple[str, str]]:
    """(path, why) for each change of the index GIT_INDEX_FILE (set in `prefix`) against the
    base that a patch may not make (docs/grading.md, "What a patch may write"): a path
    outside the base's tracked and non-ignored ones, a link or a submodule, a module
    shadowing the standard library or the runner on the import path."""
    q = shlex.quote
    await _run(sb, f"{prefix}; {git('diff-index', '--cached', '-z', '--no-renames', '--ignore-submodules=none', q(base))}"
                   f" > {q(t + '/raw')}", "list the patch's changes")
    changes = parse_raw_z(await sb.read(f"{t}/raw"))
    fresh = [c.path for c in changes if c.status != "D" and c.path not in tree
             and not path_refusal(c.path, tree)]
    ignored = await _ignored(sb, prefix, base, t, tree, fresh)
    after = ({p for p in tree} | {c.path for c in changes}) - {
        c.path for c in changes if c.status == "D"}
    pkgs, shipped = packages(after), shipped_modules(tree)
    out = []
    for c in changes:
        why = write_refusal(c, tree, ignored)
        if why is None and c.status != "D" and runner_refusal(c.path) is None:
            why = import_refusal(c.path, pkgs, shipped, roots)
        if why:
            out.append((c.path, why))
    return out


async def _refusal(sb: AsyncSandbox, task: Task, t: str, patch: bytes,
                   roots: tuple[str, ...]) -> str | None:
    """Why the patch is refused, one line, or None: checked on the base before anything is
    applied, by git's own reading of the patch (applied to an index of the base)."""
    q = shlex.quote
    prefix = f"set -e; cd -- {q(task.repo)}"
    tree = await _base_tree(sb, prefix, task.base_commit, t)
    bad = [(p, why) for p in patch_paths(patch) for why in [path_refusal(p, tree)] if why]
    if not bad:
        idx = f"{t}/check.index"
        await sb.write(f"{t}/check.diff", patch)
        args = " ".join(q(a) for a in
                        ["--cached", "--binary", "--whitespace=nowarn", *task.exclude.apply_args(),
                         *(f"--exclude={f}" for f in task.test_files)])
        out = await _run(sb, (
            f"{prefix}; export GIT_INDEX_FILE={q(idx)}; {git('read-tree', q(task.base_commit))}; "
            f"{{ {git('apply', args, q(t + '/check.diff'))}; }} > {q(t + '/check.out')} 2>&1 "
            f"&& echo applied || true"), "check the patch's paths")
        if "applied" not in out.split():
            msg = (await sb.read(f"{t}/check.out")).decode("utf-8", "replace")
            lines = [ln for ln in msg.splitlines() if any(s in ln for s in APPLY_PATH_REFUSALS)]
            # Any other refusal is the apply step's to report (the agent's patch, failed).
            return lines[0].removeprefix("error: ").strip() if lines else None
        bad = await _write_refusals(sb, f"{prefix}; export GIT_INDEX_FILE={q(idx)}",
                                    task.base_commit, t, tree, roots)
    if not bad:
        return None
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    return f"{bad[0][0]}: {bad[0][1]}{more}"


async def _collect(sb: AsyncSandbox, task: Task, t: str, addopts: list[str]
                   ) -> tuple[str, ...] | str:
    """The official test ids on the base (before any patch): the node ids pytest collects
    from the test files with the grading's own options; or why there are none."""
    q = shlex.quote
    await sb.write(f"{t}/plug/{COLLECT_PLUGIN}.py",
                   Path(__file__).parent.parent.joinpath("_collect_plugin.py").read_bytes())
    ids_file = f"{t}/ids.json"
    opts = [*addopts, "--collect-only", "-p", COLLECT_PLUGIN]
    r = await _step(
        sb, f"{pytest_env(opts)}; export SANDMAN_GRADING_IDS={q(ids_file)} "
        f"PYTHONPATH={q(t + '/plug')}${{PYTHONPATH:+:$PYTHONPATH}}; "
        f"{q(task.python)} -m pytest -q -- {' '.join(q(f) for f in task.test_files)}",
        cwd=task.repo, timeout=max(_limit(task), STEP_TIMEOUT_S), uses_git=False)
    if r.error:
        raise _StepFailed(f"collect the official tests: {r.error}")
    try:
        ids = json.loads(await sb.read(ids_file))
    except (FileNotFound, ValueError):
        ids = None
    if r.exit_code != 0 or not isinstance(ids, list) or not ids or not all(
            isinstance(i, str) for i in ids):
        return (f"task: the official tests do not collect on the base (exit {r.exit_code}): "
                f"{tail(r.output, 600).strip()}")
    return tuple(ids)


async def _grade_on(client: AsyncClient, sb: AsyncSandbox, task: Task, patch: bytes,
                    excluded: list[Excluded], stage: list[str], ids_out: list[str]
                    ) -> tuple[Verdict, str, bool, int | None, dict[str, int], str]:
    """One attempt on one pod: (verdict, reason, infra, exit_code, summary, output).
    SDK errors propagate (the caller decides: infrastructure or the caller's own);
    `stage[0]` names the step running, for the attempt's error; `ids_out` gets the official
    test ids used."""
    stage[0] = "check the base commit"
    q = shlex.quote
    t = _tmpdir()
    base = q(task.base_commit)
    tests = " ".join(q(f) for f in task.test_files)
    ex = task.exclude
    cd = f"cd -- {q(task.repo)}"
    r = await _step(sb, f"set -e; {cd}; "
                        f"{git('rev-parse', '-q', '--verify', q(task.base_commit + '^{commit}'))}"
                        f" >/dev/null")
    if r.error:
        raise _StepFailed(f"check base commit: {r.error}")
    if r.exit_code != 0:
        return (Verdict.NO_VERDICT, f"task: base commit {task.base_commit} or repo "
                f"{task.repo} not in the image: {tail(r.output, 300).strip()}", False,
                None, {}, "")
    # The official tests from the base commit (a never-used pod has them; a reused one too,
    # after its checked restore: this is the grader's own guard).
    stage[0] = "restore the official tests"
    await _run(sb, f"set -e; {cd}; {git('checkout', '-q', base, '--', tests)}; "
                   f"mkdir -p {q(t + '/cfg')} {q(t + '/out')} {q(t + '/plug')}",
               "restore the official tests")
    stage[0] = "find the base's configuration"
    cfg = await _base_config(sb, task, t)
    addopts = _addopts(task, cfg)
    test_ids = task.test_ids
    if test_ids is None:
        stage[0] = "collect the official tests"
        got = await _collect(sb, task, t, addopts)
        if isinstance(got, str):
            return Verdict.NO_VERDICT, got, False, None, {}, ""
        test_ids = got
    ids_out[:] = test_ids
    if len(patch) > MAX_PATCH_BYTES:  # the agent's output: a failure, never an SDK error
        return (Verdict.FAILED, f"patch too large: {len(patch)} bytes, the cap is "
                f"{MAX_PATCH_BYTES}", False, None, {}, "")
    if patch.strip():
        stage[0] = "check the patch's paths"
        why = await _refusal(sb, task, t, patch, cfg.roots)
        if why:
            return Verdict.FAILED, f"patch refused: {why}", False, None, {}, ""
        stage[0] = "apply the patch"
        for path in patch_paths(patch):
            why = runner_refusal(path)
            if path in task.test_files:
                excluded.append(Excluded(path, "official test file (restored from the base)"))
            elif why:
                excluded.append(Excluded(path, why))
            elif ex.file_excluded(path):
                excluded.append(Excluded(path, "test configuration file"))
        await sb.write(f"{t}/patch.diff", patch)
        args = " ".join(q(a) for a in
                        ["--binary", "--whitespace=nowarn", *ex.apply_args(),
                         *(f"--exclude={f}" for f in task.test_files)])
        r = await _step(sb, f"{cd} && {git('apply', args, q(t + '/patch.diff'))}")
        if r.error:
            raise _StepFailed(f"git apply: {r.error}")
        if r.exit_code != 0:
            out = tail(r.output, 1500).strip()
            if apply_refused(out, r.exit_code):
                return (Verdict.FAILED, f"patch does not apply: {out}", False, None, {}, out)
            raise _StepFailed(f"git apply: exit {r.exit_code}: {out}")
        # Every path the patch changed, ignored files included: the runner's own files
        # (start-up hooks, configuration, shadowing modules) go back to the base, whatever
        # the patch's headers said; section-ruled files (setup.cfg, pyproject.toml) too
        # when their test sections changed.
        await _run(sb, f"set -e; {cd}; {git('status', '--porcelain=v1', '-z', '--untracked-files=all', '--ignored=matching')}"
                       f" > {q(t + '/status')}", "list the patched files")
        changed = parse_status_z(await sb.read(f"{t}/status"))
        for path in changed:
            why = runner_refusal(path)
            if why:
                undo = (f"{git('checkout', '-q', base, '--', q(':(literal)' + path))} "
                        f"2>/dev/null || rm -rf -- {q(path)}")
                await _run(sb, f"{cd}; {undo}", f"restore {path}")
                if path not in {e.path for e in excluded}:
                    excluded.append(Excluded(path, why))
        for i, path in enumerate(p for p in changed if ex.section_names(p)):
            r = await _step(sb, f"{cd} && {git('show', q(task.base_commit + ':' + path))} "
                                f"> {q(f'{t}/base.{i}')} 2>/dev/null")
            before = await sb.read(f"{t}/base.{i}") if r.exit_code == 0 else None
            try:
                after = await sb.read(f"{task.repo}/{path}")
            except FileNotFoundError:
                after = None
            if sections_changed(before, after, ex.section_names(path)):
                undo = (git("checkout", "-q", base, "--", q(path)) if before is not None
                        else f"rm -f -- {q(path)}")
                await _run(sb, f"set -e; {cd}; {undo}", f"restore {path}")
                excluded.append(Excluded(path, "changes its test section(s)"))
        # The grader's invariant, checked rather than assumed.
        r = await _step(sb, f"{cd} && {git('diff', '--quiet', '--no-ext-diff', '--no-textconv', base, '--', tests)}")
        if r.error or r.exit_code != 0:
            raise _StepFailed(f"official tests differ from the base after the patch: "
                              f"{r.error or r.output.strip()[:300]}")
    if cfg.original:  # read in place: the grader's invariant, checked
        await _run(sb, f"set -e; {cd}; {git('diff', '--quiet', '--no-ext-diff', base, '--', q(cfg.original))}",
                   "the base's configuration file is the base's")
    stage[0] = "run the suite"
    report = f"{t}/out/report.xml"
    env = pytest_env([*addopts, f"--junitxml={report}"])
    try:
        # A fresh process: when it returns, execd has killed every process it left.
        r = await _step(sb, f"{env}; {task.command}", cwd=task.repo,
                        timeout=_limit(task), uses_git=False)
    except CommandTimeout as e:
        out = tail(e.result.output)
        return (Verdict.FAILED, f"the suite ran past its declared time limit "
                f"({task.time_limit_s:g} s)", False, e.result.exit_code, {}, out)
    out = tail(r.output)
    if r.error:
        # execd answered with an error. Evidence from outside the code under test decides: a
        # pod gone or an execd unreachable raise here (the infrastructure's); a healthy pod
        # and execd leave it to the run (the code under test).
        await asyncio.sleep(HEALTH_WAIT_S)
        if sb.id:
            await client.get(sb.id)
        await _step(sb, "true", uses_git=False)
        return (Verdict.FAILED, f"the suite's run ended in an error (execd: {r.error}) while "
                "the pod and execd stayed healthy", False, r.exit_code, {}, out)
    stage[0] = "read the report"
    data, why = await _report_copy(sb, report)
    if why:
        return Verdict.FAILED, f"{why} (exit {r.exit_code})", False, r.exit_code, {}, out
    verdict, reason, summary = judge(data, tuple(test_ids), r.exit_code)
    return verdict, reason, False, r.exit_code, summary, out


async def _report_copy(sb: AsyncSandbox, report: str) -> tuple[bytes | None, str | None]:
    """The suite's report, read from a copy made now that no process of the suite is left:
    (its bytes or None when there is none, None), or (None, why it is no report: a
    symlink, not a regular file, unreadable). At most MAX_REPORT + 1 bytes are copied."""
    q = shlex.quote
    copy = _tmpdir()
    r = await _step(sb, (
        f"r={q(report)}; c={q(copy)}; mkdir -m 700 -- \"$c\" || exit 70; "
        'if [ -L "$r" ]; then echo "the JUnit report is a symlink"; exit 3; fi; '
        'if [ ! -e "$r" ]; then exit 4; fi; '
        'if [ ! -f "$r" ]; then echo "the JUnit report is not a regular file"; exit 3; fi; '
        f'head -c {MAX_REPORT + 1} -- "$r" > "$c/report.xml" '
        '|| { echo "the JUnit report is unreadable"; exit 3; }'), uses_git=False)
    if r.error or r.exit_code not in (0, 3, 4):
        raise _StepFailed(f"copy the report: exit {r.exit_code}"
                          f"{', ' + r.error if r.error else ''}: {tail(r.output, 300).strip()}")
    if r.exit_code == 3:
        return None, (tail(r.output, 300).strip().splitlines() or ["no JUnit report"])[-1]
    if r.exit_code == 4:
        return None, None
    try:
        return await sb.read(f"{copy}/report.xml"), None
    except FileNotFound:
        return None, None


async def grade(client: AsyncClient, task: Task, patch: bytes | str | None, *,
                job: str = "grading", attempts: int = 3, reuse: bool = False,
                acquire_timeout_s: float = 300.0, retry_backoff_s: float = 1.0,
                namespace: str | None = None, record: PreflightRecord | None = None,
                shadow: float = SHADOW_SHARE) -> GradeResult:
    """Grade `patch` for `task`: a never-used grading pod (or, with `reuse=True`, one the
    controller restored and checked), the official tests restored from the base commit, the
    patch applied without test configuration, the suite run under the task's time limit,
    its JUnit report read against the official test ids.

    passed / failed are verdicts on the patch (failing or missing official tests, a patch
    that does not apply, a suite past its time limit, a crash in a healthy pod). Anything the infrastructure did (pod lost, execd unreachable,
    acquire timeout, a killed run, the controller's 5xx) is retried on a new pod up to
    `attempts` pods in all and then answered as no_verdict: resample, never score 0. The
    caller's own errors (BadRequest, Unauthenticated, Forbidden) raise.

    `record`: the task set's preflight record (PreflightRecord.load, pinned by its SHA-256):
    a task it does not hold as admitted, with the same hash, raises TaskRefused before any
    pod. `shadow`: the share of verdicts on a reused pod (`reuse=True`) graded again on a
    never-used pod; that verdict is returned, and the reused pod is retired when the two
    contradict (docs/grading.md "Shadow grading")."""
    if record is not None:
        why = record.check(task)
        if why:
            raise TaskRefused(why)
    if isinstance(shadow, bool) or not 0 <= shadow <= 1:
        raise SandmanError(f"grade: shadow must be a share between 0 and 1, not {shadow!r}")
    kw: dict[str, Any] = {"job": job, "attempts": attempts,
                          "acquire_timeout_s": acquire_timeout_s,
                          "retry_backoff_s": retry_backoff_s, "namespace": namespace}
    held: list[AsyncSandbox] = []
    sampled = reuse and shadow > 0 and random.random() < shadow
    with tracing.span("sandman grade", attributes={"sandman.task": task.name,
                                                    "sandman.reuse": reuse}) as span:
        result = await _grade(client, task, patch, reuse=reuse,
                              hold=held if sampled else None, **kw)
        if held:
            result = await _shadow(client, task, patch, result, held[0], kw)
        tracing.set_attributes(span, {"sandman.verdict": result.verdict.value,
                                      "sandman.attempts": result.attempts,
                                      "sandman.shadow": result.shadow})
        return result


async def _shadow(client: AsyncClient, task: Task, patch: bytes | str | None,
                  first: GradeResult, sb: AsyncSandbox, kw: dict[str, Any]) -> GradeResult:
    """`first` was graded on the reused pod `sb`, still held: grade again on a never-used
    pod, report the outcome (the controller counts it and retires a contradicted pod, or
    takes an agreeing one back for reuse) and answer the never-used pod's verdict."""
    try:
        fresh = await _grade(client, task, patch, reuse=False, hold=None, **kw)
    except BaseException:
        await _finish(client, sb, first.verdict, True)
        raise
    if fresh.verdict is Verdict.NO_VERDICT:  # nothing to compare with: as if not sampled
        await _finish(client, sb, first.verdict, True)
        return first
    outcome = (contract.SHADOW_AGREE if fresh.verdict is first.verdict
               else contract.SHADOW_CONTRADICT)
    if outcome == contract.SHADOW_CONTRADICT:
        log.warning("grading %s: reused pod %s said %s, a never-used pod %s: retiring it",
                    task.name, sb.pod or sb.id, first.verdict, fresh.verdict)
    try:
        if hasattr(sb, "report_shadow"):
            await sb.report_shadow(outcome)
        elif outcome == contract.SHADOW_CONTRADICT:
            await sb.retire()
        else:
            await sb.release(reuse=True)
    except SandmanError as e:
        log.warning("grading: reporting shadow outcome %s for %s failed: %s", outcome, sb.id, e)
    return dataclasses.replace(
        fresh, shadow=outcome, attempts=first.attempts + fresh.attempts,
        infra_errors=first.infra_errors + fresh.infra_errors, pods=first.pods + fresh.pods,
        duration_s=first.duration_s + fresh.duration_s)


async def _grade(client: AsyncClient, task: Task, patch: bytes | str | None, *, job: str,
                 attempts: int, reuse: bool, acquire_timeout_s: float,
                 retry_backoff_s: float, namespace: str | None,
                 hold: list[AsyncSandbox] | None) -> GradeResult:
    """grade() with one pod per attempt. `hold`: a reused pod (an earlier grading ran in it)
    that gave a verdict goes there instead of back (the shadow decides its fate)."""
    if attempts < 1:
        raise SandmanError("grade: attempts must be >= 1")
    data = patch.encode() if isinstance(patch, str) else bytes(patch or b"")
    t0 = time.monotonic()
    errors: list[str] = []
    pods: list[str] = []
    last: tuple[Verdict, str, bool, int | None, dict[str, int], str] | None = None
    excluded: list[Excluded] = []
    ids: list[str] = []
    suspicious = scan_patch(data)
    for n in range(1, attempts + 1):
        excluded = []
        stage = ["acquire"]
        sb = None
        verdict = Verdict.NO_VERDICT
        try:
            sb = await _acquire(client, task, job, acquire_timeout_s, namespace, reuse)
            pods.append(sb.pod or sb.id or "?")
            _check_image(client, task, sb)
            last = await _grade_on(client, sb, task, data, excluded, stage, ids)
            verdict = last[0]
            if not last[2]:  # a verdict, or a no-verdict retrying cannot change
                return GradeResult(verdict, last[1], last[3], last[4], last[5], n,
                                   tuple(errors), tuple(excluded), tuple(pods),
                                   time.monotonic() - t0, suspicious, tuple(ids))
            errors.append(f"attempt {n} ({stage[0]}): {last[1]}")
        except SandmanError as e:
            if not is_infra(e):
                raise
            errors.append(f"attempt {n} ({stage[0]}): {type(e).__name__}: {e}")
        finally:
            if sb is not None:
                if (hold is not None and verdict is not Verdict.NO_VERDICT
                        and getattr(sb, "reuses", 0) > 0):
                    hold.append(sb)
                else:
                    await _finish(client, sb, verdict, reuse)
        log.warning("grading %s: attempt %d/%d without a verdict: %s", task.name, n, attempts,
                    errors[-1])
        if n < attempts:
            await asyncio.sleep(retry_backoff_s * n)
    code, summary, out = (last[3], last[4], last[5]) if last else (None, {}, "")
    return GradeResult(Verdict.NO_VERDICT, f"no verdict after {attempts} attempt(s); last: "
                       f"{errors[-1] if errors else '?'}", code, summary, out, attempts,
                       tuple(errors), tuple(excluded), tuple(pods), time.monotonic() - t0,
                       suspicious, tuple(ids))


# ---- preflight

async def preflight(client: AsyncClient, tasks: list[Task], **grade_kw: Any) -> PreflightResult:
    """Grade each task's reference patch (must pass) and the empty patch (must fail), twice;
    keep the tasks that do both both times (paper: two Verified tasks' tests pass without the
    fix; a flaky test gives rewards by chance). A task whose reference fails or whose empty
    patch passes on the first run is not graded again; one whose runs disagree is dropped as
    flaky, naming both outcomes. A task without a reference patch, or with no verdict on any
    check, is dropped too: it cannot be shown to be gradable. `record` holds every task's
    hash and outcomes: save it and pin its SHA-256 (docs/grading.md "The preflight record").
    `grade_kw` go to grade()."""
    kept: list[Task] = []
    dropped: list[tuple[Task, str]] = []
    results: dict[str, tuple[GradeResult, GradeResult | None]] = {}
    records: list[TaskRecord] = []
    for given in tasks:
        task = given
        runs: list[tuple[GradeResult, GradeResult | None]] = []
        why = "" if task.reference_patch else "no reference patch"
        for n in ((1, 2) if not why else ()):
            ref = await grade(client, task, task.reference_patch, **grade_kw)
            if task.test_ids is None and ref.test_ids:
                # The official test ids, as collected on the base: later gradings check these.
                task = dataclasses.replace(task, test_ids=ref.test_ids)
            if ref.verdict is not Verdict.PASSED:
                runs.append((ref, None))
                why = _preflight_why("reference patch", Verdict.PASSED, ref, n)
                break
            empty = await grade(client, task, b"", **grade_kw)
            runs.append((ref, empty))
            if empty.verdict is not Verdict.FAILED:
                why = _preflight_why("empty patch", Verdict.FAILED, empty, n)
                break
        if runs:
            results[given.name] = runs[0]
        outcomes = [(str(r.verdict), str(e.verdict) if e else "") for r, e in runs]
        if why:
            dropped.append((task, why))
            # The task as given: that is what a trainer would grade it as.
            records.append(TaskRecord.of(given, admitted=False, outcomes=outcomes, reason=why))
        else:
            kept.append(task)
            records.append(TaskRecord.of(task, admitted=True, outcomes=outcomes))
    return PreflightResult(kept, dropped, results, PreflightRecord(tuple(records)))


def _preflight_why(what: str, want: Verdict, got: GradeResult, n: int) -> str:
    """Why a task is dropped at run `n`: the check's outcome; both runs' when they differ."""
    if n > 1 and got.verdict is not Verdict.NO_VERDICT:
        return f"flaky: {what} {want} on run 1, {got.verdict} on run 2: {got.reason}"
    must = " (must fail)" if want is Verdict.FAILED else ""
    run = f", run {n}" if n > 1 else ""
    return f"{what}{run}: {got.verdict}{must}: {got.reason}"
