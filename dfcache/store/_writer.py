"""Writing artifacts: :class:`ArtifactWriter` stages one artifact privately and publishes it
atomically, manifest last; :class:`ArrayWriter` appends one array's rows, a full chunk going to
the staging area as soon as it fills (compressed ones on encoder threads; the uncompressed chunks
of one append written by ``write_threads()`` threads at once, all staged before it returns). What the files are is
:mod:`dfcache.store.format`; resumable writers checkpoint in their staging area
(``layout.PROGRESS``, ``layout.tail_relpath``).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import threading
from collections import deque
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from .. import __version__
from .._lazy import LazyModule
from ..errors import UsageError
from ..keys import KEY_PATTERN
from ..manifest import CODECS, FP8_DTYPE, NAME_PATTERN, STORAGE_DTYPE, ArraySpec, BlobSpec, Manifest, validate_manifest
from . import format as fmt
from ._backend import Staging
from ._pools import thread_pool, write_pool, write_threads
from .format import default_chunk_rows
from .layout import BLOBS, CHUNKS, PROGRESS, TAILS, tail_relpath

if TYPE_CHECKING:
    from ._store import Store

np = LazyModule("numpy")  # imported by the first array written

ENCODE_AHEAD = 8  # compressed chunks in flight per array (up to 8 MiB of copies); beyond, the writer encodes too


def _encode_pool():
    """Threads that compress chunks: numcodecs releases the GIL, so the producer, the hashing
    and the compression of the next chunks run on different cores (and blosc off the main
    thread takes its single-threaded context, which is the faster one for one block)."""
    return thread_pool("encode", max(2, min(8, os.cpu_count() or 2)))


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
        # Uncompressed chunks of one append written at once (the appending thread is one writer).
        self.write_threads = write_threads()
        # The first error of a chunk write: the array's chunks are no longer all staged, so no
        # checkpoint may name them (drain() raises it again) and nothing more is appended.
        self._failed: BaseException | None = None

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
        elif self.dtype == FP8_DTYPE and got == "uint8":
            pass  # packed FP8 rows (dfcache/fp8.py): codes and scale bytes
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
        self._check_failed()
        data = self._as_storage(data)
        if self.total_rows is not None and self.rows_written + len(data) > self.total_rows:
            raise UsageError(f"array {self.name} has {self.total_rows} rows; appending "
                             f"{len(data)} to {self.rows_written} overflows it.")
        full: list = []  # the chunks this append fills: (rows, kept)
        if self._fill:
            need = self.chunk_rows - self._fill
            self._keep(data[:need])
            data = data[need:]
            if self._fill == self.chunk_rows:
                full.append((self._buf, False))  # written before the tail is kept in it again
                self._fill = 0
        while len(data) >= self.chunk_rows:
            full.append((data[: self.chunk_rows], kept))
            data = data[self.chunk_rows:]
        try:
            if self.codec == "none" and self.write_threads > 1 and len(full) > 1:
                self._write_chunks([rows for rows, _ in full])
            else:
                for rows, k in full:
                    self._write_chunk(rows, kept=k)
        except BaseException as e:
            if self._failed is None:
                self._failed = e
            raise
        if len(data):
            self._keep(data)

    def _write_chunks(self, chunks: list) -> None:
        """Uncompressed full chunks written ``write_threads`` at a time (chunk files are
        independent; the appending thread writes its share too), every one staged when this
        returns, as one after the other would be: the caller may then reuse its rows."""
        index = len(self.chunk_digests)
        self.chunk_digests.extend([None] * len(chunks))
        jobs = [(fmt.chunk_relpath(self.name, index + i, 1 + len(self.row_shape)), index + i, rows)
                for i, rows in enumerate(chunks)]
        n = min(self.write_threads, len(jobs))
        # Interleaved shares: the files appear in about their order, whichever thread is slow.
        self._inflight.extend(write_pool(self.write_threads).submit(self._put_plain, jobs[i::n]) for i in range(1, n))
        try:
            self._put_plain(jobs[0::n])
        except BaseException as e:
            if self._failed is None:
                self._failed = e
            self.drain(raise_errors=False)  # no thread still writes from the caller's rows
            raise
        self.drain()  # every share staged (or its first error raised) before the rows are let go

    def _put_plain(self, jobs: list) -> None:
        for rel, index, rows in jobs:
            if rows.dtype.byteorder == ">":
                rows = rows.astype(rows.dtype.newbyteorder("<"))
            self.chunk_digests[index] = fmt.chunk_digest(rows)
            self.owner._put(rel, fmt.encode_chunk(rows, "none"))

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
            self.chunk_digests.append(None)  # filled once the file is staged: a failed put leaves no digest
            self.owner._put(rel, fmt.encode_chunk(full, self.codec))
            self.chunk_digests[index] = fmt.chunk_digest(full[:len(rows)])
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
        """Wait until every chunk handed to other threads is staged; then raise the first error
        of a chunk write, if any (this one's or an earlier one's)."""
        while self._inflight:
            exc = self._inflight[0].exception()  # waits for it
            self._inflight.popleft()
            if exc is not None and self._failed is None:
                self._failed = exc
        if raise_errors:
            self._check_failed()

    def _check_failed(self) -> None:
        """Raise the error that broke a chunk write of this array, if one did (an interrupt
        becomes a UsageError: the later call was not interrupted)."""
        if isinstance(self._failed, Exception):
            raise self._failed
        if self._failed is not None:
            raise UsageError(f"array {self.name} was interrupted while writing its chunks; "
                             "abort this writer and write the artifact again.")

    def finish(self) -> ArraySpec:
        if not self.closed:
            if self.total_rows is not None and self.rows_written != self.total_rows:
                raise UsageError(f"array {self.name} has {self.rows_written} of {self.total_rows} rows; "
                                 "write them all before committing.")
            self.total_rows = self.rows_written
            if self._fill:
                try:
                    self._write_chunk(self._tail)
                except BaseException as e:
                    if self._failed is None:
                        self._failed = e
                    raise
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
