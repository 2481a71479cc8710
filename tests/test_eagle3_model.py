"""EAGLE-3 drafter: checkpoint loading in SpecForge's and speculators' layouts, batched chain
scoring equal to the per-root online chain, the dynamic tree, the vocab maps."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dfcache.errors import BadInputError
from runner.drafters.eagle3 import (Eagle3Config, Eagle3Drafter, Tree, draft_one_root, dynamic_tree,
                                    init_eagle3_weights, save_eagle3, score_roots, tree_accept)
from runner.drafters.dflash import TargetHead
from runner.models.train_tiny import single_thread

H, V, DV = 64, 96, 48


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_thread():
        yield


def _config(**kw) -> Eagle3Config:
    base = dict(hidden_size=H, target_hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                intermediate_size=128, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=V, draft_vocab_size=DV,
                target_layer_ids=[0, 1, 2])
    base.update(kw)
    return Eagle3Config(**base)


def _drafter(seed=0, **kw) -> Eagle3Drafter:
    m = init_eagle3_weights(Eagle3Drafter(_config(**kw)), seed, std=0.2).eval()
    g = torch.Generator().manual_seed(seed + 1)
    # a draft vocabulary of every other target id, as d2t offsets (target = d + d2t[d])
    m.d2t = torch.arange(0, V, 2)[:DV] - torch.arange(DV)
    return m


def _head(seed=0) -> TargetHead:
    g = torch.Generator().manual_seed(seed)
    return TargetHead(torch.randn(V, H, generator=g), torch.randn(V, H, generator=g), num_layers=8)


def _inputs(T=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, 3 * H, generator=g), torch.randint(0, V, (T,), generator=g)


def test_batched_chain_equals_the_online_chain_at_every_root():
    d, head = _drafter(), _head()
    feats, toks = _inputs()
    roots = list(range(1, 39))
    got, logits = score_roots(d, head, feats, toks, roots, depth=5, chunk=7)
    assert got.shape == (38, 5)
    for i, p in enumerate(roots):
        ref, ref_logits = draft_one_root(d, head, feats, toks.tolist(), p, depth=5)
        assert got[i].tolist() == ref, p
        torch.testing.assert_close(logits[i], ref_logits, rtol=1e-5, atol=1e-5)
    assert all(int(t) % 2 == 0 for t in got.flatten())  # drafts are target ids through d2t
    assert len(set(got[:, 1].tolist())) > 3  # the drafts depend on the root


def test_drafts_see_only_the_features_before_the_root():
    d, head = _drafter(), _head()
    feats, toks = _inputs()
    a, _ = score_roots(d, head, feats, toks, [20], depth=4)
    feats2, toks2 = feats.clone(), toks.clone()
    feats2[20:] = 0.0
    toks2[21:] = 0
    b, _ = score_roots(d, head, feats2, toks2, [20], depth=4)
    assert a.tolist() == b.tolist()
    feats2[19] += 1.0  # the root drafts from position root-1: its feature matters
    c, lc = score_roots(d, head, feats2, toks2, [20], depth=4)
    _, la = score_roots(d, head, feats, toks, [20], depth=4)
    assert not torch.allclose(la, lc)


def test_tree_of_topk_one_is_the_chain():
    d, head = _drafter(), _head()
    feats, toks = _inputs()
    chain, _ = draft_one_root(d, head, feats, toks.tolist(), 17, depth=4)
    tree = dynamic_tree(d, head, feats, toks.tolist(), 17, topk=1, num_steps=4, num_draft_tokens=5)
    assert tree.tokens == chain and tree.parents == [-1, 0, 1, 2]
    wide = dynamic_tree(d, head, feats, toks.tolist(), 17, topk=4, num_steps=4, num_draft_tokens=12)
    assert len(wide.tokens) == 11
    assert all(p < i for i, p in enumerate(wide.parents))
    # the best path is the chain's first token (top-1 of the root)
    assert chain[0] in [t for t, p in zip(wide.tokens, wide.parents) if p == -1]


def test_tree_accept_follows_the_target_path():
    t = Tree(tokens=[5, 6, 7, 8, 9], parents=[-1, -1, 0, 1, 3])
    assert tree_accept(t, [6, 8, 9, 1]) == 3
    assert tree_accept(t, [5, 7, 1]) == 2
    assert tree_accept(t, [4]) == 0


def _write_specforge(tmp_path, d: Eagle3Drafter):
    return save_eagle3(d, tmp_path / "sf")


def test_load_specforge_layout_roundtrip(tmp_path):
    d, head = _drafter(), _head()
    path = _write_specforge(tmp_path, d)
    names = set(load_file(str(path / "model.safetensors")))
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "d2t", "t2d", "lm_head.weight"} <= names
    e = Eagle3Drafter.from_pretrained(path)
    feats, toks = _inputs()
    a, _ = score_roots(d, head, feats, toks, [5, 30], depth=3)
    b, _ = score_roots(e, head, feats, toks, [5, 30], depth=3)
    assert a.tolist() == b.tolist()


def test_load_speculators_layout(tmp_path):
    d, head = _drafter(), _head()
    path = _write_specforge(tmp_path, d)
    out = tmp_path / "spec"
    out.mkdir()
    state = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v
             for k, v in load_file(str(path / "model.safetensors")).items()}
    save_file(state, str(out / "model.safetensors"))
    cfg = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
           "draft_vocab_size": DV, "norm_before_residual": False, "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
           "speculators_config": {"algorithm": "eagle3", "proposal_methods": [{"speculative_tokens": 3}]},
           "transformer_layer_config": {"model_type": "llama", "hidden_size": H, "num_attention_heads": 4,
                                        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
                                        "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                                        "vocab_size": V}}
    (out / "config.json").write_text(json.dumps(cfg))
    e = Eagle3Drafter.from_pretrained(out)
    assert e.config.layout == "speculators" and e.config.speculative_tokens == 3
    assert e.config.target_layer_ids == [0, 1, 2]  # HF hidden_states indices 1..3: outputs of layers 0..2
    feats, toks = _inputs()
    assert score_roots(d, head, feats, toks, [9], depth=3)[0].tolist() == score_roots(e, head, feats, toks, [9], depth=3)[0].tolist()


def test_vocab_map_outside_the_target_is_refused(tmp_path):
    d = _drafter()
    d.d2t = d.d2t + V  # maps past vocab_size
    path = _write_specforge(tmp_path, d)
    with pytest.raises(BadInputError, match="outside vocab_size"):
        Eagle3Drafter.from_pretrained(path)


def test_config_errors_name_the_field():
    with pytest.raises(BadInputError, match="eagle_aux_hidden_state_layer_ids"):
        Eagle3Config.from_dict({"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": H,
                                "num_attention_heads": 4, "intermediate_size": 8, "vocab_size": V,
                                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2]}})
    with pytest.raises(BadInputError, match="num_hidden_layers=2"):
        Eagle3Config.from_dict({"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": H, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "intermediate_size": 8, "vocab_size": V})


def test_batched_trees_equal_the_per_root_trees():
    from runner.drafters.eagle3 import dynamic_trees

    d, head = _drafter(), _head()
    feats, toks = _inputs()
    roots = list(range(1, 39))
    for topk, steps, n in ((1, 4, 5), (3, 4, 10), (4, 3, 16)):
        got = dynamic_trees(d, head, feats, toks, roots, topk, steps, n, chunk=5)
        for p, tree in zip(roots, got):
            ref = dynamic_tree(d, head, feats, toks.tolist(), p, topk, steps, n)
            assert (tree.tokens, tree.parents) == (ref.tokens, ref.parents), (topk, steps, n, p)


def test_extending_the_context_keys_as_a_serving_engine_does_gives_the_same_drafts():
    """SGLang's draft-extend adds the accepted positions' keys to the cached ones: computing them
    in two pieces (``start=``) equals computing them at once."""
    d, head = _drafter(), _head()
    feats, toks = _inputs()
    q, k, v, r = d.context_kv(head, feats[:30], toks[1:31])
    q1, k1, v1, r1 = d.context_kv(head, feats[:17], toks[1:18])
    q2, k2, v2, r2 = d.context_kv(head, feats[17:30], toks[18:31], start=17)
    torch.testing.assert_close(torch.cat([k1, k2]), k, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([q1, q2]), q, rtol=0, atol=0)
