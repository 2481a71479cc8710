"""A segment: one committed artifact holding many samples of one partition (see the package
docstring for its layout). :class:`SegmentWriter` writes one, :class:`Segment` reads one;
:func:`index_problem` and :func:`segment_problems` are the checks of its per-sample index
document that reads and ``dfcache verify`` make.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import xxhash

from .._lazy import LazyModule
from ..errors import IntegrityError, UsageError
from ..keys import sample_keys, segment_key
from ..manifest import STORAGE_DTYPE, Manifest
from ..store import CommitOnExit
from ..store.format import chunk_digest, default_chunk_rows
from ._index import index_of
from ._partition import Partition

np = LazyModule("numpy")  # imported by the first array read or written

DOC = "doc"  # the array of per-sample JSON documents
INDEX = "samples"  # the document with per-sample upstream keys, row offsets and digests
DOC_CHUNK_ROWS = 1 << 16  # 64 KiB of JSON a chunk: one completion's text reads one or two chunks
MAX_SAMPLE_CHUNK_ROWS = 1 << 14  # token ids: 64 KiB chunks, a few samples each


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
    # ~1 MiB chunks for wide rows (hidden states: 128 tokens at 4096 x bf16), at most
    # MAX_SAMPLE_CHUNK_ROWS rows for narrow ones so one sample's read stays small.
    return min(default_chunk_rows((0,) + tuple(spec.row_shape), spec.dtype), MAX_SAMPLE_CHUNK_ROWS)


def doc_bytes(doc: Any) -> np.ndarray:
    """A sample's JSON document as the rows of the ``doc`` array (UTF-8, sorted keys)."""
    data = json.dumps(doc, sort_keys=True, ensure_ascii=False, allow_nan=False).encode()
    return np.frombuffer(data, dtype=np.uint8)


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
            arrays[DOC] = doc_bytes(doc)
        if set(arrays) != set(self.specs):
            raise UsageError(f"sample {self._n} gives arrays {sorted(arrays)}; the partition has {sorted(self.specs)}.")
        digests = {}
        for name, spec in self.specs.items():
            rows = _storage(arrays[name], spec.dtype)
            digests[name] = chunk_digest(rows)  # a sample's rows are digested as a chunk's are
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

    def read_raw(self, pos: int, name: str, *, out: np.ndarray | None = None, mapped: bool = False,
                 copy=None) -> np.ndarray:
        """One sample's rows in the storage dtype; ``out``, ``mapped`` and ``copy`` as ArrayReader.read_raw."""
        a, b = self.rows(pos, name)
        return self.reader(name).read_raw(a, b, out=out, mapped=mapped, copy=copy)

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
        digests = {name: chunk_digest(self.read_raw(pos, name)) for name in self.offsets}
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
                      mapped: bool = False, copy=None) -> np.ndarray:
    """Each ``(segment, position)``'s rows of array ``name`` into consecutive columns of ``out``
    (the layers of one sample laid side by side, as a training item concatenates them; ``out``
    is rows x the parts' widths summed, in the storage dtype; ``mapped`` as
    ``ArrayReader.read_raw``, and ``copy`` with it). Returns ``out``.

    One part after the other on the caller's thread: splitting the parts across reader threads
    was measured (bench ``training``, 2026-12-04) and was no faster on 2 cores at 0 workers,
    slower with DataLoader workers, which already share the cores."""
    # math.prod: 0.15 us a call against np.prod's 2.5, on every training item's read
    widths = [math.prod(map(int, seg.reader(name).shape[1:])) for seg, _ in parts]
    if out.ndim != 2 or out.shape[1] != sum(widths):
        raise UsageError(f"out= must be 2-D with {sum(widths)} columns (the arrays' widths summed), "
                         f"not {out.shape}.")
    col = 0
    for (seg, pos), w in zip(parts, widths):
        seg.read_raw(pos, name, out=out[:, col:col + w], mapped=mapped, copy=copy)
        col += w
    return out
