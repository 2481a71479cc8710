"""DFlash block-diffusion drafter: checkpoint loading and offline scoring of block roots.

Semantics follow ``/work/shared/reference/dflash.md`` (sections cited as §):

* Context features (§1.3): for every target position t, ``C[t]`` is the concatenation, in the
  order of ``dflash_config.target_layer_ids``, of the output of target decoder layer k (Hugging
  Face ``hidden_states[k+1]``, *before* the final norm). The drafter projects them once,
  ``Z = hidden_norm(fc(C))``.
* KV injection (§1.4): every drafter layer turns the same ``Z`` into extra keys/values
  (``k_norm(k_proj(Z))`` with RoPE at the context positions, ``v_proj(Z)``). Queries come only
  from the block tokens; only the block stream goes through the residual/MLP path.
* A block rooted at p (§1.6, §6 step 2) is ``[x[p], MASK x (B-1)]`` at positions p..p+B-1,
  embedded with the target's frozen embedding. It sees the context features of positions < p
  only (x[p]'s own feature is not available online when the block is drafted).
* Attention inside a block (§1.5): full-attention layers are bidirectional over the B block
  tokens; sliding layers are causal with a window that counts the query token
  (``q_pos - k_pos < sliding_window``). A config ``is_causal`` overrides the causality like the
  later z-lab code does.
* Logits (§1.7): ``target.lm_head(drafter.norm(h))`` for slots 1..B-1, then the optional
  ``output_multiplier`` and ``tanh`` soft-cap ``final_logit_softcapping``.

The offline evaluator needs draft logits for many roots of the same sequence. Because the
context keys/values do not depend on the root (§6 step 1), :func:`score_roots` computes them
once and scores a chunk of roots in one batched pass: the attention of a chunk is the
training-style block mask over ``[context ++ blocks]`` (each block sees context t < p and its own
B tokens), evaluated as one softmax over the block's context scores and in-block scores so the
context keys are never copied per root. :func:`score_roots_one_at_a_time` is the slow
reference: it re-projects ``C[:p]`` for every root and attends over the literal concatenation,
the way the online loop does; tests check the two agree.

Checkpoint files (§1.8): ``config.json`` plus ``*.safetensors`` (optionally sharded with
``model.safetensors.index.json``), parameter names without prefix (a ``model.`` prefix is
accepted). Bad or inconsistent checkpoints raise :class:`dfcache.errors.BadInputError`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dfcache.errors import BadInputError

from .rope import rope_scaling_of

__all__ = [
    "DFlashConfig", "DFlashDrafter", "TargetHead", "load_target_head", "save_drafter",
    "score_roots", "score_roots_one_at_a_time", "iter_score_roots", "check_compatible", "init_drafter_weights",
]

_LAYER_TYPES = ("full_attention", "sliding_attention")
# DFlash2 adds modules that change the forward pass; silently ignoring them would give wrong drafts.
_DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
_DFLASH2_TENSOR_MARKERS = ("candidate_selector.", "attention_conv.", "mlp_conv.")
# A DFlash drafter published under another name: z-lab's loaders read "MuseGlimmerAssistantModel"
# (the "Meta v1" assistant, z-lab/dflash tests/fixtures/assistant-config.json) as DFlash with its
# fields at the top level, its in-block attention bidirectional (z-lab dflash/model_mlx.py
# _meta_v1_config_kwargs: is_causal=False, although its layers are sliding_attention) and two
# modules renamed (_remap_meta_v1_weights).
META_V1_ARCH = "MuseGlimmerAssistantModel"
_META_V1_RENAMES = (("encoder.fc.", "fc."), ("encoder.output_norm_enc.", "hidden_norm."))


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------

@dataclass
class DFlashConfig:
    """The fields of a DFlash ``config.json`` that change what the drafter computes."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    attention_bias: bool = False
    is_causal: bool | None = None
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    input_embedding_scale: float = 1.0
    num_target_layers: int | None = None
    vocab_size: int | None = None
    rope_scaling: dict | None = None  # rope_scaling_of: llama3 / yarn / linear frequencies; None: plain

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "DFlashConfig":
        """Parse a DFlash config dict; ``source`` names the file in error messages."""
        if not isinstance(raw, dict):
            raise BadInputError(f"{source}: expected a JSON object, got {type(raw).__name__}. "
                                "Point dfcache at the drafter's config.json.")
        dcfg = raw.get("dflash_config") or {}
        if not isinstance(dcfg, dict):
            raise BadInputError(f"{source}: 'dflash_config' must be an object. Fix the drafter config.")
        for key in _DFLASH2_KEYS:
            if key in dcfg or key in raw:
                raise BadInputError(
                    f"{source}: field '{key}' marks a DFlash2 drafter, which this evaluator does not "
                    "implement (its conv/selector modules change the drafts). Use a DFlash (v1) drafter.")

        def draft_value(name, default=None):
            # Same precedence as the reference: dflash_config first, then the top level.
            return dcfg.get(name, raw.get(name, default))

        def need(name, value, fix):
            if value is None:
                raise BadInputError(f"{source}: missing field '{name}'. {fix}")
            return value

        ids = draft_value("target_layer_ids")
        need("dflash_config.target_layer_ids", ids,
             "Add the target layer ids the drafter was trained on (e.g. \"dflash_config\": "
             "{\"target_layer_ids\": [1, 9, 17, 25, 33]}); dfcache never guesses them (dflash.md §1.2).")
        if (not isinstance(ids, list) or not ids
                or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
            raise BadInputError(f"{source}: 'dflash_config.target_layer_ids' must be a non-empty list of "
                                f"non-negative integers, got {ids!r}. Fix the drafter config.")
        mask_id = need("dflash_config.mask_token_id", draft_value("mask_token_id"),
                       "Add the MASK token id used in training (dflash_config.mask_token_id, usually "
                       "len(tokenizer), e.g. 151669 for Qwen3).")
        block_size = int(need("block_size", draft_value("block_size"),
                              "Add 'block_size' (top level or inside dflash_config), e.g. 16."))
        if block_size < 2:
            raise BadInputError(f"{source}: 'block_size' must be >= 2, got {block_size}. Fix the drafter config.")

        hidden = int(need("hidden_size", raw.get("hidden_size"), "Add the drafter's hidden_size."))
        layers = int(need("num_hidden_layers", raw.get("num_hidden_layers"), "Add num_hidden_layers."))
        heads = int(need("num_attention_heads", raw.get("num_attention_heads"), "Add num_attention_heads."))
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise BadInputError(f"{source}: num_attention_heads={heads} is not a multiple of "
                                f"num_key_value_heads={kv_heads}. Fix the drafter config.")
        head_dim = int(raw.get("head_dim") or hidden // heads)
        inter = int(need("intermediate_size", raw.get("intermediate_size"), "Add intermediate_size."))

        rope_params = raw.get("rope_parameters") or {}
        rope_scaling = raw.get("rope_scaling") or {}
        rope_theta = raw.get("rope_theta", rope_params.get("rope_theta"))
        need("rope_theta", rope_theta, "Add the drafter's own rope_theta (e.g. 1000000 for Qwen3 "
                                       "drafters, 10000000 for Qwen3.5/3.6); it is not the target's.")
        scaling = rope_scaling_of(raw, source)
        prf = raw.get("partial_rotary_factor", rope_params.get("partial_rotary_factor", 1.0))
        if prf not in (None, 1, 1.0):
            raise BadInputError(f"{source}: partial_rotary_factor={prf} is not supported; DFlash drafters "
                                "rotate the whole head_dim. Remove the field if it was copied from the target.")

        layer_types = raw.get("layer_types") or ["full_attention"] * layers
        if len(layer_types) != layers:
            raise BadInputError(f"{source}: 'layer_types' has {len(layer_types)} entries but "
                                f"num_hidden_layers={layers}. Make them agree.")
        bad = sorted(set(layer_types) - set(_LAYER_TYPES))
        if bad:
            raise BadInputError(f"{source}: unknown layer_types {bad}; expected {list(_LAYER_TYPES)}.")
        window = raw.get("sliding_window")
        if "sliding_attention" in layer_types and not (isinstance(window, int) and window > 0):
            raise BadInputError(f"{source}: layer_types has sliding_attention layers but 'sliding_window' "
                                f"is {window!r}. Add the window size the drafter was trained with.")

        act = raw.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise BadInputError(f"{source}: hidden_act={act!r}; DFlash drafters use a SwiGLU MLP ('silu'). "
                                "Fix hidden_act if it was copied from elsewhere.")
        softcap = draft_value("final_logit_softcapping")
        num_target_layers = raw.get("num_target_layers")
        cfg = cls(
            hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=inter,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=float(rope_theta),
            block_size=block_size, target_layer_ids=[int(i) for i in ids], mask_token_id=int(mask_id),
            layer_types=list(layer_types),
            sliding_window=int(window) if "sliding_attention" in layer_types else None,
            attention_bias=bool(raw.get("attention_bias", False)),
            is_causal=(False if META_V1_ARCH in (raw.get("architectures") or []) else None)
            if draft_value("is_causal") is None else bool(draft_value("is_causal")),
            output_multiplier=float(draft_value("output_multiplier", 1.0)),
            final_logit_softcapping=float(softcap) if softcap else None,
            input_embedding_scale=float(draft_value("input_embedding_scale", 1.0)),
            num_target_layers=int(num_target_layers) if num_target_layers is not None else None,
            vocab_size=int(raw["vocab_size"]) if raw.get("vocab_size") is not None else None,
            rope_scaling=scaling,
        )
        if cfg.num_target_layers is not None and max(cfg.target_layer_ids) >= cfg.num_target_layers:
            raise BadInputError(f"{source}: target_layer_ids {cfg.target_layer_ids} reach past "
                                f"num_target_layers={cfg.num_target_layers}. Fix the ids or num_target_layers.")
        return cfg

    def to_dict(self) -> dict[str, Any]:
        """A config.json in the reference layout (``sgl-project/SpecForge: configs/*-dflash.json``)."""
        out: dict[str, Any] = {
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
            "hidden_size": self.hidden_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "intermediate_size": self.intermediate_size,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta, "hidden_act": "silu",
            "attention_bias": self.attention_bias, "layer_types": list(self.layer_types),
            "block_size": self.block_size, "tie_word_embeddings": False,
            "dflash_config": {"target_layer_ids": list(self.target_layer_ids),
                              "mask_token_id": self.mask_token_id},
        }
        if self.sliding_window is not None:
            out["sliding_window"] = self.sliding_window
            out["use_sliding_window"] = True
        if self.num_target_layers is not None:
            out["num_target_layers"] = self.num_target_layers
        if self.vocab_size is not None:
            out["vocab_size"] = self.vocab_size
        if self.rope_scaling is not None:
            out["rope_scaling"] = dict(self.rope_scaling)
        if self.is_causal is not None:
            out["dflash_config"]["is_causal"] = self.is_causal
        if self.output_multiplier != 1.0:
            out["dflash_config"]["output_multiplier"] = self.output_multiplier
        if self.final_logit_softcapping:
            out["dflash_config"]["final_logit_softcapping"] = self.final_logit_softcapping
        if self.input_embedding_scale != 1.0:
            out["dflash_config"]["input_embedding_scale"] = self.input_embedding_scale
        return out


# --------------------------------------------------------------------------------------------
# Target embedding / LM head
# --------------------------------------------------------------------------------------------

@dataclass
class TargetHead:
    """The target's frozen token embedding and LM head (the drafter has neither, §1.1)."""

    embed_tokens: torch.Tensor      # [V, H]
    lm_head: torch.Tensor           # [V, H]; the embedding itself for tied targets
    tied: bool = False
    num_layers: int | None = None   # target depth, when config.json says it

    @property
    def hidden_size(self) -> int:
        return int(self.embed_tokens.shape[1])

    @property
    def vocab_size(self) -> int:
        return int(self.lm_head.shape[0])

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embed_tokens)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head.to(hidden.dtype))


