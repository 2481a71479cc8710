"""Real greedy speculative decoding, and `dfcache parity`: online against the offline eval, block by block.

The online loops here are written the way z-lab/dflash HEAD's ``dflash_generate`` runs DFlash
(``/work/shared/reference/dflash.md`` §2.1, §7): draft a block ``[root, MASK x (B-1)]`` from the
context features committed so far, verify it with a target forward, accept the matching prefix
plus the bonus token, append the accepted positions' target features to the context, repeat.
:func:`reference_draft` computes a draft the way ``DFlashDraftModel.forward`` does (keys/values =
cat(context, block), RoPE at absolute positions), independently of the batched attention code in
:mod:`runner.drafters.dflash` that the offline eval uses; only the weights are shared.

The target is driven by a verifier. :class:`CachedVerifier` (``--online-loop cache``, the
default) runs it as SGLang and vLLM do: one prefill forward, then one forward over each drafted
block on the KV cache, gated-DeltaNet layers token by token with the state after every token
kept, rolled back to the accepted one (SGLang's target-verify kernel, vLLM's speculative GDN
path). :class:`RecomputeVerifier` (``recompute``) re-runs the whole prefix each round. In exact
arithmetic both verify the same tokens and append the same features; in bf16 each is its own
rounding of them, as is the cached greedy completion (``generate``: one token a forward) and the
offline eval's features (one forward over prompt + completion).

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
(dflash.md §7: "offline equals online in float32"). In bfloat16 an online completion parts from
the cached greedy one wherever the target's two best logits are within a bf16 rounding of each
other, and from there the two sides score different texts; so τ online and τ offline must agree
within the 95% bootstrap interval over prompts of their paired difference (docs/metrics.md,
"bf16 fidelity", has the measurement behind this rule).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dfcache.errors import BadInputError, UsageError

__all__ = ["reference_draft", "target_pass", "online_dflash", "online_ddtree", "greedy_continuation",
           "CachedVerifier", "RecomputeVerifier", "make_verifier", "LOOPS", "OnlineBlock", "serving_features_walk",
           "parting_row_check",
           "ParityOptions", "ParityResult", "run_parity", "compare_blocks", "format_parity", "bootstrap_mean"]


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
    sliding layers (or as ``is_causal`` says). Returns draft logits [B-1, V] for slots 1..B-1 (slots
    ``drafter.first_draft_slot``..B-1 and the drafter's draft vocabulary where it has them: DSpark).
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
    scale = 1.0
    if getattr(cfg, "rope_scaling", None) is not None:  # llama3 / yarn / linear: the drafter's own table
        inv_freq, scale = drafter.rope.inv_freq.to(dev), drafter.rope.attention_factor
    ang = pos[:, None].float() * inv_freq
    cos, sin = (torch.cat([ang, ang], -1).cos() * scale).to(dt), (torch.cat([ang, ang], -1).sin() * scale).to(dt)
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
    first = getattr(drafter, "first_draft_slot", 1)  # 0: DSpark's anchor slot drafts too
    lm = drafter.draft_lm_weight(head) if hasattr(drafter, "draft_lm_weight") else head.lm_head
    logits = (drafter.norm(h[first:]) @ lm.to(dt).T).float()
    if cfg.output_multiplier != 1.0:
        logits = logits * cfg.output_multiplier
    if cfg.final_logit_softcapping:
        logits = torch.tanh(logits / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
    return logits


def target_pass(model, ids, layer_ids):
    """One full target forward: (greedy next token at every position [T], features [T, n*H])."""
    from ..models.train_tiny import capture_features

    logits, feats = capture_features(model, ids, layer_ids)
    return logits.argmax(-1).cpu(), feats


# --------------------------------------------------------------------------------------------
# The target's side of the online loops
# --------------------------------------------------------------------------------------------

LOOPS = ("cache", "recompute")


@dataclass
class Rows:
    """What one target forward gives the loop for its new positions: the context features
    [n, n_ids*H], and for the last rows asked for (all of a verify, the last of a prefill) the
    greedy token after each (``post``) and the gap between its two largest logits (``margin``,
    0.0 is an exact tie: argmax then takes the lower id)."""

    post: list[int]
    margin: list[float]
    feats: object
    logits: object = None  # [n, V] float32, kept for the parting check only


class _Verifier:
    """The target as an online loop drives it: ``prefill`` the prompt, ``verify`` a block of new
    tokens after the committed ones (tentatively), ``accept`` the first tokens of that block."""

    name = ""

    def __init__(self, model, layer_ids, block_size: int, rebind=None) -> None:
        from ..models.train_tiny import _decoder_layers

        self.model = model
        self.layer_ids = list(layer_ids)
        self.block_size = block_size
        self.rebind = rebind
        self.layers = _decoder_layers(model)
        self.device = next(model.parameters()).device

    def _forward(self, ids: list[int], start: int, logits_rows: int | None = None, **kw) -> Rows:
        """Rows ``start:`` of one forward over ``ids`` (hooks on the decoder layers, as capture_features);
        ``logits_rows``: only the last that many rows need logits (``post``, ``margin``), which keeps
        a long prompt's [T, V] logits out of memory."""
        import torch

        if logits_rows is not None:
            if not hasattr(self, "_keeps"):
                import inspect

                self._keeps = "logits_to_keep" in inspect.signature(self.model.forward).parameters
            if self._keeps:
                kw["logits_to_keep"] = logits_rows

        captured: dict[int, object] = {}
        hooks = []
        for k in sorted(set(self.layer_ids)):
            def hook(_mod, _inp, out, k=k):
                captured[k] = out[0] if isinstance(out, tuple) else out
            hooks.append(self.layers[k].register_forward_hook(hook))
        if self.rebind:
            self.rebind()
        try:
            with torch.no_grad():
                logits = self.model(input_ids=torch.tensor([ids], device=self.device), **kw).logits[0]
            logits = (logits[start:] if logits_rows is None else logits[-logits_rows:]).float()
        finally:
            for h in hooks:
                h.remove()
        top = torch.topk(logits, min(2, logits.shape[-1]), dim=-1)
        margin = (top.values[:, 0] - top.values[:, -1]).tolist()
        feats = torch.cat([captured[k][0, start:] for k in self.layer_ids], dim=-1).float()
        return Rows(logits.argmax(-1).tolist(), margin, feats, logits)


