"""Samples: the unit of reuse. Segments: the unit of commit.

A *partition* is everything a per-sample stage keys except the set of samples (model
fingerprint, sampling parameters, layer, backend class...); its key is an ordinary
:func:`dfcache.compute_key` of (stage, version, inputs, upstream partition keys). A *sample* of a
partition is identified by the key of the sample it was made from (its *upstream* sample; for a
root stage the content digest of its record)::

    sample_key(partition, upstream) = xxh3_128(canonical({"partition": partition, "sample": upstream}))

so any subset, superset, reordering or overlap of a set of samples finds every sample already
made, whatever set it was made in. Deriving a key costs one hash (not a canonical encoding of the
whole partition), so planning 100,000 samples stays well under a second.

Samples are committed in *segments*: one ordinary artifact (zarr group, manifest written last,
atomic publish, content digests) holding many samples of one partition, never one file or
manifest per sample. In a segment:

* samples are ordered by ascending upstream key, so a set of samples has one layout and one key:
  ``segment_key(partition, keys) = xxh3_128(canonical({"partition": p, "segment": xxh3_128(",".join(sorted(keys)))}))``;
  two writers of the same samples publish one copy (the store's atomic publish);
* each per-sample array is the samples' rows concatenated along axis 0 (hidden states: tokens),
  chunked along it, so reading one sample opens only the chunks its rows touch;
* per-sample JSON documents are the uint8 array ``doc`` (UTF-8 JSON, concatenated);
* the manifest's ``samples`` field holds the partition, its upstream partitions and the ordered
  sample keys (planning reads manifests only);
* the document ``samples`` holds, per sample, its upstream key, its row offsets in every array
  and its digest (xxh3-128 over ``name=<xxh3 of its rows>`` joined by ``,``, arrays by name), so
  one sample can be verified, and copied alone, without the rest of its segment.

A sample held by several segments (two writers that overlapped) is read from the segment with
the smallest key: reads of a set assembled from any segments are deterministic; ``gc`` removes
segments none of whose samples are read from them.

Roles of a partition's upstream: ``"sample"`` names the partition the upstream samples belong
to; any other role names partitions whose sample *with the same upstream key* this sample also
needs (an eval sample needs the hidden states of its tokens sample, layer by layer).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Mapping
from itertools import chain, repeat
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable

import xxhash

from ._lazy import LazyModule
from .errors import ArtifactNotFoundError, IntegrityError, SamplesMissingError, UsageError
from .keys import record_digest, sample_key, sample_keys, segment_key  # noqa: F401  (public here too)
from .keys import compute_key
from .manifest import STORAGE_DTYPE, Manifest, key_problem
from .store import CommitOnExit

np = LazyModule("numpy")  # imported by the first array read, write or large key search: a plan of a few cached samples needs none

__all__ = ["DOC", "Partition", "PartitionSamples", "SampleArray", "SampleSet", "SampleSink", "SamplesMissingError",
           "SegmentWriter", "index_of", "keys_as_bytes", "keys_from_bytes", "partition_key", "record_digest",
           "sample_key", "segment_key"]

DOC = "doc"  # the array of per-sample JSON documents
INDEX = "samples"  # the document with per-sample upstream keys, row offsets and digests
DOC_CHUNK_ROWS = 1 << 16  # 64 KiB of JSON a chunk: one completion's text reads one or two chunks
MAX_SAMPLE_CHUNK_ROWS = 1 << 14  # token ids: 64 KiB chunks, a few samples each


# ------------------------------------------------------------------------------------- keys


def partition_key(stage: str, version: int, inputs: dict, upstream: dict | None = None) -> str:
    return compute_key(stage, version, inputs, upstream or {})


@dataclass(eq=False)
class Partition:
    """One per-sample stage's inputs without the samples; ``key`` is derived from the rest."""

    stage: str
    version: int
    inputs: dict
    upstream: dict = field(default_factory=dict)  # role -> partition key (or list of them)
    key: str = field(init=False)

    def __post_init__(self) -> None:
        self.key = partition_key(self.stage, self.version, self.inputs, self.upstream)

    def sample_key(self, upstream: str) -> str:
        return sample_key(self.key, upstream)

    def sample_keys(self, upstream: Iterable[str]) -> list[str]:
        return sample_keys(self.key, upstream)

    @classmethod
    def of_segment(cls, m: Manifest) -> "Partition":
        """The partition a segment manifest claims, checked: its key must derive from the
        manifest's stage, version, inputs and upstream partitions (else it is not trusted)."""
        s = m.samples or {}
        try:
            p = cls(m.stage, m.stage_version, m.inputs, dict(s.get("partition_upstream") or {}))
        except UsageError:
            p = None
        if p is None or p.key != s.get("partition"):
            raise IntegrityError(f"segment {m.key} claims partition {s.get('partition')} but its inputs give "
                                 f"{p.key if p else 'no key'}; the manifest was altered. Delete it "
                                 f"(`dfcache gc --key {m.key[:12]} --force --yes`) or pull it again.", key=m.key)
        return p


# ------------------------------------------------------------------------------------ writing


