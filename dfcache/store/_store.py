"""Artifacts: writing, committing, reading and verifying them, over any backend.

What the files are (names, encodings, digests, checks) is :mod:`dfcache.store.format`; this
module is the API on top of it: :class:`Store`, :class:`ArtifactWriter`, :class:`Artifact`.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import stat
import threading
from collections import deque
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .. import __version__
from .._lazy import LazyModule
from ..errors import (AmbiguousKeyError, ArtifactNotFoundError, IntegrityError, UntrustedManifestError,
                      UsageError)
from ..keys import KEY_PATTERN
from ..manifest import (CODECS, NAME_PATTERN, STORAGE_DTYPE, ArraySpec, BlobSpec, Manifest, key_problem,
                        validate_manifest)
from . import _pagecache
from . import format as fmt
from ._backend import Backend, Staging, UnreadableManifest
from ._files import OPEN_FLAGS, NotRegularFile, read_regular
from .format import default_chunk_rows  # noqa: F401  (default_chunk_rows: public via dfcache.store)
from .layout import BLOBS, CHUNKS, PROGRESS, TAILS, chunk_prefix, tail_relpath

np = LazyModule("numpy")  # imported by the first array read or write: opening a store and its manifests needs none

MAPPED_CHUNKS = 512  # mapped chunks kept per store: address space only, the page cache holds the data
VERIFIED_CHUNKS = 1 << 18  # chunk files a store remembers having checked (~40 MB at most)
ENCODE_AHEAD = 8  # compressed chunks in flight per array (up to 8 MiB of copies); beyond, the writer encodes too

_pools: dict[str, tuple[int, object]] = {}
_pools_lock = threading.Lock()


def _pool(name: str, workers: int):
    """A process's thread pool ``name``, made again in a forked child (whose copy of the
    parent's pool has no threads: work handed to it would never run)."""
    pid = os.getpid()
    with _pools_lock:
        hit = _pools.get(name)
        if hit is None or hit[0] != pid:
            from concurrent.futures import ThreadPoolExecutor

            hit = _pools[name] = (pid, ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"dfcache-{name}"))
        return hit[1]


def _encode_pool():
    """Threads that compress chunks: numcodecs releases the GIL, so the producer, the hashing
    and the compression of the next chunks run on different cores (and blosc off the main
    thread takes its single-threaded context, which is the faster one for one block)."""
    return _pool("encode", max(2, min(8, os.cpu_count() or 2)))


READ_SPLIT_BYTES = 4 << 20  # a read of at least this much is shared with the reader threads
LOAD_THREADS = 4  # chunk files loaded into the page cache at once by a cold read (they wait on the disk, not a core)


def _load_and_close(fd: int, size: int) -> None:
    try:
        _pagecache.load_large(fd, size)
    finally:
        os.close(fd)


def _read_workers() -> int:
    """Threads beside the caller that read and check chunk files of one large read (the pread
    and the xxh3 of the digest check both release the GIL), so a read uses the machine's cores."""
    return max(0, min(3, (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1) - 1))


