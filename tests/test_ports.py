"""No helper hands out a port it has closed. A port found by binding 0 and closing goes back to
the kernel, which gives it to the next bind(0) or outgoing connection on the machine: in CI a
tier running beside took one, and a controller died on "address already in use". Servers the
tests start bind port 0 and report the port they got (testbed/procs.py `reported_port`), a URL
where nothing answers holds its port (`refused_port`), a bed component that needs its port on
its command line gets one outside the kernel's ephemeral range (`reserve_port`).

This scans the code that starts servers (tests/, testbed/, bench/, loadtest/, tools/) for the
pattern: a name `free_port`, or a socket bound to port 0 in a `with` block whose port is
returned from inside the block or read after it (the socket closed by then)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DIRS = ("tests", "testbed", "bench", "loadtest", "tools")
# file -> why it may still have the pattern, until fixed (each entry must still match).
KNOWN: dict[str, str] = {}
FREE_PORT = re.compile(r"\b_?free_port\b")


def _is_socket_call(node: ast.AST) -> bool:
    """socket.socket(...), socket.create_server(...), socket(...)."""
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
    return name in ("socket", "create_server")


def _reads_port(node: ast.AST, sock: str) -> bool:
    """`node` contains `<sock>.getsockname()`."""
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
               and n.func.attr == "getsockname" and isinstance(n.func.value, ast.Name)
               and n.func.value.id == sock for n in ast.walk(node))


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def closed_ports(src: str) -> list[int]:
    """Lines where a port is taken from a socket that a `with` block closes, and used after it
    closed: returned from inside the block (not a generator: a context manager that yields
    keeps its socket), or assigned inside and read after the block."""
    tree = ast.parse(src)
    out = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
            continue
        body = fn.body
        generator = any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in ast.walk(fn)) \
            if not isinstance(fn, ast.Module) else False
        for i, stmt in enumerate(body):
            if not isinstance(stmt, ast.With):
                continue
            for item in stmt.items:
                if not (_is_socket_call(item.context_expr)
                        and isinstance(item.optional_vars, ast.Name)):
                    continue
                sock = item.optional_vars.id
                assigned: set[str] = set()
                for n in ast.walk(stmt):
                    if isinstance(n, ast.Return) and n.value is not None \
                            and _reads_port(n.value, sock) and not generator:
                        out.append(n.lineno)
                    if isinstance(n, ast.Assign) and _reads_port(n.value, sock):
                        for t in n.targets:
                            assigned |= _names(t)
                after = [n for s in body[i + 1:] for n in ast.walk(s)
                         if isinstance(n, ast.Name) and n.id in assigned
                         and isinstance(n.ctx, ast.Load)]
                out += [n.lineno for n in after[:1]]
    return sorted(out)


def _files() -> list[Path]:
    return sorted(p for d in DIRS for p in (ROOT / d).rglob("*.py")
                  if p.resolve() != Path(__file__).resolve())


def test_no_helper_hands_out_a_port_it_has_closed():
    found = {}
    for p in _files():
        rel = str(p.relative_to(ROOT))
        src = p.read_text()
        hits = [f"line {src.count(chr(10), 0, m.start()) + 1}: {m.group()}"
                for m in FREE_PORT.finditer(src)]
        hits += [f"line {ln}: a port read from a closed socket" for ln in closed_ports(src)]
        if hits:
            found[rel] = hits
    new = {k: v for k, v in found.items() if k not in KNOWN}
    assert not new, ("a port chosen by binding 0 and closing (another process may take it "
                     "before use): bind 0 in the server and read the port it reports, or hold "
                     "it (testbed/procs.py)", new)
    fixed = sorted(set(KNOWN) - set(found))
    assert not fixed, f"no longer has the pattern: remove from KNOWN: {fixed}"


def test_the_scan_finds_the_pattern_and_spares_the_fixes():
    bad_return = (
        "import socket\n"
        "def port():\n"
        "    with socket.socket() as s:\n"
        "        s.bind(('127.0.0.1', 0))\n"
        "        return s.getsockname()[1]\n")
    bad_after = (
        "import socket\n"
        "def f():\n"
        "    with socket.socket() as s:\n"
        "        s.bind(('127.0.0.1', 0))\n"
        "        port = s.getsockname()[1]\n"
        "    start(port)\n")
    held = (
        "import contextlib, socket\n"
        "@contextlib.contextmanager\n"
        "def refused():\n"
        "    with socket.socket() as s:\n"
        "        s.bind(('127.0.0.1', 0))\n"
        "        yield s.getsockname()[1]\n"
        "def g():\n"
        "    with socket.create_server(('127.0.0.1', 0)) as srv:\n"
        "        target = srv.getsockname()[1]\n"
        "        use(target)\n")
    assert closed_ports(bad_return) == [5]
    assert closed_ports(bad_after) == [6]
    assert closed_ports(held) == []
    assert FREE_PORT.search("from testbed.procs import free_port")