class RecomputeVerifier(_Verifier):
    """Re-runs the target over the whole committed prefix plus the new tokens, no cache: in exact
    arithmetic the tokens verified and the features appended are those of a cached forward."""

    name = "recompute"

    def prefill(self, prompt: list[int]) -> Rows:
        self.seq = list(prompt)
        return self._forward(self.seq, 0, logits_rows=1)

    def verify(self, tokens: list[int]) -> Rows:
        return self._forward(self.seq + list(tokens), len(self.seq), logits_rows=len(tokens))

    def accept(self, tokens: list[int]) -> None:
        self.seq += list(tokens)

    def verify_each(self, blocks: list[list[int]]) -> list[Rows]:
        """Each block verified from the same committed state, which stays as it was."""
        return [self.verify(b) for b in blocks]


class CachedVerifier(_Verifier):
    """As a serving engine runs the target: one prefill forward, then one forward over each drafted
    block on the KV cache, rolled back to the accepted tokens.

    Linear-attention layers (gated DeltaNet) cannot subtract a token from their recurrent state;
    SGLang and vLLM keep the state after every token of a verified block and pick the accepted
    one, and so does transformers' cache once ``activate_past_recording`` is on (its verify
    forward then runs those layers token by token, the recurrent kernel of decoding, as SGLang's
    verify kernel does). Where the installed transformers lacks it, the block is verified on a
    copy of the cache and the accepted tokens are forwarded again on the original.
    """

    name = "cache"
    use_recording = True  # False: the copy-and-replay path (tests run both)

    def _kw(self, cache) -> dict:
        if not hasattr(self, "_cache_arg"):
            import inspect

            # transformers 5.25 renamed past_key_values to cache (the old name warns)
            params = inspect.signature(self.model.forward).parameters
            self._cache_arg = "cache" if "cache" in params else "past_key_values"
        return {self._cache_arg: cache, "use_cache": True}

    def prefill(self, prompt: list[int]) -> Rows:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        rows = self._forward(list(prompt), 0, logits_rows=1, **self._kw(self.cache))
        # after the prefill, as transformers' assisted decoding does: recording during a long
        # prefill would keep every token's state
        self.recorded = self.use_recording and hasattr(self.cache, "activate_past_recording")
        if self.recorded:
            self.cache.activate_past_recording(recurrent_states_to_keep=self.block_size)
        self.pending: list[int] = []
        return rows

    def verify(self, tokens: list[int]) -> Rows:
        import copy

        self.pending = list(tokens)
        if self.recorded:
            return self._forward(self.pending, 0, **self._kw(self.cache))
        trial = copy.deepcopy(self.cache)
        return self._forward(self.pending, 0, **self._kw(trial))

    def accept(self, tokens: list[int]) -> None:
        n = len(tokens)
        if list(tokens) != self.pending[:n]:
            raise ValueError("accept() takes a prefix of the block verify() was given")
        if self.recorded:
            self.cache.crop(-(len(self.pending) - n))  # crop(0) also trims the recorded conv windows
        elif n:
            self._forward(list(tokens), 0, **self._kw(self.cache))
        self.pending = []

    def verify_each(self, blocks: list[list[int]]) -> list[Rows]:
        """Each block verified from the same committed state (a copy of the cache each), which
        stays as it was."""
        import copy

        kept, out = self.cache, []
        try:
            for b in blocks:
                self.cache = copy.deepcopy(kept)
                out.append(self.verify(b))
        finally:
            self.cache, self.pending = kept, []
        return out


def make_verifier(loop: str, model, layer_ids, block_size: int, rebind=None) -> _Verifier:
    if loop not in LOOPS:
        raise UsageError(f"--online-loop {loop!r} is not one of {', '.join(LOOPS)}.")
    cls = CachedVerifier if loop == "cache" else RecomputeVerifier
    return cls(model, layer_ids, block_size, rebind)


@dataclass
class OnlineBlock:
    """One block of an online loop: root, the drafts, the target's greedy tokens from its verify
    forward (one per slot, the bonus included), their top-2 margins, and the block's value."""

    root: int
    drafts: list[int]
    target: list[int]
    margin: list[float]
    value: int


def _stopped(out, P: int, start: int, stop_ids) -> bool:
    return any(t in stop_ids for t in out[P:start + 1])


def _completion(out, P: int, start: int, max_length: int, stop_ids) -> list[int]:
    completion = out[P:min(start + 1, max_length)]
    for i, t in enumerate(completion):
        if t in stop_ids:
            return completion[:i + 1]
    return completion


def _prefill(verifier: _Verifier, drafter, prompt: list[int], max_new_tokens: int):
    """The target's pass over the prompt both decoders start with: (out, P, max_length, feats),
    ``out`` the prompt, the committed prefill token, then MASK up to a last full block."""
    B, mask_id = _verify_len(drafter), drafter.mask_token_id
    P = len(prompt)
    out = list(prompt) + [mask_id] * (max_new_tokens + B)
    rows = verifier.prefill(list(prompt))
    out[P] = int(rows.post[-1])  # prefill token: committed, not a block
    return out, P, P + max_new_tokens, rows.feats


def _verify_len(drafter) -> int:
    """Tokens a block's verify forward takes: the root then its drafts."""
    return getattr(drafter, "num_drafts", drafter.block_size - 1) + 1


