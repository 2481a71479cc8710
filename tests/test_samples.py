"""The sample layer: segments, the sample index, per-sample reads, transfer and gc references.

Real zarr stores on disk, real file:// remotes, real child processes for concurrent writers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from dfcache.errors import DependentsError, IntegrityError
from dfcache.keys import compute_key
from dfcache.maintenance import gc_plan
from dfcache.references import dependents, redundant_segments
from dfcache.sample_transfer import compare_samples, pull_samples, push_samples
from dfcache.samples import (Partition, SampleArray, SampleSet, SampleSink, SamplesMissingError, SegmentWriter,
                             index_of, record_digest, sample_key)
from dfcache.store import open_store

HIDDEN = {"hidden": SampleArray((16,), "bfloat16")}


def part(layer: int = 1, **extra) -> Partition:
    return Partition("hidden_states", 2, {"target": "a" * 32, "layer": layer, **extra})


def ups(n: int, start: int = 0) -> list[str]:
    return [record_digest({"prompt": f"p{i}"}) for i in range(start, start + n)]


def rows_of(u: str) -> np.ndarray:
    """Each sample's rows are a pure function of its upstream key (any process can check them)."""
    rng = np.random.default_rng(int(u[:8], 16))
    return rng.standard_normal((3 + int(u[8:10], 16) % 40, 16)).astype(ml_dtypes.bfloat16)


def write(store, p: Partition, upstream: list[str], arrays=HIDDEN, **kw) -> SampleSink:
    with SampleSink(store, p, arrays=arrays, **kw) as sink:
        for u in upstream:
            sink.add(u, {"hidden": rows_of(u)}, {"u": u})
    return sink


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint16), b.view(np.uint16))


def test_any_subset_superset_or_order_reads_every_cached_sample(tmp_path):
    store = open_store(tmp_path / "s")
    p = part()
    u = ups(10)
    sink = write(store, p, u[:7], max_samples=3)
    assert [len(m.samples["keys"]) for m in sink.committed] == [3, 3, 1]  # every 3 samples, then the rest
    again = open_store(tmp_path / "s")  # a new process: the index comes from the manifests alone
    idx = index_of(again)
    keys = p.sample_keys(u)
    assert idx.missing(p.key, keys) == keys[7:]
    order = [5, 0, 6, 2]
    ss = SampleSet(again, p.key, [keys[i] for i in order])
    for j, i in enumerate(order):
        assert same(ss.read(j, "hidden"), rows_of(u[i]))
        assert ss.doc(j) == {"u": u[i]}
        assert ss.upstream(j) == u[i]
    with pytest.raises(SamplesMissingError) as e:
        SampleSet(again, p.key, keys)
    assert e.value.missing == keys[7:]
    # another partition (another layer) shares nothing
    assert index_of(again).missing(part(2).key, part(2).sample_keys(u[:7])) == part(2).sample_keys(u[:7])


def test_sample_keys_derive_from_partition_and_upstream_only():
    p = part()
    u = ups(1)[0]
    assert p.sample_key(u) == sample_key(p.key, u)
    from dfcache.keys import canonical_encode
    import xxhash

    assert p.sample_key(u) == xxhash.xxh3_128_hexdigest(canonical_encode({"partition": p.key, "sample": u}))
    assert part(extra=1).sample_key(u) != p.sample_key(u)
    # prompt text that looks like a path is content, not refused key material
    assert len(record_digest({"messages": [{"role": "user", "content": "/etc/passwd: explain"}]})) == 32


