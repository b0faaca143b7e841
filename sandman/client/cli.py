"""`sandman`: the command-line client (the client distribution's entry point; also
`python3 -m sandman.client`). It reads the same environment as `Client()` ($SANDMAN_URL,
$SANDMAN_TOKEN_FILE, $SANDMAN_CA_FILE; `--url`, `--token-file`, `--ca-file` override them).

    sandman acquire IMAGE --job JOB [--cpu 1] [--memory 1Gi] [--lifetime 3600] [--count N]
    sandman fork ID -n N
    sandman checkpoint (--job JOB | ID ...) | restore CHECKPOINT | pause ID | resume HANDLE
    sandman exec ID [--timeout S] [--idle-timeout S] [--] COMMAND ...
    sandman shell ID [-- COMMAND ...]
    sandman cp [ID:]SRC [ID:]DST
    sandman list [--job JOB] | get ID | renew ID | release ID | drain JOB | stats
    sandman prewarm IMAGE COUNT | prepull [REPO@sha256:HEX ...]
    sandman completion bash|zsh

Global options go anywhere before the command (`--` or, for `exec`, its first word that is not
an option). `acquire` (and `fork`, for each child) keeps the controller's answer (it holds
execd's token) in the lease directory, one file per sandbox, readable by this user only;
`exec`, `cp` and `shell` use it, `release` removes it. Output is a table, or JSON with
`-o json` (errors too). Every error is one line on stderr and an exit code of the CLI's own
(EXIT_TABLE); `exec` and `shell` exit with the command's own status.
"""

from __future__ import annotations

import argparse
import codecs
import json
import os
import re
import select
import shlex
import signal
import stat
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

from sandman import api
from sandman._version import __version__
from sandman.client import errors as E
from sandman.client._sync.client import Client
from sandman.client._sync.sandbox import Sandbox
from sandman.client.models import ExecResult, Lease

ENV_LEASE_DIR = "SANDMAN_LEASE_DIR"
PROG = "sandman"
# `shell`'s session is closed by execd once no call named it for this long: a CLI killed
# (SIGKILL, a lost machine) leaves nothing running for longer. The loop reads every 0.25 s;
# this is above what the SDK's retries ride out (a 30 s read, then its 30 s retry budget).
SHELL_ABANDON_AFTER_S = 120.0

# The CLI's own exit codes sit above what commands usually use, next to the conventions of
# timeout(1) and `docker run` (124 timed out, 125 the tool's own usage error; 126 and 127 stay
# the sandbox shell's, passed through): `exec` and `shell` pass the command's status through,
# so a code of the CLI's own must not read as a command's ordinary failure. A command that
# itself exits with one of these is told apart by `-o json` (`timed_out`, `error`).
EXIT_OTHER = 116  # any other SandmanError; a local file the CLI could not read or write
EXIT_CONFIG = 117
EXIT_NOT_FOUND = 118
EXIT_AUTH = 119
EXIT_UNREACHABLE = 120
EXIT_QUEUE_FULL = 121
EXIT_TREE = 122
EXIT_PROTOCOL = 123
EXIT_TIMEOUT = 124
EXIT_USAGE = 125
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report ^C

# Exit codes by error type, most specific first (a class's subclasses come before it).
EXIT_CODES: tuple[tuple[type[BaseException], int], ...] = (
    (E.ConfigurationError, EXIT_CONFIG),
    (E.BadRequest, EXIT_USAGE),
    (E.SandboxGone, EXIT_NOT_FOUND),
    (E.CheckpointGone, EXIT_NOT_FOUND),
    (E.FileNotFound, EXIT_NOT_FOUND),
    (E.ProcessNotFound, EXIT_NOT_FOUND),
    (E.Unauthenticated, EXIT_AUTH),
    (E.Forbidden, EXIT_AUTH),
    (E.Unauthorized, EXIT_AUTH),
    (E.ControllerUnreachable, EXIT_UNREACHABLE),
    (E.SandboxUnreachable, EXIT_UNREACHABLE),
    (E.AcquireTimeout, EXIT_TIMEOUT),
    (E.CommandTimeout, EXIT_TIMEOUT),
    (E.QueueFull, EXIT_QUEUE_FULL),
    (E.TreeError, EXIT_TREE),
    (E.ProtocolError, EXIT_PROTOCOL),
    (E.SandmanError, EXIT_OTHER),
)
EXIT_NO_LEASE = EXIT_NOT_FOUND  # `exec`/`cp`/`shell` on an id with no lease here
# Every code of the CLI's own, as docs/sdk.md's table states it (tests/client/
# test_cli_terminal.py checks the table against this).
EXIT_TABLE: dict[int, str] = {
    EXIT_OTHER: "other", EXIT_CONFIG: "configuration", EXIT_NOT_FOUND: "not found",
    EXIT_AUTH: "refused", EXIT_UNREACHABLE: "unreachable", EXIT_QUEUE_FULL: "queue full",
    EXIT_TREE: "tree", EXIT_PROTOCOL: "protocol", EXIT_TIMEOUT: "timed out",
    EXIT_USAGE: "usage", EXIT_INTERRUPTED: "interrupted",
}


