"""Real greedy speculative decoding, and `dfcache parity`: online against the offline eval, block by block.

The online loops here are written the way z-lab/dflash HEAD's ``dflash_generate`` runs DFlash
(``/work/shared/reference/dflash.md`` §2.1, §7): draft a block ``[root, MASK x (B-1)]`` from the
context features committed so far, verify it with a target forward, accept the matching prefix
plus the bonus token, append the accepted positions' target features to the context, repeat.
:func:`reference_draft` computes a draft the way ``DFlashDraftModel.forward`` does (keys/values =
cat(context, block), RoPE at absolute positions), independently of the batched attention code in
:mod:`runner.models.dflash` that the offline eval uses; only the weights are shared.

The loops re-run the target over the whole prefix each round instead of keeping a KV cache:
gated-DeltaNet targets (Qwen3.5/3.6) have a recurrent state that cannot be cropped back after a
rejected draft. The tokens verified and the features appended are the same as with a cache.

DDTree (:func:`online_ddtree`, §3): the tree is built from the block's draft logits with the
reference heap; greedy verification accepts the longest root path that follows the target's own
argmax, so the loop follows the tree node by node with one target forward per accepted depth
(what ``follow_verified_tree`` accepts from a tree-masked forward, without a tree mask, which
linear-attention targets cannot run).

`dfcache parity` runs the normal eval graph (local greedy completions, tokens, hidden states,
drafter eval; whatever is cached is reused) and the online loops on the same prompt ids, and
compares each online block with the offline value at the same root. The online walk counts the
whole last block (HEAD); it is converted to the eval's within-output rule (capped at the
completion, no block on the last token) before comparing. In float32 every block must match
(dflash.md §7: "offline equals online in float32"); in bfloat16 the agreement rate is reported.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dfcache.errors import BadInputError, UsageError

__all__ = ["reference_draft", "target_pass", "online_dflash", "online_ddtree", "greedy_continuation",
           "ParityOptions", "ParityResult", "run_parity", "compare_blocks", "format_parity"]


# --------------------------------------------------------------------------------------------
# The online loops
# --------------------------------------------------------------------------------------------

def _rotate_half(x):
    import torch

    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def reference_draft(drafter, head, ctx_features, block_ids, start: int):
    """One draft call as ``DFlashDraftModel.forward`` does it: keys/values = cat(context, block).

    RoPE at absolute positions 0..start+B-1, no mask on full-attention layers, causal + window on
    sliding layers (or as ``is_causal`` says). Returns draft logits [B-1, V] for slots 1..B-1.
    """
    import torch
    import torch.nn.functional as F

    cfg = drafter.config
    dt = drafter.dtype
    B, hd = block_ids.shape[0], cfg.head_dim
    nh, kvh = cfg.num_attention_heads, cfg.num_key_value_heads
    dev = drafter.device
    z = drafter.hidden_norm(drafter.fc(ctx_features.to(device=dev, dtype=dt)))
    h = F.embedding(block_ids.to(dev), head.embed_tokens).to(dt)
    if cfg.input_embedding_scale != 1.0:
        h = h * cfg.input_embedding_scale
    pos = torch.arange(start + B, device=dev)
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, device=dev).float() / hd))
    ang = pos[:, None].float() * inv_freq
    cos, sin = torch.cat([ang, ang], -1).cos().to(dt), torch.cat([ang, ang], -1).sin().to(dt)
    for i, layer in enumerate(drafter.layers):
        a = layer.self_attn
        x = layer.input_layernorm(h)
        q = a.q_norm(a.q_proj(x).view(B, nh, hd)).transpose(0, 1)
        both = torch.cat([z, x])
        k = a.k_norm(a.k_proj(both).view(-1, kvh, hd)).transpose(0, 1)
        v = a.v_proj(both).view(-1, kvh, hd).transpose(0, 1)
        q = q * cos[start:] + _rotate_half(q) * sin[start:]
        k = k * cos + _rotate_half(k) * sin
        sliding = cfg.layer_types[i] == "sliding_attention"
        causal = sliding if cfg.is_causal is None else cfg.is_causal
        mask = None
        if causal or sliding:
            qp, kp = pos[start:, None], pos[None, :]
            mask = torch.ones(B, start + B, dtype=torch.bool, device=dev)
            if causal:
                mask &= kp <= qp
            if sliding:
                mask &= (qp - kp < cfg.sliding_window) & (kp - qp < cfg.sliding_window)
        g = nh // kvh
        o = F.scaled_dot_product_attention(q[None].float(), k.repeat_interleave(g, 0)[None].float(),
                                           v.repeat_interleave(g, 0)[None].float(), attn_mask=mask)
        h = h + a.o_proj(o[0].transpose(0, 1).reshape(B, -1).to(dt))
        y = layer.post_attention_layernorm(h)
        h = h + layer.mlp.down_proj(F.silu(layer.mlp.gate_proj(y)) * layer.mlp.up_proj(y))
    logits = (drafter.norm(h[1:]) @ head.lm_head.to(dt).T).float()
    if cfg.output_multiplier != 1.0:
        logits = logits * cfg.output_multiplier
    if cfg.final_logit_softcapping:
        logits = torch.tanh(logits / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
    return logits


def target_pass(model, ids, layer_ids):
    """One full target forward: (greedy next token at every position [T], features [T, n*H])."""
    from .train_tiny import capture_features

    logits, feats = capture_features(model, ids, layer_ids)
    return logits.argmax(-1).cpu(), feats


def _stopped(out, P: int, start: int, stop_ids) -> bool:
    return any(t in stop_ids for t in out[P:start + 1])


def _completion(out, P: int, start: int, max_length: int, stop_ids) -> list[int]:
    completion = out[P:min(start + 1, max_length)]
    for i, t in enumerate(completion):
        if t in stop_ids:
            return completion[:i + 1]
    return completion


def _prefill(model, drafter, prompt: list[int], max_new_tokens: int, rebind):
    """The target's pass over the prompt both decoders start with: (out, P, max_length, feats),
    ``out`` the prompt, the committed prefill token, then MASK up to a last full block."""
    B, mask_id = drafter.block_size, drafter.mask_token_id
    P = len(prompt)
    out = list(prompt) + [mask_id] * (max_new_tokens + B)
    if rebind:
        rebind()
    post, feats = target_pass(model, prompt, drafter.target_layer_ids)
    out[P] = int(post[-1])  # prefill token: committed, not a block
    return out, P, P + max_new_tokens, feats


def online_dflash(model, drafter, head, prompt: list[int], max_new_tokens: int, stop_ids, *, rebind=None):
    """Greedy DFlash decoding (z-lab/dflash HEAD 44947fb rules).

    Returns (completion, [(root, value)] per block, {root: draft logits}).
    """
    import torch

    B, layer_ids = drafter.block_size, drafter.target_layer_ids
    with torch.no_grad():
        out, P, max_length, feats = _prefill(model, drafter, prompt, max_new_tokens, rebind)
        ctx = feats                                  # features of positions < start
        start, blocks, draft_logits = P, [], {}
        from .stages.drafter_eval.metrics import chain_accept

        while start < max_length:
            block = out[start:start + B]
            draft_logits[start] = reference_draft(drafter, head, ctx, torch.tensor(block), start)
            block[1:] = draft_logits[start].argmax(-1).tolist()
            if rebind:
                rebind()
            post, feats = target_pass(model, out[:start] + block, layer_ids)
            post = post[start:].tolist()
            acc = chain_accept(block[1:], post[:-1])
            out[start:start + acc + 1] = block[:acc + 1]
            out[start + acc + 1] = post[acc]
            ctx = torch.cat([ctx, feats[start:start + acc + 1]])
            blocks.append((start, acc + 1))
            start += acc + 1
            if _stopped(out, P, start, stop_ids):
                break
    return _completion(out, P, start, max_length, stop_ids), blocks, draft_logits


def online_ddtree(model, drafter, head, prompt: list[int], max_new_tokens: int, stop_ids, budget: int, *,
                  rebind=None):
    """Greedy DDTree decoding with budget ``budget``: (completion, [(root, value)] per block)."""
    import torch

    from .stages.drafter_eval.metrics import build_ddtree, topk_log_probs

    B, layer_ids = drafter.block_size, drafter.target_layer_ids
    with torch.no_grad():
        out, P, max_length, feats = _prefill(model, drafter, prompt, max_new_tokens, rebind)
        ctx, start, blocks = feats, P, []
        while start < max_length:
            logits = reference_draft(drafter, head, ctx, torch.tensor(out[start:start + B]), start)
            lp, ids = topk_log_probs(logits, budget)
            tree = build_ddtree(lp, ids, budget, vocab_size=logits.shape[-1])
            seq, node = out[:start + 1], 0
            while True:
                if rebind:
                    rebind()
                post, feats = target_pass(model, seq, layer_ids)
                nxt = int(post[-1])
                child = tree.child_maps[node].get(nxt)
                if child is None:
                    break
                node = child
                seq.append(nxt)
            acc = len(seq) - (start + 1)
            out[start + 1:start + acc + 1] = seq[start + 1:]
            out[start + acc + 1] = nxt
            ctx = torch.cat([ctx, feats[start:start + acc + 1]])
            blocks.append((start, acc + 1))
            start += acc + 1
            if _stopped(out, P, start, stop_ids):
                break
    return _completion(out, P, start, max_length, stop_ids), blocks


def greedy_continuation(model, seq: list[int], n: int) -> list[int]:
    """The target's next n greedy tokens after ``seq``, not stopping at EOS (what HEAD verifies past the end)."""
    import torch

    seq = list(seq)
    dev = next(model.parameters()).device
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq], device=dev)).logits[0, -1].argmax()))
    return seq[-n:]


