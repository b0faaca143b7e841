"""HTTP: the connection budget, the request handler, the route table, streamed answers and the
server. One handler style: a route is a function of (handler, query)."""

import collections
import io
import re
import select
import socket
import socketserver
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from .base import (
    _SHA256_HEX,
    EXECD_READY_PATH,
    IDLE_TIMEOUT,
    STREAM_SEND_TIMEOUT,
    VERSION,
    compare_digest,
    now,
    sha256,
)
from .files import _r_files_get, _r_files_read, _r_files_write
from .reuse import _r_baseline, _r_diff, _r_restore
from .wire import _REQ, HTTPError, json_bytes, still_authorized, wire_uint

_HEAD_END = re.compile(b"\n\r?\n")
# Traces (docs/metrics.md): execd exports no spans (stdlib only, and the pod's egress is
# the holder's); it takes a caller's W3C traceparent into its log line for the request and
# answers its own time on it, which the caller's span keeps.
TRACEPARENT_HEADER = "traceparent"
SERVER_TIMING_HEADER = "Server-Timing"
SERVER_TIMING_NAME = "execd"
# version 00 as W3C Trace Context writes it: lower-case hex, ids not all zeros (checked apart).
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}")


def head_end(buf, start=0):
    """Length of the header block at the start of buf (through its empty line), or -1."""
    if buf[:1] == b"\n" or buf[:2] == b"\r\n":  # an empty request line: let http.server judge
        return buf.index(b"\n") + 1
    m = _HEAD_END.search(buf, start)
    return m.end() if m else -1


class ConnBudget:
    """Live connections in accept order, each authenticated or not. Over MAX_PREAUTH
    unauthenticated ones, the oldest is shed (shutdown wakes its thread, which exits); over
    MAX_CONNECTIONS with none to shed, the new one gets a 503 and is closed at once."""

    def __init__(self, max_conns, max_preauth):
        self.max_conns = max_conns
        self.max_preauth = max_preauth
        self.lock = threading.Lock()
        self.conns = collections.OrderedDict()  # socket -> authenticated
        self.shed = 0
        self.refused = 0

    def admit(self, sock):
        shed = []
        with self.lock:
            pre = [c for c, a in self.conns.items() if not a]
            n_pre, n_all = len(pre), len(self.conns)
            while pre and (n_pre >= self.max_preauth or n_all >= self.max_conns):
                c = pre.pop(0)
                del self.conns[c]
                shed.append(c)
                n_pre -= 1
                n_all -= 1
            ok = n_all < self.max_conns
            if ok:
                self.conns[sock] = False
            self.shed += len(shed)
            self.refused += 0 if ok else 1
        for c in shed:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        return ok

    def authed(self, sock):
        with self.lock:
            return self.conns.get(sock, False)

    def mark_authed(self, sock):
        with self.lock:
            if sock in self.conns:
                self.conns[sock] = True

    def release(self, sock):
        with self.lock:
            self.conns.pop(sock, None)

    def counts(self):
        with self.lock:
            pre = sum(1 for a in self.conns.values() if not a)
            return {"connections": len(self.conns), "preauth": pre, "shed": self.shed,
                    "refused": self.refused}


_BUSY_BODY = b'{"error":"too many connections","code":503}'
_BUSY_503 = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
             b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(_BUSY_BODY),
                                                                        _BUSY_BODY))


def _r_token(handler, query):
    """Rotate the token (authenticated with the current one): when a grading pod is reused,
    the controller gives the next holder a new token and the last holder loses access. Held in
    memory only: the pod's annotation (and so a restarted execd) keeps the first hash, which is
    why sandbox pods never restart (restartPolicy Never)."""
    want = handler.json_body().get("token_sha256")
    if not isinstance(want, str) or not _SHA256_HEX.match(want) or want.endswith("\n"):
        raise HTTPError(400, "token_sha256 must be 64 lowercase hex characters")
    d = handler.daemon
    d.args.token_sha256 = want
    d.token_gen += 1  # only the holder of the current token rotates: no concurrent bump
    handler.reply(200, {"ok": True})