class CliError(Exception):
    """A refusal of the command-line client itself (one line), with its exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def exit_code(e: BaseException) -> int:
    if isinstance(e, CliError):
        return e.code
    for cls, code in EXIT_CODES:
        if isinstance(e, cls):
            return code
    return EXIT_OTHER


# ---- the lease directory: execd tokens at rest, for this user only

def lease_dir() -> Path:
    env = os.environ.get(ENV_LEASE_DIR)
    if env:
        return Path(env)
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "sandman" / "leases"


def _private_dir(create: bool) -> Path | None:
    """The lease directory, refused (fail closed) unless it is a real directory owned by this
    user and closed to everyone else: another local user must not plant or read tokens."""
    d = lease_dir()
    if create:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        st = os.lstat(d)
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise CliError(f"lease directory {d} must be a directory owned by this user with mode "
                       f"0700 (it holds execd tokens)", EXIT_CONFIG)
    return d


# The controller's ids are hex (controller/core.py); a lease file is named after one, so an id
# is a plain name, never a path (`../x`, `/etc/x`, `.hidden`).
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")


def _lease_path(d: Path, sandbox_id: str) -> Path:
    if not _ID.fullmatch(sandbox_id):
        raise CliError(f"{sandbox_id[:80]!r} is not a sandbox id", EXIT_USAGE)
    return d / f"{sandbox_id}.json"


def save_lease(lease: Lease) -> Path:
    d = _private_dir(create=True)
    assert d is not None
    path = _lease_path(d, lease.id)
    # to_json() holds the token (raw leaves it out): the file is what connect() needs.
    data = json.dumps(lease.to_json(), sort_keys=True).encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


def load_lease(sandbox_id: str) -> Lease:
    d = _private_dir(create=False)
    path = _lease_path(d, sandbox_id) if d is not None else None
    try:
        if path is None:
            raise FileNotFoundError
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        # The controller hands execd's token out once, at acquire, and never again: another
        # machine reaches the sandbox with a copy of this file, not with the API token.
        raise CliError(f"no lease for {sandbox_id} in {lease_dir()}: exec, cp and shell reach "
                       f"sandboxes whose lease file is there (`{PROG} acquire` writes it; copy "
                       f"it, mode 0600, to use it from another machine)", EXIT_NO_LEASE) from None
    except OSError as e:
        raise CliError(f"lease {path}: {e.strerror}", EXIT_CONFIG) from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise CliError(f"lease {path} must be owned by this user with mode 0600", EXIT_CONFIG)
        raw = f.read(1 << 20)
    try:
        return Lease.from_json(json.loads(raw))
    except (ValueError, E.SandmanError) as e:
        raise CliError(f"lease {path} is not an acquire's answer: {e}", EXIT_CONFIG) from None


def drop_lease(sandbox_id: str) -> None:
    d = _private_dir(create=False)
    if d is not None:
        try:
            os.unlink(_lease_path(d, sandbox_id))
        except FileNotFoundError:
            pass


# ---- output

def _jsonable(obj: Any) -> Any:
    raw = getattr(obj, "raw", None)
    if isinstance(raw, dict) and raw:
        return raw
    if isinstance(obj, list):
        return [_jsonable(x) for x in obj]
    return obj


# C0 and C1 controls but \t, \n and \r (layout, and progress bars' \r), and DEL: what a
# terminal acts on instead of showing (ESC starts OSC 52 clipboard writes, title changes,
# screen clears). Shown as ^X (C0, DEL) or \xHH (C1) instead.
_CONTROLS = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def _visible(m: re.Match[str]) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c >= 0x80 else "^" + chr(c ^ 0x40)


def neutral(text: str) -> str:
    """`text` with every control sequence's introducer made visible and inert."""
    return _CONTROLS.sub(_visible, text)


class TerminalFilter:
    """For `shell`: lets through what a terminal needs to draw a program (text, layout
    controls, CSI sequences: cursor, colours, erase) and drops the control strings (OSC, DCS,
    SOS, PM, APC: title changes, OSC 52 clipboard writes, hyperlinks, terminal queries) and
    CSI window operations (`t`: resize, title reports). Keeps its state across chunks."""

    _STRING_STARTS = "]PX^_"

    def __init__(self) -> None:
        self.state = "text"  # text, esc, csi, string, string_esc
        self.csi = ""

    def feed(self, text: str) -> str:
        out: list[str] = []
        for ch in text:
            st = self.state
            if st == "text":
                if ch == "\x1b":
                    self.state = "esc"
                elif ch == "\x9b":
                    self.state, self.csi = "csi", ""
                elif ch in "\x90\x98\x9d\x9e\x9f":
                    self.state = "string"
                elif "\x80" <= ch <= "\x9f":
                    pass
                else:
                    out.append(ch)
            elif st == "esc":
                if ch == "[":
                    self.state, self.csi = "csi", ""
                elif ch in self._STRING_STARTS:
                    self.state = "string"
                else:
                    self.state = "text"
                    if " " <= ch <= "~":
                        out.append("\x1b" + ch)  # a two-byte escape (keypad modes, charsets)
            elif st == "csi":
                if "\x40" <= ch <= "\x7e":
                    self.state = "text"
                    if ch != "t":
                        out.append("\x1b[" + self.csi + ch)
                elif len(self.csi) < 64:
                    self.csi += ch
                else:
                    self.state = "text"  # an endless sequence: dropped
            elif st == "string":
                if ch == "\x07" or ch == "\x9c":
                    self.state = "text"
                elif ch == "\x1b":
                    self.state = "string_esc"
            else:  # string_esc: ESC \ ends the string; any other ESC starts anew
                self.state = "text" if ch == "\\" else "string"
        return "".join(out)


