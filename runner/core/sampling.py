"""Per-sample nodes: keys, where each sample is (local, a remote, nowhere), and what to produce.

Every per-sample node of one graph covers the same ordered prompt set: position i of the
prompts, completions, tokens, hidden-state and eval nodes is the same prompt. That makes demand
simple: walking the graph from its ends, a node must *produce* the positions its dependents
must produce (or, at an end, every position) that are in no store, and *pull* those that are only
in a remote. Samples nobody downstream needs are never fetched or computed (hidden states cached
for a prompt whose completion was removed need no completion), and a report that is already
stored needs nothing under it.
"""

from __future__ import annotations

import xxhash

from dfcache.errors import IntegrityError
from dfcache.keys import set_key  # noqa: F401  (the key of an ordered set of samples; public here too)
from dfcache.samples import Partition, distinct_keys, index_of, keys_as_bytes, keys_from_bytes

__all__ = ["assign_demand", "locate", "sample_counts", "sample_keys", "set_key"]


# The sample keys of a large prompt set are kept in $DFCACHE_HOME/sample-keys/, as the prompt-set
# memo keeps its ids and digests: a repeated plan of 100,000 samples reads 3.2 MB per stage
# instead of hashing 100,000 keys. The name is an xxh3-128 of exactly what the keys derive from
# (the partition key and the upstream keys as 16-byte values, in order; see
# dfcache.samples.sample_key), so a hit is the keys themselves; the file's checksum and counts are
# checked, anything else is recomputed. Beside the keys it holds their sorted distinct values
# (dfcache.samples.distinct_keys): a partition holding exactly those answers "all cached" with one
# comparison, no search and no numpy import (issue 36: 0.59 s of CPU for a plan of 100,000
# samples per stage on a busy 2-core machine, 0.1 s of it importing numpy for the searches).
KEYS_MEMO_MIN = 5000
KEYS_MEMO_VERSION = 2
KEYS_MEMO_KEEP = 64  # files kept (the newest); each is 32 bytes a sample


def sample_keys(part: Partition, upstream: list[str],
                upstream_bytes: bytes | None = None) -> tuple[list[str], bytes | None, bytes | None]:
    """``part``'s sample key of each upstream key, and, when memoised, the same as 16-byte values
    and their sorted distinct values. ``upstream_bytes``: the upstream keys as 16-byte values,
    when the caller has them (the upstream node's ``sample_key_bytes``)."""
    n = len(upstream)
    if n < KEYS_MEMO_MIN:
        return part.sample_keys(upstream), None, None
    if upstream_bytes is None or len(upstream_bytes) != 16 * n:
        upstream_bytes = keys_as_bytes(upstream)
    if upstream_bytes is None:
        return part.sample_keys(upstream), None, None  # not all 32-hex-digit keys: the name would not be exact
    from dfcache.config import dfcache_home

    name = xxhash.xxh3_128_hexdigest(b"%d\0%s\0%d\0" % (KEYS_MEMO_VERSION, part.key.encode(), n) + upstream_bytes)
    memo = dfcache_home() / "sample-keys" / name
    got = _read_keys_memo(memo, n)
    if got is not None:
        return keys_from_bytes(got[0]), got[0], got[1]
    keys = part.sample_keys(upstream)
    blob = keys_as_bytes(keys)
    if blob is None:
        return keys, None, None
    distinct = distinct_keys(blob)
    _write_keys_memo(memo, blob, distinct)
    return keys, blob, distinct


def _read_keys_memo(memo, n: int) -> tuple[bytes, bytes] | None:
    try:
        data = memo.read_bytes()
    except OSError:
        return None
    head, _, body = data.partition(b"\n")
    parts = head.split(b" ")
    if len(parts) != 5 or parts[:3] != [b"dfcache-sample-keys", b"%d" % KEYS_MEMO_VERSION, b"%d" % n] \
            or not parts[3].isdigit() or len(body) != 16 * (n + int(parts[3])) \
            or parts[4] != xxhash.xxh3_128_hexdigest(body).encode():
        return None
    return body[:16 * n], body[16 * n:]


