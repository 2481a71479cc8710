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

The modules, one concept each: the partition and its key (``_partition.py``), a segment written
and read (``_segment.py``), the sink that commits finished samples as segments (``_sink.py``),
the sample index, in memory and on disk (``_index.py``), and an ordered set of samples read from
whichever segments hold them (``_set.py``). The keys themselves are :mod:`dfcache.keys`'s.
"""

from importlib import import_module

# Loaded on first use, as dfcache.store's names are: a plan or a fully cached run finds its
# samples with Partition and index_of only, and never imports the writers and readers of segments
# (3 modules, their share of a cached run's 2% in python -m bench's noop-eval row).
_WHERE = {"SamplesMissingError": "..errors", "record_digest": "..keys", "sample_key": "..keys",
          "sample_keys": "..keys", "segment_key": "..keys",
          "PartitionSamples": "._index", "SampleIndex": "._index", "index_of": "._index", "keys_as_bytes": "._index",
          "keys_from_bytes": "._index", "distinct_keys": "._index", "Partition": "._partition", "partition_key": "._partition",
          "DOC": "._segment", "INDEX": "._segment", "SampleArray": "._segment", "Segment": "._segment",
          "SegmentWriter": "._segment", "index_problem": "._segment", "read_side_by_side": "._segment",
          "sample_digest": "._segment", "segment_problems": "._segment", "SampleSet": "._set",
          "SampleSink": "._sink"}

__all__ = ["DOC", "INDEX", "Partition", "PartitionSamples", "SampleArray", "SampleIndex", "SampleSet", "SampleSink",
           "SamplesMissingError", "Segment", "SegmentWriter", "distinct_keys", "index_of", "index_problem", "keys_as_bytes",
           "keys_from_bytes", "partition_key", "read_side_by_side", "record_digest", "sample_digest", "sample_key",
           "sample_keys", "segment_key", "segment_problems"]


def __getattr__(name: str):
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(where, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
