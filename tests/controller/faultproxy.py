"""A fault-injecting HTTPS proxy between the controller and the real API server (test fixture).

The controller's kubeconfig points here; the proxy terminates TLS with its own throwaway CA and
forwards every request to the real API server with the test bed's admin client certificate.
Watches (chunked, long-lived) are streamed through untouched, and can be paused as a whole so
the controller does not learn that a pod became Ready (a "gate" on the Ready wait).

A `Fault` matches (method, path regex, optional body predicate) and fires `count` times. What it
does, in order:
    hold="before": wait until the test calls `rule.release()`, then go on (the call is "in
        admission": nothing stored yet). If the client went away meanwhile, nothing is sent.
    forward=True: send the call to the API server (the pod is stored / deleted there).
    hold="after": the answer is held until released (the call took effect, its answer is "in
        flight").
    answer: None -> the API server's answer; an int -> that status with a Kubernetes Status body
        (forward=False: the call never reached the API server); "reset" -> the connection is
        reset (RST) instead of answering; "drop" -> no answer until the client gives up.
    delay: seconds to wait before answering.
Every request is recorded (method, path, status, pod name, outcome), so a test can wait for "the
create reached the proxy" or "the delete was answered 500" instead of sleeping.
"""

from __future__ import annotations

import datetime as dt
import http.client
import ipaddress
import json
import re
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

HOLD_LIMIT_S = 60.0  # a hold the test forgot to release ends here (loops are bounded)
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host",
        "authorization", "proxy-connection", "te", "trailer", "upgrade"}
_REASONS = {403: "Forbidden", 404: "NotFound", 409: "AlreadyExists", 429: "TooManyRequests",
            500: "InternalError", 503: "ServiceUnavailable", 504: "Timeout"}


@dataclass
class Fault:
    method: str
    path: str  # regex, matched with re.search against the path (query string excluded)
    body: Callable[[dict], bool] | None = None
    hold: str | None = None  # None | "before" | "after"
    forward: bool = True
    answer: int | str | None = None  # None | status | "reset" | "drop"
    delay: float = 0.0
    count: int = 1
    name: str = ""
    # filled in as it fires
    fired: int = 0
    hits: list = field(default_factory=list)  # Record of each matched request
    reached: threading.Event = field(default_factory=threading.Event)  # first match arrived
    _release: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        if self.hold not in (None, "before", "after"):
            raise ValueError("hold is None, 'before' or 'after'")
        if not self.forward and self.answer is None:
            raise ValueError("a call that is not forwarded needs an answer")
        self._re = re.compile(self.path)

    def matches(self, method: str, path: str, body: dict | None) -> bool:
        if self.fired >= self.count or method != self.method or not self._re.search(path):
            return False
        if self.body is not None:
            try:
                return bool(self.body(body or {}))
            except Exception:  # noqa: BLE001 - a predicate that cannot read the body: no match
                return False
        return True

    def release(self) -> None:
        self._release.set()

    def wait_reached(self, timeout: float = 10.0) -> Record:
        if not self.reached.wait(timeout):
            raise AssertionError(f"rule {self.name or self.path}: no matching call within "
                                 f"{timeout:g}s")
        return self.hits[0]


@dataclass
class Record:
    method: str
    path: str
    query: str
    name: str | None  # the pod (or object) name: from the path, or from a create's body
    body: dict | None
    t: float = field(default_factory=time.monotonic)
    status: int | None = None  # what the client was answered (None: reset/dropped/streaming)
    upstream: int | None = None  # what the API server answered (None: not forwarded)
    outcome: str = ""  # "", "reset", "dropped", "client-gone", "held"
    rule: str = ""


