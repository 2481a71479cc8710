"""Filling a speculators draft model (their own classes) with test weights, shared by the tests
that check dfcache's forward against speculators' (test_dspark_speculators, test_published_layouts)."""

from __future__ import annotations

import torch


def fill_speculators_model(model, vocab: int, draft_vocab: int, scale: float) -> torch.Tensor:
    """Load a random reduced draft vocabulary into ``model`` when ``draft_vocab`` is below ``vocab``
    (speculators' ``load_vocab_mappings``) and fill every parameter: norms near 1, the rest
    ``scale`` x N(0, 1). Returns the draft ids (target id of each draft token, increasing)."""
    ids = torch.arange(vocab)
    if draft_vocab != vocab:
        ids = torch.sort(torch.randperm(vocab)[:draft_vocab]).values
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        model.load_vocab_mappings(t2d, ids - torch.arange(draft_vocab))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else scale * torch.randn_like(p))
    return ids


def fill_with_target_heads(model, vocab: int, hidden: int, draft_vocab: int, scale: float):
    """:func:`fill_speculators_model`, then a random target embedding and lm_head ([vocab, hidden],
    drawn first) copied into the draft model's embedding and, at the draft ids, its two heads
    (DFlash/DSpark layouts). Returns (embed, lm)."""
    embed, lm = torch.randn(vocab, hidden), torch.randn(vocab, hidden)
    ids = fill_speculators_model(model, vocab, draft_vocab, scale)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(lm[ids])
        model.verifier_lm_head.weight.copy_(lm[ids])
    return embed, lm
