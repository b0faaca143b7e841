"""`sandman`: the command-line client (the client distribution's entry point; also
`python3 -m sandman.client`). It reads the same environment as `Client()` ($SANDMAN_URL,
$SANDMAN_TOKEN_FILE, $SANDMAN_CA_FILE; `--url`, `--token-file`, `--ca-file` override them).

    sandman acquire IMAGE --job JOB [--cpu 1] [--memory 1Gi] [--lifetime 3600]
    sandman fork ID -n N
    sandman checkpoint (--job JOB | ID ...) | restore CHECKPOINT
    sandman exec ID [--timeout S] [--idle-timeout S] -- COMMAND ...
    sandman cp [ID:]SRC [ID:]DST
    sandman list [--job JOB] | get ID | renew ID | release ID | drain JOB | stats
    sandman prewarm IMAGE COUNT

`acquire` (and `fork`, for each child) keeps the controller's answer (it holds execd's token) in the lease directory, one
file per sandbox, readable by this user only; `exec` and `cp` use it, `release` removes it.
Output is a table, or JSON with `-o json`. Every error is one line on stderr and an exit code
per error type (EXIT_CODES); `exec` exits with the command's own status.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import stat
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

from sandman import api
from sandman.client import errors as E
from sandman.client._sync.client import Client
from sandman.client._sync.sandbox import Sandbox
from sandman.client.models import ExecResult, Lease

ENV_LEASE_DIR = "SANDMAN_LEASE_DIR"
PROG = "sandman"

# Exit codes by error type, most specific first (a class's subclasses come before it). 2 is
# argparse's own for bad usage; `exec` passes the command's status through (0-255), so a
# script cannot tell these apart from the command's there: `-o json` carries the kind.
EXIT_CODES: tuple[tuple[type[BaseException], int], ...] = (
    (E.ConfigurationError, 3),
    (E.BadRequest, 2),
    (E.SandboxGone, 4),
    (E.CheckpointGone, 4),
    (E.FileNotFound, 4),
    (E.ProcessNotFound, 4),
    (E.Unauthenticated, 5),
    (E.Forbidden, 5),
    (E.Unauthorized, 5),
    (E.ControllerUnreachable, 6),
    (E.SandboxUnreachable, 6),
    (E.AcquireTimeout, 7),
    (E.CommandTimeout, 7),
    (E.QueueFull, 8),
    (E.TreeError, 9),
    (E.SandmanError, 1),
)
EXIT_NO_LEASE = 4  # `exec`/`cp` on an id this machine holds no lease for: not found here


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
    return 1


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
                       f"0700 (it holds execd tokens)", 3)
    return d


# The controller's ids are hex (controller/core.py); a lease file is named after one, so an id
# is a plain name, never a path (`../x`, `/etc/x`, `.hidden`).
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")


def _lease_path(d: Path, sandbox_id: str) -> Path:
    if not _ID.fullmatch(sandbox_id):
        raise CliError(f"{sandbox_id[:80]!r} is not a sandbox id", 2)
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
        raise CliError(f"no lease for {sandbox_id} in {lease_dir()}: exec and cp reach "
                       f"sandboxes acquired here with `{PROG} acquire`", EXIT_NO_LEASE) from None
    except OSError as e:
        raise CliError(f"lease {path}: {e.strerror}", 3) from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise CliError(f"lease {path} must be owned by this user with mode 0600", 3)
        raw = f.read(1 << 20)
    try:
        return Lease.from_json(json.loads(raw))
    except (ValueError, E.SandmanError) as e:
        raise CliError(f"lease {path} is not an acquire's answer: {e}", 3) from None


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


def emit(args: argparse.Namespace, obj: Any, table: Callable[[], list[list[str]]]) -> None:
    if args.output == "json":
        print(json.dumps(_jsonable(obj), indent=2, sort_keys=True, default=str))
        return
    rows = table()
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


def cmd_fork(args: argparse.Namespace) -> int:
    with _client(args) as c:
        kept = _keep_all(c, c.fork(args.id, args.n, timeout_s=args.timeout, renew=False))
    emit(args, [{"id": lease.id, "pod": lease.pod, "expires_at": lease.expires_at,
                 "lease_file": str(path)} for lease, path in kept],
         lambda: [["ID", "POD", "EXPIRES"]] + [[lease.id, lease.pod, str(lease.expires_at)]
                                               for lease, _ in kept])
    return 0


def cmd_checkpoint(args: argparse.Namespace) -> int:
    if bool(args.job) == bool(args.ids):
        raise CliError("checkpoint: --job JOB or sandbox ids, one of the two", 2)
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


def cmd_exec(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise CliError("exec: give the command after the sandbox id (sandman exec ID -- CMD)", 2)
    # One argument is a shell line as typed; several are joined as the shell would read them.
    line = command[0] if len(command) == 1 else " ".join(shlex.quote(c) for c in command)
    sb = _connect(args.id)
    result: ExecResult | None = None
    try:
        for part in sb.stream(line, timeout=args.timeout, idle_timeout=args.idle_timeout):
            if isinstance(part, str):
                sys.stdout.write(part)
                sys.stdout.flush()
            else:
                result = part
    finally:
        sb.close()
    if result is None:
        raise E.ProtocolError("exec: the stream ended without the command's status")
    if args.output == "json":
        print(json.dumps({"exit_code": result.exit_code, "error": result.error,
                          "timed_out": result.timed_out}))
    elif result.error:
        print(f"{PROG}: exec: {result.error}", file=sys.stderr)
    return result.exit_code


def _remote(spec: str) -> tuple[str, str] | None:
    """`ID:/path` -> (ID, /path); a local path (no colon before the first slash) -> None."""
    head, sep, tail = spec.partition(":")
    if not sep or "/" in head or not head:
        return None
    if not tail.startswith("/"):
        raise CliError(f"cp: {spec!r}: a sandbox path must be absolute (ID:/path)", 2)
    return head, tail


def cmd_cp(args: argparse.Namespace) -> int:
    src, dst = _remote(args.src), _remote(args.dst)
    if (src is None) == (dst is None):
        raise CliError("cp: exactly one of SRC and DST is in a sandbox (ID:/path)", 2)
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
                raise CliError(f"cp: {args.src}: not a regular file or a directory", 2)
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


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description="sandman's command-line client")
    ap.add_argument("--url", help="the controller (default $SANDMAN_URL)")
    ap.add_argument("--token-file", help="bearer token file (default $SANDMAN_TOKEN_FILE)")
    ap.add_argument("--ca-file", help="the controller's CA (default $SANDMAN_CA_FILE)")
    ap.add_argument("--request-timeout", type=float, default=30.0,
                    help="seconds per controller call (default 30)")
    ap.add_argument("-o", "--output", choices=("table", "json"), default="table")
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

    p = sub.add_parser("exec", help="run a command in a sandbox acquired here, streaming")
    p.add_argument("id")
    p.add_argument("--timeout", type=float, default=None, help="wall seconds")
    p.add_argument("--idle-timeout", type=float, default=None,
                   help="seconds without output that end the command")
    p.add_argument("command", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_exec)

    p = sub.add_parser("cp", help="copy a file or a tree in or out (ID:/path on one side)")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--tree", action="store_true",
                   help="download: SRC is a directory, DST the local directory to fill")
    p.set_defaults(func=cmd_cp)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except (CliError, E.SandmanError) as e:
        msg = " ".join(str(e).split()) or type(e).__name__
        print(f"{PROG}: error: {msg}", file=sys.stderr)
        return exit_code(e)
    except OSError as e:
        print(f"{PROG}: error: {e.strerror or e}: {e.filename or ''}".rstrip(": "),
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
