"""The sync SDK is generated from the async one (tools/gen_sync.py): the generated files are
current, and the rewriting rules do what they say on a small sample."""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _gen():
    spec = importlib.util.spec_from_file_location("gen_sync", ROOT / "tools" / "gen_sync.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_generated_sync_files_are_current():
    gen = _gen()
    outs = gen.outputs()
    assert {p.name for p in outs} == {"client.py", "grading.py", "sandbox.py"}
    for path, text in outs.items():
        assert path.read_text() == text, (
            f"{path.relative_to(ROOT)} is stale: run .venv/bin/python tools/gen_sync.py")


def test_rules_on_a_sample():
    src = textwrap.dedent('''\
        import asyncio
        import time


        class AsyncThing:
            async def __aenter__(self) -> AsyncThing:
                return self

            async def go(self, x: int) -> int:
                if True:  # ASYNC
                    task = asyncio.ensure_future(self.go(x))
                    return await asyncio.shield(task)
                else:
                    return x

            if True:  # ASYNC
                def only_async(self) -> None:
                    pass

            async def call(self) -> None:
                resp = await self._http.request("GET", "/x",
                                                timeout=1)
                await asyncio.sleep(1)
                await self._http.aclose()
        ''')
    out = _gen().render(src.replace("AsyncThing", "AsyncClient"), "sample.py")
    assert out.split("\n", 2)[2] == textwrap.dedent('''\
        import time


        class Client:
            def __enter__(self) -> Client:
                return self

            def go(self, x: int) -> int:
                return x

            def call(self) -> None:
                resp = self._http.request("GET", "/x",
                                          timeout=1)
                time.sleep(1)
                self._http.close()
        ''')


def test_asyncio_left_in_a_sync_twin_is_refused():
    import pytest

    with pytest.raises(ValueError, match="asyncio"):
        _gen().render("import time\nx = asyncio.get_running_loop()\n", "bad.py")