def within_output(blocks: list[tuple[int, int]], prompt_len: int, completion_len: int) -> list[tuple[int, int]]:
    """An online (HEAD) walk under the eval's default rule: capped at the completion, no block
    rooted on its last token."""
    last = prompt_len + completion_len - 1
    return [(p, min(v, last - p)) for p, v in blocks if p < last]


# --------------------------------------------------------------------------------------------
# `dfcache parity`
# --------------------------------------------------------------------------------------------

@dataclass
class ParityOptions:
    target: str
    drafter: str
    prompts: str = "builtin:coding"
    num_prompts: int = 4
    max_new_tokens: int = 64
    dtype: str = "float32"
    device: str = "cpu"
    backend: str = "auto"
    attn_implementation: str = "sdpa"
    tree_budgets: list[int] = field(default_factory=list)
    enable_thinking: bool = False
    show_mismatches: int = 5
    progress: bool = False


@dataclass
class MethodParity:
    method: str  # "chain" | "tree-N"
    blocks: int = 0
    matched: int = 0
    mismatches: list[dict] = field(default_factory=list)  # the first few
    mismatch_count: int = 0

    @property
    def rate(self) -> float | None:
        return self.matched / self.blocks if self.blocks else None


@dataclass
class ParityResult:
    dtype: str
    device: str
    eval_key: str
    responses: int
    completions_equal: int
    completion_mismatches: list[dict]
    methods: list[MethodParity]
    tau_online: dict
    tau_offline: dict

    @property
    def exact_required(self) -> bool:
        return self.dtype == "float32"

    @property
    def ok(self) -> bool:
        if not self.exact_required:
            return True
        return self.completions_equal == self.responses and all(m.matched == m.blocks for m in self.methods)

    def to_dict(self) -> dict:
        chain = next(m for m in self.methods if m.method == "chain")
        return {"ok": self.ok, "dtype": self.dtype, "device": self.device, "eval_key": self.eval_key,
                "exact_required": self.exact_required, "responses": self.responses,
                "completions_equal": self.completions_equal, "completion_mismatches": self.completion_mismatches,
                "blocks": chain.blocks, "matched": chain.matched, "agreement": chain.rate,
                "mismatches": chain.mismatches,
                "methods": [{**asdict(m), "agreement": m.rate} for m in self.methods],
                "tau_online": self.tau_online, "tau_offline": self.tau_offline}


