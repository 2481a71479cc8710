"""Push and pull samples, not whole sets: a machine with 900 of 1,000 samples fetches 100.

    pull_samples(remote, local, {partition: [sample keys]})   # what the runner does per stage
    push_samples(local, remote, {partition: [sample keys]})
    compare_samples(local, remote)                             # per partition: only here / only there / both

For each partition the destination's sample index says what it lacks; the source's says which
segment holds each missing sample. A source segment whose every sample is needed (and that the
destination lacks) is copied whole with :mod:`dfcache.transfer` (every file verified, manifest
last). From any other segment only the needed samples' rows are copied: the chunk files their
rows touch are fetched with the manifest's size bounds and verified (crc32c and chunk digest),
the segment's samples document is verified against its digest and checked against the manifest
(sample keys must derive from the partition and the upstream keys), each sample's rows are
checked against its own digest, and the samples go into new segments at the destination,
committed atomically like any other. Nothing unverified is ever published; the destination
never holds part of a segment.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from .errors import IntegrityError
from .manifest import Manifest
from .samples import (DOC, INDEX, Partition, SampleArray, SampleSink, index_of, index_problem, sample_digest,
                      sample_key)
from .store.format import chunk_digest
from .store import Store
from .store import format as fmt
from .transfer import BaseTransferResult, TransferResult, damage_fix, pull_keys, push_keys, read_bounded

__all__ = ["SampleTransferResult", "compare_samples", "pull_samples", "push_samples", "split_selection",
           "transfer_selection", "with_sample_upstream"]


@dataclass
class SampleTransferResult(BaseTransferResult):
    """What one push or pull of samples did."""

    direction: str
    source: str
    destination: str
    requested: int = 0  # distinct samples asked for
    present: int = 0  # already at the destination
    copied: int = 0  # newly at the destination
    missing: list[str] = field(default_factory=list)  # in neither store
    whole_segments: list[str] = field(default_factory=list)  # copied as they are
    new_segments: list[str] = field(default_factory=list)  # assembled from parts of source segments
    bytes: int = 0
    seconds: float = 0.0

    def summary(self) -> str:
        verb, where = self._verb_where()
        miss = f"; {len(self.missing)} in neither store" if self.missing else ""
        return (f"{verb} {self.copied} sample(s) {where} ({len(self.whole_segments)} whole segment(s), "
                f"{len(self.new_segments)} new); {self.present} already there{miss}; {self.seconds:.1f} s")


def _rows_of(src, m: Manifest, name: str, ranges: list[tuple[int, int]], direction: str) -> list[np.ndarray]:
    """The rows [a, b) of each range of one array, from verified chunk files only."""
    spec = m.arrays[name]
    cr = spec.chunk_rows
    ndim = len(spec.shape)
    chunks: dict[int, np.ndarray] = {}
    for a, b in ranges:
        for i in range(a // cr, (b - 1) // cr + 1 if b > a else a // cr):
            if i in chunks:
                continue
            rel = fmt.chunk_relpath(name, i, ndim)
            data = read_bounded(src, m, rel, fmt.FileRole("chunk", name, i), direction)
            try:
                chunks[i] = fmt.check_chunk(spec, name, i, data, m.key)
            except IntegrityError as e:
                raise e.with_fix(damage_fix(direction, m.key, src.url)) from None
    out = []
    for a, b in ranges:
        rows = np.empty((b - a,) + tuple(spec.shape[1:]), dtype=np.dtype(spec.storage_dtype).newbyteorder("<"))
        for i in range(a // cr, (b - 1) // cr + 1 if b > a else a // cr):
            lo = i * cr
            x, y = max(a, lo), min(b, lo + cr)
            rows[x - a:y - a] = chunks[i][x - lo:y - lo]
        out.append(rows)
    return out


def _copy(direction: str, src, dst, wanted: dict[str, list[str]], *, progress: bool, jobs: int) -> SampleTransferResult:
    t0 = time.monotonic()
    result = SampleTransferResult(direction=direction, source=src.url, destination=dst.url)
    src_index, dst_index = index_of(src), index_of(dst)
    sinks: dict[tuple, SampleSink] = {}
    from tqdm import tqdm

    bar = None
    try:
        for partition, keys in wanted.items():
            keys = list(dict.fromkeys(keys))
            result.requested += len(keys)
            have = dst_index.partition(partition)
            need = [k for k in keys if k not in have]
            result.present += len(keys) - len(need)
            if not need:
                continue
            where = src_index.partition(partition)
            segs = src_index.segments(partition)
            by_seg: dict[str, list[int]] = {}
            for k in need:
                loc = where.get(k)
                if loc is None:
                    result.missing.append(k)
                else:
                    by_seg.setdefault(loc[0], []).append(loc[1])
            whole, partial = [], {}
            for seg, positions in sorted(by_seg.items()):
                m = segs[seg]
                Partition.of_segment(m)
                try:
                    fmt.check_manifest(m)
                except IntegrityError as e:
                    raise e.with_fix(damage_fix(direction, seg, src.url)) from None
                if len(positions) == len(m.samples["keys"]) and not dst.has(seg):
                    whole.append(seg)
                else:
                    partial[seg] = sorted(positions)
            if whole:
                copy = pull_keys if direction == "pull" else push_keys
                r = copy(src, dst, whole, with_upstream=False, progress=progress, jobs=jobs)
                result.bytes += r.bytes
                result.whole_segments.extend(r.transferred)
                for seg in whole:
                    dst_index.add(dst.manifest(seg))
                    result.copied += len(segs[seg].samples["keys"])
            if partial and bar is None:
                bar = tqdm(total=None, desc=f"{direction} samples", unit="sample", file=sys.stderr,
                           disable=None if progress else True, leave=False)
            for seg, positions in partial.items():
                m = segs[seg]
                part = Partition.of_segment(m)
                rel, role = fmt.blob_relpath(INDEX), fmt.FileRole("blob", INDEX)
                raw = read_bounded(src, m, rel, role, direction)
                try:
                    fmt.check_file(m, rel, role, raw)
                except IntegrityError as e:
                    raise e.with_fix(damage_fix(direction, seg, src.url)) from None
                index = json.loads(raw)
                problem = index_problem(m, index)
                if problem:
                    raise IntegrityError(f"segment {seg} in {src.url} is corrupt: {problem}. "
                                         f"{damage_fix(direction, seg, src.url)}", key=seg)
                names = sorted(m.arrays)
                rows = {n: _rows_of(src, m, n, [(index["offsets"][n][p], index["offsets"][n][p + 1])
                                                 for p in positions], direction) for n in names}
                arrays = {n: SampleArray(tuple(m.arrays[n].shape[1:]), m.arrays[n].dtype, m.arrays[n].codec,
                                         m.arrays[n].chunk_rows) for n in names if n != DOC}
                sig = (part.key, tuple((n, a.row_shape, a.dtype, a.codec, a.chunk_rows) for n, a in arrays.items()),
                       DOC in names)
                sink = sinks.get(sig)
                if sink is None:
                    sink = sinks[sig] = SampleSink(dst, part, arrays=arrays, doc=DOC in names,
                                                   summary=m.summary.split(": ", 1)[-1] if ": " in m.summary else "",
                                                   provenance={**m.provenance, "copied_from": seg})
                for j, p in enumerate(positions):
                    got = {n: rows[n][j] for n in names}
                    if sample_digest({n: chunk_digest(r) for n, r in got.items()}) != index["digests"][p]:
                        raise IntegrityError(f"sample {m.samples['keys'][p]} of segment {seg} in {src.url} does not "
                                             f"match its digest. {damage_fix(direction, seg, src.url)}", key=seg)
                    sink.add(index["upstream"][p], got)
                    result.bytes += sum(r.nbytes for r in got.values())
                    result.copied += 1
                    bar.update(1)
        for sink in sinks.values():
            sink.flush()
    finally:
        if bar is not None:
            bar.close()
    for sink in sinks.values():
        result.new_segments.extend(m.key for m in sink.committed)
    result.seconds = time.monotonic() - t0
    return result


def pull_samples(remote, local, wanted: dict[str, list[str]], *, progress: bool = True, jobs: int = 8,
                 offline: bool | None = None) -> SampleTransferResult:
    """Fetch the samples ``local`` lacks of each ``{partition: [sample keys]}`` from ``remote``."""
    remote.backend.check_offline(offline)
    local.backend.check_offline(offline)
    return _copy("pull", Store(remote.backend.for_untrusted_reads()), local, wanted, progress=progress, jobs=jobs)


def push_samples(local, remote, wanted: dict[str, list[str]], *, progress: bool = True, jobs: int = 8,
                 offline: bool | None = None) -> SampleTransferResult:
    """Copy the samples ``remote`` lacks of each ``{partition: [sample keys]}`` from ``local``."""
    remote.backend.check_offline(offline)
    local.backend.check_offline(offline)
    return _copy("push", local, remote, wanted, progress=progress, jobs=jobs)


def split_selection(store, keys: list[str]) -> tuple[dict[str, list[str]], list[str], list[str]]:
    """What a push or pull of artifact ``keys`` of ``store`` moves, by kind: the samples of the
    segments among them and those other artifacts name in ``sample_refs`` ({partition: [sample
    keys]}), the artifacts without ``sample_refs`` (moved whole, with their upstream chains when
    asked), and those with (moved alone: their upstream are sets of samples, not artifacts)."""
    wanted: dict[str, list[str]] = {}
    plain, referring = [], []
    for k in keys:
        m = store.manifest(k)
        if m.samples:
            wanted.setdefault(m.samples["partition"], []).extend(m.samples["keys"])
            continue
        (referring if m.sample_refs else plain).append(k)
        for ref in m.sample_refs or []:
            wanted.setdefault(ref["partition"], []).extend(ref["keys"])
    return {p: list(dict.fromkeys(ks)) for p, ks in wanted.items()}, plain, referring


def with_sample_upstream(store, wanted: dict[str, list[str]]) -> dict[str, list[str]]:
    """``wanted`` plus, transitively, every sample the wanted ones were made from (a hidden-state
    sample's tokens sample, its completion, its prompt; an eval sample's states), as far as
    ``store`` holds them (docs/format.md "References"). Reads each holding segment's samples
    document once; a damaged one is refused."""
    out = {p: list(dict.fromkeys(ks)) for p, ks in wanted.items()}
    seen = {p: set(ks) for p, ks in out.items()}
    todo = [(p, k) for p, ks in out.items() for k in ks]
    idx = index_of(store)
    docs: dict[str, list[str]] = {}
    while todo:
        by_part: dict[str, list[str]] = {}
        for p, k in todo:
            by_part.setdefault(p, []).append(k)
        todo = []
        for p, ks in by_part.items():
            where, segs = idx.partition(p), idx.segments(p)
            for k in ks:
                loc = where.get(k)
                if loc is None:
                    continue  # not here: the transfer reports it
                seg, pos = loc
                m = segs[seg]
                up = docs.get(seg)
                if up is None:
                    index = store.open(seg).json(INDEX)
                    problem = index_problem(m, index)
                    if problem:
                        raise IntegrityError(f"segment {seg} in {store.url} is corrupt: {problem}. Delete it "
                                             f"(`dfcache gc --key {seg[:12]} --force --yes`) or pull it again.", key=seg)
                    up = docs[seg] = index["upstream"]
                u = up[pos]
                for role, q in (m.samples.get("partition_upstream") or {}).items():
                    for qp in (q if isinstance(q, list) else [q]):
                        need = u if role == "sample" else sample_key(qp, u)
                        got = seen.setdefault(qp, set())
                        if need not in got:
                            got.add(need)
                            out.setdefault(qp, []).append(need)
                            todo.append((qp, need))
    return out


def transfer_selection(direction: str, src, dst, chosen: list[str], *, with_upstream: bool = True, jobs: int = 8,
                       progress: bool = False, offline: bool | None = None,
                       ) -> tuple[TransferResult, SampleTransferResult | None]:
    """What `dfcache push` and `pull` do with the artifacts ``chosen`` in ``src``: artifacts as
    they are (:func:`dfcache.transfer.push_keys`/``pull_keys``), segments by sample: only the
    samples ``dst`` lacks move (a source segment whole when all of its samples are wanted), so two
    stores that hold the same samples in other segments exchange nothing. ``direction`` is
    "push" or "pull" (``src`` is then read as untrusted by the caller)."""
    wanted, plain, referring = split_selection(src, chosen)
    if with_upstream and wanted:
        wanted = with_sample_upstream(src, wanted)
    copy = push_keys if direction == "push" else pull_keys
    copy_samples = push_samples if direction == "push" else pull_samples
    result = copy(src, dst, plain, with_upstream=with_upstream, progress=progress, jobs=jobs, offline=offline)
    if referring:  # made from samples: their upstream keys name sets of samples, moved below
        more = copy(src, dst, referring, with_upstream=False, progress=progress, jobs=jobs, offline=offline)
        result.transferred += more.transferred
        result.skipped += more.skipped
        result.files += more.files
        result.bytes += more.bytes
        result.seconds += more.seconds
    samples = copy_samples(src, dst, wanted, progress=progress, jobs=jobs, offline=offline) if wanted else None
    return result, samples


def compare_samples(local, remote, *, offline: bool | None = None) -> list[dict]:
    """Per partition (of either store): stage, samples only local, only in the remote, in both."""
    remote.backend.check_offline(offline)
    li, ri = index_of(local), index_of(remote)
    rows = []
    for p in sorted(set(li.partitions()) | set(ri.partitions())):
        mine, theirs = set(li.partition(p)), set(ri.partition(p))
        segs = li.segments(p) or ri.segments(p)
        stage = next(iter(segs.values())).stage if segs else None
        rows.append({"partition": p, "stage": stage, "only_local": len(mine - theirs),
                     "only_remote": len(theirs - mine), "both": len(mine & theirs)})
    return rows
