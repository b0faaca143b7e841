"""Where a tree's symlinks lead, judged as the kernel would follow them: component by
component, each directory opened from the one above with O_NOFOLLOW, over several trees seen
as one (an upload's staging directory over its target as it is on disk)."""

import errno
import os

TREE_LINK_HOPS = 40  # symlinks followed while checking where one leads (the kernel's limit)
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
# Judging a link only looks: O_PATH (Linux) opens a directory that can be traversed but not
# read, as the kernel's own lookup would go through it.
LOOK_FLAGS = DIR_FLAGS | getattr(os, "O_PATH", 0)
TREE_LOOK_FDS = 32  # directory levels a TreeView holds open at once; deeper ones are reopened


def _tree_open(fd, name, flags):
    if fd < 0:
        return -1
    try:
        return os.open(name, flags, dir_fd=fd)
    except OSError:
        return -1


class TreeView(object):
    """One path below `roots`, fds on the tops of trees seen as one: the first's entry wins
    and a directory in several is one merged directory (tree_merge's rules: the staging
    directory over the target). Each level is opened from the one above with O_NOFOLLOW, so
    nothing is followed that look() does not report; at most TREE_LOOK_FDS levels held, a
    closed one reopened from the nearest held above it. `hide`: a name at the top taken as
    missing. The roots stay the caller's."""

    def __init__(self, roots, hide=None, flags=LOOK_FLAGS):
        self.hide = hide
        self.flags = flags
        self.names = []  # the path below the top
        self.levels = [list(roots)]  # per level, an fd per root (-1: none); None once closed

    def fds(self):
        """The current level's fds (reopened if closed)."""
        i = len(self.levels) - 1
        while self.levels[i] is None:
            i -= 1
        for k in range(i + 1, len(self.levels)):
            self.levels[k] = [_tree_open(fd, self.names[k - 1], self.flags)
                              for fd in self.levels[k - 1]]
        self._cap()
        return self.levels[-1]

    def _cap(self):
        held = [k for k in range(1, len(self.levels)) if self.levels[k] is not None]
        for k in held[:max(0, len(held) - TREE_LOOK_FDS)]:
            self._close(k)

    def _close(self, k):
        for fd in self.levels[k] or ():
            if fd >= 0:
                os.close(fd)
        self.levels[k] = None

    def look(self, name):
        """`name` at the current level: True (a directory: the view went down into it), its
        target (a symlink), or None (missing, a file, or not to be looked into)."""
        fds = self.fds()
        if len(self.levels) == 1 and name == self.hide:
            return None
        for i, fd in enumerate(fds):
            if fd < 0:
                continue
            try:
                nfd = os.open(name, self.flags, dir_fd=fd)
            except OSError as e:
                if e.errno == errno.ENOENT:
                    continue
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    try:
                        return os.readlink(name, dir_fd=fd)
                    except OSError:
                        return None  # a file (or gone meanwhile)
                return None
            new = [-1] * len(fds)
            new[i] = nfd
            for j in range(i + 1, len(fds)):
                new[j] = _tree_open(fds[j], name, self.flags)
            self.names.append(name)
            self.levels.append(new)
            self._cap()
            return True
        return None

    def up(self):
        self._close(len(self.levels) - 1)
        self.levels.pop()
        self.names.pop()

    def close(self):
        while len(self.levels) > 1:
            self.up()


def tree_symlinks(root_fd, skip):
    """(parts, target) of every symlink under root_fd, never through one; iterative, at most
    TREE_LOOK_FDS directory fds held. Names at the top starting with `skip` are left out
    (staging directories: what is in them is judged by their own upload)."""
    view = TreeView([root_fd], flags=DIR_FLAGS)
    out = []
    todo = [(0, None)]  # (depth, name): back up to depth, then down into name
    try:
        while todo:
            depth, name = todo.pop()
            while len(view.names) > depth:
                view.up()
            if name is not None and view.look(name) is not True:
                continue  # changed meanwhile
            fd = view.fds()[0]
            if fd < 0:
                continue
            try:
                with os.scandir(fd) as it:
                    for e in it:
                        if not view.names and e.name.startswith(skip):
                            continue
                        if e.is_symlink():
                            try:
                                out.append((view.names + [e.name],
                                            os.readlink(e.name, dir_fd=fd)))
                            except OSError:
                                pass
                        elif e.is_dir(follow_symlinks=False):
                            todo.append((len(view.names), e.name))
            except OSError:
                continue  # unreadable: what is below it was not written by us either
    finally:
        view.close()
    return out


def tree_link_escapes(roots, link_parts, target, hops=TREE_LINK_HOPS, hide=None):
    """Whether following the symlink at link_parts to `target` ends outside the tree. `roots`:
    an fd on the tree's top, or several seen as one merged tree (TreeView: the staging
    directory over the target as it is on disk). Resolved component by component, each level
    opened from the one above with O_NOFOLLOW and each link read where it is, so a chain
    (s -> ., l -> s/s/../..) is judged as the kernel would follow it, whether its links come
    from this archive, an earlier one or the agent. `hide`: a name at the top taken as missing
    (the staging directory itself)."""
    if not target or target.startswith("/"):
        return True
    view = TreeView(roots if isinstance(roots, (list, tuple)) else [roots], hide)
    lost = 0  # components below the last directory found (missing, or a file): lexical
    try:
        for p in link_parts[:-1]:
            if lost or view.look(p) is not True:
                lost += 1
        todo = target.split("/")[::-1]
        while todo:
            p = todo.pop()
            if p in ("", "."):
                continue
            if p == "..":
                if lost:
                    lost -= 1
                elif not view.names:
                    return True
                else:
                    view.up()
                continue
            if lost:
                lost += 1
                continue
            got = view.look(p)
            if got is None:
                lost += 1  # missing: nothing below it is a link, the rest is lexical
            elif got is not True:
                hops -= 1
                if hops < 0 or not got or got.startswith("/"):
                    return True
                todo.extend(got.split("/")[::-1])
        return False
    finally:
        view.close()
