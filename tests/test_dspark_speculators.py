"""DSpark checkpoints as speculators 0.9 writes them (``DSparkDraftModel.save_pretrained``: config
with ``transformer_layer_config``, ``sample_from_anchor`` default true, a draft vocabulary with its
``d2t``/``t2d`` buffers and reduced ``lm_head``), built with speculators' own classes on the CPU
(installed --no-deps): dfcache's batched forward gives their model's teacher-forced logits (their
``_backbone_forward`` plus ``MarkovHead.block_bias`` with their previous-token rule) and drafts."""

from __future__ import annotations

import json

import pytest
import torch

from dfcache.errors import BadInputError

pytest.importorskip("speculators")

V, VD, H, B, T = 64, 48, 32, 4, 20


def _build(out, *, anchor: bool | None, draft_vocab: int, head_type="rnn", seed=0):
    """A speculators DSpark model with random weights, saved to ``out``; returns (model, embed, lm_head)."""
    from transformers import Qwen3Config

    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    tl = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
    tl._attn_implementation = "eager"  # flex attention needs a compiler; eager takes their float mask
    extra = {} if anchor is None else {"sample_from_anchor": anchor}  # None: speculators' default
    cfg = DSparkSpeculatorConfig(
        transformer_layer_config=tl, draft_vocab_size=draft_vocab, block_size=B, aux_hidden_state_layer_ids=[1, 2],
        mask_token_id=V - 1, markov_rank=8, markov_head_type=head_type, **extra,
        speculators_config=SpeculatorsConfig(
            algorithm="dspark", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=B)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"])))
    torch.manual_seed(seed)
    model = DSparkDraftModel(cfg)
    embed, lm = torch.randn(V, H), torch.randn(V, H)
    ids = torch.arange(V)
    if draft_vocab != V:
        ids = torch.sort(torch.randperm(V)[:draft_vocab]).values
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[ids] = True
        model.load_vocab_mappings(t2d, ids - torch.arange(draft_vocab))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.5 * torch.randn_like(p))
        model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(lm[ids])
        model.verifier_lm_head.weight.copy_(lm[ids])
    model.save_pretrained(str(out))
    return model.eval(), embed, lm


def _theirs(model, feats, tokens):
    """speculators' teacher-forced logits [n, B, V'] over every anchor (sorted), DSparkDraftModel.forward's
    Markov rule; and the anchors."""
    T_ = tokens.shape[0]
    loss_mask = torch.ones(1, T_)
    loss_mask[:, :4] = 0                                   # anchors 4 .. T-B-1
    n = int(loss_mask[0, :-B].sum())
    with torch.no_grad():
        hidden, logits, _, _, idx = model._backbone_forward(
            feats[None], tokens[None], loss_mask, torch.zeros(1, T_, H), torch.zeros(1, T_, dtype=torch.long),
            max_anchors=n)
        block_tokens = tokens[idx].view(n, B)
        if model.config.sample_from_anchor:
            prev = block_tokens
        else:
            prev = torch.cat([block_tokens[:, :1], block_tokens[:, :-1]], dim=1)
        logits = logits.view(n, B, -1) + model.markov_head.block_bias(
            prev_token_ids=prev, hidden_states=hidden.view(n, B, -1))
    return logits, idx.view(n, B)[:, 0].tolist()


@pytest.mark.parametrize("anchor,draft_vocab,head_type", [(None, V, "rnn"), (False, V, "gated"),
                                                         (None, VD, "rnn"), (False, VD, "vanilla")])
def test_forward_equals_speculators(tmp_path, anchor, draft_vocab, head_type):
    from runner.drafters import dspark
    from runner.drafters.dflash import TargetHead, iter_score_roots

    model, embed, lm = _build(tmp_path / "ckpt", anchor=anchor, draft_vocab=draft_vocab, head_type=head_type)
    raw = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert raw["speculators_model_type"] == "dspark" and raw["sample_from_anchor"] is (anchor is None)
    g = torch.Generator().manual_seed(1)
    feats, tokens = torch.randn(T, 2 * H, generator=g), torch.randint(0, V - 1, (T,), generator=g)
    want, roots = _theirs(model, feats, tokens)

    ours = dspark.DSparkDrafter.from_pretrained(tmp_path / "ckpt")
    first = 0 if anchor is None else 1
    assert ours.first_draft_slot == first and ours.num_drafts == B - first
    assert ours.target_layer_ids == [0, 1]  # speculators' ids are hidden_states indices: output of layer k-1
    head = TargetHead(embed_tokens=embed, lm_head=lm)
    K = ours.num_drafts
    block = dspark._block_tokens(tokens, roots, K + 1)
    for idx, base in iter_score_roots(ours, head, feats, tokens, roots):
        got = base + ours.markov.block_bias(block[idx, :-1], ours.norm.last)
        torch.testing.assert_close(got, want[idx][:, first:], rtol=1e-4, atol=1e-4)
    drafts = torch.cat([d for _, d in dspark.iter_drafts(ours, head, feats, tokens, roots)])
    d2t = model.d2t if draft_vocab != V else None
    theirs = want[:, first:].argmax(-1)
    assert drafts.tolist() == (theirs if d2t is None else theirs + d2t[theirs]).tolist()


def test_draft_vocabulary_that_does_not_fit_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    from runner.drafters.family import DSpark, family_of

    _build(tmp_path / "ckpt", anchor=None, draft_vocab=VD)
    path = tmp_path / "ckpt"
    raw = json.loads((path / "config.json").read_text())
    assert family_of(path, raw) is DSpark
    plan = DSpark.plan(path, raw, layers=[0, 1], block_size=B, target_vocab=V)
    assert plan.block_size == B + 1 and plan.key_inputs == {"family": "dspark", "sample_from_anchor": True}
    with pytest.raises(BadInputError, match="the target has 100"):
        DSpark.plan(path, raw, layers=[0, 1], block_size=B, target_vocab=100)
    t = load_file(str(path / "model.safetensors"))
    t["d2t"] = t["d2t"] + V  # past the target's vocabulary
    save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(BadInputError, match="d2t maps draft ids"):
        DSpark.plan(path, raw, layers=[0, 1], block_size=B, target_vocab=V)
    del t["d2t"]
    save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(BadInputError, match="no d2t"):
        DSpark.plan(path, raw, layers=[0, 1], block_size=B, target_vocab=V)
