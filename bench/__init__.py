"""dfcache benchmark suite: ``python -m bench`` (see docs/benchmarks.md).

Each benchmark is a module with ``NAME`` and ``run(ctx) -> Result``; this table maps the names
used by ``--only`` to the modules, in the order the suite runs them.
"""

BENCHMARKS = {
    "write": "bench.write",
    "read": "bench.read",
    "size": "bench.size",
    "fp8": "bench.fp8",
    "noop-eval": "bench.noop_eval",
    "ls": "bench.ls",
    "samples": "bench.samples",
    "fingerprint": "bench.fingerprint",
    "eval-batching": "bench.eval_batching",
    "eagle3-batching": "bench.eagle3_batching",
    "training": "bench.training",
    "gpu-extract": "bench.gpu_row",
}