def emit(args: argparse.Namespace, obj: Any, table: Callable[[], list[list[str]]]) -> None:
    if args.output == "json":
        print(json.dumps(_jsonable(obj), indent=2, sort_keys=True, default=str))
        return
    # Cells hold names callers chose (jobs, images): never a control sequence to a terminal.
    rows = [[neutral(c) for c in r] for r in table()]
    if not rows:
        return
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def _info_rows(items: list[Any]) -> list[list[str]]:
    rows = [["ID", "STATE", "JOB", "IMAGE", "POD", "EXPIRES"]]
    for i in items:
        raw = i.raw
        rows.append([str(raw.get(k) or "-") for k in
                     ("id", "state", "job", "image", "pod", "expires_at")])
    return rows


# ---- the commands

def _client(args: argparse.Namespace) -> Client:
    return Client(args.url, token_file=args.token_file, ca_file=args.ca_file,
                  timeout_s=args.request_timeout)


def cmd_acquire(args: argparse.Namespace) -> int:
    if args.count is not None:
        return _acquire_group(args)
    with _client(args) as c:
        sb = c.acquire(args.image, job=args.job, cpu=args.cpu, memory=args.memory,
                       egress=_egress(args), role=args.role, namespace=args.namespace,
                       timeout_s=args.timeout, lifetime_s=args.lifetime, renew=False)
        try:
            lease = sb.detach()
            path = save_lease(lease)
        except BaseException:
            sb_id = sb.id
            # Not kept: nothing could reach it again, so it goes back now.
            try:
                c.release(sb_id or "")
            finally:
                raise
    emit(args, {"id": lease.id, "pod": lease.pod, "expires_at": lease.expires_at,
                "lease_file": str(path)},
         lambda: [["ID", "POD", "EXPIRES"], [lease.id, lease.pod, str(lease.expires_at)]])
    return 0


def _keep_all(c: Client, sbs: Sequence[Sandbox]) -> list[tuple[Lease, Path]]:
    """Each sandbox detached and its lease kept here; all or nothing, as the fork or restore
    that made them: a sandbox not kept could never be reached."""
    kept: list[tuple[Lease, Path]] = []
    try:
        for sb in sbs:
            lease = sb.detach()
            kept.append((lease, save_lease(lease)))
    except BaseException:
        try:
            for sb in sbs:
                c.release(sb.id or "")
            for lease, _ in kept:
                drop_lease(lease.id)
        finally:
            raise
    return kept


def _acquire_group(args: argparse.Namespace) -> int:
    """`acquire --count N`: one call for N sandboxes of the spec, all kept or none."""
    with _client(args) as c:
        kept = _keep_all(c, c.acquire_group(
            args.image, args.count, job=args.job, cpu=args.cpu, memory=args.memory,
            egress=_egress(args), role=args.role, namespace=args.namespace,
            timeout_s=args.timeout, lifetime_s=args.lifetime, renew=False))
    return _emit_kept(args, kept)


def cmd_fork(args: argparse.Namespace) -> int:
    with _client(args) as c:
        kept = _keep_all(c, c.fork(args.id, args.n, timeout_s=args.timeout, renew=False))
    return _emit_kept(args, kept)


def _emit_kept(args: argparse.Namespace, kept: list[tuple[Lease, Path]]) -> int:
    emit(args, [{"id": lease.id, "pod": lease.pod, "expires_at": lease.expires_at,
                 "lease_file": str(path)} for lease, path in kept],
         lambda: [["ID", "POD", "EXPIRES"]] + [[lease.id, lease.pod, str(lease.expires_at)]
                                               for lease, _ in kept])
    return 0


def cmd_checkpoint(args: argparse.Namespace) -> int:
    if bool(args.job) == bool(args.ids):
        raise CliError("checkpoint: --job JOB or sandbox ids, one of the two", EXIT_USAGE)
    with _client(args) as c:
        ck = c.checkpoint(job=args.job, ids=args.ids or None, namespace=args.namespace,
                          timeout_s=args.timeout)
    emit(args, ck.to_json(), lambda: [["CHECKPOINT", "SANDBOX", "BYTES", "EXPIRES"]]
         + [[ck.id, s.id, str(s.bytes), ck.expires_at] for s in ck.sandboxes])
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    with _client(args) as c:
        got = c.restore(args.checkpoint, timeout_s=args.timeout, renew=False)
        olds = list(got)
        kept = _keep_all(c, [got[o] for o in olds])
    rows = [{"old": old, "id": lease.id, "pod": lease.pod, "expires_at": lease.expires_at,
             "lease_file": str(path)} for old, (lease, path) in zip(olds, kept)]
    emit(args, rows, lambda: [["OLD", "ID", "POD", "EXPIRES"]]
         + [[str(r["old"]), str(r["id"]), str(r["pod"]), str(r["expires_at"])] for r in rows])
    return 0


