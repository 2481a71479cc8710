"""The drafter-family interface: what a family needs from the target, how its checkpoints are
recognised and validated, how it loads; the stage and ``parity`` dispatch on ``DrafterRef.family``.

* ``recognises(config)``: planning reads ``config.json`` as JSON (no torch) and asks each family
  in turn; :func:`family_of` refuses a checkpoint no family claims (exit 6, naming the families
  and what the config says it is).
* ``plan(path, config, target)`` (EAGLE-3, DSpark): the planning fields (:class:`Plan`): the target
  layers whose outputs it reads (``layers``; resolved against the target's depth where the family
  has a default), whether it trains on the target's final state (``final_state``: the state after
  the final norm, hidden-state layer ``"final"``; EAGLE-3 and DSpark),
  the block size the report uses (draft depth + 1) and the key inputs only this family has. Every
  check that needs no weights (and the d2t map, read with numpy) runs here, before any work.
  DFlash's planning is ``runner.stages.drafter_eval.read_drafter``'s, unchanged: it adds no key input.
  DSpark's is DFlash's (its backbone's layers, block size and MASK id; speculators' layout read
  through ``dspark_config.backbone_config``) plus the key input ``family: "dspark"`` (and
  ``sample_from_anchor: true`` where its anchor slot drafts: block size B + 1); its Markov head and
  vocabulary map are in the checkpoint, so in the drafter fingerprint; a d2t that does not fit the
  target is exit 6 here.
* ``load(path, device, dtype)``: the torch model.
* Drafting from cached features, batched over all roots of a response: DFlash
  ``runner.drafters.dflash.iter_score_roots``, EAGLE-3 ``runner.drafters.eagle3.score_roots`` and
  ``dynamic_tree``, DSpark ``runner.drafters.dspark.iter_drafts`` (the head teacher-forced; chain
  only: DDTree budgets are DFlash's), reduced to RootScores / accepted lengths in
  ``runner.stages.drafter_eval``.
* The reference online loops for ``parity``: ``runner.trust.parity.online_dflash`` /
  ``online_ddtree``, ``online_eagle3`` / ``online_eagle_tree`` and ``online_dspark``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dfcache.errors import BadInputError

from .dspark_config import draft_differs_from_dflash, is_dspark_config
from .eagle3_config import Eagle3Config, default_layer_ids, is_eagle3_config


@dataclass
class Plan:
    """What planning knows of one drafter for a given target (no weights read but headers)."""

    family: str
    layers: list[int]          # target layer ids whose outputs the drafter reads, in its order
    block_size: int            # drafts per block + 1 (the bonus token)
    final_state: bool = False  # trains on the target's final state (after its final norm: layer "final")
    key_inputs: dict[str, Any] = field(default_factory=dict)  # family-only key inputs (DFlash: none)
    summary: str = ""
    label: str = ""  # what the report's family column says where it is not ``family`` (a speculators
    #                  DFlash drafted by DSpark's loader without a head: "dflash")


# Architectures of SpecForge's families that share DFlash's config shape but not its forward.
_OTHER_DFLASH_SHAPED = ("DominoDraftModel", "PEagleDraftModel")


class DFlash:
    name = "dflash"
    # What it trains on besides its layers: the target's state after its final norm (hidden-state
    # layer "final")? DFlash: no (SpecForge's DFlash files hold its layers only).
    trains_on_final_state = False
    what = "DFlash block-diffusion drafter (config.json with dflash_config, or z-lab's MuseGlimmerAssistantModel)"

    @staticmethod
    def recognises(raw: dict) -> bool:
        # A DSpark checkpoint carries a dflash_config too; only one that drafts as its DFlash
        # backbone does (no Markov head: a confidence head changes no draft) is DFlash's.
        if is_dspark_config(raw) and draft_differs_from_dflash(raw):
            return False
        # SpecForge's other DFlash-shaped families keep a dflash_config too, told apart by
        # projector_type (configs/qwen3-8b-domino.json: DominoDraftModel, "domino", a GRU head
        # and shifted labels): they are not DFlash and must not load as it.
        dcfg = raw.get("dflash_config")
        projector = dcfg.get("projector_type") if isinstance(dcfg, dict) else None
        if projector not in (None, "dflash", "dspark"):
            return False
        if any(a in _OTHER_DFLASH_SHAPED for a in (raw.get("architectures") or [])):
            return False
        archs = raw.get("architectures") or []
        return isinstance(dcfg, dict) or "DFlashDraftModel" in archs or "MuseGlimmerAssistantModel" in archs

    @staticmethod
    def load(path, device, dtype):
        from .dflash import DFlashDrafter

        return DFlashDrafter.from_pretrained(path, device=device, dtype=dtype)


class Eagle3:
    name = "eagle3"
    what = "EAGLE-3 drafter (SpecForge LlamaForCausalLMEagle3 or speculators eagle3)"
    DEFAULT_STEPS = 5  # SGLang's --speculative-num-steps in its EAGLE-3 examples
    # SpecForge's offline EAGLE-3 files hold it as ``hidden_state`` (the teacher's logits are
    # lm_head(hidden_state); specforge.algorithms.eagle3.data). speculators' EAGLE-3 reads the last
    # layer before the norm instead and applies verifier_norm itself.
    trains_on_final_state = True

    @staticmethod
    def recognises(raw: dict) -> bool:
        return is_eagle3_config(raw)

    @staticmethod
    def config(path: Path, raw: dict) -> Eagle3Config:
        return Eagle3Config.from_dict(raw, source=str(path / "config.json"))

    @classmethod
    def plan(cls, path: Path, raw: dict, *, num_target_layers: int | None, target_hidden: int | None,
             target_vocab: int | None, steps: int | None) -> Plan:
        """Planning fields against the target; a config that does not fit it is exit 6 here."""
        cfg = cls.config(path, raw)
        ids = cfg.target_layer_ids
        if ids is None:
            if not num_target_layers or num_target_layers < 5:
                raise BadInputError(f"EAGLE-3 drafter {path}: no eagle_aux_hidden_state_layer_ids and the target's "
                                    f"depth ({num_target_layers}) gives no default; add the ids to its config.json.")
            ids = default_layer_ids(num_target_layers)
        if num_target_layers is not None and max(ids) >= num_target_layers:
            raise BadInputError(f"EAGLE-3 drafter {path}: layer ids {ids} reach past the target's {num_target_layers} "
                                "layers; pass the target it was trained for (or fix eagle_aux_hidden_state_layer_ids).")
        if target_hidden is not None and cfg.target_hidden_size != target_hidden:
            raise BadInputError(f"EAGLE-3 drafter {path}: its fc reads 3 x {cfg.target_hidden_size} features but the "
                                f"target is {target_hidden} wide; pass the drafter trained for this target.")
        if target_vocab is not None and cfg.vocab_size != target_vocab:
            raise BadInputError(f"EAGLE-3 drafter {path}: its vocab maps are for a {cfg.vocab_size}-token vocabulary, "
                                f"the target has {target_vocab}; pass the drafter trained for this target.")
        problem = d2t_problem(path, cfg)
        if problem:
            raise BadInputError(f"EAGLE-3 drafter {path}: {problem}")
        depth = int(steps or cfg.speculative_tokens or cls.DEFAULT_STEPS)
        return Plan("eagle3", list(ids), depth + 1, final_state=cls.trains_on_final_state,
                    key_inputs={"family": "eagle3", "draft_depth": depth},
                    summary=f"eagle3 chain {depth}, layers {list(ids)}")

    @staticmethod
    def load(path, device, dtype):
        from .eagle3 import Eagle3Drafter

        return Eagle3Drafter.from_pretrained(path, device=device, dtype=dtype)


class DSpark:
    name = "dspark"
    what = ("DSpark drafter (SpecForge DSparkDraftModel: a DFlash backbone, dflash_config.projector_type "
            "'dspark', with a Markov head; or speculators_model_type 'dspark'; also speculators' DFlash, "
            "speculators_model_type 'dflash', its backbone with a draft vocabulary and no head)")
    # SpecForge's DSpark training reads ``target_last_hidden_states`` (its lm_head gives the
    # teacher logits of the L1/confidence losses: specforge.algorithms.common.dflash_family_data
    # and dflash_family_model); its eval here does not (the target's tokens are known).
    trains_on_final_state = True

    @staticmethod
    def recognises(raw: dict) -> bool:
        # One without a Markov head drafts as its backbone: DFlash's (DFlash.recognises).
        return is_dspark_config(raw) and draft_differs_from_dflash(raw)

    @classmethod
    def plan(cls, path: Path, raw: dict, *, layers: list[int], block_size: int,
             target_vocab: int | None = None) -> Plan:
        """Planning fields: the backbone's (read as DFlash's by the caller, speculators' layout through
        ``dspark_config.backbone_config``); a draft vocabulary whose d2t map does not fit the target
        is exit 6 here. With ``sample_from_anchor`` a block drafts B tokens, so the report's block
        size is B + 1 and the key has ``sample_from_anchor`` (absent otherwise: keys unchanged)."""
        from .dspark_config import head_config, is_speculators_dflash

        cfg = head_config(raw, source=str(path / "config.json"))
        vocab = cfg.vocab_size
        if target_vocab is not None and vocab is not None and vocab != target_vocab:
            raise BadInputError(f"DSpark drafter {path}: its config says a {vocab}-token vocabulary (vocab_size), "
                                f"the target has {target_vocab}; pass the drafter trained for this target.")
        if cfg.reduced_vocab or cfg.layout == "speculators":
            problem = vocab_map_problem(path, vocab if vocab is not None else target_vocab,
                                        cfg.draft_vocab_size) if (vocab or target_vocab) else None
            if problem:
                raise BadInputError(f"DSpark drafter {path}: {problem}")
        key_inputs = {"family": "dspark"}
        drafts = int(block_size) - 1
        if cfg.sample_from_anchor:
            key_inputs["sample_from_anchor"] = True
            drafts = int(block_size)
        vocab_note = f", draft vocabulary {cfg.draft_vocab_size}" if cfg.reduced_vocab else ""
        anchor_note = " (anchor slot drafts)" if cfg.sample_from_anchor else ""
        if is_speculators_dflash(raw):
            return Plan("dspark", list(layers), drafts + 1, final_state=False, key_inputs=key_inputs, label="dflash",
                        summary=f"dflash (speculators layout, no head), chain {drafts}{anchor_note}{vocab_note}, "
                                f"layers {list(layers)}")
        return Plan("dspark", list(layers), drafts + 1, final_state=cls.trains_on_final_state,
                    key_inputs=key_inputs,
                    summary=f"dspark {cfg.head_type} head rank {cfg.markov_rank}, chain {drafts}"
                            f"{anchor_note}{vocab_note}, layers {list(layers)}")

    @staticmethod
    def load(path, device, dtype):
        from .dspark import DSparkDrafter

        return DSparkDrafter.from_pretrained(path, device=device, dtype=dtype)


FAMILIES = {f.name: f for f in (DFlash, Eagle3, DSpark)}


def trains_on_final_state(family: str | None) -> bool:
    """Whether a family's training data hold the target's final state (layer "final"): `run
    hidden-states --drafter` extracts it and `export --format specforge` writes it for them."""
    fam = FAMILIES.get(family or "")
    return bool(fam is not None and fam.trains_on_final_state)


def export_needs_final_state(family: str | None, fmt: str) -> bool:
    """Whether ``export --format fmt`` of a selection whose drafter is of ``family`` writes the final
    state: SpecForge's EAGLE-3 (``hidden_state``) and DSpark (``target_last_hidden_states``) layouts.
    speculators' EAGLE-3 takes the last layer before the norm (its verifier_norm applies it)."""
    return fmt == "specforge" and trains_on_final_state(family)


