"""Stores of committed artifacts: the API the runner (and users) call.

``open_store(path_or_url)`` gives a :class:`Store`. Public: the names below and
:mod:`dfcache.store.format` (what the files are). Private: the backends, one module each
(``_local.py`` a directory, ``_file_remote.py`` a ``file://`` directory read without symlinks,
``_s3.py`` ``s3://`` with its write lease in ``_s3_lease.py``), behind the small interface in
``_backend.py``; ``_open.py`` picks one per URL scheme. ``dfcache.testing.store_conformance`` is
the suite every backend passes. ``migrate_store`` (``_migrate.py``) upgrades a store of an older
format in place.
"""

from . import format
from ._backend import Backend, Staging, Temporary
from ._migrate import MigrateResult, migrate_store
from ._store import (ArrayReader, ArrayWriter, Artifact, ArtifactWriter, CommitOnExit, Store, default_chunk_rows,
                     open_store)

__all__ = ["ArrayReader", "ArrayWriter", "Artifact", "ArtifactWriter", "Backend", "CommitOnExit", "MigrateResult",
           "Staging", "Store", "Temporary", "default_chunk_rows", "format", "migrate_store", "open_store"]
