"""Races between real processes on one local store: many writers of one key, many keys at once,
`dfcache gc --yes` in a loop while writers commit, readers verifying everything they see.

Each test asserts: every process exits 0, exactly one copy of each key, every listed artifact
is complete and holds exactly its spec's bytes, and nothing is left in staging.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from children import check_artifact, key_of
from test_crash import resumable_spec, store_is_sound

from dfcache.store import open_store


def spec(i: int, rows: int = 3000, cols: int = 32, chunk_rows: int = 256, **kw) -> dict:
    return {"i": i, "rows": rows, "cols": cols, "chunk_rows": chunk_rows, "dtype": "bfloat16", "codec": "none", **kw}


def one_copy_each(store, keys: set[str]) -> None:
    dirs = sorted(p.name for p in (store / "artifacts").glob("*/*"))
    assert sorted(dirs) == sorted(keys), f"artifact directories {dirs} != keys {sorted(keys)}"
    leftovers = [p.name for p in (store / "staging").iterdir() if not p.name.endswith(".deleted")]
    assert leftovers == [], f"staging leftovers: {leftovers}"


def run_all(zygote, procs, timeout: float = 180.0) -> None:
    for name, child in procs:
        code = child.wait(timeout)
        assert code == 0, f"{name} exited {code}:\n{child.err[-3000:]}"


def readers(zygote, store, specs, seconds: float, n: int = 2):
    return [(f"reader{r}", zygote.spawn("children:reader_job", store, str(seconds), json.dumps(specs),
                                        name=f"reader{r}")) for r in range(n)]


def test_eight_processes_write_the_same_artifact(zygote, fast_tmp, figures):
    store = fast_tmp / "store"
    open_store(store)
    s = spec(1, rows=20000, chunk_rows=512)
    start = time.time() + 0.5
    job = json.dumps({"artifacts": [s], "start_at": start})
    procs = [(f"writer{w}", zygote.spawn("children:writer_job", store, job, name=f"same{w}")) for w in range(8)]
    procs += readers(zygote, store, [s], seconds=2.0)
    run_all(zygote, procs)
    one_copy_each(store, {key_of(s)})
    assert check_artifact(open_store(store), s) == []
    store_is_sound(zygote, store, {key_of(s)}, {key_of(s)}, "same key")
    figures.record("race_same_key", writers=8, readers=2)


def test_eight_processes_write_different_artifacts(zygote, fast_tmp, figures):
    store = fast_tmp / "store"
    open_store(store)
    specs = [spec(100 + w, rows=6000) for w in range(8)]
    start = time.time() + 0.5
    procs = [(f"writer{w}", zygote.spawn("children:writer_job", store,
                                         json.dumps({"artifacts": [specs[w]], "start_at": start}), name=f"diff{w}"))
             for w in range(8)]
    procs += readers(zygote, store, specs, seconds=2.0)
    run_all(zygote, procs)
    keys = {key_of(s) for s in specs}
    one_copy_each(store, keys)
    s = open_store(store)
    assert all(check_artifact(s, sp) == [] for sp in specs)
    store_is_sound(zygote, store, keys, keys, "different keys")
    figures.record("race_different_keys", writers=8, readers=2)


def test_processes_creating_one_new_store_at_once_all_open_it(zygote, fast_tmp, figures):
    """torchrun ranks given a --store that does not exist yet all create it at once: each must
    open it, none may take another's half-made store for a foreign directory (CI saw rank 1 fail
    with "exists and is not a dfcache store" while rank 0 was between its mkdir and its marker)."""
    rounds, n = 30, 6
    stores = [str(fast_tmp / f"new{r}" / "store") for r in range(rounds)]
    start = time.time() + 0.5
    at = [start + 0.02 * r for r in range(rounds)]
    procs = [(f"opener{w}", zygote.spawn("children:new_store_job", json.dumps(stores), json.dumps(at),
                                         name=f"new{w}")) for w in range(n)]
    run_all(zygote, procs)
    for _, c in procs:
        assert c.out.count("O ") == rounds
    for path in stores:
        s = open_store(path, create=False)
        assert s.keys() == []
        assert sorted(p.name for p in Path(path).iterdir()) == ["artifacts", "dfcache-store.json", "locks", "staging"]
    figures.record("race_new_store", openers=n, stores=rounds)


@pytest.mark.parametrize("grace", ["60", "0"], ids=["gc-default-grace", "gc-grace-0"])
def test_gc_in_a_loop_while_writers_commit(zygote, fast_tmp, stress, figures, grace):
    """`dfcache gc --yes` again and again while 4 writers commit (2 of them writing the same
    keys) and 2 readers verify; with --grace 0 gc even considers brand-new staging areas."""
    store = fast_tmp / "store"
    open_store(store)
    per = 12 if stress else 5
    specs = [spec(200 + i, rows=1500 + 250 * (i % 4), chunk_rows=128, codec="zstd" if i % 3 == 0 else "none")
             for i in range(3 * per)]
    jobs = [specs[0:per], specs[per:2 * per], specs[2 * per:3 * per], specs[0:per]]  # the last races the first
    seconds = 30.0 if stress else 6.0
    gc = zygote.spawn("children:gc_loop", store, str(seconds), "--grace", grace, name="gcloop")
    procs = [(f"writer{w}", zygote.spawn("children:writer_job", store, json.dumps({"artifacts": job, "slow_fsync": 0.001}),
                                         name=f"gcw{w}")) for w, job in enumerate(jobs)]
    procs += readers(zygote, store, specs, seconds=seconds)
    procs.append(("gc loop", gc))
    run_all(zygote, procs)
    runs = int(next(line.split()[1] for line in gc.out.splitlines() if line.startswith("GC")))
    keys = {key_of(s) for s in specs}
    one_copy_each(store, keys)
    s = open_store(store)
    assert all(check_artifact(s, sp) == [] for sp in specs)
    store_is_sound(zygote, store, keys, keys, f"gc grace {grace}")
    reads = [int(line.split()[1]) for _, c in procs if c.out.startswith("READS") for line in c.out.splitlines()]
    figures.record(f"race_gc_loop_grace_{grace}", writers=4, readers=2, gc_runs=runs, artifacts=len(keys),
                   artifact_reads=sum(reads))
    assert runs >= 3


def test_resumable_writers_of_one_key_serialise(zygote, fast_tmp, figures):
    """8 resumable writers of one key (as 8 `run hidden-states` of one layer would be) plus a
    `gc --grace 0` loop: they take turns on the key lock; one commits, the others find it done."""
    store = fast_tmp / "store"
    open_store(store)
    import random

    s = resumable_spec(random.Random(3), 900)
    s["slow"] = 0.0
    gc = zygote.spawn("children:gc_loop", store, "4", "--grace", "0", name="gcres")
    procs = [(f"resumable{w}", zygote.spawn("children:resumable_job", store, json.dumps(s), name=f"ser{w}"))
             for w in range(8)]
    procs += readers(zygote, store, [s], seconds=4.0)
    procs.append(("gc loop", gc))
    run_all(zygote, procs)
    outs = [c.out for name, c in procs if name.startswith("resumable")]
    committed = [o for o in outs if "\nD " in "\n" + o]
    already = [o for o in outs if o.startswith("H ")]
    assert len(committed) + len(already) == 8
    assert len(committed) >= 1
    one_copy_each(store, {key_of(s)})
    assert check_artifact(open_store(store), s) == []
    figures.record("race_resumable_same_key", writers=8, committed_by=len(committed), found_done=len(already))
