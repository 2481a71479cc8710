"""The RoPE scaling a drafter's config declares, read as JSON (planning imports this without
torch); the tables themselves are ``runner.drafters.dflash.Rope``."""

from __future__ import annotations

from dfcache.errors import BadInputError

_ROPE_NEEDS = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                                 "original_max_position_embeddings"),
               "yarn": ("factor", "original_max_position_embeddings")}


def rope_scaling_of(cfg: dict, source: str) -> dict | None:
    """The RoPE frequency scaling a drafter config declares (``rope_scaling``, or transformers 5's
    ``rope_parameters``): ``{"rope_type": ..., params}``, or None for plain RoPE. ``mrope`` is plain
    RoPE here: a text-only sequence has equal temporal/height/width positions, so every frequency
    band rotates by the same position (Qwen2-VL's get_rope_index). Other types are exit 6."""
    for where in ("rope_scaling", "rope_parameters"):
        params = cfg.get(where)
        if not isinstance(params, dict):
            continue
        kind = params.get("rope_type", params.get("type", "default"))
        if kind in (None, "default", "mrope"):
            continue
        if kind not in _ROPE_NEEDS:
            raise BadInputError(f"{source}: {where}.rope_type={kind!r} is not supported (plain, linear, llama3 and "
                                "yarn RoPE are); remove it if the drafter was trained without scaling.")
        params = dict(params)
        if kind == "yarn" and params.get("original_max_position_embeddings") is None:
            params["original_max_position_embeddings"] = cfg.get("max_position_embeddings")
        absent = [k for k in _ROPE_NEEDS[kind] if params.get(k) is None]
        if absent:
            raise BadInputError(f"{source}: {where}.rope_type={kind!r} without {absent}; add them as the drafter "
                                "was trained (transformers reads the same fields).")
        if float(params.get("partial_rotary_factor", 1.0) or 1.0) != 1.0:
            raise BadInputError(f"{source}: {where}.partial_rotary_factor is not supported; the drafter rotates "
                                "the whole head_dim.")
        params["rope_type"] = kind
        return {k: v for k, v in params.items() if k != "type"}
    return None
