"""The local read path's guarantees: a large read split over reader threads returns the same
rows, result buffers are recycled only once nothing refers to them, and a chunk changed on disk
after this process checked it is checked again (plain and mapped reads)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from dfcache.errors import IntegrityError
from dfcache.store import _store, open_store

ROWS, WIDTH, CHUNK_ROWS = 1000, 512, 64  # uint16: 1 KiB rows, 64 KiB chunks, ~1 MB in all


def _array(tmp_path):
    store = open_store(tmp_path / "store")
    data = np.random.default_rng(0).integers(0, 1 << 16, (ROWS, WIDTH), dtype=np.uint16)
    key = "ab" * 16
    with store.writer(key, stage="t", stage_version=1, inputs={}) as w:
        w.write_array("x", data, dtype="uint16", chunk_rows=CHUNK_ROWS)
    return store, key, data


def _chunk_file(store, key: str, i: int):
    return store.backend.local_file_path(key, f"x/c/{i}/0")


@pytest.fixture
def split(monkeypatch):
    """Every read of more than one chunk split over 2 reader threads besides the caller, and
    every result recycled, whatever this machine's cores and the crc32c library."""
    monkeypatch.setattr(_store, "READ_SPLIT_BYTES", 0)
    monkeypatch.setattr(_store, "_read_workers", lambda: 2)
    monkeypatch.setattr(_store, "recycled_empty", _recycle_all)


def _recycle_all(shape, dtype):
    dtype = np.dtype(dtype)
    buf = _store._recycler.take(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
    return buf.view(dtype).reshape(shape)


def test_split_reads_return_the_rows_and_recycle_only_dropped_results(tmp_path, split):
    store, key, data = _array(tmp_path)
    arr = store.open(key).array("x")
    for a, b in ((0, ROWS), (5, 700), (63, 130), (200, 201)):
        assert np.array_equal(arr.read_raw(a, b), data[a:b])
    kept = arr.read_raw(10, 900)
    other = arr.read_raw(10, 900)  # while `kept` lives it is not written over
    assert not np.shares_memory(kept, other)
    assert np.array_equal(kept, data[10:900]) and np.array_equal(other, data[10:900])
    used = {kept.ctypes.data, other.ctypes.data}
    view = kept[3:7]  # a view keeps its buffer in use too
    del kept, other
    again = arr.read_raw(10, 900)
    assert again.ctypes.data in used and np.array_equal(view, data[13:17])


@pytest.mark.parametrize("mapped", [False, True])
@pytest.mark.parametrize("change", ["in place, just committed", "in place, remembered", "replaced"])
def test_a_chunk_changed_on_disk_is_checked_again_in_the_same_process(tmp_path, split, monkeypatch, mapped, change):
    store, key, data = _array(tmp_path)
    if change != "in place, just committed":  # checks remembered at once (the file counts as settled)
        monkeypatch.setattr(_store, "RACY_NS", -(1 << 62))
    arr = store.open(key).array("x")
    assert np.array_equal(arr.read_raw(0, ROWS, mapped=mapped), data)  # checked (and maybe remembered)
    path = _chunk_file(store, key, 9)  # read by a reader thread in a split read
    raw = bytearray(path.read_bytes())
    raw[10] ^= 0xFF
    if change == "replaced":
        tmp = path.with_name("new")
        tmp.write_bytes(bytes(raw))
        os.replace(tmp, path)
    else:
        st = os.stat(path)
        with open(path, "r+b") as f:
            f.write(bytes(raw))
        if change == "in place, remembered":  # a later tick: the timestamps move
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    with pytest.raises(IntegrityError, match="chunk 9 of array x .*crc32c"):
        arr.read_raw(0, ROWS, mapped=mapped)
    assert np.array_equal(arr.read_raw(0, 9 * CHUNK_ROWS, mapped=mapped), data[:9 * CHUNK_ROWS])