def compare_blocks(method: MethodParity, response_id: str, online: list[tuple[int, int]],
                   offline: list[tuple[int, int]], keep: int) -> None:
    """Count online blocks whose root the offline walk also visits with the same value."""
    off = dict(offline)
    for i, (p, v) in enumerate(online):
        method.blocks += 1
        if off.get(p) == v:
            method.matched += 1
            continue
        method.mismatch_count += 1
        if len(method.mismatches) < keep:
            method.mismatches.append({"response": response_id, "block": i, "root": p, "online": v,
                                      "offline": off.get(p)})


def _walk(prompt_len: int, values: list[int]) -> list[tuple[int, int]]:
    out, p = [], prompt_len
    for v in values:
        out.append((p, int(v)))
        p += int(v)
    return out


def _tau(walks: list[list[tuple[int, int]]]) -> float | None:
    means = [sum(v for _, v in w) / len(w) for w in walks if w]
    return sum(means) / len(means) if means else None


def run_parity(store, opts: ParityOptions, log=None) -> ParityResult:
    """Run the eval graph and the online loops on the same prompts; compare them block by block."""
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    from .graph import RunContext, check_offline, resolve
    from .options import EvalOptions
    from .pipeline import build_graph, execute

    # The online side runs where the states are: an explicit device (the eval options also take auto).
    if opts.device not in ("cpu", "cuda"):
        raise UsageError(f"--device {opts.device!r} is not one of cpu, cuda.")
    budgets = sorted({int(b) for b in opts.tree_budgets})
    eopts = EvalOptions(target=opts.target, drafters=[opts.drafter], prompts=opts.prompts,
                        num_prompts=opts.num_prompts, completions="local", max_new_tokens=opts.max_new_tokens,
                        backend=opts.backend, device=opts.device, dtype=opts.dtype, tree_budgets=budgets,
                        enable_thinking=opts.enable_thinking, progress=opts.progress,
                        attn_implementation=opts.attn_implementation,
                        # the offline side runs where the online loop does: float32 parity is exact
                        # only on one device's numerics
                        eval_device=opts.device).validate()
    ctx = RunContext(store, eopts, argv=["run", "eval", "--target", opts.target, "--drafter", opts.drafter])
    nodes = resolve(ctx, build_graph(ctx, "eval"))
    check_offline(ctx, nodes)
    log(f"parity: offline side: {sum(1 for n in nodes if n.status not in ('cached', 'not needed'))} of "
        f"{len(nodes)} stages to produce")
    execute(ctx, nodes)
    ev = next(n for n in nodes if n.stage == "drafter_eval")
    tokens_node = next(n for n in nodes if n.stage == "tokens")
    from .stages.drafter_eval import read_responses

    responses = read_responses(store, ev)
    hs = [n for n in nodes if n.stage == "hidden_states"]

    import torch

    from .models.dflash import DFlashDrafter, load_target_head
    from .models.resolve import eos_token_ids
    from .models.target import KernelSpec
    from .stages.hidden_states import get_target
    from .stages.tokens import read_tokens

    backend = KernelSpec(**hs[0].inputs["backend"])
    target_dir = tokens_node.payload["target_dir"]
    target = get_target(ctx, target_dir, backend)
    dtype = torch.float32 if opts.dtype == "float32" else torch.bfloat16
    dev = target.device
    drafter = DFlashDrafter.from_pretrained(Path(opts.drafter).expanduser(), device=dev, dtype=dtype)
    head = load_target_head(target_dir, device=dev, dtype=dtype)
    toks = read_tokens(store, tokens_node)
    stops = eos_token_ids(target_dir)
    methods = [MethodParity("chain")] + [MethodParity(f"tree-{b}") for b in budgets]
    completions_equal, comp_mismatch = 0, []
    on_walks: dict[str, list] = {m.method: [] for m in methods}
    off_walks: dict[str, list] = {m.method: [] for m in methods}
    bar = ctx.progress(len(responses), desc="parity: online decoding", unit="resp")
    for i, resp in enumerate(responses):
        prompt = [int(t) for t in toks.prompt(i)]
        stored = [int(t) for t in toks.completion(i)][: resp["completion_len"]]
        completion, blocks, _ = online_dflash(target.model, drafter, head, prompt, opts.max_new_tokens, stops,
                                              rebind=target.rebind)
        if completion == stored:
            completions_equal += 1
        else:
            at = next((j for j, (a, b) in enumerate(zip(completion, stored)) if a != b), min(len(completion), len(stored)))
            comp_mismatch.append({"response": resp["id"], "position": len(prompt) + at,
                                  "online_len": len(completion), "offline_len": len(stored)})
        P = len(prompt)
        on = within_output(blocks, P, len(completion))
        off = _walk(P, resp["chain"])
        compare_blocks(methods[0], resp["id"], on, off, opts.show_mismatches)
        on_walks["chain"].append(on)
        off_walks["chain"].append(off)
        for m, b in zip(methods[1:], budgets):
            comp_t, tblocks = online_ddtree(target.model, drafter, head, prompt, opts.max_new_tokens, stops, b,
                                            rebind=target.rebind)
            on_t = within_output(tblocks, P, len(comp_t))
            off_t = _walk(P, resp["tree"][str(b)])
            compare_blocks(m, resp["id"], on_t, off_t, opts.show_mismatches)
            on_walks[m.method].append(on_t)
            off_walks[m.method].append(off_t)
        bar.update(1)
    bar.close()
    if not responses:
        raise BadInputError("parity: the eval has no responses; check --prompts and --num-prompts.")
    return ParityResult(dtype=opts.dtype, device=str(dev.type), eval_key=ev.key, responses=len(responses),
                        completions_equal=completions_equal, completion_mismatches=comp_mismatch,
                        methods=methods, tau_online={k: _tau(v) for k, v in on_walks.items()},
                        tau_offline={k: _tau(v) for k, v in off_walks.items()})


