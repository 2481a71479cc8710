"""Commit atomicity and concurrency of the local store, with real processes and SIGKILL."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from dfcache.maintenance import gc_plan
from dfcache.store import open_store
from dfcache.testing.store_conformance import _key, write_example

CHILD = str(Path(__file__).with_name("store_child.py"))


def _spawn(store_dir, first, count, rows=4000):
    return subprocess.Popen([sys.executable, CHILD, str(store_dir), str(first), str(count), str(rows)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_sigkill_at_random_instants_leaves_only_complete_artifacts(tmp_path):
    store_dir = tmp_path / "store"
    store = open_store(store_dir)
    rng = random.Random(1234)
    committed: set[str] = set()
    trials = 12
    for trial in range(trials):
        child = _spawn(store_dir, first=trial * 10, count=10)
        time.sleep(rng.uniform(0.3, 1.2))  # python start-up is ~0.3 s; writes follow
        child.send_signal(signal.SIGKILL)
        out, _ = child.communicate()
        committed |= {line.split()[1] for line in out.splitlines() if line.startswith("committed")}
        listed = {m.key for m in store.list_manifests()}
        assert committed <= listed, "an artifact the child reported committed is gone"
        for key in listed:
            assert store.verify(key) == [], f"trial {trial}: {key} is listed but not complete"
    # what crashes left behind is only temporaries, and gc removes them
    plan = gc_plan(store, tmp=True, grace_s=0)
    plan.execute(store, grace_s=0)
    assert not any((store_dir / "staging").iterdir())
    # a rerun completes and nothing committed earlier is lost
    child = _spawn(store_dir, first=0, count=3, rows=500)
    assert child.wait(60) == 0
    assert committed <= {m.key for m in store.list_manifests()}


def test_racing_processes_same_key_one_copy(tmp_path):
    store_dir = tmp_path / "store"
    open_store(store_dir)
    children = [_spawn(store_dir, first=5, count=1, rows=20000) for _ in range(4)]
    codes = [c.wait(120) for c in children]
    errs = [c.stderr.read() for c in children]
    assert codes == [0, 0, 0, 0], errs
    store = open_store(store_dir)
    assert [m.key for m in store.list_manifests()] == [_key(5)]
    assert store.verify(_key(5)) == []
    assert list((store_dir / "staging").iterdir()) == []


def test_gc_dry_run_changes_nothing_and_skips_live_writers(tmp_path):
    store = open_store(tmp_path / "store")
    write_example(store, i=1)
    # a crashed writer's leftover and a live writer's staging area
    crashed = store.backend.open_staging(_key(2))
    crashed.put("x/c/0/0", b"123")
    crashed._release()  # the process "died": its lock is gone
    live = store.writer(_key(3), stage="conformance", stage_version=1, inputs={"i": 3})
    live.write_array("x", np.zeros((10, 2), np.float32))
    before = sorted(str(p) for p in (tmp_path / "store").rglob("*"))
    plan = gc_plan(store, tmp=True, grace_s=0)
    assert [i.name for i in plan.items] == [f"staging/{crashed.path.name}"]
    assert sorted(str(p) for p in (tmp_path / "store").rglob("*")) == before
    assert plan.execute(store, grace_s=0) == [f"staging/{crashed.path.name}"]
    live.commit()
    assert store.has(_key(3)) and store.has(_key(1))


def test_resumable_writer_continues_after_a_crash(tmp_path):
    store = open_store(tmp_path / "store")
    key = _key("resume")
    data = np.random.default_rng(0).standard_normal((1000, 8)).astype(np.float32)
    w = store.writer(key, stage="conformance", stage_version=1, inputs={"i": "resume"}, resumable=True)
    aw = w.create_array("x", data.shape, "float32", chunk_rows=64)
    aw.append(data[:300])
    w.checkpoint({"done": 300})
    aw.append(data[300:500])  # not checkpointed: lost in the "crash"
    w._staging._release()
    del w
    w2 = store.writer(key, stage="conformance", stage_version=1, inputs={"i": "resume"}, resumable=True)
    assert w2.resumed and w2.state == {"done": 300}
    aw2 = w2.create_array("x", data.shape, "float32", chunk_rows=64)
    assert aw2.rows_written == 300
    aw2.append(data[300:])
    w2.commit()
    assert store.open(key).array("x")[:].tobytes() == data.tobytes()
    assert store.verify(key) == []
    assert not (tmp_path / "store" / "staging" / f"{key}.resume").exists()


def test_zarr_reads_what_we_write(tmp_path):
    import zarr

    store = open_store(tmp_path / "store")
    for codec in ("none", "zstd"):
        key, data = write_example(store, i=codec, rows=777, chunk_rows=100, codec=codec)
        group = zarr.open_group(str(tmp_path / "store" / "artifacts" / key[:2] / key), mode="r")
        assert np.array_equal(group["hidden"][:], data.view(np.uint16))
        assert group["hidden"].attrs["dfcache_dtype"] == "bfloat16"
        assert np.array_equal(group["ids"][:], np.arange(777, dtype=np.int32))


def test_fsync_and_rename_leave_no_partial_visible(tmp_path):
    """A directory in artifacts/ without a manifest (a partial manual copy) is not an artifact."""
    store = open_store(tmp_path / "store")
    key, _ = write_example(store, i=9)
    partial = tmp_path / "store" / "artifacts" / key[:2] / key
    (partial / "manifest.json").unlink()
    assert not store.has(key) and store.list_manifests() == []
    # writing the key again replaces the leftover
    write_example(store, i=9)
    assert store.verify(key) == []
    assert os.path.exists(partial / "manifest.json")
