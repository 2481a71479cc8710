"""One opener per store location: a path, ``file://``, ``s3://``.

- a plain path (``./store``, ``/data/cache``): :class:`LocalBackend`, this user's own directory,
  read through the fast path;
- ``file:///path``: :class:`FileRemoteBackend`, the same layout read as someone else's directory
  (no symlink is ever followed), whether it is opened as ``--store`` or as a remote;
- ``s3://bucket/prefix``: :class:`ObjectStoreBackend`; refused while offline, before anything is
  imported or contacted.

Backends are imported only when their scheme is asked for: ``dfcache ls`` on a local store never
imports obstore.
"""

from __future__ import annotations

import os

from ..errors import UsageError
from ._backend import Backend, offline_refusal


def _local(loc: str, *, create: bool, **_) -> Backend:
    from ._local import LocalBackend

    return LocalBackend(loc, create=create)


def _file(url: str, *, create: bool, **_) -> Backend:
    from ._file_remote import FileRemoteBackend

    return FileRemoteBackend(url[len("file://"):], create=create)


def _s3(url: str, *, endpoint_url: str | None, region: str | None, **_) -> Backend:
    from ._s3 import ObjectStoreBackend

    return ObjectStoreBackend(url, endpoint_url=endpoint_url, region=region)


# scheme -> (needs the network, opener)
SCHEMES = {"": (False, _local), "file": (False, _file), "s3": (True, _s3)}


def open_backend(location: str | os.PathLike | None = None, *, create: bool = True,
                 endpoint_url: str | None = None, region: str | None = None,
                 offline: bool | None = None) -> Backend:
    """The backend for a path or URL; ``None`` means ``$DFCACHE_STORE`` or ``./store``.

    Nothing is contacted here; the first operation does. While offline (``offline``, else
    ``DFCACHE_OFFLINE``; not ``HF_HUB_OFFLINE``) a location that needs the network is refused with
    :class:`dfcache.errors.OfflineModeIsEnabled` (exit 3) before any socket is opened.
    """
    from ..config import default_store_location, offline_from_env

    loc = os.fspath(location) if location is not None else default_store_location()
    scheme = loc.split("://", 1)[0].lower() if "://" in loc else ""
    if scheme not in SCHEMES:
        if offline_from_env() if offline is None else offline:
            raise offline_refusal(loc)
        raise UsageError(f"store {loc}: the {scheme}:// scheme is not supported; use s3://bucket/prefix "
                         "(any S3-compatible server with --endpoint-url), file:///path or a directory.")
    needs_network, opener = SCHEMES[scheme]
    if needs_network and (offline_from_env() if offline is None else offline):
        raise offline_refusal(loc)
    return opener(loc, create=create, endpoint_url=endpoint_url, region=region)
