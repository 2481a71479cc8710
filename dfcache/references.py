"""What references what in a store, so that `gc` never removes something others depend on.

Three kinds of reference, all read from manifests (and, for segments, their samples documents):

* an artifact's ``upstream`` keys (a report names its evals);
* an artifact's ``sample_refs``: the samples it was made from, by partition;
* a sample's upstream: a sample of a partition whose upstream role ``"sample"`` is partition Q
  needs its upstream sample in Q; for every other role Q' it needs the sample of Q' made from
  the same upstream key (see dfcache/samples/).

Removing segments loses only the samples no other (kept) segment holds. A segment all of whose
samples are read from other segments (a duplicate left by overlapping writers) loses nothing.
"""

from __future__ import annotations

from .manifest import Manifest
from .samples import INDEX, index_problem, sample_key

__all__ = ["dependents", "redundant_segments"]


def _segments_by_partition(manifests: list[Manifest]) -> dict[str, list[Manifest]]:
    out: dict[str, list[Manifest]] = {}
    for m in manifests:
        if m.samples:
            out.setdefault(m.samples["partition"], []).append(m)
    return out


def redundant_segments(store, manifests: list[Manifest] | None = None) -> dict[str, str]:
    """Segments none of whose samples are read from them: segment key -> where its samples are."""
    manifests = store.list_manifests() if manifests is None else manifests
    out = {}
    for segs in _segments_by_partition(manifests).values():
        if len(segs) < 2:
            continue
        winner: dict[str, str] = {}
        for m in sorted(segs, key=lambda m: m.key):
            for k in m.samples["keys"]:
                winner.setdefault(k, m.key)
        for m in segs:
            held = {winner[k] for k in m.samples["keys"]}
            if m.key not in held:
                out[m.key] = ", ".join(sorted(h[:12] for h in held))
    return out


def _upstream_of(store, m: Manifest) -> list[str] | None:
    try:
        index = store.open(m.key).json(INDEX)
    except Exception:
        return None
    return None if index_problem(m, index) else index["upstream"]


def dependents(store, removing: list[str], manifests: list[Manifest] | None = None) -> dict[str, list[str]]:
    """For each key of ``removing``, the kept artifacts that depend on it (empty lists left out)."""
    manifests = store.list_manifests() if manifests is None else manifests
    gone = set(removing)
    by_key = {m.key: m for m in manifests}
    found: dict[str, set[str]] = {}
    kept = [m for m in manifests if m.key not in gone]
    for m in kept:
        for up in m.upstream_keys:
            if up in gone:
                found.setdefault(up, set()).add(m.key)
    # Samples that nothing kept would hold any more: partition -> {sample key: segment removed}.
    lost: dict[str, dict[str, str]] = {}
    segs = _segments_by_partition(manifests)
    for p, ms in segs.items():
        removed = [m for m in ms if m.key in gone]
        if not removed:
            continue
        still = set()
        for m in ms:
            if m.key not in gone:
                still.update(m.samples["keys"])
        for m in removed:
            for k in m.samples["keys"]:
                if k not in still:
                    lost.setdefault(p, {})[k] = m.key
    if not lost:
        return {k: sorted(v) for k, v in found.items()}
    for m in kept:
        for ref in m.sample_refs or []:
            hit = lost.get(ref["partition"])
            if hit:
                for k in ref["keys"]:
                    if k in hit:
                        found.setdefault(hit[k], set()).add(m.key)
        if not m.samples:
            continue
        roles = m.samples.get("partition_upstream") or {}
        needs = [(role, q) for role, v in roles.items() for q in (v if isinstance(v, list) else [v]) if q in lost]
        if not needs:
            continue
        upstream = _upstream_of(store, m)
        if upstream is None:
            continue  # a damaged segment protects nothing; verify reports it
        for role, q in needs:
            hit = lost[q]
            for u in upstream:
                k = u if role == "sample" else sample_key(q, u)
                if k in hit:
                    found.setdefault(hit[k], set()).add(m.key)
    return {k: sorted(v) for k, v in found.items() if k in by_key or k in gone}
