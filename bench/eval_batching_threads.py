"""Experiment (not part of the suite): the `eval-batching` comparison at several torch thread
counts, to see how each side scales over cores.

    python -m bench.eval_batching_threads [--threads 1,2,4,8,16] [--tokens 512] [--reps 5]

Same drafter, inputs and check as ``bench/eval_batching.py``; per thread count the median of
``--reps`` alternating calls of ``score_roots`` and ``score_roots_one_at_a_time``.
"""

from __future__ import annotations

import argparse
import time
import uuid

from ._common import OUT_DIR, med
from .eval_batching import make_drafter, make_inputs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.eval_batching_threads")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    import torch

    from runner.drafters import dflash as D

    drafter, head = make_drafter(OUT_DIR / f"tmp-ebthreads-{uuid.uuid4().hex[:6]}")
    feats, ids, roots = make_inputs(head, args.tokens)
    for threads in [int(x) for x in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for _ in range(2):
            D.score_roots(drafter, head, feats, ids, roots)
        batched, one = [], []
        for _ in range(args.reps):
            t = time.perf_counter()
            x = D.score_roots(drafter, head, feats, ids, roots)
            batched.append(time.perf_counter() - t)
            t = time.perf_counter()
            y = D.score_roots_one_at_a_time(drafter, head, feats, ids, roots)
            one.append(time.perf_counter() - t)
        if not torch.allclose(x, y, atol=1e-3, rtol=1e-3):
            raise AssertionError(f"batched and one-at-a-time logits differ at {threads} threads")
        print(f"threads {threads:2d}: batched {med(batched) * 1e3:7.1f} ms, one at a time {med(one) * 1e3:7.1f} ms, "
              f"{med(one) / med(batched):5.2f}x, max |diff| {(x - y).abs().max().item():.2g}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
