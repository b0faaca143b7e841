"""Extended attributes (ACLs are system.posix_acl_access and _default) and hard links, for
checked reuse. A directory's attributes are compared where its ctime moved (an xattr change
moves it, as its entries do); a file's move its ctime, so the file is rewritten, and the
rewrite carries the baseline's attributes back; a symlink's (trusted.*, security.*) too, where
its ctime moved and its target did not. A file with more than one name at baseline
cannot be rewritten without splitting it: the restore leaves it, which retires the pod."""

import errno
import os


def read(path):
    """((name, value), ...) sorted, () where the filesystem has none; None if unreadable."""
    try:
        names = os.listxattr(path, follow_symlinks=False)
        return tuple(sorted((n, os.getxattr(path, n, follow_symlinks=False)) for n in names))
    except OSError as e:
        return () if e.errno in (errno.ENOTSUP, errno.EOPNOTSUPP) else None


def change(path, want, area):
    """/diff's entry (kind "xattr", the names added, removed or changed) or None."""
    got = read(path)
    if got == want:
        return None
    a, b = dict(want or ()), dict(got or ())
    names = sorted(n for n in set(a) | set(b) if a.get(n) != b.get(n))
    return {"kind": "xattr", "path": path, "area": area,
            "names": names if got is not None and want is not None else ["(unreadable)"]}


def put_back(path, want):
    """Make the attributes of `path` the baseline's; why not, or None."""
    got = read(path)
    if want is None or got is None:
        return "extended attributes unreadable"
    if got == want:
        return None
    keep = dict(want)
    try:
        for n, _ in got:
            if n not in keep:
                os.removexattr(path, n, follow_symlinks=False)
        for n, v in want:
            if dict(got).get(n) != v:
                os.setxattr(path, n, v, follow_symlinks=False)
    except OSError as e:
        return "extended attribute cannot be set back: %s" % e.strerror
    return None
