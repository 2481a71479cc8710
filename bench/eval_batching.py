"""`eval-batching`: draft logits for every block root of a sequence, batched
(``runner.drafters.dflash.score_roots``: context keys/values once, many roots per pass) vs one
block at a time (``score_roots_one_at_a_time``: the reference that re-projects the context for
each root, as the online loop does). Same drafter, same context features, same roots; the two
must agree (checked). Imported lazily: SKIPPED if the module or functions are absent.

Setup: the tiny Qwen3.5 target's embedding/LM head (``runner.models.tiny.build_tiny_target``), a
2-layer DFlash drafter (hidden 128, block 16, target layers 0/2/4) with deterministic random
weights, float32, random context features for 512 tokens (x factor; and a quarter of that,
printed), roots 1..T-1. The target row pins both sides to one torch thread (issue 36): the
batched calls scale over cores and the reference's small one-block calls hardly do (16-core Xeon
host: 7.7x at 1 thread, 11.4x at 2, 15.7x at 16), and on a busy 2-core machine the reference's
oversubscription (OpenMP spin-waiting while a colleague's job runs) inflated the default-thread
ratio from 8.3x to 22.5x: a figure of the machine's load, not of the batching. Judged by CPU
time (this process's user + system seconds; the wall time is in the details). The same at
torch's default thread count (as an eval runs) is printed beside it (INFO).
The speed-up grows with T (the reference re-projects a context of length p for each root p).

The reference re-projects the context for every root, as the parity reference draft does; a
serving loop does not: z-lab's ``dflash_generate`` keeps the context K/V in the draft cache and
projects only the newly accepted rows (reference/dflash.md §1.4). That loop's cost, one block at
a time over context K/V projected once (:func:`score_roots_cached_context`), is printed beside
the target row (INFO): the part of the speed-up that is batching proper, not the saved
re-projection. Same results (checked).
"""

from __future__ import annotations

from ._common import Ctx, Result, Row, alternate, cpu_now, med, ms, profile_top, rmtree, skipped, summary

NAME = "eval-batching"
BASE_TOKENS = 512  # one-at-a-time costs O(T^2): 0.8 s per run at 512 tokens on the 2-core Intel VM
BLOCK = 16