def describe_config(raw: dict) -> str:
    """What a config says it is, for the refusal of an unknown family."""
    bits = []
    for k in ("architectures", "model_type", "speculators_model_type"):
        if raw.get(k):
            bits.append(f"{k}={raw[k]!r}")
    dcfg = raw.get("dflash_config")
    if isinstance(dcfg, dict) and dcfg.get("projector_type"):
        bits.append(f"dflash_config.projector_type={dcfg['projector_type']!r}")
    return ", ".join(bits) or f"fields {sorted(raw)[:6]}"


def family_of(path: Path, raw: dict):
    """The family whose checkpoints look like ``raw``; BadInputError (exit 6) naming the known ones."""
    for fam in FAMILIES.values():
        if fam.recognises(raw):
            return fam
    known = "; ".join(f"{f.name}: {f.what}" for f in FAMILIES.values())
    raise BadInputError(f"drafter {path}: config.json is of no drafter family dfcache knows ({describe_config(raw)}). "
                        f"Known families: {known}. Pass a checkpoint of one of them (a DFlash config.json "
                        "has dflash_config with the target_layer_ids, mask_token_id and block_size it was trained with).")


def d2t_problem(path: Path, cfg: Eagle3Config) -> str | None:
    """Read only the ``d2t`` tensor (its safetensors bytes: no torch, no numpy, which a cached run
    never imports) and check it maps the draft vocabulary into the target's."""
    return vocab_map_problem(path, cfg.vocab_size, cfg.draft_vocab_size)


