"""DFlash drafter: checkpoint loading (dflash.md §1.2, §1.8), target head reading, batched root scoring (§6)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dfcache.errors import BadInputError
from runner.drafters.dflash import (DFlashConfig, DFlashDrafter, TargetHead, check_compatible, init_drafter_weights,
                                    iter_score_roots, load_target_head, save_drafter, score_roots,
                                    score_roots_one_at_a_time)
from runner.models.train_tiny import single_thread

H, V = 64, 96


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # tiny ops: a second intra-op thread only adds waiting on a busy 2-core machine
    with single_thread():
        yield


def _config(**kw) -> DFlashConfig:
    base = dict(hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                intermediate_size=128, rms_norm_eps=1e-6, rope_theta=10000.0, block_size=6,
                target_layer_ids=[0, 2, 3], mask_token_id=5, layer_types=["full_attention"] * 2)
    base.update(kw)
    return DFlashConfig(**base)


def _drafter(seed=0, **kw) -> DFlashDrafter:
    # std 0.2 rather than a trained model's scale so logits have structure to compare
    return init_drafter_weights(DFlashDrafter(_config(**kw)), seed, std=0.2).eval()


def _head(seed=0, hidden=H) -> TargetHead:
    g = torch.Generator().manual_seed(seed)
    return TargetHead(torch.randn(V, hidden, generator=g), torch.randn(V, hidden, generator=g), num_layers=4)


def _inputs(drafter, T=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(T, len(drafter.target_layer_ids) * H, generator=g)
    toks = torch.randint(0, V, (T,), generator=g)
    return feats, toks


def _raw_config(**over) -> dict:
    raw = _config().to_dict()
    raw.update(over)
    return raw


# ---- batched scoring -----------------------------------------------------------------------

@pytest.mark.parametrize("kw", [
    dict(),                                                                        # full, bidirectional
    dict(layer_types=["sliding_attention", "full_attention"], sliding_window=4),  # window < block
    dict(layer_types=["sliding_attention"] * 2, sliding_window=9),
    dict(is_causal=True),                                                          # config override
    dict(num_key_value_heads=4),                                                   # no GQA
])
def test_batched_equals_one_at_a_time(kw):
    d, head = _drafter(**kw), _head()
    feats, toks = _inputs(d)
    roots = [17, 1, 39, 5, 6, 30, 17, 2, 38, 21, 0]         # unordered, a duplicate, first and last, no context
    slow = score_roots_one_at_a_time(d, head, feats, toks, roots)
    for opts in (dict(), dict(max_batch_roots=1), dict(max_batch_roots=3), dict(max_score_elems=2000)):
        fast = score_roots(d, head, feats, toks, roots, **opts)
        assert fast.shape == (len(roots), d.block_size - 1, V)
        torch.testing.assert_close(fast, slow, atol=1e-4, rtol=1e-4)
        assert torch.equal(fast.argmax(-1), slow.argmax(-1))


@pytest.mark.parametrize("kw", [dict(), dict(layer_types=["sliding_attention", "full_attention"], sliding_window=5)])
def test_batched_every_root_of_a_long_sequence(kw):
    # Long enough that roots fall into groups of several blocks sharing one attention call.
    from runner.drafters.dflash import _root_groups

    d, head = _drafter(**kw), _head()
    feats, toks = _inputs(d, T=200, seed=1)
    roots = list(range(1, 200))
    assert max(b - a for a, b in _root_groups(roots, d.block_size)) >= 4
    slow = score_roots_one_at_a_time(d, head, feats, toks, roots)
    fast = score_roots(d, head, feats, toks, roots)
    torch.testing.assert_close(fast, slow, atol=1e-4, rtol=1e-4)
    assert torch.equal(fast.argmax(-1), slow.argmax(-1))
    # the autograd path (keys concatenated, not written in place) gives the same logits
    r = torch.tensor(roots[::7][::-1])
    with torch.inference_mode():
        ctx_kv = d.context_kv(feats)
    ctx_kv = [(k.clone(), v.clone()) for k, v in ctx_kv]
    with torch.enable_grad():
        graded = d.block_logits(ctx_kv, r, toks[r], head)
    assert graded.requires_grad
    torch.testing.assert_close(graded.detach(), slow[r - 1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kw", [
    dict(),
    dict(is_causal=True),
    dict(num_key_value_heads=4),                                                   # no GQA
    dict(layer_types=["full_attention", "sliding_attention"], sliding_window=4),   # only layer 0 shares
])
def test_first_layer_shared_positions_equal_one_at_a_time(kw):
    # Dense roots (every root of a response) take the first layer's per-position context path
    # (DFlashDrafter._first_layer_attention_shared): root 0, a duplicate, roots near the start
    # (window keys before position 0), and a chunk boundary.
    from runner.drafters.dflash import _shared_first_layer_ok

    d, head = _drafter(**kw), _head()
    feats, toks = _inputs(d, T=48, seed=2)
    roots = [0] + list(range(1, 48)) + [20]
    assert _shared_first_layer_ok(d.layers[0], torch.tensor(sorted(roots)), d.block_size)
    slow = score_roots_one_at_a_time(d, head, feats, toks, roots)
    for opts in (dict(), dict(max_batch_roots=16)):
        fast = score_roots(d, head, feats, toks, roots, **opts)
        torch.testing.assert_close(fast, slow, atol=1e-4, rtol=1e-4)
        assert torch.equal(fast.argmax(-1), slow.argmax(-1))


def test_block_sees_only_context_before_its_root():
    d, head = _drafter(), _head()
    feats, toks = _inputs(d)
    base = score_roots(d, head, feats, toks, [10, 20])
    changed = feats.clone()
    changed[20:] += 5.0                      # features at and after root 20 must not matter
    torch.testing.assert_close(score_roots(d, head, changed, toks, [10, 20]), base)
    changed[19] += 5.0                       # ... the one just before it must
    after = score_roots(d, head, changed, toks, [10, 20])
    torch.testing.assert_close(after[0], base[0])
    assert (after[1] - base[1]).abs().max() > 1e-3
    toks2 = toks.clone()
    toks2[11:] = (toks2[11:] + 1) % V        # only x[p] of the sequence enters the block
    torch.testing.assert_close(score_roots(d, head, feats, toks2, [10]), base[:1])


def test_iter_score_roots_chunks_cover_every_root_once():
    d, head = _drafter(), _head()
    feats, toks = _inputs(d)
    roots = list(range(3, 40))
    seen = []
    for idx, logits in iter_score_roots(d, head, feats, toks, roots, max_batch_roots=8):
        assert logits.shape[0] == len(idx) <= 8
        seen += idx
    assert sorted(seen) == list(range(len(roots)))


def test_logits_written_into_the_result_are_the_bits_a_chunk_yields():
    # score_roots writes each pass's logits straight into its rows of the result (ascending roots)
    d, head = _drafter(), _head()
    feats, toks = _inputs(d)
    roots = list(range(1, 40))
    whole = score_roots(d, head, feats, toks, roots, max_batch_roots=8)
    chunks = torch.cat([lg for _, lg in iter_score_roots(d, head, feats, toks, roots, max_batch_roots=8)])
    assert torch.equal(whole, chunks)


def test_rope_written_into_a_strided_buffer_is_rope_bit_for_bit():
    from runner.drafters.dflash import Rope, _rope_into

    rope = Rope(32, 1e6)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 16, 4, 32, generator=gen) * 10
    cos, sin = rope.cos_sin(torch.arange(16)[None] + 97 * torch.arange(5)[:, None], torch.float32)
    want = Rope.apply(x, cos[:, :, None], sin[:, :, None])
    out = torch.empty(5, 4, 16, 32).transpose(1, 2)          # the layout the attention call reads
    _rope_into(x, cos[:, :, None], sin[:, :, None], out)
    assert torch.equal(out, want)
    shared = x[:1, :1]                                        # one row broadcast over every position
    _rope_into(shared, cos[:, :, None], sin[:, :, None], out)
    assert torch.equal(out, Rope.apply(shared.expand_as(x), cos[:, :, None], sin[:, :, None]))


def test_rmsnorm_in_inference_is_the_autograd_bits():
    # without autograd the weight is multiplied in place into the normalised buffer: same products
    from runner.drafters.dflash import RMSNorm

    gen = torch.Generator().manual_seed(4)
    for dtype in (torch.float32, torch.bfloat16):
        norm = RMSNorm(32, 1e-6).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(32, generator=gen))
        x = (torch.randn(7, 5, 3, 32, generator=gen) * 4).to(dtype)
        with torch.enable_grad():
            want = norm(x)
        with torch.inference_mode():
            assert torch.equal(norm(x), want)
            assert torch.equal(norm(x[:, 1:]), want[:, 1:])            # a strided view too


def test_output_multiplier_softcap_and_embedding_scale():
    plain, head = _drafter(), _head()
    feats, toks = _inputs(plain)
    raw = score_roots(plain, head, feats, toks, [12])
    capped = _drafter(output_multiplier=2.0, final_logit_softcapping=3.0)
    torch.testing.assert_close(score_roots(capped, head, feats, toks, [12]), torch.tanh(raw * 2.0 / 3.0) * 3.0)
    scaled = _drafter(input_embedding_scale=0.5)
    assert not torch.allclose(score_roots(scaled, head, feats, toks, [12]), raw)


def test_bad_inputs_raise():
    d, head = _drafter(), _head()
    feats, toks = _inputs(d)
    with pytest.raises(BadInputError, match="wide"):
        score_roots(d, head, feats[:, :2 * H], toks, [5])
    with pytest.raises(BadInputError, match="hidden_size"):
        score_roots(d, _head(hidden=H + 8), feats, toks, [5])
    with pytest.raises(BadInputError, match="layers"):
        check_compatible(_drafter(target_layer_ids=[0, 2, 4]), head)       # head says 4 target layers
    with pytest.raises(ValueError, match="outside"):
        score_roots(d, head, feats, toks, [40])


# ---- checkpoints ---------------------------------------------------------------------------

REFERENCE_NAMES = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
    f"layers.{i}.{n}" for i in range(2) for n in (
        "input_layernorm.weight", "post_attention_layernorm.weight",
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "self_attn.q_norm.weight", "self_attn.k_norm.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")}


def test_save_writes_reference_layout_and_round_trips(tmp_path):
    d, head = _drafter(layer_types=["sliding_attention", "full_attention"], sliding_window=4), _head()
    save_drafter(d, tmp_path / "ckpt")
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert cfg["dflash_config"] == {"target_layer_ids": [0, 2, 3], "mask_token_id": 5}
    assert cfg["block_size"] == 6 and cfg["architectures"] == ["DFlashDraftModel"]
    assert set(load_file(tmp_path / "ckpt" / "model.safetensors")) == REFERENCE_NAMES
    loaded = DFlashDrafter.from_pretrained(tmp_path / "ckpt")
    assert loaded.config == d.config
    assert (loaded.block_size, loaded.target_layer_ids, loaded.mask_token_id) == (6, [0, 2, 3], 5)
    feats, toks = _inputs(d)
    torch.testing.assert_close(score_roots(loaded, head, feats, toks, [7, 20]),
                               score_roots(d, head, feats, toks, [7, 20]))


def _write_checkpoint(dir_: Path, config: dict, tensors: dict, shards: int = 1) -> Path:
    """A checkpoint directory as published (config.json + safetensors, optionally sharded)."""
    dir_.mkdir(parents=True, exist_ok=True)
    (dir_ / "config.json").write_text(json.dumps(config))
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(dir_ / "model.safetensors"))
        return dir_
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, str(dir_ / fname))
        weight_map.update({n: fname for n in part})
    (dir_ / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dir_


@pytest.mark.parametrize("prefix,shards", [("", 1), ("model.", 1), ("model.", 3)])
def test_loads_reference_names_with_and_without_prefix(tmp_path, prefix, shards):
    d, head = _drafter(seed=3), _head()
    state = {prefix + k: v.contiguous() for k, v in d.state_dict().items()}
    raw = _raw_config()
    raw.pop("block_size")
    raw["dflash_config"]["block_size"] = 6           # sglang: block_size may live in dflash_config
    path = _write_checkpoint(tmp_path / "ckpt", raw, state, shards)
    loaded = DFlashDrafter.from_pretrained(path)
    assert loaded.block_size == 6
    feats, toks = _inputs(d)
    torch.testing.assert_close(score_roots(loaded, head, feats, toks, [9]), score_roots(d, head, feats, toks, [9]))
    bf16 = DFlashDrafter.from_pretrained(path, dtype=torch.bfloat16)
    assert bf16.fc.weight.dtype == torch.bfloat16
    assert score_roots(bf16, head, feats, toks, [9]).dtype == torch.float32


def _state():
    return {k: v.contiguous() for k, v in _drafter().state_dict().items()}


def test_missing_target_layer_ids_is_bad_input(tmp_path):
    raw = _raw_config()
    del raw["dflash_config"]["target_layer_ids"]
    path = _write_checkpoint(tmp_path / "c", raw, _state())
    with pytest.raises(BadInputError, match="target_layer_ids") as err:
        DFlashDrafter.from_pretrained(path)
    assert "config.json" in str(err.value)


def test_wrong_fc_width_is_bad_input(tmp_path):
    raw = _raw_config()
    raw["dflash_config"]["target_layer_ids"] = [0, 1, 2, 3]      # 4 ids but fc was trained on 3
    path = _write_checkpoint(tmp_path / "c", raw, _state())
    with pytest.raises(BadInputError, match=r"fc\.weight.*target_layer_ids"):
        DFlashDrafter.from_pretrained(path)


def test_missing_tensor_and_shape_mismatch_are_bad_input(tmp_path):
    state = _state()
    del state["layers.1.mlp.up_proj.weight"]
    with pytest.raises(BadInputError, match=r"layers\.1\.mlp\.up_proj\.weight"):
        DFlashDrafter.from_pretrained(_write_checkpoint(tmp_path / "a", _raw_config(), state))
    with pytest.raises(BadInputError, match="intermediate_size|implies"):
        DFlashDrafter.from_pretrained(_write_checkpoint(tmp_path / "b", _raw_config(intermediate_size=64), _state()))


@pytest.mark.parametrize("edit,match", [
    (lambda r: r.pop("dflash_config"), "target_layer_ids"),
    (lambda r: r["dflash_config"].pop("mask_token_id"), "mask_token_id"),
    (lambda r: r.pop("block_size"), "block_size"),
    (lambda r: r.pop("rope_theta"), "rope_theta"),
    (lambda r: r.update(layer_types=["full_attention"]), "layer_types"),
    (lambda r: r.update(layer_types=["sliding_attention", "full_attention"]), "sliding_window"),
    (lambda r: r["dflash_config"].update(conv_kernel_size=4), "DFlash2"),
    (lambda r: r.update(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_type"),
    (lambda r: r["dflash_config"].update(target_layer_ids=[1, "x"]), "target_layer_ids"),
    (lambda r: r.update(num_target_layers=3), "num_target_layers"),
])
def test_config_errors_are_bad_input(edit, match):
    raw = _raw_config()
    edit(raw)
    with pytest.raises(BadInputError, match=match):
        DFlashConfig.from_dict(raw)


def test_config_reads_rope_parameters_and_defaults():
    raw = _raw_config()
    raw.pop("rope_theta")
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e7}
    raw.pop("layer_types")
    raw.pop("head_dim")
    cfg = DFlashConfig.from_dict(raw)
    assert cfg.rope_theta == 1e7 and cfg.layer_types == ["full_attention"] * 2 and cfg.head_dim == H // 4


def test_not_a_checkpoint_is_bad_input(tmp_path):
    with pytest.raises(BadInputError, match="config.json"):
        DFlashDrafter.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(_raw_config()))
    with pytest.raises(BadInputError, match="safetensors"):
        DFlashDrafter.from_pretrained(tmp_path)


# ---- target head ---------------------------------------------------------------------------

def test_load_target_head_plain_sharded_and_tied(tmp_path):
    g = torch.Generator().manual_seed(0)
    embed, lm = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g)
    body = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(8, H, generator=g) for i in range(3)}
    cfg = {"num_hidden_layers": 3, "tie_word_embeddings": False}

    plain = _write_checkpoint(tmp_path / "plain", cfg,
                              {"model.embed_tokens.weight": embed, "lm_head.weight": lm, **body})
    h = load_target_head(plain)
    assert torch.equal(h.embed_tokens, embed) and torch.equal(h.lm_head, lm) and not h.tied and h.num_layers == 3

    mm_cfg = {"text_config": {"num_hidden_layers": 3, "tie_word_embeddings": False}}
    sharded = _write_checkpoint(tmp_path / "sharded", mm_cfg,
                                {"model.language_model.embed_tokens.weight": embed, "lm_head.weight": lm, **body},
                                shards=2)
    h = load_target_head(sharded, dtype=torch.bfloat16)
    assert h.embed_tokens.dtype == torch.bfloat16 and torch.equal(h.lm_head, lm.to(torch.bfloat16))

    tied = _write_checkpoint(tmp_path / "tied", {"num_hidden_layers": 3, "tie_word_embeddings": True},
                             {"model.embed_tokens.weight": embed, **body})
    h = load_target_head(tied)
    assert h.tied and torch.equal(h.lm_head, embed)

    broken = _write_checkpoint(tmp_path / "broken", cfg, {"model.embed_tokens.weight": embed})
    with pytest.raises(BadInputError, match="lm_head"):
        load_target_head(broken)
    no_embed = _write_checkpoint(tmp_path / "noembed", cfg, {"lm_head.weight": lm})
    with pytest.raises(BadInputError, match="embedding"):
        load_target_head(no_embed)
