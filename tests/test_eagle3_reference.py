"""dfcache's EAGLE-3 forward against the peers' own model code (installed --no-deps in CI):
SpecForge's ``LlamaForCausalLMEagle3`` run through its training-time-test path (the cached keys of
earlier steps, ``cache_hidden``), and speculators' ``Eagle3DraftModel`` config read by our loader.
Tiny checkpoints built from configs; logits compared at every position and draft step."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from runner.drafters.eagle3 import Eagle3Drafter, score_roots
from runner.drafters.dflash import TargetHead
from runner.models.train_tiny import single_thread

H, V, DV, T, STEPS = 64, 96, 48, 24, 3


def _specforge_model(**extra):
    pytest.importorskip("specforge")
    from transformers import LlamaConfig

    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3

    cfg = LlamaConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                      vocab_size=V, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=256,
                      hidden_act="silu", num_hidden_layers=1, tie_word_embeddings=False, **extra)
    cfg.draft_vocab_size = DV
    torch.manual_seed(0)
    m = LlamaForCausalLMEagle3(cfg).float().eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() > 1 else 1.0) + (1.0 if p.dim() == 1 else 0.0))
        m.d2t.copy_(torch.arange(0, V, 2)[:DV] - torch.arange(DV))
        m.t2d.zero_()
        m.t2d[torch.arange(0, V, 2)[:DV]] = True
    return m, cfg


def _save(m, cfg, path, layer_ids=(0, 1, 2)):
    path.mkdir()
    raw = cfg.to_dict()
    raw.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=DV,
               eagle_config={"eagle_aux_hidden_state_layer_ids": list(layer_ids)})
    (path / "config.json").write_text(json.dumps(raw))
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, str(path / "model.safetensors"))
    return path


def _their_logits(m, feats, ids):
    """SpecForge's TTT loop over all positions: step s feeds step s-1's output and its own draft."""
    from specforge.modeling.draft.llama3_eagle import prepare_decoder_attention_mask

    n = feats.shape[0]
    h = m.project_hidden_states(feats[None])
    mask = prepare_decoder_attention_mask(torch.ones(1, n, dtype=torch.bool), (1, n), h, 0)
    pos = torch.arange(n)[None]
    cache = [[], []]
    tokens = ids[None]
    out = []
    with torch.no_grad():
        for _ in range(STEPS):
            h = m.backbone(m.embed_input_ids(tokens), h, cache, mask, pos)
            logits = m.compute_logits(h)[0]
            out.append(logits)
            d = logits.argmax(-1)
            tokens = (d + m.d2t[d])[None]
    return torch.stack(out, 1)  # [n, STEPS, DV]


@pytest.mark.parametrize("extra", [{}, {"fc_norm": True, "norm_output": False}], ids=["plain", "fc_norm"])
def test_forward_equals_specforge_logits_at_every_position_and_step(tmp_path, extra):
    with single_thread():
        m, cfg = _specforge_model(**extra)
        path = _save(m, cfg, tmp_path / "d")
        ours = Eagle3Drafter.from_pretrained(path)
        assert ours.embed_tokens is not None  # SpecForge saves the (target's) embedding with the drafter
        g = torch.Generator().manual_seed(1)
        feats = torch.randn(T, 3 * H, generator=g)
        seq = torch.randint(0, V, (T + 1,), generator=g)
        head = TargetHead(torch.randn(V, H), torch.randn(V, H))  # not used: the drafter has its own embedding
        theirs = _their_logits(m, feats, seq[1:T + 1])
        roots = list(range(1, T + 1))
        _, logits = score_roots(ours, head, feats, seq, roots, depth=STEPS)
    torch.testing.assert_close(logits, theirs, rtol=1e-4, atol=1e-4)
    assert (logits.argmax(-1) == theirs.argmax(-1)).all()


def test_speculators_config_is_read_as_its_model_reads_it(tmp_path):
    pytest.importorskip("speculators")
    from speculators.models.eagle3 import Eagle3SpeculatorConfig

    from runner.drafters.eagle3_config import Eagle3Config
    from transformers import LlamaConfig

    tl = LlamaConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                     vocab_size=V, rms_norm_eps=1e-6, rope_theta=10000.0, num_hidden_layers=1)
    sc = Eagle3SpeculatorConfig(transformer_layer_config=tl, draft_vocab_size=DV, norm_before_residual=True,
                                eagle_aux_hidden_state_layer_ids=[1, 4, 7])
    raw = json.loads(sc.to_json_string())
    cfg = Eagle3Config.from_dict(raw)
    # speculators counts HF hidden_states indices (its converter: "z-lab reads hidden_states[layer_id + 1]
    # ... speculators uses the layer id directly"): dfcache's (SpecForge's) ids are one less
    assert cfg.layout == "speculators" and cfg.target_layer_ids == [0, 3, 6]
    assert cfg.declared_layer_ids == [1, 4, 7]
    assert (cfg.hidden_size, cfg.head_dim, cfg.draft_vocab_size, cfg.vocab_size) == (H, 16, DV, V)
    assert cfg.norm_before_residual is True