@dataclass
class SampleArray:
    """One per-sample array of a partition: the shape of a row and how rows are stored."""

    row_shape: tuple = ()
    dtype: str = "float32"
    codec: str = "none"
    chunk_rows: int | None = None


def _chunk_rows_for(spec: SampleArray) -> int:
    if spec.chunk_rows:
        return int(spec.chunk_rows)
    from .store import default_chunk_rows

    # ~1 MiB chunks for wide rows (hidden states: 128 tokens at 4096 x bf16), at most
    # MAX_SAMPLE_CHUNK_ROWS rows for narrow ones so one sample's read stays small.
    return min(default_chunk_rows((0,) + tuple(spec.row_shape), spec.dtype), MAX_SAMPLE_CHUNK_ROWS)


def _doc_bytes(doc: Any) -> np.ndarray:
    data = json.dumps(doc, sort_keys=True, ensure_ascii=False, allow_nan=False).encode()
    return np.frombuffer(data, dtype=np.uint8)


def _digest_rows(storage: np.ndarray) -> str:
    return xxhash.xxh3_128_hexdigest(np.ascontiguousarray(storage).view(np.uint8).reshape(-1))


def sample_digest(array_digests: dict[str, str]) -> str:
    return xxhash.xxh3_128_hexdigest(",".join(f"{n}={array_digests[n]}" for n in sorted(array_digests)).encode())


def _storage(rows: np.ndarray, dtype: str) -> np.ndarray:
    rows = np.asarray(rows)
    if dtype == "bfloat16" and rows.dtype.name in ("bfloat16", "uint16"):
        rows = rows.view(np.uint16)
    if rows.dtype != np.dtype(STORAGE_DTYPE[dtype]):
        raise UsageError(f"rows of dtype {rows.dtype} given for a {dtype} array.")
    if rows.dtype.byteorder == ">":
        rows = rows.astype(rows.dtype.newbyteorder("<"))
    return rows


class SegmentWriter(CommitOnExit):
    """Writes one segment; samples are added in ascending order of their upstream keys.

    ``arrays`` declares the per-sample arrays; ``doc=True`` adds the JSON document array. Use as
    a context manager (commit on success, nothing published on error) or call :meth:`commit`.
    Rows are streamed to the store's staging as chunks fill; only the commit publishes.
    """

    def __init__(self, store, partition: Partition, upstream: list[str], *, arrays: dict[str, SampleArray] | None = None,
                 doc: bool = True, summary: str = "", provenance: dict | None = None,
                 rows: dict[str, int] | None = None) -> None:
        upstream = list(upstream)
        if not upstream:
            raise UsageError("a segment holds at least one sample.")
        if any(a >= b for a, b in zip(upstream, upstream[1:])):
            raise UsageError("a segment's samples must be given once each, in ascending order of upstream key.")
        self.store = store
        self.partition = partition
        self.upstream = upstream
        self.keys = partition.sample_keys(upstream)
        self.key = segment_key(partition.key, self.keys)
        self.specs = dict(sorted((arrays or {}).items()))
        if DOC in self.specs:
            raise UsageError(f"array name {DOC!r} is reserved for per-sample documents.")
        if doc:
            self.specs[DOC] = SampleArray((), "uint8", "none", DOC_CHUNK_ROWS)
        self._n = 0
        self._offsets = {name: [0] for name in self.specs}
        self._digests: list[str] = []
        self.manifest: Manifest | None = None
        self.won = False
        self._w = store.writer(self.key, stage=partition.stage, stage_version=partition.version,
                               inputs=partition.inputs, upstream={}, provenance=provenance,
                               summary=f"{len(upstream)} samples" + (f": {summary}" if summary else ""),
                               samples={"partition": partition.key, "partition_upstream": partition.upstream,
                                        "keys": self.keys})
        # ``rows``: each array's total rows when the writer knows them; a small segment's array is
        # then one chunk of its size, not one padded to a full chunk (zarr's grid is regular).
        rows = rows or {}
        self._aw = {name: self._w.create_array(name, (0,) + tuple(s.row_shape), s.dtype, codec=s.codec,
                                               chunk_rows=_chunk_rows_for(s) if name not in rows
                                               else max(1, min(_chunk_rows_for(s), rows[name])), unknown_rows=True)
                    for name, s in self.specs.items()}

    @property
    def added(self) -> int:
        return self._n

    def add(self, arrays: dict[str, np.ndarray] | None = None, doc: Any = None) -> str:
        """Append the next sample's rows (every declared array) and document; returns its key."""
        if self._n >= len(self.keys):
            raise UsageError(f"segment {self.key[:12]} was declared with {len(self.keys)} samples; one more given.")
        arrays = dict(arrays or {})
        if DOC in self.specs and DOC not in arrays:  # given as bytes when copied from another segment
            arrays[DOC] = _doc_bytes(doc)
        if set(arrays) != set(self.specs):
            raise UsageError(f"sample {self._n} gives arrays {sorted(arrays)}; the partition has {sorted(self.specs)}.")
        digests = {}
        for name, spec in self.specs.items():
            rows = _storage(arrays[name], spec.dtype)
            digests[name] = _digest_rows(rows)
            self._aw[name].append(rows)
            self._offsets[name].append(self._offsets[name][-1] + len(rows))
        self._digests.append(sample_digest(digests))
        self._n += 1
        return self.keys[self._n - 1]

    def commit(self) -> Manifest:
        if self.manifest is not None:
            return self.manifest
        if self._n != len(self.keys):
            raise UsageError(f"segment {self.key[:12]} has {self._n} of its {len(self.keys)} samples; add them all.")
        self._w.put_json(INDEX, {"upstream": self.upstream, "offsets": self._offsets, "digests": self._digests})
        self.manifest = self._w.commit()
        self.won = self._w.won
        index_of(self.store).add(self.manifest)
        return self.manifest

    def abort(self) -> None:
        if self.manifest is None:
            self._w.abort()