class FaultProxy:
    def __init__(self, upstream: str, ca_cert: str, client_cert: str, client_key: str,
                 workdir: Path):
        u = urlsplit(upstream)
        self.up_host, self.up_port = u.hostname, u.port or 443
        self._up_ctx = ssl.create_default_context(cafile=ca_cert)
        self._up_ctx.load_cert_chain(client_cert, client_key)
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.ca_path, cert, key = _make_tls(workdir)
        self._ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._ctx.load_cert_chain(cert, key)
        self.rules: list[Fault] = []
        self.records: list[Record] = []
        self.watch_open = threading.Event()
        self.watch_open.set()
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.proxy = self
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={
            "poll_interval": 0.1}, name="faultproxy", daemon=True)

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._closing.set()
        self.watch_open.set()
        for r in self.rules:
            r.release()
        self._server.shutdown()
        self._server.server_close()
        self._server.close_all()

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def kubeconfig(self, path: Path) -> Path:
        """A kubeconfig for the controller: this proxy, its CA, no client credentials (the
        proxy adds the admin client certificate upstream)."""
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "proxy",
            "clusters": [{"name": "proxy", "cluster": {"server": self.url,
                                                       "certificate-authority": str(self.ca_path)}}],
            "users": [{"name": "proxy", "user": {"token": "unused-by-the-proxy"}}],
            "contexts": [{"name": "proxy", "context": {"cluster": "proxy", "user": "proxy"}}],
        }))
        return path

    # ---- rules and records ----------------------------------------------------------------
    def add(self, rule: Fault) -> Fault:
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        """Drop every rule (releasing any hold) and reopen watches: the end of a trial."""
        with self._lock:
            rules, self.rules = self.rules, []
        for r in rules:
            r.release()
        self.watch_open.set()

    def mark(self) -> int:
        with self._lock:
            return len(self.records)

    def since(self, mark: int, method: str | None = None, path: str | None = None,
              name: str | None = None) -> list[Record]:
        with self._lock:
            recs = list(self.records[mark:])
        return [r for r in recs if (method is None or r.method == method)
                and (path is None or re.search(path, r.path))
                and (name is None or r.name == name)]

    def _match(self, method: str, path: str, body: dict | None) -> Fault | None:
        with self._lock:
            for r in self.rules:
                if r.matches(method, path, body):
                    r.fired += 1
                    return r
        return None

    def _record(self, rec: Record) -> None:
        with self._lock:
            self.records.append(rec)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128
    proxy: FaultProxy

    def __init__(self, *a, **kw):
        self._conns: set = set()
        self._conns_lock = threading.Lock()
        super().__init__(*a, **kw)

    def finish_request(self, request, client_address):
        # The TLS handshake runs in the connection's own thread, never in the accept loop.
        try:
            tls = self.proxy._ctx.wrap_socket(request, server_side=True)
        except (OSError, ssl.SSLError):
            return
        with self._conns_lock:
            self._conns.add(tls)
        try:
            self.RequestHandlerClass(tls, client_address, self)
        finally:
            with self._conns_lock:
                self._conns.discard(tls)
            try:
                tls.close()
            except OSError:
                pass

    def close_all(self) -> None:
        with self._conns_lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.close()
            except OSError:
                pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    server: _Server
    _up: http.client.HTTPSConnection | None = None

    def log_message(self, *a) -> None:  # quiet
        pass

    @property
    def proxy(self) -> FaultProxy:
        return self.server.proxy

    def do_GET(self):
        self._serve()

    do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = do_GET

    def finish(self):
        try:
            super().finish()
        except OSError:
            pass
        if self._up is not None:
            self._up.close()

    # ---- one request ----------------------------------------------------------------------
    def _serve(self) -> None:
        p = self.proxy
        path, _, query = self.path.partition("?")
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        body = None
        if raw:
            try:
                body = json.loads(raw)
            except ValueError:
                body = None
        name = None
        m = re.search(r"/namespaces/[^/]+/[a-z]+/([^/]+)", path)
        if m:
            name = m.group(1)
        elif isinstance(body, dict):
            name = (body.get("metadata") or {}).get("name")
        rec = Record(self.command, path, query, name, body if self.command in (
            "POST", "PATCH", "PUT") else None)
        if self.command == "GET" and re.search(r"(^|&)watch=(true|1|True)", query):
            p._record(rec)
            self._stream(raw)
            return
        rule = p._match(self.command, path, body)
        if rule is not None:
            rec.rule = rule.name or rule.path
            rule.hits.append(rec)
            rule.reached.set()
        p._record(rec)
        if rule is not None and rule.hold == "before":
            if not self._hold(rule):
                rec.outcome = "client-gone"  # never sent: the client left while it was held
                self.close_connection = True
                return
        status, headers, data = None, [], b""
        if rule is None or rule.forward:
            try:
                status, headers, data = self._forward(raw)
            except (OSError, http.client.HTTPException):
                rec.outcome = "upstream-error"
                self._reset()
                return
            rec.upstream = status
        if rule is not None and rule.hold == "after":
            if not self._hold(rule):
                rec.outcome = "client-gone"
                self.close_connection = True
                return
        if rule is not None and rule.delay:
            time.sleep(rule.delay)
        answer = rule.answer if rule is not None else None
        if answer == "reset":
            rec.outcome = "reset"
            self._reset()
            return
        if answer == "drop":
            rec.outcome = "dropping"
            self._wait_client_gone(HOLD_LIMIT_S)
            rec.outcome = "dropped"
            self.close_connection = True
            return
        if isinstance(answer, int):
            status, headers, data = answer, [("Content-Type", "application/json")], _status(
                answer, rec)
        rec.status = status
        self._send(status, headers, data)

    def _hold(self, rule: Fault) -> bool:
        """Wait for the release; False when the client went away meanwhile (or the proxy
        stops)."""
        deadline = time.monotonic() + HOLD_LIMIT_S
        while not rule._release.wait(0.02):
            if self.proxy._closing.is_set() or time.monotonic() > deadline:
                return False
            if self._client_gone():
                return False
        return not self._client_gone()

    def _client_gone(self) -> bool:
        try:
            po = select.poll()
            po.register(self.connection.fileno(), select.POLLRDHUP | select.POLLHUP
                        | select.POLLERR)
            return any(ev & (select.POLLRDHUP | select.POLLHUP | select.POLLERR)
                       for _, ev in po.poll(0))
        except (OSError, ValueError):
            return True

    def _wait_client_gone(self, limit: float) -> None:
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline and not self.proxy._closing.is_set():
            if self._client_gone():
                return
            time.sleep(0.05)

    def _reset(self) -> None:
        """Abort the connection with a TCP RST: the client sees 'connection reset'."""
        self.close_connection = True
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                       struct.pack("ii", 1, 0))
            socket.socket.close(self.connection)  # no TLS close_notify: a raw abort
        except OSError:
            pass

    def _headers_out(self) -> dict:
        return {k: v for k, v in self.headers.items() if k.lower() not in _HOP}

    def _upstream(self, fresh: bool = False) -> http.client.HTTPSConnection:
        if fresh or self._up is None:
            if self._up is not None:
                self._up.close()
            self._up = http.client.HTTPSConnection(self.proxy.up_host, self.proxy.up_port,
                                                   context=self.proxy._up_ctx, timeout=120)
        return self._up

    def _forward(self, raw: bytes):
        hdrs = self._headers_out()
        for attempt in (0, 1):
            conn = self._upstream(fresh=attempt == 1)
            try:
                conn.request(self.command, self.path, body=raw or None, headers=hdrs)
            except (OSError, http.client.HTTPException):
                if attempt:
                    raise
                continue  # a stale keep-alive connection: the request was never delivered
            resp = conn.getresponse()
            data = resp.read()
            return resp.status, [(k, v) for k, v in resp.getheaders()
                                 if k.lower() not in _HOP], data
        raise OSError("unreachable")

    def _send(self, status: int, headers, data: bytes) -> None:
        try:
            self.send_response_only(status)
            for k, v in headers:
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
            self.wfile.flush()
        except OSError:
            self.close_connection = True

    def _stream(self, raw: bytes) -> None:
        """A watch: its own upstream connection, copied chunk by chunk while watches are
        open; ends when either side ends."""
        p = self.proxy
        conn = http.client.HTTPSConnection(p.up_host, p.up_port, context=p._up_ctx, timeout=120)
        self.close_connection = True
        try:
            conn.request(self.command, self.path, body=raw or None, headers=self._headers_out())
            resp = conn.getresponse()
            self.send_response_only(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in _HOP:
                    self.send_header(k, v)
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.flush()
            while not p._closing.is_set():
                chunk = resp.read1(65536)
                if not chunk:
                    break
                while not p.watch_open.wait(0.1):
                    if p._closing.is_set():
                        return
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (OSError, http.client.HTTPException):
            pass
        finally:
            conn.close()


def _status(code: int, rec: Record) -> bytes:
    reason = _REASONS.get(code, "InternalError")
    return json.dumps({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": f"injected by the test proxy: {code} for {rec.method} {rec.path}",
        "reason": reason, "details": {"name": rec.name or "", "kind": "pods"}, "code": code,
    }).encode()


def _make_tls(d: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a serving certificate for 127.0.0.1 signed by it."""
    now = dt.datetime.now(dt.UTC)

    def build(subject, issuer, pub, ca: bool) -> x509.CertificateBuilder:
        b = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(pub)
             .serial_number(x509.random_serial_number())
             .not_valid_before(now - dt.timedelta(minutes=5))
             .not_valid_after(now + dt.timedelta(days=2))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        return b

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "faultproxy-ca")])
    ca = (build(ca_name, ca_name, ca_key.public_key(), True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (build(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "faultproxy")]), ca_name,
                  key.public_key(), False)
            .add_extension(x509.SubjectAlternativeName([
                x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
                critical=False)
            .sign(ca_key, hashes.SHA256()))
    ca_path, cert_path, key_path = d / "proxy-ca.crt", d / "proxy.crt", d / "proxy.key"
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_path.write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_path.chmod(0o600)
    return ca_path, cert_path, key_path
