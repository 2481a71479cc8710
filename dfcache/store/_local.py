"""A store in this user's own directory: a directory store (``_directory.py``) read through the
fast paths, with the indexes kept beside its artifacts.

- Reads take the committed files' paths (``local_file_path``: zero-copy and threaded reads,
  memory maps) and follow links the owner put there (their choice: a store's directories may be
  links to other disks).
- ``ls`` lists from the listing index (``_index.py``) and sample lookups use the per-partition
  sample indexes (``dfcache.samples``), both derived data kept under ``index/``.
- Read as someone else's (a pull from it, ``for_untrusted_reads``), the same directory is a
  :class:`~dfcache.store._file_remote.FileRemoteBackend`: no link is followed.
"""

from __future__ import annotations

from pathlib import Path

from ._backend import Backend
from ._directory import DirectoryBackend
from .layout import SAMPLE_INDEX


class LocalBackend(DirectoryBackend):
    """A store directory of this user's: reads follow the fast path (``local_file_path``)."""

    _follow_own_dirs = True

    def local_file_path(self, key: str, relpath: str) -> Path:
        return self._artifact_dir(key) / relpath

    def listing(self):
        from ._index import listing
        from .format import FORMAT_VERSION

        return listing(self.root, FORMAT_VERSION)

    def sample_index_dir(self) -> Path | None:
        return self.root / SAMPLE_INDEX

    def for_untrusted_reads(self) -> Backend:
        from ._file_remote import FileRemoteBackend

        return FileRemoteBackend(self.root, create=False)
