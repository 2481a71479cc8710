"""`fp8`: FP8 hidden states (``--compression fp8-e4m3[+lossless]``, dfcache/fp8.py) against bf16
``none``, side by side in one run (issue 33's targets).

* bytes per token on disk: the tiny Qwen3.5 target's states (bench/size.py's data: layers 0, 2,
  4 of 128 values each, stored as the store stores them, one array per layer) and N(0,1) bf16
  of the same shape; FP8 alone and with each lossless stage. With one float32 scale per token and
  layer, FP8 alone is 2H / (H + 4) smaller: 1.94x at H = 128, 1.998x at H = 4096; it never
  reaches 2.0x unless scales are shared across rows or layers.
* write throughput (fsync) of the packed FP8 rows vs bf16 ``none`` (what the writer does when
  extraction quantized on the GPU), and with the host quantization in the writer's time too
  (a CPU extraction quantizes in torch where it computes).
* warm one-sample read, dequantized to bf16, vs ``torch.load`` of the same sample's bf16
  SpecForge file (bench/read.py's data: ~2048 tokens x 4096), by CPU time at one torch thread,
  beside its variants (numpy's kernels, the casts, hs-connectors' expression, the packed rows).
* τ of the example's trained drafter (``dfcache run eval --example``: 8 coding prompts, 64 new
  tokens, CPU) on FP8 vs bf16 states of the same samples, chain, tree-4 and tree-8, through
  ``compare-backends --codec none --codec fp8-e4m3`` (runner.trust.compare_backends.run_compare).
"""

from __future__ import annotations

import itertools

import numpy as np

from ._common import Ctx, Result, Row, alternate, clock, clock_cpu, gbps, med, ms, rmtree, summary

NAME = "fp8"
HIDDEN = 128  # the tiny target's hidden size (bench/size.py's layers are concatenated: 3 x 128)
READ_BYTES = 64 * 10**6


def _layers(states: np.ndarray) -> list[np.ndarray]:
    return [np.ascontiguousarray(states[:, i:i + HIDDEN]) for i in range(0, states.shape[1], HIDDEN)]


def _entropy_bound(packed: list[np.ndarray]) -> tuple[float, float]:
    """(zero-order entropy of the FP8 codes in bits, the bf16-vs-FP8 ratio a lossless stage
    reaching it with the scales stored raw would give): a lossless stage beats it only where
    codes depend on each other (real states do; N(0,1) draws do not)."""
    from dfcache import fp8

    codes = np.concatenate([p[:, :fp8.hidden_width(p.shape[1])].reshape(-1) for p in packed])
    pr = np.bincount(codes, minlength=256) / max(1, codes.size)
    bits = float(-(pr[pr > 0] * np.log2(pr[pr > 0])).sum())
    rows_scales = sum(p.shape[0] * fp8.SCALE_BYTES for p in packed)
    return bits, 2 * codes.size / (codes.size * bits / 8 + rows_scales)


def _tau(ctx: Ctx, root) -> dict | None:
    """compare-backends --codec none --codec fp8-e4m3 on the example (None, logged, if it cannot run)."""
    try:
        from dfcache.store import open_store
        from runner.core.options import EvalOptions
        from runner.models.example import example_models
        from runner.trust.compare_backends import run_compare

        store = open_store(root / "tau-store")
        models = example_models(root / "tau-store" / "example", log=ctx.log)
        opts = EvalOptions(target=str(models["target"]), drafters=[str(models["trained"])], prompts="builtin:coding",
                           num_prompts=8, max_new_tokens=64, backend="torch", device="cpu", dtype="bfloat16",
                           tree_budgets=[4, 8], progress=False)
        return run_compare(store, opts, ["torch"], codecs=["none", "fp8-e4m3"])
    except Exception as e:  # the example could not be built here: the size rows still stand
        ctx.log(f"τ rows skipped: {type(e).__name__}: {e}")
        return None


