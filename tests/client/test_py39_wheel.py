"""The `sandman-client` wheel in a bare Python 3.9 venv (issue 16): built from the tree,
installed with its one dependency into a fresh venv of Debian bullseye's python3.9
(testbed/dist.py: a cached debootstrapped tree, entered with chroot), then driven for real:
acquire from a controller on 127.0.0.1 (the FakeController of conftest.py), a command in the
real execd it hands out, release, with the sync and the async client; a controller that is not
there gives the typed error. Nothing of the server may land in that venv.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from testbed import dist
from testbed.procs import refused_port

from .conftest import LOOPBACK, FakeController

# Root: the tree is debootstrapped once and entered with chroot.
pytestmark = pytest.mark.netns

PY39 = dist.PYTHON
# What may be in the venv: the client, httpx and httpx's own dependencies on 3.9, and what
# `python3.9 -m venv` puts there.
ALLOWED = {"sandman-client", "httpx", "httpcore", "anyio", "sniffio", "idna", "certifi", "h11",
           "exceptiongroup", "typing-extensions", "pip", "setuptools", "pkg-resources"}
# The server's distribution and its dependencies, named to make a failure readable.
SERVER = {"sandman", "fastapi", "starlette", "pydantic", "pydantic-core", "uvicorn",
          "kubernetes", "cryptography", "pyroute2", "prometheus-client", "jsonpatch", "pyyaml",
          "uvloop", "httptools", "locust"}
CLIENT_FILES = {"client", "api.py", "execd_api.py", "contract.py", "egress.py", "quantity.py", "tracing.py",
                "_version.py", "py.typed", "__pycache__"}

SCRIPT = textwrap.dedent('''
    import asyncio, importlib, json, pkgutil, sys
    import sandman.client
    from sandman.client import AsyncClient, Client, ControllerUnreachable, RetryPolicy

    url, dead = sys.argv[1], sys.argv[2]
    out = {"python": list(sys.version_info[:3])}
    # Every module of the distribution imports on 3.9 (not only those __init__ pulls in),
    # except adapters whose extra (client/pyproject.toml) is not installed: they may say so.
    out["modules"], out["optional"] = [], {}
    for m in pkgutil.walk_packages(sandman.client.__path__, "sandman.client."):
        try:
            importlib.import_module(m.name)
            out["modules"].append(m.name)
        except ImportError as e:
            # An adapter re-raises its missing framework as one line, chained to the cause.
            missing = e if isinstance(e, ModuleNotFoundError) else e.__cause__
            if not isinstance(missing, ModuleNotFoundError) or \
                    (missing.name or "sandman").split(".")[0] == "sandman":
                raise
            out["optional"][m.name] = missing.name
    with Client(url) as client:
        with client.acquire(image="task:py39", job="py39") as sb:
            r = sb.exec("echo sync-$((6 * 7))")
            out["sync"] = [r.exit_code, r.output]

    async def main():
        async with AsyncClient(url) as client:
            async with await client.acquire(image="task:py39", job="py39") as sb:
                r = await sb.exec("echo async-$((6 * 7))")
                return [r.exit_code, r.output]
    out["async"] = asyncio.run(main())
    try:
        with Client(dead, retry=RetryPolicy(attempts=2, backoff_s=0.05, budget_s=2.0)) as c:
            c.acquire(image="task:py39", job="py39")
    except ControllerUnreachable as e:
        out["dead"] = type(e).__name__
    # An egress allowlist is parsed by sandman/egress.py, shipped in the wheel, on 3.9 too.
    from sandman import api
    out["allow"] = api.AcquireRequest(image="i", job="j", egress={
        "allow": ["10.1.2.0/24:443", "svc/m.infra:3141"]}).to_json()["egress"]
    import importlib.metadata as md
    out["dists"] = sorted(d.metadata["Name"].lower().replace("_", "-")
                          for d in md.distributions())
    from pathlib import Path
    out["sandman_dir"] = sorted(p.name for p in Path(sandman.client.__file__).parent.parent.iterdir())
    print("RESULT " + json.dumps(out))
''')


@pytest.fixture(scope="module")
def py39_root() -> Path:
    why = dist.missing()
    if why:
        pytest.skip(f"bare Python 3.9 from Debian bullseye: {why}")
    return dist.rootfs()


@pytest.mark.timeout(1200)  # the first run debootstraps bullseye (196 s here)
def test_client_wheel_in_a_bare_python39_venv(py39_root: Path, controller: FakeController,
                                               tmp_path: Path) -> None:
    with refused_port(LOOPBACK) as port, dist.Py39Venv(py39_root, tmp_path) as venv:
        dead = f"http://{LOOPBACK}:{port}"  # held: nothing listens there meanwhile
        assert venv.check([venv.python, "-c", "import sys; print(sys.version_info[:2])"]) \
            .strip() == "(3, 9)"
        out = venv.check([venv.python, venv.put("check.py", SCRIPT), controller.url, dead],
                         timeout=120)
    result = json.loads(next(ln for ln in out.splitlines()
                             if ln.startswith("RESULT "))[len("RESULT "):])
    assert result["python"][:2] == [3, 9]
    assert "sandman.client._async.sandbox" in result["modules"]
    # A module may only miss what an extra brings, never the base dependencies.
    assert not set(result["optional"].values()) & {"httpx", "httpcore", "anyio"}, \
        result["optional"]
    assert result["sync"] == [0, "sync-42\n"]
    assert result["async"] == [0, "async-42\n"]
    assert result["dead"] == "ControllerUnreachable"
    assert result["allow"] == {"allow": ["10.1.2.0/24:443/tcp", "svc/m.infra:3141/tcp"]}
    # Both acquires reached the controller, and both sandboxes were released.
    assert len(controller.calls("POST")) >= 2
    assert len(controller.calls("DELETE")) == 2
    dists = set(result["dists"])
    assert "sandman-client" in dists and "httpx" in dists
    assert not dists & SERVER, f"server packages in the client's venv: {dists & SERVER}"
    assert dists <= ALLOWED, f"unexpected packages in the client's venv: {dists - ALLOWED}"
    assert set(result["sandman_dir"]) <= CLIENT_FILES, result["sandman_dir"]
