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
    sample_from_anchor: bool     # slot 0 (the root's slot) drafts too: B drafts per block, not B-1
    vocab_size: int | None = None        # the target's (markov_w1 rows; what drafts map into)
    draft_vocab_size: int | None = None  # lm_head / markov_w2 rows; < vocab_size: a d2t map

    @property
    def reduced_vocab(self) -> bool:
        return (self.draft_vocab_size is not None and self.vocab_size is not None
                and self.draft_vocab_size != self.vocab_size)


def is_dspark_config(raw: dict) -> bool:
    """A DSpark checkpoint's ``config.json`` in either peer's layout, or a speculators DFlash one
    (``speculators_model_type: "dflash"``, RedHatAI/*-speculator.dflash): the same backbone and
    layout with no Markov head, by default a reduced draft vocabulary (``draft_vocab_size`` 32000
    with ``d2t``/``t2d`` and the reduced ``lm_head``), which DFlash's loader (SpecForge's and
    z-lab's layout: the target's head) does not read; DSpark's does, so it is drafted by it."""
    dflash = raw.get("dflash_config")
    if isinstance(dflash, dict) and dflash.get("projector_type") == "dspark":
        return True
    return is_speculators_layout(raw) or "DSparkDraftModel" in (raw.get("architectures") or [])


def is_speculators_layout(raw: dict) -> bool:
    return raw.get("speculators_model_type") in ("dspark", "dflash")


def is_speculators_dflash(raw: dict) -> bool:
    return raw.get("speculators_model_type") == "dflash"


def _vocab_sizes(raw: dict) -> tuple[int | None, int | None]:
    """(target vocabulary, draft vocabulary) as the config declares them."""
    if is_speculators_layout(raw):
        layer = raw.get("transformer_layer_config") or {}
        vocab = layer.get("vocab_size") if isinstance(layer, dict) else None
        draft = raw.get("draft_vocab_size")
    else:
        fields = raw.get("dflash_config") or {}
        vocab = raw.get("vocab_size")
        draft = fields.get("draft_vocab_size", raw.get("draft_vocab_size"))
    vocab = int(vocab) if isinstance(vocab, int) else None
    draft = int(draft) if isinstance(draft, int) else vocab
    return vocab, draft


def head_config(raw: dict, source: str = "config.json") -> DSparkHeadConfig:
    """The Markov/confidence head fields; BadInputError (exit 6) for what dfcache cannot score."""
    if is_speculators_dflash(raw):
        # speculators' DFlash (DFlashSpeculatorConfig): no Markov or confidence head, and
        # sample_from_anchor defaults to false (from_training_args: true for dspark only)
        layout, fields = "speculators", raw
        rank_default, conf_default, with_markov_default, anchor_default = 0, False, False, False
        for key in ("markov_rank", "enable_confidence_head"):
            if raw.get(key):
                raise BadInputError(f"DFlash drafter {source}: speculators_model_type 'dflash' with {key} set, which "
                                    "speculators' DFlash does not define; pass the checkpoint as speculators wrote it.")
    elif is_speculators_layout(raw):
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
    # speculators 0.9 (DSparkDraftModel.forward, DFlashDraftModel._backbone_forward): with
    # sample_from_anchor the anchor slot's output is trained on the token after the anchor and
    # slot k's previous token (Markov) is block token k, so slot 0 drafts too: B drafts.
    anchor = bool(fields.get("sample_from_anchor", anchor_default))
    if anchor and layout == "specforge":
        # SpecForge 0.2's DSpark has no such field (its blocks draft slots 1..B-1): which slot
        # would draft which token is not defined there, so it is not guessed.
        raise BadInputError(f"DSpark drafter {source}: dflash_config.sample_from_anchor is true, which SpecForge "
                            "0.2's DSpark does not define (speculators' does: speculators_model_type 'dspark'); "
                            "pass the checkpoint in the layout that trained it, or without the field.")
    vocab, draft = _vocab_sizes(raw)
    if draft is not None and (draft < 1 or (vocab is not None and draft > vocab)):
        raise BadInputError(f"DSpark drafter {source}: draft_vocab_size {draft} is not within 1..vocab_size "
                            f"({vocab}); re-save the checkpoint with its vocab maps.")
    return DSparkHeadConfig(layout, rank, head_type, confidence, with_markov, anchor, vocab, draft)


# speculators keeps the backbone's layer under transformer_layer_config (a Qwen3Config's fields)
_LAYER_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "intermediate_size", "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling",
                 "partial_rotary_factor", "attention_bias", "hidden_act", "vocab_size", "layer_types")


def backbone_config(raw: dict, source: str = "config.json") -> dict:
    """The DFlash backbone's config in SpecForge's layout (what ``DFlashConfig.from_dict`` and planning
    read): ``raw`` itself for SpecForge; for speculators 0.9 its ``transformer_layer_config`` fields,
    ``aux_hidden_state_layer_ids`` shifted to dfcache's convention, ``mask_token_id`` and ``block_size``."""
    if not is_speculators_layout(raw):
        return raw
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise BadInputError(f"DSpark drafter {source}: speculators config without a 'transformer_layer_config' "
                            "object; re-save the checkpoint with speculators.")
    ids = raw.get("aux_hidden_state_layer_ids")
    if (not isinstance(ids, list) or not ids
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
        raise BadInputError(f"DSpark drafter {source}: aux_hidden_state_layer_ids must be a non-empty list of "
                            f"layer ids, got {ids!r}; re-save the checkpoint with speculators.")
    if 0 in ids:
        raise BadInputError(f"DSpark drafter {source}: aux_hidden_state_layer_ids {ids} include 0, the embedding "
                            "output (hidden_states[0]), which no hidden-state stage stores; use a drafter trained "
                            "on decoder-layer outputs.")
    types = layer.get("layer_types") or []
    if "sliding_attention" in types or layer.get("use_sliding_window"):
        # speculators' window (dflash/attention.py create_anchor_block_mask_mod) keeps context
        # positions >= anchor - window for every query of the block; DFlash's counts back from
        # each query's own position: the drafts differ, so it is not scored.
        raise BadInputError(f"DSpark drafter {source}: transformer_layer_config.layer_types has sliding_attention "
                            "layers (speculators' anchor-bounded window), which dfcache does not score; pass a "
                            "checkpoint with full-attention layers.")
    out = {k: layer[k] for k in _LAYER_FIELDS if layer.get(k) is not None}
    # speculators (and vLLM) count Hugging Face hidden_states indices: id k is the input of layer k,
    # the output of layer k-1 (speculators/convert/dflash/converter.py); dfcache's ids are the output
    # of layer k, as SpecForge's (EAGLE-3's speculators layout does the same: eagle3_config.py).
    out["dflash_config"] = {"target_layer_ids": [int(k) - 1 for k in ids], "mask_token_id": raw.get("mask_token_id"),
                            "block_size": raw.get("block_size")}
    out["architectures"] = list(raw.get("architectures") or [])
    return out


def draft_differs_from_dflash(raw: dict) -> bool:
    """Whether a DSpark checkpoint needs DSpark's loader rather than DFlash's: a Markov head, a draft
    vocabulary, or speculators' layout (whose default drafts from the anchor slot too); a confidence
    head alone changes no draft."""
    if is_speculators_layout(raw):
        return True  # also: its layout is speculators' (DFlash's loader reads SpecForge's only)
    fields = raw.get("dflash_config") or {}
    vocab, draft = _vocab_sizes(raw)
    return int(fields.get("markov_rank", 0) or 0) > 0 or (draft is not None and draft != vocab)
