"""The sink of a producer of samples: finished samples buffered and committed as segments."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from .._lazy import LazyModule
from ..manifest import Manifest
from ._partition import Partition
from ._segment import DOC, SampleArray, SegmentWriter, doc_bytes

np = LazyModule("numpy")


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
                docs[u] = arrays[DOC] if DOC in arrays else doc_bytes(doc)
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
