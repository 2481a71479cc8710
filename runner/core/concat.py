"""`dfcache concat`: a selection's layers stored concatenated, for training reads with no copy.

The eval pipeline stores each layer's hidden states as its own partition (a layer is shared by
every drafter that reads it), so a training item that concatenates several layers has to copy
each layer's rows into one buffer. A *concatenated copy* stores them once more, side by side (one
row per token of ``len(layers) * hidden`` values, the item's layout), with each segment's array
a single chunk: every sample's rows then lie in one chunk file, and an item is a private memory
map of them (no copy, as ``torch.load(mmap=True)`` of a SpecForge file). It costs the selected
layers' bytes again on disk; the per-layer partitions stay (the eval reads them), and
``gc --stage concatenated_hidden_states`` removes the copy.

Key recipe (a per-sample partition, docs/format.md "Samples and segments")::

    partition = Partition("concatenated_hidden_states", VERSION,
                          inputs={"layers": layer ids in concatenation order, "widths": hidden per layer,
                                  "dtype": the stored dtype},
                          upstream={"sample": tokens partition, "hidden_states": [layer partitions, in order]})
    sample key = partition.sample_key(tokens sample key)

A sample's rows are exactly its tokens sample's rows of those layer partitions, side by side;
nothing else shapes its bytes. Segments are committed as they fill (``SEGMENT_BYTES``), so an
interrupted run keeps what it committed and a rerun writes only what is missing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

STAGE = "concatenated_hidden_states"
VERSION = 1
ARRAY = "hidden"
# One chunk a segment: a chunk's crc32c is checked on its first map, so a segment is read whole
# once per process; 64 MiB keeps that first touch short and the segment writer's buffer small.
SEGMENT_BYTES = 64 << 20
ONE_CHUNK = 1 << 40  # chunk rows: more than any segment holds, so the writer makes one chunk of it


@dataclass
class ConcatResult:
    partition: str
    layers: list[int]
    samples: int
    written: int  # samples written now
    already: int  # samples stored concatenated before
    bytes_written: int
    segments: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"partition": self.partition, "layers": self.layers, "samples": self.samples,
                "written": self.written, "already": self.already, "bytes_written": self.bytes_written,
                "segments": self.segments}


def concat_partition(source):
    """The partition of a :class:`runner.core.samples.StoredSamples`'s layers concatenated, in its order."""
    from dfcache.samples import Partition

    layers = list(source.layers) if source.layers is not None else None
    return Partition(STAGE, VERSION, {"layers": layers, "widths": list(source.widths), "dtype": source.dtype},
                     {"sample": source.tokens_partition, "hidden_states": list(source.layer_partitions)})


def concat(source, store, *, progress: Callable[[int], object] | None = None) -> ConcatResult:
    """Store the samples of ``source`` not stored concatenated yet; then ``source`` reads from there.

    ``progress(n)``: a tqdm-like bar (``update``, ``close``) for the n samples to write."""
    from dfcache.errors import UsageError
    from dfcache.samples import SampleArray, SampleSink, index_of

    from .samples import StoredSamples

    if not isinstance(source, StoredSamples):
        raise UsageError("only the pipeline's per-sample hidden states can be stored concatenated (an imported "
                         "set keeps its own layout): read it without concatenated=True.")
    part = concat_partition(source)
    keys = part.sample_keys(source.tokens_keys)
    idx = index_of(store)
    idx.refresh()
    todo = list(dict.fromkeys(idx.partition(part.key).lacking(keys)))
    bar = progress(len(todo)) if progress is not None and todo else None
    written = 0
    arrays = {ARRAY: SampleArray((sum(source.widths),), source.dtype, "none", ONE_CHUNK)}
    sink = SampleSink(store, part, arrays=arrays, doc=False, max_bytes=SEGMENT_BYTES, max_seconds=1e9,
                      summary=f"layers {list(source.layers or [])} concatenated")
    try:
        with sink:  # leaving it (an error or Ctrl-C included) commits the samples buffered
            for i in todo:
                rows = source.read_hidden_per_layer(i)
                sink.add(source.tokens_keys[i], {ARRAY: rows})
                written += rows.nbytes
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    source.use_concatenated(part.key, keys)
    return ConcatResult(partition=part.key, layers=list(source.layers or []), samples=len(keys), written=len(todo),
                        already=len(keys) - len(todo), bytes_written=written,
                        segments=[m.key for m in sink.committed])
