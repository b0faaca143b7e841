"""Fixtures for the webhook tests: a real `python3 -m webhook serve` process over TLS on
127.0.0.1, killed (by its pid) when the test or module is done."""

from __future__ import annotations

import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    url: str
    ca: Path
    certdir: Path
    log: Path

    def client(self, **kw) -> httpx.Client:
        # Like the API server's Go client, which disables Nagle on its connections: otherwise
        # the client's own header/body writes stall 40 ms and hide what the server does.
        ctx = ssl.create_default_context(cafile=str(self.ca))
        transport = httpx.HTTPTransport(verify=ctx, socket_options=[
            (socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
        return httpx.Client(base_url=self.url, transport=transport, timeout=10, **kw)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def start_server(workdir: Path, *extra: str, certdir: Path | None = None,
                 ca: Path | None = None) -> Server:
    """Start the webhook; with `certdir` it serves certdir/tls.{crt,key}, else self-signed."""
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "webhook.log"
    if certdir is None:
        certdir = workdir / "certs"
        tls = ["--self-signed-dir", str(certdir), "--ip", "127.0.0.1"]
    else:
        tls = ["--tls-cert", str(certdir / "tls.crt"), "--tls-key", str(certdir / "tls.key")]
    args = [sys.executable, "-m", "webhook", "serve", "--host", "127.0.0.1", "--port", "0",
            *tls, *extra]
    out = open(log, "wb")
    proc = subprocess.Popen(args, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out.close()
    deadline = time.monotonic() + 30
    port = None
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"webhook exited {proc.returncode}: {log.read_text()[-2000:]}")
            m = re.search(r"serving https://127\.0\.0\.1:(\d+)", log.read_text(errors="replace"))
            if m:
                port = int(m.group(1))
                break
            time.sleep(0.05)
        if port is None:
            raise RuntimeError(f"webhook did not start in 30 s: {log.read_text()[-2000:]}")
        server = Server(proc, port, f"https://127.0.0.1:{port}", ca or certdir / "ca.crt",
                        certdir, log)
        while time.monotonic() < deadline:
            try:
                with server.client() as c:
                    if c.get("/readyz").status_code == 200:
                        return server
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"webhook not ready in 30 s: {log.read_text()[-2000:]}")
    except BaseException:
        proc.kill()
        proc.wait(5)
        raise


@pytest.fixture(scope="module")
def webhook_server(tmp_path_factory) -> Server:
    server = start_server(tmp_path_factory.mktemp("webhook"))
    yield server
    server.stop()