def _write_keys_memo(memo, blob: bytes, distinct: bytes) -> None:
    import os

    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f".{memo.name}.{os.getpid()}.tmp")
        body = blob + distinct
        tmp.write_bytes(b"dfcache-sample-keys %d %d %d %s\n" % (KEYS_MEMO_VERSION, len(blob) // 16, len(distinct) // 16,
                                                               xxhash.xxh3_128_hexdigest(body).encode()) + body)
        os.replace(tmp, memo)
        kept = sorted(memo.parent.iterdir(), key=lambda p: p.stat().st_mtime_ns, reverse=True)
        for old in kept[KEYS_MEMO_KEEP:]:
            old.unlink(missing_ok=True)
    except OSError:
        pass  # only a speed-up


def make_partition(stage: str, version: int, inputs: dict, upstream: dict | None = None) -> Partition:
    return Partition(stage, version, inputs, dict(upstream or {}))


def locate(ctx, node, warn) -> None:
    """Where each of the node's samples is: ``node.local`` / ``node.in_remote`` (positions: sets,
    ``local`` a range when every sample is stored) and ``node.remote_of`` (sample key -> remote
    store)."""
    keys = node.sample_keys
    here = index_of(ctx.store).partition(node.partition.key)
    # Of a large set: one comparison when the partition holds exactly these keys, else one
    # binary search of them all.
    absent = here.lacking(keys, node.sample_key_bytes, node.sample_key_distinct)
    # All stored (a repeated plan): the positions as a range, not a set of 100,000 ints.
    node.local = range(len(keys))
    if absent:
        node.local = set(node.local)
        node.local.difference_update(absent)
    lacking = {keys[i] for i in absent}
    node.remote_of = {}
    for remote in ctx.remotes:
        if not lacking:
            break
        try:
            there = index_of(remote).partition(node.partition.key)
        except IntegrityError:
            raise  # a hostile or damaged remote segment of this partition: refused, never skipped
        except Exception as e:  # a remote that cannot be listed is not a reason to stop planning
            warn(f"warning: remote {getattr(remote, 'url', remote)} could not be checked: {e}")
            continue
        for k in [k for k in lacking if k in there]:
            node.remote_of[k] = remote
            lacking.discard(k)
    node.in_remote = ({i for i, k in enumerate(keys) if i not in node.local and k in node.remote_of}
                      if node.remote_of else set())


def assign_demand(nodes: list) -> None:
    """Give every per-sample node ``produce`` and ``pull`` (sorted positions) from what its
    dependents need; ``nodes`` in dependency order. Set-level nodes with a status other than
    cached/remote demand every position of their per-sample dependencies."""
    demand: dict[str, set[int]] = {}
    depended_on = {d.key for n in nodes for d in n.deps}
    for n in reversed(nodes):
        if n.partition is None:
            if n.status not in ("cached", "remote"):  # it will be made from all of its samples
                for d in n.deps:
                    if d.partition is not None:
                        demand.setdefault(d.key, set()).update(range(len(d.sample_keys)))
            continue
        if len(n.local) == len(n.sample_keys):  # all stored here: nothing to pull or make
            n.pull, n.produce = [], []
            continue
        wanted = demand.get(n.key, set())
        if n.key not in depended_on:
            wanted = set(range(len(n.sample_keys)))
        n.pull = sorted(wanted & n.in_remote)
        n.produce = sorted(wanted - n.local - n.in_remote)
        for d in n.deps:
            if d.partition is not None:
                demand.setdefault(d.key, set()).update(n.produce)


def sample_counts(n) -> dict:
    total = len(n.sample_keys)
    cached = len(n.local)
    remote = len(n.in_remote)
    return {"total": total, "cached": cached, "remote": remote, "missing": total - cached - remote,
            "to_pull": len(n.pull), "to_produce": len(n.produce)}