def format_parity(res: ParityResult) -> str:
    lines = [f"parity ({res.dtype}, {res.device}): {res.responses} response(s), eval {res.eval_key[:12]}",
             f"completions: {res.completions_equal}/{res.responses} online completions equal the cached greedy ones"]
    for c in res.completion_mismatches[:5]:
        lines.append(f"  {c['response']}: differs from position {c['position']}")
    lines.append(f"{'method':<10} {'blocks':>7} {'matched':>8} {'agree':>7} {'τ online':>9} {'τ offline':>10}")
    for m in res.methods:
        rate = "-" if m.rate is None else f"{100 * m.rate:.1f}%"
        ton, toff = res.tau_online.get(m.method), res.tau_offline.get(m.method)
        lines.append(f"{m.method:<10} {m.blocks:>7} {m.matched:>8} {rate:>7} "
                     f"{'-' if ton is None else f'{ton:.3f}':>9} {'-' if toff is None else f'{toff:.3f}':>10}")
        for mm in m.mismatches:
            lines.append(f"  first mismatches: {mm['response']} block {mm['block']} at position {mm['root']}: "
                         f"online {mm['online']}, offline {mm['offline'] if mm['offline'] is not None else 'no block here'}")
    if res.exact_required:
        lines.append("OK: offline equals online on every block" if res.ok else
                     "FAIL: in float32 offline must equal online on every block")
    else:
        lines.append(f"{res.dtype}: agreement is reported, not required (bf16 online decoding drifts from plain greedy)")
    return "\n".join(lines)
