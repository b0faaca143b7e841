"""Serve the app over TLS with uvicorn; reload the certificate files when they change.

The SSLContext object given to uvicorn stays the same; `load_cert_chain` on it swaps the
certificate for new handshakes (established connections keep theirs). Reloading happens on the
event loop, the thread that runs handshakes. A half-written pair (new cert, old key) fails to
load and is retried on the next poll while the old pair keeps serving: it is tried on a
throwaway context first (webhook.certs.load_pair), since a failed load into the live context
left it with the new certificate and no key (every handshake failed).

Nagle: asyncio's socket transport sets TCP_NODELAY on accepted connections, but only when the
socket's proto is IPPROTO_TCP; a listening socket made with socket.socket(family, SOCK_STREAM)
has proto 0, and then every response stalled ~44 ms on delayed ACKs (measured here). bind()
passes the proto and sets the option on the listener too (Linux copies it to accepted sockets);
tests/webhook/test_server.py::test_no_nagle_stall keeps it so.

Bounds per connection (BoundedHttpTools): a request must arrive whole (request line, headers,
body) within `--request-read-seconds` of its first byte, or of the connection's opening, and its
headers may not exceed 64 KiB; otherwise the connection is closed. uvicorn alone waits forever
for a request that trickles in, and each such connection holds one of the 512 slots of
`limit_concurrency`, past which every review is answered 503. The body size bound is in
webhook/app.py (413 before reading it). tests/webhook/test_bounds.py plays both with sockets.

Drain (`--drain-seconds`, the chart sets 5): a deleted replica gets SIGTERM while its address
is still in the Service's endpoints and the API server still holds kept-alive connections to
it. Shutting down at once refused new connections and closed kept-alive ones under the API
server's next call: a create failed ("failed calling webhook ... EOF") around a rollout. During
the drain /readyz answers 503, every admission call is still served, and each response says
`Connection: close`, so the API server's connections end after an answer, never under a call;
then uvicorn's graceful shutdown. A second signal ends the drain at once.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import socket
import ssl
import threading
import time

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from sandman import logs
from sandman.podspec import SandboxPolicy
from webhook.app import MAX_BODY_BYTES, AdmissionFastPath, create_app
from webhook.certs import load_pair
from webhook.metrics import Metrics

log = logging.getLogger("webhook")

RELOAD_POLL_SECONDS = 1.0  # a stat() of two files a second; Secret volumes update in ~1 min
REQUEST_READ_SECONDS = 5.0  # the API server sends a review at once (webhook timeout: 5 s)
MAX_HEADER_BYTES = 64 * 1024  # the API server's headers are a few hundred bytes


def bounded_protocol(read_seconds: float, max_header_bytes: int = MAX_HEADER_BYTES) -> type:
    """uvicorn's httptools protocol with a deadline on receiving each request and a bound on
    its headers (see the module docstring)."""

    class BoundedHttpTools(HttpToolsProtocol):
        _deadline = None
        _header_bytes = 0

        def _arm(self) -> None:
            self._disarm()
            self._header_bytes = 0
            self._deadline = self.loop.call_later(read_seconds, self._too_slow)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _too_slow(self) -> None:
            self._deadline = None
            log.warning("closing connection from %s: request not received within %g s",
                        self.client, read_seconds)
            self.transport.close()

        def _count(self, n: int) -> None:
            self._header_bytes += n
            if self._header_bytes > max_header_bytes:
                log.warning("closing connection from %s: headers over %d bytes", self.client,
                            max_header_bytes)
                self._disarm()
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()  # a connection that never sends a whole request is closed too

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._deadline is None:  # the next request on a kept-alive connection
                self._arm()

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value))
            super().on_header(name, value)

        def on_message_complete(self) -> None:
            self._disarm()  # the handler's own time is not bounded here
            super().on_message_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return BoundedHttpTools


def _stamp(path: str) -> tuple:
    st = os.stat(path)  # follows the ..data symlink of Secret volumes
    return (st.st_ino, st.st_mtime_ns, st.st_size)


class TLSFiles:
    def __init__(self, cert: str, key: str, metrics: Metrics):
        self.cert, self.key, self.metrics = cert, key, metrics
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        self.context.set_alpn_protocols(["http/1.1"])
        self.not_after: datetime.datetime | None = None
        self._stamps: tuple | None = None
        # Clients (ip, port) seen since the last load, and those seen before it.
        self._current: set = set()
        self._previous: set = set()
        if not self.reload():
            raise SystemExit(f"webhook: cannot load TLS certificate {cert} / key {key}")

    def reload(self) -> bool:
        """Load the pair if it changed. True when the context holds a valid pair."""
        try:
            stamps = (_stamp(self.cert), _stamp(self.key))
        except OSError as e:
            log.warning("certificate files unreadable: %s", e)
            return self._stamps is not None
        if stamps == self._stamps:
            return True
        try:
            leaf = load_pair(self.context, self.cert, self.key)  # never half-loaded
        except (OSError, ssl.SSLError, ValueError) as e:
            self.metrics.cert_reloads.labels("failed").inc()
            log.warning("certificate reload failed, keeping the previous one: %s", e)
            return self._stamps is not None
        self._stamps = stamps
        self._previous, self._current = self._current, set()
        self.not_after = leaf.not_valid_after_utc
        self.metrics.cert_expiry.set(self.not_after.timestamp())
        self.metrics.cert_reloads.labels("loaded").inc()
        log.info("serving certificate loaded, valid until %s", self.not_after.isoformat())
        return True

    def predates_reload(self, client) -> bool:
        """True (once) for a connection that sent requests before the last reload.

        Clients keep a kept-alive connection, and with it the old certificate, indefinitely
        (the API server did, measured in the rotation test); closing such connections after
        their next response makes every client handshake with the new certificate at once."""
        if client in self._previous:
            self._previous.discard(client)
            return True
        if client not in self._current:
            # First request on this connection (or one forgotten at the bound below).
            self.metrics.connections.inc()
            if len(self._current) > 10_000:  # bound memory; a miss only delays one reconnect
                self._current.clear()
            self._current.add(client)
        return False

    def not_ready(self) -> str | None:
        if self.not_after is None:
            return "no certificate"
        if self.not_after <= datetime.datetime.now(datetime.UTC):
            return f"certificate expired at {self.not_after.isoformat()}"
        return None

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(RELOAD_POLL_SECONDS)
            self.reload()


class Drain:
    """The drain's state: started on the first SIGTERM (see the module's docstring)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.started: float | None = None

    def not_ready(self) -> str | None:
        return "draining: shutting down" if self.started is not None else None


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose first SIGTERM/SIGINT starts the drain instead of the shutdown."""

    def __init__(self, config: uvicorn.Config, drain: Drain):
        super().__init__(config)
        self.drain = drain

    def handle_exit(self, sig, frame) -> None:
        if self.drain.seconds <= 0 or self.drain.started is not None:
            return super().handle_exit(sig, frame)
        self.drain.started = time.monotonic()
        log.warning("webhook: signal %d: draining for %g s, then shutting down", sig,
                    self.drain.seconds)
        # uvicorn's loop polls should_exit; a timer thread setting it is what a signal does.
        t = threading.Timer(self.drain.seconds, uvicorn.Server.handle_exit, (self, sig, None))
        t.daemon = True
        t.start()


class CloseOnReload:
    """ASGI wrapper: `Connection: close` on responses of connections older than the cert, and
    on every response during a drain."""

    def __init__(self, app, tls: TLSFiles, drain: Drain | None = None):
        self.app, self.tls, self.drain = app, tls, drain

    async def __call__(self, scope, receive, send):
        draining = self.drain is not None and self.drain.started is not None
        if scope["type"] != "http" or not (self.tls.predates_reload(scope.get("client"))
                                           or draining):
            return await self.app(scope, receive, send)

        async def send_close(message):
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() != b"connection"]
                message = {**message, "headers": headers + [(b"connection", b"close")]}
            await send(message)

        return await self.app(scope, receive, send_close)


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


def serve(policy: SandboxPolicy, host: str, port: int, cert: str, key: str,
          log_level: str = "warning", max_body: int = MAX_BODY_BYTES,
          read_seconds: float = REQUEST_READ_SECONDS, drain_seconds: float = 0.0,
          log_format: str = "text") -> None:
    metrics = Metrics()
    tls = TLSFiles(cert, key, metrics)
    drain = Drain(drain_seconds)
    app = create_app(policy, metrics, ready=lambda: drain.not_ready() or tls.not_ready(),
                     background=tls.watch)

    sock = bind(host, port)
    config = uvicorn.Config(
        CloseOnReload(AdmissionFastPath(app, policy, metrics, max_body=max_body), tls, drain),
        log_level=log_level, log_config=logs.uvicorn_log_config(log_format),
        access_log=False,
        # The C parser and loop: webhook CPU per pod create 0.88 ms instead of 1.51 with
        # h11/asyncio (make bench-webhook, docs/webhook.md); bounded per connection.
        http=bounded_protocol(read_seconds), loop="uvloop",
        ssl_context_factory=lambda _config, _default: tls.context,
        # Bounded work in flight: past this, uvicorn answers 503 instead of growing memory
        # (the paper's single 384 MiB webhook replica was OOM-killed under a burst).
        limit_concurrency=512, timeout_keep_alive=30, timeout_graceful_shutdown=5)
    server = DrainingServer(config, drain)
    logs.say(log_format, "webhook", f"webhook: serving https://{host}:{sock.getsockname()[1]}")
    server.run(sockets=[sock])
