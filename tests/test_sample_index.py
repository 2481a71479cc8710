"""The on-disk sample index (``<store>/index/samples/<partition>``): derived data that must always
agree with the segment manifests, whatever changed them (commits, concurrent writers, gc, pull,
an edited manifest) and whatever happened to the index file (missing, torn, corrupt, another
partition's). Every check compares a fresh reader with the truth parsed from the manifests."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cli_util import run_side_by_side

import dfcache.samples._index as samples_mod
from dfcache.maintenance import gc_plan
from dfcache.manifest import Manifest
from dfcache.sample_transfer import pull_samples
from dfcache.samples import SampleSet, index_of
from dfcache.store import open_store

from tests.test_samples import part, rows_of, same, ups, write


@pytest.fixture(autouse=True)
def index_small_partitions(monkeypatch):
    monkeypatch.setattr(samples_mod, "SAMPLE_INDEX_MIN", 0)  # the index is kept from 4,096 samples on


def truth(root: Path, partition: str) -> dict[str, tuple[str, int]]:
    """sample key -> (segment, position) straight from the manifests, the smallest segment key winning."""
    segs = {}
    for key, data in open_store(root).backend.iter_manifests():
        m = Manifest.from_json(data, expect_key=key)
        if m.samples and m.samples["partition"] == partition:
            segs[key] = m.samples["keys"]
    where = {}
    for key in sorted(segs, reverse=True):
        where.update({k: (key, i) for i, k in enumerate(segs[key])})
    return where


def fresh(root: Path, partition: str):
    """A new process's view: (sample key -> location, segments whose keys came from the index)."""
    idx = index_of(open_store(root))
    where = idx.partition(partition)
    return {k: where[k] for k in where}, idx.index_used


def index_file(root: Path, partition: str) -> Path:
    return root / "index" / "samples" / partition


def test_index_is_written_used_and_follows_commits(tmp_path):
    root, p = tmp_path / "s", part()
    u = ups(12)
    write(open_store(root), p, u[:8], max_samples=4)
    got, used = fresh(root, p.key)
    assert used == 0 and got == truth(root, p.key) and len(got) == 8
    assert index_file(root, p.key).is_file()
    got, used = fresh(root, p.key)
    assert used == 2 and got == truth(root, p.key)  # both segments' keys read from the index
    write(open_store(root), p, u[6:12], max_samples=100)  # a commit after the index: overlaps, adds 4
    got, used = fresh(root, p.key)
    assert used == 2 and got == truth(root, p.key) and len(got) == 12  # the new segment parsed, merged
    assert fresh(root, p.key) == (got, 3)
    ss = SampleSet(open_store(root), p.key, p.sample_keys(u))
    assert all(same(ss.read(i, "hidden"), rows_of(u[i])) for i in range(12))


CHILD = r"""
import sys
sys.path.insert(0, sys.argv[1])
import dfcache.samples._index as s
s.SAMPLE_INDEX_MIN = 0
from tests.test_samples import part, ups, write
from dfcache.store import open_store
lo, hi = int(sys.argv[3]), int(sys.argv[4])
write(open_store(sys.argv[2]), part(), ups(hi - lo, start=lo), max_samples=4)
s.index_of(open_store(sys.argv[2])).partition(part().key)  # and rewrite the index, racing the other
print("done")
"""


def test_concurrent_commits_both_end_up_in_the_index(tmp_path):
    root, p = tmp_path / "s", part()
    write(open_store(root), p, ups(4), max_samples=4)
    fresh(root, p.key)  # an index exists before the writers start
    run_side_by_side(CHILD, (root, 2, 20), (root, 10, 30))
    want = truth(root, p.key)
    assert len(want) == 30
    got, _ = fresh(root, p.key)
    assert got == want
    n_segments = len({seg for seg, _ in want.values()} | {m for m in truth_segments(root, p.key)})
    assert fresh(root, p.key) == (want, n_segments)  # settled: every segment now from the index


def truth_segments(root: Path, partition: str) -> list[str]:
    out = []
    for key, data in open_store(root).backend.iter_manifests():
        m = Manifest.from_json(data, expect_key=key)
        if m.samples and m.samples["partition"] == partition:
            out.append(key)
    return out


