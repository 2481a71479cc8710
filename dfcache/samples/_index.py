"""Where every sample of a store is: the sample index, built from segment manifests and kept,
for large partitions, on disk beside the store (derived data, never the truth)."""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections.abc import Mapping
from itertools import chain, repeat
from typing import Iterable

import xxhash

from .._lazy import LazyModule
from ..errors import UntrustedManifestError
from ..manifest import Manifest, key_problem

np = LazyModule("numpy")  # imported by a large key search: a plan of a few cached samples needs none


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
        from ..keys import source_stamp

        _sample_index_stamp = source_stamp(SAMPLE_INDEX_VERSION, (
            "samples/_index.py", "samples/_segment.py", "manifest.py", "keys.py", "store/format.py",
            "store/layout.py"))
    return _sample_index_stamp


def _read_sample_index(path, partition: str) -> tuple[dict[str, tuple[str, bytes]], bytes | None]:
    """(segment key -> (manifest digest, its sample keys as 16-byte values), the sorted distinct
    keys of them all) from an index file; ({}, None) if it is missing, torn, corrupt, of other
    code or of another partition (never trusted then)."""
    from ..store import read_regular

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
    order = sorted(segs)
    body = b"".join(segs[k][1] for k in order) + unique
    head = json.dumps({"dfcache_sample_index": SAMPLE_INDEX_VERSION, "stamp": sample_index_stamp(),
                       "partition": partition, "body": xxhash.xxh3_128_hexdigest(body), "unique": len(unique) // 16,
                       "segments": [[k, segs[k][0], len(segs[k][1]) // 16] for k in order]}, separators=(",", ":"))
    from ..store import replace_derived

    replace_derived(path, head.encode() + b"\n" + body)


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


def distinct_keys(blob: bytes) -> bytes:
    """16-byte values (as :func:`keys_as_bytes` gives them) sorted as big-endian 128-bit numbers,
    each once: what :meth:`PartitionSamples.distinct` holds of a partition, so a caller that
    keeps it for a set of keys can ask :meth:`PartitionSamples.lacking` with it."""
    return _sorted_distinct(blob) if blob else b""


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

    def lacking(self, keys: list[str], as_bytes: bytes | None = None, distinct: bytes | None = None) -> list[int]:
        """The positions in ``keys`` of those that are not samples of the partition, ascending.

        ``distinct``: the keys' sorted distinct values (:func:`distinct_keys` of ``as_bytes``),
        when the caller has them: a partition holding exactly those keys answers with one
        comparison (a fully cached stage of a repeated plan: no search, no numpy import). A
        partition of fewer than ``SAMPLE_INDEX_MIN`` keys answers from its set of keys, so
        planning a run of a few samples imports no numpy; a larger one searches as
        :meth:`contains_many` does."""
        with self._lock:
            if distinct is not None and len(distinct) == 16 * self.size_hint() and distinct == self.distinct():
                return []  # (size_hint first: a partition holding other keys too is not sorted for nothing)
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
