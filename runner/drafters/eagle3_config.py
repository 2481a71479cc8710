"""An EAGLE-3 checkpoint's config.json as planning reads it (JSON only: no torch import).

Two layouts: SpecForge's (``architectures: [LlamaForCausalLMEagle3]``, the layer ids in
``eagle_config.eagle_aux_hidden_state_layer_ids``, read by SGLang) and speculators'
(``speculators_model_type: eagle3``, the layer's fields under ``transformer_layer_config``, the
ids at the top level, read by vLLM). dfcache's layer id k is the output of target decoder layer k
(Hugging Face ``hidden_states[k+1]``), the convention SpecForge's ids have (SGLang captures the
input of layer k+1); speculators' ids are Hugging Face ``hidden_states`` indices (vLLM captures the
input of layer k), so a speculators id k is dfcache's k-1. Both defaults name the same tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dfcache.errors import BadInputError

# The architecture names published EAGLE-3 checkpoints declare: SpecForge / SGLang / the EAGLE repo's
# (yuhuili/EAGLE3-*: LlamaForCausalLMEagle3), SpecForge's Qwen3 variant, speculators' (Eagle3Speculator;
# older converters: Eagle3DraftModel) and vLLM's own name for it (Eagle3LlamaForCausalLM, which vLLM's
# speculators config reader writes, vllm/transformers_utils/configs/speculators/algos.py).
SPECFORGE_ARCHS = ("LlamaForCausalLMEagle3", "Qwen3ForCausalLMEagle3", "Eagle3DraftModel",
                   "Eagle3LlamaForCausalLM", "Eagle3Speculator")

# transformers' class defaults for the layer configs EAGLE-3 drafters use: a config written with
# ``to_diff_dict`` (speculators' serializer of transformer_layer_config under transformers 4.x)
# leaves out every field equal to its class default, which the peers' loaders fill back in
# (LlamaConfig(**d) / Qwen3Config(**d)). Values from transformers 5.25's LlamaConfig() / Qwen3Config().
_LAYER_DEFAULTS = {
    "llama": {"hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32, "vocab_size": 32000,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0},
    "qwen3": {"hidden_size": 4096, "intermediate_size": 22016, "num_attention_heads": 32, "vocab_size": 151936,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "head_dim": 128},
}


def is_eagle3_config(raw: dict) -> bool:
    """True for a SpecForge/SGLang EAGLE-3 config or a speculators one (planning reads JSON only).
    A one-layer Llama with a reduced draft vocabulary and no EAGLE name (nebius/EAGLE3-gpt-oss-20b:
    ``LlamaForCausalLM`` with ``draft_vocab_size``/``truncated_vocab_size``) is an EAGLE-3 head too:
    no language model declares a draft vocabulary."""
    archs = raw.get("architectures") or []
    if raw.get("speculators_model_type") == "eagle3" or any(isinstance(a, str) and a in SPECFORGE_ARCHS
                                                              for a in archs):
        return True
    return (raw.get("num_hidden_layers") == 1 and "dflash_config" not in raw and "speculators_model_type" not in raw
            and any(isinstance(raw.get(k), int) for k in ("draft_vocab_size", "truncated_vocab_size")))


def default_layer_ids(num_target_layers: int) -> list[int]:
    """SGLang's and SpecForge's default EAGLE-3 layers: outputs of layers 1, N//2-1, N-4."""
    return [1, num_target_layers // 2 - 1, num_target_layers - 4]


def _int_list(value) -> list[int] | None:
    if isinstance(value, list) and value and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                 for i in value):
        return [int(i) for i in value]
    return None


