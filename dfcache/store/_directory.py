"""A store in a directory (local or on a shared POSIX filesystem): what the two directory
backends share, this user's own store (``_local.py``) and someone else's read as a remote
(``_file_remote.py``, no link ever followed). The layout is :mod:`dfcache.store.layout`'s.

A writer assembles everything, manifest last, in its staging directory and publishes it with one
``rename`` onto ``artifacts/..``: atomic on POSIX, and it fails if the target exists, so two
writers of one key both succeed and exactly one copy stays. Each staging directory is held with
``flock`` by its live writer; ``gc`` removes only those no live process holds (a crashed writer's
lock dies with it). Locks are an optimisation of cleanup, never what makes commits safe
(huggingface_hub PR #4228).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import stat
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from ..errors import IntegrityError, StoreWriteError, UntrustedManifestError, UsageError
from ._backend import Backend, Staging, Temporary, UnreadableManifest, too_large
from ._files import NotRegularFile, kind_of, read_regular
from ._pools import fsync_pool
from .format import check_store_marker, damaged_marker, store_marker_bytes
from .layout import (ARTIFACTS, GRAVE_SUFFIX, INDEX, LOCKS, MANIFEST, MAX_MANIFEST_BYTES, MAX_MARKER_BYTES,
                     RESERVED_DIRS, RESUME_SUFFIX, SAMPLE_INDEX, STAGING, STORE_MARKER, TMP_SUFFIX, artifact_parts,
                     lock_relpath, marker_tmp_name, staging_relpath)

# What layout.index_tmp_name and layout.marker_tmp_name make.
_INDEX_TMP = re.compile(r"\.[^/]+\.[0-9]+\.[0-9a-f]{12}" + re.escape(TMP_SUFFIX))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _dir_size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


# errnos that mean "this store cannot take the write", not "dfcache has a bug"
_UNWRITABLE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM}


@contextlib.contextmanager
def _refused(root: Path, message: str):
    """An OSError that says the store cannot take a change (full, over quota, read-only, not
    ours) becomes one StoreWriteError (exit 2): ``message`` with the system's reason in place of
    ``{why}``. Any other OSError is dfcache's to report."""
    try:
        yield
    except OSError as e:
        if isinstance(e, StoreWriteError) or e.errno not in _UNWRITABLE:
            raise
        raise StoreWriteError(message.replace("{why}", e.strerror or str(e)), path=str(root)) from None


def _writing(root: Path, key: str):
    """A write of artifact ``key``: a full or read-only store is one clear StoreWriteError."""
    return _refused(root, f"cannot write artifact {key[:12]} into the store {root}: {{why}}. Free space (`dfcache "
                          "gc --dry-run` lists what can go) or fix its permissions, or pass another --store; then "
                          "run again.")


def _removing(root: Path, what: str):
    """A removal: `gc` and `delete` on a read-only store is one clear StoreWriteError, not an
    internal error."""
    return _refused(root, f"cannot remove {what} from the store {root}: {{why}}; nothing more was removed. Make the "
                          "store writable (its filesystem, its permissions) and run again.")


_DIR_OPEN = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | getattr(os, "O_NONBLOCK", 0)


def _open_dir(path) -> int:
    """A descriptor of the directory ``path`` itself (never a link, a FIFO or a file: OSError)."""
    return os.open(path, _DIR_OPEN)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_NOT_FOREIGN = {"README.md", ".gitignore", ".gitkeep"}
_MARKER_TMP = re.compile(re.escape(STORE_MARKER) + r"\.[0-9a-f]{32}" + re.escape(TMP_SUFFIX))


def foreign_entries(root: Path) -> list[str]:
    """What a directory without a store marker holds that a new store would not: not the files
    a repository keeps in an empty directory, not a marker being written by another process
    creating the same store, and not a store's own directories left empty (a creation cut short
    before the marker existed)."""
    out = []
    for p in root.iterdir():
        if p.name in _NOT_FOREIGN or _MARKER_TMP.fullmatch(p.name):
            continue
        if p.name in RESERVED_DIRS and p.is_dir() and not p.is_symlink() and not any(p.iterdir()):
            continue
        out.append(p.name)
    return out