def run(ctx: Ctx) -> Result:
    measure = "draft logits of all block roots, CPU time: batched score_roots vs one block at a time"
    try:
        from runner.drafters import dflash as D
        D.score_roots, D.score_roots_one_at_a_time  # noqa: B018
    except (ImportError, AttributeError) as e:
        return Result([skipped(NAME, measure, f"SKIPPED: runner.drafters.dflash.score_roots / "
                               f"score_roots_one_at_a_time not available ({type(e).__name__}: {e})")])
    import torch

    reps = ctx.reps_or(3)
    T = min(2048, max(64, int(BASE_TOKENS * ctx.factor)))  # O(T^2) reference: 2048 at large
    drafter, head = make_drafter(ctx.tmpdir("eval-batching"))
    threads = torch.get_num_threads()  # torch's default here: what a user's eval runs with
    rows, details = [], {"reps": reps, "threads": threads, "judged_threads": 1, "runs": {}}
    try:
        # The target row at one thread on both sides (the default-thread ratio measures the
        # reference's oversubscription on a busy machine as much as the batching); the default
        # thread count beside it, and a quarter of the length (the speed-up grows with the sequence).
        runs = [(max(32, T // 4), 1, False), (T, threads, False), (T, 1, True)]
        for n_tok, n_threads, is_main in runs if threads > 1 else [runs[0], runs[2]]:
            torch.set_num_threads(n_threads)
            r, det = _compare(ctx, D, drafter, head, n_tok, reps, n_threads)
            r.measure = f"{measure} ({n_tok - 1} roots, {n_tok} tokens, {n_threads} torch thread{'s' * (n_threads > 1)})"
            if is_main:
                r.target, r.direction = 10.0, ">="
            rows.append(r.judge())
            details["runs"][f"{n_tok}x{n_threads}"] = det
        torch.set_num_threads(1)
        r, det = _compare(ctx, D, drafter, head, T, reps, 1, reference=score_roots_cached_context)
        r.measure = (f"{measure} with the context K/V cached, as a serving loop keeps them ({T - 1} roots, "
                     f"{T} tokens, 1 torch thread)")
        rows.append(r.judge())
        details["runs"][f"{T}x1_cached_context"] = det
        details["profile_batched"] = _profile(D, drafter, head, T)
        details["profile_n"] = T
    finally:
        torch.set_num_threads(threads)
    rows = rows[:-1][::-1] + rows[-1:]  # the target row first, the cached-context row last
    return Result(rows, details)


def make_drafter(d):
    """The bench's drafter and the tiny target's head (built in ``d``, which is removed)."""
    from runner.drafters import dflash as D
    from runner.models.tiny import build_tiny_target

    d.mkdir(parents=True, exist_ok=True)
    build_tiny_target(d / "target")
    head = D.load_target_head(d / "target")
    cfg = D.DFlashConfig.from_dict({
        "hidden_size": head.hidden_size, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256, "rms_norm_eps": 1e-6,
        "rope_theta": 1e6, "block_size": BLOCK,
        "dflash_config": {"target_layer_ids": [0, 2, 4], "mask_token_id": 3}}, source="bench")
    drafter = D.init_drafter_weights(D.DFlashDrafter(cfg), seed=0).eval()
    rmtree(d)
    return drafter, head


def make_inputs(head, T: int):
    """Context features [T, 3H], token ids [T] (seeded by T) and roots 1..T-1."""
    import torch

    gen = torch.Generator().manual_seed(T)
    feats = torch.randn(T, 3 * head.hidden_size, generator=gen)
    ids = torch.randint(4, head.vocab_size, (T,), generator=gen)
    return feats, ids, list(range(1, T))


def score_roots_cached_context(drafter, head, context_features, token_ids, roots):
    """One block at a time as a serving loop runs it (z-lab ``dflash_generate``): the context's
    keys/values come from the draft cache, projected once (``context_kv``: a row's bits do not
    depend on how many rows a projection takes), each block attends over ``ctx[:p] ++ its own``.
    Otherwise ``score_roots_one_at_a_time``'s block (full attention: the bench drafter's layers)."""
    import torch
    import torch.nn.functional as F

    cfg, B = drafter.config, drafter.block_size
    if any(layer.is_causal or layer.sliding_window is not None for layer in drafter.layers):
        raise ValueError("score_roots_cached_context runs full bidirectional attention layers only")
    rep = cfg.num_attention_heads // cfg.num_key_value_heads
    token_ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
    with torch.inference_mode():
        ctx_kv = drafter.context_kv(context_features)
        cos_all, sin_all = drafter.rope.cos_sin(torch.arange(context_features.shape[0] + B), drafter.dtype)
        rows = []
        for p in roots:
            cos, sin = cos_all[p:p + B], sin_all[p:p + B]
            h = drafter._block_inputs(head, token_ids[p].reshape(1))[0]            # [B, H]
            for layer, (k_c, v_c) in zip(drafter.layers, ctx_kv):
                x = layer.input_layernorm(h)
                q = layer.q(x, cos, sin)                                            # [nh, B, hd]
                k_b, v_b = layer.kv(x, cos, sin)
                k, v = torch.cat([k_c[:, :p], k_b], dim=1), torch.cat([v_c[:, :p], v_b], dim=1)
                attn = F.scaled_dot_product_attention(q[None], k.repeat_interleave(rep, 0)[None],
                                                      v.repeat_interleave(rep, 0)[None])
                h = h + layer.self_attn.o_proj(attn[0].transpose(0, 1).reshape(B, -1))
                h = h + layer.mlp_forward(layer.post_attention_layernorm(h))
            rows.append(drafter.compute_logits(h[1:], head))
    return torch.stack(rows)


def _compare(ctx: Ctx, D, drafter, head, T: int, reps: int, threads: int, reference=None):
    import time

    import torch

    reference = reference or D.score_roots_one_at_a_time
    feats, ids, roots = make_inputs(head, T)
    out, cpu = {}, {"batched": [], "one_at_a_time": []}

    def c(name, key, fn):
        def go() -> float:
            c0 = cpu_now()
            t = time.perf_counter()
            out[name] = fn(drafter, head, feats, ids, roots)
            dt = time.perf_counter() - t
            cpu[key].append(cpu_now() - c0)
            return dt
        return go

    wall = alternate({"batched": c("batched", "batched", D.score_roots),
                      "one_at_a_time": c("one", "one_at_a_time", reference)}, reps, log=ctx.log)
    # Judged by CPU time (issue 36): on the busy 2-core VM the wall time of either side is mostly
    # waiting for a core; at one thread its CPU time is the work done. Wall time is in the details.
    times = cpu
    diff = (out["batched"] - out["one"]).abs().max().item()
    agree = (out["batched"].argmax(-1) == out["one"].argmax(-1)).float().mean().item()
    if not torch.allclose(out["batched"], out["one"], atol=1e-3, rtol=1e-3):
        raise AssertionError(f"batched and one-at-a-time logits differ at {T} tokens: max |diff| {diff:.3g}")
    m = {k: med(v) for k, v in times.items()}
    w = {k: med(v) for k, v in wall.items()}
    row = Row(NAME, "", ms(m["batched"]), ms(m["one_at_a_time"]), m["one_at_a_time"] / m["batched"],
              note=f"speed-up by CPU time (wall {w['one_at_a_time'] / w['batched']:.2f}x); same results: max |diff| "
              f"{diff:.2g}, argmax agreement {agree * 100:.1f} %; {threads} torch thread{'s' * (threads > 1)}")
    return row, {"tokens": T, "roots": len(roots), "max_abs_diff": diff, "argmax_agreement": agree,
                 "cpu_seconds": {k: summary(v) for k, v in times.items()},
                 "seconds": {k: summary(v) for k, v in wall.items()}}


def _profile(D, drafter, head, T: int) -> list[dict]:
    """cProfile of one batched call, plus torch's operator table (where the time goes inside torch)."""
    feats, ids, roots = make_inputs(head, T)
    prof = profile_top(lambda: D.score_roots(drafter, head, feats, ids, roots), n=12)
    try:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as tp:
            D.score_roots(drafter, head, feats, ids, roots)
        ops = sorted(tp.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
        total = sum(e.self_cpu_time_total for e in tp.key_averages()) or 1
        prof += [{"function": f"torch op {e.key}", "calls": e.count, "tottime_s": round(e.self_cpu_time_total / 1e6, 4),
                  "cumtime_s": round(e.cpu_time_total / 1e6, 4), "share": round(e.self_cpu_time_total / total, 3)}
                 for e in ops]
    except Exception as e:  # the profiler is a nicety; the timing rows stand without it
        prof.append({"function": f"torch profiler unavailable: {type(e).__name__}: {e}", "calls": 0,
                     "tottime_s": 0, "cumtime_s": 0, "share": 0})
    return prof
