"""Chunk files of one append written by several threads (DFCACHE_WRITE_THREADS): the same bytes
as one after the other, and a failed chunk write never named by a checkpoint."""

import os

import ml_dtypes
import numpy as np
import pytest

from dfcache.store import format as fmt
from dfcache.store import open_store
from dfcache.testing.store_conformance import _key

ROWS, COLS, CHUNK = 1000, 64, 32
STEPS = [37, 300, 64, 7, 1, 200, 391]  # across the fill buffer, whole chunks, many chunks at once


def _data():
    rng = np.random.default_rng(3)
    return rng.standard_normal((ROWS, COLS), dtype=np.float32).astype(ml_dtypes.bfloat16)


def _write(store, name, data, resumable=False):
    key = _key(name)
    w = store.writer(key, stage="conformance", stage_version=1, inputs={"i": name}, resumable=resumable)
    with w:
        aw = w.create_array("x", data.shape, "bfloat16", chunk_rows=CHUNK)
        big = w.create_array("big", (ROWS, 8), "float32", chunk_rows=CHUNK)  # rows given big-endian
        pos = 0
        for step in STEPS:
            aw.append(data[pos:pos + step])
            big.append(np.arange(pos * 8, (pos + step) * 8, dtype=">f4").reshape(-1, 8))
            pos += step
        assert aw.write_threads == int(os.environ["DFCACHE_WRITE_THREADS"])
    return w.manifest


def test_parallel_appends_write_the_same_bytes(tmp_path, monkeypatch):
    store = open_store(tmp_path / "store")
    data = _data()
    manifests = {}
    for n in ("1", "4"):
        monkeypatch.setenv("DFCACHE_WRITE_THREADS", n)
        manifests[n] = _write(store, f"threads-{n}", data)
    one, four = manifests["1"], manifests["4"]
    for name in ("x", "big"):
        assert four.arrays[name].chunk_digests == one.arrays[name].chunk_digests
        assert four.arrays[name].digest == one.arrays[name].digest
    root = tmp_path / "store" / "artifacts"
    files = sorted(store.backend.list_files(one.key))
    assert files == sorted(store.backend.list_files(four.key))
    for rel in files:
        if "/c/" in rel:
            assert (root / four.key[:2] / four.key / rel).read_bytes() == (root / one.key[:2] / one.key / rel).read_bytes()
    assert store.verify(four.key) == []
    assert store.open(four.key).array("x").read_raw().tobytes() == data.view(np.uint16).tobytes()


@pytest.mark.parametrize("threads", ["1", "4"])
def test_a_failed_chunk_write_keeps_the_last_checkpoint(tmp_path, monkeypatch, threads):
    """A chunk file that cannot be written (here: a directory where its file goes) fails the append
    that holds it; the checkpoint the failure would take is refused, so the next writer resumes
    from the last one, and the artifact it commits is whole. (Before 2026-12-06 that checkpoint
    named the failed chunk, whose file was never staged: the resumed writer published an
    artifact without it.)"""
    monkeypatch.setenv("DFCACHE_WRITE_THREADS", threads)
    store = open_store(tmp_path / "store")
    name = f"failed-put-{threads}"
    key = _key(name)
    data = _data()
    w = store.writer(key, stage="conformance", stage_version=1, inputs={"i": name}, resumable=True)
    aw = w.create_array("x", data.shape, "bfloat16", chunk_rows=CHUNK)
    aw.append(data[:256])
    w.checkpoint({"rows": 256})
    blocker = w._staging.path / (fmt.chunk_relpath("x", 13, 2) + ".part")  # inside the next append
    blocker.mkdir(parents=True)
    with pytest.raises(OSError):
        with w:
            aw.append(data[256:640])  # chunks 8..19
    blocker.rmdir()
    w2 = store.writer(key, stage="conformance", stage_version=1, inputs={"i": name}, resumable=True)
    assert w2.resumed and w2.state == {"rows": 256}
    with w2:
        aw2 = w2.create_array("x", data.shape, "bfloat16", chunk_rows=CHUNK)
        assert aw2.rows_written == 256
        aw2.append(data[256:])
    assert store.verify(key) == []
    assert store.open(key).array("x").read_raw().tobytes() == data.view(np.uint16).tobytes()