def cmd_pause(args: argparse.Namespace) -> int:
    with _client(args) as c:
        ck = c.pause(args.id, timeout_s=args.timeout)
    drop_lease(args.id)  # released: the handle is all that is left of it
    emit(args, ck.to_json(), lambda: [["HANDLE", "SANDBOX", "BYTES", "EXPIRES"]]
         + [[ck.id, s.id, str(s.bytes), ck.expires_at] for s in ck.sandboxes])
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    with _client(args) as c:
        kept = _keep_all(c, [c.resume(args.handle, timeout_s=args.timeout, renew=False)])
    return _emit_kept(args, kept)


def cmd_list(args: argparse.Namespace) -> int:
    with _client(args) as c:
        items = c.list(job=args.job, namespace=args.namespace)
    emit(args, items, lambda: _info_rows(items))
    return 0


def cmd_get(args: argparse.Namespace) -> int:
    with _client(args) as c:
        info = c.get(args.id)
    emit(args, info, lambda: _info_rows([info]))
    return 0


def cmd_release(args: argparse.Namespace) -> int:
    with _client(args) as c:
        released = c.release(args.id, reuse=args.reuse)
    drop_lease(args.id)
    emit(args, {"id": args.id, "released": released},
         lambda: [["ID", "RELEASED"], [args.id, str(released).lower()]])
    return 0


def cmd_renew(args: argparse.Namespace) -> int:
    with _client(args) as c:
        info = c.renew(args.id, args.lifetime)
    emit(args, info, lambda: _info_rows([info]))
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    with _client(args) as c:
        n = c.drain(args.job, namespace=args.namespace)
    emit(args, {"job": args.job, "released": n},
         lambda: [["JOB", "RELEASED"], [args.job, str(n)]])
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    with _client(args) as c:
        st = c.stats()
    emit(args, st, lambda: [["LIVE", "CREATING", "QUEUED", "RATE/S"],
                            [str(st.live), str(st.creating),
                             str(sum(st.queue_depth.values())), f"{st.rate:g}"]])
    return 0


def cmd_prewarm(args: argparse.Namespace) -> int:
    with _client(args) as c:
        pool = c.prewarm(args.image, args.count, cpu=args.cpu, memory=args.memory,
                         egress=_egress(args), role=args.role, idle_timeout_s=args.idle_timeout)
    emit(args, pool, lambda: [["TARGET", "WARM", "BUILDING"],
                              [str(pool.target), str(pool.warm), str(pool.building)]])
    return 0


def cmd_prepull(args: argparse.Namespace) -> int:
    with _client(args) as c:
        st = c.prepull(args.images) if args.images else c.images()
    emit(args, st, lambda: [["IMAGE", "PULLED", "PENDING", "FAILED"]]
         + [[i.image, str(i.pulled), str(i.pending), str(i.failed)] for i in st.images])
    return 0


def _connect(sandbox_id: str) -> Sandbox:
    return Sandbox.connect(load_lease(sandbox_id))


def _line(command: list[str]) -> str:
    """One argument is a shell line as typed; several are joined as the shell would read them."""
    return command[0] if len(command) == 1 else " ".join(shlex.quote(c) for c in command)


def _writer(args: argparse.Namespace, stream: Any) -> Callable[[str], str]:
    """What the sandbox printed, made inert for a terminal unless --raw. Not a terminal (a
    file, a pipe): as it came, the bytes are data for a program."""
    if args.raw or not stream.isatty():
        return lambda text: text
    return neutral


def cmd_exec(args: argparse.Namespace) -> int:
    if not args.command:
        raise CliError("exec: give the command after the sandbox id (sandman exec ID -- CMD)",
                       EXIT_USAGE)
    line = _line(args.command)
    show = _writer(args, sys.stdout)
    sb = _connect(args.id)
    result: ExecResult | None = None
    try:
        for part in sb.stream(line, timeout=args.timeout, idle_timeout=args.idle_timeout):
            if isinstance(part, str):
                sys.stdout.write(show(part))
                sys.stdout.flush()
            else:
                result = part
    except E.CommandTimeout as e:
        result = e.result  # its status is execd's 124; the timed_out flag tells it apart
    finally:
        sb.close()
    if result is None:
        raise E.ProtocolError("exec: the stream ended without the command's status")
    code = EXIT_TIMEOUT if result.timed_out else result.exit_code
    if args.output == "json":
        print(json.dumps({"exit_code": code, "error": result.error,
                          "timed_out": result.timed_out}))
    elif result.error:
        print(f"{PROG}: exec: {neutral(result.error)}", file=sys.stderr)
    return code


