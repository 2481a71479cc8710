"""Experiment (not part of the suite): where the batched side of `eval-batching` spends its time,
each ATen call timed at one torch thread, and the GEMM shapes it runs measured alone.

    python -m bench.eval_batching_ops [--tokens 512] [--reps 9]

Same drafter and inputs as ``bench/eval_batching.py``. Prints the median CPU time of
``score_roots``, then one call under a ``TorchDispatchMode`` that times every ATen call (wall
time of the call itself, which at one thread is its CPU time; the mode's own Python overhead
falls between calls and is not counted), grouped by operator, and the GFLOP/s of each GEMM shape
of that call when run alone in a loop: what the GEMMs would cost at the library's rate on those
shapes. torch.profiler's table inflates the small calls; this does not.
"""

from __future__ import annotations

import argparse
import collections
import time
import uuid

from ._common import OUT_DIR, med
from .eval_batching import make_drafter, make_inputs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.eval_batching_ops")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args(argv)
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from runner.drafters import dflash as D

    torch.set_num_threads(1)
    drafter, head = make_drafter(OUT_DIR / f"tmp-ebops-{uuid.uuid4().hex[:6]}")
    feats, ids, roots = make_inputs(head, args.tokens)

    def call():
        return D.score_roots(drafter, head, feats, ids, roots)

    call()
    cpu = []
    for _ in range(args.reps):
        c = time.process_time()
        call()
        cpu.append(time.process_time() - c)
    print(f"score_roots, {len(roots)} roots, {args.tokens} tokens, 1 thread: {med(cpu) * 1e3:.1f} ms CPU (median of {args.reps})")

    by_op: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    gemms: dict[tuple, int] = collections.Counter()

    class Timed(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, call_args=(), kwargs=None):
            t = time.perf_counter()
            out = func(*call_args, **(kwargs or {}))
            s = by_op[str(func)]
            s[0] += 1
            s[1] += time.perf_counter() - t
            if func in (torch.ops.aten.linear.default, torch.ops.aten.matmul.out, torch.ops.aten.matmul.default,
                        torch.ops.aten.mm.default):
                a, b = call_args[0], call_args[1]
                m, k = a.reshape(-1, a.shape[-1]).shape
                n = b.shape[0] if func is torch.ops.aten.linear.default else b.shape[-1]
                gemms[(m, k, n)] += 1
            return out

    with Timed():
        call()
    total = sum(v[1] for v in by_op.values())
    print(f"one call under the mode: {total * 1e3:.1f} ms inside {sum(v[0] for v in by_op.values())} ATen calls")
    for name, (n, t) in sorted(by_op.items(), key=lambda kv: -kv[1][1])[:12]:
        print(f"  {name:60s} {n:5d} calls {t * 1e3:8.2f} ms")

    alone = 0.0
    print("GEMM shapes of that call, each alone ([m x k] x [k x n], median of 30):")
    for (m, k, n), count in sorted(gemms.items(), key=lambda kv: -kv[0][0] * kv[0][1] * kv[0][2] * kv[1]):
        x, w = torch.randn(m, k), torch.randn(n, k)
        for _ in range(3):
            x @ w.t()
        ts = []
        for _ in range(30):
            c = time.process_time()
            x @ w.t()
            ts.append(time.process_time() - c)
        dt = med(ts)
        alone += dt * count
        print(f"  [{m} x {k}] x [{k} x {n}] x{count}: {dt * 1e3:.3f} ms, {2 * m * k * n / dt / 1e9:.1f} GFLOP/s")
    print(f"the GEMMs alone at those rates: {alone * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
