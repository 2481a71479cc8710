"""`dfcache doctor`: static checks that a drafter, a target and cached completions belong together.

Every check returns findings with a severity (``error`` | ``warning`` | ``info``), what was found
and the fix. The checks are the ways DFlash numbers have gone wrong in practice
(``/work/shared/reference/dflash.md`` §1.2-§1.8, §4, §5.3): layer ids off by one or past the
target's depth, the last layer's pre/post-norm trap, a MASK id outside the embedding, ``fc`` sized
for another target, vocabularies that disagree, unsupported RoPE variants, sliding-window configs
without a window, Gemma-style scaled embeddings, and completions made with another chat template or
thinking mode.

Nothing here imports torch or transformers: configs and tokenizers are read as JSON and
safetensors headers (and the one MASK embedding row) are read directly
(:mod:`runner.models.safetensors_header`), so the doctor answers in well under a second.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dfcache.errors import BadInputError, ModelNotFoundError

from ..models.resolve import chat_template_hash, chat_template_text, resolve_target
from ..models.safetensors_header import read_rows, tensor_index

SEVERITIES = ("error", "warning", "info")
_EMBED_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
                "language_model.model.embed_tokens.weight", "embed_tokens.weight", "transformer.wte.weight")
_LM_HEAD_NAMES = ("lm_head.weight", "model.lm_head.weight", "language_model.lm_head.weight")
# Targets whose decoder multiplies the token embedding by sqrt(hidden_size) before layer 0.
_SCALED_EMBEDDING_TYPES = ("gemma", "gemma2", "gemma3", "gemma3_text", "gemma3n", "gemma3n_text", "gemma4",
                           "gemma4_text", "recurrent_gemma", "paligemma", "t5gemma")


@dataclass
class Finding:
    check: str
    severity: str
    found: str
    fix: str = ""


@dataclass
class DoctorReport:
    target: str
    drafter: str
    findings: list[Finding] = field(default_factory=list)

    def add(self, check: str, severity: str, found: str, fix: str = "") -> None:
        assert severity in SEVERITIES
        self.findings.append(Finding(check, severity, found, fix))

    def count(self, severity: str) -> int:
        return sum(1 for f in self.findings if f.severity == severity)

    @property
    def ok(self) -> bool:
        return self.count("error") == 0

    def to_dict(self) -> dict:
        return {"target": self.target, "drafter": self.drafter, "ok": self.ok,
                "errors": self.count("error"), "warnings": self.count("warning"),
                "checks": [asdict(f) for f in self.findings]}


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise BadInputError(f"{what}: {path} does not exist; pass a model directory with config.json.")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise BadInputError(f"{what}: {path} is not valid JSON ({e}); repair or re-download it.") from None
    if not isinstance(data, dict):
        raise BadInputError(f"{what}: {path} is not a JSON object.")
    return data


def default_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The fallback formula of z-lab/SpecForge/sglang (dflash.md §1.2), for comparisons only."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def _tokenizer_vocab(model_dir: Path) -> tuple[int | None, dict[str, int], dict]:
    """(len(tokenizer), token -> id for added/special tokens, tokenizer_config) from the JSON files."""
    ids: dict[str, int] = {}
    n = None
    tj = model_dir / "tokenizer.json"
    if tj.is_file():
        try:
            data = json.loads(tj.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            data = {}
        vocab = (data.get("model") or {}).get("vocab")
        top = -1
        if isinstance(vocab, dict):
            top = max(vocab.values(), default=-1)
            ids.update({k: v for k, v in vocab.items() if isinstance(v, int)})
        elif isinstance(vocab, list):
            top = len(vocab) - 1
        for t in data.get("added_tokens") or []:
            if isinstance(t, dict) and isinstance(t.get("id"), int):
                ids[str(t.get("content"))] = t["id"]
                top = max(top, t["id"])
        n = top + 1 if top >= 0 else None
    cfg = {}
    tc = model_dir / "tokenizer_config.json"
    if tc.is_file():
        try:
            cfg = json.loads(tc.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            cfg = {}
        for sid, t in (cfg.get("added_tokens_decoder") or {}).items():
            if isinstance(t, dict) and str(sid).isdigit():
                ids[str(t.get("content"))] = int(sid)
                n = max(n or 0, int(sid) + 1)
    return n, ids, cfg


def _token_name(v) -> str | None:
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def run_doctor(target: str, drafter: str, *, target_revision: str | None = None, store=None,
               completions_from: str | None = None) -> DoctorReport:
    """All checks for ``target`` (a directory or cached HF id) against the drafter checkpoint."""
    tdir = resolve_target(target, target_revision)
    ddir = Path(drafter).expanduser()
    if not ddir.is_dir():
        raise ModelNotFoundError(f"drafter {drafter} is not a directory; pass a DFlash checkpoint directory "
                                 "(config.json + *.safetensors) with --drafter.")
    rep = DoctorReport(target=str(target), drafter=str(drafter))
    tcfg_all = _read_json(tdir / "config.json", "target")
    tcfg = tcfg_all.get("text_config") if isinstance(tcfg_all.get("text_config"), dict) else tcfg_all
    dcfg = _read_json(ddir / "config.json", "drafter")
    dflash = dcfg.get("dflash_config") if isinstance(dcfg.get("dflash_config"), dict) else {}

    def dval(name, default=None):
        return dflash.get(name, dcfg.get(name, default))

    depth = tcfg.get("num_hidden_layers")
    hidden = tcfg.get("hidden_size")
    model_type = str(tcfg_all.get("model_type") or tcfg.get("model_type") or "?")
    if not isinstance(depth, int) or not isinstance(hidden, int):
        rep.add("target config", "error", f"{tdir}/config.json has no num_hidden_layers/hidden_size",
                "pass a decoder-only causal LM directory")
        return rep
    rep.add("target", "info", f"{model_type}, {depth} decoder layers, hidden {hidden}, vocab "
            f"{tcfg.get('vocab_size', tcfg_all.get('vocab_size'))}")
    t_tensors = _safe_index(rep, tdir, "target weights")
    d_tensors = _safe_index(rep, ddir, "drafter weights")
    from ..drafters.family import DSpark, Eagle3, FAMILIES, describe_config

    fam = next((f for f in FAMILIES.values() if f.recognises(dcfg)), None)
    if fam is None:
        rep.add("family", "error", f"config.json is of no drafter family dfcache knows ({describe_config(dcfg)})",
                "pass a checkpoint of one of: " + "; ".join(f"{f.name}: {f.what}" for f in FAMILIES.values()))
        return rep
    rep.add("family", "info", fam.what)
    if fam is Eagle3:
        _check_eagle3(rep, ddir, dcfg, tcfg, tcfg_all, depth, hidden, d_tensors)
        return _completions_checks(rep, store, completions_from, tdir)
    raw = dcfg
    if fam is DSpark:  # speculators' layout: its backbone's fields read as SpecForge's
        from ..drafters.dspark_config import backbone_config

        try:
            dcfg = backbone_config(raw, source=str(ddir / "config.json"))
        except BadInputError as e:
            rep.add("dspark backbone", "error", str(e), "pass a DSpark checkpoint dfcache scores")
            return rep
        dflash = dcfg.get("dflash_config") if isinstance(dcfg.get("dflash_config"), dict) else {}

    ids = _check_layers(rep, dval("target_layer_ids"), depth, dcfg)
    _check_widths(rep, dcfg, hidden, ids, d_tensors)
    vocab_rows = _check_vocab(rep, tdir, tcfg, tcfg_all, dcfg, t_tensors)
    _check_mask(rep, tdir, dval("mask_token_id"), vocab_rows, t_tensors)
    _check_block(rep, dcfg, dflash)
    _check_attention(rep, dcfg, tcfg)
    _check_rope(rep, dcfg, tcfg)
    _check_embedding_scale(rep, model_type, tcfg, hidden, float(dval("input_embedding_scale", 1.0) or 1.0))
    if fam is DSpark:  # the DFlash backbone checked above; its Markov head here
        _check_dspark(rep, ddir, raw, vocab_rows, d_tensors)
    return _completions_checks(rep, store, completions_from, tdir)


def _check_dspark(rep: DoctorReport, ddir: Path, dcfg: dict, vocab: int | None, d_tensors: dict) -> None:
    """DSpark's Markov head: a layout and fields dfcache scores, and its tensors there with the
    shapes the config and the target's vocabulary give (headers only)."""
    from ..drafters.dspark_config import head_config

    from ..drafters.dspark_config import backbone_config
    from ..drafters.family import vocab_map_problem

    try:
        cfg = head_config(dcfg, source=str(ddir / "config.json"))
    except BadInputError as e:
        rep.add("dspark head", "error", str(e), "pass a DSpark checkpoint of SpecForge 0.2 or speculators 0.9")
        return
    problem = None
    if vocab is not None and cfg.vocab_size is not None and cfg.vocab_size != vocab:
        problem = f"vocab_size {cfg.vocab_size} but the target has {vocab} rows"
    elif vocab is not None:
        problem = vocab_map_problem(ddir, vocab, cfg.draft_vocab_size or vocab)
    if problem:
        rep.add("dspark vocabulary", "error", problem, "pass the drafter trained for this target")
        return
    rank, hidden = cfg.markov_rank, backbone_config(dcfg).get("hidden_size")
    draft = cfg.draft_vocab_size if cfg.reduced_vocab else vocab
    # w1 is indexed by the previous token's target id, w2 gives draft-vocabulary logits
    want = {"markov_w1.weight": (vocab, rank), "markov_w2.weight": (draft, rank)}
    if cfg.head_type == "gated" and isinstance(hidden, int):
        want["gate_proj.weight"] = (rank, hidden + rank)
    elif cfg.head_type == "rnn" and isinstance(hidden, int):
        want["joint_proj.weight"] = (3 * rank, 2 * rank + hidden)
    prefixes = ("model.logit_head.markov_head.", "logit_head.markov_head.", "model.markov_head.", "markov_head.")
    found = {n[len(p):]: t for n, t in d_tensors.items() for p in prefixes if n.startswith(p)}
    bad = [f"{k} {'missing' if k not in found else list(found[k].shape)} (expected {[d for d in shape]})"
           for k, shape in want.items()
           if k not in found or (None not in shape and tuple(found[k].shape) != shape)]
    if d_tensors and bad:
        rep.add("dspark head", "error", "markov_head tensors: " + "; ".join(bad),
                "re-save the checkpoint with its Markov head, for this target's vocabulary")
        return
    rep.add("dspark head", "info", f"{cfg.head_type} Markov head of rank {rank} ({cfg.layout} layout)"
            + (", the anchor slot drafts too (sample_from_anchor)" if cfg.sample_from_anchor else "")
            + (f", a draft vocabulary of {cfg.draft_vocab_size} (d2t)" if cfg.reduced_vocab else "")
            + (", a confidence head (changes no draft)" if cfg.confidence else "")
            + "; evaluated as a chain (DDTree budgets are DFlash's)")


