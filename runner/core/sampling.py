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
from dfcache.samples import Partition, index_of, keys_as_bytes, keys_from_bytes

__all__ = ["assign_demand", "locate", "sample_counts", "sample_keys", "set_key"]


# The sample keys of a large prompt set are kept in $DFCACHE_HOME/sample-keys/, as the prompt-set
# memo keeps its ids and digests: a repeated plan of 100,000 samples reads 1.6 MB per stage
# instead of hashing 100,000 keys. The name is an xxh3-128 of exactly what the keys derive from
# (the partition key and the upstream keys, in order; see dfcache.samples.sample_key), so a hit is
# the keys themselves; the file's checksum and count are checked, anything else is recomputed.
KEYS_MEMO_MIN = 5000
KEYS_MEMO_VERSION = 1
KEYS_MEMO_KEEP = 64  # files kept (the newest); each is 16 bytes a sample


def sample_keys(part: Partition, upstream: list[str]) -> tuple[list[str], bytes | None]:
    """``part``'s sample key of each upstream key, and the same as 16-byte values when memoised."""
    n = len(upstream)
    if n < KEYS_MEMO_MIN:
        return part.sample_keys(upstream), None
    joined = "\n".join(upstream)
    if len(joined) != 33 * n - 1 or joined.count("\n") != n - 1:
        return part.sample_keys(upstream), None  # not all 32-character keys: the name would not be exact
    from dfcache.config import dfcache_home

    name = xxhash.xxh3_128_hexdigest(f"{KEYS_MEMO_VERSION}\0{part.key}\0{n}\0{joined}".encode())
    memo = dfcache_home() / "sample-keys" / name
    blob = _read_keys_memo(memo, n)
    if blob is not None:
        return keys_from_bytes(blob), blob
    keys = part.sample_keys(upstream)
    blob = keys_as_bytes(keys)
    if blob is not None:
        _write_keys_memo(memo, blob)
    return keys, blob


def _read_keys_memo(memo, n: int) -> bytes | None:
    try:
        data = memo.read_bytes()
    except OSError:
        return None
    head, _, blob = data.partition(b"\n")
    if head != b"dfcache-sample-keys %d %d %s" % (KEYS_MEMO_VERSION, n, xxhash.xxh3_128_hexdigest(blob).encode()) \
            or len(blob) != 16 * n:
        return None
    return blob


def _write_keys_memo(memo, blob: bytes) -> None:
    import os

    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f".{memo.name}.{os.getpid()}.tmp")
        tmp.write_bytes(b"dfcache-sample-keys %d %d %s\n" % (KEYS_MEMO_VERSION, len(blob) // 16,
                                                           xxhash.xxh3_128_hexdigest(blob).encode()) + blob)
        os.replace(tmp, memo)
        kept = sorted(memo.parent.iterdir(), key=lambda p: p.stat().st_mtime_ns, reverse=True)
        for old in kept[KEYS_MEMO_KEEP:]:
            old.unlink(missing_ok=True)
    except OSError:
        pass  # only a speed-up


def make_partition(stage: str, version: int, inputs: dict, upstream: dict | None = None) -> Partition:
    return Partition(stage, version, inputs, dict(upstream or {}))


def locate(ctx, node, warn) -> None:
    """Where each of the node's samples is: sets ``node.local`` / ``node.in_remote`` (positions)
    and ``node.remote_of`` (sample key -> remote store)."""
    keys = node.sample_keys
    here = index_of(ctx.store).partition(node.partition.key)
    absent = here.lacking(keys, node.sample_key_bytes)  # of a large set, one binary search of them all
    node.local = set(range(len(keys)))
    if absent:
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