class SampleSink:
    """Buffers finished samples and commits them as segments every ``max_samples`` samples,
    ``max_bytes`` bytes or ``max_seconds`` seconds, and at the end.

    What is committed stays committed: an interrupted producer loses only the samples of the
    segment it had not yet committed, and a rerun produces only the samples still missing. Leaving
    the ``with`` block commits what is buffered, also on an exception (every buffered sample is
    complete); a killed process loses the buffer only.
    """

    def __init__(self, store, partition: Partition, *, arrays: dict[str, SampleArray] | None = None, doc: bool = True,
                 max_samples: int = 4096, max_bytes: int = 256 << 20, max_seconds: float = 30.0, summary: str = "",
                 provenance: dict | None = None) -> None:
        self.store = store
        self.partition = partition
        self.arrays = dict(arrays or {})
        self.doc = doc
        self.max_samples = max(1, int(max_samples))
        self.max_bytes = max(1, int(max_bytes))
        self.max_seconds = float(max_seconds)
        self.summary = summary
        self.provenance = provenance
        self._buf: dict[str, tuple[dict, Any]] = {}
        self._bytes = 0
        self._since = time.monotonic()
        self._lock = threading.Lock()
        self.committed: list[Manifest] = []
        self.samples_committed = 0

    def add(self, upstream: str, arrays: dict[str, np.ndarray] | None = None, doc: Any = None) -> str:
        with self._lock:
            if upstream not in self._buf:
                arrays = {n: np.array(a, copy=True) for n, a in (arrays or {}).items()}
                self._buf[upstream] = (arrays, doc)
                self._bytes += sum(a.nbytes for a in arrays.values()) + (len(json.dumps(doc)) if doc is not None else 0)
            due = (len(self._buf) >= self.max_samples or self._bytes >= self.max_bytes
                   or time.monotonic() - self._since >= self.max_seconds)
        if due:
            self.flush()
        return self.partition.sample_key(upstream)

    def flush(self) -> Manifest | None:
        with self._lock:
            buf, self._buf, self._bytes, self._since = self._buf, {}, 0, time.monotonic()
        if not buf:
            return None
        order = sorted(buf)
        docs = {}
        if self.doc:
            for u in order:
                arrays, doc = buf[u]
                docs[u] = arrays[DOC] if DOC in arrays else _doc_bytes(doc)
        rows = {name: sum(len(buf[u][0][name]) for u in order) for name in self.arrays}
        if self.doc:
            rows[DOC] = sum(len(d) for d in docs.values())
        with SegmentWriter(self.store, self.partition, order, arrays=self.arrays, doc=self.doc, summary=self.summary,
                           provenance=self.provenance, rows=rows) as w:
            for u in order:
                arrays, _doc = buf[u]
                if self.doc:
                    arrays = {**arrays, DOC: docs[u]}
                w.add(arrays)
        self.committed.append(w.manifest)
        self.samples_committed += len(order)
        return w.manifest

    def __enter__(self) -> "SampleSink":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.flush()
            return
        try:
            self.flush()  # keep every finished sample, whatever stopped the producer
        except Exception:
            pass


# ------------------------------------------------------------------------------------ the index

_SAMPLES_AT = re.compile(rb'"samples":\s*\{')
_PARTITION = re.compile(rb'"partition":\s*"([0-9a-f]{32})"')

# The on-disk sample index of a partition (docs/format.md "The sample index"): derived data,
# never the truth. One file per partition, ``<store>/index/samples/<partition>``, holding the
# sample keys of each segment it covers (16-byte values) with an xxh3-128 of that segment's
# manifest bytes, and the sorted distinct keys of them all. A
# reader uses a segment's keys from it only if the manifest it has just read hashes the same, so
# the keys are exactly those that parsing the manifest gives; anything new, changed or gone is
# parsed or dropped and the file is replaced (temporary name, then rename). Commits do not write
# it (a run committing 25 segments would rewrite it 25 times); the next reader brings it up to
# date, so concurrent writers, gc, pull and migrate need no coordination with it.
SAMPLE_INDEX_VERSION = 1
SAMPLE_INDEX_MIN = 4096  # partitions with fewer samples are parsed from manifests (fast enough)
_sample_index_stamp: str | None = None


