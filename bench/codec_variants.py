"""Experiment (not part of the suite): which lossless codec should hidden states use?

    python -m bench.codec_variants [--tokens 16384] [--reps 3]

The data of the ``size`` benchmark (real hidden states of the tiny Qwen3.5 target, layers 0, 2,
4 concatenated, bf16, cached in ``bench/out/cache/codec-states.npy``), cut into the store's
chunks (``default_chunk_rows``), encoded by each candidate: size reduction (none / candidate,
whole chunks) and encode and decode throughput of one thread, medians. Every candidate's
round-trip is checked bitwise.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from pathlib import Path

import numpy as np

from ._common import OUT_DIR, Ctx, clock, med


def _states(tokens: int) -> np.ndarray:
    cache = OUT_DIR / "cache" / f"codec-states-{tokens}.npy"
    if cache.exists():
        return np.load(cache)
    from .size import tiny_states

    ctx = Ctx(factor=1.0, size_name="medium", reps=None, work=OUT_DIR / f"tmp-codec-{uuid.uuid4().hex[:6]}")
    ctx.work.mkdir(parents=True, exist_ok=True)
    states, _ = tiny_states(ctx, tokens)
    cache.parent.mkdir(parents=True, exist_ok=True)
    np.save(cache, states)
    return states


def candidates() -> dict:
    import numcodecs
    from numcodecs import Blosc, Shuffle, Zstd

    def chain(*codecs):
        def enc(b):
            for c in codecs:
                b = c.encode(b)
            return b

        def dec(b):
            for c in reversed(codecs):
                b = c.decode(b)
            return b
        return enc, dec

    def one(c):
        return c.encode, c.decode

    numcodecs.blosc.set_nthreads(1)
    out = {
        "zstd-1": one(Zstd(level=1)),
        "shuffle2+zstd-1": chain(Shuffle(elementsize=2), Zstd(level=1)),
    }
    for bs_kb in (128, 256, 0):  # 0 here: one block, the whole chunk
        for shuf, sname in ((Blosc.SHUFFLE, "shuffle"), (Blosc.BITSHUFFLE, "bitshuffle")):
            out[f"blosc-zstd-1-{sname}-bs{bs_kb or 'chunk'}"] = ("blocksize", bs_kb, shuf)
    for cname in ("zstd", "lz4"):
        for level in ((1, 3) if cname == "zstd" else (5,)):
            for shuf, sname in ((Blosc.SHUFFLE, "shuffle"), (Blosc.BITSHUFFLE, "bitshuffle")):
                c = Blosc(cname=cname, clevel=level, shuffle=shuf)
                # blosc takes its typesize from the buffer: bf16 bits as uint16, not bytes
                out[f"blosc-{cname}-{level}-{sname}"] = (lambda b, c=c: c.encode(b.view(np.uint16)), c.decode)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.codec_variants")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    from dfcache.store.format import default_chunk_rows

    states = _states(args.tokens)
    rows = default_chunk_rows(states.shape, "bfloat16")
    n = len(states) // rows * rows
    chunks = [np.ascontiguousarray(states[i:i + rows]).view(np.uint8).reshape(-1) for i in range(0, n, rows)]
    raw = sum(c.nbytes for c in chunks)
    print(f"{len(chunks)} chunks of {rows} rows x {states.shape[1]} bf16 ({raw / 1e6:.1f} MB)", file=sys.stderr)
    print(f"{'codec':<28} {'ratio':>7} {'enc GB/s':>9} {'dec GB/s':>9}")
    from numcodecs import Blosc
    for name, cand in candidates().items():
        if cand[0] == "blocksize":
            bs = cand[1] * 1024 or chunks[0].nbytes
            c = Blosc(cname="zstd", clevel=1, shuffle=cand[2], blocksize=bs)
            shaped = [x.view(np.uint16) for x in chunks]  # typesize 2 comes from the buffer's itemsize
            enc, dec = c.encode, c.decode
            blobs = [enc(x) for x in shaped]
            for x, b in zip(shaped, blobs):
                if not np.array_equal(np.frombuffer(dec(b), dtype=np.uint16), x):
                    raise AssertionError(f"{name} does not round-trip")
            size = sum(len(b) for b in blobs)
            te = med([clock(lambda: [enc(x) for x in shaped]) for _ in range(args.reps)])
            td = med([clock(lambda: [dec(b) for b in blobs]) for _ in range(args.reps)])
            print(f"{name:<28} {raw / size:7.3f} {raw / te / 1e9:9.2f} {raw / td / 1e9:9.2f}", flush=True)
            continue
        enc, dec = cand
        blobs = [enc(c) for c in chunks]
        for c, b in zip(chunks, blobs):
            if not np.array_equal(np.frombuffer(dec(b), dtype=np.uint8), c):
                raise AssertionError(f"{name} does not round-trip")
        size = sum(len(b) for b in blobs)
        te = med([clock(lambda: [enc(c) for c in chunks]) for _ in range(args.reps)])
        td = med([clock(lambda: [dec(b) for b in blobs]) for _ in range(args.reps)])
        print(f"{name:<28} {raw / size:7.3f} {raw / te / 1e9:9.2f} {raw / td / 1e9:9.2f}", flush=True)
    return 0


if __name__ == "__main__":
    t = time.perf_counter()
    rc = main()
    print(f"took {time.perf_counter() - t:.0f} s", file=sys.stderr)
    sys.exit(rc)
