"""An ordered set of samples of one partition, read from whichever segments hold them."""

from __future__ import annotations

import json
from typing import Any, Iterable

from .._lazy import LazyModule
from ..errors import ArtifactNotFoundError, SamplesMissingError
from ._index import index_of
from ._segment import DOC, Segment

np = LazyModule("numpy")


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