_HTTP_VERSION = re.compile(r"HTTP/[0-9]{1,3}\.[0-9]{1,3}")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # without it each small response waits ~40 ms for an ACK
    server_version = "execd/" + VERSION
    sys_version = ""
    timeout = IDLE_TIMEOUT
    daemon = None  # set in main()

    # ------------------------------------------------------------ pre-auth budget

    def handle_one_request(self):
        """http.server's, with the header block read under a byte and time budget first (the
        stdlib allows 64 KiB per line, 100 lines and IDLE_TIMEOUT per read)."""
        self.t_start = None
        head = self.read_head()
        if head is None:
            self.close_connection = True
            return
        self.t_start = now()
        try:  # the header budget is over: writes (a slow reader of a big file) get the old limit
            self.connection.settimeout(IDLE_TIMEOUT)
        except OSError:
            pass
        nl = head.find(b"\n") + 1
        self.raw_requestline = head[:nl]
        # http.server reads the version with int() (and before 3.9 without isdigit): signs,
        # underscores and non-ASCII digits would pass.
        words = head[:nl].decode("latin-1").rstrip("\r\n").split()
        if len(words) >= 3 and not _HTTP_VERSION.fullmatch(words[-1]):
            self.requestline, self.request_version, self.command = "", "", ""
            self.send_error(400, "bad HTTP version %r (want HTTP/DIGITS.DIGITS)" % words[-1][:20])
            return
        rfile = self.rfile
        self.rfile = io.BytesIO(head[nl:])
        try:
            ok = self.parse_request()
        finally:
            self.rfile = rfile
        if not ok:
            return
        method = getattr(self, "do_" + self.command, None)
        if method is None:
            self.send_error(405, "unsupported method %r" % self.command[:20])
            return
        method()
        self.wfile.flush()

    def read_head(self):
        """The request line and headers (through the empty line), or None after replying 431 or
        408, or when the peer closed or was shed. One socket read at a time (peek), so the
        time limit holds however slowly the bytes drip, and no body byte is consumed."""
        budget = self.server.budget
        authed = budget.authed(self.connection)
        limit = self.daemon.args.max_header_bytes
        buf = bytearray()
        deadline = now() + (IDLE_TIMEOUT if authed else self.daemon.args.preauth_idle)
        started = False
        try:
            while True:
                left = deadline - now()
                if left <= 0:
                    raise socket.timeout()
                self.connection.settimeout(left)
                data = self.rfile.peek(1)
                if not data:
                    return None
                if not started:
                    started = True
                    deadline = now() + self.daemon.args.header_timeout
                start = max(0, len(buf) - 2)
                cand = buf + data[:limit + 1 - len(buf)]
                end = head_end(cand, start)
                # Consume through the empty line only: what follows is the body or the next
                # request, read from the same buffer.
                buf += self.rfile.read((end if end >= 0 else len(cand)) - len(buf))
                if end >= 0:
                    return bytes(buf)
                if len(buf) > limit:
                    self.requestline, self.request_version, self.command = "", "", ""
                    self.send_error(431, "request line and headers over %d bytes" % limit)
                    return None
        except socket.timeout:
            if started:
                self.requestline, self.request_version, self.command = "", "", ""
                self.send_error(408, "request headers too slow")
            return None
        except OSError:
            return None

    def log_message(self, fmt, *args):
        if self.daemon.args.verbose:
            trace = self.trace_id()
            sys.stderr.write("execd: %s %s%s\n" % (self.address_string(), fmt % args,
                                                   " trace=" + trace if trace else ""))

    def trace_id(self):
        """The caller's trace id, when its traceparent is a valid W3C one (anything else is
        ignored: it is the caller's data and goes into a log line)."""
        headers = getattr(self, "headers", None)
        value = headers.get(TRACEPARENT_HEADER, "") if headers is not None else ""
        m = _TRACEPARENT.fullmatch(value.strip()) if len(value) <= 64 else None
        if m is None or m.group(1) == "0" * 32 or m.group(2) == "0" * 16:
            return None
        return m.group(1)

    def send_error(self, code, message=None, explain=None):
        # http.server's own errors (bad request line, huge headers...): JSON, then close.
        self.close_connection = True
        # Client mistakes (an HTTP version or method http.server rejects) are 4xx, not 5xx.
        code = {505: 400, 501: 405}.get(code, code)
        try:
            self.reply(code, {"error": message or "bad request", "code": code}, close=True)
        except OSError:
            pass

    def reply(self, code, obj, close=False, headers=None):
        body = obj if isinstance(obj, bytes) else json_bytes(obj)
        ctype = "application/octet-stream" if isinstance(obj, bytes) else "application/json"
        self.send_raw(code, body, ctype, close, headers)

    def send_raw(self, code, body, ctype, close=False, headers=None, length=None):
        if close:
            self.close_connection = True
        reason = self.responses.get(code, ("",))[0]
        head = ["HTTP/1.1 %d %s" % (code, reason), "Server: " + self.server_version,
                "Content-Type: " + ctype,
                "Content-Length: %d" % (len(body) if length is None else length)]
        if headers:
            for k, v in headers:
                head.append("%s: %s" % (k, v))
        started = getattr(self, "t_start", None)
        if started is not None:
            took = (now() - started) * 1000.0
            head.append("%s: %s;dur=%.1f" % (SERVER_TIMING_HEADER, SERVER_TIMING_NAME, took))
            # The route only (a query is the caller's), quoted: never a raw byte of theirs.
            self.log_message("%r %d %.1fms", "%s %s" % (
                getattr(self, "command", "") or "-",
                urlsplit(getattr(self, "path", "") or "").path[:200]), code, took)
        if self.close_connection:
            head.append("Connection: close")
        self.wfile.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)

    def do_GET(self):
        self.dispatch("GET")

    def do_POST(self):
        self.dispatch("POST")

    def do_PUT(self):
        self.dispatch("PUT")

    def do_DELETE(self):
        self.dispatch("DELETE")

    def do_PATCH(self):
        self.dispatch("PATCH")

    def do_HEAD(self):
        self.close_connection = True
        self.dispatch("HEAD")

    def do_OPTIONS(self):
        self.dispatch("OPTIONS")

    def read_body(self):
        if self.headers.get("Transfer-Encoding"):
            raise HTTPError(411, "send a Content-Length (chunked bodies are not accepted)",
                            {"close": True})
        raws = self.headers.get_all("Content-Length") or []
        if not raws:
            return b""
        cap = self.daemon.args.max_body
        lengths = {wire_uint(raw, cap) for raw in raws}
        if None in lengths:
            raise HTTPError(400, "Content-Length must be ASCII digits", {"close": True})
        if len(lengths) > 1:
            # Which one frames the body is ambiguous; the rest would become the next request.
            raise HTTPError(400, "conflicting Content-Length headers", {"close": True})
        n = lengths.pop()
        if n > cap:
            raise HTTPError(413, "request body over %d bytes" % self.daemon.args.max_body,
                            {"close": True})
        chunks = []
        got = 0
        deadline = now() + self.daemon.args.body_timeout
        try:
            while got < n:
                left = deadline - now()
                if left <= 0:
                    raise socket.timeout()
                self.connection.settimeout(left)
                chunk = self.rfile.read1(min(n - got, 1 << 20))
                if not chunk:
                    raise HTTPError(400, "body ended early", {"close": True})
                chunks.append(chunk)
                got += len(chunk)
        except socket.timeout:
            raise HTTPError(408, "request body too slow", {"close": True}) from None
        finally:
            try:
                self.connection.settimeout(IDLE_TIMEOUT)
            except OSError:
                pass
        still_authorized(self.daemon)
        return b"".join(chunks)

    def json_body(self):
        import json  # here, not at start (the imports at the top say why)

        body = self.read_body()
        try:
            obj = json.loads(body.decode("utf-8")) if body.strip() else {}
        except (ValueError, UnicodeDecodeError):
            raise HTTPError(400, "body is not valid JSON") from None
        if not isinstance(obj, dict):
            raise HTTPError(400, "body must be a JSON object")
        return obj

    def authorized(self):
        self.daemon.undumpable.wait(5.0)
        want = self.daemon.args.token_sha256
        if want is None:
            return True
        got = self.headers.get("Authorization", "")
        if not got.startswith("Bearer "):
            return False
        digest = sha256(got[7:].strip().encode("utf-8", "surrogateescape")).hexdigest()
        return compare_digest(digest, want)

    def dispatch(self, method):
        try:
            url = urlsplit(self.path)
            route = url.path
            query = parse_qs(url.query, keep_blank_values=True)
            handler = ROUTES.get(route)
            if handler is None:
                raise HTTPError(404, "no such route: %s" % route[:200], {"close_body": True})
            # The generation is read before the check: a rotation in between leaves this
            # request with the old one, refused at its action (still_authorized).
            _REQ.gen = None if route in PUBLIC_ROUTES else self.daemon.token_gen
            # /ready answers without a token (the kubelet), but one that carries a token is
            # checked: the controller's readiness probe proves it reached this pod's own execd,
            # not another pod's that still holds a reused IP. /health stays open to any caller.
            carries = route == EXECD_READY_PATH and "Authorization" in self.headers
            if (route not in PUBLIC_ROUTES or carries) and not self.authorized():
                raise HTTPError(401, "missing or wrong bearer token", {"close_body": True})
            if self.daemon.stopping:
                raise HTTPError(503, STOPPING, {"close_body": True})
            if route not in PUBLIC_ROUTES or self.authorized():
                # Authenticated connections leave the pre-auth budget (longer idle, no shedding).
                self.server.budget.mark_authed(self.connection)
            want_method = handler[0]
            if method != want_method:
                raise HTTPError(405, "use %s for %s" % (want_method, route),
                                {"close_body": True})
            if route in QUIET_ROUTES:
                handler[1](self, query)
            else:
                activity = self.daemon.activity
                activity.begin()
                try:
                    handler[1](self, query)
                finally:
                    activity.end()
        except HTTPError as e:
            close = bool(e.extra.pop("close", False))
            if e.extra.pop("close_body", False) and self.headers.get("Content-Length", "0") \
                    not in ("0", ""):
                close = True  # we did not read the body: the connection cannot be reused
            obj = {"error": e.message, "code": e.code}
            obj.update(e.extra)
            self.reply(e.code, obj, close=close)
        except (BrokenPipeError, ConnectionResetError, socket.timeout):
            self.close_connection = True
        except Exception as e:  # never a traceback to the client
            sys.stderr.write("execd: internal error on %s: %r\n" % (self.path[:200], e))
            try:
                self.reply(500, {"error": "internal error: %s" % type(e).__name__, "code": 500},
                           close=True)
            except OSError:
                self.close_connection = True


