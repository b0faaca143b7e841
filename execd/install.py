"""Put execd into a sandbox's shared volume: `python3 -m execd.install DIR`, or `install(DIR)`
from netguard's `--install-execd DIR` (a guarded sandbox has one injected init container that
applies the guard and then installs execd; an unguarded one runs this module alone).

What DIR holds afterwards, all read-only (0444):
- `execd_daemon/`: the daemon package, each module as the image has it and its bytecode from
  the image's `pip install` (same mtime, so a task image whose python3 is the sandman image's
  minor version loads it; any other compiles the source at start).
- `execd.py`: the launcher the sandbox container runs (this package's execd.py), written last,
  so the file the main container runs appears only once the rest is in place.
- `run/`: netguard's status directory (the sandbox container mounts DIR read-only, so it must
  exist before).

Standard library only, like the daemon.
"""

import errno
import os
import stat
import sys

DAEMON = "execd_daemon"
LAUNCHER = "execd.py"


def bytecode_path(src: str):
    """importlib.util.cache_from_source(src) for this interpreter (its cache tag, -O level and
    pycache prefix), or None when it caches no bytecode. Written out because importing
    importlib.util (and contextlib with it) is CPU on netguard's hot path, paid under the
    sandbox's quota at every guarded start; tests/execd/test_install.py holds the two equal."""
    tag = sys.implementation.cache_tag
    if tag is None:
        return None
    base = os.path.basename(src)
    name = base.rpartition(".")[0] or base
    opt = sys.flags.optimize
    filename = name + "." + tag + (".opt-" + str(opt) if opt else "") + ".pyc"
    head = os.path.dirname(src)
    prefix = getattr(sys, "pycache_prefix", None)
    if prefix is None:
        return os.path.join(head, "__pycache__", filename)
    if not os.path.isabs(head):
        head = os.path.join(os.getcwd(), head)
    return os.path.join(prefix, head.lstrip(os.sep), filename)


def _put(data: bytes, dst: str, mtime_of: str = "") -> None:
    """Write `data` to dst through a temporary name beside it, read-only, then rename it into
    place (a reader sees the old file or the new one). The temporary file is created new, never
    through a link (O_EXCL | O_NOFOLLOW): the install runs as the guard, root. With `mtime_of`,
    dst takes that file's mtime (the bytecode's check on its source)."""
    tmp = dst + ".tmp"
    try:
        os.unlink(tmp)  # a read-only leftover of a restarted init container
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o444)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    if mtime_of:
        st = os.stat(mtime_of)
        os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(tmp, dst)


def _mkdir(path: str) -> None:
    """A directory of the install, made if missing; never one reached through a link (the
    install runs as the guard, root), and never its parents (DIR must exist)."""
    try:
        os.mkdir(path, 0o755)
    except FileExistsError:
        pass
    if not stat.S_ISDIR(os.lstat(path).st_mode):
        raise OSError(errno.ENOTDIR, "not a directory", path)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def install(directory: str) -> list:
    """Install execd into `directory` (which must exist); returns the paths written, the
    launcher last. Raises OSError when a file cannot be written."""
    here = os.path.dirname(os.path.abspath(__file__))
    src_pkg = os.path.join(here, DAEMON)
    pkg = os.path.join(directory, DAEMON)
    tag = sys.implementation.cache_tag
    written = []
    _mkdir(pkg)
    for name in sorted(os.listdir(src_pkg)):
        if not name.endswith(".py"):
            continue
        src = os.path.join(src_pkg, name)
        dst = os.path.join(pkg, name)
        _put(_read(src), dst, mtime_of=src)
        written.append(dst)
        pyc = bytecode_path(src)
        if pyc is not None and os.path.exists(pyc):
            cache = os.path.join(pkg, "__pycache__")
            _mkdir(cache)
            dst = os.path.join(cache, name[:-3] + "." + tag + ".pyc")
            _put(_read(pyc), dst)
            written.append(dst)
    os.makedirs(os.path.join(directory, "run"), exist_ok=True)

    launcher = os.path.join(directory, LAUNCHER)
    _put(_read(os.path.join(here, LAUNCHER)), launcher)
    written.append(launcher)
    return written


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python3 -m execd.install DIR", file=sys.stderr)
        return 2
    try:
        written = install(args[0])
    except OSError as e:
        print(f"execd install: cannot install into {args[0]}: {e}", file=sys.stderr)
        return 1
    print(f"execd install: {len(written)} files in {args[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
