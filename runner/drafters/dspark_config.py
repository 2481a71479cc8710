"""DSpark checkpoint configs in SpecForge 0.2's and speculators 0.9's layouts, read without torch
(planning and ``doctor`` import this; the model is :mod:`runner.drafters.dspark`)."""

from __future__ import annotations

from dataclasses import dataclass

from dfcache.errors import BadInputError

HEAD_TYPES = ("vanilla", "gated", "rnn")


@dataclass(frozen=True)
class DSparkHeadConfig:
    layout: str                  # "specforge" | "speculators"
    markov_rank: int             # 0: no Markov head (pure DFlash drafting)
    head_type: str               # one of HEAD_TYPES
    confidence: bool
    confidence_with_markov: bool
    sample_from_anchor: bool


def is_dspark_config(raw: dict) -> bool:
    """A DSpark checkpoint's ``config.json`` in either peer's layout."""
    dflash = raw.get("dflash_config")
    if isinstance(dflash, dict) and dflash.get("projector_type") == "dspark":
        return True
    return raw.get("speculators_model_type") == "dspark" or "DSparkDraftModel" in (raw.get("architectures") or [])


def head_config(raw: dict, source: str = "config.json") -> DSparkHeadConfig:
    """The Markov/confidence head fields; BadInputError (exit 6) for what dfcache cannot score."""
    if raw.get("speculators_model_type") == "dspark":
        layout, fields = "speculators", raw
        rank_default, conf_default, with_markov_default, anchor_default = 256, True, True, True
    else:
        layout, fields = "specforge", raw.get("dflash_config") or {}
        rank_default, anchor_default = 0, False
        conf_default = float(fields.get("confidence_head_alpha", 0.0) or 0.0) > 0.0
        with_markov_default = False
    rank = int(fields.get("markov_rank", rank_default) or 0)
    head_type = str(fields.get("markov_head_type", "vanilla")).lower()
    if rank < 0:
        raise BadInputError(f"DSpark drafter {source}: markov_rank {rank} is negative; re-save the checkpoint.")
    if head_type not in HEAD_TYPES:
        raise BadInputError(f"DSpark drafter {source}: markov_head_type {head_type!r} is none of {list(HEAD_TYPES)}; "
                            "pass a checkpoint of SpecForge 0.2 or speculators 0.9.")
    confidence = bool(fields.get("enable_confidence_head", conf_default))
    with_markov = bool(fields.get("confidence_head_with_markov", with_markov_default)) and confidence
    if with_markov and rank == 0:
        raise BadInputError(f"DSpark drafter {source}: confidence_head_with_markov needs markov_rank > 0; "
                            "re-save the checkpoint with its Markov head.")
    anchor = bool(fields.get("sample_from_anchor", anchor_default))
    if anchor:
        raise BadInputError(f"DSpark drafter {source}: sample_from_anchor (the anchor slot drafts too) is not "
                            "scored yet; pass a checkpoint trained with sample_from_anchor: false.")
    draft_vocab = fields.get("draft_vocab_size")
    if draft_vocab is not None and raw.get("vocab_size") is not None and int(draft_vocab) != int(raw["vocab_size"]):
        raise BadInputError(f"DSpark drafter {source}: a draft vocabulary of {draft_vocab} tokens (target "
                            f"{raw['vocab_size']}) is not scored yet; pass a full-vocabulary checkpoint.")
    return DSparkHeadConfig(layout, rank, head_type, confidence, with_markov, anchor)


def draft_differs_from_dflash(raw: dict) -> bool:
    """Whether a DSpark checkpoint drafts other tokens than its DFlash backbone would (a Markov head,
    or the anchor slot drafting): a confidence head alone changes no draft."""
    if raw.get("speculators_model_type") == "dspark":
        return int(raw.get("markov_rank", 256) or 0) > 0 or bool(raw.get("sample_from_anchor", True))
    fields = raw.get("dflash_config") or {}
    return int(fields.get("markov_rank", 0) or 0) > 0