def sample_index_stamp() -> str:
    """xxh3-64 of the code that decides which keys a manifest gives (this module, manifest
    validation, keys, the store format): an index written by other code is not used."""
    global _sample_index_stamp
    if _sample_index_stamp is None:
        from .keys import source_stamp

        _sample_index_stamp = source_stamp(SAMPLE_INDEX_VERSION, (
            "samples.py", "manifest.py", "keys.py", "store/format.py"))
    return _sample_index_stamp


def _read_sample_index(path, partition: str) -> tuple[dict[str, tuple[str, bytes]], bytes | None]:
    """(segment key -> (manifest digest, its sample keys as 16-byte values), the sorted distinct
    keys of them all) from an index file; ({}, None) if it is missing, torn, corrupt, of other
    code or of another partition (never trusted then)."""
    from .store import read_regular

    try:
        data = read_regular(path)  # (a FIFO in its place must not hang a run: it is rebuilt instead)
        nl = data.index(b"\n")
        head = json.loads(data[:nl])
        body = memoryview(data)[nl + 1:]
        if (not isinstance(head, dict) or head.get("dfcache_sample_index") != SAMPLE_INDEX_VERSION
                or head.get("stamp") != sample_index_stamp() or head.get("partition") != partition
                or head.get("body") != xxhash.xxh3_128_hexdigest(body)):
            return {}, None
        segs, unique = head["segments"], head["unique"]
        total = sum(n for _k, _d, n in segs)
        if not (isinstance(unique, int) and 0 < unique <= total) or len(body) != 16 * (total + unique):
            return {}, None
        out, at = {}, 0
        for key, digest, n in segs:
            out[key] = (digest, bytes(body[at:at + 16 * n]))
            at += 16 * n
        return out, bytes(body[at:])
    except (OSError, ValueError, TypeError, KeyError):
        return {}, None


