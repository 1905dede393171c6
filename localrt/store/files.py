"""The durable file steps every store write is built from.

A write goes to a temporary file beside its target, is flushed and fsynced, renamed into place, and the
folder is fsynced, so that after a crash or a power cut the target holds either its old bytes or its
new ones. A temporary file or folder is held (an exclusive `flock` on it) while a process uses it: the
kernel drops the hold when the process dies, however it dies, so a later recovery can tell what a
killed write left behind from what a live one is still writing.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no flock; recovery then leaves recent leftovers alone
    fcntl = None  # type: ignore[assignment]

# without flock, a leftover is taken for abandoned only once it is this old
UNHELD_AGE_S = 24 * 3600.0


def fsync_dir(path: Path) -> None:
    """Make the entries of folder `path` (a rename into it, a new or removed file) durable."""
    if os.name == "nt":  # NTFS journals its metadata; folders cannot be opened for fsync there
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(path: Path) -> None:
    """`mkdir -p`, each new folder's entry fsynced in its parent, so what is renamed into it stays."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        try:
            folder.mkdir()
        except FileExistsError:  # another process made it first: its own fsync covers it
            continue
        fsync_dir(folder.parent)


def sync_file(path: Path) -> None:
    """fsync a file that was written and closed (a download, a converter's output) before it is renamed."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def place(tmp: Path, final: Path) -> None:
    """Rename a synced file into place and make the rename durable."""
    os.replace(tmp, final)
    fsync_dir(final.parent)


def hold(fd: int) -> None:
    """Mark a temporary file or folder (its open descriptor) as in use for as long as `fd` stays open."""
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def hold_folder(path: Path) -> int | None:
    """`hold` for a folder: its open descriptor (close it to let go), or None where folders cannot be
    opened (Windows, where a leftover is judged by its age instead)."""
    if fcntl is None:
        return None
    fd = os.open(path, os.O_RDONLY)
    hold(fd)
    return fd


def in_use(path: Path) -> bool:
    """Whether a live process holds `path` (see `hold`); a path that is gone counts as in use (not ours)."""
    if fcntl is None:
        try:
            return time.time() - os.stat(path).st_mtime < UNHELD_AGE_S
        except OSError:
            return True
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return True
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                return True
            raise
        return False
    finally:
        os.close(fd)  # releases the probe's own lock


def size_of(path: Path) -> int:
    """Bytes under `path` (a file, or a folder's files), for the recovery's report."""
    with contextlib.suppress(OSError):
        if path.is_dir():
            return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        return path.stat().st_size
    return 0