# The daemon's own routes; the others live with their concern (files, trees, reuse, background,
# sessions). Every route is a function of (handler, query).

def _r_health(handler, query):
    handler.reply(200, {"ok": True, "version": VERSION})


def _r_ready(handler, query):
    res = handler.daemon.ready.get()
    res["version"] = VERSION
    handler.reply(200 if res.get("ok") else 503, res)


STOPPING = "execd is stopping (SIGTERM): the sandbox's processes were killed"


def _r_exec(handler, query):
    res = handler.daemon.exec_command(handler.json_body(), handler.connection)
    if handler.daemon.stopping:  # its processes died of the stop, not of their own doing
        res["error"] = "; ".join(e for e in (res.get("error"), STOPPING) if e)
    handler.reply(200, res)


def _r_exec_stream(handler, query):
    stream = ExecStream(handler)
    body = handler.json_body()
    try:
        result = handler.daemon.stream_command(body, stream)
    except HTTPError as e:
        if not stream.started:
            raise
        obj = {"error": e.message, "code": e.code}
        obj.update(e.extra)
        stream.finish(obj)
        return
    except Exception as e:
        if not stream.started:
            raise
        sys.stderr.write("execd: internal error on /exec/stream: %r\n" % (e,))
        handler.close_connection = True
        stream.finish({"error": "internal error: %s" % type(e).__name__, "code": 500})
        return
    stream.finish({"result": result})


