"""Experiment (not part of the suite): how fast are a per-layer training item's rows copied into
its columns? The per-layer layout's item (``dfcache.training``) is one [n, layers x hidden] array
assembled from each layer's rows; this times that assembly, one layer's rows after the other into
the columns of one wide array, side by side, alternating, at one torch thread:

* ``numpy``  - ``out[:, cols] = rows`` (what ``ArrayReader.read_raw`` did before 2026-12-07);
* ``torch``  - ``dfcache.training.copy_rows`` (``Tensor.copy_``), what a training item uses now;
* ``contiguous numpy`` / ``contiguous torch`` - the same bytes into a [layers, n, hidden] array
  (no column stride), the copy's own rate.

    python -m bench.copy_variants [--rows 4096] [--hidden 1024] [--layers 4] [--reps 15]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from ._common import alternate, clock, med


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.copy_variants")
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args(argv)
    import torch

    from dfcache.training import copy_rows

    torch.set_num_threads(1)
    n, h, L = args.rows, args.hidden, args.layers
    rng = np.random.default_rng(0)
    src = [rng.integers(0, 1 << 16, size=(n, h), dtype=np.uint16) for _ in range(L)]
    wide = np.empty((n, L * h), dtype=np.uint16)
    flat = np.empty((L, n, h), dtype=np.uint16)

    def numpy_cols():
        for k in range(L):
            wide[:, k * h:(k + 1) * h] = src[k]

    def torch_cols():
        for k in range(L):
            copy_rows(wide[:, k * h:(k + 1) * h], src[k])

    def numpy_flat():
        for k in range(L):
            flat[k] = src[k]

    def torch_flat():
        for k in range(L):
            copy_rows(flat[k], src[k])

    variants = {"numpy": numpy_cols, "torch": torch_cols, "contiguous numpy": numpy_flat,
                "contiguous torch": torch_flat}
    for fn in variants.values():
        fn()  # pages touched once before timing
    times = alternate({name: (lambda fn=fn: clock(fn)) for name, fn in variants.items()}, args.reps)
    torch_cols()
    assert all(np.array_equal(wide[:, k * h:(k + 1) * h], src[k]) for k in range(L))
    mb = wide.nbytes / 1e6
    print(f"{L} layers x {n} rows x {h} bf16 ({mb:.0f} MB) into one array, 1 torch thread, median of {args.reps}:")
    for name, ts in times.items():
        s = med(ts)
        print(f"  {name:17s} {s * 1e3:7.2f} ms  {mb / s / 1e3:5.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
