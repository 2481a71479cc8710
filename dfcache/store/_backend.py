"""The small interface every store backend implements, with its capabilities declared.

A backend moves bytes; it knows artifacts only as a key and relative file names inside them
(the names in :mod:`dfcache.store.format`). Everything about arrays, digests and manifests lives
in ``format.py`` and ``_store.py``, so every backend shares it and passes the same conformance
suite (:mod:`dfcache.testing.store_conformance`).

Backends, one private module each: ``_local.py`` (this user's directory), ``_file_remote.py`` (a
``file://`` directory read without following symlinks), both on ``_directory.py``, and ``_s3.py``
(``s3://``, with the write lease in ``_s3_lease.py``). ``_open.py`` picks one per URL scheme.

Capabilities are class attributes and methods here, never probed with ``getattr``:

- ``needs_network``: every operation talks to a server, so offline mode refuses it
  (:meth:`Backend.check_offline`, the one place that refusal is made for stores).
- ``local_root``: the store is a directory on this machine (a fast read path, and a place for
  files materialized from artifacts); None for object stores.
- :meth:`Backend.read_file_limited`: a bounded read, so an untrusted copy can never make a reader
  download more than the manifest allows.
- :meth:`Backend.local_file_path`: a committed file's path for zero-copy reads, or None.
- :meth:`Backend.for_untrusted_reads`: the same store read as someone else's (no symlinks).
- :meth:`Backend.listing`: ``ls``'s rows from an index kept beside the artifacts, or None.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import IntegrityError, OfflineModeIsEnabled


@dataclass
class Temporary:
    """A leftover staging area (a crashed or running writer)."""

    name: str
    size_bytes: int
    age_s: float
    in_use: bool  # a live process holds it
    resumable: bool
    note: str = ""  # what it is where that is not a writer's staging area ("stray: a FIFO (named pipe)")


class UnreadableManifest(bytes):
    """What :meth:`Backend.iter_manifests` yields, in place of a manifest's bytes, for a
    ``manifest.json`` that cannot be read as one (a directory, a FIFO, larger than any manifest):
    no bytes (any parser refuses it), and ``problem`` says why. ``Store.list_manifests`` reports
    it as an invalid manifest, so `ls` warns, `verify` exits 5 and `gc --bad` removes it."""

    problem: str

    def __new__(cls, problem: str) -> "UnreadableManifest":
        obj = super().__new__(cls, b"")
        obj.problem = problem
        return obj


class Staging(ABC):
    """A private place where one writer assembles an artifact before publishing it."""

    @abstractmethod
    def put(self, relpath: str, data) -> int:
        """Write one file from a bytes-like object or a list of them; return the bytes written."""

    def flush(self) -> None:
        """Wait until every file put so far is durable (a checkpoint relies on it)."""

    @abstractmethod
    def get(self, relpath: str) -> bytes | None:
        """Read back a staged file (used when a resumable writer resumes); None if absent."""

    @abstractmethod
    def publish(self, manifest_bytes: bytes) -> bool:
        """Make the artifact visible with its manifest written last.

        Returns True if this writer's copy is the published one, False if another writer had
        already published the same key (then this copy is dropped; both callers succeed).
        """

    def size(self, relpath: str) -> int | None:
        """Size of a staged file, None if absent (a resumable writer checks its progress with it)."""
        data = self.get(relpath)
        return None if data is None else len(data)

    @abstractmethod
    def abort(self) -> None:
        """Drop the staged files (a resumable staging keeps them unless ``discard``)."""

    def discard(self) -> None:
        self.abort()


class Backend(ABC):
    url: str
    needs_network: bool = False
    local_root: Path | None = None

    @property
    def is_local(self) -> bool:
        return self.local_root is not None

    def check_offline(self, offline: bool | None = None) -> None:
        """Refuse, before any socket is opened, a backend that needs the network while offline
        (``offline``, else ``DFCACHE_OFFLINE``; ``HF_HUB_OFFLINE`` is the Hub's switch only)."""
        if not self.needs_network:
            return
        from ..config import offline_from_env

        if offline_from_env() if offline is None else offline:
            raise offline_refusal(self.url)

    @abstractmethod
    def read_manifest(self, key: str) -> bytes | None: ...

    @abstractmethod
    def iter_manifests(self) -> Iterator[tuple[str, bytes]]:
        """Yield (key, manifest bytes) of every committed artifact (an :class:`UnreadableManifest`
        for a manifest that cannot be read as a file)."""

    @abstractmethod
    def read_file(self, key: str, relpath: str) -> bytes:
        """Read a committed artifact's file; raise FileNotFoundError if it is missing."""

    def read_file_limited(self, key: str, relpath: str, limit: int) -> bytes:
        """Like :meth:`read_file`, but never reads more than ``limit`` bytes: IntegrityError (no
        fix; the caller knows it) if the file is larger. Backends override this to stop early."""
        data = self.read_file(key, relpath)
        if len(data) > limit:
            raise too_large(self.url, key, relpath, limit)
        return data

    @abstractmethod
    def list_files(self, key: str) -> dict[str, int]:
        """Relative path → size of every file of a committed artifact."""

    @abstractmethod
    def delete(self, key: str) -> bool: ...

    @abstractmethod
    def open_staging(self, key: str, resumable: bool = False) -> Staging: ...

    @abstractmethod
    def list_temporaries(self) -> list[Temporary]: ...

    @abstractmethod
    def remove_temporary(self, name: str, grace_s: float = 60.0) -> bool:
        """Remove a leftover if no live process holds it; True if removed."""

    def local_file_path(self, key: str, relpath: str) -> Path | None:
        """Path of a committed file on a local filesystem, or None (fast read path)."""
        return None

    def listing(self):
        """What ``dfcache ls`` lists, from the store's listing index (``_index.Listing``), or None:
        list the manifests instead (a backend without an index)."""
        return None

    def sample_index_dir(self) -> Path | None:
        """Where this store keeps its per-partition sample indexes (``dfcache.samples``), or None:
        read the segment manifests instead (a backend without one, or someone else's store)."""
        return None

    def for_untrusted_reads(self) -> "Backend":
        """This store, read as someone else's (a pull source): no symlink is ever followed."""
        return self


def too_large(url: str, key: str, relpath: str, limit: int) -> IntegrityError:
    return IntegrityError(f"{relpath} of artifact {key} in {url} is larger than its manifest allows "
                          f"({limit} bytes).", key=key)


def offline_refusal(url: str) -> OfflineModeIsEnabled:
    """The one error for a store that needs the network while offline (no socket was opened;
    exit 3, as for anything else offline mode keeps from the network)."""
    return OfflineModeIsEnabled(f"cannot reach {url}: offline mode is on (--offline or DFCACHE_OFFLINE), so "
                                "dfcache opens no connection.", url=url,
                                fix="Use a file:// remote or the local store, or turn offline mode off "
                                    "(drop --offline, unset DFCACHE_OFFLINE) to reach it.")