@dataclass
class Eagle3Config:
    """The fields of an EAGLE-3 ``config.json`` that change what the drafter computes."""

    hidden_size: int
    target_hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    draft_vocab_size: int
    target_layer_ids: list[int] | None  # None: SGLang's default for the target's depth
    layout: str = "specforge"           # "specforge" | "speculators" (where the layer's fields live)
    norm_before_residual: bool = False
    speculative_tokens: int | None = None  # the chain length the checkpoint declares, if any
    declared_layer_ids: list[int] | None = None  # as the config spells them (speculators: HF indices)
    fc_norm: bool = False      # SpecForge and speculators: an RMSNorm per target layer's features before fc
    norm_output: bool = True   # SpecForge: False gives logits = lm_head(h) without the final norm
    rope_scaling: dict | None = None  # llama3 / yarn / linear frequencies (runner.drafters.rope)
    norm_before_fc: bool = False  # speculators (RedHatAI gpt-oss heads): one RMSNorm over the 3 layers' concat
    feed_normed: bool = False  # speculators' norm_output (EAGLE 3.1): the next step reads norm(h), not h
    qk_norm: bool = False      # Qwen3 layer (speculators' default transformer_layer_config): q/k RMSNorm per head
    attention_bias: bool = False  # q/k/v/o biases (vLLM and speculators read attention_bias)
    mlp_bias: bool = False        # gate/up/down biases (Llama's mlp_bias)
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "Eagle3Config":
        if not isinstance(raw, dict):
            raise BadInputError(f"{source}: expected a JSON object; point dfcache at the drafter's config.json.")
        spec = raw.get("speculators_model_type") == "eagle3"
        layer = raw.get("transformer_layer_config") if spec else raw
        if not isinstance(layer, dict):
            raise BadInputError(f"{source}: speculators config without a 'transformer_layer_config' object; "
                                "re-save the checkpoint with speculators.")
        # speculators' transformer_layer_config defaults to a Qwen3Config (Eagle3SpeculatorConfig);
        # a layer config saved as a diff leaves out its class's defaults (_LAYER_DEFAULTS).
        model_type = str(layer.get("model_type") or ("qwen3" if spec else "llama"))
        if spec:
            layer = {**_LAYER_DEFAULTS.get(model_type, {}), **{k: v for k, v in layer.items() if v is not None}}

        def need(name, where=layer):
            value = where.get(name)
            if value is None:
                raise BadInputError(f"{source}: missing field '{name}' of an EAGLE-3 drafter; "
                                    "re-save the checkpoint with SpecForge or speculators.")
            return value

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(layer.get("num_key_value_heads") or heads)
        head_dim = int(layer.get("head_dim") or hidden // heads)
        layers = int(layer.get("num_hidden_layers", 1))
        if layers != 1:
            raise BadInputError(f"{source}: num_hidden_layers={layers}; dfcache evaluates single-layer EAGLE-3 "
                                "drafters (what SGLang and vLLM serve). Use a one-layer checkpoint.")
        act = layer.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise BadInputError(f"{source}: hidden_act={act!r}; EAGLE-3 drafters use a SwiGLU MLP ('silu').")
        # speculators copies the verifier's RoPE into transformer_layer_config (train/cli.py: llama3
        # for Llama-3.1 verifiers, yarn for gpt-oss), nebius' heads declare yarn: read, not refused
        from .rope import rope_scaling_of

        scaling = rope_scaling_of(layer, source)
        prf = layer.get("partial_rotary_factor", (layer.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))
        if prf not in (None, 1, 1.0):
            raise BadInputError(f"{source}: partial_rotary_factor={prf} is not supported (the drafter rotates "
                                "the whole head_dim); pass a checkpoint with full rotary embeddings.")
        rope = layer.get("rope_theta")
        if rope is None:
            rope = (layer.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        types = layer.get("layer_types") or []
        if "sliding_attention" in types or layer.get("use_sliding_window"):
            # dfcache's EAGLE-3 attends over the whole context; a windowed layer's drafts differ
            # once a context is longer than the window.
            raise BadInputError(f"{source}: the drafter's layer uses sliding-window attention (layer_types / "
                                "use_sliding_window), which dfcache's EAGLE-3 does not score; pass a checkpoint "
                                "with a full-attention layer.")
        vocab = int(need("vocab_size"))
        top = raw if spec else layer
        # truncated_vocab_size: nebius' EAGLE-3 heads and vLLM's EAGLE configs name the draft vocabulary so
        draft_vocab = int(top.get("draft_vocab_size") or top.get("truncated_vocab_size") or vocab)
        ecfg_any = raw.get("eagle_config")
        if isinstance(ecfg_any, dict) and ecfg_any.get("use_aux_hidden_state") is False:
            raise BadInputError(f"{source}: eagle_config.use_aux_hidden_state is false (the drafter reads the "
                                "target's last state only, no fc over three layers): that is not an EAGLE-3 "
                                "drafter dfcache scores; pass an EAGLE-3 checkpoint.")
        if spec:
            ids = raw.get("eagle_aux_hidden_state_layer_ids")
        else:
            ecfg = raw.get("eagle_config") or {}
            ids = ecfg.get("eagle_aux_hidden_state_layer_ids") if isinstance(ecfg, dict) else None
            ids = ids if ids is not None else raw.get("eagle_aux_hidden_state_layer_ids")
        if ids is not None and (_int_list(ids) is None or len(ids) != 3):
            raise BadInputError(f"{source}: eagle_aux_hidden_state_layer_ids must be 3 non-negative layer ids "
                                f"(low, mid, high), got {ids!r}. Fix the drafter config.")
        declared = None if ids is None else [int(i) for i in ids]
        if spec and declared is not None:
            # speculators (and vLLM) count Hugging Face hidden_states indices: id k is the input of
            # layer k, the output of layer k-1 (speculators/convert/dflash/converter.py: "z-lab reads
            # hidden_states[layer_id + 1] ... speculators uses the layer id directly"); dfcache's ids
            # are SGLang's, the output of layer k.
            if 0 in declared:
                raise BadInputError(f"{source}: eagle_aux_hidden_state_layer_ids {declared} include 0, the "
                                    "embedding output (hidden_states[0]), which no hidden-state stage stores; "
                                    "use a drafter trained on decoder-layer outputs.")
            ids = [k - 1 for k in declared]
        k = None
        if spec:
            methods = ((raw.get("speculators_config") or {}).get("proposal_methods") or [])
            if methods and isinstance(methods[0], dict) and isinstance(methods[0].get("speculative_tokens"), int):
                k = methods[0]["speculative_tokens"]
        if spec:
            # speculators writes its EAGLE fields at the top level (Eagle3SpeculatorConfig); its
            # norm_output is EAGLE 3.1's "feed norm(h) to the next step" (Eagle3DraftModel.forward),
            # not SpecForge's flag of that name (its logits always read norm(h)). A config without
            # norm_before_residual is read as vLLM reads it (update_eagle3: default True).
            fc_norm, norm_before_fc = bool(raw.get("fc_norm", False)), bool(raw.get("norm_before_fc", False))
            norm_output, feed_normed = True, bool(raw.get("norm_output", False))
            nbr = bool(raw.get("norm_before_residual", True))
        else:
            fc_norm, norm_before_fc = bool(layer.get("fc_norm", False)), bool(layer.get("norm_before_fc", False))
            norm_output, feed_normed = bool(layer.get("norm_output", True)), False
            nbr = bool(raw.get("norm_before_residual", False))
        if fc_norm and norm_before_fc:
            raise BadInputError(f"{source}: fc_norm and norm_before_fc are both set, which no peer defines "
                                "(speculators refuses it); fix the drafter config.")
        return cls(hidden_size=hidden, target_hidden_size=int(raw.get("target_hidden_size") or layer.get("target_hidden_size") or hidden),
                   num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                   intermediate_size=int(need("intermediate_size")), rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
                   rope_theta=float(rope), vocab_size=vocab, draft_vocab_size=draft_vocab,
                   target_layer_ids=None if ids is None else [int(i) for i in ids],
                   layout="speculators" if spec else "specforge", declared_layer_ids=declared,
                   norm_before_residual=nbr, speculative_tokens=k,
                   fc_norm=fc_norm, norm_output=norm_output, norm_before_fc=norm_before_fc, feed_normed=feed_normed,
                   qk_norm=model_type == "qwen3" and spec, rope_scaling=scaling,
                   attention_bias=bool(layer.get("attention_bias", False)), mlp_bias=bool(layer.get("mlp_bias", False)))

    def to_dict(self) -> dict[str, Any]:
        """A config.json as SpecForge writes one (LlamaForCausalLMEagle3, read by SGLang)."""
        out = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
               "hidden_size": self.hidden_size, "num_attention_heads": self.num_attention_heads,
               "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
               "intermediate_size": self.intermediate_size, "num_hidden_layers": 1, "hidden_act": "silu",
               "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta, "vocab_size": self.vocab_size,
               "draft_vocab_size": self.draft_vocab_size, "max_position_embeddings": 4096,
               "pretraining_tp": 1, "tie_word_embeddings": False}
        if self.target_hidden_size != self.hidden_size:
            out["target_hidden_size"] = self.target_hidden_size
        if self.fc_norm:
            out["fc_norm"] = True
        if self.rope_scaling is not None:
            out["rope_scaling"] = dict(self.rope_scaling)
        if self.norm_before_fc:
            out["norm_before_fc"] = True
        if self.norm_before_residual:
            out["norm_before_residual"] = True
        if self.attention_bias:
            out["attention_bias"] = True
        if self.mlp_bias:
            out["mlp_bias"] = True
        if not self.norm_output:
            out["norm_output"] = False
        if self.target_layer_ids is not None:
            out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.target_layer_ids)}
        return out