def _chain_loop(model, drafter, prompt: list[int], max_new_tokens: int, stop_ids, draft, *, rebind, loop: str,
                record: dict | None):
    """The greedy block loop DFlash and DSpark share: ``draft(ctx, block, root)`` gives a block's
    drafted tokens from the features so far; the target verifies, the longest agreeing prefix and
    the target's next token are committed, and the accepted rows' features join the context.
    Returns (completion, [(root, value)])."""
    import torch

    from ..stages.drafter_eval.metrics import chain_accept

    B = _verify_len(drafter)  # the root and its drafts: the block size, + 1 where slot 0 drafts
    verifier = make_verifier(loop, model, drafter.target_layer_ids, B, rebind)
    with torch.no_grad():
        out, P, max_length, ctx = _prefill(verifier, drafter, prompt, max_new_tokens)
        start, blocks, trace = P, [], []
        while start < max_length:
            block = out[start:start + B]
            block[1:] = draft(ctx, block, start)
            rows = verifier.verify(block)
            acc = chain_accept(block[1:], rows.post[:-1])
            verifier.accept(block[:acc + 1])
            out[start:start + acc + 1] = block[:acc + 1]
            out[start + acc + 1] = rows.post[acc]
            ctx = torch.cat([ctx, rows.feats[:acc + 1].to(ctx.device)])
            blocks.append((start, acc + 1))
            trace.append(OnlineBlock(start, block[1:], rows.post, rows.margin, acc + 1))
            start += acc + 1
            if _stopped(out, P, start, stop_ids):
                break
    if record is not None:
        record.update(blocks=trace, context=ctx, loop=verifier.name)
    return _completion(out, P, start, max_length, stop_ids), blocks


def online_dflash(model, drafter, head, prompt: list[int], max_new_tokens: int, stop_ids, *, rebind=None,
                  loop: str = "cache", record: dict | None = None):
    """Greedy DFlash decoding (z-lab/dflash HEAD 44947fb rules), the target run as ``loop`` says
    (``cache``: as a serving engine; ``recompute``: the whole prefix each round).

    Returns (completion, [(root, value)] per block, {root: draft logits}). ``record``, when given,
    receives ``blocks`` ([OnlineBlock]), ``context`` (the features the drafter saw, [T, n*H]) and
    ``loop``.
    """
    import torch

    draft_logits = {}

    def draft(ctx, block, start):
        draft_logits[start] = reference_draft(drafter, head, ctx, torch.tensor(block), start)
        return draft_logits[start].argmax(-1).tolist()

    completion, blocks = _chain_loop(model, drafter, prompt, max_new_tokens, stop_ids, draft, rebind=rebind,
                                     loop=loop, record=record)
    return completion, blocks, draft_logits


def online_dspark(model, drafter, head, prompt: list[int], max_new_tokens: int, stop_ids, *, rebind=None,
                  loop: str = "cache", record: dict | None = None):
    """Greedy DSpark decoding (SpecForge 0.2 ``DSparkDraftModel.spec_generate``): :func:`online_dflash`'s
    loop, each block's drafts sampled one slot at a time through the Markov head from the previous
    drafted token (``runner.drafters.dspark.greedy_chain``). Returns (completion, [(root, value)]);
    ``record`` receives what :func:`online_dflash` records."""
    import torch

    from ..drafters.dspark import greedy_chain

    def draft(ctx, block, start):
        # the drafter's input is [root, MASK x (B-1)] whether or not slot 0 drafts (then the block
        # verified is one token longer: B drafts)
        base = reference_draft(drafter, head, ctx, torch.tensor(block[:drafter.block_size]), start)
        hidden = drafter.norm.last                                   # norm(h[first:]), recorded
        toks, _ = greedy_chain(drafter.markov, base[None].float(), torch.tensor([block[0]]), hidden[None].float(),
                               drafter.d2t)
        return toks[0].tolist()

    return _chain_loop(model, drafter, prompt, max_new_tokens, stop_ids, draft, rebind=rebind, loop=loop,
                       record=record)


# --------------------------------------------------------------------------------------------
# EAGLE-3's online loop (runner/drafters/eagle3.py drafts)
# --------------------------------------------------------------------------------------------

def online_eagle3(model, drafter, head, prompt: list[int], max_new_tokens: int,
                  stop_ids, *, depth: int, rebind=None, loop: str = "cache", record: dict | None = None):
    """Greedy EAGLE-3 speculative decoding as SGLang runs it with topk 1 (a chain of ``depth``
    drafts per round): prefill, then each round drafts from the features of the committed
    positions (``runner.drafters.eagle3.draft_one_root``), the target verifies [bonus, drafts] in one forward, the
    longest matching prefix and the target's next token are committed and their features appended.

    Returns (completion, [(root, value)] per block, {}) like ``parity.online_dflash``; ``record``
    receives ``blocks`` ([OnlineBlock]), ``context`` and ``loop``."""
    import torch

    from ..drafters.eagle3 import draft_one_root
    from ..stages.drafter_eval.metrics import chain_accept

    verifier = make_verifier(loop, model, drafter.target_layer_ids, depth + 1, rebind)
    P = len(prompt)
    out = list(prompt) + [0] * (max_new_tokens + depth + 1)
    max_length = P + max_new_tokens
    blocks, trace = [], []
    with torch.no_grad():
        rows = verifier.prefill(list(prompt))
        out[P] = int(rows.post[-1])
        ctx = rows.feats
        start = P
        while start < max_length:
            drafts, _ = draft_one_root(drafter, head, ctx, out, start, depth)
            block = [out[start]] + drafts
            rows = verifier.verify(block)
            acc = chain_accept(drafts, rows.post[:-1])
            verifier.accept(block[:acc + 1])
            out[start:start + acc + 1] = block[:acc + 1]
            out[start + acc + 1] = rows.post[acc]
            ctx = torch.cat([ctx, rows.feats[:acc + 1].to(ctx.device)])
            blocks.append((start, acc + 1))
            trace.append(OnlineBlock(start, drafts, rows.post, rows.margin, acc + 1))
            start += acc + 1
            if _stopped(out, P, start, stop_ids):
                break
    if record is not None:
        record.update(blocks=trace, context=ctx, loop=verifier.name)
    return _completion(out, P, start, max_length, stop_ids), blocks, {}