def vocab_map_problem(path: Path, vocab_size: int, draft_vocab_size: int) -> str | None:
    """:func:`d2t_problem` for any family storing EAGLE-3's ``d2t`` (offsets: draft id d is target
    id ``d + d2t[d]``; SpecForge and speculators both write it so)."""
    from ..models.safetensors_header import read_ints, tensor_index

    try:
        index = tensor_index(path)
        info = index.get("d2t") or index.get("model.d2t")
        d2t = read_ints(info) if info is not None else None
        if not index and (path / "pytorch_model.bin").is_file():
            d2t = _bin_d2t(path)  # the EAGLE repo's checkpoints: torch is needed to read them at all
    except (OSError, ValueError, KeyError) as e:
        return f"cannot read its d2t tensor ({e}); re-download or re-save the checkpoint."
    if d2t is None:
        if draft_vocab_size != vocab_size:
            return (f"draft_vocab_size {draft_vocab_size} != vocab_size {vocab_size} but no d2t tensor; "
                    "re-save the checkpoint with its vocab maps.")
        return None
    if len(d2t) != draft_vocab_size:
        return (f"d2t has {len(d2t)} entries, not draft_vocab_size = {draft_vocab_size}; "
                "re-save the checkpoint with its vocab maps.")
    mapped = [i + o for i, o in enumerate(d2t)]
    lo, hi = min(mapped), max(mapped)
    if lo < 0 or hi >= vocab_size:
        return (f"d2t maps draft ids to target ids {lo}..{hi}, outside the target vocabulary "
                f"0..{vocab_size - 1}; pass the drafter trained for this target.")
    return None


