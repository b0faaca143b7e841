"""A standby forwards API calls to the leader.

Both replicas are Ready (readiness means "this replica can serve", not "this replica leads"),
so the Service sends API calls to both. A call that lands on the standby is forwarded to the
leader at the URL the leader wrote into the Lease (controller/leader.py), and the answer goes
back unchanged. Why forwarding, and not the alternatives (docs/controller.md, "Two replicas"):

- A retryable NotLeader alone is not enough behind a Service: kube-proxy balances
  connections, not requests, so a client's keep-alive connection to the standby would get
  NotLeader on every retry, and curl, `helm test` or a non-Python client would see 503s.
- A leader-only Service (a label the leader puts on its own pod) needs pod-patch rights in the
  release namespace, leaves the label on a crashed leader's restarted pod until it is cleared,
  and makes every failover wait for EndpointSlice and kube-proxy propagation, which on a busy
  shared cluster takes seconds to tens of seconds.

Forwarding needs nothing but the Lease both replicas already read. Fencing: the standby
forwards only while its view of the Lease is fresh (it read it within `duration`), names the
holder it means in `X-Sandman-Leader`, and a replica that is not that holder (or not serving)
refuses with NotLeader instead of forwarding again, so a call never loops and never reaches a
deposed leader's books. With no leader to forward to (failover, or the leader still syncing)
the standby answers NotLeader (503) with `Connection: close` and `Retry-After`; the SDK
retries NotLeader, and the closed connection lets the retry be balanced afresh.

TLS: a forwarded call carries the caller's token, so over https the standby forwards only to
an https leader, verifying its certificate with the CA bundle (`--tls-ca-file`) for the
Service's DNS name (`--tls-server-name`, sent as SNI): the leader is reached by pod IP, which
no certificate names. A leader that fails verification gets nothing; the caller gets NotLeader
and retries (tests/controller/test_forward.py, test_tls.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from collections.abc import Awaitable, Callable

import httpx

log = logging.getLogger("controller.forward")

LEADER_HEADER = "x-sandman-leader"  # the holder identity the standby forwards to
FORWARDED_BY = "x-sandman-forwarded-by"  # the standby's identity, for logs
_LEADER_KEY = LEADER_HEADER.encode()
API_PREFIX = "/v1/"
CONNECT_TIMEOUT_S = 2.0  # pod to pod; a leader that does not accept in 2 s is not serving
# Hop-by-hop headers (RFC 9110 7.6.1), and those the proxy recomputes: httpx sets Host and
# Content-Length of the call, and hands back the answer's body already decoded.
_HOP = frozenset((b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer",
                  b"transfer-encoding", b"upgrade", b"content-length"))
_DROP_REQUEST = _HOP | {b"host"}
_DROP_RESPONSE = _HOP | {b"content-encoding"}

Scope = dict
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


def not_leader_headers() -> list[tuple[bytes, bytes]]:
    """What a NotLeader answer carries: close the connection so the client's retry is balanced
    afresh by the Service (kube-proxy pins a keep-alive connection to one pod)."""
    return [(b"connection", b"close"), (b"retry-after", b"1")]


class ForwardToLeader:
    """ASGI middleware. `serving()` is true when this replica is the leader with synced
    books (then calls go to the app); `target()` is (holder identity, URL) of the leader to
    forward to, or None. Calls that were already forwarded, and every call when there is no
    target, go to the app, whose routes answer NotLeader."""

    def __init__(self, app, serving: Callable[[], bool],
                 target: Callable[[], tuple[str, str] | None], identity: str = "",
                 verify: ssl.SSLContext | None = None, server_name: str | None = None,
                 require_https: bool = False):
        self.app = app
        self.serving = serving
        self.target = target
        self.identity = identity
        # TLS to the leader: `verify` (the CA bundle) checks its certificate for `server_name`
        # (the Service's DNS name: the leader's pod IP is in no certificate). With
        # require_https a caller's token is never forwarded over plain http.
        self.verify = verify
        self.server_name = server_name
        self.require_https = require_https
        self._client: httpx.AsyncClient | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(API_PREFIX):
            await self.app(scope, receive, send)
            return
        meant = next((v for k, v in scope.get("headers") or [] if k == _LEADER_KEY), None)
        if meant is not None:
            # Forwarded by a standby: serve it only as the very holder it meant, never pass it
            # on (no loops, no deposed leader's books).
            if self.serving() and meant.decode("latin-1") == self.identity:
                await self.app(scope, receive, send)
            else:
                await _not_leader(send, f"forwarded to {meant.decode('latin-1')!r}, which this"
                                        " replica is not (or it is not serving); retry")
            return
        if self.serving():
            await self.app(scope, receive, send)
            return
        target = self.target()
        if target is None:
            await self.app(scope, receive, send)  # the routes answer NotLeader
            return
        if self.require_https and not target[1].lower().startswith("https://"):
            await _not_leader(send, f"the leader {target[0]} serves plain http, and this replica"
                                    " forwards callers' tokens over https only; retry")
            return
        await self._forward(scope, receive, send, *target)

    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            # A run start can send thousands of acquires at once, each held until its sandbox
            # is ready: no connection cap, no read timeout (the caller's own timeout and its
            # disconnect end a call; the disconnect is passed on below).
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
                trust_env=False, verify=self.verify if self.verify is not None else True)
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    async def _forward(self, scope: Scope, receive: Receive, send: Send, holder: str,
                       url: str) -> None:
        body = bytearray()
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        headers = [(k.decode("latin-1"), v.decode("latin-1"))
                   for k, v in scope.get("headers") or [] if k.lower() not in _DROP_REQUEST]
        headers += [(LEADER_HEADER, holder), (FORWARDED_BY, self.identity)]
        target = url.rstrip("/") + scope.get("raw_path", scope["path"].encode()).decode(
            "latin-1")
        if scope.get("query_string"):
            target += "?" + scope["query_string"].decode("latin-1")
        ext = {"sni_hostname": self.server_name} if self.server_name else None
        call = asyncio.ensure_future(self.client().request(
            scope["method"], target, content=bytes(body), headers=headers, extensions=ext))
        # The leader must learn that the caller left (an acquire withdraws its create): when
        # the caller disconnects, cancelling the call closes the connection to the leader.
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({call, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not call.done():
                call.cancel()
            gone.cancel()
        if not call.done() or call.cancelled():
            return  # the caller left; nobody to answer
        try:
            resp = call.result()
        except httpx.HTTPError as e:
            log.info("forward %s %s to leader %s at %s failed: %s", scope["method"],
                     scope["path"], holder, url, e)
            await _not_leader(send, f"the leader {holder} did not answer ({type(e).__name__});"
                                    " retry")
            return
        out = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in resp.headers.multi_items()
               if k.lower().encode() not in _DROP_RESPONSE]
        out.append((b"content-length", str(len(resp.content)).encode()))
        if resp.status_code == 503:
            out += not_leader_headers()
        await send({"type": "http.response.start", "status": resp.status_code, "headers": out})
        await send({"type": "http.response.body", "body": resp.content})


async def _disconnected(receive: Receive) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


async def _not_leader(send: Send, message: str) -> None:
    body = json.dumps({"error": {"type": "NotLeader", "message": message, "events": []}}).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            *not_leader_headers()]})
    await send({"type": "http.response.body", "body": body})