def test_index_follows_gc_and_pull(tmp_path):
    root, p = tmp_path / "s", part()
    u = ups(12)
    store = open_store(root)
    write(store, p, u[:8], max_samples=4)
    write(store, p, u[2:6] + u[8:12], max_samples=100)  # overlaps both: gc finds duplicates
    before, _ = fresh(root, p.key)
    gc_plan(open_store(root), tmp=False, duplicates=True).execute(open_store(root))
    after, _ = fresh(root, p.key)
    assert after == truth(root, p.key) and set(after) == set(before)
    assert {seg for seg, _ in after.values()} == set(truth_segments(root, p.key))  # no removed segment named
    ss = SampleSet(open_store(root), p.key, p.sample_keys(u))
    assert all(same(ss.read(i, "hidden"), rows_of(u[i])) for i in range(12))

    remote_root = tmp_path / "remote"
    more = ups(6, start=100)
    write(open_store(remote_root), p, more, max_samples=3)
    pull_samples(open_store(f"file://{remote_root}"), open_store(root), {p.key: p.sample_keys(more)}, progress=False)
    got, _ = fresh(root, p.key)
    assert got == truth(root, p.key) and set(p.sample_keys(more)) <= set(got)
    assert not index_file(remote_root, p.key).exists()  # a remote's index is never read nor written


