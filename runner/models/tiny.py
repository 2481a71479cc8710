"""Tiny real models built from configs, for tests and ``dfcache run eval --example``.

Nothing is downloaded: the tokenizer is a byte-level BPE trained on the built-in prompt sets,
the target is a Qwen3.5 text model (gated-DeltaNet linear attention + full attention) with
random weights from a fixed seed. Building is deterministic, so the example's keys are stable.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

TINY_TARGET_CONFIG = dict(
    vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
    layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
    max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    tie_word_embeddings=False,
)
SPECIAL_TOKENS = ["<|pad|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def qwen35_shape_config(num_layers: int, hidden: int, vocab: int, seq_len: int):
    """A Qwen3.5 text config of a given depth and width (three gated-DeltaNet layers to one full
    attention layer, as the released models), for the GPU benchmarks' random-weight targets."""
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    L, H = num_layers, hidden
    return Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=H, intermediate_size=3 * H, num_hidden_layers=L,
        num_attention_heads=max(1, H // 128), num_key_value_heads=min(2, max(1, H // 128)), head_dim=256,
        linear_num_key_heads=max(1, H // 128), linear_num_value_heads=max(2, H // 64),
        linear_key_head_dim=128, linear_value_head_dim=128,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (L // 4) + ["linear_attention"] * (L % 4),
        max_position_embeddings=max(8192, 2 * seq_len), bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=False)


def _training_texts() -> list[str]:
    texts = []
    for name in ("coding.jsonl", "reasoning.jsonl"):
        for line in resources.files("runner").joinpath("data", name).read_text().splitlines():
            rec = json.loads(line)
            texts.extend(m["content"] for m in rec["messages"])
    texts += ["def f(x):\n    return x + 1\n", "for i in range(10):\n    print(i)\n",
              "The answer is 42 because 6 times 7 is 42.", "assistant user system"]
    return texts


def build_tiny_tokenizer(out_dir: str | Path):
    """Train and save a 512-token byte-level BPE tokenizer with a ChatML-style template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(unk_token=None))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(_training_texts(), trainers.BpeTrainer(
        vocab_size=TINY_TARGET_CONFIG["vocab_size"] - 8, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<|pad|>", bos_token="<|im_start|>",
                                  eos_token="<|im_end|>", mask_token="<|mask|>")
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(out_dir))
    return tok


def build_tiny_target(out_dir: str | Path, *, seed: int = 0, num_layers: int = 6, **overrides) -> Path:
    """Write a tiny random Qwen3.5 target (fp32 safetensors) and its tokenizer to ``out_dir``."""
    import torch
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(TINY_TARGET_CONFIG)
    cfg["num_hidden_layers"] = num_layers
    cfg["layer_types"] = (["linear_attention", "linear_attention", "full_attention"] * num_layers)[:num_layers]
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**cfg))
    # Random init gives near-uniform next-token distributions; a larger embedding/lm_head scale
    # makes greedy output structured (repetitive), which is what a drafter can learn from.
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(8.0)
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(str(out))
    build_tiny_tokenizer(out)
    return out
