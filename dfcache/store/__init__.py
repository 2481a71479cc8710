"""Stores of committed artifacts: the API the runner (and users) call.

``open_store(path_or_url)`` gives a :class:`Store`. Public: the names below,
:mod:`dfcache.store.format` (what the files are) and :mod:`dfcache.store.layout` (where they
are; the format's names, standard library only). Private, one concept a module: the store API
(``_store.py``: Store, open_store), writing (``_writer.py``: ArtifactWriter, ArrayWriter,
CommitOnExit), reading (``_reader.py``: Artifact, ArrayReader), what reads and writes share in
a process (``_pools.py``: thread pools, recycled buffers), and the backends, one module each
(``_local.py`` this user's directory, ``_file_remote.py`` a ``file://`` directory read without
symlinks, both on ``_directory.py``; ``_s3.py`` ``s3://`` with its write lease in
``_s3_lease.py``) behind the small interface in ``_backend.py``; ``_open.py`` picks one per URL
scheme. ``dfcache.testing.store_conformance`` is the suite every backend passes.
``migrate_store`` (``_migrate.py``) upgrades a store of an older format in place.
``listing(root)`` is what ``dfcache ls`` lists of a local store, from its listing index
(``_index.py``, docs/format.md). ``recycled_empty`` is ``np.empty`` in a buffer reused once
nothing refers to it (large read results). ``read_regular(path, limit)`` reads a file kept in a
store (never blocking on a FIFO, regular files only, bounded; ``_files.py``), and
``replace_derived(path, data)`` replaces a derived file (an index) in one rename.
``populate_write(addr, size)`` makes a writable shared mapping's pages present in one call
(``_pagecache.py``; a DataLoader worker's item memory).
"""

from importlib import import_module

# Loaded on first use: `dfcache ls` reads the listing index (``_index.py``) without numpy and
# without the writer and reader code below.
_WHERE = {"ArrayReader": "._reader", "Artifact": "._reader",
          "ArrayWriter": "._writer", "ArtifactWriter": "._writer", "CommitOnExit": "._writer",
          "Store": "._store", "open_store": "._store",
          "default_chunk_rows": ".format", "recycled_empty": "._pools", "layout": ".layout",
          "Backend": "._backend", "Staging": "._backend", "Temporary": "._backend", "format": ".format",
          "listing": "._index", "MigrateResult": "._migrate", "migrate_store": "._migrate",
          "read_regular": "._files", "replace_derived": "._files", "populate_write": "._pagecache"}

__all__ = ["ArrayReader", "ArrayWriter", "Artifact", "ArtifactWriter", "Backend", "CommitOnExit", "MigrateResult",
           "Staging", "Store", "Temporary", "default_chunk_rows", "format", "layout", "listing", "migrate_store",
           "open_store", "populate_write", "read_regular", "recycled_empty", "replace_derived"]


def __getattr__(name: str):
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = import_module(where, __name__)
    value = module if name in ("format", "layout") else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
