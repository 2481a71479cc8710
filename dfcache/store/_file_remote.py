"""``file:///path`` stores: a directory used as a remote, read without following symlinks.

A remote is someone else's directory: a symlink in it could make a pull copy any file this user
can read (``~/.ssh/id_rsa`` as a "chunk") into the store, so no path is ever followed through one.
It is written like a local store (:class:`dfcache.store._directory.DirectoryBackend`); a shared
filesystem is a fine remote.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from ..errors import IntegrityError, UsageError
from ..keys import KEY_PATTERN
from ._files import kind_of, read_fd
from ._directory import DirectoryBackend
from .format import check_relpath, damaged_marker
from .layout import (ARTIFACTS, INDEX, LOCKS, MANIFEST, MAX_MANIFEST_BYTES, MAX_MARKER_BYTES, STAGING, STORE_MARKER,
                     artifact_parts, shard)


class FileRemoteBackend(DirectoryBackend):
    """A store directory used as a remote: written like a local store, read without symlinks.

    Every read opens each path component below the root with ``O_NOFOLLOW`` relative to its
    parent's descriptor, so no symlink is followed at any depth and nothing can swap one in
    between a check and the open. The root itself is the user's choice and may be a link.

    Someone else's directory: no index of theirs is used (its manifests are read), and no file
    path is handed out for the fast reads (the Backend defaults: ``listing``,
    ``sample_index_dir`` and ``local_file_path`` are None). Read as untrusted, it is itself.
    """

    # Its own directories (artifacts/, staging/, locks/, index/) must be real directories
    # (DirectoryBackend._follow_own_dirs): a link at R/staging made a push write its files outside
    # the remote, then rename them in.

    def __init__(self, root: str | os.PathLike, create: bool = True) -> None:
        path = Path(root).expanduser().absolute()
        if not create and not os.path.lexists(path / STORE_MARKER):
            raise UsageError(f"no dfcache store at file://{path}; check the URL or push to it first.")
        super().__init__(path, create=create)
        self.url = f"file://{self.root}"

    def _marker_name(self) -> str:
        return f"file://{self.root}/{STORE_MARKER}"

    def _read_marker(self) -> bytes:
        # Never through a link (one pointing outside the remote was read), never blocking,
        # at most MAX_MARKER_BYTES (a 3 GB "marker" was read whole).
        try:
            fd = self._open_nofollow([STORE_MARKER])
        except FileNotFoundError:
            raise damaged_marker(self._marker_name(), "it is gone") from None
        try:
            size = os.fstat(fd).st_size
            if size > MAX_MARKER_BYTES:
                raise damaged_marker(self._marker_name(), f"{size} bytes, more than a marker may have")
            return read_fd(fd, size)[:MAX_MARKER_BYTES + 1]
        finally:
            os.close(fd)

    def _own_dir(self, *parts: str) -> Path:
        """``root/parts...`` for writing, each component checked to be a real directory (or absent):
        nothing is ever written through a link in a remote."""
        path = self.root
        for i, part in enumerate(parts):
            path = path / part
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            if not stat.S_ISDIR(st.st_mode):
                raise IntegrityError(f"{self.url}/{'/'.join(parts[:i + 1])} is "
                                     f"{'a symbolic link' if stat.S_ISLNK(st.st_mode) else 'not a directory'}; "
                                     "dfcache never writes through links or over files in a remote store.",
                                     fix="Replace it with a real directory there (or push to another remote), "
                                         "then push again.")
        return path

    def open_staging(self, key: str, resumable: bool = False):
        self._check_own_dirs()
        self._own_dir(STAGING)
        self._own_dir(LOCKS)
        self._own_dir(ARTIFACTS, shard(key))
        return super().open_staging(key, resumable)

    def _before_publish(self, key: str) -> None:
        self._check_own_dirs()
        self._own_dir(ARTIFACTS, shard(key))
        self._own_dir(INDEX)

    def _refuse_foreign(self) -> UsageError:
        return UsageError(f"file://{self.root} exists and is not a dfcache store; push to a new or empty "
                          "directory, or to an existing store.")

    def _url_for_refusal(self) -> str:
        return f"file://{self.root}"

    def _refuse_link(self, rel: str) -> IntegrityError:
        return IntegrityError(f"file://{self.root}/{rel} is a symbolic link; dfcache never follows links in a "
                              "remote store. Replace it with the real file (or remove the artifact there) "
                              "and pull again.")

    def _open_nofollow(self, parts: list[str]) -> int:
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        done: list[str] = []
        try:
            for i, part in enumerate(parts):
                last = i == len(parts) - 1
                # O_NONBLOCK: opening a FIFO planted as a "file" must not hang the pull.
                flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_NONBLOCK if last else os.O_DIRECTORY)
                try:
                    nfd = os.open(part, flags, dir_fd=fd)
                except OSError as e:
                    rel = "/".join(done + [part])
                    try:
                        st = os.stat(part, dir_fd=fd, follow_symlinks=False)
                    except OSError:
                        st = None
                    if st is not None and stat.S_ISLNK(st.st_mode):
                        raise self._refuse_link(rel) from None
                    if e.errno in (errno.ENOENT, errno.ENOTDIR):
                        raise FileNotFoundError(f"file://{self.root}/{rel}") from None
                    raise
                os.close(fd)
                fd = nfd
                done.append(part)
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise IntegrityError(f"file://{self.root}/{'/'.join(parts)} is {kind_of(st.st_mode)}, not a regular "
                                     "file; remove it from the remote and push the artifact again.")
            return fd
        except BaseException:
            os.close(fd)
            raise

    def _read_rel(self, parts: list[str], limit: int | None) -> bytes:
        fd = self._open_nofollow(parts)
        try:
            size = os.fstat(fd).st_size
            if limit is not None and size > limit:
                raise IntegrityError(f"file://{self.root}/{'/'.join(parts)} has {size} bytes, more than its "
                                     f"manifest allows ({limit}); the remote copy is damaged.",
                                     fix="Delete it there and push a good copy.")
            chunks = []
            while True:
                b = os.read(fd, 1 << 22)
                if not b:
                    break
                chunks.append(b)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def _parts(self, key: str, relpath: str) -> list[str]:
        check_relpath(relpath)
        return [*artifact_parts(key), *relpath.split("/")]

    def read_manifest(self, key: str) -> bytes | None:
        if not KEY_PATTERN.match(key):
            return None
        try:
            return self._read_rel(self._parts(key, MANIFEST), MAX_MANIFEST_BYTES)
        except FileNotFoundError:
            return None

    def iter_manifests(self) -> Iterator[tuple[str, bytes]]:
        base = self.root / ARTIFACTS
        try:
            shards = sorted(e.name for e in os.scandir(base) if e.is_dir(follow_symlinks=False))
        except FileNotFoundError:
            return
        for shard in shards:
            for entry in sorted(os.scandir(base / shard), key=lambda e: e.name):
                if not entry.is_dir(follow_symlinks=False) or not KEY_PATTERN.match(entry.name):
                    continue  # links and strays are not artifacts of this remote
                try:
                    raw = self.read_manifest(entry.name)
                except IntegrityError:
                    continue
                if raw is not None:
                    yield entry.name, raw

    def read_file(self, key: str, relpath: str) -> bytes:
        return self._read_rel(self._parts(key, relpath), None)

    def read_file_limited(self, key: str, relpath: str, limit: int | None) -> bytes:
        return self._read_rel(self._parts(key, relpath), limit)