def online_eagle_tree(model, drafter, head, prompt: list[int], max_new_tokens: int, stop_ids, tree: list[int], *,
                      rebind=None, loop: str = "cache"):
    """Greedy EAGLE-3 decoding with its dynamic tree (``tree`` = [topk, steps, draft tokens], SGLang's
    names): (completion, [(root, value)] per block). Each round drafts the tree from the committed
    features (``runner.drafters.eagle3.dynamic_tree``) and follows it along the target's greedy
    path one token a forward, as ``online_ddtree`` does (a tree-masked verify accepts the same path)."""
    import torch

    from ..drafters.eagle3 import dynamic_tree

    topk, steps, tokens = tree
    verifier = make_verifier(loop, model, drafter.target_layer_ids, steps + 1, rebind)
    P = len(prompt)
    out = list(prompt) + [0] * (max_new_tokens + steps + 1)
    max_length = P + max_new_tokens
    blocks = []
    with torch.no_grad():
        rows = verifier.prefill(list(prompt))
        out[P] = int(rows.post[-1])
        ctx, start = rows.feats, P
        while start < max_length:
            t = dynamic_tree(drafter, head, ctx, out, start, topk, steps, tokens)
            children: dict[int, dict[int, int]] = {}
            for i, (tok, parent) in enumerate(zip(t.tokens, t.parents)):
                children.setdefault(parent, {}).setdefault(tok, i)
            ctx, acc = _follow_tree(verifier, out, start, ctx, -1, lambda node, tok: children.get(node, {}).get(tok))
            blocks.append((start, acc + 1))
            start += acc + 1
            if _stopped(out, P, start, stop_ids):
                break
    return _completion(out, P, start, max_length, stop_ids), blocks


def serving_features_walk(model, drafter, head, prompt: list[int], completion: list[int], *, rebind=None,
                          loop: str = "cache") -> list[tuple[int, int]]:
    """The chain walk over a fixed ``completion`` (within-output rule) with the drafter's context
    taken as a serving engine takes it: from the verify forward over each drafted block, rows of
    the accepted tokens, rather than from one forward over the whole sequence. Acceptance is
    judged against ``completion`` (teacher forcing), so the walk is the offline eval's except for
    where the features come from: what a "serving features" eval mode would compute."""
    import torch

    from ..stages.drafter_eval.metrics import chain_accept

    B = drafter.block_size
    seq = list(prompt) + list(completion)
    P, last = len(prompt), len(prompt) + len(completion) - 1
    verifier = make_verifier(loop, model, drafter.target_layer_ids, B, rebind)
    walk = []
    with torch.no_grad():
        ctx = verifier.prefill(list(prompt)).feats
        start = P
        while start < last:
            block = [seq[start]] + [drafter.mask_token_id] * (B - 1)
            block[1:] = reference_draft(drafter, head, ctx, torch.tensor(block), start).argmax(-1).tolist()
            rows = verifier.verify(block)
            acc = chain_accept(block[1:], seq[start + 1:min(start + B, last + 1)])
            verifier.accept(block[:acc + 1])
            ctx = torch.cat([ctx, rows.feats[:acc + 1].to(ctx.device)])
            value = min(acc + 1, last - start)
            walk.append((start, value))
            start += value
    return walk


def online_ddtree(model, drafter, head, prompt: list[int], max_new_tokens: int, stop_ids, budget: int, *,
                  rebind=None, loop: str = "cache"):
    """Greedy DDTree decoding with budget ``budget``: (completion, [(root, value)] per block).

    The tree is verified along the target's greedy path, one token a forward (what
    ``follow_verified_tree`` accepts from a tree-masked forward, without the tree mask, which
    linear-attention targets cannot run): with ``loop="cache"`` each forward is one cached token,
    as a serving engine's recurrent kernel follows the tree's parent pointers.
    """
    import torch

    from ..stages.drafter_eval.metrics import build_ddtree, topk_log_probs

    B = drafter.block_size
    verifier = make_verifier(loop, model, drafter.target_layer_ids, B, rebind)
    with torch.no_grad():
        out, P, max_length, ctx = _prefill(verifier, drafter, prompt, max_new_tokens)
        start, blocks = P, []
        while start < max_length:
            logits = reference_draft(drafter, head, ctx, torch.tensor(out[start:start + B]), start)
            lp, ids = topk_log_probs(logits, budget)
            tree = build_ddtree(lp, ids, budget, vocab_size=logits.shape[-1])
            ctx, acc = _follow_tree(verifier, out, start, ctx, 0, lambda node, tok: tree.child_maps[node].get(tok))
            blocks.append((start, acc + 1))
            start += acc + 1
            if _stopped(out, P, start, stop_ids):
                break
    return _completion(out, P, start, max_length, stop_ids), blocks


def _follow_tree(verifier, out: list[int], start: int, ctx, root: int, child):
    """Follow the target's greedy path down a drafted tree from ``out[start]``, one cached token a
    forward (``child(node, token)``: the node reached, or None), as a serving engine's recurrent
    kernel follows the parent pointers: the path and the target's next token go into ``out``, the
    verified rows' features onto ``ctx``. Returns (ctx, tokens accepted)."""
    import torch

    path, node, feats = [out[start]], root, []
    while True:
        rows = verifier.verify(path[-1:])
        verifier.accept(path[-1:])
        feats.append(rows.feats)
        nxt = int(rows.post[-1])
        reached = child(node, nxt)
        if reached is None:
            break
        node = reached
        path.append(nxt)
    acc = len(path) - 1
    out[start:start + acc + 1] = path
    out[start + acc + 1] = nxt
    return torch.cat([ctx] + [f.to(ctx.device) for f in feats]), acc


def parting_row_check(model, drafter, prompt: list[int], completion: list[int], blocks: list[OnlineBlock],
                       parted: int, alternatives: list[int], *, loop: str = "cache", rebind=None) -> bool | None:
    """Whether the verify forward that chose the token at position ``parted`` gave that row the same
    logits, bit for bit, with each of ``alternatives`` in the next slot instead of the draft there.

    The loop is replayed up to the block that holds ``parted`` (the same blocks, so the same cache
    states), then that block is verified as it was and with each alternative. None when the replay
    does not reproduce the loop's own choice (non-deterministic kernels) or no slot follows."""
    import torch

    seq = list(prompt) + list(completion)
    k = next((i for i, b in enumerate(blocks) if b.root < parted <= b.root + b.value), None)
    if k is None:
        return None
    blk = blocks[k]
    j = parted - blk.root - 1
    if j + 1 >= drafter.block_size:
        return None
    verifier = make_verifier(loop, model, drafter.target_layer_ids, drafter.block_size, rebind)
    with torch.no_grad():
        verifier.prefill(list(prompt))
        for b in blocks[:k]:
            tokens = [seq[b.root]] + list(b.drafts)
            verifier.verify(tokens)
            verifier.accept(tokens[:b.value])
        block = [seq[blk.root]] + list(blk.drafts)
        variants = [block] + [block[:j + 1] + [t] + block[j + 2:] for t in alternatives]
        rows = verifier.verify_each(variants)
    if rows[0].post[j] != blk.target[j]:
        return None
    return all(torch.equal(r.logits[j], rows[0].logits[j]) for r in rows[1:])


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
    target: str | None = None
    drafter: str | None = None
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
    online_loop: str = "cache"  # cache (as a serving engine) | recompute (the whole prefix each round)
    example: bool = False  # the embedded example's target and trained drafter (built once)
    trace: str | None = None  # write one JSON line per online chain block to this file
    serving_features: bool = False  # also walk the cached completions with verify-forward features
    eagle_trees: list[str] = field(default_factory=list)  # EAGLE-3: dynamic trees "TOPK,STEPS,TOKENS"