def test_one_sample_read_opens_only_its_chunks(tmp_path):
    store = open_store(tmp_path / "s")
    p = part()
    u = sorted(ups(40))
    sink = write(store, p, u, max_samples=1000, arrays={"hidden": SampleArray((16,), "bfloat16", chunk_rows=16)})
    seg = sink.committed[0]
    chunk_rows = seg.arrays["hidden"].chunk_rows
    ss = SampleSet(store, p.key, p.sample_keys(u))
    a_seg, pos = ss.segment(20)
    a, b = a_seg.rows(pos, "hidden")
    mine = set(range(a // chunk_rows, (b - 1) // chunk_rows + 1))
    assert len(mine) < seg.arrays["hidden"].num_chunks
    root = Path(store.backend.root) / "artifacts" / seg.key[:2] / seg.key / "hidden" / "c"
    for i in range(seg.arrays["hidden"].num_chunks):
        if i not in mine:
            (root / str(i) / "0").write_bytes(b"garbage")  # any read of these chunks fails
    fresh = SampleSet(open_store(tmp_path / "s"), p.key, p.sample_keys(u))
    assert same(fresh.read(20, "hidden"), rows_of(u[20]))
    outside = next(i for i in range(40) if fresh.segment(i)[0].rows(fresh.segment(i)[1], "hidden")[0] // chunk_rows
                   not in mine)
    with pytest.raises(IntegrityError):
        fresh.read(outside, "hidden")


@pytest.mark.parametrize("rows", [40, 700])
@pytest.mark.parametrize("mapped", [True, False])
def test_side_by_side_read_is_each_parts_rows_in_its_columns(tmp_path, rows, mapped):
    from dfcache.samples import read_side_by_side

    store = open_store(tmp_path / "s")
    u = ups(3)
    rng = np.random.default_rng(rows)
    want, parts = [], []
    for layer, width in enumerate((1024, 1024, 512, 1536)):
        arrays = {"hidden": SampleArray((width,), "bfloat16", chunk_rows=256)}
        states = [rng.standard_normal((rows + i, width)).astype(ml_dtypes.bfloat16) for i in range(3)]
        with SampleSink(store, part(layer), arrays=arrays) as sink:
            for i in range(3):
                sink.add(u[i], {"hidden": states[i]})
        ss = SampleSet(open_store(tmp_path / "s"), part(layer).key, part(layer).sample_keys(u))
        parts.append(ss.segment(1))
        want.append(states[1])
    out = np.full((rows + 1, 4096), 7, dtype=np.uint16)
    got = read_side_by_side(parts, "hidden", out, mapped=mapped)
    assert got is out and same(out.view(ml_dtypes.bfloat16), np.concatenate(want, axis=1))
    with pytest.raises(Exception, match="4096 columns"):
        read_side_by_side(parts, "hidden", np.empty((rows + 1, 4000), np.uint16))
    # a damaged chunk in one part is an IntegrityError, not a torn result
    seg, pos = parts[3]
    first = seg.rows(pos, "hidden")[0] // 256
    chunk = Path(store.backend.root) / "artifacts" / seg.key[:2] / seg.key / "hidden" / "c" / str(first) / "0"
    chunk.write_bytes(b"garbage")
    fresh = [SampleSet(open_store(tmp_path / "s"), part(layer).key, part(layer).sample_keys(u)).segment(1)
             for layer in range(4)]
    with pytest.raises(IntegrityError):
        read_side_by_side(fresh, "hidden", out, mapped=mapped)


def test_overlapping_segments_read_deterministically_and_gc_drops_only_duplicates(tmp_path):
    store = open_store(tmp_path / "s")
    p = part()
    u = ups(12)
    first = write(store, p, u[:8], max_samples=4)  # two segments of 4
    second = write(store, p, u[2:6] + u[8:12], max_samples=100)  # overlaps both, adds 4
    third = write(store, p, u[4:8], max_samples=100)  # exactly the second of `first`: same key, one copy
    assert third.committed[0].key in {m.key for m in first.committed}
    keys = p.sample_keys(u)
    reads = []
    for _ in range(2):
        ss = SampleSet(open_store(tmp_path / "s"), p.key, keys)
        reads.append([ss.where[i][0] for i in range(12)])
        assert all(same(ss.read(i, "hidden"), rows_of(u[i])) for i in range(12))
    assert reads[0] == reads[1]
    # every sample is read from the smallest segment key holding it
    holders = {}
    for m in first.committed + second.committed:
        for k in m.samples["keys"]:
            holders.setdefault(k, []).append(m.key)
    assert reads[0] == [min(holders[k]) for k in keys]
    redundant = redundant_segments(store)
    plan = gc_plan(store, tmp=False, duplicates=True)
    assert {i.name for i in plan.items} == set(redundant)
    plan.execute(store)
    ss = SampleSet(open_store(tmp_path / "s"), p.key, keys)
    assert all(same(ss.read(i, "hidden"), rows_of(u[i])) for i in range(12))
    assert redundant_segments(open_store(tmp_path / "s")) == {}


def test_partial_pull_copies_only_missing_samples_verified(tmp_path):
    remote = open_store(tmp_path / "remote")
    p = part()
    u = ups(10)
    write(remote, p, u, max_samples=100)  # one remote segment of 10
    local = open_store(tmp_path / "local")
    write(local, p, u[:7])  # this machine has 7
    keys = p.sample_keys(u)
    rem = open_store(f"file://{tmp_path / 'remote'}")
    r = pull_samples(rem, local, {p.key: keys}, progress=False)
    assert (r.requested, r.present, r.copied, r.missing, r.whole_segments) == (10, 7, 3, [], [])
    assert len(r.new_segments) == 1
    new = local.manifest(r.new_segments[0])
    assert len(new.samples["keys"]) == 3 and local.verify(new.key) == []
    ss = SampleSet(open_store(tmp_path / "local"), p.key, keys)
    assert all(same(ss.read(i, "hidden"), rows_of(u[i])) for i in range(10))
    # nothing left to pull; a fresh machine takes the remote segment whole
    assert pull_samples(rem, local, {p.key: keys}, progress=False).copied == 0
    empty = open_store(tmp_path / "empty")
    r = pull_samples(rem, empty, {p.key: keys[2:]}, progress=False)  # 8 of 10: rows only
    assert r.copied == 8 and not r.whole_segments
    r = pull_samples(rem, empty, {p.key: keys}, progress=False)
    assert r.copied == 2
    other = open_store(tmp_path / "other")
    r = pull_samples(rem, other, {p.key: keys}, progress=False)
    assert len(r.whole_segments) == 1 and r.copied == 10 and not r.new_segments
    assert compare_samples(local, rem) == [{"partition": p.key, "stage": "hidden_states", "only_local": 0,
                                            "only_remote": 0, "both": 10}]
    # push the other way: the remote lacks 2 new samples
    more = ups(2, start=100)
    write(local, p, more)
    r = push_samples(local, rem, {p.key: p.sample_keys(u + more)}, progress=False)
    assert r.copied == 2 and r.present == 10


def test_pull_refuses_a_damaged_remote_sample_and_publishes_nothing(tmp_path):
    remote = open_store(tmp_path / "remote")
    p = part()
    u = sorted(ups(10))
    seg = write(remote, p, u, max_samples=100).committed[0]
    root = Path(remote.backend.root) / "artifacts" / seg.key[:2] / seg.key / "hidden" / "c" / "0" / "0"
    data = bytearray(root.read_bytes())
    data[5] ^= 0xFF
    root.write_bytes(bytes(data))
    local = open_store(tmp_path / "local")
    write(local, p, u[5:])
    before = sorted(local.keys())
    with pytest.raises(IntegrityError):
        pull_samples(open_store(f"file://{tmp_path / 'remote'}"), local, {p.key: p.sample_keys(u)}, progress=False)
    assert sorted(open_store(tmp_path / "local").keys()) == before


def test_verify_catches_a_segment_whose_partition_was_edited(tmp_path):
    store = open_store(tmp_path / "s")
    p = part()
    seg = write(store, p, ups(3)).committed[0]
    path = Path(store.backend.root) / "artifacts" / seg.key[:2] / seg.key / "manifest.json"
    doc = json.loads(path.read_text())
    doc["inputs"]["layer"] = 7  # claims another layer's states
    path.write_text(json.dumps(doc, sort_keys=True, indent=1))
    problems = open_store(tmp_path / "s").verify(seg.key)
    assert problems and "partition" in problems[0]


def test_gc_refuses_to_remove_samples_others_depend_on(tmp_path):
    store = open_store(tmp_path / "s")
    prompts = Partition("prompts", 2, {})
    u = ups(4)
    pseg = write(store, prompts, u).committed[0]
    tokens = Partition("tokens", 2, {"tok": "b" * 32}, upstream={"sample": prompts.key})
    tu = prompts.sample_keys(u)
    tseg = write(store, tokens, tu[:2]).committed[0]  # made from 2 of the 4 prompts
    hs = Partition("hidden_states", 2, {"layer": 1}, upstream={"sample": tokens.key})
    with SegmentWriter(store, hs, sorted(tokens.sample_keys(tu[:1])), arrays=HIDDEN) as w:
        w.add({"hidden": rows_of(u[0])})
    w_hs = w
    assert dependents(store, [pseg.key]) == {pseg.key: [tseg.key]}
    with pytest.raises(DependentsError) as e:
        gc_plan(store, tmp=False, keys=[pseg.key])
    assert tseg.key[:12] in e.value.message and "--force" in e.value.message
    # the same prompts in another segment: removing one copy loses nothing
    write(store, prompts, u[:2])
    assert dependents(open_store(tmp_path / "s"), [pseg.key]) == {}
    # a set-level artifact that names samples protects them
    report = compute_key("report", 1, {})
    with store.writer(report, stage="report", stage_version=1, inputs={}, summary="r",
                      sample_refs=[{"partition": tokens.key, "keys": tokens.sample_keys(tu[:1])}]) as w:
        w.put_json("x", {})
    assert dependents(store, [tseg.key]) == {tseg.key: sorted([w_hs.key, report])}  # states and report
    plan = gc_plan(store, tmp=False, keys=[tseg.key], force=True)
    assert [i.name for i in plan.items] == [tseg.key]


def test_cli_gc_names_dependents_and_exits_2(tmp_path):
    store = open_store(tmp_path / "s")
    prompts = Partition("prompts", 2, {})
    u = ups(2)
    pseg = write(store, prompts, u).committed[0]
    tokens = Partition("tokens", 2, {}, upstream={"sample": prompts.key})
    tseg = write(store, tokens, prompts.sample_keys(u)).committed[0]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    run = subprocess.run([sys.executable, "-m", "dfcache", "--store", str(tmp_path / "s"), "gc", "--key",
                          pseg.key[:12], "--yes"], capture_output=True, text=True, env=env)
    assert run.returncode == 2, run.stderr
    assert tseg.key[:12] in run.stderr and "Traceback" not in run.stderr
    assert open_store(tmp_path / "s").has(pseg.key)


CHILD = r"""
import sys, numpy as np
sys.path.insert(0, sys.argv[1])
from tests.test_samples import part, ups, write
from dfcache.store import open_store
lo, hi = int(sys.argv[3]), int(sys.argv[4])
write(open_store(sys.argv[2]), part(), ups(hi - lo, start=lo), max_samples=5)
print("done")
"""


def test_two_processes_writing_overlapping_sets_both_succeed(tmp_path):
    from cli_util import run_side_by_side  # here: the children import this module without tests/ on the path

    s = tmp_path / "s"
    open_store(s)
    run_side_by_side(CHILD, (s, 0, 30), (s, 10, 40))
    store = open_store(s)
    p = part()
    u = ups(40)
    ss = SampleSet(store, p.key, p.sample_keys(u))
    assert all(same(ss.read(i, "hidden"), rows_of(u[i])) for i in range(40))
    assert all(store.verify(k) == [] for k in store.keys())
    gc_plan(store, tmp=False, duplicates=True).execute(store)
    ss = SampleSet(open_store(s), p.key, p.sample_keys(u))
    assert all(same(ss.read(i, "hidden"), rows_of(u[i])) for i in range(40))


def test_an_artifact_made_from_samples_has_a_broken_chain_only_when_they_are_gone(tmp_path):
    from dfcache.maintenance import missing_upstream

    store = open_store(tmp_path / "s")
    p = part()
    u = ups(3)
    sink = write(store, p, u)
    keys = p.sample_keys(u)
    set_key = "c" * 32  # what a report's upstream names: a set of samples, not an artifact
    report = compute_key("report", 1, {}, {"evals": [set_key]})
    with store.writer(report, stage="report", stage_version=1, inputs={}, upstream={"evals": [set_key]},
                      sample_refs=[{"partition": p.key, "keys": keys}]) as w:
        w.put_json("report", {})
    assert missing_upstream(store, store.list_manifests()) == []
    store.delete(sink.committed[0].key)
    store = open_store(tmp_path / "s")
    [(m, what)] = missing_upstream(store, store.list_manifests())
    assert m.key == report and what == f"3 of 3 sample(s) of partition {p.key}"


def test_a_segment_whose_upstream_samples_are_gone_is_a_broken_chain_in_verify(tmp_path):
    """A hidden-states segment is made from tokens samples (its partition's upstream). Once gc
    --force removed those, verify warns of the broken chain (exit 0: the segment's own bytes are
    fine), as it does for an artifact whose upstream artifact is gone; before, it said nothing."""
    from cli_util import dfcache
    from dfcache.maintenance import missing_upstream

    root = tmp_path / "s"
    store = open_store(root)
    tokens = Partition("tokens", 1, {"t": 1})
    u = ups(4)
    with SampleSink(store, tokens, arrays={"ids": SampleArray((), "int32")}) as tsink:
        for x in u:
            tsink.add(x, {"ids": np.arange(5, dtype=np.int32)})
    hs = Partition("hidden_states", 2, {"layer": 1}, {"sample": tokens.key})
    write(store, hs, tokens.sample_keys(u))
    assert missing_upstream(store, store.list_manifests()) == []
    res = dfcache("verify", store=root)
    assert res.code == 0 and "BROKEN CHAIN" not in res.out
    store.delete(tsink.committed[0].key)
    store = open_store(root)
    [(m, what)] = missing_upstream(store, store.list_manifests())
    assert m.stage == "hidden_states" and what == f"4 of 4 upstream sample(s) of partition {tokens.key}"
    res = dfcache("verify", "--json", store=root)
    assert res.code == 0, res.err
    out = json.loads(res.out)
    assert out["bad"] == [] and [b["key"] for b in out["missing_upstream"]] == [m.key]
    assert "warning" in res.err and "Traceback" not in res.err