def _write_sample_index(path, partition: str, segs: dict[str, tuple[str, bytes]], unique: bytes) -> None:
    """Replace the index file atomically; best effort (a store that cannot hold it is read
    from its manifests), no fsync (a torn file fails its checksum and is rebuilt)."""
    import os

    order = sorted(segs)
    body = b"".join(segs[k][1] for k in order) + unique
    head = json.dumps({"dfcache_sample_index": SAMPLE_INDEX_VERSION, "stamp": sample_index_stamp(),
                       "partition": partition, "body": xxhash.xxh3_128_hexdigest(body), "unique": len(unique) // 16,
                       "segments": [[k, segs[k][0], len(segs[k][1]) // 16] for k in order]}, separators=(",", ":"))
    from .store.layout import index_tmp_name

    tmp = path.with_name(index_tmp_name(path.name))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(head.encode() + b"\n" + body)
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def keys_as_bytes(keys: list[str]) -> bytes | None:
    """Sample keys (32 lowercase hex digits each) as 16-byte values; None if any is not one."""
    joined = "".join(keys)
    if len(joined) != 32 * len(keys) or not joined.isascii() or joined != joined.lower():
        return None
    try:
        out = bytes.fromhex(joined)
    except ValueError:
        return None
    return out if len(out) == 16 * len(keys) else None


def keys_from_bytes(blob: bytes) -> list[str]:
    """The inverse of :func:`keys_as_bytes`."""
    return blob.hex(",", 16).split(",") if blob else []


def _sorted_distinct(blob: bytes) -> bytes:
    """16-byte values sorted (as big-endian 128-bit numbers), each once."""
    a = np.frombuffer(blob, dtype=">u8").reshape(-1, 2)
    s = a[np.lexsort((a[:, 1], a[:, 0]))]
    keep = np.ones(len(s), dtype=bool)
    keep[1:] = (s[1:, 0] != s[:-1, 0]) | (s[1:, 1] != s[:-1, 1])
    return s[keep].tobytes()


class PartitionSamples(Mapping):
    """sample key -> (segment key, position) of one partition, built lazily from each segment's
    ordered keys. Membership of many keys at once (``contains_many``) is a binary search in the
    sorted distinct keys, as 128-bit numbers; a set of the keys (``key_set``) and the positions
    (smallest segment key first) are made only when asked for."""

    def __init__(self, segs: dict[str, list[str]], blobs: dict[str, bytes] | None = None,
                 distinct: bytes | None = None) -> None:
        self._strs = segs  # segment key -> its sample keys, in segment order (as strings)
        self._blobs = dict(blobs or {})  # the same as 16-byte values (those read from the index)
        self._distinct = distinct  # sorted distinct keys of every segment, if known
        self._sorted: tuple[np.ndarray, np.ndarray] | None = None
        self._set: set | None = None
        self._where: dict[str, tuple[str, int]] | None = None
        # Lazy members are made and segments added under one lock: a run's threads share this.
        self._lock = threading.RLock()

    def segment_keys(self) -> set[str]:
        with self._lock:
            return set(self._strs) | set(self._blobs)

    def keys_of(self, segment: str) -> list[str]:
        with self._lock:
            got = self._strs.get(segment)
            if got is None:
                got = self._strs[segment] = keys_from_bytes(self._blobs[segment])
            return got

    def blob_of(self, segment: str) -> bytes | None:
        with self._lock:
            got = self._blobs.get(segment)
            if got is None:
                got = keys_as_bytes(self._strs[segment])
                if got is not None:
                    self._blobs[segment] = got
            return got

    def distinct(self) -> bytes | None:
        """The sorted distinct keys as 16-byte values (None if a key is not 32 hex digits)."""
        with self._lock:
            if self._distinct is None:
                blobs = [self.blob_of(k) for k in sorted(self.segment_keys())]
                if any(b is None for b in blobs):
                    return None
                self._distinct = _sorted_distinct(b"".join(blobs)) if blobs else b""
            return self._distinct

    def key_set(self) -> set:
        with self._lock:
            if self._set is None:
                self._set = set(chain.from_iterable(map(self.keys_of, sorted(self.segment_keys()))))
            return self._set

    def size_hint(self) -> int:
        """Keys over all segments, a sample held by several counted in each (no sets made)."""
        with self._lock:
            return (sum(map(len, self._strs.values()))
                    + sum(len(b) // 16 for k, b in self._blobs.items() if k not in self._strs))

    def lacking(self, keys: list[str], as_bytes: bytes | None = None) -> list[int]:
        """The positions in ``keys`` of those that are not samples of the partition, ascending.

        A partition of fewer than ``SAMPLE_INDEX_MIN`` keys answers from its set of keys, so
        planning a run of a few samples imports no numpy; a larger one searches as
        :meth:`contains_many` does."""
        with self._lock:
            if self._set is not None or self.size_hint() < SAMPLE_INDEX_MIN:
                have = self.key_set()
                return [i for i, k in enumerate(keys) if k not in have]
        return np.flatnonzero(~self.contains_many(keys, as_bytes)).tolist()

    def contains_many(self, keys: list[str], as_bytes: bytes | None = None) -> np.ndarray:
        """Whether each of ``keys`` is a sample of the partition (a bool per key); ``as_bytes``:
        the same keys as :func:`keys_as_bytes` gives them, if the caller has them."""
        q = as_bytes if as_bytes is not None else keys_as_bytes(keys)
        with self._lock:
            distinct = self.distinct()
            if distinct is None or q is None:
                return np.fromiter(map(self.key_set().__contains__, keys), dtype=bool, count=len(keys))
            if not distinct or not keys:
                return np.zeros(len(keys), dtype=bool)
            if self._sorted is None:
                a = np.frombuffer(distinct, dtype=">u8").reshape(-1, 2)
                self._sorted = (a[:, 0].astype(np.uint64), a[:, 1].astype(np.uint64))
            hi, lo = self._sorted
        qa = np.frombuffer(q, dtype=">u8").reshape(-1, 2)
        qh, ql = qa[:, 0].astype(np.uint64), qa[:, 1].astype(np.uint64)
        order = np.argsort(qh)  # sorted needles: the searches walk the array in order
        pos = np.empty(len(qh), dtype=np.intp)
        pos[order] = np.searchsorted(hi, qh[order])
        at = np.minimum(pos, len(hi) - 1)
        same_hi = hi[at] == qh
        present = same_hi & (lo[at] == ql)
        for i in np.flatnonzero(same_hi & ~present).tolist():
            # another key shares these 64 bits: the run of equal high halves is sorted by the low
            j = int(pos[i]) + 1
            while j < len(hi) and hi[j] == qh[i]:
                if lo[j] == ql[i]:
                    present[i] = True
                    break
                j += 1
        return present

    def _resolved(self) -> dict[str, tuple[str, int]]:
        with self._lock:
            return self._resolve()

    def _resolve(self) -> dict[str, tuple[str, int]]:
        if self._where is None:
            where: dict[str, tuple[str, int]] = {}
            # Descending, each segment overwriting: a sample held by several resolves to the
            # smallest key. zip/repeat/range keep the 100,000-sample loop in C.
            for key in sorted(self.segment_keys(), reverse=True):
                keys = self.keys_of(key)
                where.update(zip(keys, zip(repeat(key), range(len(keys)))))
            self._where = where
        return self._where

    def add_segment(self, key: str, keys: list[str]) -> None:
        with self._lock:
            self._add_segment(key, keys)

    def _add_segment(self, key: str, keys: list[str]) -> None:
        if key in self._strs or key in self._blobs:
            return
        self._strs[key] = keys
        self._distinct = self._sorted = None
        if self._set is not None:
            self._set.update(keys)
        if self._where is not None:
            where = self._where
            for pos, k in enumerate(keys):
                cur = where.get(k)
                if cur is None or key < cur[0]:
                    where[k] = (key, pos)

    def __contains__(self, k) -> bool:
        return k in self.key_set()

    def __getitem__(self, k: str) -> tuple[str, int]:
        return self._resolved()[k]

    def __iter__(self):
        return iter(self.key_set())

    def __len__(self) -> int:
        return len(self.key_set())


class SampleIndex:
    """Where every sample of a store is: partition -> {sample key: (segment key, position)}.

    Built from manifests only (one listing of the store; a manifest is parsed only when its
    partition is asked for and the on-disk sample index does not already hold its keys), kept
    for the life of the :class:`~dfcache.store.Store` object and updated by this process's own
    commits. A sample in several segments resolves to the segment with the smallest key.
    """

    def __init__(self, store) -> None:
        self.store = store
        self._lock = threading.RLock()
        self._raw: dict[str, list[tuple[str, bytes]]] | None = None
        self._parts: dict[str, PartitionSamples] = {}
        self._segments: dict[str, dict[str, Manifest]] = {}
        self.errors: list[tuple[str, str]] = []  # (segment key, why it was skipped)
        self.index_used = 0  # segments whose keys came from the on-disk index (tests, bench)

    def refresh(self) -> None:
        with self._lock:
            self._raw = None
            self._parts.clear()
            self._segments.clear()
            self.errors = []

    def _scan(self) -> dict[str, list[tuple[str, bytes]]]:
        if self._raw is None:
            raw: dict[str, list[tuple[str, bytes]]] = {}
            for key, data in self.store.backend.iter_manifests():
                at = _SAMPLES_AT.search(data)
                if at is None:
                    continue
                m = _PARTITION.search(data, at.end())
                if m is not None:
                    raw.setdefault(m.group(1).decode(), []).append((key, data))
            self._raw = raw
        return self._raw

    def partitions(self) -> list[str]:
        with self._lock:
            return sorted(set(self._scan()) | set(self._parts))

    def _parse(self, partition: str, key: str, data: bytes) -> Manifest | None:
        from .errors import UntrustedManifestError

        try:
            m = Manifest.from_json(data, expect_key=key)
        except UntrustedManifestError as e:
            # A segment of the very partition asked for that cannot be trusted: say so (its
            # samples would silently count as missing and be made again beside it).
            raise UntrustedManifestError(f"{e.message} (in {self.store.url})", key=key) from None
        if not m.samples or m.samples["partition"] != partition:
            return None
        problem = key_problem(m)
        if problem:  # its claims (inputs, partition, samples) were edited: they decide nothing here
            raise UntrustedManifestError(f"manifest of segment {key} refused: {problem} (in {self.store.url}).",
                                         key=key, fix=f"Delete it with `dfcache gc --key {key[:12]} --force --yes` "
                                         "and run again to recompute its samples, or pull it again.")
        return m

    def _load(self, partition: str) -> PartitionSamples:
        got = self._parts.get(partition)
        if got is not None:
            return got
        listed = self._scan().get(partition, [])
        where_dir = self.store.backend.sample_index_dir()
        path = where_dir / partition if where_dir is not None else None
        disk, distinct = _read_sample_index(path, partition) if path is not None else ({}, None)
        segs: dict[str, Manifest] = {}
        strs: dict[str, list[str]] = {}
        blobs: dict[str, bytes] = {}
        digests: dict[str, str] = {}
        for key, data in listed:
            digest = xxhash.xxh3_128_hexdigest(data)
            hit = disk.get(key)
            if hit is not None and hit[0] == digest:
                blobs[key] = hit[1]  # the keys of the very manifest bytes it was indexed from
                digests[key] = digest
                self.index_used += 1
                continue
            m = self._parse(partition, key, data)
            if m is None:
                continue
            segs[key] = m
            strs[key] = m.samples["keys"]
            digests[key] = digest
        where = PartitionSamples(strs, blobs, distinct if not strs and set(blobs) == set(disk) else None)
        if path is not None and (strs or set(disk) != set(blobs)) and \
                sum(len(b) // 16 for b in blobs.values()) + sum(map(len, strs.values())) >= SAMPLE_INDEX_MIN:
            distinct = where.distinct()
            entries = {k: (digests[k], where.blob_of(k)) for k in digests}
            if distinct is not None and all(b is not None for _d, b in entries.values()):
                _write_sample_index(path, partition, entries, distinct)
        self._parts[partition] = where
        self._segments[partition] = segs
        return where

    def partition(self, partition: str) -> PartitionSamples:
        """sample key -> (segment key, position in it) of every sample of ``partition``."""
        with self._lock:
            return self._load(partition)

    def segments(self, partition: str) -> dict[str, Manifest]:
        """segment key -> manifest of every segment of ``partition`` (parsing those whose keys
        came from the on-disk index)."""
        with self._lock:
            where = self._load(partition)
            segs = self._segments[partition]
            if len(segs) < len(where.segment_keys()):
                data_of = dict(self._scan().get(partition, []))
                for key in where.segment_keys():
                    if key not in segs:
                        m = self._parse(partition, key, data_of[key])
                        if m is not None:
                            segs[key] = m
            return segs

    def missing(self, partition: str, keys: Iterable[str]) -> list[str]:
        keys = list(dict.fromkeys(keys))
        return [keys[i] for i in self.partition(partition).lacking(keys)]

    def add(self, m: Manifest) -> None:
        """Record a segment this process committed (or found committed by another)."""
        if not m.samples:
            return
        p = m.samples["partition"]
        with self._lock:
            if p not in self._parts and self._raw is None:
                return  # nothing listed yet: the first load lists it from the store
            where = self._load(p)  # the listing may predate this commit: add it to what was listed
            segs = self._segments[p]
            if m.key in where.segment_keys():
                return
            segs[m.key] = m
            where.add_segment(m.key, m.samples["keys"])


_indexes: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_indexes_lock = threading.Lock()


def index_of(store) -> SampleIndex:
    """The sample index of ``store`` (one per Store object)."""
    with _indexes_lock:
        idx = _indexes.get(store)
        if idx is None:
            idx = SampleIndex(store)
            _indexes[store] = idx
        return idx


# ------------------------------------------------------------------------------------ reading


class Segment:
    """A committed segment opened for reads: its manifest and its per-sample index document."""

    def __init__(self, store, key: str) -> None:
        self.artifact = store.open(key)
        self.key = key
        m = self.artifact.manifest
        if not m.samples:
            raise UsageError(f"artifact {key} is not a segment of samples.")
        self.keys: list[str] = m.samples["keys"]
        index = self.artifact.json(INDEX)
        problem = index_problem(m, index)
        if problem:
            raise IntegrityError(f"segment {key} is corrupt: {problem}. Delete it with `dfcache gc --key "
                                 f"{key[:12]} --force --yes` and run again, or pull it again.", key=key)
        self.upstream: list[str] = index["upstream"]
        self.offsets: dict[str, list[int]] = index["offsets"]
        self.digests: list[str] = index["digests"]
        self._readers: dict = {}

    def reader(self, name: str):
        r = self._readers.get(name)
        if r is None:
            r = self._readers[name] = self.artifact.array(name)
        return r

    def rows(self, pos: int, name: str) -> tuple[int, int]:
        off = self.offsets[name]
        return off[pos], off[pos + 1]

    def read_raw(self, pos: int, name: str, *, out: np.ndarray | None = None, mapped: bool = False) -> np.ndarray:
        """One sample's rows in the storage dtype; ``out`` and ``mapped`` as ArrayReader.read_raw."""
        a, b = self.rows(pos, name)
        return self.reader(name).read_raw(a, b, out=out, mapped=mapped)

    def read(self, pos: int, name: str) -> np.ndarray:
        a, b = self.rows(pos, name)
        return self.reader(name).read(a, b)

    def map_rows(self, pos: int, name: str) -> np.ndarray | None:
        """One sample's rows without a copy (ArrayReader.map_rows), or None."""
        a, b = self.rows(pos, name)
        return self.reader(name).map_rows(a, b)

    def prefetch(self, pos: int, name: str) -> None:
        a, b = self.rows(pos, name)
        self.reader(name).prefetch(a, b)

    def doc(self, pos: int) -> Any:
        return json.loads(self.read_raw(pos, DOC).tobytes())

    def sample_problem(self, pos: int) -> str | None:
        digests = {name: _digest_rows(self.read_raw(pos, name)) for name in self.offsets}
        if sample_digest(digests) != self.digests[pos]:
            return f"sample {self.keys[pos]} (position {pos}) does not match its digest"
        return None


def index_problem(m: Manifest, index: Any) -> str | None:
    """What is wrong with a segment's index document given its manifest (None if they agree)."""
    keys = m.samples["keys"]
    n = len(keys)
    if not isinstance(index, dict):
        return "its samples document is not an object"
    up, offsets, digests = index.get("upstream"), index.get("offsets"), index.get("digests")
    if not (isinstance(up, list) and len(up) == n and all(isinstance(u, str) for u in up)):
        return f"its samples document lists {len(up) if isinstance(up, list) else 'no'} upstream keys for {n} samples"
    if any(a >= b for a, b in zip(up, up[1:])):
        return "its samples are not in ascending upstream order"
    if sample_keys(m.samples["partition"], up) != keys:
        return "its sample keys do not derive from the partition and the upstream keys"
    if not (isinstance(digests, list) and len(digests) == n and all(isinstance(d, str) and len(d) == 32 for d in digests)):
        return "its samples document has no digest for every sample"
    if not isinstance(offsets, dict) or set(offsets) != set(m.arrays):
        return f"its samples document gives offsets for {sorted(offsets) if isinstance(offsets, dict) else '?'}, " \
               f"the manifest has arrays {sorted(m.arrays)}"
    for name, off in offsets.items():
        if (not isinstance(off, list) or len(off) != n + 1 or off[0] != 0 or off[-1] != m.arrays[name].shape[0]
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in off)
                or any(a > b for a, b in zip(off, off[1:]))):
            return f"the row offsets of array {name} do not cover its {m.arrays[name].shape[0]} rows"
    return None


def segment_problems(store, key: str) -> list[str]:
    """Per-sample checks ``dfcache verify`` adds for a segment (the chunks are checked apart)."""
    try:
        m = store.manifest(key)
        Partition.of_segment(m)
        seg = Segment(store, key)
    except IntegrityError as e:
        return [e.message]
    problems = []
    for pos in range(len(seg.keys)):
        try:
            p = seg.sample_problem(pos)
        except IntegrityError:
            continue  # the chunk checks name it
        if p:
            problems.append(p)
    return problems


def read_side_by_side(parts: list[tuple[Segment, int]], name: str, out: np.ndarray, *,
                      mapped: bool = False) -> np.ndarray:
    """Each ``(segment, position)``'s rows of array ``name`` into consecutive columns of ``out``
    (the layers of one sample laid side by side, as a training item concatenates them; ``out``
    is rows x the parts' widths summed, in the storage dtype; ``mapped`` as
    ``ArrayReader.read_raw``). Returns ``out``.

    One part after the other on the caller's thread: splitting the parts across reader threads
    was measured (bench ``training``, 2026-12-04) and was no faster on 2 cores at 0 workers,
    slower with DataLoader workers, which already share the cores."""
    widths = [int(np.prod(seg.reader(name).shape[1:], dtype=np.int64)) for seg, _ in parts]
    if out.ndim != 2 or out.shape[1] != sum(widths):
        raise UsageError(f"out= must be 2-D with {sum(widths)} columns (the arrays' widths summed), "
                         f"not {out.shape}.")
    col = 0
    for (seg, pos), w in zip(parts, widths):
        seg.read_raw(pos, name, out=out[:, col:col + w], mapped=mapped)
        col += w
    return out


class SampleSet:
    """An ordered list of samples of one partition, read from whichever segments hold them.

    Raises :class:`SamplesMissingError` (with ``.missing``) if any is in no segment.
    """

    def __init__(self, store, partition: str, keys: list[str]) -> None:
        self.store = store
        self.partition = partition
        self.keys = list(keys)
        idx = index_of(store)
        where = idx.partition(partition)
        missing = [k for k in dict.fromkeys(self.keys) if k not in where]
        if missing:
            idx.refresh()  # another process may have committed them since we listed
            where = idx.partition(partition)
            missing = [k for k in dict.fromkeys(self.keys) if k not in where]
        if missing:
            raise SamplesMissingError(f"{len(missing)} of {len(self.keys)} samples of partition {partition[:12]} are "
                                      f"not in {store.url} (first: {', '.join(k[:12] for k in missing[:3])}).",
                                      missing=missing)
        self.where = [where[k] for k in self.keys]
        self._segments: dict[str, Segment] = {}

    def __len__(self) -> int:
        return len(self.keys)

    def segment(self, i: int) -> tuple[Segment, int]:
        key, pos = self.where[i]
        seg = self._segments.get(key)
        if seg is None:
            try:
                seg = Segment(self.store, key)
            except ArtifactNotFoundError:
                # gc removed a duplicate since we listed: the sample is in the segment kept.
                idx = index_of(self.store)
                idx.refresh()
                now = idx.partition(self.partition).get(self.keys[i])
                if now is None or now[0] == key:
                    raise
                self.where[i] = now
                return self.segment(i)
            self._segments[key] = seg
        return seg, pos

    def read(self, i: int, name: str) -> np.ndarray:
        seg, pos = self.segment(i)
        return seg.read(pos, name)

    def read_raw(self, i: int, name: str, *, out: np.ndarray | None = None, mapped: bool = False) -> np.ndarray:
        seg, pos = self.segment(i)
        return seg.read_raw(pos, name, out=out, mapped=mapped)

    def map_rows(self, i: int, name: str) -> np.ndarray | None:
        seg, pos = self.segment(i)
        return seg.map_rows(pos, name)

    def rows(self, i: int, name: str) -> int:
        seg, pos = self.segment(i)
        a, b = seg.rows(pos, name)
        return b - a

    def doc(self, i: int) -> Any:
        seg, pos = self.segment(i)
        return seg.doc(pos)

    def read_many(self, name: str, positions: Iterable[int] | None = None, *, raw: bool = False) -> list[np.ndarray]:
        """Rows of many samples at once: each segment's rows are read in one span where the
        samples asked for fill most of it (a bulk read), else sample by sample."""
        positions = list(range(len(self))) if positions is None else list(positions)
        out: dict[int, np.ndarray] = {}
        by_seg: dict[str, list[tuple[int, int]]] = {}
        for i in positions:
            seg, pos = self.segment(i)
            by_seg.setdefault(seg.key, []).append((i, pos))
        for key, items in by_seg.items():
            seg = self._segments[key]
            spans = [seg.rows(pos, name) for _, pos in items]
            lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
            reader = seg.reader(name)
            if sum(b - a for a, b in spans) * 2 >= hi - lo:
                block = reader.read_raw(lo, hi) if raw else reader.read(lo, hi)
                for (i, _), (a, b) in zip(items, spans):
                    out[i] = block[a - lo:b - lo]
            else:
                for (i, _), (a, b) in zip(items, spans):
                    out[i] = reader.read_raw(a, b) if raw else reader.read(a, b)
        return [out[i] for i in positions]

    def docs(self, positions: Iterable[int] | None = None) -> list[Any]:
        return [json.loads(b.tobytes()) for b in self.read_many(DOC, positions, raw=True)]

    def upstream(self, i: int) -> str:
        seg, pos = self.segment(i)
        return seg.upstream[pos]