def _r_env(handler, query):
    handler.reply(200, handler.daemon.set_env(handler.json_body()))


def _r_reset(handler, query):
    handler.reply(200, handler.daemon.reset(handler.json_body()))


def _r_state(handler, query):
    st = handler.daemon.state()
    st["connections"] = handler.server.budget.counts()  # the pre-auth budget at work
    handler.reply(200, st)


def _r_conditions(handler, query):
    handler.reply(200, handler.daemon.conditions(query))


def _r_activity(handler, query):
    handler.reply(200, handler.daemon.activity.read())


def _later(module, name):
    """The route `name` of `module`, imported by its first call: trees, background processes
    and sessions are CPU at every sandbox start that most sandboxes never spend on them."""
    def route(handler, query):
        fn = getattr(__import__(__package__ + "." + module, fromlist=[name]), name)
        return fn(handler, query)

    route.__name__ = name
    return route


PUBLIC_ROUTES = ("/health", EXECD_READY_PATH)  # no token: the kubelet calls them
# Authenticated but not the holder's activity: the controller's idle rule reads /activity,
# and its pause reads /snapshot; counting either would keep an idle sandbox alive (or make
# a pause look like use). Public routes are never activity either.
QUIET_ROUTES = PUBLIC_ROUTES + ("/activity", "/snapshot")

