"""tools/gotoolchain.py (`make deps`: Go >= 1.26 from the Go module proxy when missing).

The hash is checked against Go's own: every module zip in the local Go module cache has the
`h1:` hash go computed next to it (.ziphash). The fetch runs against a proxy on 127.0.0.1
that serves a zip which is not the pinned toolchain: it must refuse it and leave nothing."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tools import gotoolchain

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "gotoolchain.py"


def test_dirhash_is_gos_own():
    try:
        modcache = subprocess.run(["go", "env", "GOMODCACHE"], capture_output=True, text=True,
                                  timeout=30).stdout.strip()
    except OSError:
        pytest.skip("no go on PATH to compare with")
    pairs = sorted(Path(modcache, "cache", "download").rglob("*.ziphash"))[:20]
    if not pairs:
        pytest.skip(f"no module zips in {modcache} to compare with (make testbed-build)")
    for ziphash in pairs:
        zpath = ziphash.with_suffix(".zip")
        if zpath.exists():
            assert gotoolchain.dirhash_h1(zpath) == ziphash.read_text().strip(), zpath


@pytest.fixture
def bad_proxy():
    """A Go module proxy on 127.0.0.1 whose toolchain zip is a valid zip of other content."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr(f"golang.org/toolchain@v0.0.1-go{gotoolchain.VERSION}.linux-x/bin/go",
                   "#!/bin/sh\necho go version go9.9.9\n")
    body = buf.getvalue()
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            seen.append(self.path)
            ok = self.path.startswith("/golang.org/toolchain/@v/") and self.path.endswith(".zip")
            self.send_response(200 if ok else 404)
            self.send_header("Content-Length", str(len(body) if ok else 0))
            self.end_headers()
            if ok:
                self.wfile.write(body)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", seen
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(5)


def _run(tmp_path: Path, path: str, proxy: str) -> subprocess.CompletedProcess:
    env = {"PATH": path, "HOME": str(tmp_path), "GOPROXY": f"{proxy},direct",
           "SANDMAN_TESTBED_CACHE": str(tmp_path / "cache"), "no_proxy": "127.0.0.1"}
    return subprocess.run([sys.executable, str(TOOL)], env=env, capture_output=True, text=True,
                          timeout=120)


def _fake_go(tmp_path: Path, version: str) -> str:
    bin_dir = tmp_path / f"go-{version}"
    bin_dir.mkdir()
    (bin_dir / "go").write_text(f"#!/bin/sh\necho go version go{version} linux/amd64\n")
    (bin_dir / "go").chmod(0o755)
    return f"{bin_dir}:/usr/bin:/bin"


@pytest.mark.parametrize("go", [None, "1.22.1"], ids=["no-go", "old-go"])
def test_a_wrong_toolchain_zip_is_refused_and_nothing_is_left(tmp_path, bad_proxy, go):
    url, seen = bad_proxy
    path = _fake_go(tmp_path, go) if go else "/usr/bin:/bin"
    r = _run(tmp_path, path, url)
    assert r.returncode == 1, r.stderr
    assert seen and seen[0].startswith("/golang.org/toolchain/@v/v0.0.1-go")
    last = r.stderr.strip().splitlines()[-1]
    assert "has hash h1:" in last and "expected h1:" in last and "not installed" in last
    cache = tmp_path / "cache"
    assert not any(cache.rglob("*")), list(cache.rglob("*"))


def test_a_recent_go_on_path_is_used_as_it_is(tmp_path, bad_proxy):
    url, seen = bad_proxy
    r = _run(tmp_path, _fake_go(tmp_path, f"{gotoolchain.MIN_GO[0]}.{gotoolchain.MIN_GO[1]}.0"),
             url)
    assert r.returncode == 0, r.stderr
    assert seen == [] and not (tmp_path / "cache").exists()


def test_the_makefile_puts_the_fetched_go_first_on_path():
    text = (ROOT / "Makefile").read_text()
    assert "/go-toolchain/bin:$(PATH)" in text
    assert os.path.basename(gotoolchain.cache_dir()) == "go-toolchain"
