"""The local read path's guarantees: a large read split over reader threads returns the same
rows, result buffers are recycled only once nothing refers to them, and a chunk changed on disk
after this process checked it is checked again (plain and mapped reads)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from dfcache.errors import IntegrityError
from dfcache.store import _pools, _reader, open_store

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
    monkeypatch.setattr(_reader, "READ_SPLIT_BYTES", 0)
    monkeypatch.setattr(_reader, "_read_workers", lambda: 2)
    monkeypatch.setattr(_reader, "recycled_empty", _recycle_all)


def _recycle_all(shape, dtype):
    dtype = np.dtype(dtype)
    buf = _pools._recycler.take(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
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


def test_the_buffer_recycled_is_the_free_one_taken_last():
    """A result buffer goes again to the free base taken most recently (its lines likely still
    cached), whatever its size, never to one still referred to; none large enough: a new one."""
    r = _pools._Recycler()
    mib = 1 << 20
    a, b = r.take(2 * mib), r.take(3 * mib)
    base_of = {a.ctypes.data: "a", b.ctypes.data: "b"}
    del a, b  # b was taken last
    c = r.take(mib)
    assert base_of.get(c.ctypes.data) == "b"
    d = r.take(mib)  # b's base is c's: the other one
    assert base_of.get(d.ctypes.data) == "a"
    e = r.take(4 * mib)  # neither is free (nor large enough)
    assert e.ctypes.data not in base_of and len(e) == 4 * mib
    del c, d, e
    assert r.take(4 * mib).ctypes.data not in base_of  # the 4 MiB base, taken last


@pytest.mark.parametrize("mapped", [False, True])
@pytest.mark.parametrize("change", ["in place, just committed", "in place, remembered", "replaced"])
def test_a_chunk_changed_on_disk_is_checked_again_in_the_same_process(tmp_path, split, monkeypatch, mapped, change):
    store, key, data = _array(tmp_path)
    if change != "in place, just committed":  # checks remembered at once (the file counts as settled)
        monkeypatch.setattr(_reader, "RACY_NS", -(1 << 62))
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


def _evict(paths) -> bool:
    """Drop the files' pages from the page cache; False where this file system keeps them."""
    from dfcache.store import _pagecache

    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            missing = _pagecache.missing_pages(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        if not missing:
            return False
    return True


def _missing(paths) -> list[int]:
    from dfcache.store import _pagecache

    out = []
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            out.append(_pagecache.missing_pages(fd, os.fstat(fd).st_size))
        finally:
            os.close(fd)
    return out


@pytest.fixture
def cold_capable():
    from dfcache.store import _pagecache

    if not hasattr(os, "posix_fadvise") or not _pagecache.available():
        pytest.skip("no cachestat here (Linux 6.5+): cold files are read with plain read-ahead")


@pytest.mark.parametrize("how", ["read_raw", "split", "mapped", "prefetch", "plain read-ahead"])
def test_a_cold_read_loads_the_missing_files_and_returns_the_rows(tmp_path, cold_capable, monkeypatch, how):
    from dfcache.store import _pagecache

    store, key, data = _array(tmp_path)
    if how == "split":
        monkeypatch.setattr(_reader, "READ_SPLIT_BYTES", 0)
        monkeypatch.setattr(_reader, "_read_workers", lambda: 2)
    arr = store.open(key).array("x")
    n_chunks = -(-ROWS // CHUNK_ROWS)
    files = [_chunk_file(store, key, i) for i in range(n_chunks)]
    assert np.array_equal(arr.read_raw(0, ROWS), data)  # checked while warm
    if not _evict(files):
        pytest.skip("this file system keeps evicted pages (tmpfs?)")
    if how == "plain read-ahead":
        monkeypatch.setattr(_pagecache, "ENABLED", False)
    if how == "prefetch":
        arr.prefetch(100, 700)  # returns at once; the loader threads bring the files in
        want = range(100 // CHUNK_ROWS, 699 // CHUNK_ROWS + 1)
        import time

        deadline = time.monotonic() + 30
        while any(_missing([files[i] for i in want])) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _missing([files[i] for i in want]) == [0] * len(want)
        assert np.array_equal(arr.read_raw(100, 700), data[100:700])
        return
    got = arr.read_raw(5, ROWS - 7, mapped=how == "mapped")
    assert np.array_equal(got, data[5:ROWS - 7])
    monkeypatch.setattr(_pagecache, "ENABLED", True)
    if how != "plain read-ahead":  # (plain read-ahead may stop short of a file's tail)
        assert _missing(files) == [0] * n_chunks


@pytest.mark.parametrize("mapped", [False, True])
def test_a_truncated_chunk_read_cold_is_an_integrity_error(tmp_path, cold_capable, mapped):
    """The loader maps the size a chunk file must have: a shorter file fails the read's check
    (an IntegrityError naming the chunk), never a bus error from the mapping."""
    store, key, data = _array(tmp_path)
    path = _chunk_file(store, key, 3)
    os.truncate(path, os.path.getsize(path) - 4096)
    if not _evict([_chunk_file(store, key, i) for i in range(2, 5)]):
        pytest.skip("this file system keeps evicted pages (tmpfs?)")
    arr = store.open(key).array("x")
    with pytest.raises(IntegrityError, match="chunk 3 of array x"):
        arr.read_raw(2 * CHUNK_ROWS, 5 * CHUNK_ROWS, mapped=mapped)
    assert np.array_equal(arr.read_raw(0, 3 * CHUNK_ROWS, mapped=mapped), data[:3 * CHUNK_ROWS])


def test_pagecache_counts_missing_pages_and_loads_them(tmp_path, cold_capable):
    from dfcache.store import _pagecache

    path = tmp_path / "f"
    path.write_bytes(os.urandom(3 * 4096 + 10))
    size = os.path.getsize(path)
    assert _missing([path]) == [0]  # just written
    if not _evict([path]):
        pytest.skip("this file system keeps evicted pages (tmpfs?)")
    assert _missing([path]) == [4]
    fd = os.open(path, os.O_RDONLY)
    try:
        assert _pagecache.load_large(fd, size) in (True, False)  # False: no THP here; the pages come anyway
        assert _pagecache.missing_pages(fd, size) == 0
        assert _pagecache.load_large(fd, 0) is False and _pagecache.load_large(-1, size) is False
    finally:
        os.close(fd)


@pytest.mark.parametrize("where", ["before the rows", "in the rows", "after the rows", "the last chunk's padding",
                                   "truncated", "one byte longer"])
def test_a_read_of_part_of_a_chunk_checks_the_whole_chunk(tmp_path, monkeypatch, where):
    """A first read of some rows of a chunk reads them straight into the result and the rest
    aside, and checks the whole chunk: a byte changed anywhere in it (or a file of another size)
    is refused, rows asked for or not; the rows of intact chunks read as written, at any place."""
    monkeypatch.setattr(_reader, "_read_workers", lambda: 0)
    store, key, data = _array(tmp_path)
    arr = store.open(key).array("x")
    last = (ROWS - 1) // CHUNK_ROWS  # 15: rows 960..999 of 64, the rest padding
    index, (a, b) = (last, (970, 990)) if where == "the last chunk's padding" else (3, (3 * 64 + 10, 3 * 64 + 20))
    path = _chunk_file(store, key, index)
    raw = bytearray(path.read_bytes())
    row = WIDTH * 2
    at = {"before the rows": 2 * row, "in the rows": 15 * row, "after the rows": 40 * row,
          "the last chunk's padding": 45 * row}.get(where)
    if at is not None:
        raw[at] ^= 0xFF
    elif where == "truncated":
        raw = raw[:-100]
    else:
        raw += b"\0"
    path.write_bytes(bytes(raw))
    if where == "the last chunk's padding":  # padding is not key material: the rows still read
        assert np.array_equal(arr.read_raw(a, b), data[a:b])
    else:
        with pytest.raises(IntegrityError, match=f"chunk {index} of array x"):
            arr.read_raw(a, b)
    fresh = open_store(tmp_path / "store").open(key).array("x")
    for lo, hi in ((0, 1), (5, 64), (64, 70), (100, 190), (ROWS - 7, ROWS), (960, 1000)):
        if hi <= index * CHUNK_ROWS or lo >= (index + 1) * CHUNK_ROWS or where == "the last chunk's padding":
            assert np.array_equal(fresh.read_raw(lo, hi), data[lo:hi]), (lo, hi)  # the other chunks


def test_populate_write_makes_shared_pages_present_and_keeps_them_writable():
    """A DataLoader worker's item memory is populated in one call before its rows are copied
    in; the memory stays ordinary shared memory: zeros until written, writes seen through any
    mapping of it. Refused (False) only where the system lacks the call, never an error."""
    import ctypes
    import mmap

    from dfcache.store import _pagecache, populate_write

    size = 3 * mmap.PAGESIZE + 100
    fd = os.memfd_create("dfcache-test") if hasattr(os, "memfd_create") else None
    if fd is None:
        pytest.skip("no memfd here")
    try:
        os.ftruncate(fd, size)
        a, b = mmap.mmap(fd, size), mmap.mmap(fd, size)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(a)) + 17  # not page-aligned: the pages around it
        ok = populate_write(addr, size - 17)
        assert ok or not _pagecache.available()
        assert a[:] == bytes(size)
        a[size - 5:] = b"rows!"
        assert b[size - 5:] == b"rows!"
        assert populate_write(addr, 0) is False
    finally:
        os.close(fd)