ROUTES = {
    "/health": ("GET", _r_health),
    EXECD_READY_PATH: ("GET", _r_ready),
    "/exec": ("POST", _r_exec),
    "/exec/stream": ("POST", _r_exec_stream),
    "/files/read": ("POST", _r_files_read),
    "/files": ("GET", _r_files_get),
    "/files/write": ("POST", _r_files_write),
    "/files/tree": ("GET", _later("trees", "tree_read")),
    "/files/tree/write": ("POST", _later("trees", "tree_write")),
    "/env": ("POST", _r_env),
    "/reset": ("POST", _r_reset),
    "/state": ("GET", _r_state),
    "/activity": ("GET", _r_activity),
    "/conditions": ("GET", _r_conditions),
    "/baseline": ("POST", _r_baseline),
    "/diff": ("GET", _r_diff),
    "/restore": ("POST", _r_restore),
    "/token": ("POST", _r_token),
    "/processes": ("GET", _later("background", "_r_processes")),
    "/processes/spawn": ("POST", _later("background", "_r_spawn")),
    "/processes/info": ("GET", _later("background", "_r_process")),
    "/processes/output": ("GET", _later("background", "_r_process_output")),
    "/processes/signal": ("POST", _later("background", "_r_process_signal")),
    "/processes/wait": ("POST", _later("background", "_r_process_wait")),
    "/sessions": ("GET", _later("sessions", "_r_sessions")),
    "/sessions/open": ("POST", _later("sessions", "_r_session_open")),
    "/sessions/write": ("POST", _later("sessions", "_r_session_write")),
    "/sessions/read": ("GET", _later("sessions", "_r_session_read")),
    "/sessions/resize": ("POST", _later("sessions", "_r_session_resize")),
    "/sessions/signal": ("POST", _later("sessions", "_r_session_signal")),
    "/sessions/close": ("POST", _later("sessions", "_r_session_close")),
    "/snapshot": ("GET", _later("snapshot", "_r_snapshot")),
    "/snapshot/apply": ("POST", _later("snapshot", "_r_snapshot_apply")),
}


