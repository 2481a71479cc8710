"""Where everything is in a store: every file and directory name of the on-disk layout, spelled
once, and the bounds on the two files read before any manifest (the marker, a manifest).

Public, part of the store format (:mod:`dfcache.store.format` re-exports every name here;
docs/format.md describes the same layout in prose). Nothing but ``os`` imported:
the ``dfcache`` executable's fast paths (``ls`` from the listing index, a fully cached ``run``)
find a store's marker and manifests with it, where importing the format module (manifests,
dataclasses, xxhash) would cost more than the listing itself.

A store (a directory, a ``file://`` remote, an ``s3://`` prefix)::

    dfcache-store.json                   STORE_MARKER: {"format_version": 2, "kind": "dfcache-store"}
    artifacts/<key[:2]>/<key>/           artifact_prefix(key): one committed artifact
    staging/<key>.<id>.tmp/              a writer's private staging area (local stores)
    staging/<key>.resume/                a resumable writer's staging area (local stores)
    staging/<name>.<id>.deleted          a grave: a directory renamed out of sight, being removed
    staging/<key>.<writer>/              uploads of an S3 writer that found the lease taken
    locks/<key>.lock                     serialises resumable writers of one key (local stores)
    locks/<key>.lease                    the one writer allowed under an artifact's prefix (S3)
    index/listing, index/listing.log     the listing index (local stores; derived data)
    index/samples/<partition>            the sample index of one partition (local stores; derived data)

An artifact (one zarr v3 group)::

    manifest.json                        MANIFEST, written last: its presence makes the artifact exist
    zarr.json                            GROUP_META, the group
    <array>/zarr.json                    array_meta_relpath(name)
    <array>/c/<i>/0[/0...]               chunk_relpath(name, i, ndim)
    blobs/<name>.json                    blob_relpath(name)

In a writer's staging area only, never published: ``progress.json`` (PROGRESS) and
``tails/<array>.bin`` (tail_relpath), a resumable writer's checkpoint.
"""

from __future__ import annotations

import os

__all__ = ["ARTIFACTS", "BLOBS", "CHUNKS", "GRAVE_SUFFIX", "GROUP_META", "INDEX", "LEASE_SUFFIX", "LISTING",
           "LISTING_LOG", "LOCKS", "LOCK_SUFFIX", "MANIFEST", "MARKER_KIND", "MAX_MANIFEST_BYTES", "MAX_MARKER_BYTES",
           "PROGRESS", "RESERVED_DIRS", "RESUME_SUFFIX", "SAMPLE_INDEX", "STAGING", "STORE_MARKER", "TAILS",
           "TMP_SUFFIX", "array_meta_relpath", "artifact_parts", "artifact_prefix", "blob_relpath", "chunk_prefix",
           "chunk_relpath", "index_tmp_name", "lock_relpath", "marker_tmp_name", "shard", "staging_relpath",
           "tail_relpath"]

STORE_MARKER = "dfcache-store.json"
MARKER_KIND = "dfcache-store"  # the marker's "kind": another program's file says something else
MAX_MARKER_BYTES = 64 << 10  # the marker is ~50 bytes; every backend reads at most this much of it
MAX_MANIFEST_BYTES = 64 << 20  # a manifest beyond this is hostile or broken; never download more

# A store's own directories below its root.
ARTIFACTS = "artifacts"
STAGING = "staging"
LOCKS = "locks"
INDEX = "index"
RESERVED_DIRS = (ARTIFACTS, STAGING, LOCKS, INDEX)
SAMPLE_INDEX = f"{INDEX}/samples"  # one file per partition
LISTING = "listing"  # in INDEX: the listing index's snapshot
LISTING_LOG = "listing.log"  # in INDEX: entries appended at commit

# Names of temporaries under STAGING: what gc recognises.
TMP_SUFFIX = ".tmp"  # a writer's private staging area
RESUME_SUFFIX = ".resume"  # a resumable writer's staging area, kept across crashes
GRAVE_SUFFIX = ".deleted"  # renamed out of sight, then removed (a removal cut short leaves it for gc)
LOCK_SUFFIX = ".lock"
LEASE_SUFFIX = ".lease"

# Inside an artifact.
MANIFEST = "manifest.json"
GROUP_META = "zarr.json"
BLOBS = "blobs"
CHUNKS = "c"
PROGRESS = "progress.json"  # a resumable writer's checkpoint, in its staging area only
TAILS = "tails"  # a resumable writer's rows short of a chunk, in its staging area only


def shard(key: str) -> str:
    """The directory under ARTIFACTS that holds an artifact: its key's first two digits."""
    return key[:2]


def artifact_parts(key: str) -> tuple[str, str, str]:
    """The path components of an artifact's directory below a store's root."""
    return ARTIFACTS, key[:2], key


def artifact_prefix(key: str) -> str:
    """Where an artifact lives below a store's root, with a trailing slash."""
    return f"{ARTIFACTS}/{key[:2]}/{key}/"


def lock_relpath(key: str, suffix: str = LOCK_SUFFIX) -> str:
    return f"{LOCKS}/{key}{suffix}"


def staging_relpath(name: str) -> str:
    return f"{STAGING}/{name}"


def chunk_prefix(name: str) -> str:
    """The directory of an array's chunks, with a trailing slash."""
    return f"{name}/{CHUNKS}/"


def chunk_relpath(name: str, index: int, ndim: int) -> str:
    """Chunk ``index`` of an array chunked along its first axis only: ``<name>/c/<index>/0...``."""
    return f"{name}/{CHUNKS}/{index}" + "/0" * (ndim - 1)


def array_meta_relpath(name: str) -> str:
    return f"{name}/{GROUP_META}"


def blob_relpath(name: str) -> str:
    return f"{BLOBS}/{name}.json"


def tail_relpath(name: str) -> str:
    return f"{TAILS}/{name}.bin"


def index_tmp_name(name: str) -> str:
    """A new temporary name beside the index file ``name`` being replaced (renamed over it within
    milliseconds): ``.<name>.<pid>.<12 hex>.tmp``. One still there after gc's grace period was
    left by a killed process."""
    return f".{name}.{os.getpid()}.{os.urandom(6).hex()}{TMP_SUFFIX}"


def marker_tmp_name() -> str:
    """A new temporary name for a store marker being written (renamed into place)."""
    return f"{STORE_MARKER}.{os.urandom(16).hex()}{TMP_SUFFIX}"