def _completions_checks(rep: DoctorReport, store, completions_from: str | None, tdir: Path) -> DoctorReport:
    if completions_from:
        _check_completions(rep, store, completions_from, tdir)
    else:
        rep.add("chat template / thinking", "info", "no cached completions given",
                "pass --completions-from KEY to check their chat template and thinking mode against this target")
    return rep


def _check_eagle3(rep: DoctorReport, ddir: Path, dcfg: dict, tcfg: dict, tcfg_all: dict, depth: int, hidden: int,
                  d_tensors: dict) -> None:
    """EAGLE-3: the config as SpecForge/speculators write it, its layer ids (or SGLang's default) against
    the target's depth, the fc width, the vocabulary and its d2t map."""
    from ..drafters.eagle3_config import Eagle3Config, default_layer_ids
    from ..drafters.family import d2t_problem

    try:
        cfg = Eagle3Config.from_dict(dcfg, source=str(ddir / "config.json"))
    except BadInputError as e:
        rep.add("eagle3 config", "error", str(e), "re-save the checkpoint with SpecForge or speculators")
        return
    rep.add("eagle3 config", "info", f"{cfg.layout} layout, one decoder layer, hidden {cfg.hidden_size}, "
            f"draft vocabulary {cfg.draft_vocab_size} of {cfg.vocab_size}"
            + (f", {cfg.speculative_tokens} speculative tokens declared" if cfg.speculative_tokens else ""))
    ids = cfg.target_layer_ids
    if ids is None:
        ids = default_layer_ids(depth)
        rep.add("layer ids", "warning", f"no eagle_aux_hidden_state_layer_ids: SGLang's default {ids} for a "
                f"{depth}-layer target applies (vLLM's default counts layer inputs: the same tensors)",
                "add the ids the drafter was trained with to its config.json (eagle_config."
                "eagle_aux_hidden_state_layer_ids), so every engine reads the same layers")
    if cfg.layout == "speculators" and cfg.declared_layer_ids is not None:
        rep.add("layer convention", "info", f"speculators ids {cfg.declared_layer_ids} are HF hidden_states indices "
                f"(vLLM captures the input of layer k): dfcache reads the outputs of layers {ids}")
    else:
        rep.add("layer convention", "info", f"ids {ids}: id k = output of decoder layer k = HF hidden_states[k+1] "
                f"(here {[k + 1 for k in ids]}); SGLang captures the input of layer k+1, the same tensor")
    bad = [k for k in ids if not 0 <= k < depth]
    if bad:
        rep.add("layer ids", "error", f"ids {bad} are outside the target's {depth} decoder layers (0..{depth - 1})",
                "pass the target the drafter was trained against, or fix eagle_aux_hidden_state_layer_ids")
    elif max(ids) == depth - 1:
        rep.add("last layer pre/post-norm", "warning", f"id {depth - 1} is the last decoder layer: dfcache uses its "
                "pre-norm output", "make sure training captured the pre-norm state")
    if cfg.target_hidden_size != hidden:
        rep.add("hidden size", "error", f"the drafter's fc reads 3 x {cfg.target_hidden_size}, the target is {hidden} wide",
                "use the drafter trained for this target")
    fc = d_tensors.get("fc.weight") or d_tensors.get("model.fc.weight")
    if fc is not None and tuple(fc.shape) != (cfg.hidden_size, 3 * cfg.target_hidden_size):
        rep.add("fc width", "error", f"fc.weight is {list(fc.shape)}, the config implies "
                f"{[cfg.hidden_size, 3 * cfg.target_hidden_size]}", "fix hidden_size / target_hidden_size in config.json")
    elif fc is not None:
        rep.add("fc width", "info", f"fc.weight {list(fc.shape)} = 3 layers x {cfg.target_hidden_size}")
    tv = tcfg.get("vocab_size", tcfg_all.get("vocab_size"))
    if isinstance(tv, int) and tv != cfg.vocab_size:
        rep.add("vocabulary", "error", f"the drafter's vocab maps are for {cfg.vocab_size} tokens, the target has {tv}",
                "use the drafter trained for this target")
    problem = d2t_problem(ddir, cfg)
    if problem:
        rep.add("d2t map", "error", problem, "re-save the checkpoint with the vocab maps of this target")
    else:
        rep.add("d2t map", "info", f"{cfg.draft_vocab_size} draft ids map into the target vocabulary")
    own = any(n in d_tensors for n in ("embed_tokens.weight", "model.embed_tokens.weight"))
    rep.add("embedding", "info", "the drafter's own embed_tokens (as SpecForge saves it)" if own else
            "the target's embedding (speculators and SGLang share it when the drafter has none)")


