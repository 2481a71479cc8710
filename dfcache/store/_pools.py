"""What the reads and writes of one process share: thread pools (reader threads, page-cache
loaders, chunk encoders, a local store's background fsyncs; each made again in a forked child,
whose copy of a pool has no threads) and buffers reused across reads (large results, partial
chunks).

numpy is imported on first use (``np = LazyModule("numpy")``): opening a store needs none.
"""

from __future__ import annotations

import math
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
    handed over once it is written; a checkpoint or a commit waits for them all): 32, or 4 per
    write thread, at most 64. A thread waiting in fsync costs no core, and concurrent fsyncs keep
    the disk's queue full and let the filesystem join them in one journal commit. Measured on an
    H100 host (bench/results/gpu/store_variants.py, 2026-12-07, four layers of 1 MiB chunk files):
    8 threads 60k tok/s (0.98 GB/s), 32 threads 125k (2.05 GB/s), 64 threads 124k; plain 1 MiB
    files fsync'd without the store 135k, 16 MiB ones 150k."""
    n = min(64, max(32, 4 * write_threads()))
    return thread_pool(f"fsync{n}", n)


class _Recycler:
    """Result buffers of large reads, handed out again once nothing refers to them.

    A fresh buffer of a few MB costs the kernel a page fault and a zeroed page per 4 KiB on its
    first write, about as much as reading the rows into it from the page cache. Each buffer
    handed out is a view of a pooled base array; every view, and every tensor or array made
    from one, keeps the base referenced, so a base whose reference count is back to the pool's
    own is unused and is filled again. Bases are anonymous maps (no hugepage advice: on the
    development VMs a read into a madvised, never-backed region was several times slower).

    The free base taken is the one taken most recently (large enough), not the smallest that
    fits: its lines are likely still in the last-level cache, so filling it, and the caller's
    next pass over it, do not go to memory. A training epoch of the per-layer layout (items of
    1-8 MB, a 32 MiB L3; ``python -m bench.recycle_variants``: DataLoader at 0 workers, each item
    cloned) took 3-12 % less CPU than with the smallest base that fits in seven of eight
    in-process A/B runs, 2 % more in one (e.g. medians 30.6 vs 33.5, 31.2 vs 32.4, 39.5 vs 41.1
    ms; 2-core AMD EPYC VM, 2026-12-08); the one-sample read row did not move (17 MB results)."""

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
            bases = self._bases  # least recently taken first
            for i in range(len(bases) - 1, -1, -1):
                # 2 = the list's reference and getrefcount's argument: no view of it is alive
                if bases[i].nbytes >= nbytes and sys.getrefcount(bases[i]) == 2:
                    bases.append(bases.pop(i))
                    return bases[-1][:nbytes]
            import mmap

            cap = -(-nbytes // (1 << 20)) * (1 << 20) or (1 << 20)
            base = np.frombuffer(mmap.mmap(-1, cap), dtype=np.uint8)
            if len(bases) >= self.KEEP:
                free = [i for i in range(len(bases)) if sys.getrefcount(bases[i]) == 2]
                if not free:
                    return base[:nbytes]  # all in use: this one is not kept
                bases.pop(min(free, key=lambda i: bases[i].nbytes))  # too small for this one
            bases.append(base)
            return base[:nbytes]


_recycler = _Recycler()


def recycled_empty(shape: tuple, dtype) -> np.ndarray:
    """An uninitialised array like ``np.empty``, in a recycled buffer when it is large (see
    :class:`_Recycler`): for results handed to a caller who drops them before the next ones."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(map(int, shape)) * dtype.itemsize  # (np.prod: 2.5 us a call, math.prod 0.15)
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
