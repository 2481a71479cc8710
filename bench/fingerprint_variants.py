"""Experiment (not part of the suite): can a first-time fingerprint run at the disk's read rate?

    python -m bench.fingerprint_variants [--mb 512] [--reps 3]

Hashes the files of a model directory (cold page cache: each file evicted first) with xxh3-128,
alternating, medians:

* ``read_only``   - read every file with 8 MiB ``readinto`` (the reference: the disk's rate).
* ``serial``      - what ``keys.hash_file`` does: read 8 MiB, hash it, read the next (the disk idles
                    while hashing; only the kernel's small readahead window overlaps).
* ``fadvise``     - the same loop after ``posix_fadvise(fd, 0, 0, SEQUENTIAL)`` and ``WILLNEED`` on
                    the whole file (the kernel reads ahead while we hash).
* ``thread``      - a reader thread fills one 8 MiB buffer while the main thread hashes the other
                    (both release the GIL).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from queue import Queue

import xxhash

from ._common import OUT_DIR, alternate, clock, evict, fmt_num, med, rmtree
from .fingerprint import make_model_dir

PIECE = 8 << 20


def h_serial(path: str, advise: bool = False) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb", buffering=0) as f:
        if advise:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_WILLNEED)
        buf = bytearray(PIECE)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


def h_thread(path: str) -> str:
    h = xxhash.xxh3_128()
    free: Queue = Queue()
    full: Queue = Queue()
    for _ in range(2):
        free.put(bytearray(PIECE))

    def reader():
        with open(path, "rb", buffering=0) as f:
            while True:
                b = free.get()
                n = f.readinto(b)
                full.put((b, n))
                if not n:
                    return
    t = threading.Thread(target=reader, daemon=True)
    t.start()
    while True:
        b, n = full.get()
        if not n:
            break
        h.update(memoryview(b)[:n])
        free.put(b)
    t.join()
    return h.hexdigest()


def read_only(path: str) -> None:
    buf = bytearray(PIECE)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fingerprint_variants")
    ap.add_argument("--mb", type=float, default=512)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    root = OUT_DIR / f"tmp-fpvariants-{os.getpid()}"
    files = make_model_dir(root / "model", int(args.mb * 1e6))
    nbytes = sum(os.path.getsize(p) for p in files)
    ref = [h_serial(p) for p in files]

    def variant(fn):
        def go() -> float:
            evict(files)
            out = []
            t = clock(lambda: out.extend(fn(p) for p in files))
            if fn is not read_only and out != ref:
                raise AssertionError("digest mismatch")
            return t
        return go

    times = alternate({"read_only": variant(read_only), "serial": variant(h_serial),
                       "fadvise": variant(lambda p: h_serial(p, advise=True)), "thread": variant(h_thread)},
                      args.reps, log=lambda m: print("  " + m, file=sys.stderr))
    rmtree(root)
    base = med(times["read_only"])
    print(f"{nbytes / 1e6:.0f} MB in {len(files)} files, cold page cache")
    print(f"{'variant':<10} {'median s':>9} {'GB/s':>6} {'vs read':>8}")
    for k, v in times.items():
        print(f"{k:<10} {med(v):9.3f} {nbytes / med(v) / 1e9:6.2f} {fmt_num(base / med(v)):>7}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
