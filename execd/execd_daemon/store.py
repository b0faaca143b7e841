"""The baseline's store: a 0700 directory of copies of the watched files' content.

The store is writable by the holder's uid (execd's own), so nothing in it is opened by name:
everything is opened relative to the directory fds taken when the store is made, without
following a link or blocking on a FIFO, and read only once fstat says it is a regular file.
A copy replaced by anything else (or renamed away, or altered: its hash stays in execd's
memory) fails the restore, which retires the pod, and never blocks it."""

import errno
import os
import shutil
import stat
import time

from .base import now, sha256

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC



def copy_hashed(src, dst):
    """Copy fd `src` to fd `dst` to its end; the SHA-256 of what was copied (hex)."""
    h = sha256()
    while True:
        chunk = os.read(src, 1 << 20)
        if not chunk:
            return h.hexdigest()
        h.update(chunk)
        os.write(dst, chunk)

class Store(object):
    def __init__(self, path):
        self.path = os.path.realpath(path)
        self.fd = self.blobs_fd = None  # the store and its blobs dir, held from the reset
        self.stored_bytes = 0
        self.blobs = 0

    def reset(self):
        """An empty store (a new baseline); the directory fds are taken here, once."""
        for fd in (self.fd, self.blobs_fd):
            if fd is not None:
                os.close(fd)
        self.fd = self.blobs_fd = None
        if os.path.lexists(self.path):
            shutil.rmtree(self.path)
        os.makedirs(os.path.join(self.path, "blobs"), 0o700)
        os.chmod(self.path, 0o700)
        self.fd = os.open(self.path, _DIR)
        self.blobs_fd = os.open("blobs", _DIR, dir_fd=self.fd)
        self.stored_bytes = self.blobs = 0

    def copy(self, path, ent, copy_cap, store_cap):
        """Copy a regular file's content into the store; the copy counts only if the file did
        not change while it was read."""
        if ent.size > copy_cap:
            ent.why = "over the %d-byte copy cap" % copy_cap
            return
        if self.stored_bytes + ent.size > store_cap:
            ent.why = "store cap (%d bytes) reached" % store_cap
            return
        self.blobs += 1
        name = "%x" % self.blobs
        try:
            src = os.open(path, _READ)
        except OSError as e:
            ent.why = "unreadable at baseline: %s" % e.strerror
            return
        try:
            dst = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                          | os.O_CLOEXEC, 0o600, dir_fd=self.blobs_fd)
            try:
                digest = copy_hashed(src, dst)
            finally:
                os.close(dst)
            st = os.fstat(src)
        except OSError as e:
            ent.why = "copy failed: %s" % e.strerror
            return
        finally:
            os.close(src)
        if not ent.same(st):
            ent.why = "changed while it was copied"
            os.unlink(name, dir_fd=self.blobs_fd)
            return
        # The hash stays in execd's memory: a copy altered in the store (an agent running as
        # execd's user can reach it) is refused at restore instead of written back.
        ent.blob = (name, digest)
        self.stored_bytes += ent.size

    def open_blob(self, name):
        """A read fd of a stored copy, or OSError where it is no longer a regular file."""
        # lstat first: opening a device node can act (a tty's open), a FIFO's would block
        if not stat.S_ISREG(os.stat(name, dir_fd=self.blobs_fd, follow_symlinks=False).st_mode):
            raise OSError(errno.EINVAL, "the stored copy is not a regular file")
        fd = os.open(name, _READ, dir_fd=self.blobs_fd)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(errno.EINVAL, "the stored copy is not a regular file")
        return fd

    def tick(self):
        """Wait until the file system's clock moved past now, so a change made right after
        this cannot carry the ctime just recorded (git's "racy clean" problem). Whatever the
        holder planted at the probe's name is removed, never written through."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(".tick", flags, 0o600, dir_fd=self.fd)
        except OSError:
            os.unlink(".tick", dir_fd=self.fd)  # a link or a FIFO without a reader
            fd = os.open(".tick", flags | os.O_EXCL, 0o600, dir_fd=self.fd)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file", ".tick")
            first = os.fstat(fd).st_ctime_ns
            deadline = now() + 1
            while now() < deadline:
                time.sleep(0.001)
                os.utime(fd)
                if os.fstat(fd).st_ctime_ns != first:
                    break
        finally:
            os.close(fd)