class _Signalled(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_signalled(signum: int, frame: Any) -> None:
    raise _Signalled(signum)


class _Resized:
    """SIGWINCH's handler and the flag it raises for the shell's loop. The handler only stores
    an attribute: CPython runs handlers in the main thread between any two bytecodes, inside
    the previous SIGWINCH's handler too, so one that takes a lock (threading.Event.set does)
    deadlocks on a SIGWINCH that comes while that lock is held, and the session's output stops
    for good. A terminal sends them in bursts while its window is dragged."""

    def __init__(self) -> None:
        self.flag = False

    def __call__(self, signum: int, frame: Any) -> None:
        self.flag = True

    def take(self) -> bool:
        """Whether a SIGWINCH came since the last take. Read the size after this: one that
        comes after the flag is lowered raises it again."""
        if not self.flag:
            return False
        self.flag = False
        return True


def cmd_shell(args: argparse.Namespace) -> int:
    import termios
    import tty

    if not (os.isatty(0) and os.isatty(1)):
        raise CliError("shell: stdin and stdout must be a terminal (for a command without "
                       "one: sandman exec ID -- COMMAND)", EXIT_USAGE)
    env = {"TERM": os.environ.get("TERM") or "xterm-256color"}
    sb = _connect(args.id)
    saved = termios.tcgetattr(0)
    old_handlers: dict[signal.Signals, Any] = {}
    resized = _Resized()
    done = threading.Event()
    session = None
    try:
        # Listening before the size is read: a resize while the session opens is the loop's
        # to send (SIGWINCH's default is to ignore it).
        old_handlers[signal.SIGWINCH] = signal.signal(signal.SIGWINCH, resized)
        # And for a stop before the open: one while it waits for its answer comes out of the
        # SDK's open, which closes what it opened (SIGINT's KeyboardInterrupt does the same).
        for signum in (signal.SIGTERM, signal.SIGHUP):
            old_handlers[signum] = signal.signal(signum, _raise_signalled)
        cols, rows = os.get_terminal_size(1)
        live = session = sb.session(_line(args.command) if args.command else "bash",
                                    env=env, cols=max(1, cols), rows=max(1, rows),
                                    abandon_after=SHELL_ABANDON_AFTER_S)
        tty.setraw(0)
        failed: list[BaseException] = []

        def keys() -> None:  # the operator's keys, typed into the sandbox's terminal
            try:
                while not done.is_set():
                    # Polled, so that no key typed after the session ended is taken from
                    # the operator's next program.
                    if not select.select([0], [], [], 0.2)[0]:
                        continue
                    data = os.read(0, 4096)
                    if not data:
                        return
                    live.write(data)
            except BaseException as e:  # noqa: BLE001 - handed to the main thread
                failed.append(e)
                done.set()

        threading.Thread(target=keys, daemon=True).start()
        filt = None if args.raw else TerminalFilter()
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        while not done.is_set():
            if resized.take():
                c, r = os.get_terminal_size(1)
                live.resize(max(1, c), max(1, r))
            out = live.read(timeout=0.25)
            if out.data:
                if filt is None:
                    os.write(1, out.data)
                else:
                    os.write(1, filt.feed(decoder.decode(out.data)).encode())
            if not out.running and not out.output_open:
                break
        if failed and not isinstance(failed[0], E.SessionEnded):
            raise failed[0]
        session = None
        status = live.close()
        if status.exit_code is not None:
            return status.exit_code
        return 128 + status.signal if status.signal else 0
    except _Signalled as e:
        return 128 + e.signum
    finally:
        done.set()
        # The operator's terminal comes back as it was, whatever ended the session.
        termios.tcsetattr(0, termios.TCSADRAIN, saved)
        for signum, h in old_handlers.items():
            signal.signal(signum, h)
        try:
            if session is not None:
                session.close()  # kills what still runs there
        except E.SandmanError:
            pass  # the error or signal that got here is the one to report
        finally:
            sb.close()


def _remote(spec: str) -> tuple[str, str] | None:
    """`ID:/path` -> (ID, /path); a local path (no colon before the first slash) -> None."""
    head, sep, tail = spec.partition(":")
    if not sep or "/" in head or not head:
        return None
    if not tail.startswith("/"):
        raise CliError(f"cp: {spec!r}: a sandbox path must be absolute (ID:/path)", EXIT_USAGE)
    return head, tail


def cmd_cp(args: argparse.Namespace) -> int:
    src, dst = _remote(args.src), _remote(args.dst)
    if (src is None) == (dst is None):
        raise CliError("cp: exactly one of SRC and DST is in a sandbox (ID:/path)", EXIT_USAGE)
    if dst is not None:  # upload
        sid, remote = dst
        local = Path(args.src)
        sb = _connect(sid)
        try:
            if local.is_dir() and not local.is_symlink():
                res: Any = sb.upload_tree(str(local), remote)
            elif local.is_file():
                res = sb.write(remote, local.read_bytes(),
                               mode=stat.S_IMODE(local.stat().st_mode))
            else:
                raise CliError(f"cp: {args.src}: not a regular file or a directory", EXIT_USAGE)
        finally:
            sb.close()
    else:
        assert src is not None
        sid, remote = src
        sb = _connect(sid)
        try:
            if args.tree:
                res = sb.download_tree(remote, args.dst)
            else:
                data = sb.read(remote)
                target = Path(args.dst)
                if target.is_dir():
                    target = target / Path(remote).name
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o644)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                res = {"path": str(target), "size": len(data)}
        finally:
            sb.close()
    if args.output == "json":
        print(json.dumps(_jsonable(res) if not hasattr(res, "__dataclass_fields__")
                         else {k: getattr(res, k) for k in res.__dataclass_fields__
                               if k != "raw"}, default=str, sort_keys=True))
    return 0


