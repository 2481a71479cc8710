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

from ..errors import SamplesMissingError
from ..keys import record_digest, sample_key, sample_keys, segment_key
from ._index import PartitionSamples, SampleIndex, index_of, keys_as_bytes, keys_from_bytes
from ._partition import Partition, partition_key
from ._segment import (DOC, INDEX, SampleArray, Segment, SegmentWriter, index_problem, read_side_by_side,
                       sample_digest, segment_problems)
from ._set import SampleSet
from ._sink import SampleSink

__all__ = ["DOC", "INDEX", "Partition", "PartitionSamples", "SampleArray", "SampleIndex", "SampleSet", "SampleSink",
           "SamplesMissingError", "Segment", "SegmentWriter", "index_of", "index_problem", "keys_as_bytes",
           "keys_from_bytes", "partition_key", "read_side_by_side", "record_digest", "sample_digest", "sample_key",
           "sample_keys", "segment_key", "segment_problems"]
