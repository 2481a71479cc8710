"""Artifacts: writing, committing, reading and verifying them, over any backend.

An artifact is one zarr v3 group. Each array is chunked along its first axis only; chunk ``i``
holds rows ``[i*chunk_rows, (i+1)*chunk_rows)`` and lives in the file ``<array>/c/<i>/0...``
(zarr's default chunk key encoding). Chunks are encoded here, without going through zarr's
per-call codec pipeline (which runs at about a third of disk speed, see
shared/reference/storage-probe.md), with exactly the codecs zarr.json declares: ``bytes``
(little endian), optionally ``zstd``, then ``crc32c``. Any zarr v3 reader opens the result; the
tests check that zarr reads back what we wrote.

Digests: each chunk's digest is xxh3-128 over its logical rows (no padding) in the storage
dtype; an array's digest is xxh3-128 over its chunk digests joined by ``,``. Chunk digests let
a streaming writer resume and let ``verify`` name the bad chunk.
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import os
import socket
import threading
from dataclasses import asdict
from typing import Any

import google_crc32c
import numpy as np
import xxhash

from .. import __version__
from ..errors import (AmbiguousKeyError, ArtifactNotFoundError, IntegrityError, UntrustedManifestError,
                      UsageError)
from ..keys import KEY_PATTERN
from ..manifest import (CODECS, NAME_PATTERN, STORAGE_DTYPE, ArraySpec, BlobSpec, Manifest,
                        validate_manifest)
from ._backend import Backend, Staging

TARGET_CHUNK_BYTES = 1 << 20  # 128 tokens at 4096 x bf16: little over-read at sample edges
ZSTD_LEVEL = 1
PROGRESS = "progress.json"
MAPPED_CHUNKS = 512  # mapped chunks kept per store: address space only, the page cache holds the data


def _logical_dtype_of(arr: np.ndarray) -> str:
    if arr.dtype.name == "bfloat16":
        return "bfloat16"
    name = arr.dtype.name
    if name not in STORAGE_DTYPE:
        raise UsageError(f"dtype {name} cannot be stored; use one of {', '.join(STORAGE_DTYPE)}.")
    return name


def _np_logical_dtype(dtype: str) -> np.dtype:
    if dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def default_chunk_rows(shape: tuple[int, ...], dtype: str) -> int:
    row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(STORAGE_DTYPE[dtype]).itemsize
    rows = max(1, TARGET_CHUNK_BYTES // max(1, row_bytes))
    rows = 1 << (rows.bit_length() - 1)  # a power of two keeps block reads aligned
    return int(min(max(rows, 16), 1 << 20))


def chunk_relpath(name: str, index: int, ndim: int) -> str:
    return f"{name}/c/{index}" + "/0" * (ndim - 1)


@functools.lru_cache(maxsize=256)
def _array_zarr_json(shape: tuple, storage_dtype: str, chunk_rows: int, codec: str, dtype: str) -> bytes:
    """zarr.json of an array, produced by zarr itself so the metadata is always what zarr reads."""
    import zarr
    from zarr.codecs import Crc32cCodec, ZstdCodec
    from zarr.storage import MemoryStore

    compressors: list = [ZstdCodec(level=ZSTD_LEVEL)] if codec == "zstd" else []
    compressors.append(Crc32cCodec())
    store = MemoryStore()
    zarr.create_array(store=store, name="a", shape=shape, dtype=storage_dtype,
                      chunks=(chunk_rows,) + tuple(shape[1:]) if shape else (1,),
                      compressors=compressors, filters=None, fill_value=0,
                      attributes={"dfcache_dtype": dtype})
    buf = store._store_dict["a/zarr.json"]
    return buf.to_bytes()


def _group_zarr_json(key: str, stage: str) -> bytes:
    return json.dumps({"zarr_format": 3, "node_type": "group",
                       "attributes": {"dfcache": {"key": key, "stage": stage}}}, indent=1).encode()


def _chunk_digest(rows: np.ndarray) -> str:
    return xxhash.xxh3_128_hexdigest(np.ascontiguousarray(rows).view(np.uint8).reshape(-1))


def _array_digest(chunk_digests: list[str]) -> str:
    return xxhash.xxh3_128_hexdigest(",".join(chunk_digests).encode())


def _encode_chunk(full: np.ndarray, codec: str) -> list:
    raw = np.ascontiguousarray(full).view(np.uint8).reshape(-1)
    if codec == "zstd":
        import numcodecs

        raw = np.frombuffer(numcodecs.Zstd(level=ZSTD_LEVEL).encode(raw), dtype=np.uint8)
    crc = google_crc32c.extend(0, raw).to_bytes(4, "little")
    return [raw, crc]


def _decode_chunk(data: bytes, codec: str, shape: tuple, storage_dtype: str, where: str,
                  key: str | None) -> np.ndarray:
    if len(data) < 4:
        raise IntegrityError(f"{where} is truncated ({len(data)} bytes).", key=key)
    body = np.frombuffer(data, dtype=np.uint8)[:-4]
    if google_crc32c.extend(0, body) != int.from_bytes(data[-4:], "little"):
        raise IntegrityError(f"{where} fails its crc32c checksum (corrupt or truncated).", key=key)
    if codec == "zstd":
        import numcodecs

        try:
            body = np.frombuffer(numcodecs.Zstd().decode(body), dtype=np.uint8)
        except Exception:
            raise IntegrityError(f"{where} does not decompress.", key=key) from None
    dt = np.dtype(storage_dtype).newbyteorder("<")
    expect = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    if body.nbytes != expect:
        raise IntegrityError(f"{where} holds {body.nbytes} bytes, expected {expect}.", key=key)
    return np.frombuffer(body, dtype=dt).reshape(shape)


def repair_hint(key: str) -> str:
    """How to get past a corrupt or incomplete artifact: the end of every such message."""
    return (f"Delete it with `dfcache gc --key {key[:12]} --yes` and run again to recompute it, or pull "
            "it again.")


def array_meta_problem(meta: Any, spec: ArraySpec) -> str | None:
    """What is wrong with an array's zarr.json given its manifest entry (None if they agree).

    A manifest edited by hand (a shape, a dtype) passes its own validation and the chunk
    checksums; only this disagreement gives it away."""
    if not isinstance(meta, dict) or meta.get("zarr_format") != 3 or meta.get("node_type") != "array":
        return "zarr.json is not zarr v3 array metadata"
    grid = ((meta.get("chunk_grid") or {}).get("configuration") or {}).get("chunk_shape")
    if (meta.get("shape") != spec.shape or meta.get("data_type") != spec.storage_dtype
            or not isinstance(grid, list) or not grid or grid[0] != spec.chunk_rows):
        return (f"zarr.json says shape {meta.get('shape')} {meta.get('data_type')} in chunks of "
                f"{grid[0] if isinstance(grid, list) and grid else '?'} rows, the manifest {spec.shape} "
                f"{spec.storage_dtype} in chunks of {spec.chunk_rows}")
    attrs = meta.get("attributes")
    if isinstance(attrs, dict) and "dfcache_dtype" in attrs and attrs["dfcache_dtype"] != spec.dtype:
        return f"zarr.json says dtype {attrs['dfcache_dtype']}, the manifest {spec.dtype}"
    return None


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
        self._tail = np.empty((0,) + self.row_shape, dtype=self.storage_dtype)
        self.closed = False

    @property
    def rows_written(self) -> int:
        return len(self.chunk_digests) * self.chunk_rows + len(self._tail)

    def _as_storage(self, data: np.ndarray) -> np.ndarray:
        data = np.asarray(data)
        got = _logical_dtype_of(data) if data.dtype.name != "uint16" else "uint16"
        if self.dtype == "bfloat16" and got in ("bfloat16", "uint16"):
            data = data.view(np.uint16)
        elif got != self.dtype:
            raise UsageError(f"array {self.name} is {self.dtype}; got {got} rows.")
        if data.shape[1:] != self.row_shape:
            raise UsageError(f"array {self.name} rows have shape {self.row_shape}; got {data.shape[1:]}.")
        return data

    def append(self, data: np.ndarray) -> None:
        """Append rows (first axis). bf16 may be given as ml_dtypes.bfloat16 or its uint16 bits."""
        if self.closed:
            raise UsageError(f"array {self.name} is already finished.")
        data = self._as_storage(data)
        if self.total_rows is not None and self.rows_written + len(data) > self.total_rows:
            raise UsageError(f"array {self.name} has {self.total_rows} rows; appending "
                             f"{len(data)} to {self.rows_written} overflows it.")
        if len(self._tail):
            need = self.chunk_rows - len(self._tail)
            self._tail = np.concatenate([self._tail, data[:need]])
            data = data[need:]
            if len(self._tail) == self.chunk_rows:
                self._write_chunk(self._tail)
                self._tail = self._tail[:0]
        while len(data) >= self.chunk_rows:
            self._write_chunk(data[: self.chunk_rows])
            data = data[self.chunk_rows:]
        if len(data):
            self._tail = np.array(data, copy=True)

    def _write_chunk(self, rows: np.ndarray) -> None:
        index = len(self.chunk_digests)
        digest = _chunk_digest(rows)
        if len(rows) < self.chunk_rows:
            full = np.zeros((self.chunk_rows,) + self.row_shape, dtype=self.storage_dtype)
            full[: len(rows)] = rows
        else:
            full = rows
        if full.dtype.byteorder == ">":
            full = full.astype(full.dtype.newbyteorder("<"))
        self.owner._put(chunk_relpath(self.name, index, 1 + len(self.row_shape)), _encode_chunk(full, self.codec))
        self.chunk_digests.append(digest)

    def finish(self) -> ArraySpec:
        if not self.closed:
            if self.total_rows is not None and self.rows_written != self.total_rows:
                raise UsageError(f"array {self.name} has {self.rows_written} of {self.total_rows} rows; "
                                 "write them all before committing.")
            self.total_rows = self.rows_written
            if len(self._tail):
                self._write_chunk(self._tail)
                self._tail = self._tail[:0]
            self.closed = True
        shape = [self.total_rows] + list(self.row_shape)
        self.owner._put(f"{self.name}/zarr.json",
                        _array_zarr_json(tuple(shape), self.storage_dtype.name, self.chunk_rows,
                                         self.codec, self.dtype))
        nbytes = int(np.prod(shape, dtype=np.int64)) * self.storage_dtype.itemsize
        return ArraySpec(shape=shape, dtype=self.dtype, chunk_rows=self.chunk_rows,
                         digest=_array_digest(self.chunk_digests), nbytes=nbytes, codec=self.codec,
                         chunk_digests=list(self.chunk_digests))

    def state(self) -> dict:
        return {"row_shape": list(self.row_shape), "total_rows": self.total_rows, "dtype": self.dtype,
                "chunk_rows": self.chunk_rows, "codec": self.codec,
                "chunk_digests": list(self.chunk_digests), "tail_rows": len(self._tail),
                # The tail file and progress.json are replaced one after the other; a crash between
                # the two leaves a newer tail beside older progress, possibly of the same length.
                # Its digest tells them apart (a mismatched tail is dropped, never appended to).
                "tail_digest": _chunk_digest(self._tail) if len(self._tail) else None}


class ArtifactWriter:
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
        return all(self._staging.size(rel) == n for rel, n in files.items() if not rel.startswith("tails/"))

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
        if not NAME_PATTERN.match(name) or ".." in name or name in ("blobs", "c"):
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
                raw = self._staging.get(f"tails/{name}.bin")
                if raw is not None:
                    tail = np.frombuffer(raw, dtype=aw.storage_dtype).reshape((-1,) + aw.row_shape)
                    if len(tail) == prev["tail_rows"] and prev.get("tail_digest") == _chunk_digest(tail):
                        aw._tail = tail.copy()
        self._arrays[name] = aw
        return aw

    def write_array(self, name: str, data: np.ndarray, *, dtype: str | None = None,
                    chunk_rows: int | None = None, codec: str = "none") -> None:
        """Write a whole array in one call."""
        data = np.asarray(data)
        if data.ndim == 0:
            data = data.reshape(1)
        aw = self.create_array(name, data.shape, dtype or _logical_dtype_of(data), chunk_rows=chunk_rows,
                               codec=codec)
        if aw.rows_written == 0:
            aw.append(data)

    def put_json(self, name: str, obj: Any) -> None:
        """Store a small JSON document with the artifact (read back with ``Artifact.json``)."""
        if not NAME_PATTERN.match(name) or ".." in name:
            raise UsageError(f"blob name {name!r} is not allowed; use letters, digits, _ . -.")
        data = json.dumps(obj, sort_keys=True, ensure_ascii=False, allow_nan=False).encode()
        self._put(f"blobs/{name}.json", data)
        self._blobs[name] = BlobSpec(digest=xxhash.xxh3_128_hexdigest(data), nbytes=len(data))

    def checkpoint(self, state: dict | None = None) -> None:
        """Persist progress so a later writer of the same key resumes from here (resumable only)."""
        if not self.resumable:
            raise UsageError("checkpoint() needs store.writer(..., resumable=True).")
        if state is not None:
            self.state = state
        for name, aw in self._arrays.items():
            if len(aw._tail):
                self._put(f"tails/{name}.bin", memoryview(np.ascontiguousarray(aw._tail).view(np.uint8).reshape(-1)))
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
        self._put("zarr.json", _group_zarr_json(self.key, self.stage))
        files = {k: v for k, v in self._files.items() if not k.startswith("tails/")}
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

    def abort(self) -> None:
        self._staging.abort()

    def discard(self) -> None:
        """Abort and drop resumable progress too."""
        self._staging.discard()

    def __enter__(self) -> "ArtifactWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            try:
                self.commit()
            except BaseException:
                self.abort()
                raise
        else:
            if self.resumable and exc_type is not None and issubclass(exc_type, Exception):
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

    def __len__(self) -> int:
        return self.shape[0]

    def _check_meta(self) -> None:
        """Once per store and array: the array's zarr.json agrees with the manifest."""
        key = self.artifact.key
        checked = self.artifact.store._meta_checked
        if (key, self.name) in checked:
            return
        try:
            meta = json.loads(self.artifact._read(f"{self.name}/zarr.json"))
        except FileNotFoundError:
            problem = "zarr.json is missing"
        except ValueError:
            problem = "zarr.json is not valid JSON"
        else:
            problem = array_meta_problem(meta, self.spec)
        if problem:
            raise IntegrityError(f"array {self.name} of artifact {key} is corrupt: {problem}. "
                                 f"{repair_hint(key)}", key=key)
        checked.add((key, self.name))

    def _chunk(self, index: int) -> np.ndarray:
        self._check_meta()
        key = self.artifact.key
        rel = chunk_relpath(self.name, index, self._ndim)
        where = f"chunk {index} of array {self.name} in artifact {key}"
        try:
            data = self.artifact._read(rel)
        except FileNotFoundError:
            raise IntegrityError(f"{where} is missing; the artifact is incomplete. {repair_hint(key)}",
                                 key=key) from None
        try:
            return _decode_chunk(data, self.spec.codec, (self.chunk_rows,) + self.shape[1:],
                                 self._storage.name, where, key)
        except IntegrityError as e:
            raise IntegrityError(f"{e.message} {repair_hint(key)}", key=key) from None

    def read_raw(self, start: int = 0, stop: int | None = None, *, out: np.ndarray | None = None,
                 mapped: bool = False) -> np.ndarray:
        """Rows [start, stop) in the storage dtype (bf16 comes back as its uint16 bits).

        ``out``: an array of at least that many rows (storage dtype, row shape) to read into,
        e.g. a buffer reused across reads or the columns of a wider one (``big[:, 0:1024]``);
        the rows read are returned as a view of it.

        ``mapped=True`` (local, uncompressed chunks): chunk files are memory-mapped and their
        crc32c checked the first time this store maps them, not on every read; rows are then
        copied straight from the page cache into ``out``. For many small random reads over the
        same chunks (training); a chunk corrupted after its first check in this process is not
        noticed until the store is reopened (``verify`` still checks everything)."""
        n = self.shape[0]
        stop = n if stop is None else min(stop, n)
        start = max(0, start)
        rows = max(0, stop - start)
        if out is None:
            out = np.empty((rows,) + self.shape[1:], dtype=self._storage)
        else:
            if out.dtype != self._storage or out.shape[1:] != self.shape[1:] or len(out) < rows:
                raise UsageError(f"out= must be a {self._storage} array of at least {rows} rows of shape "
                                 f"{self.shape[1:]}.")
            out = out[:rows]
        if stop <= start:
            return out
        contiguous = out.flags.c_contiguous
        c0, c1 = start // self.chunk_rows, (stop - 1) // self.chunk_rows
        for i in range(c0, c1 + 1):
            lo, hi = i * self.chunk_rows, (i + 1) * self.chunk_rows
            a, b = max(lo, start), min(hi, stop)
            chunk = self._mapped_chunk(i) if mapped else None
            if chunk is None:
                if (contiguous and a == lo and b == hi
                        and self._read_chunk_into(i, out[a - start:b - start])):
                    continue
                chunk = self._chunk(i)
            out[a - start:b - start] = chunk[a - lo:b - lo]
        return out

    def _mapped_chunk(self, index: int) -> np.ndarray | None:
        """An uncompressed local chunk's rows over a read-only mmap, crc32c checked when first
        mapped by this store (then kept, a bounded number per store). None: use _chunk()."""
        if self.spec.codec != "none":
            return None
        store = self.artifact.store
        ck = (self.artifact.key, self.name, index)
        hit = store._mapped.get(ck)
        if hit is not None:
            return hit
        self._check_meta()
        path = self.artifact._local_path(chunk_relpath(self.name, index, self._ndim))
        if path is None:
            return None
        import mmap

        body = self.chunk_rows * int(np.prod(self.shape[1:], dtype=np.int64)) * self._storage.itemsize
        try:
            with open(path, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):
            return None  # _chunk() reports what is wrong
        if hasattr(mm, "madvise"):  # one large read-ahead for the crc pass, not a fault per few pages
            mm.madvise(mmap.MADV_WILLNEED)
        raw = np.frombuffer(mm, dtype=np.uint8)
        if len(raw) != body + 4 or google_crc32c.extend(0, raw[:body]) != int.from_bytes(raw[body:].tobytes(), "little"):
            del raw
            mm.close()
            return None  # _chunk() re-reads it and says exactly what is wrong
        arr = raw[:body].view(self._storage.newbyteorder("<")).reshape((self.chunk_rows,) + self.shape[1:])
        if len(store._mapped) >= MAPPED_CHUNKS:
            store._mapped.pop(next(iter(store._mapped)))  # the mapping closes with its last view
        store._mapped[ck] = arr
        return arr

    def _read_chunk_into(self, index: int, rows: np.ndarray) -> bool:
        """Fast path: an uncompressed local chunk the read covers whole goes straight into the
        result (no intermediate buffer, no copy), crc32c still checked. False: use _chunk()."""
        if self.spec.codec != "none":
            return False
        self._check_meta()
        path = self.artifact._local_path(chunk_relpath(self.name, index, self._ndim))
        if path is None:
            return False
        view = rows.reshape(-1).view(np.uint8)
        try:
            with open(path, "rb", buffering=0) as f:
                got = f.readinto(view)
                crc = f.read(5)
        except FileNotFoundError:
            return False  # _chunk() reports it
        if got != view.nbytes or len(crc) != 4 or google_crc32c.extend(0, view) != int.from_bytes(crc, "little"):
            return False  # _chunk() re-reads it and says exactly what is wrong
        return True

    def read(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows [start, stop) in the logical dtype (bf16 as ml_dtypes.bfloat16)."""
        raw = self.read_raw(start, stop)
        if self.dtype == "bfloat16":
            return raw.view(_np_logical_dtype("bfloat16"))
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
        """Re-hash every chunk; return what does not match the manifest."""
        problems = []
        digests = []
        n = self.shape[0]
        for i in range(self.spec.num_chunks):
            try:
                chunk = self._chunk(i)
            except IntegrityError as e:
                problems.append(e.message.removesuffix(" " + repair_hint(self.artifact.key)))
                digests.append("")
                continue
            rows = min(self.chunk_rows, n - i * self.chunk_rows)
            d = _chunk_digest(chunk[:rows])
            digests.append(d)
            if i < len(self.spec.chunk_digests) and d != self.spec.chunk_digests[i]:
                problems.append(f"chunk {i} of array {self.name} does not match its digest")
        if not problems and _array_digest(digests) != self.spec.digest:
            problems.append(f"array {self.name} does not match its digest")
        return problems


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

    def _read(self, relpath: str) -> bytes:
        backend = self.store.backend
        path = backend.local_file_path(self.key, relpath)
        if path is not None:
            with open(path, "rb") as f:
                return f.read()
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
        try:
            data = self._read(f"blobs/{name}.json")
        except FileNotFoundError:
            raise IntegrityError(f"document {name} of artifact {self.key} is missing. {repair_hint(self.key)}",
                                 key=self.key) from None
        if xxhash.xxh3_128_hexdigest(data) != spec.digest:
            raise IntegrityError(f"document {name} of artifact {self.key} does not match its digest. "
                                 f"{repair_hint(self.key)}", key=self.key)
        return json.loads(data)

    def problems(self) -> list[str]:
        """Everything wrong with this artifact's bytes (empty if it verifies)."""
        problems = []
        try:
            self._read("zarr.json")
        except FileNotFoundError:
            problems.append("zarr.json of the group is missing")
        for name in self.array_names:
            try:
                meta = json.loads(self._read(f"{name}/zarr.json"))
                problem = array_meta_problem(meta, self.manifest.arrays[name])
                if problem:
                    problems.append(f"array {name}: {problem}")
                    continue  # its chunks cannot be judged against a manifest that disagrees
            except FileNotFoundError:
                problems.append(f"array {name}: zarr.json is missing")
            except ValueError:
                problems.append(f"array {name}: zarr.json is not valid JSON")
            # The metadata is judged (above); the chunks are judged against the manifest alone.
            self.store._meta_checked.add((self.key, name))
            try:
                problems.extend(self.array(name).digest_problems())
            finally:
                if problems:  # a read must not take a damaged array's metadata as checked
                    self.store._meta_checked.discard((self.key, name))
        for name in sorted(self.manifest.blobs):
            try:
                self.json(name)
            except IntegrityError as e:
                problems.append(e.message.removesuffix(" " + repair_hint(self.key)))
        return problems


class Store:
    """A dfcache store: committed artifacts addressed by key, over one backend."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.url = backend.url
        self._meta_checked: set[tuple[str, str]] = set()  # (key, array) whose zarr.json agrees
        self._mapped: dict[tuple[str, str, int], np.ndarray] = {}  # read_raw(mapped=True) chunks

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    def has(self, key: str) -> bool:
        return self.backend.read_manifest(key) is not None

    def manifest(self, key: str) -> Manifest:
        raw = self.backend.read_manifest(key)
        if raw is None:
            raise ArtifactNotFoundError(f"no artifact {key} in {self.url}; run `dfcache ls` to see what "
                                        "is there.")
        try:
            return Manifest.from_json(raw, expect_key=key)
        except UntrustedManifestError as e:
            detail = getattr(e, "detail", None) or e.message
            raise UntrustedManifestError(f"{detail} {repair_hint(key)}", key=key) from None

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
        """Every committed artifact's manifest (never array data). Invalid manifests are skipped
        and reported in ``errors`` as (key, message)."""
        out = []
        for key, raw in self.backend.iter_manifests():
            if stage is not None and f'"stage": "{stage}"' not in raw.decode("utf-8", "replace"):
                continue
            try:
                m = Manifest.from_json(raw, expect_key=key if KEY_PATTERN.match(key) else None)
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


def open_store(location: str | os.PathLike | None = None, *, create: bool = True,
               endpoint_url: str | None = None) -> Store:
    """Open a store by path or URL (``file:///...``, ``s3://bucket/prefix``).

    ``None`` means ``$DFCACHE_STORE`` or ``./store``. A local store is created if missing.
    """
    from ..config import default_store_location

    loc = os.fspath(location) if location is not None else default_store_location()
    if loc.startswith("file://"):
        loc = loc[len("file://"):]
    if "://" in loc:
        from ._remote import open_remote_backend

        return Store(open_remote_backend(loc, endpoint_url=endpoint_url))
    from ._local import LocalBackend

    return Store(LocalBackend(loc, create=create))