@pytest.mark.parametrize("damage", ["missing", "torn", "flipped", "garbage", "other partition", "other code"])
def test_a_missing_or_damaged_index_is_rebuilt_never_trusted(tmp_path, damage):
    root, p, q = tmp_path / "s", part(), part(layer=2)
    write(open_store(root), p, ups(8), max_samples=4)
    write(open_store(root), q, ups(8, start=50), max_samples=4)
    want = truth(root, p.key)
    fresh(root, p.key), fresh(root, q.key)
    f = index_file(root, p.key)
    data = f.read_bytes()
    if damage == "missing":
        f.unlink()
    elif damage == "torn":
        f.write_bytes(data[:len(data) * 2 // 3])
    elif damage == "flipped":  # one bit of one key: the body no longer matches its checksum
        i = (data.index(b"\n") + len(data)) // 2
        f.write_bytes(data[:i] + bytes([data[i] ^ 1]) + data[i + 1:])
    elif damage == "garbage":
        f.write_bytes(os.urandom(len(data)))
    elif damage == "other partition":
        f.write_bytes(index_file(root, q.key).read_bytes())
    else:  # written by other code (another index version)
        nl = data.index(b"\n")
        head = json.loads(data[:nl])
        head["stamp"] = "0" * 16
        f.write_bytes(json.dumps(head).encode() + data[nl:])
    got, used = fresh(root, p.key)
    assert used == 0 and got == want
    assert fresh(root, p.key) == (want, 2)  # rebuilt


def test_a_manifest_changed_under_the_index_is_parsed_again(tmp_path):
    root, p = tmp_path / "s", part()
    write(open_store(root), p, ups(8), max_samples=4)
    fresh(root, p.key)
    key = sorted(truth_segments(root, p.key))[0]
    mf = root / "artifacts" / key[:2] / key / "manifest.json"
    doc = json.loads(mf.read_bytes())
    mf.write_text(json.dumps(doc, indent=3))  # the same manifest, other bytes (as a rewrite would give)
    got, used = fresh(root, p.key)
    assert used == 1 and got == truth(root, p.key)


def test_membership_is_exact_when_keys_share_their_high_half():
    from dfcache.samples import PartitionSamples

    hi = "0123456789abcdef"
    held = [hi + "0" * 16, hi + "f" * 16, "f" * 32, hi + "0" * 15 + "7"]
    asked = [hi + "f" * 16, hi + "0" * 15 + "1", "f" * 32, "e" * 32, hi + "0" * 15 + "7", "0" * 32, "F" * 32]
    ps = PartitionSamples({"s1": held[:2], "s2": held[2:]})
    assert ps.contains_many(asked).tolist() == [k in set(held) for k in asked]
    assert ps.contains_many([]).tolist() == []
    assert PartitionSamples({}).contains_many(asked).tolist() == [False] * len(asked)


def test_lacking_agrees_with_contains_many_below_and_above_the_index_size(monkeypatch):
    # Small partitions answer from their key set (a cached plan of a few samples imports no
    # numpy), large ones by the binary search: the same positions either way.
    import dfcache.samples._index as samples
    from dfcache.samples import PartitionSamples

    hi = "0123456789abcdef"
    held = [hi + "0" * 16, hi + "f" * 16, "f" * 32, hi + "0" * 15 + "7"]
    asked = [hi + "f" * 16, hi + "0" * 15 + "1", "f" * 32, "e" * 32, hi + "0" * 15 + "7", "0" * 32, "F" * 32, "f" * 32]
    want = [i for i, k in enumerate(asked) if k not in set(held)]
    for index_min in (samples.SAMPLE_INDEX_MIN, 1):
        monkeypatch.setattr(samples, "SAMPLE_INDEX_MIN", index_min)
        ps = PartitionSamples({"s1": held[:2], "s2": held[2:]})
        assert ps.lacking(asked) == want
        assert ps.lacking([]) == []
        assert PartitionSamples({}).lacking(asked) == list(range(len(asked)))


def test_sample_keys_memo_gives_the_keys_and_is_never_trusted_when_damaged(tmp_path, monkeypatch):
    import runner.core.sampling as sampling
    from dfcache.samples import distinct_keys, keys_as_bytes

    monkeypatch.setenv("DFCACHE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(sampling, "KEYS_MEMO_MIN", 1)
    monkeypatch.setattr(sampling, "KEYS_MEMO_KEEP", 3)
    p, u = part(), ups(50) + ups(3)  # a set may repeat a sample
    want = p.sample_keys(u)
    first, blob, distinct = sampling.sample_keys(p, u)
    assert first == want and blob == keys_as_bytes(want)
    assert distinct == b"".join(sorted({bytes.fromhex(k) for k in want}))  # sorted, each once
    files = list((tmp_path / "home" / "sample-keys").iterdir())
    assert len(files) == 1
    again, blob2, distinct2 = sampling.sample_keys(p, u)
    assert again == want and (blob2, distinct2) == (blob, distinct)  # from the memo
    # the upstream keys' bytes, when the caller has them, name the same entry
    assert sampling.sample_keys(p, u, keys_as_bytes(u)) == (want, blob, distinct)
    assert len(list((tmp_path / "home" / "sample-keys").iterdir())) == 1
    assert sampling.sample_keys(p, u[::-1])[0] == want[::-1]  # another order: another entry
    assert sampling.sample_keys(part(layer=2), u)[0] == part(layer=2).sample_keys(u)  # another partition
    data = files[0].read_bytes()
    for damaged in (data[:-1], data[:-16] + bytes(16), b"x" + data[1:], data.replace(b" 50 ", b" 49 ", 1)):
        files[0].write_bytes(damaged)
        assert sampling.sample_keys(p, u)[:2] == (want, blob)  # recomputed (and the memo rewritten)
    assert files[0].read_bytes() == data
    assert distinct_keys(blob) == distinct
    for k in range(4):
        sampling.sample_keys(p, u[k:])
    assert len(list((tmp_path / "home" / "sample-keys").iterdir())) == 3  # only the newest are kept
    odd = u[:-1] + ["not-a-key\nwith a newline"]  # not 32-character keys: never memoised
    assert sampling.sample_keys(p, odd) == (p.sample_keys(odd), None, None)


def test_lacking_with_the_keys_distinct_values_answers_as_the_search_does(monkeypatch):
    """A plan gives ``lacking`` the sorted distinct values of its keys (from the keys memo): a
    partition holding exactly those keys answers with one comparison; any other partition (more
    keys, fewer, other ones, a sample held by two segments) answers as the search does."""
    import dfcache.samples._index as samples
    from dfcache.samples import PartitionSamples, distinct_keys, keys_as_bytes

    held = [f"{i:032x}" for i in range(40)]
    asked = held[:30] + held[5:10]  # repeats
    cases = {"exactly": {"a": held[:15], "b": held[15:30]}, "more": {"a": held[:20], "b": held[20:]},
             "fewer": {"a": held[:12], "b": held[14:30]}, "twice": {"a": held[:20], "b": held[10:30]},
             "empty": {}}
    monkeypatch.setattr(samples, "SAMPLE_INDEX_MIN", 1)  # the search, not the set
    for name, segs in cases.items():
        ps = PartitionSamples(dict(segs))
        want = [i for i, k in enumerate(asked) if not any(k in v for v in segs.values())]
        q = keys_as_bytes(asked)
        assert ps.lacking(asked, q, distinct_keys(q)) == want, name
        assert ps.lacking(asked, q) == want, name
    assert PartitionSamples({}).lacking([], b"", b"") == []


def test_gc_removes_index_files_a_killed_writer_left_half_written(tmp_path):
    """An index is written to ``.<name>.<pid>.<hex>.tmp`` and renamed over the index file; a
    process killed between the two leaves the temporary. gc lists and removes it once it is older
    than the grace period, leaves a fresh one (a writer may be about to rename it) and the index
    itself alone, and the samples still read."""
    root, p = tmp_path / "s", part()
    u = ups(6)
    write(open_store(root), p, u, max_samples=3)
    fresh(root, p.key)  # writes the index file
    idx = index_file(root, p.key)
    assert idx.exists()
    stale = idx.with_name(f".{idx.name}.12345.{'ab' * 6}.tmp")
    young = idx.with_name(f".{idx.name}.12346.{'cd' * 6}.tmp")
    listing_tmp = root / "index" / f".snapshot.999.{'ef' * 6}.tmp"
    for f in (stale, young, listing_tmp):
        f.write_bytes(b"half an index")
    old = os.stat(idx).st_mtime - 3600
    os.utime(stale, (old, old))
    os.utime(listing_tmp, (old, old))
    plan = gc_plan(open_store(root))
    listed = {i.name for i in plan.items if i.kind == "temporary"}
    assert listed == {f"index/samples/{stale.name}", f"index/{listing_tmp.name}"}
    plan.execute(open_store(root))
    assert not stale.exists() and not listing_tmp.exists() and young.exists() and idx.exists()
    ss = SampleSet(open_store(root), p.key, p.sample_keys(u))
    assert all(same(ss.read(i, "hidden"), rows_of(u[i])) for i in range(6))


def test_a_plan_locates_samples_with_the_keys_memo_as_without_it(tmp_path, monkeypatch):
    """The graph's per-sample nodes carry the keys' sorted distinct values from the keys memo;
    locating them in a store whose partition holds exactly those samples, more, or fewer gives
    the positions that locating without the memo gives (a fresh store object each time: the
    partition's keys come from the on-disk sample index, as in a new process)."""
    from types import SimpleNamespace

    import runner.core.sampling as sampling
    from runner.core.graph import Node

    monkeypatch.setenv("DFCACHE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(samples_mod, "SAMPLE_INDEX_MIN", 1)
    u = ups(12)
    for name, held in (("exactly", u), ("more", u + ups(5, start=40)), ("fewer", u[2:9])):
        root = tmp_path / name
        write(open_store(root), part(), held, max_samples=5)
        got = {}
        for memo_min in (1, 10**9):  # with the memo (a fast path when exact), without it
            monkeypatch.setattr(sampling, "KEYS_MEMO_MIN", memo_min)
            node = Node.make_samples(part().stage, part().version, inputs=part().inputs, upstream_samples=u,
                                     partition_upstream=part().upstream, ids=[str(i) for i in range(12)],
                                     needs="cpu")
            assert (node.sample_key_distinct is not None) == (memo_min == 1)
            sampling.locate(SimpleNamespace(store=open_store(root), remotes=[]), node, warn=print)
            got[memo_min] = sorted(node.local)
        assert got[1] == got[10**9] == ([i for i in range(12) if u[i] in held]), name
