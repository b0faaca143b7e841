"""Configuration the SDK cannot work with fails at once with `ConfigurationError`, never
retried into `ControllerUnreachable`: a URL that is not http(s)://host, a CA file that does not
load, a controller certificate that does not verify (a real TLS server on 127.0.0.1 counts the
connections), a bearer token about to travel over plain http. And `async with
client.acquire(...)` works without the `await`."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import threading
import time

import pytest

from sandman.client import AsyncClient, Client, ConfigurationError, RetryPolicy, SandmanError, _core
from sandman.client import __version__ as client_version
from testbed.controller import local_tls_dir

from .conftest import FakeController

CLIENTS = [Client, AsyncClient]


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for k in (_core.ENV_URL, _core.ENV_TOKEN_FILE, _core.ENV_CA_FILE):
        monkeypatch.delenv(k, raising=False)


@pytest.mark.parametrize("cls", CLIENTS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("url", ["ftp://sandman-controller:8080", "sandman-controller:8080",
                                 "https://", "http:///v1", "unix:///run/ctl.sock"])
def test_a_url_that_is_not_http_or_https_to_a_host_fails_at_construction(cls, url):
    with pytest.raises(ConfigurationError, match="must be https://host") as e:
        cls(url)
    assert "sandman-controller.sandman-system.svc:8080" in str(e.value)
    assert isinstance(e.value, SandmanError) and isinstance(e.value, ValueError)


def test_the_missing_url_hint_names_the_charts_https_service():
    with pytest.raises(ConfigurationError, match=r"SANDMAN_URL .*https://sandman-controller"
                                                 r"\.sandman-system\.svc:8080"):
        Client()


@pytest.mark.parametrize("cls", CLIENTS, ids=lambda c: c.__name__)
def test_a_ca_file_that_does_not_load_is_a_configuration_error(cls, tmp_path):
    bad = tmp_path / "ca.crt"
    bad.write_text("not a certificate\n")
    for ca in (str(tmp_path / "missing.crt"), str(bad)):
        with pytest.raises(ConfigurationError, match="cannot load the CA file"):
            cls("https://127.0.0.1:1", ca_file=ca)


@pytest.mark.parametrize("cls", CLIENTS, ids=lambda c: c.__name__)
def test_a_bearer_token_over_plain_http_is_refused_unless_asked_for(cls, tmp_path, monkeypatch,
                                                                     caplog):
    with pytest.raises(ConfigurationError, match="plain http and a bearer token"):
        cls("http://127.0.0.1:1", token="secret")
    tok = tmp_path / "token"
    tok.write_text("projected\n")
    monkeypatch.setenv(_core.ENV_TOKEN_FILE, str(tok))
    with pytest.raises(ConfigurationError, match="allow_insecure_http=True"):
        cls("http://127.0.0.1:1")
    caplog.set_level(logging.WARNING, logger="sandman.client")
    c = cls("http://127.0.0.1:1", allow_insecure_http=True)
    assert "over plain http" in caplog.text
    monkeypatch.delenv(_core.ENV_TOKEN_FILE)
    caplog.clear()
    n = cls("http://127.0.0.1:1")  # no token: nothing to leak, nothing said
    assert "plain http" not in caplog.text
    for x in (c, n):
        if isinstance(x, Client):
            x.close()
        else:
            asyncio.run(x.aclose())


class TLSServer:
    """A TLS listener on 127.0.0.1 with the local test CA's serving pair; counts the TCP
    connections it accepted (each one a client attempt)."""

    def __init__(self) -> None:
        d = local_tls_dir()
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(str(d / "tls.crt"), str(d / "tls.key"))
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        deadline = time.monotonic() + 60  # bounded, whatever the test does
        while not self.stop.is_set() and time.monotonic() < deadline:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            try:
                conn.settimeout(2)
                with self.ctx.wrap_socket(conn, server_side=True):
                    pass
            except (OSError, ssl.SSLError):
                pass
            finally:
                conn.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()


@pytest.mark.parametrize("flavor_name", ["sync", "async"])
def test_a_certificate_that_does_not_verify_fails_at_the_first_call_without_retries(
        flavor_name):
    srv = TLSServer()
    retry = RetryPolicy(attempts=5, backoff_s=0.2, backoff_max_s=0.2)
    try:
        url = f"https://127.0.0.1:{srv.port}"  # the system CAs do not know the test CA
        if flavor_name == "sync":
            with Client(url, retry=retry) as c, pytest.raises(ConfigurationError) as e:
                c.list()
        else:
            async def body():
                async with AsyncClient(url, retry=retry) as c:
                    await c.list()
            with pytest.raises(ConfigurationError) as e:
                asyncio.run(body())
        assert "did not verify" in str(e.value) and "SANDMAN_CA_FILE" in str(e.value)
        assert srv.accepted == 1  # one attempt: no retry can fix a certificate
        # With the right CA the same server is trusted (the failure was the CA, nothing else).
        ok = _core.controller_tls(str(local_tls_dir() / "ca.crt"))
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as raw, \
                ok.wrap_socket(raw, server_hostname="127.0.0.1"):
            pass
    finally:
        srv.close()


def test_async_acquire_is_awaitable_and_an_async_context_manager(controller: FakeController):
    async def body():
        async with AsyncClient(controller.url) as client:
            async with client.acquire("img:1", job="job-a") as sb:  # no `await`
                assert sb.id in controller.sandboxes
                assert (await sb.exec("echo hi")).output == "hi\n"
                sid = sb.id
            assert sid not in controller.sandboxes  # released on leaving the block
            pending = client.acquire("img:1", job="job-a")
            sb2 = await pending
            assert sb2.id in controller.sandboxes
            with pytest.raises(RuntimeError, match="already awaited"):
                await pending  # one acquire per call, never a second sandbox by accident
            await sb2.release()

    asyncio.run(body())


def test_the_client_has_its_version():
    import sandman

    assert client_version and client_version == sandman._version.__version__


def test_a_size_that_is_no_quantity_is_refused_before_anything_is_sent():
    import httpx

    from sandman.client import BadRequest

    sent = []
    transport = httpx.MockTransport(lambda req: sent.append(req) or httpx.Response(500))
    with Client("https://127.0.0.1:1", transport=transport) as c:
        with pytest.raises(BadRequest, match="cpu: must be a Kubernetes quantity"):
            c.acquire("img", job="j", cpu="two")
        with pytest.raises(BadRequest, match="memory: must be a Kubernetes quantity"):
            c.acquire("img", job="j", memory="8 GB")
    assert sent == []
