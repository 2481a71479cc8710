"""Bringing a local chunk file that is not in the page cache into it in large folios.

Why: the kernel keeps a file's cached pages in folios (runs of pages handled as one). A file
we wrote sits in large folios; one read back after eviction through ordinary read-ahead
(``read`` or ``POSIX_FADV_WILLNEED``) comes back in small ones, and every later warm read of
it copies from the page cache more slowly. Faulting the file in through a ``MADV_HUGEPAGE``
mapping makes the kernel read it in large folios, as the write left it, and the cold read
itself is faster too. ``python -m bench.pagecache_variants`` on the 2-core VM (6.18 kernel),
17 chunk-sized files: cold read 8.28 ms against 12.52 ms with WILLNEED on every file first;
a warm re-read after it 1.37 ms against 1.94 ms (1.30 ms as written). In the suite's ``read``
benchmark, three runs each: warm 1.00-1.09x ``torch.load`` against 0.77-0.85x, cold
0.87-0.88x against 0.77-0.83x.

Whether a file is cached is asked with ``cachestat`` (Linux 6.5+, under a microsecond a call),
so a warm read pays nothing else. Where it is missing (older kernel, another OS, a seccomp
filter) :func:`available` is False and the callers keep POSIX_FADV_WILLNEED.
"""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

_SYS_CACHESTAT = 451  # the same number on every architecture that has it (asm-generic table)
_ARCHES = {"x86_64", "aarch64"}
_MADV_HUGEPAGE, _MADV_POPULATE_READ, _MADV_POPULATE_WRITE = 14, 22, 23  # Linux (POPULATE_* since 5.14)
_PROT_READ, _MAP_SHARED = 1, 1
_MAP_FAILED = (1 << 64) - 1  # (void *) -1 as ctypes.c_void_p gives it on a 64-bit system
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

ENABLED = True  # False: plain readahead everywhere (for side-by-side timing)
_calls = None  # the ctypes calls once set up (see _setup); False: cachestat is not available here
_local = threading.local()  # each thread its own cachestat argument structs


def _setup():
    """The libc calls this module makes, with their ctypes signatures, once a probe of
    ``cachestat`` on this file has succeeded; False where it fails."""
    global _calls
    try:
        import ctypes
        import platform

        if platform.machine() not in _ARCHES:
            raise OSError("no cachestat on this architecture")

        class Range(ctypes.Structure):
            _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]

        class Stat(ctypes.Structure):
            _fields_ = [(n, ctypes.c_uint64) for n in ("cache", "dirty", "writeback", "evicted", "recently_evicted")]

        lib = ctypes.CDLL(None, use_errno=True)
        mmap_, madvise, munmap = lib.mmap, lib.madvise, lib.munmap
        mmap_.restype, mmap_.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                          ctypes.c_int, ctypes.c_int, ctypes.c_long]
        madvise.restype, madvise.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        munmap.restype, munmap.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t]
        fd = os.open(__file__, os.O_RDONLY)
        try:
            if lib.syscall(_SYS_CACHESTAT, fd, ctypes.byref(Range(0, 0)), ctypes.byref(Stat()), 0) != 0:
                raise OSError(ctypes.get_errno(), "cachestat failed")
        finally:
            os.close(fd)
        _calls = SimpleNamespace(syscall=lib.syscall, Range=Range, Stat=Stat, byref=ctypes.byref,
                                 mmap=mmap_, madvise=madvise, munmap=munmap)
    except (OSError, AttributeError, ImportError):
        _calls = False
    return _calls


def available() -> bool:
    """Whether cold files are loaded in large folios here (then callers skip their WILLNEED,
    which would start small-folio readahead first)."""
    return ENABLED and bool(_calls if _calls is not None else _setup())


def missing_pages(fd: int, size: int) -> int | None:
    """Pages of the file's first ``size`` bytes not in the page cache (0: all cached), or None
    when this system cannot tell (then do nothing special)."""
    calls = _calls if _calls is not None else _setup()
    if not calls or not ENABLED:
        return None
    args = getattr(_local, "args", None)
    if args is None:
        rng, stat = calls.Range(0, 0), calls.Stat()
        args = _local.args = (calls.byref(rng), stat, calls.byref(stat))
    rng_ref, stat, stat_ref = args
    if calls.syscall(_SYS_CACHESTAT, fd, rng_ref, stat_ref, 0) != 0:
        return None
    return max(0, -(-size // _PAGE) - stat.cache)


def load_large(fd: int, size: int) -> bool:
    """Fault the file's first ``size`` bytes into the page cache through a ``MADV_HUGEPAGE``
    mapping (large folios), returning whether every page was brought in; the mapping is gone
    on return. The calls go through ctypes, which lets go of the GIL while the kernel waits on
    the disk: ``mmap.madvise`` keeps it, and a thread counting in a loop beside a 256 MB load
    through it ran at 1.1 M/s against 18.6 M/s idle, so a reader's copies would wait for every
    load. Without THP the pages still load (small folios, as plain read-ahead); a failure (a
    file shorter than ``size``: the pages past its end are refused, not a bus error) leaves the
    reader's own read to bring in what is missing and to find what is wrong."""
    calls = _calls if _calls is not None else _setup()
    if not calls or size <= 0:
        return False
    addr = calls.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        return False
    try:
        calls.madvise(addr, size, _MADV_HUGEPAGE)  # refused without THP: the pages still load, in small folios
        return calls.madvise(addr, size, _MADV_POPULATE_READ) == 0
    finally:
        calls.munmap(addr, size)



def populate_write(addr: int, size: int) -> bool:
    """Make the pages of a writable shared mapping (``addr``, ``size`` bytes) present and
    writable in one call (``MADV_POPULATE_WRITE``) instead of one page fault per 4 KiB on the
    first write; False where the system refuses (the writes then fault the pages in as usual)."""
    calls = _calls if _calls is not None else _setup()
    if not calls or size <= 0:
        return False
    start = addr - addr % _PAGE
    return calls.madvise(start, addr + size - start, _MADV_POPULATE_WRITE) == 0