# ---- the parser

def _egress(args: argparse.Namespace) -> str | dict[str, list[str]]:
    """--egress, or with --egress-allow the allowlist (which means egress deny)."""
    if not args.egress_allow:
        return str(args.egress)
    if args.egress != api.DEFAULT_EGRESS:
        raise E.BadRequest(f"--egress-allow needs --egress {api.DEFAULT_EGRESS}, not "
                           f"{args.egress!r}: an allowlist is what egress deny lets out")
    entries = [x.strip() for item in args.egress_allow for x in item.split(",")]
    return {api.EGRESS_ALLOW_KEY: entries}


def _size_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cpu", default=api.DEFAULT_CPU, help="CPU (requests == limits)")
    p.add_argument("--memory", default=api.DEFAULT_MEMORY, help="memory (requests == limits)")
    p.add_argument("--egress", default=api.DEFAULT_EGRESS, help="egress mode")
    p.add_argument("--egress-allow", action="append", default=[], metavar="ENTRY",
                   help="with egress deny, let out only to ENTRY (CIDR:PORT or "
                        "svc/NAME.NAMESPACE:PORT; repeatable or comma-separated)")
    p.add_argument("--role", default=api.DEFAULT_ROLE, help="agent or grading")


class UsageError(Exception):
    """argparse's refusal, raised instead of its exit(2): the CLI's usage code, and JSON under
    `-o json` like every other error."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:
        verb = self.prog[len(PROG):].strip()  # "sandman exec" -> "exec"
        raise UsageError(f"{verb}: {message}" if verb else message)


DEFAULTS = {"url": None, "token_file": None, "ca_file": None, "request_timeout": 30.0,
            "output": "table", "raw": False}


def _global_args(p: argparse.ArgumentParser, suppress: bool) -> None:
    """The global options, on the top parser and on each command's (there without defaults,
    so an option given before the command is not reset by the command's parser)."""
    kw: dict[str, Any] = {"default": argparse.SUPPRESS} if suppress else {}
    p.add_argument("--url", help="the controller (default $SANDMAN_URL)", **kw)
    p.add_argument("--token-file", help="bearer token file (default $SANDMAN_TOKEN_FILE)",
                   **kw)
    p.add_argument("--ca-file", help="the controller's CA (default $SANDMAN_CA_FILE)", **kw)
    p.add_argument("--request-timeout", type=float,
                   help="seconds per controller call (default 30)", **kw)
    p.add_argument("-o", "--output", choices=("table", "json"), **kw)
    p.add_argument("--raw", action="store_true",
                   help="the sandbox's output to a terminal as it came, control sequences "
                        "included", **kw)


