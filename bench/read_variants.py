"""Experiment (not part of the suite): how fast could ``ArrayReader.read_raw`` read a sample?

    python -m bench.read_variants [--mb 128] [--picks 30]

Writes one bf16 array with the real store (no compression) and the same samples in the
SpecForge layout, then reads random ~2048-token samples with, alternating:

* ``current``      - ``ArrayReader.read_raw`` as it is (``f.read()`` of each whole chunk into a new
                     bytes object, crc32c over it, ``np.frombuffer``, copy rows into the result).
* ``reuse_buf``    - the same, but ``readinto`` one preallocated per-reader buffer (no 4 MB
                     allocation + page faults per chunk).
* ``direct``       - chunks fully inside the range are ``readinto`` straight into the result's rows
                     (crc32c computed over those rows + the 4 trailing bytes); partial chunks go
                     through the reused buffer. Same checks as ``current``, one copy fewer.
* ``hybrid``       - whole chunks as ``direct`` (crc checked); partial chunks: ``preadv`` of only the
                     needed rows, crc not checked (``verify`` still checks every chunk).
* ``pread_nocrc``  - ``os.preadv`` of only the needed rows into the result, no crc (lower bound).
* ``torch.load``   - SpecForge: ``torch.load`` of the sample's file.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from ._common import OUT_DIR, clock, fmt_num, med, rmtree
from ._data import make_hidden, specforge_path, specforge_samples, specforge_write


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.read_variants")
    ap.add_argument("--mb", type=float, default=128)
    ap.add_argument("--picks", type=int, default=30)
    args = ap.parse_args(argv)
    import google_crc32c
    import torch

    from dfcache.keys import compute_key
    from dfcache.store import open_store

    h = make_hidden(int(args.mb * 1e6), lengths=(1024, 3072), seed=1)
    root = OUT_DIR / f"tmp-readvariants-{os.getpid()}"
    root.mkdir(parents=True)
    sf = root / "sf"
    sf.mkdir()
    specforge_write(sf, specforge_samples(h))
    store = open_store(root / "s")
    key = compute_key("rv", 1, {})
    with store.writer(key, stage="hidden_states", stage_version=1, inputs={}) as w:
        w.write_array("hidden_states", h.states, dtype="bfloat16")
    arr = store.open(key).array("hidden_states")
    cr, W = arr.chunk_rows, h.states.shape[1]
    rb = W * 2
    from dfcache.store.format import artifact_prefix

    adir = store.backend.local_root / artifact_prefix(key)
    cpath = lambda i: adir / f"hidden_states/c/{i}/0"  # noqa: E731
    buf = bytearray(cr * rb + 4)
    crcbuf = bytearray(4)
    T = h.tokens

    def chunk_span(i):
        lo = i * cr
        return lo, min(lo + cr, T)

    def reuse_buf(a, b):
        out = np.empty((b - a, W), np.uint16)
        for i in range(a // cr, (b - 1) // cr + 1):
            with open(cpath(i), "rb", buffering=0) as f:
                n = f.readinto(buf)
            body = np.frombuffer(buf, np.uint8, count=n - 4)
            if google_crc32c.extend(0, body) != int.from_bytes(buf[n - 4:n], "little"):
                raise ValueError("crc")
            c = np.frombuffer(buf, np.uint16, count=(n - 4) // 2).reshape(-1, W)
            lo, _ = chunk_span(i)
            x, y = max(lo, a), min(lo + cr, b)
            out[x - a:y - a] = c[x - lo:y - lo]
        return out

    def direct(a, b):
        out = np.empty((b - a, W), np.uint16)
        for i in range(a // cr, (b - 1) // cr + 1):
            lo, hi = i * cr, (i + 1) * cr
            x, y = max(lo, a), min(hi, b)
            if x == lo and y == hi:   # whole chunk inside: read straight into the result
                dst = memoryview(out[x - a:y - a]).cast("B")
                with open(cpath(i), "rb", buffering=0) as f:
                    n = f.readinto(dst)
                    f.readinto(crcbuf)
                if n != len(dst) or google_crc32c.extend(0, out[x - a:y - a].reshape(-1).view(np.uint8)) != int.from_bytes(crcbuf, "little"):
                    raise ValueError("crc")
            else:
                with open(cpath(i), "rb", buffering=0) as f:
                    n = f.readinto(buf)
                if google_crc32c.extend(0, np.frombuffer(buf, np.uint8, count=n - 4)) != int.from_bytes(buf[n - 4:n], "little"):
                    raise ValueError("crc")
                c = np.frombuffer(buf, np.uint16, count=(n - 4) // 2).reshape(-1, W)
                out[x - a:y - a] = c[x - lo:y - lo]
        return out

    def hybrid(a, b):
        out = np.empty((b - a, W), np.uint16)
        for i in range(a // cr, (b - 1) // cr + 1):
            lo, hi = i * cr, (i + 1) * cr
            x, y = max(lo, a), min(hi, b)
            dst = memoryview(out[x - a:y - a]).cast("B")
            fd = os.open(cpath(i), os.O_RDONLY)
            try:
                if x == lo and y == hi:
                    n = os.preadv(fd, [dst, crcbuf], 0)
                    if n != len(dst) + 4 or google_crc32c.extend(
                            0, out[x - a:y - a].reshape(-1).view(np.uint8)) != int.from_bytes(crcbuf, "little"):
                        raise ValueError("crc")
                else:
                    os.preadv(fd, [dst], (x - lo) * rb)
            finally:
                os.close(fd)
        return out

    def pread_nocrc(a, b):
        out = np.empty((b - a, W), np.uint16)
        for i in range(a // cr, (b - 1) // cr + 1):
            lo = i * cr
            x, y = max(lo, a), min(lo + cr, b)
            fd = os.open(cpath(i), os.O_RDONLY)
            try:
                os.preadv(fd, [memoryview(out[x - a:y - a]).cast("B")], (x - lo) * rb)
            finally:
                os.close(fd)
        return out

    off = h.offsets
    fns = {"current": lambda i: arr.read_raw(int(off[i]), int(off[i + 1])),
           "reuse_buf": lambda i: reuse_buf(int(off[i]), int(off[i + 1])),
           "direct": lambda i: direct(int(off[i]), int(off[i + 1])),
           "hybrid": lambda i: hybrid(int(off[i]), int(off[i + 1])),
           "pread_nocrc": lambda i: pread_nocrc(int(off[i]), int(off[i + 1])),
           "torch.load": lambda i: torch.load(specforge_path(sf, i), weights_only=True)["hidden_states"]}
    for i in (0, len(h.lengths) - 1):
        ref = fns["current"](i)
        for k in ("reuse_buf", "direct", "hybrid", "pread_nocrc"):
            assert np.array_equal(fns[k](i), ref), k
    rng = np.random.default_rng(3)
    times = {k: [] for k in fns}
    names = list(fns)
    for p in range(args.picks):
        i = int(rng.integers(0, len(h.lengths)))
        k0 = p % len(names)
        for k in names[k0:] + names[:k0]:
            times[k].append(clock(lambda: fns[k](i)))
    rmtree(root)
    base = med(times["torch.load"])
    print(f"{h.nbytes / 1e6:.0f} MB, chunk_rows {cr}, {args.picks} random samples of 1024-3072 tokens, warm cache")
    print(f"{'variant':<12} {'median ms':>10} {'vs torch.load':>14}")
    for k, v in times.items():
        print(f"{k:<12} {med(v) * 1e3:10.2f} {fmt_num(base / med(v)):>13}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
