"""What the reads and writes of one process share: thread pools (reader threads, page-cache
loaders, chunk encoders, a local store's background fsyncs; each made again in a forked child,
whose copy of a pool has no threads) and buffers reused across reads (large results, partial
chunks).

numpy is imported on first use (``np = LazyModule("numpy")``): opening a store needs none.
"""

from __future__ import annotations

import os
import threading

from .._lazy import LazyModule

np = LazyModule("numpy")

_pools: dict[str, tuple[int, object]] = {}
_pools_lock = threading.Lock()


def thread_pool(name: str, workers: int):
    """A process's thread pool ``name``, made again in a forked child (whose copy of the
    parent's pool has no threads: work handed to it would never run)."""
    pid = os.getpid()
    with _pools_lock:
        hit = _pools.get(name)
        if hit is None or hit[0] != pid:
            from concurrent.futures import ThreadPoolExecutor

            hit = _pools[name] = (pid, ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"dfcache-{name}"))
        return hit[1]


def write_threads() -> int:
    """Chunk files of one array written at once: ``$DFCACHE_WRITE_THREADS``, else 1 (one after the
    other on the appending thread). Opt-in: on an H200 host (16 cores) the extraction's store path
    alone wrote 94.7k, 86.9k, 82.7k and 100.0k tok/s with 1, 2, 4 and 8 threads a layer (medians of
    2, run to run 72k-104k; docs/benchmarks.md), and 1.00-1.07x on the 2-core VM: no gain measured,
    so the default keeps the one-thread writer. A file write is a copy into the page cache, without
    the GIL; fsyncs run apart (a staging area's background fsyncs)."""
    from ..config import write_threads as configured

    n = configured()
    return n if n is not None else 1


def write_pool(threads: int):
    """The threads that write chunk files for arrays of ``threads`` threads each (the appending
    thread is one of them): enough for 8 arrays at once (an extraction writes a layer an array,
    8 layers at a time); more arrays queue for them."""
    return thread_pool(f"write{threads}", min(64, 8 * (threads - 1)))


def fsync_pool():
    """The threads that fsync a local store's staged files in the background (a file's fsync is
    handed over once it is written; a checkpoint or a commit waits for them all): 4 per write
    thread, at least 8 (the count before 2026-12-06, kept for 1 and 2 write threads), at most 64.
    A thread waiting in fsync costs no core, and concurrent fsyncs keep the disk's queue full and
    let the filesystem join them in one journal commit. With 8, the extraction's store path wrote
    1.43 GB/s on an H200 host whose disk took 1.94 GB/s from 4 parallel fsync'd streams
    (docs/benchmarks.md); bench/gpu_extract.py's write-threads curve shows what more of both gives."""
    n = min(64, max(8, 4 * write_threads()))
    return thread_pool(f"fsync{n}", n)


class _Recycler:
    """Result buffers of large reads, handed out again once nothing refers to them.

    A fresh buffer of a few MB costs the kernel a page fault and a zeroed page per 4 KiB on its
    first write, about as much as reading the rows into it from the page cache. Each buffer
    handed out is a view of a pooled base array; every view, and every tensor or array made
    from one, keeps the base referenced, so a base whose reference count is back to the pool's
    own is unused and is filled again. Bases are anonymous maps (no hugepage advice: on the
    development VMs a read into a madvised, never-backed region was several times slower)."""

    KEEP = 6  # bases kept per process
    MAX_BYTES = 64 << 20  # larger results are plain allocations

    def __init__(self) -> None:
        self._bases: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray | None:
        """``nbytes`` bytes (uint8) nobody else holds, or None: allocate normally."""
        if nbytes > self.MAX_BYTES:
            return None
        import sys

        with self._lock:
            bases = self._bases
            best = None
            for i in range(len(bases)):
                # 2 = the list's reference and getrefcount's argument: no view of it is alive
                if bases[i].nbytes >= nbytes and sys.getrefcount(bases[i]) == 2 and (
                        best is None or bases[i].nbytes < bases[best].nbytes):
                    best = i
            if best is None:
                import mmap

                cap = -(-nbytes // (1 << 20)) * (1 << 20) or (1 << 20)
                base = np.frombuffer(mmap.mmap(-1, cap), dtype=np.uint8)
                if len(bases) >= self.KEEP:
                    free = [i for i in range(len(bases)) if sys.getrefcount(bases[i]) == 2]
                    if not free:
                        return base[:nbytes]  # all in use: this one is not kept
                    bases.pop(min(free, key=lambda i: bases[i].nbytes))
                bases.append(base)
                best = len(bases) - 1
            return bases[best][:nbytes]


_recycler = _Recycler()


def recycled_empty(shape: tuple, dtype) -> np.ndarray:
    """An uninitialised array like ``np.empty``, in a recycled buffer when it is large (see
    :class:`_Recycler`): for results handed to a caller who drops them before the next ones."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    buf = _recycler.take(nbytes) if nbytes >= (1 << 20) else None
    if buf is None:
        return np.empty(shape, dtype=dtype)
    return buf.view(dtype).reshape(shape)


_scratch_local = threading.local()


def scratch(nbytes: int) -> np.ndarray:
    """A per-thread buffer for partial chunk reads, reused: a fresh one costs its page faults."""
    buf = getattr(_scratch_local, "buf", None)
    if buf is None or buf.nbytes < nbytes:
        buf = _scratch_local.buf = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
    return buf[:nbytes]