def run(ctx: Ctx) -> Result:
    import torch

    from dfcache import fp8
    from dfcache.keys import compute_key
    from dfcache.store import open_store

    from . import size
    from ._data import make_hidden, specforge_path, specforge_samples, specforge_write

    tokens = max(size.SEQ, int(size.BASE_TOKENS * ctx.factor))
    reps = ctx.reps_or(5)
    ctx.log(f"tiny target forward over {tokens} tokens")
    real, info = size.tiny_states(ctx, tokens)
    gen = torch.Generator().manual_seed(0)
    noise = torch.randn(tokens, real.shape[1], generator=gen).to(torch.bfloat16).view(torch.uint16).numpy()
    root = ctx.tmpdir("fp8")
    store = open_store(root / "store")
    counter = itertools.count()
    sizes: dict[str, int] = {}
    bound: dict[str, tuple[float, float]] = {}

    def write(layers: list[np.ndarray], dtype: str, codec: str, tag: str | None = None) -> float:
        key = compute_key("bench_fp8", 1, {"n": next(counter)})

        def w():
            with store.writer(key, stage="hidden_states", stage_version=1, inputs={"n": key}) as wr:
                for i, a in enumerate(layers):
                    wr.write_array(f"l{i}", a, dtype=dtype, codec=codec)
        t = clock(w)
        if tag:
            sizes[tag] = sum(s for f, s in store.backend.list_files(key).items() if "/c/" in f)
        store.delete(key)
        return t

    variants = {"none": ("bfloat16", "none"), "shuffle-zstd": ("bfloat16", "shuffle-zstd"),
                "fp8-e4m3": (fp8.FP8_DTYPE, "none"), "fp8-e4m3+zstd": (fp8.FP8_DTYPE, "zstd"),
                "fp8-e4m3+shuffle-zstd": (fp8.FP8_DTYPE, "shuffle-zstd"),
                "fp8-e4m3+bitshuffle-lz4": (fp8.FP8_DTYPE, "bitshuffle-lz4")}
    for src, data in (("real", real), ("noise", noise)):
        bf16 = _layers(data)
        packed = [fp8.quantize(a) for a in bf16]
        bound[src] = _entropy_bound(packed)
        for name, (dtype, codec) in variants.items():
            write(packed if dtype == fp8.FP8_DTYPE else bf16, dtype, codec, f"{src}:{name}")
    per_tok = {k: v / tokens for k, v in sizes.items()}

    # write throughput on >= 64 MB of bf16 (tiled real states)
    tile = max(1, -(-int(READ_BYTES * ctx.factor) // real.nbytes))
    big = _layers(np.tile(real, (tile, 1)))
    big_packed = [fp8.quantize(a) for a in big]
    big_t = [torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) for a in big]
    times = alternate({
        "none": lambda: write(big, "bfloat16", "none"),
        "fp8": lambda: write(big_packed, fp8.FP8_DTYPE, "none"),
        "fp8+zstd": lambda: write(big_packed, fp8.FP8_DTYPE, "zstd"),
        "fp8_hostq": lambda: clock(lambda: [fp8.quantize_torch(t) for t in big_t]) +
        write(big_packed, fp8.FP8_DTYPE, "none"),
    }, reps, log=ctx.log)
    B = sum(a.nbytes for a in big)
    m = {k: med(v) for k, v in times.items()}

    # warm one-sample read, dequantized, vs torch.load of the bf16 SpecForge file
    h = make_hidden(int(READ_BYTES * ctx.factor), lengths=(1024, 3072), seed=1)
    sf_root = root / "specforge"
    sf_root.mkdir()
    specforge_write(sf_root, specforge_samples(h))
    key = compute_key("bench_fp8_read", 1, {})
    with store.writer(key, stage="hidden_states", stage_version=1, inputs={}) as w:
        w.write_array("hidden", fp8.quantize(h.states), dtype=fp8.FP8_DTYPE)
    import time

    from dfcache.store._reader import RACY_NS

    time.sleep(RACY_NS / 1e9 + 0.2)
    arr = store.open(key).array("hidden")
    off = h.offsets
    rng = np.random.default_rng(7)
    picks = [int(i) for i in rng.integers(0, len(h.lengths), ctx.reps_or(20))]

    def as_bf16(bits):
        return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)

    def casts(raw):
        codes, scales = fp8.unpack(raw)
        return fp8._dequantize_casts(codes, scales.reshape(-1, 1))

    def hs_connectors(raw):  # their reader's expression in torch, on our packed rows
        codes, scales = fp8.unpack(raw)
        t = torch.from_numpy(codes.view(np.uint8)).view(torch.float8_e4m3fn)
        return t.to(torch.bfloat16) * torch.from_numpy(scales).to(torch.bfloat16)[:, None]

    # the read variants, side by side per sample (rotated), at one torch thread (issue 33's target
    # is judged at one thread; a 2-core machine reads on the caller's thread, _read_workers): the
    # shipped read (torch's kernels where torch is imported: int16 bit moves and one bf16
    # multiply, dfcache/fp8.py), numpy's integer and float32 ufuncs (what a process without torch
    # runs, and the read before), the ml_dtypes casts, hs-connectors' torch expression, the packed
    # rows alone (what fp8="raw" reads: the floor), and torch.load of the bf16 file
    # (bench/fp8_variants.py measures more candidates: lookup tables, block sizes, the NaN check)
    torch.set_num_threads(1)  # the harness restores the default after this benchmark

    def rows_of(i):
        return int(off[i]), int(off[i + 1])

    def numpy_kernels(raw):
        codes, scales = fp8.unpack(raw)
        return fp8._dequantize_numpy(codes, scales.reshape(-1, 1))

    readers = {
        "dfc": lambda i: as_bf16(arr.read(*rows_of(i))),
        "dfc_numpy": lambda i: as_bf16(numpy_kernels(arr.read_raw(*rows_of(i)))),
        "casts": lambda i: as_bf16(casts(arr.read_raw(*rows_of(i)))),
        "torch": lambda i: hs_connectors(arr.read_raw(*rows_of(i))),
        "raw": lambda i: arr.read_raw(*rows_of(i)),
        "sf": lambda i: torch.load(specforge_path(sf_root, i), weights_only=True)["hidden_states"],
    }
    t_read: dict[str, list[float]] = {k: [] for k in readers}
    cpu: dict[str, list[float]] = {k: [] for k in readers}  # CPU seconds (user + sys, all threads)
    names = list(readers)
    for j, i in enumerate(picks):
        for name in names[j % len(names):] + names[:j % len(names)]:
            t_read[name].append(clock_cpu(lambda: readers[name](i), cpu[name]))
    x = arr.read_raw(*rows_of(picks[0]))
    assert all(np.array_equal(arr.read(*rows_of(picks[0])).view(np.uint16), y) for y in (
        casts(x), numpy_kernels(x), hs_connectors(x).view(torch.int16).numpy().view(np.uint16))), \
        "the read variants' bits differ"
    t_dfc, t_sf = t_read["dfc"], t_read["sf"]
    c = {k: med(v) for k, v in cpu.items()}
    tok_mean = float(np.mean([h.lengths[i] for i in picks]))
    tau = _tau(ctx, root)
    rmtree(root)

    rows = []
    for src, what in (("real", f"tiny Qwen3.5 states (3 layers x {HIDDEN})"), ("noise", "N(0,1) bf16, same shape")):
        base = sizes[f"{src}:none"]
        rows.append(Row(NAME, f"bytes/token, {what}: fp8-e4m3 vs bf16 none", f"{per_tok[f'{src}:fp8-e4m3']:.0f} B/token",
                        f"{per_tok[f'{src}:none']:.0f} B/token", base / sizes[f"{src}:fp8-e4m3"], target=2.0,
                        note=f"2H/(H+4) = {2 * HIDDEN / (HIDDEN + 4):.3f}x is the most a per-token float32 scale allows "
                             "at this H (1.998x at H = 4096): 2.0x is out of reach unless scales are shared"))
        best = min(("fp8-e4m3+zstd", "fp8-e4m3+shuffle-zstd", "fp8-e4m3+bitshuffle-lz4"), key=lambda n: sizes[f"{src}:{n}"])
        rows.append(Row(NAME, f"bytes/token, {what}: {best} vs bf16 none", f"{per_tok[f'{src}:{best}']:.0f} B/token",
                        f"{per_tok[f'{src}:none']:.0f} B/token", base / sizes[f"{src}:{best}"], target=2.5,
                        note=f"the codes' zero-order entropy: {bound[src][0]:.2f} bits/code, {bound[src][1]:.2f}x with raw "
                             "scales, the most any lossless stage reaches on independent draws (N(0,1)); "
                             "the best FP8 + lossless; others: " + ", ".join(
                            f"{n} {base / sizes[f'{src}:{n}']:.3f}x" for n in variants if n not in ("none", best))))
    rows += [
        Row(NAME, "write (fsync), tiny states tiled: fp8-e4m3 (quantized on the device) vs bf16 none",
            gbps(B, m["fp8"]), gbps(B, m["none"]), m["none"] / m["fp8"], target=0.8,
            note=f"{B / 1e6:.0f} MB of bf16 input; the packed rows as extraction hands them over"),
        Row(NAME, "write (fsync): fp8-e4m3+zstd vs bf16 none", gbps(B, m["fp8+zstd"]), gbps(B, m["none"]),
            m["none"] / m["fp8+zstd"]),
        Row(NAME, "write (fsync): torch quantization on the host + fp8-e4m3 vs bf16 none (CPU extraction)",
            gbps(B, m["fp8_hostq"]), gbps(B, m["none"]), m["none"] / m["fp8_hostq"],
            note="torch's CPU cast to float8_e4m3fn is scalar code: a CPU extraction pays it (its forward is far slower)"),
        # Judged by CPU time, as the read benchmark (issue 36): on the busy 2-core VM a warm read's
        # wall time is mostly waiting for a core; the wall-time ratio is the next row.
        Row(NAME, f"one sample (~{tok_mean:.0f} tokens x 4096), warm, CPU time at one thread: dfcache read "
            "dequantized to bf16 vs torch.load bf16", ms(c["dfc"]), ms(c["sf"]), c["sf"] / c["dfc"], target=1.0,
            note="torch's kernels (torch imported): int8 -> int16, << 4, & 0x87F0, a NaN-code check, one bf16 multiply "
                 "over 1 M-value blocks (dfcache/fp8.py); 4 passes over 2-byte values per output value where "
                 "torch.load copies 2 B once: the packed rows alone ('raw') plus one copy of the output bound any "
                 "numpy/ATen composition (bench/fp8_variants.py)"),
        Row(NAME, f"one sample (~{tok_mean:.0f} tokens x 4096), warm, wall time: dfcache read dequantized to bf16 vs "
            "torch.load bf16", ms(med(t_dfc)), ms(med(t_sf)), med(t_sf) / med(t_dfc),
            note="speed ratio (a busy machine's wall time: INFO)"),
    ]
    for v, what in (("dfc_numpy", "numpy's integer + float32 ufuncs (a process without torch; the read before)"),
                    ("casts", "ml_dtypes casts float8 -> float32 -> bf16 (the reference)"),
                    ("torch", "hs-connectors' torch expression fp8.to(bf16) * scale.to(bf16)"),
                    ("raw", "the packed rows alone, not dequantized (fp8='raw': the floor)")):
        rows.append(Row(NAME, f"one sample, warm, CPU time, read variant: {what} vs torch.load bf16", ms(c[v]),
                        ms(c["sf"]), c["sf"] / c[v], note=f"wall {ms(med(t_read[v]))} vs {ms(med(t_sf))} "
                                                          f"({med(t_sf) / med(t_read[v]):.2f}x)"))
    if tau is not None:
        (d,) = tau["drafters"]
        exact, lossy = (d["evals"][b] for b in tau["backends"])
        err = ", ".join(f"L{x['layer']} {x['rel_l2']:.4f}" for x in tau["layers"])
        for budget in (None, "4", "8"):
            a = exact["tau_chain"] if budget is None else exact["tau_tree"][budget]
            b = lossy["tau_chain"] if budget is None else lossy["tau_tree"][budget]
            rows.append(Row(NAME, f"τ {'chain' if budget is None else 'tree-' + budget}, example's trained drafter: "
                                  "fp8-e4m3 vs bf16 states", f"{b:.3f}", f"{a:.3f}", b / a,
                            note=f"Δτ {b - a:+.3f}; {exact['blocks']} blocks, 8 prompts x 64 tokens, CPU; per-layer "
                                 f"rel_l2 of the FP8 states: {err}; beside 1.94x fewer bytes (FP8 alone)"))
    for r in rows:
        r.judge()
    return Result(rows, {"tau": tau, "tokens": tokens, "data": info, "bytes": sizes, "bytes_per_token": per_tok,
                         "write_bytes": B, "seconds": {k: summary(v) for k, v in times.items()},
                         "read_ms": {k: summary(v) for k, v in t_read.items()},
                         "read_cpu_seconds": {k: summary(v) for k, v in cpu.items()}})