# The interval parity judges bf16 by: a 95% percentile bootstrap over prompts, with a fixed seed so
# that one store and one command give one verdict.
LEVEL = 0.95
RESAMPLES = 4000
SEED = 0


def bootstrap_mean(values, level: float = LEVEL, resamples: int = RESAMPLES, seed: int = SEED) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values`` (resampled with replacement)."""
    import numpy as np

    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        raise ValueError("no values")
    rng = np.random.default_rng(seed)
    means = np.concatenate([v[rng.integers(0, v.size, size=(min(1000, resamples - i), v.size))].mean(axis=1)
                            for i in range(0, resamples, 1000)])
    lo, hi = np.quantile(means, [(1 - level) / 2, 1 - (1 - level) / 2])
    return float(lo), float(hi)


@dataclass
class MethodParity:
    method: str  # "chain" | "tree-N"
    blocks: int = 0
    matched: int = 0
    mismatches: list[dict] = field(default_factory=list)  # the first few
    mismatch_count: int = 0
    # per response with blocks on both sides, in prompt order: (id, τ online, τ offline)
    pairs: list[tuple[str, float, float]] = field(default_factory=list)

    @property
    def rate(self) -> float | None:
        return self.matched / self.blocks if self.blocks else None

    def interval(self) -> dict | None:
        """τ of each side over the paired responses with its interval, and the paired difference
        (online − offline) with its interval; ``agrees``: the difference's interval holds 0."""
        if not self.pairs:
            return None
        on = [a for _, a, _ in self.pairs]
        off = [b for _, _, b in self.pairs]
        diff = [a - b for a, b in zip(on, off)]
        d_lo, d_hi = bootstrap_mean(diff)
        # equal walks give equal means bit for bit; the slack only absorbs rounding in the resampled means
        agrees = d_lo <= 1e-9 and d_hi >= -1e-9
        return {"prompts": len(diff), "prompts_differing": sum(1 for d in diff if d != 0.0),
                "online": sum(on) / len(on), "online_interval": list(bootstrap_mean(on)),
                "offline": sum(off) / len(off), "offline_interval": list(bootstrap_mean(off)),
                "difference": sum(diff) / len(diff), "difference_interval": [d_lo, d_hi], "agrees": agrees}


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
    online_loop: str = "cache"
    alignment: dict = field(default_factory=dict)  # chain blocks before / at / after each first parting
    partings: list[dict] = field(default_factory=list)  # chain: where each online completion parts
    serving_features: MethodParity | None = None  # --serving-features: reported, not judged

    @property
    def exact_required(self) -> bool:
        return self.dtype == "float32"

    @property
    def ok(self) -> bool:
        if self.exact_required:
            return self.completions_equal == self.responses and all(m.matched == m.blocks for m in self.methods)
        return all(iv is None or iv["agrees"] for iv in (m.interval() for m in self.methods))

    def to_dict(self) -> dict:
        chain = next(m for m in self.methods if m.method == "chain")
        return {"ok": self.ok, "dtype": self.dtype, "device": self.device, "eval_key": self.eval_key,
                "online_loop": self.online_loop, "exact_required": self.exact_required,
                "level": LEVEL, "responses": self.responses,
                "completions_equal": self.completions_equal, "completion_mismatches": self.completion_mismatches,
                "blocks": chain.blocks, "matched": chain.matched, "agreement": chain.rate,
                "mismatches": chain.mismatches, "interval": chain.interval(),
                "methods": [{"method": m.method, "blocks": m.blocks, "matched": m.matched, "agreement": m.rate,
                             "mismatch_count": m.mismatch_count, "mismatches": m.mismatches,
                             "interval": m.interval(),
                             "responses": [{"response": r, "tau_online": a, "tau_offline": b} for r, a, b in m.pairs]}
                            for m in self.methods],
                "tau_online": self.tau_online, "tau_offline": self.tau_offline,
                "alignment": self.alignment, "partings": self.partings,
                "serving_features": None if self.serving_features is None else {
                    "blocks": self.serving_features.blocks, "matched": self.serving_features.matched,
                    "interval": self.serving_features.interval()}}


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
    if online and offline:
        method.pairs.append((response_id, sum(v for _, v in online) / len(online),
                             sum(v for _, v in offline) / len(offline)))


def _walk(prompt_len: int, values: list[int]) -> list[tuple[int, int]]:
    out, p = [], prompt_len
    for v in values:
        out.append((p, int(v)))
        p += int(v)
    return out


def _tau(walks: list[list[tuple[int, int]]]) -> float | None:
    means = [sum(v for _, v in w) / len(w) for w in walks if w]
    return sum(means) / len(means) if means else None


