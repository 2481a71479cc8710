"""dfcache: a content-addressed artifact cache with an offline-first runner.

The package knows nothing about drafters; the eval pipeline lives in ``runner/`` and reaches
storage only through this API:

    from dfcache import open_store, compute_key, fingerprint_path
"""

__version__ = "0.1.0"

_LAZY = {"DfcacheError": "errors", "compute_key": "keys", "fingerprint_path": "keys", "fingerprint_text": "keys"}


def __getattr__(name: str):
    # Imported on first use: `dfcache ls` (dfcache/__main__.py) needs none of them.
    if name not in _LAZY:
        raise AttributeError(f"module 'dfcache' has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value


def open_store(*args, **kwargs):
    """Open a store by path or URL; see :func:`dfcache.store.open_store`."""
    from .store import open_store as _open

    return _open(*args, **kwargs)


__all__ = ["DfcacheError", "compute_key", "fingerprint_path", "fingerprint_text", "open_store", "__version__"]
