"""Experiment (not part of the suite): how a cold read brings chunk files into the page cache,
and what that does to the reads after it.

    python -m bench.pagecache_variants [--files 17] [--rounds 8] [--read-runs 3]

Part 1, plain files (``--files`` files of one chunk's size, 1 MiB + 4 bytes, written, then
evicted and read back cold once per method, then read warm):

* ``willneed``  - POSIX_FADV_WILLNEED on every file, then ``preadv`` of each (the read path
                  before large-folio loading; the kernel reads them back in small folios);
* ``large``     - each file faulted in through a ``MADV_HUGEPAGE`` mapping on
                  ``dfcache.store._pagecache.load_large`` (ctypes, the GIL let go), 4 loader
                  threads, the caller copying each file as its load completes;
* ``large-gil`` - the same through ``mmap.madvise``, which keeps the GIL for the whole fault:
                  the caller's copies wait for every load.

Printed: the cold read (evict, then read all files) and the warm re-read after it (median of 5
right after, the median over rounds), against a warm read of the files as written.

Part 2, the suite's ``read`` benchmark run ``--read-runs`` times with
``dfcache.store._pagecache.ENABLED`` on and off alternately (everything else the same), its warm
and cold rows printed side by side.
"""

from __future__ import annotations

import argparse
import mmap
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ._common import OUT_DIR, Ctx, evict, med, rmtree

SIZE = (1 << 20) + 4  # a 128-row chunk of 4096 bf16 columns and its crc32c


def _load_gil(fd: int, size: int) -> None:
    mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
        mm.madvise(22)  # MADV_POPULATE_READ
    finally:
        mm.close()


def files_part(n_files: int, rounds: int) -> None:
    from dfcache.store import _pagecache

    if not _pagecache.available():
        print("part 1 skipped: no cachestat here (Linux 6.5+), dfcache reads cold files with WILLNEED")
        return
    d = OUT_DIR / f"tmp-pagecache-{uuid.uuid4().hex[:6]}"
    d.mkdir(parents=True)
    try:
        paths = [str(d / f"c{i}") for i in range(n_files)]
        for p in paths:
            with open(p, "wb") as f:
                f.write(np.random.bytes(SIZE))
        os.sync()
        buf = np.empty(n_files * SIZE, np.uint8)
        buf[:] = 1
        pool = ThreadPoolExecutor(4)

        def read_all(method: str) -> float:
            t = time.perf_counter()
            fds = [os.open(p, os.O_RDONLY) for p in paths]
            loads = {}
            for i, fd in enumerate(fds):
                if method == "willneed":
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                elif method == "large":
                    loads[i] = pool.submit(_pagecache.load_large, fd, SIZE)
                elif method == "large-gil":
                    loads[i] = pool.submit(_load_gil, fd, SIZE)
            for i, fd in enumerate(fds):
                if i in loads:
                    loads[i].result()
                os.preadv(fd, [buf[i * SIZE:(i + 1) * SIZE]], 0)
                os.close(fd)
            return time.perf_counter() - t

        written = med([read_all("warm") for _ in range(20)])
        cold: dict[str, list] = {m: [] for m in ("willneed", "large", "large-gil")}
        after: dict[str, list] = {m: [] for m in cold}
        for _ in range(rounds):
            for m in cold:
                evict(paths)
                cold[m].append(read_all(m))
                after[m].append(med([read_all("warm") for _ in range(5)]))
        mb = n_files * SIZE / 1e6
        print(f"part 1: {n_files} files of {SIZE} bytes ({mb:.1f} MB), {rounds} rounds; "
              f"warm read of the files as written: {written * 1e3:.2f} ms")
        for m in cold:
            print(f"  {m:10s} cold read {med(cold[m]) * 1e3:6.2f} ms   warm re-read after it "
                  f"{med(after[m]) * 1e3:5.2f} ms ({med(after[m]) / written:.2f}x the written files' time)")
    finally:
        rmtree(d)


def read_part(runs: int) -> None:
    from dfcache.store import _pagecache

    from . import read

    rows: dict[bool, dict[str, list]] = {True: {}, False: {}}
    work = OUT_DIR / f"tmp-pagecache-read-{uuid.uuid4().hex[:6]}"
    try:
        for _ in range(runs):
            for enabled in (True, False):
                _pagecache.ENABLED = enabled
                res = read.run(Ctx(factor=1.0, size_name="medium", reps=None, work=work, verbose=False))
                for r in res.rows:
                    if r.measure.startswith("one sample"):
                        kind = "cold" if "cold" in r.measure else "warm"
                        rows[enabled].setdefault(kind, []).append((r.ratio, r.dfcache, r.competitor))
    finally:
        _pagecache.ENABLED = True
        rmtree(work)
    print(f"part 2: the suite's read benchmark, {runs} runs each, alternating (ratio = torch.load time / dfcache time)")
    for enabled in (True, False):
        name = "large-folio loads" if enabled else "WILLNEED (before)"
        for kind in ("warm", "cold"):
            got = rows[enabled].get(kind, [])
            print(f"  {name:18s} {kind}: " + ", ".join(f"{r:.2f}x ({a} vs {b})" for r, a, b in got))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.pagecache_variants")
    ap.add_argument("--files", type=int, default=17)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--read-runs", type=int, default=3)
    args = ap.parse_args(argv)
    files_part(args.files, args.rounds)
    if args.read_runs:
        read_part(args.read_runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