def _bin_d2t(path: Path) -> list[int] | None:
    from .eagle3 import _weights

    names, read = _weights(path)
    name = next((n for n in ("d2t", "model.d2t") if n in names), None)
    return None if name is None else [int(x) for x in read([name])[name].tolist()]


def eagle_trees(opts) -> list[list[int]]:
    """``--eagle-tree TOPK,STEPS,TOKENS`` values (SGLang's --speculative-eagle-topk, -num-steps,
    -num-draft-tokens), parsed, sorted and unique."""
    from dfcache.errors import UsageError

    out = set()
    for value in getattr(opts, "eagle_trees", None) or []:
        try:
            topk, steps, tokens = (int(x) for x in str(value).replace("x", ",").split(","))
        except ValueError:
            raise UsageError(f"--eagle-tree {value!r}: give TOPK,STEPS,TOKENS (e.g. 8,5,32), SGLang's "
                             "--speculative-eagle-topk, --speculative-num-steps, --speculative-num-draft-tokens.") from None
        if min(topk, steps, tokens) < 1:
            raise UsageError(f"--eagle-tree {value!r}: every number must be positive.")
        out.add((topk, steps, tokens))
    return [list(t) for t in sorted(out)]


def tree_label(tree) -> str:
    return "eagle-{}x{}x{}".format(*tree)
