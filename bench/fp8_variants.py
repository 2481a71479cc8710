"""Experiment (not part of the suite): how fast can a warm FP8 read be dequantized to bf16 on the
CPU, exactly (hs-connectors' ``fp8.to(bf16) * scale.to(bf16)``), at one thread?

    python -m bench.fp8_variants [--mb 64] [--picks 15]

Writes bench/read.py's data (~2048-token samples x 4096, N(0,1) bf16) quantized to packed FP8 rows
in the real store, and the same samples bf16 in the SpecForge layout; then, one torch thread, for
random samples in turn, CPU time (``time.thread_time``) of:

* dequantization alone, on the sample's packed rows (read once beforehand):
  ``numpy``       - dfcache.fp8._dequantize_numpy (integer + float32 ufuncs in cached blocks: the read before)
  ``torch``       - dfcache.fp8._dequantize_torch (int16 bit moves + one bf16 multiply, ATen, 1 M-value blocks)
  ``torch_256k``  / ``torch_whole`` - the same in 256 K-value blocks / one block (the block size)
  ``torch_nocheck`` - ``torch`` without the NaN-code check (what the check costs)
  ``lut_rows``    - a 256-entry bf16 table per row (exact by construction), ``np.take`` per row
  ``lut_flat``    - the tables flattened, ``np.take`` with ``code + 256 x row`` indices (intp)
  ``lut_torch``   - the same with ``torch.index_select`` and int32 indices
  ``casts``       - ml_dtypes' casts (the reference)
  ``hs_torch``    - hs-connectors' expression in torch (its float8 -> bf16 cast is scalar code)
  ``memcpy_out``  - one copy of a bf16 sample's bytes (2 B per value): what any one pass writing
                    the output costs, the floor of a dequantization that numpy/ATen calls make
  ``c_kernel``    - one fused pass in C (``_C_KERNEL``: the code's value built from its bits,
                    times the bf16 scale in float32, rounded to bf16 to nearest even), compiled
                    here with ``gcc -O3 -march=native`` and called through ctypes; skipped without
                    gcc. Not shipped: it measures what a native kernel would give
* the reads: ``raw`` (``read_raw`` of the packed rows, warm), ``read`` (``ArrayReader.read``: raw +
  the shipped dequantization), ``read_fused`` / ``read_fused128`` (the read sharing the pass:
  ``read_raw`` of 256 / 128 rows at a time into one cache-sized buffer, dequantized from there),
  ``torch.load`` of the sample's bf16 SpecForge file.

Prints the medians and ratios vs torch.load; every variant's bits are checked against the casts.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from ._common import OUT_DIR, med, rmtree
from ._data import make_hidden, specforge_path, specforge_samples, specforge_write


def _tables(scales):
    """[n, 256] bf16 bits of every code times each row's bf16 scale (hs-connectors' expression
    on 256 codes: exact by construction)."""
    import torch

    allc = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.bfloat16)
    st = torch.from_numpy(scales).to(torch.bfloat16)
    return (allc[None, :] * st.reshape(-1, 1)).view(torch.int16)


# Finite scales under 2^128 / 448 and no NaN codes (the sample's check below holds it to the casts).
_C_KERNEL = r"""
#include <stdint.h>
#include <string.h>
void deq(const uint8_t *restrict codes, const float *restrict scales, long n, long w, uint16_t *restrict out) {
  for (long r = 0; r < n; r++) {
    const uint8_t *restrict c = codes + r * w;
    uint16_t *restrict o = out + r * w;
    const float s = scales[r];
    for (long i = 0; i < w; i++) {
      uint32_t x = c[i], em = x & 0x7Fu, sub, norm = (em << 20) + (120u << 23), u, m;
      float f = (float)(int)(em & 7u) * 0x1p-9f, v;
      memcpy(&sub, &f, 4);
      m = 0u - (uint32_t)(em < 8u);  /* exponent 0: subnormal, m x 2^-9 */
      u = ((x & 0x80u) << 24) | (sub & m) | (norm & ~m);
      memcpy(&v, &u, 4);
      v *= s;  /* exact: 4 x 8 significant bits */
      memcpy(&u, &v, 4);
      o[i] = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    }
  }
}
"""


def _c_kernel(workdir):
    """``_C_KERNEL`` compiled into ``workdir`` and bound with ctypes, or None without gcc."""
    import ctypes
    import shutil
    import subprocess

    if shutil.which("gcc") is None:
        return None
    src, lib = workdir / "deq.c", workdir / "deq.so"
    src.write_text(_C_KERNEL)
    subprocess.run(["gcc", "-O3", "-march=native", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    fn = ctypes.CDLL(str(lib)).deq
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p]
    return fn


def variants(codes: np.ndarray, scales: np.ndarray, out: np.ndarray, c_kernel=None) -> dict:
    import ml_dtypes
    import torch

    from dfcache import fp8

    n, w = codes.shape
    s2 = scales.reshape(-1, 1)
    src = np.empty((n, w), np.uint16)

    def torch_blocks(block, check=True):
        def f():
            old = fp8._TORCH_BLOCK_VALUES
            fp8._TORCH_BLOCK_VALUES = block
            try:
                if check:
                    return fp8._dequantize_torch(codes, s2, out)
                return _nocheck(codes, s2, out)
            finally:
                fp8._TORCH_BLOCK_VALUES = old
        return f

    def lut_rows():
        t = _tables(scales).numpy().view(np.uint16)
        for i in range(n):
            np.take(t[i], codes[i], out=out[i])
        return out

    def lut_flat():
        t = _tables(scales).numpy().view(np.uint16).reshape(-1)
        idx = np.empty((n, w), np.intp)
        np.add(codes, (np.arange(n, dtype=np.intp) * 256)[:, None], out=idx)
        np.take(t, idx, out=out)
        return out

    def lut_torch():
        t = _tables(scales).reshape(-1)
        idx = torch.from_numpy(codes).to(torch.int32) + (torch.arange(n, dtype=torch.int32) * 256)[:, None]
        torch.index_select(t, 0, idx.reshape(-1), out=torch.from_numpy(out.view(np.int16)).reshape(-1))
        return out

    def hs_torch():
        t = torch.from_numpy(codes).view(torch.float8_e4m3fn)
        r = t.to(torch.bfloat16) * torch.from_numpy(scales).to(torch.bfloat16)[:, None]
        return r.view(torch.int16).numpy().view(np.uint16)

    s_bf16 = np.ascontiguousarray(scales.reshape(-1), np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
    c_codes = np.ascontiguousarray(codes)
    c_fns = {} if c_kernel is None else {
        "c_kernel": lambda: (c_kernel(c_codes.ctypes.data, s_bf16.ctypes.data, n, w, out.ctypes.data), out)[1]}

    return {
        **c_fns,
        "numpy": lambda: fp8._dequantize_numpy(codes, s2, out),
        "torch": torch_blocks(fp8._TORCH_BLOCK_VALUES),
        "torch_256k": torch_blocks(1 << 18),
        "torch_whole": torch_blocks(n * w),
        "torch_nocheck": torch_blocks(fp8._TORCH_BLOCK_VALUES, check=False),
        "lut_rows": lut_rows,
        "lut_flat": lut_flat,
        "lut_torch": lut_torch,
        "casts": lambda: fp8._dequantize_casts(codes, s2, out),
        "hs_torch": hs_torch,
        "memcpy_out": lambda: (np.copyto(out, src), None)[1],
    }


def _nocheck(codes, scales, out):
    """fp8._dequantize_torch's passes without its checks (finite scales under 256, no NaN codes)."""
    import ml_dtypes
    import torch

    from dfcache import fp8

    n, w = codes.shape
    s = scales.astype(ml_dtypes.bfloat16).astype(np.float32) * np.float32(2.0 ** 120)
    f = torch.from_numpy(s).to(torch.bfloat16)
    ct = torch.from_numpy(codes).view(torch.int8)
    ot = torch.from_numpy(out.view(np.int16)).view(torch.bfloat16)
    rows = max(1, fp8._TORCH_BLOCK_VALUES // w)
    t = torch.empty((min(rows, n), w), dtype=torch.int16)
    for i in range(0, n, rows):
        j = min(n, i + rows)
        tt = t[:j - i]
        tt.copy_(ct[i:j])
        tt.bitwise_left_shift_(4)
        tt.bitwise_and_(-0x7810)
        torch.mul(tt.view(torch.bfloat16), f[i:j], out=ot[i:j])
    return out


def _fused(arr, a, b, out, block_rows=256):
    """(4) the read sharing the pass: ``read_raw`` of a block of rows into one small reused buffer
    (cache-sized), dequantized from there into the result, block after block."""
    from dfcache import fp8

    buf = np.empty((block_rows,) + arr.shape[1:], np.uint8)
    h = fp8.hidden_width(arr.shape[1])
    for i in range(a, b, block_rows):
        j = min(b, i + block_rows)
        raw = arr.read_raw(i, j, out=buf)
        fp8._dequantize_torch(raw[:, :h], np.ascontiguousarray(raw[:, h:]).view("<f4"), out[i - a:j - a])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fp8_variants")
    ap.add_argument("--mb", type=float, default=64)
    ap.add_argument("--picks", type=int, default=15)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    from dfcache import fp8
    from dfcache.keys import compute_key
    from dfcache.store import open_store
    
    from dfcache.store import _reader

    _reader._read_workers = lambda: 0  # one thread: thread_time sees all of a read's work
    h = make_hidden(int(args.mb * 1e6), lengths=(1024, 3072), seed=1)
    root = OUT_DIR / f"tmp-fp8variants-{os.getpid()}"
    root.mkdir(parents=True)
    try:
        sf = root / "sf"
        sf.mkdir()
        specforge_write(sf, specforge_samples(h))
        store = open_store(root / "s")
        key = compute_key("fp8v", 1, {})
        with store.writer(key, stage="hidden_states", stage_version=1, inputs={}) as w:
            w.write_array("hidden", fp8.quantize(h.states), dtype=fp8.FP8_DTYPE)
        time.sleep(_reader.RACY_NS / 1e9 + 0.2)
        arr = store.open(key).array("hidden")
        arr.read_raw()  # every chunk checked once: later reads read the rows alone
        c_kernel = _c_kernel(root)
        off = h.offsets
        rng = np.random.default_rng(7)
        picks = [int(i) for i in rng.integers(0, len(h.lengths), args.picks)]
        cpu: dict[str, list[float]] = {}
        for j, i in enumerate(picks):
            a, b = int(off[i]), int(off[i + 1])
            packed = arr.read_raw(a, b).copy()
            codes, scales = fp8.unpack(packed)
            codes = codes.view(np.uint8)
            out = np.empty((b - a, codes.shape[1]), np.uint16)
            ref = fp8._dequantize_casts(codes, scales.reshape(-1, 1))
            fns = variants(codes, scales, out, c_kernel)
            fns["raw"] = lambda: arr.read_raw(a, b)
            fns["read"] = lambda: arr.read(a, b)
            fns["read_fused"] = lambda: _fused(arr, a, b, out)
            fns["read_fused128"] = lambda: _fused(arr, a, b, out, 128)
            fns["torch.load"] = lambda: torch.load(specforge_path(sf, i), weights_only=True)["hidden_states"]
            names = list(fns)
            for name in names[j % len(names):] + names[:j % len(names)]:
                out[...] = 0
                c = time.thread_time()
                r = fns[name]()
                cpu.setdefault(name, []).append(time.thread_time() - c)
                if j == 0 and name not in ("raw", "memcpy_out", "torch.load"):
                    got = out if r is None else np.asarray(r).view(np.uint16)
                    assert np.array_equal(got, ref), f"{name}: bits differ from the casts"
        tok = float(np.mean([h.lengths[i] for i in picks]))
        base = med(cpu["torch.load"])
        print(f"{len(picks)} samples, ~{tok:.0f} tokens x {h.states.shape[1]}, one torch thread, CPU ms (median); "
              f"x = torch.load / variant")
        for name, v in cpu.items():
            print(f"  {name:14s} {med(v) * 1e3:7.2f} ms   {base / med(v):5.2f}x   "
                  f"{med(v) * 1e9 / (tok * h.states.shape[1]):.3f} ns/value")
        r, t = med(cpu["raw"]), med(cpu["torch"])
        print(f"  raw + torch   {(r + t) * 1e3:7.2f} ms   {base / (r + t):5.2f}x   (read_raw, then the torch dequantization)")
        print(f"  raw + memcpy  {(r + med(cpu['memcpy_out'])) * 1e3:7.2f} ms   "
              f"{base / (r + med(cpu['memcpy_out'])):5.2f}x   (bound: read_raw, then one pass writing the output)")
        if "c_kernel" in cpu:
            k = med(cpu["c_kernel"])
            print(f"  raw + c_kernel {(r + k) * 1e3:6.2f} ms   {base / (r + k):5.2f}x   (read_raw, then the fused C pass)")
    finally:
        rmtree(root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