def parser() -> argparse.ArgumentParser:
    ap = _Parser(prog=PROG, description="sandman's command-line client")
    _global_args(ap, suppress=False)
    ap.set_defaults(**DEFAULTS)
    ap.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = ap.add_subparsers(dest="verb", required=True, metavar="COMMAND")

    p = sub.add_parser("acquire", help="acquire a sandbox and keep its lease here")
    p.add_argument("image")
    p.add_argument("--job", required=True)
    _size_args(p)
    p.add_argument("--namespace", help="the tenant (default the caller's)")
    p.add_argument("--timeout", type=float, default=api.DEFAULT_ACQUIRE_TIMEOUT_S,
                   help="seconds to wait for a ready sandbox")
    p.add_argument("--lifetime", type=float, default=None,
                   help="seconds the sandbox lives unless renewed (default the controller's)")
    p.add_argument("--count", type=int, default=None,
                   help=f"a group: this many sandboxes (1 to {api.MAX_GROUP}) in one call, "
                        "all ready or none kept; prints one row each")
    p.set_defaults(func=cmd_acquire)

    p = sub.add_parser("fork", help="N new sandboxes holding a sandbox's state; keep their "
                                    "leases here")
    p.add_argument("id")
    p.add_argument("-n", type=int, required=True, help=f"children, 1 to {api.MAX_FORK}")
    p.add_argument("--timeout", type=float, default=api.DEFAULT_ACQUIRE_TIMEOUT_S,
                   help="seconds for the whole fork")
    p.set_defaults(func=cmd_fork)

    p = sub.add_parser("checkpoint", help="store sandboxes' state in the checkpoint "
                                          "registry; prints the checkpoint's id")
    p.add_argument("ids", nargs="*", help="sandbox ids (or --job)")
    p.add_argument("--job", help="every handed-out agent sandbox of the job")
    p.add_argument("--namespace", help="the job's tenant (default the caller's)")
    p.add_argument("--timeout", type=float, default=api.DEFAULT_ACQUIRE_TIMEOUT_S,
                   help="seconds for the whole checkpoint")
    p.set_defaults(func=cmd_checkpoint)

    p = sub.add_parser("restore", help="a checkpoint's sandboxes made anew; keep their "
                                       "leases here")
    p.add_argument("checkpoint")
    p.add_argument("--timeout", type=float, default=api.DEFAULT_ACQUIRE_TIMEOUT_S,
                   help="seconds for the whole restore")
    p.set_defaults(func=cmd_restore)

    p = sub.add_parser("pause", help="checkpoint a sandbox, then release it; prints the "
                                     "handle resume takes")
    p.add_argument("id")
    p.add_argument("--timeout", type=float, default=api.DEFAULT_ACQUIRE_TIMEOUT_S,
                   help="seconds for the checkpoint")
    p.set_defaults(func=cmd_pause)

    p = sub.add_parser("resume", help="a paused sandbox made anew; keep its lease here")
    p.add_argument("handle")
    p.add_argument("--timeout", type=float, default=api.DEFAULT_ACQUIRE_TIMEOUT_S,
                   help="seconds for the whole resume")
    p.set_defaults(func=cmd_resume)

    p = sub.add_parser("list", help="sandboxes the caller may list")
    p.add_argument("--job")
    p.add_argument("--namespace")
    p.set_defaults(func=cmd_list)

    for verb, fn, what in (("get", cmd_get, "one sandbox"), ("renew", cmd_renew,
                                                             "push a sandbox's expiry"),
                           ("release", cmd_release, "give a sandbox back")):
        p = sub.add_parser(verb, help=what)
        p.add_argument("id")
        if verb == "renew":
            p.add_argument("--lifetime", type=float, default=None)
        if verb == "release":
            p.add_argument("--reuse", action="store_true",
                           help="grading sandboxes: restore and return to the warm pool")
        p.set_defaults(func=fn)

    p = sub.add_parser("drain", help="release every sandbox of a job")
    p.add_argument("job")
    p.add_argument("--namespace")
    p.set_defaults(func=cmd_drain)

    p = sub.add_parser("stats", help="the controller's pacer and pools")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("prepull", help="pull images (by digest) onto the sandbox node pool; "
                                       "without images: the progress")
    p.add_argument("images", nargs="*", metavar="REPO@sha256:HEX")
    p.set_defaults(func=cmd_prepull)

    p = sub.add_parser("prewarm", help="set a warm pool's target")
    p.add_argument("image")
    p.add_argument("count", type=int)
    _size_args(p)
    p.add_argument("--idle-timeout", type=float, default=None)
    p.set_defaults(func=cmd_prewarm)

    # exec's and shell's COMMAND is cut off before argparse sees it (split_command).
    p = sub.add_parser("exec", help="run a command in a sandbox, streaming",
                       usage=f"{PROG} exec ID [options] [--] COMMAND ...")
    p.add_argument("id")
    p.add_argument("--timeout", type=float, default=None, help="wall seconds")
    p.add_argument("--idle-timeout", type=float, default=None,
                   help="seconds without output that end the command")
    p.set_defaults(func=cmd_exec)

    p = sub.add_parser("shell", help="an interactive terminal in a sandbox (default bash)",
                       usage=f"{PROG} shell ID [options] [-- COMMAND ...]")
    p.add_argument("id")
    p.set_defaults(func=cmd_shell)

    p = sub.add_parser("cp", help="copy a file or a tree in or out (ID:/path on one side)")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--tree", action="store_true",
                   help="download: SRC is a directory, DST the local directory to fill")
    p.set_defaults(func=cmd_cp)

    p = sub.add_parser("completion", help="print a completion script: "
                                          "eval \"$(sandman completion bash)\"")
    p.add_argument("shell", choices=("bash", "zsh"))
    p.set_defaults(func=cmd_completion)
    for p in sub.choices.values():
        _global_args(p, suppress=True)
    return ap


COMMAND_VERBS = ("exec", "shell")