class ExecStream(object):
    """The answer of /exec/stream: chunked HTTP, one JSON object per line (NDJSON). Lines
    `{"output": text}` as the command prints (UTF-8 decoded across read boundaries), then
    one `{"result": ...}` with /exec's answer, or `{"error": ..., "code": ...}` if the call
    failed after the stream began. Bounded: each chunk is one pipe read (at most READ_SIZE)
    written straight to the socket; a client that stalls STREAM_SEND_TIMEOUT is gone.
    A client gone kills nothing unless the request said kill_on_disconnect."""

    def __init__(self, handler):
        import codecs

        self.handler = handler
        self.sock = handler.connection
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.kill_on_disconnect = False
        self.started = False
        self.gone = False

    def begin(self):
        self.started = True
        head = ("HTTP/1.1 200 OK\r\nServer: %s\r\nContent-Type: application/x-ndjson\r\n"
                "Transfer-Encoding: chunked\r\nCache-Control: no-store\r\n\r\n"
                % self.handler.server_version)
        self._send(head.encode("latin-1"))

    def _send(self, data):
        if self.gone:
            return
        try:
            self.sock.settimeout(STREAM_SEND_TIMEOUT)
            self.handler.wfile.write(data)
        except OSError:  # socket.timeout included: the reader stalled
            self.gone = True
            self.handler.close_connection = True

    def line(self, obj):
        data = json_bytes(obj) + b"\n"
        self._send(b"%x\r\n%s\r\n" % (len(data), data))

    def output(self, data):
        text = self.decoder.decode(data)
        if text:
            self.line({"output": text})

    def finish(self, last):
        rest = self.decoder.decode(b"", True)
        if rest:
            self.line({"output": rest})
        self.line(last)
        self._send(b"0\r\n\r\n")
        try:
            self.sock.settimeout(IDLE_TIMEOUT)
        except OSError:
            pass

    def abandoned(self):
        """Whether the command should end because its client is gone (asked for only)."""
        if not self.kill_on_disconnect:
            return False
        if not self.gone:
            try:
                readable = select.select([self.sock], [], [], 0)[0]
                # Readable with nothing to read is the client's FIN (or a reset).
                if readable and not self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                    self.gone = True
            except (BlockingIOError, InterruptedError):
                pass
            except (OSError, ValueError):
                self.gone = True
            if self.gone:
                self.handler.close_connection = True
        return self.gone


class Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True
    request_queue_size = 128
    budget = None  # a ConnBudget, set in main()
    listen_socket = None  # already bound and listening (the pod's launcher), or None

    def server_bind(self):
        # Not HTTPServer.server_bind: its server_name is socket.getfqdn(), a host lookup of the
        # address through NSS (files, then DNS) at every start, ~2 ms of CPU, for a name that
        # only CGI handlers read.
        if self.listen_socket is None:
            socketserver.TCPServer.server_bind(self)
        else:
            self.socket.close()
            self.socket = self.listen_socket
            self.server_address = self.socket.getsockname()
        self.server_name = self.server_address[0]
        self.server_port = self.server_address[1]

    def server_activate(self):
        if self.listen_socket is None:
            ThreadingHTTPServer.server_activate(self)

    def process_request(self, request, client_address):
        # In the accept thread: cheap refusals only (no thread, no read).
        if not self.budget.admit(request):
            try:
                request.setblocking(False)
                request.send(_BUSY_503)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        ThreadingHTTPServer.process_request(self, request, client_address)

    def shutdown_request(self, request):
        self.budget.release(request)
        ThreadingHTTPServer.shutdown_request(self, request)

    def handle_error(self, request, client_address):
        pass  # a client that vanished is not our error; never print a traceback


def parse_listen(value):
    m = re.match(r"^\[([0-9a-fA-F:.]*)\]:(\d+)$", value) or re.match(r"^([^:]*):(\d+)$", value)
    if not m:
        raise ValueError("--listen wants HOST:PORT or [V6]:PORT")
    return m.group(1), int(m.group(2))


def adopt_listener(sock, host, port):
    """`sock` if it listens on exactly (host, port) over TCP (port 0: any), else None (closed):
    execd then binds itself and reports its own errors."""
    if sock is None:
        return None
    try:
        ok = (sock.type == socket.SOCK_STREAM
              and sock.family == (socket.AF_INET6 if ":" in host else socket.AF_INET)
              and sock.getsockname()[0] == host and port in (0, sock.getsockname()[1])
              and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
    except OSError:
        ok = False
    if not ok:
        sock.close()
        return None
    return sock
