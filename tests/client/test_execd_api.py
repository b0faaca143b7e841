"""sandman/execd_api.py is execd's API for everyone but execd: its routes and limits equal
execd's own table (execd imports nothing, so it keeps its own), and no module of the SDK, the
controller or loadtest spells an execd route by hand."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from sandman import api
from sandman import execd_api as X

REPO = Path(__file__).parents[2]


def execd_modules() -> list:
    """execd's modules, `server` (the route table) first: the one place this test finds
    execd's code."""
    import importlib
    import pkgutil

    import execd.execd_daemon as pkg

    names = sorted(i.name for i in pkgutil.iter_modules(pkg.__path__))
    return [importlib.import_module(f"{pkg.__name__}.{n}")
            for n in ["server"] + [n for n in names if n not in ("server", "main")]]


def execd_table():
    """execd's own route table ({path: (method, handler)}) and its routes answered without a
    token."""
    m = execd_modules()[0]
    return m.ROUTES, m.PUBLIC_ROUTES


def execd_limit(name: str):
    """One of execd's limits, by its name in execd."""
    for m in execd_modules():
        if hasattr(m, name):
            return getattr(m, name)
    raise AssertionError(f"execd has no {name}")


def test_every_route_of_execd_is_here_with_its_method_and_no_other():
    routes, _ = execd_table()
    ours = {r.path: r.method for r in X.ROUTES}
    theirs = {path: method for path, (method, _handler) in routes.items()}
    assert set(theirs) - set(ours) == set(), "served by execd, missing in sandman/execd_api.py"
    assert set(ours) - set(theirs) == set(), "in sandman/execd_api.py, not served by execd"
    assert ours == theirs
    assert len({r.path for r in X.ROUTES}) == len({r.kind for r in X.ROUTES}) == len(X.ROUTES)


def test_the_routes_without_a_token_are_the_same():
    _, public = execd_table()
    assert {r.path for r in X.PUBLIC_ROUTES} == set(public)
    assert X.READY.path in set(public)


@pytest.mark.parametrize("ours, theirs", [
    ("DEFAULT_TIMEOUT_S", "DEFAULT_TIMEOUT"), ("DEFAULT_MAX_OUTPUT", "DEFAULT_MAX_OUTPUT"),
    ("MAX_OUTPUT_LIMIT", "MAX_OUTPUT_LIMIT"), ("TREE_MAX_BYTES", "TREE_MAX_BYTES"),
    ("TREE_DIGEST_LEN", "TREE_DIGEST_LEN"), ("TREE_META_MAX", "TREE_META_MAX"),
    ("TREE_NAME_MAX", "TREE_NAME_MAX"), ("TREE_DEPTH_MAX", "TREE_DEPTH_MAX"),
    ("TREE_MTIME_MAX", "TREE_MTIME_MAX"), ("TREE_SHA256_HEADER", "TREE_SHA256_HEADER"),
    ("BG_COMMAND_MAX", "BG_COMMAND_MAX"), ("FRESH_COMMAND_MAX", "FRESH_COMMAND_MAX"),
    ("BG_WAIT_MAX", "BG_WAIT_MAX"), ("PTY_WRITE_MAX", "PTY_WRITE_MAX"),
    ("PTY_READ_WAIT_MAX", "PTY_READ_WAIT_MAX"), ("PTY_SIZE_MAX", "PTY_SIZE_MAX"),
    ("PTY_ABANDON_MAX", "PTY_ABANDON_MAX"),
    ("SNAPSHOT_MAX_BYTES", "SNAPSHOT_MAX_BYTES"), ("SNAPSHOT_MAX_ENTRIES", "SNAPSHOT_MAX_ENTRIES"),
    ("SNAPSHOT_MANIFEST_MAX", "SNAPSHOT_MANIFEST_MAX"),
    ("SNAPSHOT_MEMBER_MAX", "SNAPSHOT_MEMBER_MAX"), ("SNAPSHOT_ARCHIVE_MAX", "SNAPSHOT_ARCHIVE_MAX"),
    ("TRACEPARENT_HEADER", "TRACEPARENT_HEADER"), ("SERVER_TIMING_HEADER", "SERVER_TIMING_HEADER"),
    ("SERVER_TIMING_NAME", "SERVER_TIMING_NAME"),
])
def test_the_limits_both_sides_need_are_execds(ours, theirs):
    assert getattr(X, ours) == execd_limit(theirs)


def test_the_sdk_sends_the_modules_routes():
    from sandman.client._async import sandbox as a
    from sandman.client._sync import sandbox as s

    for mod in (a, s):
        for r in X.ROUTES:
            if hasattr(mod, r.kind):
                assert getattr(mod, r.kind) is r, (mod.__name__, r.kind)
        assert mod.SESSION_WRITE_MAX == X.PTY_WRITE_MAX
        assert mod.PROCESS_WAIT_ROUND_S == X.BG_WAIT_MAX
        assert mod.SESSION_READ_ROUND_S == X.PTY_READ_WAIT_MAX


