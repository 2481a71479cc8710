"""Drafter checkpoints in the layouts published ones have (config fields, tensor names, dtypes as
their writers save them; sizes shrunk), each recognised, planned against a target and loaded, and
where the peer's model code runs on the CPU (speculators, installed --no-deps) its logits equal
dfcache's. The layouts and where they were read are tabled in docs/cli.md ("Published layouts").

* speculators EAGLE-3 (RedHatAI/gpt-oss-20b-speculator.eagle3): Llama layer, ``norm_before_fc``
  (``input_norm.weight`` over the three layers' concat), ``norm_before_residual``, reduced vocabulary.
* speculators EAGLE-3 in its default Qwen3 layer (``q_norm``/``k_norm``), ``fc_norm`` and EAGLE 3.1's
  ``norm_output`` (the next step reads norm(h)), attention biases, no ``embed_tokens`` (the target's).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from dfcache.errors import BadInputError

H, V, DV, T, STEPS = 32, 80, 48, 16, 3


def _speculators_eagle3(out, *, layer: str, draft_vocab: int, drop_embedding=False, seed=0, **flags):
    """speculators' own Eagle3DraftModel with random weights, saved by its save_pretrained."""
    pytest.importorskip("speculators")
    from transformers import LlamaConfig, Qwen3Config

    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    cls = LlamaConfig if layer == "llama" else Qwen3Config
    extra = {"attention_bias": True} if flags.pop("attention_bias", False) else {}
    tl = cls(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, max_position_embeddings=256, **extra)
    tl._attn_implementation = "eager"  # flex attention needs a compiler; eager takes their float mask
    cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=tl, draft_vocab_size=draft_vocab, eagle_aux_hidden_state_layer_ids=[1, 2, 3],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=STEPS)],
            default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=None, architectures=[])),
        **flags)
    torch.manual_seed(seed)
    model = Eagle3DraftModel(cfg)
    if draft_vocab != V:
        ids = torch.sort(torch.randperm(V)[:draft_vocab]).values
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[ids] = True
        model.load_vocab_mappings(t2d, ids - torch.arange(draft_vocab))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    model.save_pretrained(str(out))
    embed = model.embed_tokens.weight.detach().clone()
    if drop_embedding:  # converted checkpoints without the drafter's embedding: vLLM shares the target's
        from safetensors.torch import load_file, save_file

        t = load_file(str(out / "model.safetensors"))
        del t["embed_tokens.weight"]
        save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    return model.eval(), embed


def _their_logits(model, feats, ids):
    """Their forward (TTT steps teacher-forced on ``ids``): the lm_head's output of every step."""
    got = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: got.append(o[0].detach()))
    try:
        with torch.no_grad():
            model(hidden_states=feats[None], input_ids=ids[None], document_ids=torch.zeros(1, ids.shape[0],
                  dtype=torch.long), ttt_steps=STEPS)
    finally:
        hook.remove()
    return torch.stack(got, 1)  # [n, STEPS, draft vocab]


def _our_logits(d, head, feats, ids):
    """The same teacher-forced steps with the primitives score_roots composes (context_kv, qkv,
    _attend, finish, logits): step s at position j reads token ids[j+s] and step s-1's state."""
    from runner.drafters.eagle3 import _attend, _expand_kv

    c = d.config
    n = feats.shape[0]
    groups, scale = c.num_attention_heads // c.num_key_value_heads, 1.0 / math.sqrt(c.head_dim)
    q0, k0, v0, r0 = d.context_kv(head, feats, ids)
    K0, V0 = _expand_kv(k0, groups), _expand_kv(v0, groups)
    rows = torch.arange(n)
    h = d.finish(_attend(q0, K0, V0, rows + 1, [], [], scale), r0)
    out, ks, vs = [d.logits(h)], [], []
    for s in range(1, STEPS):
        tok = torch.cat([ids[s:], ids.new_zeros(s)])
        q, k, v, res = d.qkv(d.embed(head, tok), h, rows + s)
        ks.append(_expand_kv(k, groups)), vs.append(_expand_kv(v, groups))
        h = d.finish(_attend(q, K0, V0, rows + 1, ks, vs, scale), res)
        out.append(d.logits(h))
    return torch.stack(out, 1)


@pytest.mark.parametrize("layer,draft_vocab,drop_embedding,flags", [
    ("llama", DV, False, {"norm_before_fc": True, "norm_before_residual": True}),
    ("qwen3", V, True, {"fc_norm": True, "norm_output": True, "attention_bias": True}),
], ids=["llama-norm_before_fc-draft_vocab", "qwen3-fc_norm-norm_output-bias-no_embed"])
def test_speculators_eagle3_layouts_equal_their_model(tmp_path, layer, draft_vocab, drop_embedding, flags):
    from runner.drafters.dflash import TargetHead
    from runner.drafters.eagle3 import Eagle3Drafter, score_roots
    from runner.drafters.family import Eagle3, family_of
    from runner.models.train_tiny import single_thread

    path = tmp_path / "d"
    with single_thread():
        model, embed = _speculators_eagle3(path, layer=layer, draft_vocab=draft_vocab, drop_embedding=drop_embedding,
                                           **dict(flags))
        raw = json.loads((path / "config.json").read_text())
        assert family_of(path, raw) is Eagle3
        plan = Eagle3.plan(path, raw, num_target_layers=6, target_hidden=H, target_vocab=V, steps=None)
        assert plan.layers == [0, 1, 2] and plan.block_size == STEPS + 1  # HF indices 1..3: outputs of 0..2
        with pytest.raises(BadInputError, match="the target has 90"):
            Eagle3.plan(path, raw, num_target_layers=6, target_hidden=H, target_vocab=90, steps=None)
        ours = Eagle3Drafter.from_pretrained(path)
        assert (ours.embed_tokens is None) == drop_embedding
        c = ours.config
        assert (c.norm_before_fc, c.fc_norm, c.feed_normed, c.qk_norm, c.attention_bias) == (
            bool(flags.get("norm_before_fc")), bool(flags.get("fc_norm")), bool(flags.get("norm_output")),
            layer == "qwen3", bool(flags.get("attention_bias")))
        g = torch.Generator().manual_seed(1)
        feats = torch.randn(T, 3 * H, generator=g)
        seq = torch.randint(0, V, (T + 1,), generator=g)
        head = TargetHead(embed, torch.randn(V, H, generator=g))
        want = _their_logits(model, feats, seq[1:])
        got = _our_logits(ours, head, feats, seq[1:])
        tokens, chain = score_roots(ours, head, feats, seq, list(range(1, T + 1)), depth=STEPS)
    n = T - STEPS + 1  # positions whose teacher-forced tokens are all real (no padding)
    torch.testing.assert_close(got[:n], want[:n], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(chain[:, 0], want[:, 0], rtol=1e-4, atol=1e-4)  # the chain's first step
    d2t = model.d2t if model.d2t is not None else torch.zeros(draft_vocab, dtype=torch.long)
    first = want[:, 0].argmax(-1)
    assert tokens[:, 0].tolist() == (first + d2t[first]).tolist()  # drafts in the target's vocabulary