def split_command(ap: argparse.ArgumentParser, argv: list[str]) -> tuple[list[str], list[str]]:
    """(sandman's own words, the command's) for `exec` and `shell`: the command starts after
    `--`, or at exec's first word after the id that is neither an option nor an option's
    value. Options may come anywhere before it; a command's own options need the `--`
    only when they come first. Other commands: (argv, [])."""
    takes_value: set[str] = set()
    verbs: dict[str, argparse.ArgumentParser] = {}
    for action in ap._actions:
        if isinstance(action, argparse._SubParsersAction):
            verbs = dict(action.choices)
        elif action.nargs != 0:
            takes_value |= set(action.option_strings)
    verb = None
    words = 0  # positional words after the verb (exec's id)
    i = 0
    while i < len(argv):
        w = argv[i]
        if w == "--":
            if verb in COMMAND_VERBS:
                return argv[:i], argv[i + 1:]
            return argv, []
        if w.startswith("-") and w != "-":
            if "=" not in w and w in takes_value:
                i += 1
            i += 1
            continue
        if verb is None:
            verb = w
            if verb not in COMMAND_VERBS:
                return argv, []
            sp = verbs[verb]
            takes_value |= {s for a in sp._actions if a.nargs != 0 for s in a.option_strings}
        elif words == 0:
            words = 1
        elif verb == "exec":
            return argv[:i], argv[i:]
        else:
            i += 1
            continue  # shell takes its command after `--` only: argparse refuses the rest
        i += 1
    return argv, []


# ---- completion: a script of the parser's own words, so it never lags the commands

def _words(ap: argparse.ArgumentParser) -> tuple[list[str], dict[str, list[str]]]:
    top: list[str] = []
    verbs: dict[str, list[str]] = {}
    for action in ap._actions:
        if isinstance(action, argparse._SubParsersAction):
            for verb, sp in action.choices.items():
                verbs[verb] = sorted({s for a in sp._actions for s in a.option_strings
                                      if s.startswith("--")} - {"--help"})
        else:
            top += [s for s in action.option_strings if s.startswith("--")]
    return sorted(set(top) - {"--help"}), verbs


def completion_script(shell: str) -> str:
    ap = parser()
    top, verbs = _words(ap)
    valued = "|".join(sorted(s for a in ap._actions if a.nargs != 0 and a.option_strings
                             and not isinstance(a, argparse._VersionAction)
                             for s in a.option_strings))
    cases = "\n".join(f'        {v}) opts="{" ".join(o)}" ;;' for v, o in verbs.items())
    bash = f"""# {PROG} completion (bash): eval "$({PROG} completion bash)"
_{PROG}_complete() {{
    local cur verb i opts
    cur="${{COMP_WORDS[COMP_CWORD]}}"
    verb=""
    for ((i = 1; i < COMP_CWORD; i++)); do
        case "${{COMP_WORDS[i]}}" in
            --) return 0 ;;
            {valued}) ((i++)) ;;
            -*) ;;
            *) verb="${{COMP_WORDS[i]}}"; break ;;
        esac
    done
    case "$verb" in
{cases}
        "") if [[ "$cur" == -* ]]; then
                COMPREPLY=($(compgen -W "{" ".join(top)}" -- "$cur"))
            else
                COMPREPLY=($(compgen -W "{" ".join(verbs)}" -- "$cur"))
            fi
            return 0 ;;
        *) opts="" ;;
    esac
    if [[ "$cur" == -* ]]; then
        COMPREPLY=($(compgen -W "$opts" -- "$cur"))
    else
        COMPREPLY=($(compgen -f -- "$cur"))
    fi
}}
complete -F _{PROG}_complete {PROG}
"""
    if shell == "zsh":
        return ("# sandman completion (zsh): eval \"$(sandman completion zsh)\"\n"
                "autoload -U +X bashcompinit && bashcompinit\n" + bash)
    return bash


def cmd_completion(args: argparse.Namespace) -> int:
    sys.stdout.write(completion_script(args.shell))
    return 0


def _fail(json_out: bool, e: BaseException, message: str, code: int) -> int:
    message = neutral(" ".join(message.split())) or type(e).__name__
    print(f"{PROG}: error: {message}", file=sys.stderr)
    if json_out:
        print(json.dumps({"error": {"type": type(e).__name__, "message": message,
                                    "exit_code": code}}))
    return code


def _wants_json(argv: list[str]) -> bool:
    """-o json anywhere before the command, for errors found before parsing ends."""
    for i, w in enumerate(argv):
        if w == "--":
            break
        if w in ("-o", "--output") and argv[i + 1:i + 2] == ["json"]:
            return True
        if w in ("-ojson", "--output=json"):
            return True
    return False


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    ap = parser()
    own, command = split_command(ap, words)
    json_out = _wants_json(own)
    try:
        args = ap.parse_args(own)
    except UsageError as e:
        if not json_out:
            ap.print_usage(sys.stderr)
        return _fail(json_out, e, str(e), EXIT_USAGE)
    args.command = command
    json_out = args.output == "json"
    try:
        if command and args.verb not in COMMAND_VERBS:
            raise CliError(f"{args.verb} takes no command after --", EXIT_USAGE)
        return int(args.func(args))
    except (KeyboardInterrupt, BrokenPipeError) as e:
        if isinstance(e, BrokenPipeError):
            return EXIT_OTHER
        return _fail(json_out, e, "interrupted", EXIT_INTERRUPTED)
    except (CliError, E.SandmanError) as e:
        return _fail(json_out, e, str(e), exit_code(e))
    except OSError as e:
        msg = f"{e.strerror or e}: {e.filename or ''}".rstrip(": ")
        return _fail(json_out, e, msg, EXIT_OTHER)


if __name__ == "__main__":
    sys.exit(main())