def test_bodies_carry_only_what_was_given():
    from sandman.client import _core

    assert X.ExecRequest(command="ls").to_json() == {"command": "ls"}
    assert _core.exec_body("ls", 5, 100, "r1", 2).to_json() == {
        "command": "ls", "request_id": "r1", "timeout": 5.0, "idle_timeout": 2.0,
        "max_output": 100}
    assert _core.exec_body("ls", None, None, None, fresh=True, cwd="/r").to_json() == {
        "command": "ls", "fresh": True, "cwd": "/r"}
    assert _core.stream_body("ls", None, None, None, False).to_json() == {"command": "ls"}
    assert _core.stream_body("ls", None, None, None, True).to_json() == {
        "command": "ls", "kill_on_disconnect": True}
    assert _core.spawn_body("sleep 1", None, {"A": "b"}, "r2").to_json() == {
        "command": "sleep 1", "request_id": "r2", "env": {"A": "b"}}
    assert _core.write_body("/f", b"x", None, "A" * 64).to_json() == {
        "path": "/f", "data_b64": "eA==", "if_sha256": "a" * 64}
    assert X.EnvRequest(unset=["PYTHONHASHSEED"]).to_json() == {"unset": ["PYTHONHASHSEED"]}
    assert X.SignalRequest(id="p1", signal="TERM").to_json() == {"id": "p1", "signal": "TERM"}
    assert X.Empty().to_json() == {}
    assert X.ResetRequest().to_json() == {"workspace": False}


def test_answers_are_read_and_refused_by_their_form():
    assert X.Restored.from_json({"restored": True}).restored
    a = X.SnapshotApplied.from_json({"files": 2, "deleted": 1, "bytes": 3072, "cwd": "/w"})
    assert (a.files, a.deleted, a.bytes, a.cwd) == (2, 1, 3072, "/w")
    with pytest.raises(api.AnswerError, match="no 'cwd'"):
        X.SnapshotApplied.from_json({"files": 2, "deleted": 1, "bytes": 3072})
    assert not X.Diff.from_json({"clean": "yes", "changes": [1]}).clean
    assert X.Health.from_json({"ok": True, "version": "1"}).ok
    with pytest.raises(api.AnswerError, match="no 'exit_code'"):
        X.ExecResult.from_json({"output": ""}, "r")
    with pytest.raises(api.AnswerError, match="not base64"):
        X.ProcessOutput.from_json({"data_b64": "!", "start": 0, "end": 1})


# ---- nobody else spells an execd route

def _literals(source: str) -> list[tuple[int, str]]:
    """Each string constant of `source` (f-strings' literal parts included) with its line;
    docstrings left out, and a part that follows a directory (`f"{sa_dir}/token"`: a file)."""
    tree = ast.parse(source)
    skip = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)}
    for n in ast.walk(tree):
        if isinstance(n, ast.JoinedStr):
            for before, part in zip(n.values, n.values[1:], strict=False):
                if (isinstance(before, ast.FormattedValue)
                        and ast.unparse(before.value).lower().endswith("dir")):
                    skip.add(id(part))
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in skip]


def _spelled_routes(source: str) -> list[tuple[int, str]]:
    """Literals that are an execd route, end with one (a URL built by hand) or put a query
    on one."""
    paths = {r.path for r in X.ROUTES}
    return [(line, s) for line, s in _literals(source)
            if s in paths or any(s.endswith(p) or p + "?" in s for p in paths)]


def _modules():
    for top in ("controller", "loadtest", "sandman/client"):
        yield from sorted((REPO / top).rglob("*.py"))


def test_the_check_finds_a_route_built_by_hand():
    src = ('"""Reads /conditions."""\n'
           'def f(host, port):\n'
           '    """GET /diff"""\n'
           '    a = f"http://{host}:{port}/env"\n'
           '    b = "/conditions"\n'
           '    c = base + "/processes/info?id=" + x\n'
           '    d = api.READYZ.path + "/healthz" + "/v1/sandboxes/{id}/renew"\n'
           '    e = f"{base}/token" + f"{sa_dir}/token"\n')
    assert sorted(s for _, s in _spelled_routes(src)) == ["/conditions", "/env",
                                                          "/processes/info?id=", "/token"]


def test_no_module_of_the_sdk_controller_or_loadtest_spells_an_execd_route():
    found = []
    for path in _modules():
        for line, s in _spelled_routes(path.read_text()):
            found.append(f"{path.relative_to(REPO)}:{line}: {s!r}")
    assert found == [], "spell execd's routes through sandman/execd_api.py:\n" + "\n".join(found)


def test_only_the_execd_client_talks_to_execd_in_the_controller():
    """The controller reaches execd through controller/execd_client.py only."""
    users = sorted(p.name for p in (REPO / "controller").glob("*.py")
                   if "execd_api" in p.read_text() and p.name != "execd_client.py")
    assert set(users) <= {"conditions.py"}, users  # its EnvRequest: the seed's body
