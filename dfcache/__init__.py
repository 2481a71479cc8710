"""dfcache: a content-addressed artifact cache with an offline-first runner.

The package knows nothing about drafters; the eval pipeline lives in ``runner/`` and reaches
storage only through this API:

    from dfcache import open_store, compute_key, fingerprint_path
"""

__version__ = "0.1.0"

from .errors import DfcacheError  # noqa: E402
from .keys import compute_key, fingerprint_path, fingerprint_text  # noqa: E402


def open_store(*args, **kwargs):
    """Open a store by path or URL; see :func:`dfcache.store.open_store`."""
    from .store import open_store as _open

    return _open(*args, **kwargs)


__all__ = ["DfcacheError", "compute_key", "fingerprint_path", "fingerprint_text", "open_store", "__version__"]