def _safe_index(rep: DoctorReport, d: Path, what: str) -> dict:
    try:
        idx = tensor_index(d)
    except (OSError, ValueError, KeyError) as e:
        rep.add(what, "error", f"cannot read the safetensors headers in {d}: {e}", "re-download the checkpoint")
        return {}
    if not idx:
        rep.add(what, "error", f"no *.safetensors weights in {d}",
                "download the weights (only safetensors checkpoints are supported)")
    return idx


def _check_layers(rep: DoctorReport, ids, depth: int, dcfg: dict) -> list[int]:
    name = "layer ids"
    if not (isinstance(ids, list) and ids and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
        rep.add(name, "error", f"dflash_config.target_layer_ids is {ids!r}",
                "add the ids the drafter was trained with; the fallback formula is wrong for most published "
                "drafters (sglang #37475)")
        return []
    hf = [k + 1 for k in ids]
    rep.add("layer convention", "info",
            f"ids {ids}: id k = output of decoder layer k, before the final norm = HF hidden_states[k+1] "
            f"(here hidden_states {hf}); SGLang captures 'before layer k+1'")
    bad = [k for k in ids if not 0 <= k < depth]
    if bad:
        shifted = [k for k in bad if k == depth]
        if shifted:
            rep.add(name, "error",
                    f"id {depth} equals the target's depth ({depth} layers, ids 0..{depth - 1}): the ids look "
                    "like HF hidden_states indices (k+1), shifted by one",
                    f"use the decoder-layer ids {[k - 1 for k in ids]} if the trainer indexed hidden_states, "
                    "or check that --target is the model the drafter was trained against")
        others = [k for k in bad if k != depth]
        if others:
            rep.add(name, "error", f"ids {others} are outside the target's {depth} decoder layers (0..{depth - 1})",
                    "pass the target the drafter was trained against, or fix dflash_config.target_layer_ids")
    else:
        rep.add(name, "info", f"all ids inside 0..{depth - 1}")
    if len(set(ids)) != len(ids):
        rep.add(name, "warning", f"ids {ids} repeat a layer", "check the drafter config; each id is one fc input block")
    if ids != sorted(ids):
        rep.add(name, "info", f"ids {ids} are not ascending; features are concatenated in this order",
                "nothing to do if training used the same order")
    ntl = dcfg.get("num_target_layers")
    if isinstance(ntl, int) and ntl != depth:
        rep.add("target depth", "error", f"drafter config says num_target_layers={ntl}, the target has {depth}",
                "evaluate against the target the drafter was trained for (vLLM PR #48524: fc sized wrong when "
                "num_target_layers != num_hidden_layers)")
    n_draft = dcfg.get("num_hidden_layers")
    if isinstance(n_draft, int) and n_draft >= 1 and not bad:
        formula = default_layer_ids(depth, len(ids))
        if ids != formula:
            if ids == [k + 1 for k in formula]:
                rep.add(name, "warning", f"ids {ids} equal the standard formula {formula} shifted by +1",
                        "if the trainer counted HF hidden_states indices, the drafter wants the formula's ids; "
                        "compare with how the features were captured (vLLM PR #40727, atlas PR #394)")
            elif ids == [k - 1 for k in formula]:
                rep.add(name, "warning", f"ids {ids} equal the standard formula {formula} shifted by -1 "
                        "(EAGLE-3 counts the *input* of a layer)",
                        "check the capture convention the features were trained with (dflash.md §5.2)")
    if ids and max(ids) == depth - 1:
        rep.add("last layer pre/post-norm", "warning",
                f"id {depth - 1} is the last decoder layer: HF's hidden_states[{depth}] is post-norm "
                "(model.norm applied), dfcache uses the pre-norm residual like the reference",
                "make sure training and serving captured the pre-norm state (sglang #32204 appends pre-norm)")
    return ids


def _check_widths(rep: DoctorReport, dcfg: dict, hidden: int, ids: list[int], d_tensors: dict) -> None:
    dh = dcfg.get("hidden_size")
    if dh != hidden:
        rep.add("hidden size", "error", f"drafter hidden_size={dh}, target hidden_size={hidden}",
                "use the drafter trained for this target")
    else:
        rep.add("hidden size", "info", f"drafter and target are {hidden} wide")
    fc = d_tensors.get("fc.weight") or d_tensors.get("model.fc.weight")
    if fc is None:
        if d_tensors:
            rep.add("fc width", "error", "the drafter has no fc.weight tensor",
                    "use a DFlash checkpoint with the reference parameter names (dflash.md §1.8)")
        return
    want = (hidden, len(ids) * hidden) if ids else None
    if want and tuple(fc.shape) != want:
        found = f"fc.weight is {list(fc.shape)}, need [hidden, len(layers) x hidden] = {list(want)}"
        if len(fc.shape) == 2 and hidden and fc.shape[1] % hidden == 0 and fc.shape[1] // hidden != len(ids):
            found += f" (the weights expect {fc.shape[1] // hidden} layers, the config lists {len(ids)})"
        rep.add("fc width", "error", found, "fix target_layer_ids / hidden_size in the drafter's config.json")
    elif want:
        rep.add("fc width", "info", f"fc.weight {list(fc.shape)} = {len(ids)} layers x {hidden}")


def _check_vocab(rep: DoctorReport, tdir: Path, tcfg: dict, tcfg_all: dict, dcfg: dict, t_tensors: dict) -> int | None:
    vocab = tcfg.get("vocab_size", tcfg_all.get("vocab_size"))
    embed = next((t_tensors[n] for n in _EMBED_NAMES if n in t_tensors), None)
    head = next((t_tensors[n] for n in _LM_HEAD_NAMES if n in t_tensors), None)
    rows = embed.shape[0] if embed is not None else vocab
    if t_tensors and embed is None:
        rep.add("vocab", "error", "no embedding tensor in the target's weights",
                "pass the target model directory (the eval reads its embed_tokens and lm_head)")
    if embed is not None and isinstance(vocab, int) and embed.shape[0] != vocab:
        rep.add("vocab", "error", f"target embedding has {embed.shape[0]} rows, config vocab_size={vocab}",
                "re-download the target; the checkpoint and its config disagree")
    if head is not None and embed is not None and head.shape != embed.shape:
        rep.add("vocab", "error", f"lm_head is {list(head.shape)}, embedding {list(embed.shape)}",
                "re-download the target")
    dv = dcfg.get("vocab_size")
    if isinstance(dv, int) and isinstance(rows, int) and dv != rows:
        rep.add("vocab", "error", f"drafter vocab_size={dv}, target vocab {rows}",
                "use the drafter trained for this target (it drafts with the target's lm_head)")
    n_tok, _, _ = _tokenizer_vocab(tdir)
    if n_tok is None:
        rep.add("tokenizer", "warning", f"no tokenizer.json in {tdir}", "add the target's tokenizer files")
    elif isinstance(rows, int) and n_tok > rows:
        rep.add("tokenizer", "error", f"the tokenizer has {n_tok} ids but the target vocab is {rows}",
                "pass the tokenizer that belongs to this target")
    elif isinstance(rows, int):
        rep.add("vocab", "info", f"tokenizer {n_tok} ids, embedding {rows} rows"
                + (", lm_head tied to the embedding" if t_tensors and head is None else ""))
    return rows if isinstance(rows, int) else None


def _check_mask(rep: DoctorReport, tdir: Path, mask_id, rows: int | None, t_tensors: dict) -> None:
    name = "mask_token_id"
    if not isinstance(mask_id, int) or isinstance(mask_id, bool):
        rep.add(name, "error", f"dflash_config.mask_token_id is {mask_id!r}",
                "set the MASK id used in training (usually len(tokenizer), e.g. 151669 for Qwen3)")
        return
    if rows is not None and not 0 <= mask_id < rows:
        rep.add(name, "error", f"mask_token_id={mask_id} is outside the target embedding ({rows} rows)",
                "use the drafter trained for this target, or fix dflash_config.mask_token_id")
        return
    n_tok, tok_ids, tcfg = _tokenizer_vocab(tdir)
    mask_tok = _token_name(tcfg.get("mask_token"))
    if mask_tok and mask_tok in tok_ids and tok_ids[mask_tok] != mask_id:
        rep.add(name, "warning", f"the tokenizer's mask token {mask_tok!r} is id {tok_ids[mask_tok]}, the drafter "
                f"uses {mask_id}", "check which MASK id training used (SpecForge resolve_mask_token_id order)")
    elif n_tok is not None and mask_id < n_tok:
        by_id = {v: k for k, v in tok_ids.items()}
        special = {_token_name(t.get("content")) for t in (tcfg.get("added_tokens_decoder") or {}).values()
                   if isinstance(t, dict)}
        tok = by_id.get(mask_id)
        if tok is not None and tok not in special and tok != mask_tok:
            rep.add(name, "warning", f"mask_token_id={mask_id} is the ordinary token {tok!r}",
                    "DFlash MASK ids are a special token or the first unused row (len(tokenizer)); check training")
    embed = next((t_tensors[n] for n in _EMBED_NAMES if n in t_tensors), None)
    if embed is None:
        return
    try:
        sample = sorted({mask_id, *range(0, embed.shape[0], max(1, embed.shape[0] // 256))})
        vals = read_rows(embed, sample)
    except (OSError, ValueError) as e:
        rep.add(name, "warning", f"cannot read the embedding row: {e}")
        return
    import numpy as np

    norms = np.linalg.norm(vals, axis=1)
    m = float(norms[sample.index(mask_id)])
    typical = float(np.median(norms))
    if not math.isfinite(m):
        rep.add(name, "error", f"embedding row {mask_id} is not finite", "re-download the target weights")
    elif m == 0.0:
        rep.add(name, "warning", f"embedding row {mask_id} is all zeros (median row norm {typical:.3g})",
                "a zero MASK embedding is legal only if training used the same row; check the drafter's training")
    else:
        rep.add(name, "info", f"id {mask_id} inside the vocab; embedding row norm {m:.3g} (median {typical:.3g})")


def _check_block(rep: DoctorReport, dcfg: dict, dflash: dict) -> None:
    top, inner = dcfg.get("block_size"), dflash.get("block_size")
    bs = inner if inner is not None else top
    if top is not None and inner is not None and top != inner:
        rep.add("block size", "warning", f"block_size {top} at the top level but {inner} in dflash_config",
                "make them agree; dfcache (like sglang) uses dflash_config's")
    if not isinstance(bs, int) or bs < 2:
        rep.add("block size", "error", f"block_size is {bs!r}", "set the block size the drafter was trained with (e.g. 16)")
    else:
        rep.add("block size", "info", f"{bs}: one root token + {bs - 1} drafted per block; τ ranges 1..{bs}")


def _check_attention(rep: DoctorReport, dcfg: dict, tcfg: dict) -> None:
    n = dcfg.get("num_hidden_layers")
    types = dcfg.get("layer_types") or (["full_attention"] * n if isinstance(n, int) else [])
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    window = dcfg.get("sliding_window")
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        rep.add("sliding window", "error", f"drafter layer_types has {unknown}",
                "DFlash drafters have full_attention and sliding_attention layers only")
    if isinstance(n, int) and len(types) != n:
        rep.add("sliding window", "error", f"layer_types has {len(types)} entries, num_hidden_layers={n}",
                "make them agree")
    if sliding:
        if not (isinstance(window, int) and window > 0):
            rep.add("sliding window", "error", f"drafter layers {sliding} are sliding_attention but sliding_window "
                    f"is {window!r}", "add the window the drafter was trained with (e.g. 2048 for Qwen3.6-27B)")
        else:
            msg = (f"drafter layers {sliding} are causal with a window of {window} (query included); "
                   "full layers see the whole block")
            if dcfg.get("use_sliding_window") is False:
                rep.add("sliding window", "warning", msg + ", but use_sliding_window is false",
                        "check which the trainer used; dfcache follows layer_types")
            else:
                rep.add("sliding window", "info", msg)
    else:
        rep.add("sliding window", "info", "every drafter layer is full attention (bidirectional in the block)")
    tw = tcfg.get("sliding_window")
    if isinstance(tw, int) and tw > 0 and tcfg.get("use_sliding_window", True) is not False:
        rep.add("target attention", "info", f"the target uses a sliding window of {tw} tokens in some layers; its "
                f"hidden states past {tw} tokens depend on the attention implementation honouring it",
                "extract with an attention implementation the target supports (--attn-implementation)")


def _rope_type(params) -> str | None:
    if not isinstance(params, dict):
        return None
    return params.get("rope_type", params.get("type"))


def _check_rope(rep: DoctorReport, dcfg: dict, tcfg: dict) -> None:
    params = dcfg.get("rope_parameters") if isinstance(dcfg.get("rope_parameters"), dict) else {}
    theta = dcfg.get("rope_theta", params.get("rope_theta"))
    if theta is None:
        rep.add("rope", "error", "the drafter config has no rope_theta",
                "add the drafter's own rope_theta (1e6 for Qwen3 drafters, 1e7 for Qwen3.5/3.6)")
    for where in ("rope_parameters", "rope_scaling"):
        rtype = _rope_type(dcfg.get(where))
        if rtype not in (None, "default"):
            rep.add("rope", "error", f"drafter {where}.rope_type={rtype!r}",
                    "only plain RoPE is implemented; remove it if training used none")
    prf = dcfg.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
    if prf not in (None, 1, 1.0):
        rep.add("rope", "error", f"drafter partial_rotary_factor={prf}",
                "DFlash drafters rotate the whole head_dim; remove the field if it was copied from the target "
                "(speculators #613)")
    tparams = tcfg.get("rope_parameters") if isinstance(tcfg.get("rope_parameters"), dict) else {}
    ttheta = tcfg.get("rope_theta", tparams.get("rope_theta"))
    if theta is not None:
        rep.add("rope", "info", f"drafter rope_theta {theta:g}" + (f", target {ttheta:g}" if isinstance(ttheta, (int, float)) else "")
                + " (the drafter uses its own)")


def _check_embedding_scale(rep: DoctorReport, model_type: str, tcfg: dict, hidden: int, scale: float) -> None:
    scaled = model_type in _SCALED_EMBEDDING_TYPES or str(tcfg.get("model_type", "")) in _SCALED_EMBEDDING_TYPES
    want = math.sqrt(hidden)
    if scaled:
        if abs(scale - want) <= 1e-3 * want:
            rep.add("embedding scale", "info", f"the target scales embeddings by sqrt({hidden}) = {want:.4g} and the "
                    f"drafter's input_embedding_scale matches")
        else:
            rep.add("embedding scale", "warning",
                    f"the target ({model_type}) multiplies token embeddings by sqrt(hidden) = {want:.4g} inside the "
                    f"model, but the drafter's block embedding is the raw row times input_embedding_scale={scale:g}",
                    f"if the drafter was trained on scaled embeddings, set dflash_config.input_embedding_scale to "
                    f"{want:.6g}")
    elif scale != 1.0:
        rep.add("embedding scale", "info", f"the drafter scales block embeddings by {scale:g}")


def _find_completions(store, key: str):
    """The completions manifest at or upstream of ``key``: a completions segment, or the first
    segment holding completions that a report, an eval, tokens or hidden states were made from
    (followed sample by sample, dfcache.maintenance.upstream_chain)."""
    from dfcache.maintenance import upstream_chain
    from dfcache.samples import index_of

    m = store.manifest(store.resolve(key))
    if m.stage == "completions":
        return m
    for c in upstream_chain(store, m):
        if c["stage"] != "completions":
            continue
        if c.get("kind") == "samples" and c["segments"]:
            return index_of(store).segments(c["key"])[c["segments"][0]]
        if c.get("kind") != "samples" and c["present"]:
            return store.manifest(c["key"])
    return None


def _check_completions(rep: DoctorReport, store, key: str, tdir: Path) -> None:
    name = "chat template / thinking"
    if store is None:
        raise BadInputError("--completions-from needs a store")
    m = _find_completions(store, key)
    if m is None:
        rep.add(name, "error", f"no completions artifact at or upstream of {key}",
                "pass the key of a report, or of a completions, tokens, hidden_states or drafter_eval artifact "
                "(see dfcache ls)")
        return
    try:
        tmpl = chat_template_text(tdir)
        th = chat_template_hash(tdir)
    except BadInputError as e:
        rep.add(name, "error", str(e))
        return
    if m.inputs.get("chat_template") != th:
        rep.add(name, "error", f"completions {m.key[:12]} were made with another chat template than this target's",
                "regenerate them with this target (dfcache run completions ...) or pass the target they came from")
    else:
        rep.add(name, "info", f"completions {m.key[:12]} used this target's chat template")
    thinking = bool(m.inputs.get("enable_thinking"))
    mentions = "enable_thinking" in tmpl
    if thinking and not mentions:
        rep.add(name, "warning", "the completions were requested with enable_thinking=true, but the target's "
                "template ignores enable_thinking", "check the served model's template")
    texts = []
    try:
        if m.samples:  # a segment of per-sample completions
            from dfcache.samples import Segment

            seg = Segment(store, m.key)
            texts = [str(seg.doc(i).get("text") or "") for i in range(min(len(seg.keys), 64))]
        else:
            art = store.open(m.key)
            for i in range(min(int(art.json("index").get("n", 0)), 64)):
                texts.append(str(art.json(f"c{i}").get("text") or ""))
    except Exception:  # other layouts: the texts are only a hint here
        texts = []
    with_think = sum(1 for t in texts if _has_thoughts(t))
    if not thinking and with_think:
        rep.add(name, "warning", f"enable_thinking=false but {with_think} of {len(texts)} completions hold "
                "<think> content", "check the server's reasoning settings; τ with and without thinking differ a lot "
                "(z-lab/dflash #133)")
    rep.add("thinking mode", "info",
            f"completions {m.key[:12]}: enable_thinking={str(thinking).lower()} ({m.inputs.get('endpoint')}); "
            "a drafter trained without thinking traces (Qwen3-4B/8B DFlash) accepts far less on thinking output",
            "evaluate with the thinking mode the drafter was trained for (--enable-thinking/--no-enable-thinking)")


def _has_thoughts(text: str) -> bool:
    if "<think>" not in text:
        return False
    inner = text.split("<think>", 1)[1].split("</think>", 1)[0]
    return bool(inner.strip())


def format_report(rep: DoctorReport) -> str:
    marks = {"error": "ERROR", "warning": "WARN ", "info": "ok   "}
    lines = [f"doctor: target {rep.target}, drafter {rep.drafter}"]
    order = {s: i for i, s in enumerate(SEVERITIES)}
    for f in sorted(rep.findings, key=lambda f: order[f.severity]):
        lines.append(f"{marks[f.severity]} {f.check}: {f.found}")
        if f.fix and f.severity != "info":
            lines.append(f"      fix: {f.fix}")
    lines.append(f"{rep.count('error')} error(s), {rep.count('warning')} warning(s)")
    return "\n".join(lines)
