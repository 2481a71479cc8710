"""Opening a store's files so that nothing in the store can hang or flood the reader.

A store directory may hold what its writers never put there: a FIFO where a chunk was (an
``open`` of it waits for a writer that never comes, so ``verify`` and a ``run`` hung), a directory
where ``manifest.json`` was (``IsADirectoryError``, an internal error), a 3 GB "marker". Every open
of a store file goes through here:

- ``O_NONBLOCK``: opening a FIFO returns at once (on a regular file the flag changes nothing:
  reads of regular files never block on Linux or macOS, so the read path pays nothing);
- the open file must be a regular file (``fstat``), else :class:`NotRegularFile`, an
  :class:`~dfcache.errors.IntegrityError` (exit 5) naming what it is;
- a read takes a bound: a file larger than it is refused before anything is read.

``nofollow`` opens the last component with ``O_NOFOLLOW`` (a link there is refused); a ``file://``
remote opens every component that way (``_file_remote.py``).

:func:`replace_derived` is the one way a derived file (the listing index, a sample index) is
written: under a temporary name beside it, then renamed over it.
"""

from __future__ import annotations

import errno
import os
import stat

from ..errors import IntegrityError, NotRegularFile
from .layout import index_tmp_name

OPEN_FLAGS = os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NONBLOCK", 0)


def kind_of(mode: int) -> str:
    """What a file is, in words ("a FIFO (named pipe)")."""
    for test, name in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISLNK, "a symbolic link"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "of an unknown type"


def not_regular(path, mode: int) -> NotRegularFile:
    return NotRegularFile(f"{path} is {kind_of(mode)}, not a regular file")  # (problem only: callers add the fix)


def check_regular(fd: int, path) -> os.stat_result:
    """``fstat`` of an open descriptor, which must be a regular file (else it is closed and
    :class:`NotRegularFile` raised)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise not_regular(path, st.st_mode)
    return st


def open_regular(path, *, nofollow: bool = False, dir_fd: int | None = None) -> int:
    """A read-only descriptor of the regular file ``path``; never blocks. FileNotFoundError if it
    is missing (or a path component is not a directory), :class:`NotRegularFile` if it is not a
    regular file (or, with ``nofollow``, a symbolic link)."""
    flags = OPEN_FLAGS | (os.O_NOFOLLOW if nofollow else 0)
    try:
        fd = os.open(path, flags, dir_fd=dir_fd)
    except NotADirectoryError:
        raise FileNotFoundError(errno.ENOENT, "not found", os.fspath(path)) from None
    except OSError as e:
        if nofollow and e.errno == errno.ELOOP:
            raise NotRegularFile(f"{path} is a symbolic link, not a regular file") from None
        raise
    check_regular(fd, path)
    return fd


def read_fd(fd: int, size: int) -> bytes:
    """The content of an open regular file that ``fstat`` said has ``size`` bytes: at most
    ``size`` + 1 of them (one more than that tells a caller with a bound that it grew)."""
    first = os.read(fd, size + 1)  # one call for the whole file (the usual case: no read of EOF after it)
    if len(first) >= size or not first:
        return first
    chunks = [first]
    left = size + 1 - len(first)
    while left > 0:  # a short read (rare): the rest, one call at a time
        b = os.read(fd, min(left, 1 << 24))
        if not b:
            break
        chunks.append(b)
        left -= len(b)
    return b"".join(chunks)


def read_regular(path, limit: int | None = None, *, what: str | None = None, nofollow: bool = False) -> bytes:
    """The bytes of the regular file ``path``, never blocking, never more than ``limit`` bytes:
    IntegrityError (no fix: the caller knows it) for a larger file, NotRegularFile for anything
    but a regular file, FileNotFoundError if it is missing."""
    fd = open_regular(path, nofollow=nofollow)
    try:
        size = os.fstat(fd).st_size
        if limit is not None and size > limit:
            raise IntegrityError(f"{what or path} has {size} bytes, more than the {limit} it may have")
        data = read_fd(fd, size)
        if limit is not None and len(data) > limit:
            raise IntegrityError(f"{what or path} has more than the {limit} bytes it may have")
        return data
    finally:
        os.close(fd)


def replace_derived(path: str | os.PathLike, data: bytes) -> bool:
    """Replace the derived file ``path`` (an index kept beside a store's artifacts) with ``data``
    in one rename, its directory made if needed. No fsync: after a crash a torn file fails its
    own checksum or header and is rebuilt from the manifests. Best effort: False (nothing left
    behind) where the store cannot take it, and readers go on without the file."""
    path = os.fspath(path)
    head, name = os.path.split(path)
    tmp = os.path.join(head, index_tmp_name(name))
    try:
        os.makedirs(head, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        return True
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False