class _Recycler:
    """Result buffers of large reads, handed out again once nothing refers to them.

    A fresh buffer of a few MB costs the kernel a page fault and a zeroed page per 4 KiB on its
    first write, about as much as reading the rows into it from the page cache. Each buffer
    handed out is a view of a pooled base array; every view, and every tensor or array made
    from one, keeps the base referenced, so a base whose reference count is back to the pool's
    own is unused and is filled again. Bases are anonymous maps (no hugepage advice: on the
    development VMs a read into a madvised, never-backed region was several times slower)."""

    KEEP = 6  # bases kept per process
    MAX_BYTES = 64 << 20  # larger results are plain allocations

    def __init__(self) -> None:
        self._bases: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray | None:
        """``nbytes`` bytes (uint8) nobody else holds, or None: allocate normally."""
        if nbytes > self.MAX_BYTES:
            return None
        import sys

        with self._lock:
            bases = self._bases
            best = None
            for i in range(len(bases)):
                # 2 = the list's reference and getrefcount's argument: no view of it is alive
                if bases[i].nbytes >= nbytes and sys.getrefcount(bases[i]) == 2 and (
                        best is None or bases[i].nbytes < bases[best].nbytes):
                    best = i
            if best is None:
                import mmap

                cap = -(-nbytes // (1 << 20)) * (1 << 20) or (1 << 20)
                base = np.frombuffer(mmap.mmap(-1, cap), dtype=np.uint8)
                if len(bases) >= self.KEEP:
                    free = [i for i in range(len(bases)) if sys.getrefcount(bases[i]) == 2]
                    if not free:
                        return base[:nbytes]  # all in use: this one is not kept
                    bases.pop(min(free, key=lambda i: bases[i].nbytes))
                bases.append(base)
                best = len(bases) - 1
            return bases[best][:nbytes]


_recycler = _Recycler()


def recycled_empty(shape: tuple, dtype) -> np.ndarray:
    """An uninitialised array like ``np.empty``, in a recycled buffer when it is large (see
    :class:`_Recycler`): for results handed to a caller who drops them before the next ones."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    buf = _recycler.take(nbytes) if nbytes >= (1 << 20) else None
    if buf is None:
        return np.empty(shape, dtype=dtype)
    return buf.view(dtype).reshape(shape)


_scratch_local = threading.local()


def _scratch(nbytes: int) -> np.ndarray:
    """A per-thread buffer for partial chunk reads, reused: a fresh one costs its page faults."""
    buf = getattr(_scratch_local, "buf", None)
    if buf is None or buf.nbytes < nbytes:
        buf = _scratch_local.buf = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
    return buf[:nbytes]


RACY_NS = 2_000_000_000  # a file changed this recently may change again within one timestamp tick


def _signature(st: os.stat_result) -> tuple:
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _settled(st: os.stat_result) -> bool:
    """Whether a check of this file may be remembered by its signature: file times advance by
    the kernel's coarse clock tick, so a file rewritten within the tick of its last change (a
    fresh commit, then a byte flipped in place) keeps its signature. A check made within
    ``RACY_NS`` of the last change is not remembered (as git treats a racy index entry)."""
    import time

    return time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) > RACY_NS


def _pread_full(fd: int, buf: np.ndarray, offset: int) -> int:
    """Read ``buf.nbytes`` bytes at ``offset`` (short only at the end of the file)."""
    view = memoryview(buf).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            break
        done += n
    return done


def repair_hint(key: str) -> str:
    """How to get past a corrupt or incomplete local artifact: the fix of every such error."""
    return (f"Delete it with `dfcache gc --key {key[:12]} --yes` and run again to recompute it, or pull "
            "it again.")


# ------------------------------------------------------------------------------------ writing


class ArrayWriter:
    """Appends rows to one array; full chunks go to the staging area as soon as they fill."""

    def __init__(self, owner: "ArtifactWriter", name: str, shape: tuple[int, ...] | None,
                 row_shape: tuple[int, ...], dtype: str, chunk_rows: int, codec: str) -> None:
        self.owner = owner
        self.name = name
        self.total_rows = None if shape is None else shape[0]
        self.row_shape = tuple(row_shape)
        self.dtype = dtype
        self.storage_dtype = np.dtype(STORAGE_DTYPE[dtype])
        self.chunk_rows = chunk_rows
        self.codec = codec
        self.chunk_digests: list[str] = []
        # The rows of the chunk being filled: one chunk-sized buffer filled in place (appending
        # to a growing array would copy the tail again on every append: quadratic for a segment
        # written as one chunk).
        self._buf: np.ndarray | None = None
        self._fill = 0
        self.closed = False
        self._inflight: deque = deque()  # compressed chunks being encoded and staged

    @property
    def rows_written(self) -> int:
        return len(self.chunk_digests) * self.chunk_rows + self._fill

    @property
    def _tail(self) -> np.ndarray:
        """The rows appended since the last full chunk (a view of the fill buffer)."""
        if self._buf is None:
            return np.empty((0,) + self.row_shape, dtype=self.storage_dtype)
        return self._buf[:self._fill]

    def _keep(self, rows: np.ndarray) -> None:
        """Copy rows (fewer than a chunk) to the end of the fill buffer."""
        if self._buf is None:
            self._buf = np.empty((self.chunk_rows,) + self.row_shape, dtype=self.storage_dtype)
        self._buf[self._fill:self._fill + len(rows)] = rows
        self._fill += len(rows)

    def _as_storage(self, data: np.ndarray) -> np.ndarray:
        data = np.asarray(data)
        got = fmt.logical_dtype_of(data) if data.dtype.name != "uint16" else "uint16"
        if self.dtype == "bfloat16" and got in ("bfloat16", "uint16"):
            data = data.view(np.uint16)
        elif got != self.dtype:
            raise UsageError(f"array {self.name} is {self.dtype}; got {got} rows.")
        if data.shape[1:] != self.row_shape:
            raise UsageError(f"array {self.name} rows have shape {self.row_shape}; got {data.shape[1:]}.")
        return data

    def append(self, data: np.ndarray, *, kept: bool = False) -> None:
        """Append rows (first axis). bf16 may be given as ml_dtypes.bfloat16 or its uint16 bits.

        ``kept=True``: the caller leaves ``data`` unchanged until the writer is finished or
        drained (``write_array`` does), so compressed chunks are encoded from it without a copy."""
        if self.closed:
            raise UsageError(f"array {self.name} is already finished.")
        data = self._as_storage(data)
        if self.total_rows is not None and self.rows_written + len(data) > self.total_rows:
            raise UsageError(f"array {self.name} has {self.total_rows} rows; appending "
                             f"{len(data)} to {self.rows_written} overflows it.")
        if self._fill:
            need = self.chunk_rows - self._fill
            self._keep(data[:need])
            data = data[need:]
            if self._fill == self.chunk_rows:
                self._write_chunk(self._buf)  # consumed before it returns: the buffer is free again
                self._fill = 0
        while len(data) >= self.chunk_rows:
            self._write_chunk(data[: self.chunk_rows], kept=kept)
            data = data[self.chunk_rows:]
        if len(data):
            self._keep(data)

    def _write_chunk(self, rows: np.ndarray, *, kept: bool = False) -> None:
        index = len(self.chunk_digests)
        full = rows
        if len(rows) < self.chunk_rows:
            full = np.zeros((self.chunk_rows,) + self.row_shape, dtype=self.storage_dtype)
            full[: len(rows)] = rows
            kept = True  # a private copy
        if full.dtype.byteorder == ">":
            full = full.astype(full.dtype.newbyteorder("<"))
            kept = True
        rel = fmt.chunk_relpath(self.name, index, 1 + len(self.row_shape))
        if self.codec == "none":
            self.chunk_digests.append(fmt.chunk_digest(full[:len(rows)]))
            self.owner._put(rel, fmt.encode_chunk(full, self.codec))
            return
        if not kept and full is rows:  # the caller's rows: it may reuse its buffer once append() returns
            full = np.array(rows, copy=True)
        # The encoder fills in the digest, taken from the rows it is about to compress (read from
        # memory once, then compressed from the cache); drain() waits for it.
        self.chunk_digests.append(None)
        while self._inflight and self._inflight[0].done():
            self._inflight.popleft().result()
        if len(self._inflight) >= ENCODE_AHEAD:  # the encoders are busy: this thread encodes too
            self._encode_put(rel, index, full, len(rows))
            return
        self._inflight.append(_encode_pool().submit(self._encode_put, rel, index, full, len(rows)))

    def _encode_put(self, rel: str, index: int, full: np.ndarray, rows: int) -> None:
        self.chunk_digests[index] = fmt.chunk_digest(full[:rows])
        self.owner._put(rel, fmt.encode_chunk(full, self.codec))

    def drain(self, *, raise_errors: bool = True) -> None:
        """Wait until every chunk handed to the encoder threads is staged."""
        while self._inflight:
            future = self._inflight.popleft()
            if raise_errors:
                future.result()
            else:
                future.exception()

    def finish(self) -> ArraySpec:
        if not self.closed:
            if self.total_rows is not None and self.rows_written != self.total_rows:
                raise UsageError(f"array {self.name} has {self.rows_written} of {self.total_rows} rows; "
                                 "write them all before committing.")
            self.total_rows = self.rows_written
            if self._fill:
                self._write_chunk(self._tail)
                self._fill = 0
            self.closed = True
        self.drain()
        shape = [self.total_rows] + list(self.row_shape)
        self.owner._put(fmt.array_meta_relpath(self.name),
                        fmt.array_zarr_json(tuple(shape), self.storage_dtype.name, self.chunk_rows,
                                         self.codec, self.dtype))
        nbytes = int(np.prod(shape, dtype=np.int64)) * self.storage_dtype.itemsize
        return ArraySpec(shape=shape, dtype=self.dtype, chunk_rows=self.chunk_rows,
                         digest=fmt.array_digest(self.chunk_digests), nbytes=nbytes, codec=self.codec,
                         chunk_digests=list(self.chunk_digests))

    def state(self) -> dict:
        return {"row_shape": list(self.row_shape), "total_rows": self.total_rows, "dtype": self.dtype,
                "chunk_rows": self.chunk_rows, "codec": self.codec,
                "chunk_digests": list(self.chunk_digests), "tail_rows": len(self._tail),
                # The tail file and progress.json are replaced one after the other; a crash between
                # the two leaves a newer tail beside older progress, possibly of the same length.
                # Its digest tells them apart (a mismatched tail is dropped, never appended to).
                "tail_digest": fmt.chunk_digest(self._tail) if len(self._tail) else None}


class CommitOnExit:
    """``with writer:`` commits when the block ends normally and aborts when it raises (or when
    the commit itself fails); a writer implements ``commit()`` and ``abort()``, and may keep
    something before aborting in :meth:`_on_failure`."""

    def commit(self):
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError

    def _on_failure(self, exc_type) -> None:
        self.abort()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            try:
                self.commit()
            except BaseException:
                self.abort()
                raise
        else:
            self._on_failure(exc_type)


class ArtifactWriter(CommitOnExit):
    """Stages one artifact privately and publishes it atomically, manifest last.

    Use as a context manager: leaving the block normally commits; an exception aborts (a
    resumable writer keeps its progress for the next attempt).

    Example::

        with store.writer(key, stage="tokens", stage_version=1, inputs={...}) as w:
            w.write_array("token_ids", ids)
            w.put_json("meta", {...})
        w.manifest  # the committed manifest (possibly another process's identical copy)
    """

    def __init__(self, store: "Store", key: str, *, stage: str, stage_version: int, inputs: dict,
                 upstream: dict | None = None, provenance: dict | None = None, summary: str = "",
                 resumable: bool = False, samples: dict | None = None,
                 sample_refs: list | None = None) -> None:
        if not KEY_PATTERN.match(key):
            raise UsageError(f"{key!r} is not a key (32 hex digits).")
        self.store = store
        self.key = key
        self.stage = stage
        self.stage_version = stage_version
        self.inputs = inputs
        self.upstream = upstream or {}
        self.provenance = dict(provenance or {})
        self.summary = summary
        self.resumable = resumable
        self.samples = samples  # manifest fields of segments and of artifacts made from samples
        self.sample_refs = sample_refs
        self.manifest: Manifest | None = None
        self.won = False
        self._arrays: dict[str, ArrayWriter] = {}
        self._blobs: dict[str, BlobSpec] = {}
        self._files: dict[str, int] = {}
        self._lock = threading.Lock()
        self._staging: Staging = store.backend.open_staging(key, resumable=resumable)
        self.state: dict = {}
        self._resumed: dict = {}
        if resumable:
            raw = self._staging.get(PROGRESS)
            if raw:
                try:
                    progress = json.loads(raw)
                    if progress.get("identity") == self._identity() and self._intact(progress.get("files", {})):
                        blobs = {k: BlobSpec(**v) for k, v in progress.get("blobs", {}).items()}
                        self._resumed = progress
                        self.state = progress.get("user_state", {})
                        self._files = dict(progress.get("files", {}))
                        self._blobs = blobs
                except (ValueError, TypeError, AttributeError):
                    self._resumed = {}

    def _intact(self, files: dict) -> bool:
        """Every file the progress lists is still staged at its size (a removal that was cut
        short, e.g. a killed `rm -r` or gc, must not pass for progress: start over instead)."""
        return all(self._staging.size(rel) == n for rel, n in files.items() if not rel.startswith(TAILS + "/"))

    def _identity(self) -> dict:
        return {"key": self.key, "stage": self.stage, "stage_version": self.stage_version}

    @property
    def resumed(self) -> bool:
        return bool(self._resumed)

    def _put(self, relpath: str, data) -> None:
        n = self._staging.put(relpath, data)
        with self._lock:
            self._files[relpath] = n

    def create_array(self, name: str, shape: tuple[int, ...] | list[int], dtype: str, *,
                     chunk_rows: int | None = None, codec: str = "none",
                     unknown_rows: bool = False) -> ArrayWriter:
        """Start an array whose rows are then appended. On a resumed writer the rows already
        checkpointed are kept (``rows_written`` says how many)."""
        if not NAME_PATTERN.match(name) or ".." in name or name in (BLOBS, CHUNKS):
            raise UsageError(f"array name {name!r} is not allowed; use letters, digits, _ . -.")
        if name in self._arrays:
            raise UsageError(f"array {name} was already created in this artifact.")
        if dtype not in STORAGE_DTYPE:
            raise UsageError(f"dtype {dtype!r} cannot be stored; use one of {', '.join(STORAGE_DTYPE)}.")
        if codec not in CODECS:
            raise UsageError(f"codec {codec!r} is unknown; use one of {', '.join(CODECS)}.")
        shape = tuple(int(s) for s in shape)
        if not shape:
            raise UsageError(f"array {name} needs at least one dimension.")
        if chunk_rows is None:
            chunk_rows = default_chunk_rows(shape, dtype)
            if not unknown_rows:  # a small array is one chunk, not one padded to 4 MB
                chunk_rows = min(chunk_rows, max(1, shape[0]))
        chunk_rows = int(chunk_rows)
        if chunk_rows < 1:
            raise UsageError(f"chunk_rows of array {name} must be at least 1.")
        aw = ArrayWriter(self, name, None if unknown_rows else shape, shape[1:], dtype, chunk_rows, codec)
        prev = self._resumed.get("arrays", {}).get(name)
        if prev and prev["row_shape"] == list(shape[1:]) and prev["dtype"] == dtype \
                and prev["chunk_rows"] == chunk_rows and prev["codec"] == codec \
                and prev["total_rows"] == aw.total_rows:
            aw.chunk_digests = list(prev["chunk_digests"])
            if prev["tail_rows"]:
                raw = self._staging.get(tail_relpath(name))
                if raw is not None:
                    tail = np.frombuffer(raw, dtype=aw.storage_dtype).reshape((-1,) + aw.row_shape)
                    if len(tail) == prev["tail_rows"] and prev.get("tail_digest") == fmt.chunk_digest(tail):
                        aw._keep(tail)
        self._arrays[name] = aw
        return aw

    def write_array(self, name: str, data: np.ndarray, *, dtype: str | None = None,
                    chunk_rows: int | None = None, codec: str = "none") -> None:
        """Write a whole array in one call."""
        data = np.asarray(data)
        if data.ndim == 0:
            data = data.reshape(1)
        aw = self.create_array(name, data.shape, dtype or fmt.logical_dtype_of(data), chunk_rows=chunk_rows,
                               codec=codec)
        if aw.rows_written == 0:
            aw.append(data, kept=True)
            aw.drain()  # the encoders are done with ``data`` when this returns

    def put_json(self, name: str, obj: Any) -> None:
        """Store a small JSON document with the artifact (read back with ``Artifact.json``)."""
        if not NAME_PATTERN.match(name) or ".." in name:
            raise UsageError(f"blob name {name!r} is not allowed; use letters, digits, _ . -.")
        data = json.dumps(obj, sort_keys=True, ensure_ascii=False, allow_nan=False).encode()
        self._put(fmt.blob_relpath(name), data)
        self._blobs[name] = BlobSpec(digest=fmt.blob_digest(data), nbytes=len(data))

    def checkpoint(self, state: dict | None = None) -> None:
        """Persist progress so a later writer of the same key resumes from here (resumable only)."""
        if not self.resumable:
            raise UsageError("checkpoint() needs store.writer(..., resumable=True).")
        if state is not None:
            self.state = state
        for aw in self._arrays.values():
            aw.drain()  # the chunks the progress names are staged
        for name, aw in self._arrays.items():
            if len(aw._tail):
                self._put(tail_relpath(name), memoryview(np.ascontiguousarray(aw._tail).view(np.uint8).reshape(-1)))
        progress = {"identity": self._identity(), "user_state": self.state,
                    "arrays": {n: aw.state() for n, aw in self._arrays.items()},
                    "blobs": {k: asdict(v) for k, v in self._blobs.items()},
                    "files": self._files}
        self._staging.flush()  # the data a checkpoint names is durable before the checkpoint
        self._staging.put(PROGRESS, json.dumps(progress).encode())
        self._staging.flush()

    def commit(self) -> Manifest:
        if self.manifest is not None:
            return self.manifest
        arrays = {}
        for name, aw in self._arrays.items():
            arrays[name] = aw.finish()
        self._put(fmt.GROUP_META, fmt.group_zarr_json(self.key, self.stage))
        files = {k: v for k, v in self._files.items() if not k.startswith(TAILS + "/")}
        import socket  # here: opening a store and reading manifests need no host name

        provenance = {"host": socket.gethostname(), "dfcache": __version__, **self.provenance}
        manifest = Manifest(key=self.key, stage=self.stage, stage_version=self.stage_version,
                            inputs=self.inputs, upstream=self.upstream, provenance=provenance,
                            arrays=arrays, blobs=dict(self._blobs),
                            created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                            size_bytes=sum(files.values()), dfcache_version=__version__,
                            summary=self.summary, samples=self.samples, sample_refs=self.sample_refs)
        # Validate what we are about to publish with the same rules readers apply.
        validate_manifest(json.loads(manifest.to_json()), expect_key=self.key)
        self.won = self._staging.publish(manifest.to_json().encode())
        self.manifest = manifest if self.won else self.store.manifest(self.key)
        return self.manifest

    def _drain_quietly(self) -> None:
        for aw in self._arrays.values():  # no encoder thread may write into a removed staging area
            aw.drain(raise_errors=False)

    def abort(self) -> None:
        self._drain_quietly()
        self._staging.abort()

    def discard(self) -> None:
        """Abort and drop resumable progress too."""
        self._drain_quietly()
        self._staging.discard()

    def _on_failure(self, exc_type) -> None:
        if self.resumable and issubclass(exc_type, Exception):
            try:
                self.checkpoint()
            except Exception:
                pass
        self.abort()


# ------------------------------------------------------------------------------------ reading


class ArrayReader:
    """Read-only view of a committed array; slicing rows reads only the chunks they touch."""

    def __init__(self, artifact: "Artifact", name: str, spec: ArraySpec) -> None:
        self.artifact = artifact
        self.name = name
        self.spec = spec
        self.shape = tuple(spec.shape)
        self.dtype = spec.dtype
        self.chunk_rows = spec.chunk_rows
        self._ndim = len(self.shape)
        self._storage = np.dtype(STORAGE_DTYPE[spec.dtype])
        self._row_bytes = int(np.prod(self.shape[1:], dtype=np.int64)) * self._storage.itemsize
        self._file_bytes = self.chunk_rows * self._row_bytes + 4  # an uncompressed chunk file: body, crc32c

    def __len__(self) -> int:
        return self.shape[0]

    def _check_meta(self) -> None:
        """Once per store and array: the array's zarr.json agrees with the manifest."""
        key = self.artifact.key
        checked = self.artifact.store._meta_checked
        if (key, self.name) in checked:
            return
        try:
            fmt.parse_array_meta(self.artifact._read(fmt.array_meta_relpath(self.name)), self.spec, self.name, key)
        except FileNotFoundError:
            raise IntegrityError(f"array {self.name} of artifact {key} is corrupt: zarr.json is missing.",
                                 key=key, fix=repair_hint(key)) from None
        except IntegrityError as e:
            raise e.with_fix(repair_hint(key)) from None
        checked.add((key, self.name))

    def _chunk(self, index: int) -> np.ndarray:
        """Chunk ``index``'s logical rows, read and checked in full (crc32c, decoded size,
        digest): the path of compressed and remote chunks, and of any local chunk whose fast
        read failed, which it then names exactly."""
        self._check_meta()
        key = self.artifact.key
        rel = fmt.chunk_relpath(self.name, index, self._ndim)
        where = f"chunk {index} of array {self.name} in artifact {key}"
        try:
            data = self.artifact._read(rel)
        except FileNotFoundError:
            raise IntegrityError(f"{where} is missing; the artifact is incomplete.", key=key,
                                 fix=repair_hint(key)) from None
        except IntegrityError as e:
            raise e.with_fix(repair_hint(key)) from None
        try:
            return fmt.check_chunk(self.spec, self.name, index, data, key)
        except IntegrityError as e:
            fix = repair_hint(key)
            if e.reason == fmt.MOVED:  # the artifact it came from (or went to) is wrong too
                fix += " `dfcache verify` finds every artifact affected; `dfcache gc --bad --yes` removes them all."
            raise e.with_fix(fix) from None

    def read_raw(self, start: int = 0, stop: int | None = None, *, out: np.ndarray | None = None,
                 mapped: bool = False) -> np.ndarray:
        """Rows [start, stop) in the storage dtype (bf16 comes back as its uint16 bits).

        ``out``: an array of at least that many rows (storage dtype, row shape) to read into,
        e.g. a buffer reused across reads or the columns of a wider one (``big[:, 0:1024]``);
        the rows read are returned as a view of it.

        Local uncompressed chunks are read with one ``pread`` each, straight into the result, the
        chunk files not in the page cache first set loading all at once (in large folios where
        the kernel allows, so later warm reads of them copy as fast as of freshly written ones;
        see ``_pagecache``); a read of 4 MiB or more is split into runs of
        chunks read and checked on reader threads beside the caller's (one per further core, up
        to 3). Each chunk file is checked against the manifest's digest of its rows (intact, and
        the chunk of this place: artifact, array, position) the first time this store reads it,
        and the check is remembered by the file's inode, size, mtime and ctime, so a later read
        reads only the rows it needs (a file rewritten or replaced is checked again; one
        corrupted in place without any of those changing is not noticed until the store is
        reopened, and ``verify`` still checks everything). Without ``out``, a result of 1 MiB or more lives in
        a recycled buffer: one whose previous result (and everything made from it) is gone.

        ``mapped=True`` (local, uncompressed chunks): chunk files are memory-mapped and checked
        against their digest the first time this store maps them, not on every read; rows are then
        copied straight from the page cache into ``out``. For many small random reads over the
        same chunks (training). Each use ``stat``s the file: one whose signature changed since
        its check is mapped and checked again (``verify`` still checks everything)."""
        n = self.shape[0]
        stop = n if stop is None else min(stop, n)
        start = max(0, start)
        rows = max(0, stop - start)
        if out is None:
            out = recycled_empty((rows,) + self.shape[1:], self._storage)
        else:
            if out.dtype != self._storage or out.shape[1:] != self.shape[1:] or len(out) < rows:
                raise UsageError(f"out= must be a {self._storage} array of at least {rows} rows of shape "
                                 f"{self.shape[1:]}.")
            out = out[:rows]
        if stop <= start:
            return out
        c0, c1 = start // self.chunk_rows, (stop - 1) // self.chunk_rows
        if mapped:
            for i in range(c0, c1 + 1):
                lo = i * self.chunk_rows
                a, b = max(lo, start), min(lo + self.chunk_rows, stop)
                chunk = self._mapped_chunk(i)
                if chunk is None:
                    chunk = self._chunk(i)
                out[a - start:b - start] = chunk[a - lo:b - lo]
            return out
        todo = list(range(c0, c1 + 1))
        if self.spec.codec == "none" and self.artifact._local_dir() is not None:
            self._check_meta()
            groups = 1 + _read_workers() if rows * self._row_bytes >= READ_SPLIT_BYTES else 1
            groups = min(groups, len(todo))
            if groups > 1:  # contiguous runs of chunks, the caller's thread reading the first
                cut = [len(todo) * g // groups for g in range(groups + 1)]
                pool = _pool("read", groups - 1)
                futures = [pool.submit(self._read_run, todo[cut[g]:cut[g + 1]], start, stop, out)
                           for g in range(1, groups)]
                done = [self._read_run(todo[cut[0]:cut[1]], start, stop, out)]
                done += [f.result() for f in futures]
            else:
                done = [self._read_run(todo, start, stop, out)]
            self._remember(v for verified, _ in done for v in verified)
            todo = [i for _, failed in done for i in failed]
        for i in todo:  # not local, missing or failing its check: _chunk() says what is wrong
            lo = i * self.chunk_rows
            a, b = max(lo, start), min(lo + self.chunk_rows, stop)
            out[a - start:b - start] = self._chunk(i)[a - lo:b - lo]
        return out

    def _read_run(self, chunks: list[int], start: int, stop: int, out: np.ndarray) -> tuple[list, list[int]]:
        """Chunks' rows of [start, stop) into ``out`` (run on any thread; each run opens its own
        files, so a reader thread starts at once). Returns the chunk files checked now (to
        remember) and the chunks to read through _chunk()."""
        verified, failed = [], []
        fds, loads = self._open_local(chunks)
        try:
            for i in chunks:
                lo = i * self.chunk_rows
                a, b = max(lo, start), min(lo + self.chunk_rows, stop)
                fd = fds.get(i)
                if i in loads:
                    loads[i].result()
                sig = self._read_local(fd, i, a, b, out[a - start:b - start]) if fd is not None else False
                if sig is False:
                    failed.append(i)
                elif sig is not True:
                    verified.append(sig)
        finally:
            for load in loads.values():  # a load still running uses its descriptor
                load.result()
            for fd in fds.values():
                os.close(fd)
        return verified, failed

    def _remember(self, verified) -> None:
        store = self.artifact.store
        for ck, sig in verified:
            if len(store._verified) >= VERIFIED_CHUNKS:
                store._verified.pop(next(iter(store._verified)))
            store._verified[ck] = sig

    def prefetch(self, start: int = 0, stop: int | None = None) -> None:
        """Start loading the chunk files of rows [start, stop) that this store has not mapped
        yet and that are not already in the page cache, and return at once (on loader threads
        in large folios where the system allows, see _pagecache; else POSIX_FADV_WILLNEED). A
        reader of several arrays calls it on each before reading any, so the files of one sample
        load in parallel instead of one blocking read after another; a no-op for remote or
        already mapped chunks."""
        if self.spec.codec != "none" or not hasattr(os, "posix_fadvise"):
            return
        n = self.shape[0]
        stop = n if stop is None else min(stop, n)
        if stop <= start:
            return
        mapped = self.artifact.store._mapped
        large = _pagecache.available()
        for i in range(max(0, start) // self.chunk_rows, (stop - 1) // self.chunk_rows + 1):
            if (self.artifact.key, self.name, i) in mapped:
                continue
            path = self.artifact._local_path(fmt.chunk_relpath(self.name, i, self._ndim))
            if path is None:
                return
            try:
                fd = os.open(path, OPEN_FLAGS)  # (O_NONBLOCK: a FIFO planted as a chunk must not hang)
            except OSError:
                continue  # the read reports it
            if large and _pagecache.missing_pages(fd, self._file_bytes):
                _pool("load", LOAD_THREADS).submit(_load_and_close, fd, self._file_bytes)
                continue
            try:
                if not large:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)

    def _mapped_chunk(self, index: int) -> np.ndarray | None:
        """An uncompressed local chunk's rows over a read-only mmap, checked against its digest
        (fmt.rows_match) when first mapped by this store, then kept (a bounded number per store)
        while the file's signature (inode, size, mtime, ctime; one ``stat`` per use) stays what it
        was when checked: a file changed on disk is mapped and checked again. None: use _chunk()."""
        if self.spec.codec != "none":
            return None
        store = self.artifact.store
        ck = (self.artifact.key, self.name, index)
        hit = store._mapped.get(ck)
        if hit is not None:
            try:
                if _signature(os.stat(hit[1])) == hit[2]:
                    return hit[0]
            except OSError:
                pass
            store._mapped.pop(ck, None)
        self._check_meta()
        path = self.artifact._local_path(fmt.chunk_relpath(self.name, index, self._ndim))
        if path is None:
            return None
        import mmap

        body = self._file_bytes - 4
        loaded = False
        try:
            fd = os.open(path, OPEN_FLAGS)
        except OSError:
            return None  # _chunk() reports what is wrong
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return None
            if _pagecache.missing_pages(fd, st.st_size):
                loaded = _pagecache.load_large(fd, st.st_size)
            mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)
        if not loaded and hasattr(mm, "madvise"):  # one large read-ahead for the check, not a fault per few pages
            mm.madvise(mmap.MADV_WILLNEED)
        raw = np.frombuffer(mm, dtype=np.uint8)
        if len(raw) != body + 4 or not fmt.rows_match(raw[:body], self.spec, index):
            del raw
            mm.close()
            return None  # _chunk() re-reads it and says exactly what is wrong
        arr = raw[:body].view(self._storage.newbyteorder("<")).reshape((self.chunk_rows,) + self.shape[1:])
        if _settled(st):  # (an unsettled file is checked again on its next read)
            if len(store._mapped) >= MAPPED_CHUNKS:
                store._mapped.pop(next(iter(store._mapped)))  # the mapping closes with its last view
            store._mapped[ck] = (arr, os.fspath(path), _signature(st))
        return arr

    def map_rows(self, start: int, stop: int) -> np.ndarray | None:
        """Rows [start, stop) with no copy: a private (copy-on-write) memory map of just those
        rows of their chunk file, or None when they are not in one local uncompressed chunk
        whose check this store remembers (then read them with ``read_raw``).

        The chunk is checked against its digest when the store first maps it (as
        ``read_raw(mapped=True)``), and the file this map is made from is the one checked (same
        signature). Writing to the result changes this process's copy of the pages, never the
        file or another result; the pages are read from the page cache on first touch, as
        ``torch.load(mmap=True)`` does."""
        if self.spec.codec != "none" or stop <= start or start < 0 or stop > self.shape[0]:
            return None
        index = start // self.chunk_rows
        if (stop - 1) // self.chunk_rows != index or self._mapped_chunk(index) is None:
            return None
        hit = self.artifact.store._mapped.get((self.artifact.key, self.name, index))
        if hit is None:  # checked now but too fresh to remember (see _settled): read_raw reads it
            return None
        import mmap

        try:
            fd = os.open(hit[1], OPEN_FLAGS)
        except OSError:
            return None
        try:
            if _signature(os.fstat(fd)) != hit[2]:
                return None  # replaced since it was checked: read_raw checks the new file
            row_bytes = self._row_bytes
            a = (start - index * self.chunk_rows) * row_bytes
            b = a + (stop - start) * row_bytes
            lo = a - a % mmap.ALLOCATIONGRANULARITY
            mm = mmap.mmap(fd, b - lo, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=lo)
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)
        rows = np.frombuffer(mm, dtype=self._storage.newbyteorder("<"), count=(b - a) // self._storage.itemsize,
                             offset=a - lo)  # the map closes with the last view of it
        return rows.reshape((stop - start,) + tuple(self.shape[1:]))

    def _open_local(self, chunks: list[int]) -> tuple[dict[int, int], dict]:
        """Descriptors of the local uncompressed chunks ``chunks`` (a missing one left out:
        _chunk() reports it), and for a read of several chunks the files not in the page cache
        set loading at once, so a cold read has every chunk in flight instead of one file's
        readahead at a time: each on a loader thread in large folios where the system allows
        (see _pagecache; returned as futures by chunk), else by POSIX_FADV_WILLNEED."""
        prefix, suffix = chunk_prefix(self.name), "/0" * (self._ndim - 1)
        fds: dict[int, int] = {}
        for i in chunks:
            fd = self.artifact._open_local(f"{prefix}{i}{suffix}")
            if fd is not None:
                fds[i] = fd
        loads: dict = {}
        if len(chunks) < 2:
            return fds, loads
        if _pagecache.available():
            for i, fd in fds.items():
                if _pagecache.missing_pages(fd, self._file_bytes):
                    loads[i] = _pool("load", LOAD_THREADS).submit(_pagecache.load_large, fd, self._file_bytes)
            return fds, loads
        for fd in fds.values():
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            except (AttributeError, OSError):
                pass
        return fds, loads

    def _read_local(self, fd: int, index: int, a: int, b: int, dest: np.ndarray):
        """Rows [a, b) of uncompressed local chunk ``index`` into ``dest``. The chunk is checked
        against its digest (fmt.rows_match) the first time this store reads the file (known by
        inode, size, mtime, ctime); after that only the rows asked for are read. Returns True (read, known good), the
        (chunk, signature) to remember (read and checked now), or False: use _chunk(), which
        says what is wrong. Safe on any thread: it records nothing itself."""
        store = self.artifact.store
        row_bytes = self._row_bytes
        body = self.chunk_rows * row_bytes
        lo = index * self.chunk_rows
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return False  # a FIFO or a directory in a chunk's place: _chunk() says so
        sig = _signature(st)
        ck = (self.artifact.key, self.name, index)
        contiguous = dest.flags.c_contiguous
        if store._verified.get(ck) == sig:
            want = (b - a) * row_bytes
            buf = dest.reshape(-1).view(np.uint8) if contiguous else _scratch(want)
            if _pread_full(fd, buf, (a - lo) * row_bytes) != want:
                return False
            if not contiguous:
                dest[...] = buf.view(self._storage.newbyteorder("<")).reshape(dest.shape)
            return True
        whole = contiguous and a == lo and b - lo == self.chunk_rows
        buf = dest.reshape(-1).view(np.uint8) if whole else _scratch(body)
        # The body and the crc32c after it in one system call (the fifth byte asked for must not
        # come: the file ends there); a short read (rare) is finished one call at a time.
        trailer = bytearray(5)
        got = os.preadv(fd, [buf, trailer], 0)
        if got != body + 4 and (got >= body or _pread_full(fd, buf, 0) != body or len(os.pread(fd, 5, body)) != 4):
            return False  # not a chunk file of this array's size
        # The manifest's digest of this chunk's rows: bytes intact *and* the file the manifest
        # names for this place (a chunk moved from another array keeps a valid crc32c). One pass,
        # in place of the crc32c: xxh3 is the faster (docs/format.md); verify checks the crc too.
        if not fmt.rows_match(buf, self.spec, index):
            return False
        if not whole:
            rows = buf.view(self._storage.newbyteorder("<")).reshape((self.chunk_rows,) + self.shape[1:])
            dest[...] = rows[a - lo:b - lo]
        return (ck, sig) if _settled(st) else True

    def read(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows [start, stop) in the logical dtype (bf16 as ml_dtypes.bfloat16)."""
        raw = self.read_raw(start, stop)
        if self.dtype == "bfloat16":
            return raw.view(fmt.np_logical_dtype("bfloat16"))
        return raw

    def __getitem__(self, item) -> np.ndarray:
        if isinstance(item, slice):
            start, stop, step = item.indices(self.shape[0])
            if step != 1:
                return self.read()[item]
            return self.read(start, stop)
        if isinstance(item, (int, np.integer)):
            i = int(item) + (self.shape[0] if item < 0 else 0)
            if not 0 <= i < self.shape[0]:
                raise IndexError(f"row {item} out of range for {self.shape[0]} rows")
            return self.read(i, i + 1)[0]
        if isinstance(item, tuple) and item and isinstance(item[0], slice):
            return self[item[0]][(slice(None),) + item[1:]]
        raise TypeError("arrays are indexed by a row number or a row slice")

    def digest_problems(self) -> list[str]:
        """Re-hash every chunk; return what does not match the manifest (verify's check)."""
        art = self.artifact
        files = {rel: role for rel, role in fmt.expected_files(art.manifest).items()
                 if role.kind == "chunk" and role.name == self.name}
        return art._file_problems(files)


class Artifact:
    """A committed artifact, opened read-only."""

    def __init__(self, store: "Store", manifest: Manifest) -> None:
        self.store = store
        self.manifest = manifest
        self.key = manifest.key
        self.stage = manifest.stage

    def _local_path(self, relpath: str):
        """The file's path when the store is a local directory (fast reads), else None."""
        return self.store.backend.local_file_path(self.key, relpath)

    def _local_dir(self) -> str | None:
        """The artifact's directory as a string (path objects cost more than reading a small
        sample's chunks), or None when the store is not local."""
        d = self.__dict__.get("_dir", False)
        if d is False:
            path = self.store.backend.local_file_path(self.key, "")
            d = self._dir = None if path is None else os.fspath(path).rstrip("/") + "/"
        return d

    def _open_local(self, relpath: str) -> int | None:
        """A read-only descriptor of a file of this local artifact (the fast read path), None if
        the store is not local or the file is missing (the caller's slow path says so)."""
        d = self._local_dir()
        if d is None:
            return None
        try:
            # O_NONBLOCK: a FIFO in a chunk's place opens at once (and is refused by the reader's
            # fstat); on regular files it changes nothing.
            return os.open(d + relpath, OPEN_FLAGS)
        except (FileNotFoundError, NotADirectoryError):
            return None

    def _read(self, relpath: str) -> bytes:
        """A file of this artifact; IntegrityError (no fix) if it is not a regular file, never
        blocking on one (a FIFO); FileNotFoundError if it is missing."""
        backend = self.store.backend
        path = backend.local_file_path(self.key, relpath)
        if path is not None:
            try:
                return read_regular(path)
            except NotRegularFile as e:
                raise IntegrityError(f"{relpath} of artifact {self.key} is refused: {e.problem}.",
                                     key=self.key) from None
        return backend.read_file(self.key, relpath)

    @property
    def array_names(self) -> list[str]:
        return sorted(self.manifest.arrays)

    def array(self, name: str) -> ArrayReader:
        spec = self.manifest.arrays.get(name)
        if spec is None:
            raise ArtifactNotFoundError(f"artifact {self.key} has no array {name!r} "
                                        f"(it has {', '.join(self.array_names) or 'none'}).")
        return ArrayReader(self, name, spec)

    def json(self, name: str) -> Any:
        spec = self.manifest.blobs.get(name)
        if spec is None:
            raise ArtifactNotFoundError(f"artifact {self.key} has no document {name!r}.")
        rel = fmt.blob_relpath(name)
        try:
            data = self._read(rel)
        except FileNotFoundError:
            raise IntegrityError(f"document {name} of artifact {self.key} is missing.", key=self.key,
                                 fix=repair_hint(self.key)) from None
        except IntegrityError as e:
            raise e.with_fix(repair_hint(self.key)) from None
        try:
            fmt.check_file(self.manifest, rel, fmt.FileRole("blob", name), data)
        except IntegrityError as e:
            raise e.with_fix(repair_hint(self.key)) from None
        return json.loads(data)

    def _file_problems(self, files: dict[str, fmt.FileRole]) -> list[str]:
        """Each file checked with the format's one check (the one pulls use); an array whose
        zarr.json is bad is not judged further (its chunks cannot be, against a manifest that
        disagrees with it)."""
        problems = []
        bad_arrays: set[str] = set()
        for rel, role in files.items():
            if role.kind == "chunk" and role.name in bad_arrays:
                continue
            try:
                fmt.check_file(self.manifest, rel, role, self._read(rel))
            except FileNotFoundError:
                problems.append(fmt.missing_problem(self.manifest, rel, role))
            except IntegrityError as e:
                problems.append(e.problem)
            else:
                continue
            if role.kind == "array_meta":
                bad_arrays.add(role.name)
        return problems

    def problems(self) -> list[str]:
        """Everything wrong with this artifact's bytes (empty if it verifies)."""
        return ([f"manifest of {self.key}: {p}" for p in fmt.manifest_problems(self.manifest)]
                + self._file_problems(fmt.expected_files(self.manifest)))


class Store:
    """A dfcache store: committed artifacts addressed by key, over one backend."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.url = backend.url
        self._meta_checked: set[tuple[str, str]] = set()  # (key, array) whose zarr.json agrees
        # read_raw(mapped=True) chunks: (key, array, chunk) -> (rows, path, signature when checked)
        self._mapped: dict[tuple[str, str, int], tuple] = {}
        # (key, array, chunk) -> the file's (inode, size, mtime, ctime) when its check passed
        self._verified: dict[tuple[str, str, int], tuple] = {}

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    def has(self, key: str) -> bool:
        try:
            return self.backend.read_manifest(key) is not None
        except UntrustedManifestError:
            return True  # there, but damaged: manifest() says so, with the fix

    def manifest(self, key: str) -> Manifest:
        try:
            raw = self.backend.read_manifest(key)
        except UntrustedManifestError as e:
            raise e.with_fix(repair_hint(key)) from None
        if raw is None:
            raise ArtifactNotFoundError(f"no artifact {key} in {self.url}; run `dfcache ls` to see what "
                                        "is there.")
        try:
            return Manifest.from_json(raw, expect_key=key)
        except UntrustedManifestError as e:
            raise e.with_fix(repair_hint(key)) from None

    def open(self, key: str) -> Artifact:
        return Artifact(self, self.manifest(key))

    def writer(self, key: str, *, stage: str, stage_version: int, inputs: dict,
               upstream: dict | None = None, provenance: dict | None = None, summary: str = "",
               resumable: bool = False, samples: dict | None = None,
               sample_refs: list | None = None) -> ArtifactWriter:
        return ArtifactWriter(self, key, stage=stage, stage_version=stage_version, inputs=inputs,
                              upstream=upstream, provenance=provenance, summary=summary,
                              resumable=resumable, samples=samples, sample_refs=sample_refs)

    def list_manifests(self, stage: str | None = None, *, errors: list | None = None) -> list[Manifest]:
        """Every committed artifact's manifest (never array data). Invalid manifests, and those
        whose claims (stage, inputs, upstream) do not give their key, are skipped and reported in
        ``errors`` as (key, message): whatever selects artifacts by what they claim (``ls``,
        ``--where``, ``gc`` scopes, ``push``/``pull --stage``) never trusts an edited one."""
        out = []
        for key, raw in self.backend.iter_manifests():
            if isinstance(raw, UnreadableManifest):
                if errors is not None:
                    errors.append((key, f"{raw.problem} {repair_hint(key)}"))
                continue
            if stage is not None and f'"stage": "{stage}"' not in raw.decode("utf-8", "replace"):
                continue
            try:
                m = Manifest.from_json(raw, expect_key=key if KEY_PATTERN.match(key) else None)
                claims = key_problem(m)
                if claims:
                    raise UntrustedManifestError(f"manifest of {m.key} refused: {claims}.", key=m.key,
                                                 fix=repair_hint(m.key))
            except UntrustedManifestError as e:
                if errors is not None:
                    errors.append((key, e.message))
                continue
            if stage is None or m.stage == stage:
                out.append(m)
        return out

    def keys(self) -> list[str]:
        return [k for k, _ in self.backend.iter_manifests()]

    def resolve(self, prefix: str) -> str:
        """The full key for a unique prefix (as git does for commits)."""
        prefix = prefix.strip().lower()
        if not prefix or any(c not in "0123456789abcdef" for c in prefix):
            raise ArtifactNotFoundError(f"{prefix!r} is not a key or key prefix (hex digits).")
        if len(prefix) == 32:
            if self.has(prefix):
                return prefix
            raise ArtifactNotFoundError(f"no artifact {prefix} in {self.url}; run `dfcache ls`.")
        matches = [k for k in self.keys() if k.startswith(prefix)]
        if not matches:
            raise ArtifactNotFoundError(f"no artifact key starts with {prefix} in {self.url}; run "
                                        "`dfcache ls` to see the keys.")
        if len(matches) > 1:
            raise AmbiguousKeyError(f"key prefix {prefix} matches {len(matches)} artifacts "
                                    f"({', '.join(m[:12] for m in matches[:5])}); give more digits.")
        return matches[0]

    def delete(self, key: str) -> bool:
        return self.backend.delete(key)

    def verify(self, key: str) -> list[str]:
        """Problems with one artifact: invalid manifest, missing or corrupt files."""
        try:
            art = self.open(key)
        except IntegrityError as e:
            return [e.message]
        problems = art.problems()
        if not problems and art.manifest.samples:
            from ..samples import segment_problems

            problems = segment_problems(self, key)
        return problems

    def local_dir(self, name: str) -> Path | None:
        """A directory on this machine beside the store's artifacts, for files made from them
        (report files, generated example models); None when the store is not a local directory.

        ``name`` is one plain name (``reports``, ``example``); the directory may not exist yet."""
        if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", name) or name in fmt.RESERVED_DIRS:
            raise UsageError(f"{name!r} is not a name for a directory beside the store's artifacts.")
        root = self.backend.local_root
        return None if root is None else Path(root) / name


def open_store(location: str | os.PathLike | None = None, *, create: bool = True,
               endpoint_url: str | None = None, region: str | None = None,
               offline: bool | None = None) -> Store:
    """Open a store by path or URL: a directory, ``file:///path``, ``s3://bucket/prefix``.

    ``None`` means ``$DFCACHE_STORE`` or ``./store``. A local store is created if missing (unless
    ``create=False``). A ``file://`` store is read without following symbolic links; an
    ``s3://`` store is refused while offline. See :mod:`dfcache.store._open`.
    """
    from ._open import open_backend

    return Store(open_backend(location, create=create, endpoint_url=endpoint_url, region=region,
                              offline=offline))
