"""Support matrix (docs/targets.md): every target architecture row builds a tiny model from its
config, gets an untrained DFlash drafter from ``make_untrained_drafter``, and runs the eval graph
(local greedy completions, tokens, hidden states, drafter eval) on one prompt.

Kept cheap on purpose: hidden 32, 2 decoder layers, one prompt, a few new tokens, one shared
tokenizer. What is checked is that each architecture loads, extracts the requested layers and
evaluates, with acceptance values in range; the numbers of an untrained drafter mean nothing.
"""

from __future__ import annotations

import shutil

import pytest

from dfcache import open_store
from dfcache.errors import BadInputError

V, H, L = 512, 32, 2
COMMON = dict(vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=2, num_key_value_heads=1,
              head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              tie_word_embeddings=False)
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
              layer_types=["linear_attention", "full_attention"])
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def _model(kind: str):
    import transformers as tf

    dense = dict(COMMON, intermediate_size=64)
    if kind == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**dense))
    if kind == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**dense))
    if kind in ("qwen3", "hf-cache-id"):
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(**dense))
    if kind == "qwen3_moe":
        return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**dense, **MOE, decoder_sparse_step=1))
    if kind == "qwen3_5":
        return tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**dense, **LINEAR))
    if kind == "qwen3_5_moe":
        # No dense intermediate_size: make_untrained_drafter must size its MLP from the experts.
        return tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**COMMON, **LINEAR, **MOE,
                                                                shared_expert_intermediate_size=32))
    if kind == "qwen3_next":
        return tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**dense, **LINEAR, **MOE, shared_expert_intermediate_size=32))
    if kind.startswith("gpt_oss"):
        return tf.GptOssForCausalLM(tf.GptOssConfig(**dense, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                                                    layer_types=["sliding_attention", "full_attention"]))
    if kind == "gemma3":
        return tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**dense, sliding_window=8,
                                                        layer_types=["sliding_attention", "full_attention"]))
    if kind == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(**dense, sliding_window=8))
    if kind == "qwen3_5-vl-wrapper":
        text = dict(COMMON, intermediate_size=64, **LINEAR, vocab_size=V + 16)
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=H, patch_size=4,
                      num_position_embeddings=16)
        return tf.Qwen3_5ForConditionalGeneration(tf.Qwen3_5Config(
            text_config=text, vision_config=vision, image_token_id=V + 1, video_token_id=V + 2,
            vision_start_token_id=V + 3, vision_end_token_id=V + 4))
    raise AssertionError(kind)


# (row, attention implementation, expected outcome: None = runs; a string = BadInputError matching it)
ROWS = [
    ("llama", "sdpa", None), ("qwen2", "sdpa", None), ("qwen3", "sdpa", None), ("qwen3_moe", "sdpa", None),
    ("qwen3_5", "sdpa", None), ("qwen3_5_moe", "sdpa", None), ("qwen3_next", "sdpa", None),
    ("gpt_oss", "eager", None), ("gpt_oss-sdpa", "sdpa", "--attn-implementation eager"),
    ("gemma3", "sdpa", None), ("mistral", "sdpa", None), ("qwen3_5-vl-wrapper", "sdpa", None),
    ("hf-cache-id", "sdpa", None),
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from runner.models.tiny import build_tiny_tokenizer

    d = tmp_path_factory.mktemp("tok")
    build_tiny_tokenizer(d)
    return d


def _build(kind: str, root, tokenizer_dir, monkeypatch) -> tuple[str, object]:
    import torch

    torch.manual_seed(0)
    model = _model(kind)
    if kind == "hf-cache-id":
        # A Hugging Face id resolved in the local hub cache (refs/main -> snapshots/<commit>/).
        cache = root / "hub"
        commit = "0123456789abcdef0123456789abcdef01234567"
        d = cache / "models--tiny-org--tiny-qwen3" / "snapshots" / commit
        (cache / "models--tiny-org--tiny-qwen3" / "refs").mkdir(parents=True)
        (cache / "models--tiny-org--tiny-qwen3" / "refs" / "main").write_text(commit)
        monkeypatch.setenv("HF_HUB_CACHE", str(cache))
        target = "tiny-org/tiny-qwen3"
    else:
        d = root / kind
        target = str(d)
    model.save_pretrained(str(d))
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, d / f.name)
    return target, d


@pytest.mark.parametrize("kind,attn,expect", ROWS, ids=[r[0] for r in ROWS])
def test_target_architecture_runs_the_eval(kind, attn, expect, tokenizer_dir, tmp_path, monkeypatch):
    import torch

    from runner.trust.doctor import run_doctor
    from runner.core.graph import RunContext, resolve
    from runner.core.pipeline import execute
    from runner.core.options import EvalOptions
    from runner.core.pipeline import build_graph
    from runner.stages.drafter_eval import read_summary
    from runner.models.train_tiny import make_untrained_drafter, single_thread

    target, d = _build(kind, tmp_path, tokenizer_dir, monkeypatch)
    drafter = make_untrained_drafter(d, tmp_path / "drafter", seed=1, layer_ids=[0, 1], num_layers=1,
                                     block_size=4, layer_types=("full_attention",), sliding_window=None)
    rep = run_doctor(target, str(drafter))
    assert rep.ok, [f for f in rep.findings if f.severity == "error"]
    if kind == "gemma3":
        assert any(f.check == "embedding scale" and f.severity == "warning" for f in rep.findings)
    opts = EvalOptions(target=target, drafters=[str(drafter)], prompts="builtin:coding", num_prompts=1,
                       max_new_tokens=5, backend="torch", device="cpu", dtype="float32", tree_budgets=[2],
                       attn_implementation=attn, progress=False)
    ctx = RunContext(open_store(tmp_path / "store"), opts, argv=[])
    with single_thread():
        nodes = resolve(ctx, build_graph(ctx, "eval"))
        if expect is not None:
            with pytest.raises(BadInputError, match=expect):
                execute(ctx, nodes)
            return
        execute(ctx, nodes)
    ev = next(n for n in nodes if n.stage == "drafter_eval")
    s = read_summary(ctx.store, ev)
    assert s["chain"]["num_responses"] == 1 and 1.0 <= s["chain"]["tau"] <= 4.0
    assert 1.0 <= s["tree"]["2"]["tau"] <= 3.0
    hs = [n for n in nodes if n.stage == "hidden_states"]
    assert sorted(n.inputs["layer"] for n in hs) == [0, 1]
    assert {n.inputs["backend"]["attn_implementation"] for n in hs} == {attn}
    from dfcache.samples import SampleSet

    assert SampleSet(ctx.store, hs[0].partition.key, hs[0].sample_keys).read_raw(0, "hidden").shape[1] == H
    del torch