def first_parting(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where ``a`` and ``b`` differ (a length difference counts), or None."""
    at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if at is None and len(a) != len(b):
        at = min(len(a), len(b))
    return at


class _Alignment:
    """Chain blocks of the online walks against the offline ones, split at each response's first
    parting (the first completion token where online decoding left the cached greedy completion):
    before it both walks run over the same tokens, so a difference there is the drafter's (its
    context features); at and after it they run over different texts."""

    def __init__(self) -> None:
        self.counts = {k: [0, 0] for k in ("before", "at", "after")}  # [blocks, equal]
        self.drafts = [0, 0]  # aligned roots: [compared, drafts equal]
        self.feature_rel: list[float] = []

    def add(self, online_walk, offline_walk, parted: int | None) -> list[str]:
        off = dict(offline_walk)
        kinds = []
        for p, v in online_walk:
            kind = "before" if parted is None or p + v < parted else ("at" if p < parted else "after")
            self.counts[kind][0] += 1
            self.counts[kind][1] += off.get(p) == v
            kinds.append(kind)
        return kinds

    def to_dict(self) -> dict:
        out = {k: {"blocks": n, "equal": e} for k, (n, e) in self.counts.items()}
        out["drafts"] = {"roots": self.drafts[0], "equal": self.drafts[1]}
        if self.feature_rel:
            out["features"] = {"positions": len(self.feature_rel),
                               "rel_l2_mean": sum(self.feature_rel) / len(self.feature_rel),
                               "rel_l2_max": max(self.feature_rel)}
        return out


def _example_models(store, opts: ParityOptions) -> None:
    from ..models.example import example_models

    where = store.local_dir("example")
    if where is None:
        raise UsageError("parity --example needs a local store directory (--store PATH).")
    models = example_models(where, log=lambda m: print(m, file=sys.stderr, flush=True), eagle3=False)
    opts.target = opts.target or str(models["target"])
    opts.drafter = opts.drafter or str(models["trained"])


def run_parity(store, opts: ParityOptions, log=None) -> ParityResult:
    """Run the eval graph and the online loops on the same prompts; compare them block by block."""
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    from ..core.graph import RunContext, check_offline, resolve
    from ..core.options import EvalOptions
    from ..core.pipeline import build_graph, execute

    # The online side runs where the states are: an explicit device (the eval options also take auto).
    if opts.device not in ("cpu", "cuda"):
        raise UsageError(f"--device {opts.device!r} is not one of cpu, cuda.")
    if opts.online_loop not in LOOPS:
        raise UsageError(f"--online-loop {opts.online_loop!r} is not one of {', '.join(LOOPS)}.")
    if not opts.example and (not opts.target or not opts.drafter):
        raise UsageError("parity needs --target M and --drafter D, or --example.")
    budgets = sorted({int(b) for b in opts.tree_budgets})
    eopts = EvalOptions(target=opts.target or "example", drafters=[opts.drafter or "example"], prompts=opts.prompts,
                        num_prompts=opts.num_prompts, completions="local", max_new_tokens=opts.max_new_tokens,
                        backend=opts.backend, device=opts.device, dtype=opts.dtype, tree_budgets=budgets,
                        enable_thinking=opts.enable_thinking, progress=opts.progress,
                        attn_implementation=opts.attn_implementation, eagle_trees=list(opts.eagle_trees),
                        # the offline side runs where the online loop does: float32 parity is exact
                        # only on one device's numerics
                        eval_device=opts.device).validate()
    if opts.trace:
        try:  # before any work: a path that cannot be written must not cost the decoding
            open(opts.trace, "w", encoding="utf-8").close()
        except OSError as e:
            raise UsageError(f"--trace {opts.trace}: cannot write it ({e.strerror}); pass a path in a "
                             "writable directory.") from None
    if opts.example:
        _example_models(store, opts)
        eopts.target, eopts.drafters = opts.target, [opts.drafter]
    ctx = RunContext(store, eopts, argv=["run", "eval", "--target", opts.target, "--drafter", opts.drafter])
    nodes = resolve(ctx, build_graph(ctx, "eval"))
    check_offline(ctx, nodes)
    log(f"parity: offline side: {sum(1 for n in nodes if n.status not in ('cached', 'not needed'))} of "
        f"{len(nodes)} stages to produce")
    execute(ctx, nodes)
    ev = next(n for n in nodes if n.stage == "drafter_eval")
    tokens_node = next(n for n in nodes if n.stage == "tokens")
    from ..stages.drafter_eval import read_responses

    responses = read_responses(store, ev)
    if not responses:
        raise BadInputError("parity: the eval has no responses; check --prompts and --num-prompts.")
    hs = [n for n in nodes if n.stage == "hidden_states"]

    import torch

    from dfcache.samples import SampleSet

    from ..drafters.dflash import DFlashDrafter, load_target_head
    from ..models.resolve import eos_token_ids
    from ..models.target import KernelSpec
    from ..stages.drafter_eval import read_context, score_response
    from ..stages.drafter_eval.metrics import candidate_roots
    from ..stages.hidden_states import get_target
    from ..stages.tokens import read_tokens

    backend = KernelSpec.from_key(hs[0].inputs["backend"])
    target_dir = tokens_node.spec.target_dir
    target = get_target(ctx, target_dir, backend)
    dtype = torch.float32 if opts.dtype == "float32" else torch.bfloat16
    dev = target.device
    ref = ev.spec.drafter
    eagle3, dspark = ref.family == "eagle3", ref.family == "dspark"
    if eagle3:  # runner/drafters/: its own drafter, online loop and batched scoring; no DDTree
        from ..drafters.eagle3 import Eagle3Drafter

        drafter = Eagle3Drafter.from_pretrained(Path(opts.drafter).expanduser(), device=dev, dtype=dtype)
        drafter.layer_ids, drafter.block_size = list(ref.target_layer_ids), ref.block_size
        budgets = []
    elif dspark:  # the DFlash backbone with its Markov head; a chain only (no DDTree)
        from ..drafters.dspark import DSparkDrafter

        drafter = DSparkDrafter.from_pretrained(Path(opts.drafter).expanduser(), device=dev, dtype=dtype)
        budgets = []
    else:
        drafter = DFlashDrafter.from_pretrained(Path(opts.drafter).expanduser(), device=dev, dtype=dtype)
    head = load_target_head(target_dir, device=dev, dtype=dtype)
    toks = read_tokens(store, tokens_node)
    stops = eos_token_ids(target_dir)
    B = drafter.block_size
    methods = [MethodParity("chain")] + [MethodParity(f"tree-{b}") for b in budgets]
    from ..drafters.family import tree_label

    etrees = ev.inputs.get("eagle_trees", []) if eagle3 else []
    methods += [MethodParity(tree_label(t)) for t in etrees]
    served = MethodParity("serving-features") if opts.serving_features else None
    completions_equal, comp_mismatch, partings = 0, [], []
    align = _Alignment()
    on_walks: dict[str, list] = {m.method: [] for m in methods}
    off_walks: dict[str, list] = {m.method: [] for m in methods}
    trace = open(opts.trace, "w", encoding="utf-8") if opts.trace else None
    bar = ctx.progress(len(responses), desc="parity: online decoding", unit="resp")
    try:
        for i, resp in enumerate(responses):
            prompt = [int(t) for t in toks.prompt(i)]
            stored = [int(t) for t in toks.completion(i)][: resp["completion_len"]]
            record: dict = {}
            if eagle3:
                completion, blocks, _ = online_eagle3(target.model, drafter, head, prompt, opts.max_new_tokens, stops,
                                                      depth=B - 1, rebind=target.rebind, loop=opts.online_loop,
                                                      record=record)
            elif dspark:
                completion, blocks = online_dspark(target.model, drafter, head, prompt, opts.max_new_tokens, stops,
                                                   rebind=target.rebind, loop=opts.online_loop, record=record)
            else:
                completion, blocks, _ = online_dflash(target.model, drafter, head, prompt, opts.max_new_tokens, stops,
                                                      rebind=target.rebind, loop=opts.online_loop, record=record)
            P = len(prompt)
            at = first_parting(completion, stored)
            parted = None if at is None else P + at
            if at is None:
                completions_equal += 1
            else:
                comp_mismatch.append({"response": resp["id"], "position": parted,
                                      "online_len": len(completion), "offline_len": len(stored)})
            on = within_output(blocks, P, len(completion))
            off = _walk(P, resp["chain"])
            compare_blocks(methods[0], resp["id"], on, off, opts.show_mismatches)
            kinds = align.add(on, off, parted)
            on_walks["chain"].append(on)
            off_walks["chain"].append(off)
            # The drafter's side before the parting: the eval's own drafts at the online roots
            # (recomputed from the stored states as the eval scores them) and the features.
            seq = prompt + stored
            n_aligned = len(seq) if parted is None else parted
            aligned_roots = [p for (p, _), k in zip(on, kinds) if k != "after"]
            offline_drafts: dict[int, list[int]] = {}
            # every candidate root, in the eval's passes (they group the attention), so these are the
            # drafts the eval computed
            roots = candidate_roots(P, resp["completion_len"], ended_by_stop=resp["ended_by_stop"])
            if aligned_roots and roots:
                states = [SampleSet(store, ln.partition.key, [ln.sample_keys[i]]) for ln in ev.spec.layers]
                stop = min(max(max(roots), n_aligned), len(seq))
                stored_feats = read_context(states, 0, stop, head.hidden_size).to(device=dev)
                if eagle3:
                    from ..stages.drafter_eval import score_eagle3

                    scores, _ = score_eagle3(drafter, head, stored_feats.to(dtype), seq, roots, B - 1, [], P,
                                             resp["completion_len"])
                elif dspark:
                    from ..stages.drafter_eval import score_dspark

                    scores = score_dspark(drafter, head, stored_feats.to(dtype), seq, roots)
                else:
                    scores = score_response(drafter, head, stored_feats.to(dtype), seq, roots, k=0)
                offline_drafts = {p: scores.argmax[q].tolist() for q, p in enumerate(scores.roots)}
                # completion positions both sides computed over the same tokens
                m = min(n_aligned, record["context"].shape[0], stored_feats.shape[0])
                if m > P:
                    online_ctx = record["context"][P:m].float()
                    ref = stored_feats[P:m].float()
                    align.feature_rel += ((online_ctx - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)).tolist()
            by_root = {b.root: b for b in record["blocks"]}
            for p in aligned_roots:
                if p in offline_drafts and p in by_root:
                    align.drafts[0] += 1
                    want = by_root[p].drafts
                    if dspark:  # the eval's drafts are teacher-forced: equal up to the first rejected one
                        want = want[:by_root[p].value]
                        offline_drafts[p] = offline_drafts[p][:len(want)]
                    align.drafts[1] += offline_drafts[p] == want
            if parted is not None:
                blk = next((b for b in record["blocks"] if b.root < parted <= b.root + b.value), None)
                if blk is not None:
                    j = parted - blk.root - 1  # the verify row that chose x[parted]
                    draft = blk.drafts[j] if j < len(blk.drafts) else None
                    cached = stored[at] if at < len(stored) else None
                    chosen = completion[at] if at < len(completion) else None
                    # Could the draft have won the tie? Its token enters the verify forward one slot
                    # after the row that chose x[parted]: swap it for each choice and compare that row.
                    others = [t for t in (cached, chosen) if t is not None and t != draft]
                    independent = parting_row_check(target.model, drafter, prompt, completion, record["blocks"],
                                                    parted, others, loop=opts.online_loop,
                                                    rebind=target.rebind) if others else None
                    partings.append({"response": resp["id"], "position": parted, "cached": cached, "online": chosen,
                                     "draft": draft, "draft_matches": None if draft is None else
                                     ("online" if draft == chosen else "cached" if draft == cached else "neither"),
                                     "margin": blk.margin[j], "root": blk.root, "row_independent": independent,
                                     "online_value": dict(on).get(blk.root), "offline_value": dict(off).get(blk.root)})
            if trace is not None:
                offd = dict(off)
                for (p, v), k in zip(on, kinds):
                    b = by_root[p]
                    trace.write(json.dumps({
                        "response": resp["id"], "root": p, "value": v, "offline_value": offd.get(p), "part": k,
                        "drafts": b.drafts, "offline_drafts": offline_drafts.get(p), "target": b.target,
                        "cached": stored[p - P + 1:p - P + B] if k != "after" else None,
                        "margin": [round(x, 6) for x in b.margin]}) + "\n")
            if served is not None and not (eagle3 or dspark):
                compare_blocks(served, resp["id"], serving_features_walk(target.model, drafter, head, prompt, stored,
                                                                         rebind=target.rebind, loop=opts.online_loop),
                               off, 0)
            for m, t in zip(methods[1 + len(budgets):], etrees):
                comp_t, tblocks = online_eagle_tree(target.model, drafter, head, prompt, opts.max_new_tokens, stops, t,
                                                    rebind=target.rebind, loop=opts.online_loop)
                on_t = within_output(tblocks, P, len(comp_t))
                off_t = _walk(P, resp["eagle_tree"][m.method])
                compare_blocks(m, resp["id"], on_t, off_t, opts.show_mismatches)
                on_walks[m.method].append(on_t)
                off_walks[m.method].append(off_t)
            for m, bud in zip(methods[1:], budgets):
                comp_t, tblocks = online_ddtree(target.model, drafter, head, prompt, opts.max_new_tokens, stops, bud,
                                                rebind=target.rebind, loop=opts.online_loop)
                on_t = within_output(tblocks, P, len(comp_t))
                off_t = _walk(P, resp["tree"][str(bud)])
                compare_blocks(m, resp["id"], on_t, off_t, opts.show_mismatches)
                on_walks[m.method].append(on_t)
                off_walks[m.method].append(off_t)
            bar.update(1)
    finally:
        bar.close()
        if trace is not None:
            trace.close()
    return ParityResult(dtype=opts.dtype, device=str(dev.type), eval_key=ev.key, responses=len(responses),
                        completions_equal=completions_equal, completion_mismatches=comp_mismatch,
                        methods=methods, tau_online={k: _tau(v) for k, v in on_walks.items()},
                        tau_offline={k: _tau(v) for k, v in off_walks.items()}, online_loop=opts.online_loop,
                        alignment=align.to_dict(), partings=partings, serving_features=served)


def _iv(lo_hi) -> str:
    return f"[{lo_hi[0]:.3f}, {lo_hi[1]:.3f}]"


def format_parity(res: ParityResult) -> str:
    loop = {"cache": "KV cache, one verify forward a block", "recompute": "whole prefix re-run each round"}
    lines = [f"parity ({res.dtype}, {res.device}, online loop: {loop.get(res.online_loop, res.online_loop)}): "
             f"{res.responses} response(s), eval {res.eval_key[:12]}",
             f"completions: {res.completions_equal}/{res.responses} online completions equal the cached greedy ones"]
    for c in res.partings[:5]:
        draft = "no draft there" if c["draft"] is None else f"the draft there {c['draft']} (matches {c['draft_matches']})"
        lines.append(f"  {c['response']}: differs from position {c['position']}: cached {c['cached']}, online "
                     f"{c['online']}, target top-2 margin {c['margin']:.4g}; {draft}")
    if res.partings:
        n = len(res.partings)
        has = {k: sum(1 for c in res.partings if c["draft_matches"] == k) for k in ("online", "cached", "neither")}
        checked = [c["row_independent"] for c in res.partings if c["row_independent"] is not None]
        lines.append(f"  at the {n} parting(s): target top-2 margin {min(c['margin'] for c in res.partings):.4g} to "
                     f"{max(c['margin'] for c in res.partings):.4g}; the draft had the online token {has['online']}x, "
                     f"the cached one {has['cached']}x, neither {has['neither']}x; the choosing row is unchanged by "
                     f"the token drafted after it in {sum(checked)}/{len(checked)} checked")
    for c in res.completion_mismatches[len(res.partings[:5]):5]:
        if not any(p["response"] == c["response"] for p in res.partings):
            lines.append(f"  {c['response']}: differs from position {c['position']}")
    lines.append(f"{'method':<10} {'blocks':>7} {'matched':>8} {'agree':>7} {'τ online':>9} {'τ offline':>10}"
                 f"  {'online − offline [' + format(LEVEL, '.0%') + ' interval over prompts]'}")
    for m in res.methods:
        rate = "-" if m.rate is None else f"{100 * m.rate:.1f}%"
        ton, toff = res.tau_online.get(m.method), res.tau_offline.get(m.method)
        iv = m.interval()
        diff = "-" if iv is None else f"{iv['difference']:+.3f} {_iv(iv['difference_interval'])}"
        lines.append(f"{m.method:<10} {m.blocks:>7} {m.matched:>8} {rate:>7} "
                     f"{'-' if ton is None else f'{ton:.3f}':>9} {'-' if toff is None else f'{toff:.3f}':>10}  {diff}")
        if iv is not None:
            lines.append(f"  τ online {_iv(iv['online_interval'])}, offline {_iv(iv['offline_interval'])}; "
                         f"{iv['prompts_differing']} of {iv['prompts']} prompts differ")
        for mm in m.mismatches:
            lines.append(f"  first mismatches: {mm['response']} block {mm['block']} at position {mm['root']}: "
                         f"online {mm['online']}, offline {mm['offline'] if mm['offline'] is not None else 'no block here'}")
    a = res.alignment
    if a:
        before = a["before"]
        text = (f"chain blocks before each first parting: {before['equal']}/{before['blocks']} equal; at it "
                f"{a['at']['equal']}/{a['at']['blocks']}; after it {a['after']['equal']}/{a['after']['blocks']}")
        if a["drafts"]["roots"]:
            text += f"; drafts equal at {a['drafts']['equal']}/{a['drafts']['roots']} aligned roots"
        if "features" in a:
            text += f"; features rel. L2 {a['features']['rel_l2_mean']:.2g} mean, {a['features']['rel_l2_max']:.2g} max"
        lines.append(text)
    sf = res.serving_features.interval() if res.serving_features is not None else None
    if sf is not None:
        lines.append(f"offline τ with serving-engine features (verify forwards over the cached completions): "
                     f"{sf['online']:.3f}, {res.serving_features.matched}/{res.serving_features.blocks} blocks as "
                     f"offline; − offline {sf['difference']:+.3f} {_iv(sf['difference_interval'])} (reported, not judged)")
    if res.exact_required:
        lines.append("OK: offline equals online on every block" if res.ok else
                     "FAIL: in float32 offline must equal online on every block")
    elif res.ok:
        lines.append(f"OK: {res.dtype}: τ online and offline agree within the {LEVEL:.0%} interval of their paired "
                     "difference over prompts")
    else:
        bad = [m.method for m in res.methods if m.interval() and not m.interval()["agrees"]]
        lines.append(f"FAIL: {res.dtype}: τ online and offline differ beyond the {LEVEL:.0%} interval of their paired "
                     f"difference ({', '.join(bad)}). With few prompts this can be chance: rerun with more "
                     "--num-prompts; if it stays, offline τ does not predict decoding here (docs/metrics.md, "
                     "bf16 fidelity).")
    return "\n".join(lines)
