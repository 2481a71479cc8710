"""A tiny EAGLE-3 drafter trained in seconds on the tiny target's own greedy completions.

Trained as SpecForge trains EAGLE-3 (training-time test, two steps): step 1 reads the fc-projected
features of every position and the next token and predicts the token after it; step 2 feeds step 1's
output and the true next token at the next position and attends to step 1's keys of the positions
up to its own plus its own key. The draft vocabulary is the most frequent target tokens of the
training completions (SpecForge's ``vocab_mapping``), so the d2t map is exercised.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from .dflash import init_drafter_weights, load_target_head
from .eagle3 import Eagle3Config, Eagle3Drafter, _attend, _expand_kv, save_eagle3

DEFAULT_LAYER_IDS = (1, 3, 5)  # the tiny DFlash drafter's: `--example` extracts them once for both


def _draft_vocab(data, vocab: int, size: int) -> torch.Tensor:
    counts = torch.zeros(vocab, dtype=torch.long)
    for s in data:
        counts += torch.bincount(s.tokens[s.prompt_len:], minlength=vocab)
    order = torch.argsort(counts, descending=True, stable=True)[:size]
    return order.sort().values  # draft id d -> target id, increasing (d2t[d] = ids[d] - d)


def _loss(d: Eagle3Drafter, head, seq, t2d: torch.Tensor) -> torch.Tensor:
    x, T = seq.tokens, seq.tokens.shape[0]
    n = T - 3  # positions j = 0..T-4: step 1 predicts x[j+2], step 2 x[j+3]
    q, k, v, res = d.context_kv(head, seq.features[:n], x[1:n + 1])
    c = d.config
    groups = c.num_attention_heads // c.num_key_value_heads
    k, v = _expand_kv(k, groups), _expand_kv(v, groups)
    att = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    h1 = d.finish(att.transpose(0, 1), res)
    rows = torch.arange(n, device=x.device)  # the bench trains on the GPU: every index beside the tokens
    q2, k2, v2, r2 = d.qkv(d.embed(head, x[2:n + 2]), h1, rows + 1)
    h2 = d.finish(_attend(q2, k, v, rows + 1, [_expand_kv(k2, groups)], [_expand_kv(v2, groups)],
                          1.0 / math.sqrt(c.head_dim)), r2)
    lo = max(seq.prompt_len - 2, 0)  # train on completion targets
    total = 0.0
    for s, h in enumerate((h1, h2)):
        tgt = x[2 + s:n + 2 + s][lo:]
        keep = t2d[tgt] >= 0
        logits = d.lm_head(d.norm(h[lo:]))
        ce = F.cross_entropy(logits[keep], t2d[tgt][keep]) if keep.any() else logits.sum() * 0
        total = total + (0.8 ** s) * ce
    return total


def fit(d: Eagle3Drafter, head, data, t2d: torch.Tensor, *, steps: int, lr: float, gen: torch.Generator,
        losses: list[float]) -> None:
    """``steps`` AdamW steps (cosine schedule, gradients clipped to 1) of :func:`_loss` on two
    sequences of ``data`` a step, picked with ``gen``; each step's loss appended to ``losses`` (kept
    when a step raises, so a caller can say how far training got)."""
    opt = torch.optim.AdamW(d.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    for _ in range(steps):
        picks = torch.randperm(len(data), generator=gen)[:2].tolist()
        loss = sum(_loss(d, head, data[i], t2d) for i in picks) / len(picks)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(d.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))


def train_tiny_eagle3(target_dir: str | Path, out_dir: str | Path, *, steps: int = 120, seed: int = 0,
                      layer_ids: Sequence[int] = DEFAULT_LAYER_IDS, draft_vocab_size: int = 256,
                      max_new_tokens: int = 64, lr: float = 3e-3, data=None, stats: list | None = None) -> Path:
    """Train and save (SpecForge's layout) a one-layer EAGLE-3 drafter for the tiny target."""
    from ..models.train_tiny import build_training_data, single_thread

    t0 = time.perf_counter()
    target_dir = Path(target_dir)
    head = load_target_head(target_dir)
    H, V = head.hidden_size, head.vocab_size
    if data is None:
        data = build_training_data(target_dir, layer_ids, max_new_tokens=max_new_tokens)
    data = [s for s in data if s.tokens.shape[0] - s.prompt_len >= 4]
    ids = _draft_vocab(data, V, min(draft_vocab_size, V))
    t2d = torch.full((V,), -1, dtype=torch.long)
    t2d[ids] = torch.arange(ids.shape[0])
    cfg = Eagle3Config(hidden_size=H, target_hidden_size=H, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=H // 4, intermediate_size=2 * H, rms_norm_eps=1e-6, rope_theta=10000.0,
                       vocab_size=V, draft_vocab_size=int(ids.shape[0]), target_layer_ids=list(layer_ids))
    with single_thread():
        d = init_drafter_weights(Eagle3Drafter(cfg), seed).train()
        d.d2t = ids - torch.arange(ids.shape[0])
        losses: list[float] = []
        fit(d, head, data, t2d, steps=steps, lr=lr, gen=torch.Generator().manual_seed(seed), losses=losses)
        d.eval()
        save_eagle3(d, out_dir)
    if stats is not None:
        stats.append({"seconds": time.perf_counter() - t0, "losses": losses})
    return Path(out_dir)
