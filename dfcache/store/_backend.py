"""The small interface every store backend implements (local directory, object store).

A backend moves bytes; it knows artifacts only as a key and relative file names inside them
(``manifest.json``, ``zarr.json``, ``<array>/zarr.json``, ``<array>/c/<i>/0``,
``blobs/<name>.json``). Everything about arrays, digests and manifests lives in ``_store.py``,
so both backends share it and pass the same conformance suite.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

MANIFEST = "manifest.json"


@dataclass
class Temporary:
    """A leftover staging area (a crashed or running writer)."""

    name: str
    size_bytes: int
    age_s: float
    in_use: bool  # a live process holds it
    resumable: bool


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
    is_local: bool = False

    @abstractmethod
    def read_manifest(self, key: str) -> bytes | None: ...

    @abstractmethod
    def iter_manifests(self) -> Iterator[tuple[str, bytes]]:
        """Yield (key, manifest bytes) of every committed artifact."""

    @abstractmethod
    def read_file(self, key: str, relpath: str) -> bytes:
        """Read a committed artifact's file; raise FileNotFoundError if it is missing."""

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

    def local_file_path(self, key: str, relpath: str):
        """Path of a committed file on a local filesystem, or None (fast read path)."""
        return None
