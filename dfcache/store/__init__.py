"""Stores of committed artifacts: the API the runner (and users) call.

``open_store(path_or_url)`` gives a :class:`Store`; backends are private modules
(``_local.py`` for a directory, ``_remote.py`` for object stores) behind the small interface in
``_backend.py``. ``dfcache.testing.store_conformance`` is the suite every backend passes.
"""

from ._store import (ArrayReader, ArrayWriter, Artifact, ArtifactWriter, Store, default_chunk_rows,
                     open_store)

__all__ = ["ArrayReader", "ArrayWriter", "Artifact", "ArtifactWriter", "Store", "default_chunk_rows",
           "open_store"]