def _remove_tree(path: Path, root: Path | None = None, what: str = "") -> None:
    """Remove a grave (a directory renamed out of sight). What cannot go stays as a grave, which
    the next `gc` removes; a store that refuses removals says so (StoreWriteError)."""
    failed: list[BaseException] = []
    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=lambda fn, p, exc: failed.append(exc))
    else:
        shutil.rmtree(path, onerror=lambda fn, p, exc: failed.append(exc[1]))
    unwritable = [e for e in failed if isinstance(e, OSError) and e.errno in _UNWRITABLE]
    if unwritable and root is not None:
        with _removing(root, what or str(path)):
            raise unwritable[0]


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise


class _DirectoryStaging(Staging):
    def __init__(self, backend: "DirectoryBackend", key: str, resumable: bool) -> None:
        self.backend = backend
        self.key = key
        self.resumable = resumable
        self._lock_fd: int | None = None
        staging_root = backend.root / STAGING
        if resumable:
            self._lock_fd = backend._acquire_key_lock(key)
        # `gc` removes a staging directory that no live process holds. Between our mkdir and our
        # flock nobody holds it, so a `gc --grace 0` may remove it there: after locking, check that
        # the path is still the directory we locked, else make a new one.
        while True:
            if resumable:
                self.path = staging_root / f"{key}{RESUME_SUFFIX}"
                self.path.mkdir(parents=True, exist_ok=True)
            else:
                self.path = staging_root / f"{key}.{os.urandom(6).hex()}{TMP_SUFFIX}"
                self.path.mkdir(parents=True)
            try:
                fd = os.open(self.path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                st = os.stat(self.path)
                held = os.fstat(fd)
                if (st.st_ino, st.st_dev) == (held.st_ino, held.st_dev):
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        self._dir_fd = fd
        self._made_dirs: set[str] = set()
        self._pending: list = []
        self._fsyncs = fsync_pool()

    def size(self, relpath: str) -> int | None:
        try:
            st = os.stat(self.path / relpath)
        except (FileNotFoundError, NotADirectoryError):
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def _target(self, relpath: str) -> Path:
        p = self.path / relpath
        parent = os.path.dirname(relpath)
        if parent and parent not in self._made_dirs:
            p.parent.mkdir(parents=True, exist_ok=True)
            self._made_dirs.add(parent)
        return p

    def put(self, relpath: str, data) -> int:
        with _writing(self.backend.root, self.key):
            return self._put(relpath, data)

    def _put(self, relpath: str, data) -> int:
        p = self._target(relpath)
        # Resumable staging is visible to the next attempt, so each file is written whole or not
        # at all; a private staging directory is never read before publish.
        tmp = p.with_name(p.name + ".part") if self.resumable else p
        parts = data if isinstance(data, (list, tuple)) else [data]
        with open(tmp, "wb") as f:
            n = sum(f.write(part) for part in parts)
        if self.resumable:
            os.replace(tmp, p)
        # fsync in the background while the writer produces the next chunk: one at a time at
        # commit cost 80% of a write (bench/write_variants.py); flush() waits for them.
        self._pending.append(self._fsyncs.submit(_fsync_path, p))
        return n

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        errors = [f.exception() for f in pending]
        for e in errors:
            if e is not None:
                raise e

    def get(self, relpath: str) -> bytes | None:
        try:
            return read_regular(self.path / relpath)
        except (FileNotFoundError, NotRegularFile):
            return None  # (a FIFO planted in a resumable staging area is no progress: never opened blocking)

    def publish(self, manifest_bytes: bytes) -> bool:
        with _writing(self.backend.root, self.key):
            return self._publish(manifest_bytes)

    def _publish(self, manifest_bytes: bytes) -> bool:
        # Make the data durable before the manifest, and the manifest before the rename.
        self.flush()
        self.put(MANIFEST, manifest_bytes)
        self.flush()
        for d in {os.path.dirname(r) for r in self._made_dirs} | self._made_dirs | {""}:
            _fsync_dir(self.path / d)
        final = self.backend._artifact_dir(self.key)
        self.backend._before_publish(self.key)
        final.parent.mkdir(parents=True, exist_ok=True)
        won = False
        for _attempt in range(3):
            try:
                os.rename(self.path, final)
                won = True
                break
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
                if os.path.isfile(final / MANIFEST):
                    break  # another writer published this key first: keep theirs
                # A directory without a manifest is a leftover, not an artifact: move it aside.
                grave = self.backend._grave(self.key)
                try:
                    os.rename(final, grave)
                except OSError:
                    pass
        if not won:
            shutil.rmtree(self.path, ignore_errors=True)
        _fsync_dir(final.parent)
        if won:
            from ._index import record_commit

            record_commit(self.backend.root, self.key, manifest_bytes)
        self._release()
        return won

    def _release(self) -> None:
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def abort(self) -> None:
        if not self.resumable:
            shutil.rmtree(self.path, ignore_errors=True)
        self._release()

    def discard(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        self._release()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self._release()
        except Exception:
            pass


class DirectoryBackend(Backend):
    """A store in a directory: the layout, commits by rename, temporaries and their cleanup.
    Reads follow links only where ``_follow_own_dirs`` says so; the subclasses decide the rest."""

    def __init__(self, root: str | os.PathLike, create: bool = True) -> None:
        self.root = Path(root).expanduser().absolute()
        self.local_root = self.root
        self.url = str(self.root)
        marker = self.root / STORE_MARKER
        if self.root.exists() and not self.root.is_dir():
            raise UsageError(f"store {self.root} is a file, not a directory; pass a store directory (or a "
                             "path that does not exist yet) with --store or DFCACHE_STORE.")
        made = not marker.exists() and self._make(marker, create)
        if not made:
            check_store_marker(self._read_marker(), self._url_for_refusal(), where=self._marker_name())
        self._check_own_dirs()

    # A store's own directories, each of which must be a directory if it is there at all (a file
    # named `artifacts` made `ls` and `verify` fail with an internal error). A local store may
    # have them as links to directories (its owner's choice); a file:// remote may not.
    _follow_own_dirs = False

    def _check_own_dirs(self) -> None:
        for sub in RESERVED_DIRS:
            path = self.root / sub
            try:
                st = os.stat(path) if self._follow_own_dirs else os.lstat(path)
            except FileNotFoundError:
                continue
            except OSError as e:
                raise IntegrityError(f"the store {self._url_for_refusal()} is damaged: {self._url_for_refusal()}/{sub} "
                                     f"cannot be examined ({e.strerror}).",
                                     fix="Fix or move it away, then run again.") from None
            if not stat.S_ISDIR(st.st_mode):
                raise IntegrityError(f"the store {self._url_for_refusal()} is damaged: {self._url_for_refusal()}/{sub} "
                                     f"is {kind_of(st.st_mode)}, not a directory.",
                                     fix=f"Move it out of the store (dfcache never writes anything but a directory "
                                         f"there) and run again; an empty {sub}/ is made when one is needed.")

    def _marker_name(self) -> str:
        return str(self.root / STORE_MARKER)

    def _read_marker(self) -> bytes:
        """The store marker's bytes, bounded (as S3 bounds it): a 3 GB "marker" is damage, not a read."""
        try:
            return read_regular(self.root / STORE_MARKER, MAX_MARKER_BYTES)
        except FileNotFoundError:
            raise damaged_marker(self._marker_name(), "it is gone") from None
        except NotRegularFile as e:
            raise damaged_marker(self._marker_name(), e.problem) from None
        except IntegrityError:
            raise damaged_marker(self._marker_name(), f"it is larger than {MAX_MARKER_BYTES} bytes") from None
        except OSError as e:
            raise damaged_marker(self._marker_name(), f"it cannot be read ({e.strerror})") from None

    def _make(self, marker: Path, create: bool) -> bool:
        """Make a new store here. False: another process made it meanwhile (each "marker.exists()"
        looks again, since several workers may be creating this store right now)."""
        if self.root.exists() and foreign_entries(self.root) and not marker.exists():
            raise self._refuse_foreign()
        if marker.exists():
            return False
        if not create:
            raise UsageError(f"no dfcache store at {self.root}: {self._missing_reason()}. Check the path given "
                             "with --store (or DFCACHE_STORE); a store is created by the first command that "
                             "writes to it (`dfcache run ...`, `dfcache pull URL --all`).")
        try:
            # The marker first, then the directories: workers creating one new store at once
            # (torchrun ranks) then never see a store's directories without its marker, which would
            # pass for someone else's directory.
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = marker.with_name(marker_tmp_name())
            tmp.write_bytes(store_marker_bytes())
            os.replace(tmp, marker)
            for sub in (ARTIFACTS, STAGING, LOCKS):
                (self.root / sub).mkdir(exist_ok=True)
        except OSError as e:
            raise UsageError(f"cannot create a store at {self.root}: {e.strerror}; pass a "
                             "writable directory with --store.") from None
        return True

    def _missing_reason(self) -> str:
        if not self.root.exists():
            return "the directory does not exist"
        return f"it has no {STORE_MARKER}"

    def _refuse_foreign(self) -> UsageError:
        return UsageError(f"{self.root} exists and is not a dfcache store (no {STORE_MARKER}); "
                          "pass an empty or new directory with --store.")

    def _url_for_refusal(self) -> str:
        return str(self.root)

    def _before_publish(self, key: str) -> None:
        """Checks a backend makes before it moves a staged artifact in (a file:// remote: no links)."""

    def _artifact_dir(self, key: str) -> Path:
        return self.root.joinpath(*artifact_parts(key))

    def _grave(self, name: str) -> Path:
        """A new name under which a directory is renamed out of sight before it is removed."""
        return self.root / STAGING / f"{name}.{os.urandom(6).hex()}{GRAVE_SUFFIX}"

    def _manifest_bytes(self, key: str, path) -> bytes | None:
        """A manifest's bytes (None: no manifest, no artifact); one that is not a regular file or
        is larger than any manifest may be is an UntrustedManifestError (exit 5; `gc --bad` removes it)."""
        try:
            return read_regular(path, MAX_MANIFEST_BYTES)
        except FileNotFoundError:
            return None
        except IntegrityError as e:
            raise UntrustedManifestError(f"manifest of artifact {key} in {self.url} refused: {e.problem}.",
                                         key=key) from None

    def read_manifest(self, key: str) -> bytes | None:
        return self._manifest_bytes(key, self._artifact_dir(key) / MANIFEST)

    def iter_manifests(self) -> Iterator[tuple[str, bytes]]:
        base = self.root / ARTIFACTS
        try:
            shards = sorted(os.scandir(base), key=lambda e: e.name)
        except (FileNotFoundError, NotADirectoryError):
            return
        for shard in shards:
            if not shard.is_dir(follow_symlinks=False):
                continue
            for entry in sorted(os.scandir(shard.path), key=lambda e: e.name):
                try:
                    raw = self._manifest_bytes(entry.name, os.path.join(entry.path, MANIFEST))
                except UntrustedManifestError as e:
                    yield entry.name, UnreadableManifest(e.problem)
                    continue
                # None: a directory without a manifest is not an artifact (e.g. a manual copy
                # that was interrupted); gc --tmp removes it.
                if raw is not None:
                    yield entry.name, raw

    def orphan_dirs(self) -> list[Path]:
        """Entries of the artifact directories that are no artifact: a directory without a
        manifest, or anything that is not a directory (cleaned by gc)."""
        out = []
        base = self.root / ARTIFACTS
        try:
            shards = list(os.scandir(base))
        except (FileNotFoundError, NotADirectoryError):
            return out
        for shard in shards:
            if shard.is_dir(follow_symlinks=False):
                for entry in os.scandir(shard.path):
                    if not os.path.exists(os.path.join(entry.path, MANIFEST)):
                        out.append(Path(entry.path))
        return out

    def _read_committed(self, key: str, relpath: str, limit: int | None) -> bytes:
        try:
            return read_regular(self._artifact_dir(key) / relpath, limit)
        except NotRegularFile as e:
            raise IntegrityError(f"{relpath} of artifact {key} in {self.url} is refused: {e.problem}.",
                                 key=key) from None
        except IntegrityError:
            raise too_large(self.url, key, relpath, limit) from None

    def read_file(self, key: str, relpath: str) -> bytes:
        return self._read_committed(key, relpath, None)

    def read_file_limited(self, key: str, relpath: str, limit: int) -> bytes:
        return self._read_committed(key, relpath, limit)

    def list_files(self, key: str) -> dict[str, int]:
        base = self._artifact_dir(key)
        out = {}
        for root, _dirs, files in os.walk(base):
            for f in files:
                full = os.path.join(root, f)
                out[os.path.relpath(full, base).replace(os.sep, "/")] = os.lstat(full).st_size
        return out

    def delete(self, key: str) -> bool:
        src = self._artifact_dir(key)
        # Rename first so that no reader ever sees a half-deleted artifact.
        grave = self._grave(key)
        with _removing(self.root, f"artifact {key}"):
            try:
                os.rename(src, grave)
            except FileNotFoundError:
                return False
        _remove_tree(grave)
        return True

    def open_staging(self, key: str, resumable: bool = False) -> Staging:
        with _writing(self.root, key):
            return _DirectoryStaging(self, key, resumable)

    def _acquire_key_lock(self, key: str) -> int:
        """Blocking exclusive lock for a key's resumable staging; robust to gc unlinking it."""
        path = self.root / lock_relpath(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                if os.fstat(fd).st_ino == os.stat(path).st_ino:
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)  # gc removed the file between open and lock: take the new one

    def list_temporaries(self) -> list[Temporary]:
        out = []
        staging = self.root / STAGING
        now = time.time()
        try:
            entries = list(os.scandir(staging))
        except (FileNotFoundError, NotADirectoryError):
            entries = []
        for entry in entries:
            try:
                st = os.lstat(entry.path)
            except OSError:
                continue
            if not stat.S_ISDIR(st.st_mode):
                # Writers make only directories here (a FIFO once hung gc's open): anything else
                # is a stray nobody holds, stale once its grace period has passed.
                out.append(Temporary(name=staging_relpath(entry.name), size_bytes=st.st_size, age_s=now - st.st_mtime,
                                     in_use=False, resumable=False, note=f"stray: {kind_of(st.st_mode)}"))
                continue
            try:
                fd = _open_dir(entry.path)
            except OSError:
                continue  # gone meanwhile
            try:
                held = not _try_lock(fd)
                age = now - os.fstat(fd).st_mtime
            finally:
                os.close(fd)
            out.append(Temporary(name=staging_relpath(entry.name), size_bytes=_dir_size(Path(entry.path)),
                                 age_s=age, in_use=held, resumable=entry.name.endswith(RESUME_SUFFIX)))
        for orphan in self.orphan_dirs():
            try:
                st = os.lstat(orphan)
            except OSError:
                continue
            is_dir = stat.S_ISDIR(st.st_mode)
            out.append(Temporary(name=str(orphan.relative_to(self.root)),
                                 size_bytes=_dir_size(orphan) if is_dir else st.st_size,
                                 age_s=now - st.st_mtime, in_use=False, resumable=False,
                                 note="" if is_dir else f"stray: {kind_of(st.st_mode)}"))
        for rel in (INDEX, SAMPLE_INDEX):
            try:
                entries = list(os.scandir(self.root / rel))
            except OSError:
                continue
            for entry in entries:
                if not _INDEX_TMP.fullmatch(entry.name):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                out.append(Temporary(name=f"{rel}/{entry.name}", size_bytes=st.st_size, age_s=now - st.st_mtime,
                                     in_use=False, resumable=False))
        return out

    def remove_temporary(self, name: str, grace_s: float = 60.0) -> bool:
        path = self.root / name
        head, _, base = name.rpartition("/")
        if head in (INDEX, SAMPLE_INDEX) and _INDEX_TMP.fullmatch(base):
            try:  # a plain file: no writer holds it for longer than a rename takes
                if time.time() - os.lstat(path).st_mtime < grace_s:
                    return False
                os.unlink(path)
                return True
            except OSError:
                return False
        if not (name.startswith(STAGING + "/") or name.startswith(ARTIFACTS + "/")) or ".." in name.split("/"):
            return False
        try:
            st = os.lstat(path)
        except OSError:
            return False
        if not stat.S_ISDIR(st.st_mode):
            # A stray (a file, a FIFO, a link): no writer ever holds one, so once older than the
            # grace period (or a grave) it goes; a link is removed, never followed.
            if time.time() - st.st_mtime < grace_s and not name.endswith(GRAVE_SUFFIX):
                return False
            if name.startswith(ARTIFACTS + "/") and os.path.exists(path / MANIFEST):
                return False
            try:
                with _removing(self.root, name):
                    os.unlink(path)
            except StoreWriteError:
                raise
            except OSError:
                return False  # gone meanwhile (another gc)
            return True
        try:
            fd = _open_dir(path)
        except OSError:
            return False  # gone, or replaced by something else meanwhile (the next gc sees it)
        try:
            if not _try_lock(fd):
                return False  # a live writer holds it
            if time.time() - os.fstat(fd).st_mtime < grace_s and not name.endswith(GRAVE_SUFFIX):
                return False  # may be a writer between mkdir and flock
            if name.startswith(ARTIFACTS + "/") and (path / MANIFEST).exists():
                return False  # became an artifact meanwhile
            if not name.endswith(GRAVE_SUFFIX):
                # Out of sight in one step, then removed: a gc killed half-way must not leave a
                # resumable staging area whose progress names files that are gone.
                grave = self._grave(path.name)
                try:
                    with _removing(self.root, name):
                        os.rename(path, grave)
                except StoreWriteError:
                    raise
                except OSError:
                    return False  # gone meanwhile (another gc): nothing to do
                path = grave
            _remove_tree(path, self.root, name)
            return True
        finally:
            os.close(fd)
