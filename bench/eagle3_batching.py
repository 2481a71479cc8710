"""`eagle3-batching`: EAGLE-3 chain drafts for every root of a sequence, batched
(``runner.drafters.eagle3.score_roots``: the first step's keys of all positions in one causal
pass, the later steps of a chunk of roots per pass) vs one root at a time
(``draft_one_root``: what the online loop runs, the context projected and attended for each
root). Same drafter, features and roots; the drafts must be equal and the logits agree (checked).

Setup: the tiny Qwen3.5 target's embedding (``runner.models.tiny.build_tiny_target``), a one-layer
EAGLE-3 drafter (hidden 128, 4 heads, a 256-token draft vocabulary through d2t) with
deterministic random weights, float32, random features for 512 tokens (x factor), roots
1..T-1, chain depth 5. Torch's default thread count, and one thread beside it.
"""

from __future__ import annotations

from ._common import Ctx, Result, Row, alternate, med, ms, rmtree, skipped, summary

NAME = "eagle3-batching"
BASE_TOKENS = 512
DEPTH = 5


def run(ctx: Ctx) -> Result:
    measure = "EAGLE-3 chain drafts of all roots: batched score_roots vs one root at a time"
    try:
        from runner.drafters import eagle3 as E
        E.score_roots, E.draft_one_root  # noqa: B018
    except (ImportError, AttributeError) as e:
        return Result([skipped(NAME, measure, f"SKIPPED: runner.drafters.eagle3 not available ({type(e).__name__}: {e})")])
    import torch

    reps = ctx.reps_or(3)
    T = min(2048, max(64, int(BASE_TOKENS * ctx.factor)))
    drafter, head = make_drafter(E, ctx.tmpdir("eagle3-batching"))
    threads = torch.get_num_threads()
    rows, details = [], {"reps": reps, "threads": threads, "depth": DEPTH, "runs": {}}
    try:
        for n_threads, is_main in ([(1, False), (threads, True)] if threads > 1 else [(1, True)]):
            torch.set_num_threads(n_threads)
            r, det = _compare(ctx, E, drafter, head, T, reps, n_threads)
            r.measure = f"{measure} ({T - 1} roots, depth {DEPTH}, {n_threads} torch thread{'s' * (n_threads > 1)})"
            if is_main:
                r.target, r.direction = 10.0, ">="
            rows.append(r.judge())
            details["runs"][f"{T}x{n_threads}"] = det
        # EAGLE's dynamic tree (top-k 4, 5 steps, 16 draft tokens), batched vs per root: printed
        torch.set_num_threads(threads)
        r, det = _compare_trees(ctx, E, drafter, head, max(64, T // 2), reps)
        rows.insert(0, r)
        details["runs"]["tree"] = det
    finally:
        torch.set_num_threads(threads)
    rows.reverse()
    return Result(rows, details)


def _compare_trees(ctx: Ctx, E, drafter, head, T: int, reps: int):
    import time

    import torch

    gen = torch.Generator().manual_seed(T)
    feats = torch.randn(T, 3 * head.hidden_size, generator=gen)
    ids = torch.randint(4, head.vocab_size, (T,), generator=gen)
    roots = list(range(1, T))
    out = {}

    def batched() -> float:
        t = time.perf_counter()
        out["batched"] = E.dynamic_trees(drafter, head, feats, ids, roots, 4, 5, 16)
        return time.perf_counter() - t

    def one() -> float:
        t = time.perf_counter()
        out["one"] = [E.dynamic_tree(drafter, head, feats, ids.tolist(), p, 4, 5, 16) for p in roots]
        return time.perf_counter() - t

    times = alternate({"batched": batched, "one_at_a_time": one}, max(1, reps - 1), log=ctx.log)
    same = sum((a.tokens, a.parents) == (b.tokens, b.parents) for a, b in zip(out["batched"], out["one"]))
    if same != len(roots):
        raise AssertionError(f"batched and per-root EAGLE trees differ at {len(roots) - same} of {len(roots)} roots")
    m = {k: med(v) for k, v in times.items()}
    row = Row(NAME, f"EAGLE-3 dynamic trees (top-k 4, 5 steps, 16 tokens) of all roots: dynamic_trees vs per root "
              f"({T - 1} roots)", ms(m["batched"]), ms(m["one_at_a_time"]), m["one_at_a_time"] / m["batched"],
              note=f"speed-up; the same tree at all {same} roots")
    return row.judge(), {"tokens": T, "roots": len(roots), "trees_equal": same,
                         "seconds": {k: summary(v) for k, v in times.items()}}


def make_drafter(E, d):
    import torch

    from runner.drafters.dflash import load_target_head
    from runner.models.tiny import build_tiny_target

    d.mkdir(parents=True, exist_ok=True)
    build_tiny_target(d / "target")
    head = load_target_head(d / "target")
    H, V = head.hidden_size, head.vocab_size
    cfg = E.Eagle3Config(hidden_size=H, target_hidden_size=H, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=H // 4, intermediate_size=2 * H, rms_norm_eps=1e-6, rope_theta=10000.0,
                         vocab_size=V, draft_vocab_size=256, target_layer_ids=[1, 3, 5])
    drafter = E.init_eagle3_weights(E.Eagle3Drafter(cfg), seed=0, std=0.1).eval()
    drafter.d2t = torch.arange(0, 2 * 256, 2) % V - torch.arange(256)
    rmtree(d)
    return drafter, head


def _compare(ctx: Ctx, E, drafter, head, T: int, reps: int, threads: int):
    import time

    import torch

    gen = torch.Generator().manual_seed(T)
    feats = torch.randn(T, 3 * head.hidden_size, generator=gen)
    ids = torch.randint(4, head.vocab_size, (T,), generator=gen)
    roots = list(range(1, T))
    out = {}

    def batched() -> float:
        t = time.perf_counter()
        out["batched"] = E.score_roots(drafter, head, feats, ids, roots, DEPTH)
        return time.perf_counter() - t

    def one() -> float:
        t = time.perf_counter()
        res = [E.draft_one_root(drafter, head, feats, ids.tolist(), p, DEPTH) for p in roots]
        out["one"] = (torch.tensor([r[0] for r in res]), torch.stack([r[1] for r in res]))
        return time.perf_counter() - t

    times = alternate({"batched": batched, "one_at_a_time": one}, reps, log=ctx.log)
    same = bool((out["batched"][0] == out["one"][0]).all())
    diff = (out["batched"][1] - out["one"][1]).abs().max().item()
    if not same or diff > 1e-3:
        raise AssertionError(f"batched and one-root-at-a-time EAGLE-3 drafts differ: drafts equal {same}, "
                             f"max |logit diff| {diff:.3g}")
    m = {k: med(v) for k, v in times.items()}
    row = Row(NAME, "", ms(m["batched"]), ms(m["one_at_a_time"]), m["one_at_a_time"] / m["batched"],
              note=f"speed-up; same drafts at every root and step, max |logit diff| {diff:.2g}; "
              f"{threads} torch thread{'s' * (threads > 1)}")
    return row, {"tokens": T, "roots": len(roots), "max_abs_diff": diff, "drafts_equal": same,
                 "seconds": {k: summary(v) for k, v in times.items()}}