_EMBED_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
                "language_model.model.embed_tokens.weight", "embed_tokens.weight",
                "transformer.wte.weight")
_LM_HEAD_NAMES = ("lm_head.weight", "model.lm_head.weight", "language_model.lm_head.weight")


def _safetensors_files(model_dir: Path, what: str) -> dict[str, Path]:
    """Map tensor name -> file for a (possibly sharded) safetensors checkpoint directory."""
    from safetensors import safe_open

    if not model_dir.is_dir():
        raise BadInputError(f"{what}: {model_dir} is not a directory. Pass the model directory "
                            "(the one holding config.json and *.safetensors).")
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise BadInputError(f"{what}: {index} is not a valid safetensors index ({exc}). "
                                "Re-download the checkpoint.") from exc
        return {name: model_dir / fname for name, fname in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise BadInputError(f"{what}: no *.safetensors file in {model_dir}. Download the weights "
                            "(only safetensors checkpoints are supported).")
    names: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                names[name] = f
    return names


def _read_tensors(files: dict[str, Path], wanted: Iterable[str], device, dtype) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        by_file.setdefault(files[name], []).append(name)
    out = {}
    for f, names in by_file.items():
        if not f.exists():
            raise BadInputError(f"{f} is named in the safetensors index but missing. Re-download the checkpoint.")
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name in names:
                out[name] = sf.get_tensor(name).to(device=device, dtype=dtype)
    return out


def _read_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise BadInputError(f"{path}: not valid JSON ({exc}). Fix or re-download the file.") from exc


def load_target_head(target_dir: str | Path, device: str | torch.device = "cpu",
                     dtype: torch.dtype = torch.float32) -> TargetHead:
    """Read only the target's ``embed_tokens`` and ``lm_head`` tensors (no full model load).

    Handles sharded checkpoints (``model.safetensors.index.json``), multimodal name prefixes
    (``model.language_model.embed_tokens.weight``) and tied embeddings (no lm_head tensor).
    """
    target_dir = Path(target_dir)
    files = _safetensors_files(target_dir, "target checkpoint")
    cfg = _read_config(target_dir)
    text_cfg = cfg.get("text_config") or cfg
    embed_name = next((n for n in _EMBED_NAMES if n in files), None)
    if embed_name is None:
        raise BadInputError(f"target checkpoint {target_dir}: no embedding tensor (looked for "
                            f"{', '.join(_EMBED_NAMES)}). Pass the target model directory, not the drafter's.")
    head_name = next((n for n in _LM_HEAD_NAMES if n in files), None)
    tie_flag = cfg.get("tie_word_embeddings", text_cfg.get("tie_word_embeddings"))
    if head_name is None and tie_flag is False:
        raise BadInputError(f"target checkpoint {target_dir}: config.json says tie_word_embeddings=false "
                            "but there is no lm_head.weight tensor. The checkpoint is incomplete; re-download it.")
    tensors = _read_tensors(files, [embed_name] + ([head_name] if head_name else []), device, dtype)
    embed = tensors[embed_name]
    lm_head = tensors[head_name] if head_name else embed
    if lm_head.shape[1] != embed.shape[1]:
        raise BadInputError(f"target checkpoint {target_dir}: {head_name} is {tuple(lm_head.shape)} but "
                            f"{embed_name} is {tuple(embed.shape)}. The checkpoint is inconsistent.")
    n_layers = text_cfg.get("num_hidden_layers")
    return TargetHead(embed_tokens=embed, lm_head=lm_head, tied=head_name is None,
                      num_layers=int(n_layers) if n_layers is not None else None)


# --------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and cast back before the weight, like Qwen3RMSNorm, so bf16 runs
        # round the same way the reference does.
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if dtype == self.weight.dtype and not torch.is_grad_enabled():
            # the weight multiplied in place: the same products (w * x is x * w), one buffer fewer
            return xf.to(dtype).mul_(self.weight)
        return self.weight * xf.to(dtype)


def attention_projections(in_dim: int, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool,
                          qk_norm: bool, eps: float) -> nn.Module:
    """A drafter layer's ``self_attn``: q/k/v over ``in_dim`` features, o back to ``hidden``, and
    Qwen3's per-head q/k RMSNorms when ``qk_norm``. The names and order are the checkpoints' own
    (z-lab and SpecForge DFlash, EAGLE-3), shared by every family here."""
    m = nn.Module()
    m.q_proj = nn.Linear(in_dim, heads * head_dim, bias=bias)
    m.k_proj = nn.Linear(in_dim, kv_heads * head_dim, bias=bias)
    m.v_proj = nn.Linear(in_dim, kv_heads * head_dim, bias=bias)
    m.o_proj = nn.Linear(heads * head_dim, hidden, bias=bias)
    if qk_norm:
        m.q_norm = RMSNorm(head_dim, eps)
        m.k_norm = RMSNorm(head_dim, eps)
    return m


def gated_mlp(hidden: int, inner: int, bias: bool) -> nn.Module:
    """A drafter layer's ``mlp``: gate, up and down projections (SwiGLU), the checkpoints' names."""
    m = nn.Module()
    m.gate_proj = nn.Linear(hidden, inner, bias=bias)
    m.up_proj = nn.Linear(hidden, inner, bias=bias)
    m.down_proj = nn.Linear(inner, hidden, bias=bias)
    return m


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_into(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``Rope.apply(x, cos, sin)`` written into ``out`` (any strides; ``x``, ``cos`` and ``sin``
    broadcast to it): no rotated copy of a broadcast ``x``, and the rows land in the layout the
    attention call reads. The same bits as ``Rope.apply``: each product is rounded, then the sum
    (x1*c - x2*s is x1*c + (-x2)*s exactly). Full-width operators, the products of the rotated
    half in a buffer of ``out``'s layout: half-width ones walked 16-float rows of a permuted
    output (the score_roots rope took 5.2 ms of 116, one thread, 2-core EPYC VM; 2.3x less for
    the first layer's MASK rows in a micro-benchmark)."""
    h = x.shape[-1] // 2
    t = torch.empty_like(out)
    torch.mul(torch.cat((-x[..., h:], x[..., :h]), dim=-1), sin, out=t)
    return torch.mul(x, cos, out=out).add_(t)


class Rope:
    """RoPE tables (Qwen3 / Llama layout: the two halves of head_dim share frequencies), with the
    frequency scalings published drafters declare (:func:`rope_scaling_of`), computed as
    transformers' ``ROPE_INIT_FUNCTIONS`` do (what z-lab's, speculators' and vLLM's drafters run):
    ``llama3`` (wavelengths past ``original_max_position_embeddings / low_freq_factor`` divided by
    ``factor``, a smooth ramp down to ``/ high_freq_factor``), ``yarn`` (NTK-by-parts ramp between
    the ``beta_fast``/``beta_slow`` correction dims, cos/sin times the attention factor
    ``0.1 ln(factor) + 1`` or the mscale ratio) and ``linear`` (every frequency divided by
    ``factor``)."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None):
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.attention_factor = 1.0
        kind = (scaling or {}).get("rope_type", "default")
        if kind == "linear":
            inv_freq = inv_freq / float(scaling["factor"])
        elif kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif kind == "yarn":
            inv_freq, self.attention_factor = _yarn_inv_freq(head_dim, theta, scaling)
        self.inv_freq = inv_freq

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        if self.attention_factor != 1.0:
            return (emb.cos() * self.attention_factor).to(dtype), (emb.sin() * self.attention_factor).to(dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x * cos + _rotate_half(x) * sin


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    import math

    factor, low, high = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old = float(p["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(dim: int, base: float, p: dict) -> tuple[torch.Tensor, float]:
    import math

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = float(p["factor"])
    orig = float(p["original_max_position_embeddings"])
    attention = p.get("attention_factor")
    if attention is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(float(p.get("beta_fast") or 32)), correction_dim(float(p.get("beta_slow") or 1))
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


class DFlashLayer(nn.Module):
    """One Qwen3-style pre-norm decoder layer whose attention also sees injected context K/V."""

    def __init__(self, cfg: DFlashConfig, idx: int):
        super().__init__()
        h, nh, kvh, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.self_attn = attention_projections(h, h, nh, kvh, hd, cfg.attention_bias, True, cfg.rms_norm_eps)
        self.mlp = gated_mlp(h, cfg.intermediate_size, False)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.num_heads, self.num_kv_heads, self.head_dim = nh, kvh, hd
        layer_type = cfg.layer_types[idx]
        self.sliding_window = cfg.sliding_window if layer_type == "sliding_attention" else None
        # Later z-lab code: sliding layers are causal, full layers bidirectional, unless the
        # config says otherwise (dflash.md §1.5).
        self.is_causal = (layer_type == "sliding_attention") if cfg.is_causal is None else cfg.is_causal

    def mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.mlp
        if torch.is_grad_enabled():
            return m.down_proj(F.silu(m.gate_proj(x)) * m.up_proj(x))
        # Same operations in the same order, in place: two [rows, intermediate] buffers fewer
        # (a fifth of the batched scorer's MLP time on the CPU).
        g = m.gate_proj(x)
        return m.down_proj(F.silu(g, inplace=True).mul_(m.up_proj(x)))

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Keys/values of ``x`` [..., L, H] -> ([..., kvh, L, hd], [..., kvh, L, hd])."""
        k, v = self.kv_unrotated(x)
        return self.rotate(k, cos, sin), v.transpose(-3, -2)

    def kv_unrotated(self, x: torch.Tensor):
        """Normed keys (before RoPE) and values of ``x`` [..., L, H], each [..., L, kvh, hd]."""
        a = self.self_attn
        shape = x.shape[:-1] + (self.num_kv_heads, self.head_dim)
        return a.k_norm(a.k_proj(x).view(shape)), a.v_proj(x).view(shape)

    def q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.rotate(self.q_unrotated(x), cos, sin)

    def q_unrotated(self, x: torch.Tensor) -> torch.Tensor:
        a = self.self_attn
        return a.q_norm(a.q_proj(x).view(x.shape[:-1] + (self.num_heads, self.head_dim)))

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """[..., L, heads, hd] -> RoPE'd [..., heads, L, hd]."""
        return Rope.apply(x.transpose(-3, -2), cos.unsqueeze(-3), sin.unsqueeze(-3))


class DFlashDrafter(nn.Module):
    """A DFlash drafter (no embedding, no LM head: both come from the target, §1.1)."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.rope = Rope(config.head_dim, config.rope_theta, config.rope_scaling)

    _IGNORED_PREFIXES = ("embed_tokens.", "lm_head.", "verifier_norm.", "verifier_lm_head.", "d2t", "t2d",
                         "confidence_head.", "rotary_emb.")

    # The first block slot whose output is a draft: 1 for DFlash (slot 0 is the root, x[p]);
    # DSpark in speculators' default layout (sample_from_anchor) drafts from slot 0 too.
    first_draft_slot = 1

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def num_drafts(self) -> int:
        """Drafts per block: B - 1 for DFlash (slots 1..B-1), B where slot 0 drafts too."""
        return self.config.block_size - self.first_draft_slot

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.config.target_layer_ids)

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    # ---- loading ----------------------------------------------------------------------------

    @classmethod
    def checkpoint_config(cls, raw: dict, source: str) -> DFlashConfig:
        """The backbone's config from a checkpoint's ``config.json`` (a family in another layout
        overrides it)."""
        return DFlashConfig.from_dict(raw, source=source)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32) -> "DFlashDrafter":
        path = Path(path)
        cfg_path = path / "config.json"
        if not cfg_path.exists():
            raise BadInputError(f"drafter checkpoint {path}: no config.json. Pass the drafter directory "
                                "(config.json + *.safetensors).")
        config = cls.checkpoint_config(_read_config(path), source=str(cfg_path))
        files = _safetensors_files(path, f"drafter checkpoint {path}")
        with torch.device("meta"):
            model = cls(config)
        expected = dict(model.named_parameters())

        def canonical(name: str) -> str:
            name = name[len("model."):] if name.startswith("model.") else name
            for old, new in _META_V1_RENAMES:
                if name.startswith(old):
                    return new + name[len(old):]
            return name

        dflash2 = sorted(n for n in files if any(m in n for m in _DFLASH2_TENSOR_MARKERS))
        if dflash2:
            raise BadInputError(f"drafter checkpoint {path}: tensors {dflash2[:3]} belong to a DFlash2 drafter, "
                                "which this evaluator does not implement. Use a DFlash (v1) drafter.")
        source_of = {}
        for name in files:
            c = canonical(name)
            if c in expected:
                if c in source_of:
                    raise BadInputError(f"drafter checkpoint {path}: both '{source_of[c]}' and '{name}' "
                                        "are present. Keep one naming (with or without 'model.').")
                source_of[c] = name
        # A tensor of no module here changes the forward of whatever wrote it (another family's
        # head, a second projector): refused, never dropped. What the peers save beside DFlash's
        # modules and no draft reads: the target's embedding/head copies, speculators' verifier
        # copies and vocab maps, SpecForge's confidence head (it predicts acceptance only).
        unknown = sorted(n for n in files if canonical(n) not in expected
                         and not canonical(n).startswith(cls._IGNORED_PREFIXES))
        if unknown:
            raise BadInputError(f"drafter checkpoint {path}: tensors {unknown[:4]}{' ...' if len(unknown) > 4 else ''} "
                                f"are no part of a {cls.__name__.removesuffix('Drafter')} drafter; pass a checkpoint of "
                                "a family dfcache knows (dfcache doctor names what its config says).")
        missing = sorted(set(expected) - set(source_of))
        if missing:
            raise BadInputError(
                f"drafter checkpoint {path}: missing tensors {missing[:6]}{' ...' if len(missing) > 6 else ''} "
                f"(config.json says num_hidden_layers={config.num_hidden_layers}, attention_bias="
                f"{config.attention_bias}). Fix config.json or use a complete checkpoint with the reference names "
                "(fc.weight, hidden_norm.weight, layers.{i}.self_attn.q_proj.weight, ..., norm.weight).")
        tensors = _read_tensors(files, source_of.values(), device, dtype)
        state = {}
        for c, name in source_of.items():
            t, want = tensors[name], tuple(expected[c].shape)
            if tuple(t.shape) != want:
                if c == "fc.weight":
                    n_ids = len(config.target_layer_ids)
                    raise BadInputError(
                        f"drafter checkpoint {path}: fc.weight is {tuple(t.shape)} but config.json "
                        f"(dflash_config.target_layer_ids has {n_ids} ids, hidden_size={config.hidden_size}) "
                        f"needs {want} = [hidden, n_ids*hidden]. Fix target_layer_ids or hidden_size in config.json.")
                raise BadInputError(f"drafter checkpoint {path}: tensor '{name}' is {tuple(t.shape)}, config.json "
                                    f"implies {want}. Fix config.json (hidden_size, head_dim, heads, "
                                    "intermediate_size) to match the weights.")
            state[c] = t
        model = model.to_empty(device=device).to(dtype)
        model.load_state_dict(state, strict=True)
        model.rope = Rope(config.head_dim, config.rope_theta, config.rope_scaling)
        return model.eval()

    # ---- forward pieces ---------------------------------------------------------------------

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """``hidden_norm(fc(C))`` for context features [T, n_ids*H] (§1.3)."""
        want = len(self.config.target_layer_ids) * self.config.hidden_size
        if features.shape[-1] != want:
            raise BadInputError(
                f"context features are {features.shape[-1]} wide but the drafter needs "
                f"{len(self.config.target_layer_ids)} target layers x hidden {self.config.hidden_size} = {want}. "
                "Capture the layers in dflash_config.target_layer_ids of this drafter from the matching target.")
        return self.hidden_norm(self.fc(features.to(self.dtype)))

    def context_kv(self, features: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer context keys/values [kvh, T, hd] for features of positions 0..T-1 (§6 step 1)."""
        z = self.project_context(features)
        cos, sin = self.rope.cos_sin(torch.arange(z.shape[0], device=z.device), z.dtype)
        return [layer.kv(z, cos, sin) for layer in self.layers]

    def compute_logits(self, hidden: torch.Tensor, head: TargetHead, out: torch.Tensor | None = None) -> torch.Tensor:
        """``lm_head(norm(h))`` in float32, with the optional multiplier and soft-cap (§1.7).

        ``out``: a float32 tensor of the result's shape to write into (the same bits as without).
        """
        cfg = self.config
        if (out is not None and hidden.dtype == torch.float32 and head.lm_head.dtype == torch.float32
                and cfg.output_multiplier == 1.0 and not cfg.final_logit_softcapping):
            # the product straight into the caller's buffer: F.linear's bits, one pass fewer
            return torch.matmul(self.norm(hidden), head.lm_head.t(), out=out)
        return self._scaled(head.logits(self.norm(hidden)).float(), out)

    def _scaled(self, logits: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """The config's output multiplier and final soft-capping applied, into ``out`` when given."""
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits if out is None else out.copy_(logits)

    def _block_inputs(self, head: TargetHead, root_tokens: torch.Tensor) -> torch.Tensor:
        n, B = root_tokens.shape[0], self.block_size
        ids = torch.full((n, B), self.mask_token_id, dtype=torch.long, device=root_tokens.device)
        ids[:, 0] = root_tokens
        emb = head.embed(ids).to(self.dtype)
        if self.config.input_embedding_scale != 1.0:
            emb = emb * self.config.input_embedding_scale
        return emb

    @staticmethod
    def _first_layer_rows(layer: "DFlashLayer", h: torch.Tensor):
        """Unrotated q, k, v of the first layer's n + 1 distinct rows: the n roots, then the MASK
        row every block shares (see block_logits)."""
        x = layer.input_layernorm(torch.cat([h[:, 0], h[:1, 1]]))        # [n + 1, H]: roots, MASK
        return (layer.q_unrotated(x), *layer.kv_unrotated(x))

    def _first_layer_qkv(self, layer: "DFlashLayer", h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        n, B = h.shape[0], h.shape[1]
        q0, k0, v0 = self._first_layer_rows(layer, h)

        def spread(t):                                                   # [n + 1, heads, hd] -> [n, B, heads, hd]
            return torch.cat([t[:n, None], t[n:, None].expand(n, B - 1, *t.shape[1:])], dim=1)

        return (layer.rotate(spread(q0), cos, sin), layer.rotate(spread(k0), cos, sin),
                spread(v0).transpose(1, 2))

    def _rows_qkv(self, layer: "DFlashLayer", h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, first: bool):
        """q, k, v of a layer for :func:`_block_attention_split`, RoPE written straight into its
        layouts: q [n, kvh, g*B, hd] (a KV head's query heads stacked as rows), k and v
        [n, kvh, B, hd]. ``first``: the blocks enter as [x[p], MASK, ..., MASK] (see block_logits)."""
        n, B = h.shape[0], h.shape[1]
        kvh, hd = layer.num_kv_heads, layer.head_dim
        g = layer.num_heads // kvh
        q = h.new_empty((n, kvh, g, B, hd))
        k = h.new_empty((n, kvh, B, hd))
        qv, kv_ = q.permute(0, 3, 1, 2, 4), k.transpose(1, 2)              # [n, B, kvh, g, hd], [n, B, kvh, hd]
        c5, s5 = cos[:, :, None, None], sin[:, :, None, None]
        c4, s4 = cos[:, :, None], sin[:, :, None]
        if first:
            q0, k0, v0 = self._first_layer_rows(layer, h)
            q0 = q0.view(n + 1, 1, kvh, g, hd)
            _rope_into(q0[:n], c5[:, :1], s5[:, :1], qv[:, :1])
            _rope_into(q0[n:], c5[:, 1:], s5[:, 1:], qv[:, 1:])
            _rope_into(k0[:n, None], c4[:, :1], s4[:, :1], kv_[:, :1])
            _rope_into(k0[n:, None], c4[:, 1:], s4[:, 1:], kv_[:, 1:])
            v = torch.cat([v0[:n, None], v0[n:, None].expand(n, B - 1, kvh, hd)], dim=1)
        else:
            x = layer.input_layernorm(h)
            qu = layer.q_unrotated(x)                                       # [n, B, nh, hd]
            ku, v = layer.kv_unrotated(x)                                   # [n, B, kvh, hd]
            _rope_into(qu.view(n, B, kvh, g, hd), c5, s5, qv)
            _rope_into(ku, c4, s4, kv_)
        return q.view(n, kvh, g * B, hd), k, v.transpose(1, 2)

    def _first_layer_attention_shared(self, layer: "DFlashLayer", h, q, k_ctx, v_ctx, k_blk, v_blk, roots):
        """The first layer's attention for ascending ``roots`` (no sliding window, inference, CPU),
        its context part computed once per absolute position rather than once per block slot.

        A MASK slot's first-layer query is the one MASK row rotated to its absolute position
        a = p + j, so the slots of all blocks sharing a have the same query; they differ only in
        the context they see (t < p = a - j, j = 1..B-1). Their common part t < a - (B-1) is one
        query row per position and head ("items"), computed once; the context keys just before
        each root (the part only some of a position's slots see) join the block's own keys in one
        small call per block (queries ``q`` [n, kvh, g*B, hd] as ``_rows_qkv`` lays them out). The
        root slot (its own query) is an item seeing t < p. The two softmaxes merge by their
        log-sum-exp as in :func:`_block_attention_split`: the same maths, other rounding. Every
        root of a 512-token sequence: the first layer's context attention does about 2 query rows
        per block and head group instead of 16. Returns [n, B, nh*hd].
        """
        n, kvh, gB, hd = q.shape
        B = k_blk.shape[2]
        g = gB // B
        dev = q.device
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        qf, kc, vc = q.float(), k_ctx.float(), v_ctx.float()
        offs = torch.arange(B, device=dev)
        # Items: each root's slot 0 (context t < p), then each distinct MASK position a (t < a - (B-1)).
        a_pos, a_inv = torch.unique(roots[:, None] + offs[1:], return_inverse=True)  # a_inv [n, B-1]
        q_mask = layer.q_unrotated(layer.input_layernorm(h[0, 1]))                 # [nh, hd] unrotated
        cos_a, sin_a = self.rope.cos_sin(a_pos, self.dtype)                        # [A, hd]
        qa = torch.empty((a_pos.shape[0], kvh, g, hd), dtype=q_mask.dtype, device=dev)
        _rope_into(q_mask.view(1, kvh, g, hd), cos_a[:, None, None], sin_a[:, None, None], qa)
        c_items = torch.cat([roots, (a_pos - (B - 1)).clamp_(min=0)])
        c_sorted, order = torch.sort(c_items, stable=True)
        N = order.shape[0]
        rank = torch.empty_like(order)
        rank[order] = torch.arange(N, device=dev)
        # sorted items, a KV head's rows (item, query head) contiguous: [kvh, N, g, hd]
        q_items = torch.cat([qf.view(n, kvh, g, B, hd)[:, :, :, 0], qa.float()])[order].transpose(0, 1).contiguous()
        o_items = qf.new_zeros((kvh, N, g, hd))
        lse_items = qf.new_full((kvh, N, g), _NEG_INF)                             # no context: weight 0
        cs = c_sorted.tolist()
        # Every item's context mask (t < its context length), rows (item, query head), built at
        # once: a group's mask is a slice of it (the same values; the flash kernel reads a view).
        cmax = max(cs[-1], 1)
        table = torch.zeros((N, g, cmax), dtype=torch.float32, device=dev).masked_fill_(
            (torch.arange(cmax, device=dev)[None, :] >= c_sorted[:, None])[:, None], _NEG_INF)
        start = next((i for i, c in enumerate(cs) if c > 0), N)
        while start < N:
            # A group wastes (largest - own) context scores per row; for short contexts a call's
            # overhead is worth more than that.
            lo = cs[start]
            stop = start + 1
            while stop < N and stop - start < 256 and cs[stop] - lo <= max(32, lo // 16):
                stop += 1
            m, tg = stop - start, cs[stop - 1]
            # items are sorted: every key is allowed when the smallest context is the largest
            mask = None if lo == tg else table[start:stop, :, :tg].view(1, 1, m * g, tg)
            o, lse = flash(q_items[:, start:stop].reshape(1, kvh, m * g, hd), kc[None, :, :tg], vc[None, :, :tg],
                           attn_mask=mask)
            o_items[:, start:stop] = o.view(kvh, m, g, hd)
            lse_items[:, start:stop] = lse.view(kvh, m, g)
            start = stop
        # Each slot's item (sorted index): slot 0 its root's, slot j its position's.
        item_of = torch.empty((n, B), dtype=torch.long, device=dev)
        item_of[:, 0] = rank[:n]
        item_of[:, 1:] = rank[n:][a_inv]
        # The block call: keys ctx[p-B : p] ++ the block's own (B window keys, not B-1: the CPU
        # flash kernel took 1.05 ms over 32 keys and 1.95 ms over 31, 128 blocks, one thread); slot
        # j >= 1 sees window key i (position p - B + i) when i > j (the rest is in its item) and the
        # position exists; slot 0 sees none (its item is its whole context).
        win = roots[:, None] - B + offs                                            # [n, B]
        at = win.clamp(min=0).view(-1)
        kw = qf.new_empty((n, kvh, 2 * B, hd))
        vw = torch.empty_like(kw)
        kw[:, :, :B] = kc.index_select(1, at).view(kvh, n, B, hd).transpose(0, 1)
        vw[:, :, :B] = vc.index_select(1, at).view(kvh, n, B, hd).transpose(0, 1)
        kw[:, :, B:] = k_blk
        vw[:, :, B:] = v_blk
        see_win = (offs[None, None, :] > offs[None, :, None]) & (offs[None, :, None] > 0)   # [1, B, B]
        see_blk = torch.ones(B, B, dtype=torch.bool, device=dev)
        if layer.is_causal:
            see_blk = offs[None, :] <= offs[:, None]
        if int(roots[0]) >= B:
            # every window position exists: one [g*B, 2B] mask for all blocks, broadcast over
            # them by the kernel (the same values as n copies of it)
            allowed = torch.cat([see_win[0], see_blk], dim=-1)                     # [B, 2B]
            mask = torch.zeros((g, B, 2 * B), dtype=torch.float32, device=dev).masked_fill_(
                ~allowed[None], _NEG_INF).view(1, 1, g * B, 2 * B)
        else:
            allowed = torch.cat([see_win & (win[:, None, :] >= 0), see_blk.expand(n, B, B)], dim=-1)  # [n, B, 2B]
            mask = torch.zeros((n, g, B, 2 * B), dtype=torch.float32, device=dev).masked_fill_(
                ~allowed[:, None], _NEG_INF).view(n, 1, g * B, 2 * B)
        o_w, lse_w = flash(qf, kw, vw, attn_mask=mask)
        o_w = o_w.view(n, kvh, g, B, hd).permute(0, 3, 1, 2, 4)                    # [n, B, kvh, g, hd]
        lse_w = lse_w.view(n, kvh, g, B).permute(0, 3, 1, 2)                       # [n, B, kvh, g]
        lse_i = lse_items[:, item_of].permute(1, 2, 0, 3)                          # [n, B, kvh, g]
        lse = torch.logaddexp(lse_i, lse_w)
        out = qf.new_empty((n, B, kvh, g, hd))
        # gathered in out's layout ([n, B, kvh, g, hd]), so the product walks both alike
        torch.mul(o_items.permute(1, 0, 2, 3)[item_of], (lse_i - lse).exp_()[..., None], out=out)
        out.addcmul_(o_w, (lse_w - lse).exp_()[..., None])
        return out.view(n, B, kvh * g * hd).to(q.dtype)

    def block_logits(self, ctx_kv: Sequence[tuple[torch.Tensor, torch.Tensor]], roots: torch.Tensor,
                     root_tokens: torch.Tensor, head: TargetHead, out: torch.Tensor | None = None) -> torch.Tensor:
        """Draft logits [n, B-1, V] (float32) for blocks rooted at ``roots`` (written into ``out``
        when given, a float32 tensor of that shape); [n, num_drafts, V] in general.

        All n blocks run through the projections and MLPs as one batch; attention runs per group
        of roots of similar position (:func:`_block_attention`), block r attending to context keys
        t < roots[r] plus its own B tokens. Differentiable (the tiny trainer uses it).
        """
        B = self.block_size
        roots = roots.to(self.device)
        order = torch.argsort(roots, stable=True)
        sorted_roots = roots[order]
        split = _split_attention_ok(ctx_kv[0][0]) if len(ctx_kv) else False
        groups = (_ctx_groups if split else _root_groups)(sorted_roots.tolist(), B)
        offs = torch.arange(B, device=self.device)
        qpos = sorted_roots[:, None] + offs                              # [n, B]
        cos, sin = self.rope.cos_sin(qpos, self.dtype)                   # [n, B, hd]
        h = self._block_inputs(head, root_tokens.to(self.device)[order])
        masks: dict = {}
        last = len(self.layers) - 1
        for i, (layer, (k_ctx, v_ctx)) in enumerate(zip(self.layers, ctx_kv)):
            # Every block enters the first layer as [x[p], MASK, ..., MASK]: the B-1 MASK rows are
            # the same vector in every block until RoPE, so project them once, not n*(B-1) times.
            if split:
                q, k_blk, v_blk = self._rows_qkv(layer, h, cos, sin, first=i == 0)
                if i == 0 and _shared_first_layer_ok(layer, sorted_roots, B):
                    attn = self._first_layer_attention_shared(layer, h, q, k_ctx, v_ctx, k_blk, v_blk, sorted_roots)
                else:
                    attn = _block_attention_split(q, k_ctx, v_ctx, k_blk, v_blk, sorted_roots, groups,
                                                  causal=layer.is_causal, window=layer.sliding_window, masks=masks)
            else:
                if i == 0:
                    q, k_blk, v_blk = self._first_layer_qkv(layer, h, cos, sin)
                else:
                    x = layer.input_layernorm(h)
                    q = layer.q(x, cos, sin)                             # [n, nh, B, hd]
                    k_blk, v_blk = layer.kv(x, cos, sin)                 # [n, kvh, B, hd]
                attn = _block_attention(q, k_ctx, v_ctx, k_blk, v_blk, sorted_roots, groups,
                                        causal=layer.is_causal, window=layer.sliding_window, masks=masks)
            if i == last:
                # Only slots 1..B-1 give logits (§1.7); slot 0's last residual/MLP step is unused
                # (unless it drafts: first_draft_slot 0).
                s = self.first_draft_slot
                h, attn = h[:, s:], attn[:, s:]
            if torch.is_grad_enabled():
                h = h + layer.self_attn.o_proj(attn)
                h = h + layer.mlp_forward(layer.post_attention_layernorm(h))
            else:
                # the residual added into the fresh product (h + a is a + h): no new buffer
                h = layer.self_attn.o_proj(attn).add_(h)
                h = layer.mlp_forward(layer.post_attention_layernorm(h)).add_(h)
        unsorted = bool((order[1:] < order[:-1]).any()) if order.numel() > 1 else False
        hidden = h if last >= 0 else h[:, self.first_draft_slot:]
        if unsorted:
            logits = self.compute_logits(hidden, head)[torch.argsort(order)]
            return logits if out is None else out.copy_(logits)
        return self.compute_logits(hidden, head, out=out)


def _root_groups(roots: list[int], block: int) -> list[tuple[int, int]]:
    """Split ascending roots into ``(start, stop)`` slices that share one attention call.

    A group's blocks share the keys ``ctx[:largest root] ++ every block of the group``, each block
    masked to its own part, so per query a group computes (largest - own root) + (m - 1) * block
    scores it throws away. Groups hold about an eighth of their smallest root in block keys
    (at least 4 blocks, so short contexts don't split into tiny calls; at most 64).
    """
    out, start, n = [], 0, len(roots)
    while start < n:
        lo = roots[start]
        m = min(64, max(4, lo // (8 * block)))
        stop = start + 1
        while stop < n and stop - start < m and roots[stop] - lo <= max(16, lo // 8):
            stop += 1
        out.append((start, stop))
        start = stop
    return out


def _split_attention_ok(k_ctx: torch.Tensor) -> bool:
    """Whether :func:`_block_attention_split` can run: inference on the CPU, where torch's flash
    kernel hands back the log-sum-exp the split needs (its backward does not take a gradient of it)."""
    return (not torch.is_grad_enabled() and k_ctx.device.type == "cpu"
            and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"))


def _shared_first_layer_ok(layer: "DFlashLayer", roots: torch.Tensor, block: int) -> bool:
    """Whether DFlashDrafter._first_layer_attention_shared pays: a layer without a sliding window
    (a window would make a position's common context depend on the slot) and roots dense enough
    that their blocks' MASK slots share absolute positions (distinct positions plus roots at most
    half of the n * B slots; every root of a sequence gives about n + B)."""
    if layer.sliding_window is not None or roots.numel() < 2:
        return False
    n_pos = int(torch.unique(roots[:, None] + torch.arange(1, block, device=roots.device)).numel())
    return 2 * (n_pos + roots.numel()) <= roots.numel() * block


def _ctx_groups(roots: list[int], block: int) -> list[tuple[int, int]]:
    """Groups of ascending roots for :func:`_block_attention_split`: the blocks of a group share
    the context keys ``ctx[:largest root]``, so a query wastes (largest - own root) scores; a
    group spans at most a sixteenth of its smallest root (8 positions at least, 64 blocks at
    most). Root 0 (no context at all) is a group of its own, which computes nothing."""
    out, start, n = [], 0, len(roots)
    while start < n:
        lo = roots[start]
        stop = start + 1
        while stop < n and stop - start < 64 and roots[stop] - lo <= max(8, lo // 16) and lo > 0:
            stop += 1
        out.append((start, stop))
        start = stop
    return out


_NEG_INF = float("-inf")


def _block_attention_split(q, k_ctx, v_ctx, k_blk, v_blk, roots, groups, *, causal: bool,
                           window: int | None, masks: dict | None = None):
    """:func:`_block_attention` as two softmaxes merged by their log-sum-exp (inference, CPU).

    ``q`` [n, kvh, g*B, hd]: a KV head's query heads stacked as rows (head h uses KV head h // g),
    as ``DFlashDrafter._rows_qkv`` lays it out. Returns [n, B, nh*hd].

    The context part of a group of m blocks is one flash-attention call with the m blocks as the
    batch and the context keys ``ctx[:largest root]`` broadcast over it (a stride-0 view: no
    copy), masked per block by a [m, 1, 1, tg] row (t < root; per slot under a sliding window);
    the in-block part is one call over all n blocks (own B keys, causal/window mask). Neither
    computes other blocks' keys, and no key is copied. Same maths as the single softmax over
    ``ctx[:root] ++ block``: softmax over a union = the two partial outputs weighted by
    exp(lse_part - lse_all). Rows that see no context at all (root 0, or a window shorter than
    the slot offset) get lse -inf, i.e. weight 0.
    """
    n, kvh, gB, hd = q.shape
    B = k_blk.shape[2]
    g = gB // B
    dev = q.device
    masks = {} if masks is None else masks
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    qf = q.float()
    offs = torch.arange(B, device=dev)

    bkey = ("blk", causal, window)
    if bkey not in masks:
        allowed = torch.ones(B, B, dtype=torch.bool, device=dev)
        if causal:
            allowed = offs[None, :] <= offs[:, None]
        if window is not None:
            allowed = allowed & ((offs[:, None] - offs[None, :]).abs() < window)
        masks[bkey] = None if bool(allowed.all()) else torch.zeros(
            (g * B, B), dtype=torch.float32, device=dev).masked_fill_(
            ~allowed.repeat(g, 1), _NEG_INF)[None, None]
    o_blk, lse_blk = flash(qf, k_blk.float(), v_blk.float(), attn_mask=masks[bkey])

    out = qf.new_empty((n, B, kvh, g, hd))
    merged = out.permute(0, 2, 3, 1, 4)                                   # [n, kvh, g, B, hd]
    kc, vc = k_ctx.float(), v_ctx.float()
    rl = roots.tolist()
    # Each group's two partial outputs are merged as soon as its context call returns, while they
    # are in the cache, into the rows o_proj reads ([n, B, kvh, g, hd]): no full-size context
    # buffer, no permuting copy at the end. (Merging every group at once after the loop moves
    # bits: the elementwise kernels take other vector/scalar tails when m*kvh*g*B is not a
    # multiple of the vector width.)
    table = None
    if window is None:
        # Full attention: a row's context mask is t < its root, so one [n, largest root] table
        # serves every group of the pass and every layer (a group's mask is a slice of it, a
        # view: the same values the flash kernel reads), and the checks are on Python ints, not
        # a few small operators and a sync per group (a pass of 128 roots has ~25 groups).
        # Every root of a group with context is > 0 (_ctx_groups: root 0 is a group of its
        # own), so no row has all its keys masked.
        if ("ctx_table",) not in masks:
            tmax = max(rl[-1], 1)
            masks[("ctx_table",)] = torch.zeros((n, tmax), dtype=torch.float32, device=dev).masked_fill_(
                torch.arange(tmax, device=dev)[None, :] >= roots[:, None], _NEG_INF)
        table = masks[("ctx_table",)]
    for start, stop in groups:
        tg, m = rl[stop - 1], stop - start
        if tg == 0:  # root 0: no context at all (lse -inf, weight 0)
            _merge_into(merged[start:stop], qf.new_zeros((m, kvh, gB, hd)),
                        qf.new_full((m, kvh, gB), _NEG_INF), o_blk[start:stop], lse_blk[start:stop], g)
            continue
        if table is not None:
            # ascending roots: a group of one root (or of equal roots) sees every key
            mask, dead = (None if rl[start] == tg else table[start:stop, None, None, :tg]), None
        else:
            ckey = ("ctx", start, stop, window)
            if ckey not in masks:
                r = roots[start:stop]
                kpos = torch.arange(tg, device=dev)
                allowed = (kpos[None, None, :] < r[:, None, None]) \
                    & ((r[:, None] + offs)[:, :, None] - kpos[None, None, :] < window)       # [m, B, tg]
                if bool(allowed.all()):
                    mask, dead = None, None
                else:
                    mask = torch.zeros(allowed.shape, dtype=torch.float32, device=dev).masked_fill_(~allowed, _NEG_INF)
                    mask = mask.repeat(1, g, 1)[:, None]                             # [m, 1, rows (head, slot), tg]
                    dead = (~allowed.any(-1)).repeat(1, g)
                    dead = dead if bool(dead.any()) else None
                masks[ckey] = (mask, dead)
            mask, dead = masks[ckey]
        o, lse = flash(qf[start:stop], kc[:, :tg].expand(m, kvh, tg, hd), vc[:, :tg].expand(m, kvh, tg, hd),
                       attn_mask=mask)
        if dead is not None:
            # the flash kernel reports lse 0 (and output 0) for a row with every key masked
            lse.masked_fill_(dead[:, None, :], _NEG_INF)
        _merge_into(merged[start:stop], o, lse, o_blk[start:stop], lse_blk[start:stop], g)
    return out.view(n, B, kvh * g * hd).to(q.dtype)


def _merge_into(dest, o_ctx, lse_ctx, o_blk, lse_blk, g: int) -> None:
    """dest [m, kvh, g, B, hd] = the softmax over context and block keys from the two partial
    ones (outputs [m, kvh, g*B, hd], log-sum-exps [m, kvh, g*B]): each weighted by exp(its lse -
    the union's). o_ctx is scaled in place."""
    lse = torch.logaddexp(lse_ctx, lse_blk)
    a = o_ctx.mul_((lse_ctx - lse).exp_()[..., None])
    b = o_blk * (lse_blk - lse).exp_()[..., None]
    m, kvh, gB, hd = a.shape
    torch.add(a.view(m, kvh, g, gB // g, hd), b.view(m, kvh, g, gB // g, hd), out=dest)


def _block_attention(q, k_ctx, v_ctx, k_blk, v_blk, roots, groups, *, causal: bool, window: int | None,
                     masks: dict | None = None):
    """Attention of block queries over [context keys t < root ++ the block's own keys].

    q [n, nh, B, hd] for blocks sorted by root; k_ctx/v_ctx [kvh, T, hd] shared by all blocks;
    k_blk/v_blk [n, kvh, B, hd]; ``groups`` from :func:`_root_groups`. Each group of m blocks is
    one fused ``scaled_dot_product_attention`` call, so no score tensor is materialised: the
    m*B queries of a KV head's query heads stacked as rows, keys ``ctx[:Tg] ++ the m blocks``,
    an additive block mask (context t < root, own block under the in-block causal/window rules,
    other blocks never). Head h uses KV head h // (nh // kvh), HF's repeat_kv grouping.

    Without autograd the keys are a view, not a copy: the context sits in one buffer per layer,
    and groups run from the largest root down, each writing its blocks' keys right after its
    context, over context rows that only the groups already done needed. Float32, like the
    one-at-a-time reference.
    """
    n, nh, B, hd = q.shape
    kvh = k_ctx.shape[0]
    g = nh // kvh
    dev = q.device
    masks = {} if masks is None else masks
    offs = torch.arange(B, device=dev)
    bmask = torch.ones(B, B, dtype=torch.bool, device=dev)
    if causal:
        bmask = offs[None, :] <= offs[:, None]
    if window is not None:
        bmask = bmask & ((offs[:, None] - offs[None, :]).abs() < window)
    # [kvh, g, n, B, hd]: rows of one KV head
    qf = q.float().view(n, kvh, g, B, hd).permute(1, 2, 0, 3, 4)
    kb = k_blk.float().transpose(0, 1)                                  # [kvh, n, B, hd]
    vb = v_blk.float().transpose(0, 1)
    tops = [int(roots[stop - 1]) for _, stop in groups]
    in_place = not torch.is_grad_enabled()
    if in_place:
        extra = max(stop - start for start, stop in groups) * B
        tmax = max(tops)
        kbuf = k_ctx.new_empty((kvh, tmax + extra, hd), dtype=torch.float32)
        vbuf = torch.empty_like(kbuf)
        kbuf[:, :tmax] = k_ctx[:, :tmax]
        vbuf[:, :tmax] = v_ctx[:, :tmax]
    out = q.new_empty((n, B, kvh, g, hd), dtype=torch.float32)
    for (start, stop), tg in sorted(zip(groups, tops), key=lambda x: -x[1]):
        m = stop - start
        L = tg + m * B
        blk_k = kb[:, start:stop].reshape(kvh, m * B, hd)
        blk_v = vb[:, start:stop].reshape(kvh, m * B, hd)
        if in_place:
            kbuf[:, tg:L] = blk_k
            vbuf[:, tg:L] = blk_v
            k, v = kbuf[:, :L], vbuf[:, :L]
        else:
            k = torch.cat([k_ctx[:, :tg].float(), blk_k], dim=1)
            v = torch.cat([v_ctx[:, :tg].float(), blk_v], dim=1)
        # The mask depends on the layer only through (causal, window): layers share it.
        mkey = (start, stop, causal, window)
        mask = masks.get(mkey)
        if mask is None:
            r = roots[start:stop]
            kpos = torch.arange(tg, device=dev)
            cmask = (kpos[None, None, :] < r[:, None, None]).expand(m, B, tg)        # [m, B, tg]
            if window is not None:
                cmask = cmask & ((r[:, None] + offs)[:, :, None] - kpos[None, None, :] < window)
            own = torch.eye(m, dtype=torch.bool, device=dev)[:, None, :, None] & bmask[None, :, None, :]
            allowed = torch.cat([cmask, own.reshape(m, B, m * B)], dim=-1).reshape(m * B, L)
            # Additive float mask: SDPA would convert a boolean one on every call (every layer).
            mask = torch.zeros((m * B, L), dtype=torch.float32, device=dev).masked_fill_(~allowed, float("-inf"))
            mask = mask.expand(g, m * B, L).reshape(1, 1, g * m * B, L)
            masks[mkey] = mask
        qg = qf[:, :, start:stop].reshape(1, kvh, g * m * B, hd)
        o = F.scaled_dot_product_attention(qg, k[None], v[None], attn_mask=mask)   # [1, kvh, g*m*B, hd]
        out[start:stop] = o.view(kvh, g, m, B, hd).permute(2, 3, 0, 1, 4)
    return out.view(n, B, nh * hd).to(q.dtype)


# --------------------------------------------------------------------------------------------
# Scoring roots
# --------------------------------------------------------------------------------------------

def check_compatible(drafter: DFlashDrafter, head: TargetHead) -> None:
    """Raise BadInputError when the drafter cannot run on this target (hidden size, depth, MASK row)."""
    cfg = drafter.config
    if head.hidden_size != cfg.hidden_size:
        raise BadInputError(f"drafter hidden_size={cfg.hidden_size} but the target's embedding is "
                            f"{head.hidden_size} wide. Use the drafter trained for this target.")
    if head.num_layers is not None and max(cfg.target_layer_ids) >= head.num_layers:
        raise BadInputError(f"drafter dflash_config.target_layer_ids={cfg.target_layer_ids} but the target has "
                            f"{head.num_layers} layers. Use the drafter trained for this target.")
    if not 0 <= cfg.mask_token_id < head.embed_tokens.shape[0]:
        raise BadInputError(f"drafter dflash_config.mask_token_id={cfg.mask_token_id} is outside the target "
                            f"embedding ({head.embed_tokens.shape[0]} rows). Use the drafter trained for this target.")


def _check_roots(roots: Sequence[int], n_tokens: int, n_features: int) -> list[int]:
    roots = [int(r) for r in roots]
    for r in roots:
        if not 0 <= r < n_tokens:
            raise ValueError(f"root {r} is outside the token sequence (length {n_tokens})")
        if r > n_features:
            raise ValueError(f"root {r} needs context features of positions < {r}, only {n_features} given")
    return roots


# On the CPU a pass of 128 roots (2,048 block rows) keeps a small drafter's activations in the
# L2 cache between operators (an RMSNorm over 1,024 x 128 floats takes 0.06 ms, over 8,176 x 128
# 1.06 ms) while giving each operator enough rows to share among threads. The tiny bench drafter
# scored 512 roots (2-core Intel Xeon VM, 2026-12-05, nine runs each, medians) in 87.3 ms at one
# thread against 91.8 ms in passes of 64 and 94.5 ms in passes of 192, and at two threads in 51.6
# ms against 57.5 ms (64) and 51.1 ms (192). The pass size is fixed, not chosen by the thread
# count: the attention groups follow the passes, so it moves logits at float rounding.
CPU_BATCH_ROOTS = 128


def iter_score_roots(drafter: DFlashDrafter, head: TargetHead, context_features: torch.Tensor,
                     token_ids: torch.Tensor, roots: Sequence[int], *, max_batch_roots: int | None = None,
                     max_score_elems: int = 1 << 25):
    """Yield ``(indices, logits)`` chunk by chunk, where ``indices`` index into ``roots``.

    Lets a caller reduce each chunk (argmax, top-k) without holding [R, B-1, V] logits at once
    (a 151k vocabulary makes that ~9 MB per root). Roots are processed in ascending order so a
    chunk only needs the context up to its largest root. A chunk holds as many roots as fit both
    ``max_batch_roots`` and ``max_score_elems`` float32 attention scores (heads x B x context per
    root; the default 2**25 is ~128 MB per score tensor, about 30 roots of 2k context for a
    Qwen3-8B drafter): raise it on a large GPU for fewer passes. ``max_batch_roots`` defaults to
    256 on a GPU and :data:`CPU_BATCH_ROOTS` on the CPU.
    """
    yield from _score_chunks(drafter, head, context_features, token_ids, roots, max_batch_roots,
                             max_score_elems, out=None)


def _score_chunks(drafter, head, context_features, token_ids, roots, max_batch_roots, max_score_elems,
                  out: torch.Tensor | None):
    """:func:`iter_score_roots`; with ``out`` ([len(roots), B-1, V] float32, ``roots`` ascending)
    each chunk's logits are written into their rows of ``out`` and the chunk yielded is that view."""
    check_compatible(drafter, head)
    token_ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
    roots = _check_roots(roots, token_ids.shape[0], context_features.shape[0])
    if not roots:
        return
    cfg = drafter.config
    if max_batch_roots is None:
        max_batch_roots = CPU_BATCH_ROOTS if drafter.device.type == "cpu" else 256
    order = sorted(range(len(roots)), key=lambda i: roots[i])
    with torch.inference_mode():
        ctx_kv = drafter.context_kv(context_features.to(drafter.device))
        per_root = cfg.num_attention_heads * cfg.block_size
        start = 0
        while start < len(order):
            stop = start + 1
            while (stop < len(order) and stop - start < max_batch_roots
                   and (stop - start + 1) * per_root * (roots[order[stop]] + cfg.block_size) <= max_score_elems):
                stop += 1
            idx = order[start:stop]
            r = torch.tensor([roots[i] for i in idx], dtype=torch.long, device=drafter.device)
            logits = drafter.block_logits(ctx_kv, r, token_ids.to(drafter.device)[r], head,
                                          out=None if out is None else out[start:stop])
            yield idx, logits
            start = stop


def score_roots(drafter: DFlashDrafter, head: TargetHead, context_features: torch.Tensor,
                token_ids: torch.Tensor, roots: Sequence[int], *, max_batch_roots: int | None = None,
                max_score_elems: int = 1 << 25) -> torch.Tensor:
    """Draft logits (float32) [len(roots), B-1, V] for the blocks rooted at each p in ``roots``.

    ``context_features`` [T, n_ids*H] are the target features of the sequence (rows >= max(roots)
    are never read); ``token_ids`` [T'] the sequence tokens (only ``token_ids[p]`` is read). Rows are
    in the order of ``roots``. Equal (to float rounding) to :func:`score_roots_one_at_a_time`.
    """
    roots = [int(r) for r in roots]
    out = torch.empty((len(roots), drafter.num_drafts, head.vocab_size), dtype=torch.float32,
                      device=drafter.device)
    if all(a <= b for a, b in zip(roots, roots[1:])):
        # ascending (the usual case): every chunk's logits are written straight into their rows
        for _ in _score_chunks(drafter, head, context_features, token_ids, roots, max_batch_roots,
                               max_score_elems, out=out):
            pass
        return out
    for idx, logits in _score_chunks(drafter, head, context_features, token_ids, roots, max_batch_roots,
                                     max_score_elems, out=None):
        out[torch.tensor(idx, device=logits.device)] = logits
    return out


def _reference_block(drafter: DFlashDrafter, head: TargetHead, features: torch.Tensor, root: int,
                     root_token: torch.Tensor) -> torch.Tensor:
    """One block the way the online loop runs it: project C[:p], attend over cat(ctx, block)."""
    cfg, B = drafter.config, drafter.block_size
    z = drafter.project_context(features[:root])
    pos = torch.arange(root + B, device=drafter.device)
    cos, sin = drafter.rope.cos_sin(pos, drafter.dtype)
    h = drafter._block_inputs(head, root_token.reshape(1))[0]          # [B, H]
    for layer in drafter.layers:
        x = layer.input_layernorm(h)
        q = layer.q(x, cos[root:], sin[root:])                          # [nh, B, hd]
        k_c, v_c = layer.kv(z, cos[:root], sin[:root])
        k_b, v_b = layer.kv(x, cos[root:], sin[root:])
        k, v = torch.cat([k_c, k_b], dim=1), torch.cat([v_c, v_b], dim=1)
        mask = None
        if layer.is_causal or layer.sliding_window is not None:
            qp, kp = pos[root:, None], pos[None, :]
            mask = torch.ones(B, root + B, dtype=torch.bool, device=drafter.device)
            if layer.is_causal:
                mask &= kp <= qp
            if layer.sliding_window is not None:
                mask &= (qp - kp < layer.sliding_window) & (kp - qp < layer.sliding_window)
        rep = cfg.num_attention_heads // cfg.num_key_value_heads
        attn = F.scaled_dot_product_attention(q[None].float(), k.repeat_interleave(rep, 0)[None].float(),
                                              v.repeat_interleave(rep, 0)[None].float(), attn_mask=mask)
        attn = attn[0].transpose(0, 1).reshape(B, -1).to(drafter.dtype)
        h = h + layer.self_attn.o_proj(attn)
        h = h + layer.mlp_forward(layer.post_attention_layernorm(h))
    return drafter.compute_logits(h[drafter.first_draft_slot:], head)


def score_roots_one_at_a_time(drafter: DFlashDrafter, head: TargetHead, context_features: torch.Tensor,
                              token_ids: torch.Tensor, roots: Sequence[int], **_ignored) -> torch.Tensor:
    """Slow reference for :func:`score_roots`: one block per root, context re-projected each time."""
    check_compatible(drafter, head)
    token_ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
    roots = _check_roots(roots, token_ids.shape[0], context_features.shape[0])
    feats = context_features.to(drafter.device)
    with torch.inference_mode():
        rows = [_reference_block(drafter, head, feats, p, token_ids[p].to(drafter.device)) for p in roots]
    if not rows:
        return torch.empty((0, drafter.num_drafts, head.vocab_size))
    return torch.stack(rows)


# --------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------

def save_drafter(model: DFlashDrafter, out_dir: str | Path) -> Path:
    """Write ``config.json`` + ``model.safetensors`` with the reference parameter names (§1.8)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def init_drafter_weights(model: nn.Module, seed: int, std: float = 0.02) -> nn.Module:
    """Deterministic random init (normal(0, std) linears, unit norms, zero biases), independent of
    torch's global RNG; any family's drafter (EAGLE-3's train_eagle3 uses it too)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model

