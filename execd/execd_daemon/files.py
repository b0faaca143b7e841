"""Files byte-exactly: paths resolved inside --root, regular files only, writes through a
temporary name and a rename, with an optional compare-and-swap on the content's hash."""

import base64
import binascii
import errno
import os
import re
import stat

from .base import _SHA256_HEX, sha256
from .wire import HTTPError, json_bytes, still_authorized


def resolve_path(d, path, for_write=False):
    if not isinstance(path, str) or not path:
        raise HTTPError(400, "path must be a non-empty string")
    if "\0" in path:
        raise HTTPError(400, "path contains a NUL byte")
    if not os.path.isabs(path):
        base = None
        if d.shell is not None:
            try:
                base = os.readlink("/proc/%d/cwd" % d.shell.pid)
            except OSError:
                base = None
        path = os.path.join(base or d.start_dir, path)
    real = os.path.realpath(path)
    root = d.root
    if root != "/" and real != root and not real.startswith(root + "/"):
        raise HTTPError(403, "path is outside the filesystem root %s" % root, {"path": real})
    return real


def open_regular(real):
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise HTTPError(404, "no such file", {"path": real}) from None
    except IsADirectoryError:
        raise HTTPError(400, "not a regular file (directory)", {"path": real}) from None
    except PermissionError:
        raise HTTPError(403, "permission denied", {"path": real}) from None
    except OSError as e:
        raise HTTPError(400, "cannot open: %s" % (e.strerror or e), {"path": real}) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise HTTPError(400, "not a regular file (%s)" % file_kind(st.st_mode), {"path": real})
    os.set_blocking(fd, True)
    return fd, st


def file_kind(mode):
    for test, name in ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "fifo"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISSOCK, "socket"), (stat.S_ISLNK, "symlink")):
        if test(mode):
            return name
    return "unknown"


def file_sha256(real):
    try:
        fd, st = open_regular(real)
    except HTTPError as e:
        if e.code == 404:
            return None
        raise
    h = sha256()
    left = st.st_size  # bounded even if a writer keeps appending
    try:
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            h.update(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    return h.hexdigest()


def write_file(d, req):
    real = resolve_path(d, req.get("path"), for_write=True)
    b64 = req.get("data_b64")
    if not isinstance(b64, str):
        raise HTTPError(400, "data_b64 must be a base64 string")
    try:
        data = base64.b64decode(b64.encode("ascii"), validate=True)
    except (binascii.Error, ValueError, UnicodeEncodeError):
        raise HTTPError(400, "data_b64 is not valid base64") from None
    mode = req.get("mode")
    if mode is not None:
        if isinstance(mode, str) and re.fullmatch(r"0?o?[0-7]{1,4}", mode):
            mode = int(mode.replace("o", ""), 8)
        if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o7777:
            raise HTTPError(400, "mode must be an integer 0-4095 or an octal string")
    want = req.get("if_sha256")
    if want is not None and (not isinstance(want, str) or not _SHA256_HEX.match(want.lower())):
        raise HTTPError(400, "if_sha256 must be a SHA-256 hex digest")
    with d.files_lock:
        still_authorized(d)
        try:
            st = os.stat(real)
        except FileNotFoundError:
            st = None
        except OSError as e:
            raise HTTPError(400, "cannot stat: %s" % e.strerror, {"path": real}) from None
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise HTTPError(400, "not a regular file (%s)" % file_kind(st.st_mode),
                            {"path": real})
        if want is not None:
            cur = file_sha256(real) if st is not None else None
            if cur != want.lower():
                raise HTTPError(409, "file changed: its SHA-256 differs from if_sha256",
                                {"path": real, "sha256": cur})
        parent = os.path.dirname(real)
        if not os.path.isdir(parent):
            raise HTTPError(404, "parent directory does not exist", {"path": real})
        import tempfile  # here, not at start (the imports at the top say why)

        try:
            fd, tmp = tempfile.mkstemp(prefix=".execd-", dir=parent)
        except OSError as e:
            raise HTTPError(403 if e.errno in (errno.EACCES, errno.EROFS) else 400,
                            "cannot create a file in %s: %s" % (parent, e.strerror)) from None
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if st is not None:
                if (st.st_uid, st.st_gid) != (os.getuid(), os.getgid()):
                    try:
                        os.fchown(fd, st.st_uid, st.st_gid)
                    except OSError:
                        pass
                os.fchmod(fd, stat.S_IMODE(st.st_mode) if mode is None else mode)
            else:
                os.fchmod(fd, (0o666 & ~d.umask) if mode is None else mode)
            os.close(fd)
            fd = -1
            os.replace(tmp, real)
        except OSError as e:
            if fd >= 0:
                os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise HTTPError(400, "write failed: %s" % (e.strerror or e), {"path": real}) from None
    return {"path": real, "size": len(data), "sha256": sha256(data).hexdigest()}


def _r_files_write(handler, query):
    handler.reply(200, write_file(handler.daemon, handler.json_body()))


def _r_files_read(handler, query):
    """Streams {"data_b64": ..., "size": n, "sha256": ...}: one pass over the file, the
    hash covers exactly the bytes sent."""
    req = handler.json_body()
    real = resolve_path(handler.daemon, req.get("path"))
    fd, st = open_regular(real)
    try:
        size = st.st_size
        prefix = b'{"path":' + json_bytes(real) + b',"data_b64":"'
        suffix_len = len(b'","size":%d,"sha256":"' % size) + 64 + 2
        length = len(prefix) + 4 * ((size + 2) // 3) + suffix_len
        handler.send_raw(200, prefix, "application/json", length=length)
        h = sha256()
        left = size
        while left > 0:
            chunk = os.read(fd, min(left, 3 << 18))  # multiple of 3: base64 joins cleanly
            if not chunk:
                break
            if len(chunk) % 3 and len(chunk) < left:
                more = os.read(fd, 3 - len(chunk) % 3)
                chunk += more
            h.update(chunk)
            left -= len(chunk)
            handler.wfile.write(base64.b64encode(chunk))
        if left:
            # The file shrank while we sent it: cut the response so the client sees it.
            handler.close_connection = True
            return
        handler.wfile.write(b'","size":%d,"sha256":"%s"}' % (size, h.hexdigest().encode()))
    finally:
        os.close(fd)


def _r_files_get(handler, query):
    path = query.get("path")
    real = resolve_path(handler.daemon, path[-1] if path else None)
    fd, st = open_regular(real)
    try:
        size = st.st_size
        h = sha256()
        left = size
        while left > 0:  # pass 1: the hash header must precede the body
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            h.update(chunk)
            left -= len(chunk)
        if left:
            raise HTTPError(409, "file changed while reading", {"path": real})
        digest = h.hexdigest()
        os.lseek(fd, 0, os.SEEK_SET)
        handler.send_raw(200, b"", "application/octet-stream", length=size,
                      headers=[("X-Content-SHA256", digest)])
        h2 = sha256()
        left = size
        while left > 0:  # pass 2 streams; a file changed in between cuts the connection
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            h2.update(chunk)
            left -= len(chunk)
            if left == 0 and h2.hexdigest() != digest:
                handler.close_connection = True
                return
            handler.wfile.write(chunk)
        if left:
            handler.close_connection = True
    finally:
        os.close(fd)
