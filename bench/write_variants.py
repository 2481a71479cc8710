"""Experiment (not part of the suite): how should the store make chunk files durable?

    python -m bench.write_variants [--mb 256] [--reps 5] [--chunk-mb 4]

Writes the same bf16 array as chunk files the way ``dfcache.store`` does (same chunk size,
xxh3 + crc32c per chunk, one file per chunk) and varies only *when and how* the files are
fsynced, side by side with ``numpy.save`` + fsync, alternating, medians:

* ``serial_end``   - what ``_LocalStaging.publish`` does today: write every chunk, then fsync the
                     files one after another (os.walk order).
* ``threads_end``  - write every chunk, then fsync them from a pool of threads (fsync drops the
                     GIL, so the filesystem gets several at once and can batch journal commits).
* ``bg_per_chunk`` - hand each chunk's fsync to a background pool as soon as it is written, so
                     the disk works while the next chunk is hashed and written; wait at the end.
* ``kick_end``     - start writeback of each chunk right after writing it (``sync_file_range(
                     SYNC_FILE_RANGE_WRITE)`` through ctypes, Linux), then fsync serially at the end.
* ``one_file``     - the same chunks appended to ONE file (a shard), fsync once: the cost of the
                     fsync count itself.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ._common import OUT_DIR, alternate, clock, fmt_num, fsync_path, med, rmtree
from ._data import make_hidden, numpy_save

_libc = ctypes.CDLL(None, use_errno=True)
_SFR_WRITE = 2


def _kick(fd: int) -> None:
    try:
        _libc.sync_file_range(fd, ctypes.c_longlong(0), ctypes.c_longlong(0), ctypes.c_uint(_SFR_WRITE))
    except Exception:
        pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.write_variants")
    ap.add_argument("--mb", type=float, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--chunk-mb", type=float, default=4)
    ap.add_argument("--threads", type=int, default=8)
    args = ap.parse_args(argv)

    from dfcache.store import format as S

    h = make_hidden(int(args.mb * 1e6))
    rows = max(1, int(args.chunk_mb * 2**20) // (h.states.shape[1] * 2))
    chunks = [h.states[i:i + rows] for i in range(0, h.tokens, rows)]
    root = OUT_DIR / f"tmp-variants-{os.getpid()}"
    root.mkdir(parents=True, exist_ok=True)
    pool = ThreadPoolExecutor(args.threads)

    def encode_write(path: Path, c):
        S.chunk_digest(c)
        parts = S.encode_chunk(c, "none")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for p in parts:
                os.write(fd, p)
        finally:
            os.close(fd)

    def variant(kind: str):
        def go() -> float:
            d = root / kind
            d.mkdir()
            paths = [d / f"c{i}" for i in range(len(chunks))]

            def work():
                if kind == "one_file":
                    with open(d / "shard", "wb") as f:
                        for c in chunks:
                            S.chunk_digest(c)
                            for p in S.encode_chunk(c, "none"):
                                f.write(p)
                        f.flush()
                        os.fsync(f.fileno())
                elif kind == "bg_per_chunk":
                    futs = []
                    for p, c in zip(paths, chunks):
                        encode_write(p, c)
                        futs.append(pool.submit(fsync_path, p))
                    for f in futs:
                        f.result()
                else:
                    for p, c in zip(paths, chunks):
                        encode_write(p, c)
                        if kind == "kick_end":
                            fd = os.open(p, os.O_RDONLY)
                            _kick(fd)
                            os.close(fd)
                    if kind == "threads_end":
                        list(pool.map(fsync_path, paths))
                    else:
                        for p in paths:
                            fsync_path(p)
                fsync_path(d)
            t = clock(work)
            rmtree(d)
            return t
        return go

    def c_numpy() -> float:
        d = root / "np"
        d.mkdir()
        t = clock(lambda: numpy_save(d / "h.npy", h.states))
        rmtree(d)
        return t

    contenders = {"numpy.save": c_numpy}
    for k in ("serial_end", "threads_end", "bg_per_chunk", "kick_end", "one_file"):
        contenders[k] = variant(k)
    print(f"{h.nbytes / 1e6:.0f} MB, {len(chunks)} chunks of {rows} rows; {args.reps} reps", file=sys.stderr)
    times = alternate(contenders, args.reps, log=lambda m: print("  " + m, file=sys.stderr))
    rmtree(root)
    base = med(times["numpy.save"])
    print(f"{'variant':<14} {'median s':>9} {'GB/s':>6} {'vs numpy.save':>14}")
    for k, v in times.items():
        m = med(v)
        print(f"{k:<14} {m:9.3f} {h.nbytes / m / 1e9:6.2f} {fmt_num(base / m):>13}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
